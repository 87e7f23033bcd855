"""Config contradictions, caught at start with a message naming the fields."""

from __future__ import annotations

MIXED_PRECISION = ("no", "fp16", "bf16")
WANDB_MODES = ("online", "offline", "disabled")
LOG_PROB_REDUCTIONS = ("mean", "sum")


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the fields and what is allowed."""


def validate_config(config, num_processes: int = 1) -> None:
    """Raise ConfigError listing every contradiction found in ``config``."""
    errors = []

    def need(condition: bool, message: str) -> None:
        if not condition:
            errors.append(message)

    s, t = config.sample, config.train
    need(s.num_steps >= 1, f"sample.num_steps={s.num_steps} must be >= 1")
    need(
        s.eta > 0,
        f"sample.eta={s.eta} must be > 0: with eta = 0 the DDIM step is deterministic and has no log-probability",
    )
    need(s.guidance_scale >= 0, f"sample.guidance_scale={s.guidance_scale} must be >= 0")
    need(s.batch_size >= 1, f"sample.batch_size={s.batch_size} must be >= 1")
    need(s.num_batches_per_epoch >= 1, f"sample.num_batches_per_epoch={s.num_batches_per_epoch} must be >= 1")
    need(
        s.log_prob_reduce in LOG_PROB_REDUCTIONS,
        f"sample.log_prob_reduce={s.log_prob_reduce!r} must be one of {LOG_PROB_REDUCTIONS}",
    )
    need(
        0 < t.timestep_fraction <= 1,
        f"train.timestep_fraction={t.timestep_fraction} must be in (0, 1]",
    )
    need(
        int(s.num_steps * t.timestep_fraction) >= 1,
        f"train.timestep_fraction={t.timestep_fraction} with sample.num_steps={s.num_steps} trains no step",
    )
    need(t.batch_size >= 1, f"train.batch_size={t.batch_size} must be >= 1")
    need(t.gradient_accumulation_steps >= 1, f"train.gradient_accumulation_steps={t.gradient_accumulation_steps} must be >= 1")
    need(t.num_inner_epochs >= 1, f"train.num_inner_epochs={t.num_inner_epochs} must be >= 1")
    need(t.learning_rate > 0, f"train.learning_rate={t.learning_rate} must be > 0")
    need(t.clip_range > 0, f"train.clip_range={t.clip_range} must be > 0")
    need(t.adv_clip_max > 0, f"train.adv_clip_max={t.adv_clip_max} must be > 0")
    need(t.pairs_per_forward >= 1, f"train.pairs_per_forward={t.pairs_per_forward} must be >= 1")

    samples_per_process = s.batch_size * s.num_batches_per_epoch
    if t.batch_size >= 1 and samples_per_process % t.batch_size != 0:
        errors.append(
            f"train.batch_size={t.batch_size} must divide the samples per process per epoch, "
            f"sample.batch_size * sample.num_batches_per_epoch = {s.batch_size} * {s.num_batches_per_epoch} "
            f"= {samples_per_process}"
        )
    elif t.batch_size >= 1 and t.gradient_accumulation_steps >= 1:
        train_batches = samples_per_process // t.batch_size
        if train_batches % t.gradient_accumulation_steps != 0:
            errors.append(
                f"train.gradient_accumulation_steps={t.gradient_accumulation_steps} must divide the train batches "
                f"per epoch, {samples_per_process} / train.batch_size={t.batch_size} = {train_batches}"
            )

    need(t.group_size >= 1, f"train.group_size={t.group_size} must be >= 1")
    samples_per_epoch = samples_per_process * num_processes
    if t.group_size >= 1 and samples_per_epoch % t.group_size != 0:
        errors.append(
            f"train.group_size={t.group_size} must divide the samples per epoch, num_processes * "
            f"sample.batch_size * sample.num_batches_per_epoch = {num_processes} * {s.batch_size} * "
            f"{s.num_batches_per_epoch} = {samples_per_epoch}"
        )

    guided = s.guidance_scale > 1.0
    if bool(t.cfg) != guided:
        errors.append(
            f"train.cfg={t.cfg} contradicts sample.guidance_scale={s.guidance_scale}: the training forward must "
            "use guidance exactly when sampling did (guidance_scale > 1), or the recomputed log-probs are off-policy"
        )

    need(config.mixed_precision in MIXED_PRECISION, f"mixed_precision={config.mixed_precision!r} must be one of {MIXED_PRECISION}")
    need(config.wandb.mode in WANDB_MODES, f"wandb.mode={config.wandb.mode!r} must be one of {WANDB_MODES}")
    need(config.num_epochs >= 1, f"num_epochs={config.num_epochs} must be >= 1")
    need(config.save_freq >= 0, f"save_freq={config.save_freq} must be >= 0")
    need(config.num_checkpoint_limit >= 1, f"num_checkpoint_limit={config.num_checkpoint_limit} must be >= 1")
    need(not config.use_lora or config.lora_rank >= 1, f"lora_rank={config.lora_rank} must be >= 1 with use_lora")
    tracking = config.get("per_prompt_stat_tracking")
    if tracking:
        need(tracking.buffer_size >= 1, f"per_prompt_stat_tracking.buffer_size={tracking.buffer_size} must be >= 1")
        need(tracking.min_count >= 1, f"per_prompt_stat_tracking.min_count={tracking.min_count} must be >= 1")
    need(num_processes >= 1, f"num_processes={num_processes} must be >= 1")

    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))
