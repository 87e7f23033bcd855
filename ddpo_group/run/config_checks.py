"""Config contradictions, caught at start with a message naming the fields."""

from __future__ import annotations

MIXED_PRECISION = ("no", "fp16", "bf16")
WANDB_MODES = ("online", "offline", "disabled")
LOG_PROB_REDUCTIONS = ("mean", "sum")


STEP_LEVEL_ESTIMATORS = ("gae", "reinforce_plus_plus", "remax", "group_ppo")  # accept per-step rewards (KL in reward)
STD_SCALED_ESTIMATORS = ("grpo", "grpo_passk", "group_ppo")  # where train.scale_rewards is a choice
UNSCALED_ESTIMATORS = ("dr_grpo", "rloo")  # never divide by the group std
KL_TYPES = ("gaussian", "k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
KL_CONTROLLERS = ("fixed", "adaptive")
GAE_START_VALUES = ("critic", "group_mean")


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
    start, size = s.get("sde_window_start", 0), s.get("sde_window_size", 0)
    need(
        size >= 0 and start >= 0 and (size == 0 or start + size <= s.num_steps),
        f"sample.sde_window_start={start}, sample.sde_window_size={size}: the window [start, start + size) must lie "
        f"in the {s.num_steps} sampling steps (size 0: every step stochastic)",
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
    errors.extend(algorithm_errors(config))

    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))


def algorithm_errors(config) -> list[str]:
    """Contradictions of the RL algorithm's fields (estimator, loss, KL, reference, GROUP_PPO, critic)."""
    from ddpo_group.algorithms import (
        ADV_ESTIMATOR_REGISTRY, GROUP_ESTIMATORS, POLICY_LOSS_REGISTRY, canonical_agg_mode,
    )

    errors = []

    def need(condition: bool, message: str) -> None:
        if not condition:
            errors.append(message)

    a, t = config.algorithm, config.train
    estimator = a.adv_estimator
    need(estimator in ADV_ESTIMATOR_REGISTRY,
         f"algorithm.adv_estimator={estimator!r} is unknown; registered: {ADV_ESTIMATOR_REGISTRY.names()}")
    need(a.policy_loss in POLICY_LOSS_REGISTRY,
         f"algorithm.policy_loss={a.policy_loss!r} is unknown; registered: {POLICY_LOSS_REGISTRY.names()}")
    try:
        canonical_agg_mode(a.loss_agg_mode)
    except ValueError as error:
        errors.append(f"algorithm.loss_agg_mode: {error}")
    if estimator in GROUP_ESTIMATORS and t.group_size < 2:
        errors.append(
            f"algorithm.adv_estimator={estimator!r} compares the samples of a prompt group and needs "
            f"train.group_size >= 2 samples per prompt per epoch, got train.group_size={t.group_size}"
        )
    if estimator in UNSCALED_ESTIMATORS and t.scale_rewards:
        errors.append(
            f"train.scale_rewards=True contradicts algorithm.adv_estimator={estimator!r}, which never divides by "
            f"the group std (set train.scale_rewards=False, or use grpo)"
        )
    epsilon = t.get("epsilon", t.clip_range)
    need(epsilon > 0, f"train.epsilon={epsilon} (the clip range) must be > 0")
    need(a.clip_ratio_c is None or a.clip_ratio_c > 1, f"algorithm.clip_ratio_c={a.clip_ratio_c} must be > 1 (or None)")

    # ---- KL and reference ----
    need(t.beta >= 0, f"train.beta={t.beta} must be >= 0")
    need(a.kl_type in KL_TYPES, f"algorithm.kl_type={a.kl_type!r} must be one of {KL_TYPES}")
    need(a.kl_controller in KL_CONTROLLERS, f"algorithm.kl_controller={a.kl_controller!r} must be one of {KL_CONTROLLERS}")
    if a.kl_controller == "adaptive":
        need(a.target_kl > 0, f"algorithm.target_kl={a.target_kl} must be > 0 with algorithm.kl_controller='adaptive'")
        need(a.kl_horizon > 0, f"algorithm.kl_horizon={a.kl_horizon} must be > 0 with algorithm.kl_controller='adaptive'")
        need(t.beta > 0, f"algorithm.kl_controller='adaptive' needs an initial train.beta > 0, got {t.beta}")
    if t.beta > 0 or a.kl_controller == "adaptive":
        need(t.use_reference_model,
             f"train.beta={t.beta} asks for a KL term but train.use_reference_model=False: set "
             "train.use_reference_model=True (or train.beta=0)")
    if a.kl_in_reward:
        need(estimator in STEP_LEVEL_ESTIMATORS,
             f"algorithm.kl_in_reward=True needs a step-level estimator {STEP_LEVEL_ESTIMATORS}, got "
             f"algorithm.adv_estimator={estimator!r} (use the KL loss, train.beta, instead)")
        need(t.beta > 0, f"algorithm.kl_in_reward=True needs train.beta > 0, got {t.beta}")
    alpha = t.reference_model_mixup_alpha
    need(0 <= alpha <= 1, f"train.reference_model_mixup_alpha={alpha} must be in [0, 1]")
    need(t.reference_update_freq >= 0, f"train.reference_update_freq={t.reference_update_freq} must be >= 0 (0: never)")
    if t.reference_update_freq > 0:
        need(t.use_reference_model,
             f"train.reference_update_freq={t.reference_update_freq} updates a reference model, but "
             "train.use_reference_model=False")

    # ---- estimators' own parameters ----
    need(0 < a.gamma <= 1, f"algorithm.gamma={a.gamma} must be in (0, 1]")
    need(0 <= a.gae_lambda <= 1, f"algorithm.gae_lambda={a.gae_lambda} must be in [0, 1]")
    need(a.gae_start_value in GAE_START_VALUES, f"algorithm.gae_start_value={a.gae_start_value!r} must be one of {GAE_START_VALUES}")
    if a.filter_groups:
        need(estimator in GROUP_ESTIMATORS,
             f"algorithm.filter_groups=True drops prompt groups whose rewards are all equal and needs a group "
             f"estimator {GROUP_ESTIMATORS}, got algorithm.adv_estimator={estimator!r}")
        need(a.max_num_gen_batches >= 1, f"algorithm.max_num_gen_batches={a.max_num_gen_batches} must be >= 1")

    g = config.group_params
    need(g.group_max_size >= 1, f"group_params.group_max_size={g.group_max_size} must be >= 1")
    need(g.group_epsilon > 0, f"group_params.group_epsilon={g.group_epsilon} must be > 0")
    need(0 < g.min_threshold <= g.max_threshold,
         f"need 0 < group_params.min_threshold <= group_params.max_threshold, got {g.min_threshold}, {g.max_threshold}")
    need(g.group_variance_threshold >= 0, f"group_params.group_variance_threshold={g.group_variance_threshold} must be >= 0")
    need(g.threshold_lr >= 0, f"group_params.threshold_lr={g.threshold_lr} must be >= 0")
    need(0 <= g.lam <= 1, f"group_params.lam={g.lam} must be in [0, 1]")
    need(g.target_explained_variance > 0,
         f"group_params.target_explained_variance={g.target_explained_variance} must be > 0")

    c = config.critic
    need(c.learning_rate > 0, f"critic.learning_rate={c.learning_rate} must be > 0")
    need(c.hidden_dim >= 1, f"critic.hidden_dim={c.hidden_dim} must be >= 1")
    need(c.num_updates >= 1, f"critic.num_updates={c.num_updates} must be >= 1")
    need(c.cliprange_value is None or c.cliprange_value > 0, f"critic.cliprange_value={c.cliprange_value} must be > 0 (or None)")
    return errors
