"""Config contradictions, caught at start with a message naming the fields.

The general fields are checked here; each registered piece checks its own: the model family (its sampling
fields: DDIM's eta, the flow SDE, guidance in the training forward), the advantage estimator (its registration's
``check``), the KL term (reference/regularizer.py), the critic (update/critic.py).
"""

from __future__ import annotations

import math

from ddpo_group.errors import ConfigError
from ddpo_group.models.speed_options import attention_backends, compile_mode
from ddpo_group.models.trainable import DTYPES
from ddpo_group.run.guard import ON_ALARM
from ddpo_group.sampling.gaussian import LOG_PROB_DTYPES, REDUCTIONS
from ddpo_group.sampling.window import stochastic_steps
from ddpo_group.update.memory_fit import configured_pairs

WANDB_MODES = ("online", "offline", "disabled")

__all__ = ["ConfigError", "validate_config", "algorithm_errors", "config_warnings"]


def validate_config(config, num_processes: int = 1, groupwise_reward: bool = False) -> None:
    """Raise ConfigError listing every contradiction found in ``config``. ``groupwise_reward``: the built reward
    function is groupwise (rewards/base.py's ``is_groupwise``: known once its factory ran)."""
    errors = sampling_and_training_errors(config, num_processes, groupwise_reward) + run_errors(config, num_processes)
    errors.extend(groupwise_reward_errors(config) if groupwise_reward else [])
    errors.extend(evaluation_and_ema_errors(config))
    errors.extend(family_errors(config))
    errors.extend(algorithm_errors(config))
    errors.extend(prompt_and_reward_errors(config))
    errors.extend(tree_errors(config))
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))


def config_warnings(config) -> list[str]:
    """Settings that run but are likely not what was meant: the embedded flow model on the embedded SD model's task;
    tree rollouts with an estimator that compares no prompt group; a reference model nothing runs."""
    from ddpo_group.models import TINY_SHAPES_FLOW

    warnings = []
    if config.pretrained.model == TINY_SHAPES_FLOW and config.prompt_fn == "tiny_shapes_hard":
        warnings.append(
            f"pretrained.model={TINY_SHAPES_FLOW!r} with prompt_fn='tiny_shapes_hard', the SD model's hardest captions: "
            f"the flow model already draws them right, so there is little to learn; its own task is "
            f"--config config/base.py:grpo_flow (or any preset with --config.prompt_fn=tiny_shapes_flow_hard "
            f"--config.train.learning_rate=1.5e-3; train.learning_rate={config.train.learning_rate:g} may "
            f"collapse its LoRA above 1.5e-3)")
    estimator = config.algorithm.adv_estimator
    spec = _estimator(estimator)
    if config.sample.branch_steps and estimator != "ddpo" and spec is not None and not spec.needs_groups:
        warnings.append(
            f"sample.branch_steps={tuple(config.sample.branch_steps)} with algorithm.adv_estimator={estimator!r}: a "
            f"tree's leaves are correlated copies of a prompt, and {estimator} compares no prompt group (its baseline "
            f"treats them as independent samples); grpo, rloo, dr_grpo, grpo_passk, group_ppo or ddpo compare them")
    kl = config.kl
    if kl.use_reference_model and kl.beta == 0 and not _is_preference(config):
        warnings.append(
            f"kl.use_reference_model=True with kl.beta=0 and algorithm.objective={config.algorithm.objective!r}: the "
            f"reference model is held but never runs (with full fine-tuning a float32 copy of the denoiser on the "
            f"device); kl.use_reference_model=False drops it, or set kl.beta > 0 for a KL term")
    return warnings


def _estimator(name: str):
    """The estimator's registration, None for a name that does not resolve (algorithm_errors names it)."""
    from ddpo_group.algorithms import get_adv_estimator

    try:
        return get_adv_estimator(name)
    except (ValueError, TypeError, ImportError, OSError, AttributeError):
        return None


def tree_errors(config) -> list[str]:
    """Tree rollouts (sample.branch_steps / branch_factors, or GROUP_PPO's default tree) that cannot be sampled as
    configured."""
    from ddpo_group.sampling.tree import tree_branches

    sample, train = config.sample, config.train
    steps, factors = tuple(sample.branch_steps), tuple(sample.branch_factors)
    spec = _estimator(config.algorithm.adv_estimator)
    reads_tree = spec is not None and spec.reads(config, "tree_nodes")
    if not steps and not factors and not reads_tree:
        return ["sample.adaptive_branching=True without tree rollouts (sample.branch_steps)"] if sample.adaptive_branching \
            else []
    errors = []
    need = _collector(errors)
    need(len(steps) == len(factors), f"sample.branch_steps={steps} and sample.branch_factors={factors} must have one "
                                     f"factor per branch step")
    if not steps and len(steps) == len(factors):  # an estimator that reads the tree: the default tree
        branches = tree_branches(config, reads_tree)
        steps, factors = tuple(branches), tuple(branches.values())
        need(bool(steps), f"algorithm.adv_estimator={config.algorithm.adv_estimator!r} reads tree rollouts: "
                          f"train.group_size={train.group_size} and the SDE window allow no tree (sample.branch_steps "
                          f"sets one)")
    stochastic = stochastic_steps(sample).nonzero().flatten().tolist()
    need(list(steps) == sorted(set(steps)) and set(steps) <= set(stochastic),
         f"sample.branch_steps={steps} must be ascending stochastic steps, of {stochastic} (the SDE window: a branch "
         f"at a deterministic step gives equal children)")
    need(all(int(f) >= 2 for f in factors), f"sample.branch_factors={factors}: each branch has at least 2 children")
    need(not sample.deterministic, "sample.deterministic=True draws no step noise: a tree (sample.branch_steps) needs "
                              "stochastic steps")
    need(not sample.adaptive_branching or len(steps) >= 2,
         f"sample.adaptive_branching moves the branch steps after the first: it needs 2 or more, not {steps}")
    need(not config.algorithm.filter_groups, "sample.branch_steps with algorithm.filter_groups (dynamic sampling) is "
                                             "not supported: sample flat or drop filter_groups")
    leaves = math.prod(int(f) for f in factors) if all(int(f) >= 1 for f in factors) else 1
    need(train.group_size % leaves == 0 and sample.batch_size % leaves == 0,
         f"a tree of sample.branch_factors={factors} has {leaves} leaves, which must divide train.group_size="
         f"{train.group_size} (a prompt group is whole trees) and sample.batch_size={sample.batch_size} (a sampling batch "
         f"holds whole trees)")
    need((sample.batch_size * sample.num_batches_per_epoch) % train.group_size == 0,
         f"sample.branch_steps: each process samples whole prompt groups, so train.group_size={train.group_size} must "
         f"divide sample.batch_size * sample.num_batches_per_epoch = {sample.batch_size * sample.num_batches_per_epoch}")
    return errors


def _collector(errors: list):
    def need(condition: bool, message: str) -> None:
        if not condition:
            errors.append(message)
    return need


def sampling_and_training_errors(config, num_processes: int, groupwise_reward: bool = False) -> list[str]:
    """Contradictions of the sample.* and train.* fields (steps, batch sizes, group size, guidance)."""
    errors = []
    need = _collector(errors)
    sample, train = config.sample, config.train
    need(sample.num_steps >= 1, f"sample.num_steps={sample.num_steps} must be >= 1")
    start, size = sample.sde_window_start, sample.sde_window_size
    need(
        size >= 0 and start >= 0 and (size == 0 or start + size <= sample.num_steps),
        f"sample.sde_window_start={start}, sample.sde_window_size={size}: the window [start, start + size) must lie "
        f"in the {sample.num_steps} sampling steps (size 0: every step stochastic)",
    )
    need(sample.guidance_scale >= 0, f"sample.guidance_scale={sample.guidance_scale} must be >= 0")
    for field in ("text_embedding_cache", "decode_batch_size", "eval_num_steps"):
        need(sample[field] >= 0, f"sample.{field}={sample[field]} must be >= 0 (0: off / the default)")
    need(sample.batch_size >= 1, f"sample.batch_size={sample.batch_size} must be >= 1")
    need(sample.num_batches_per_epoch >= 1, f"sample.num_batches_per_epoch={sample.num_batches_per_epoch} must be >= 1")
    need(
        sample.log_prob_reduce in REDUCTIONS,
        f"sample.log_prob_reduce={sample.log_prob_reduce!r} must be one of {REDUCTIONS}",
    )
    need(sample.log_prob_dtype in LOG_PROB_DTYPES,
         f"sample.log_prob_dtype={sample.log_prob_dtype!r} must be one of {list(LOG_PROB_DTYPES)}")
    from ddpo_group.rollout.sampler import SAMPLING_PRECISIONS

    need(sample.precision in SAMPLING_PRECISIONS,
         f"sample.precision={sample.precision!r} must be one of {list(SAMPLING_PRECISIONS)} ('': the run's mixed_precision)")
    need(
        0 < train.step_fraction <= 1,
        f"train.step_fraction={train.step_fraction} must be in (0, 1]",
    )
    need(
        int(sample.num_steps * train.step_fraction) >= 1,
        f"train.step_fraction={train.step_fraction} with sample.num_steps={sample.num_steps} trains no step",
    )
    need(train.batch_size >= 1, f"train.batch_size={train.batch_size} must be >= 1")
    need(train.gradient_accumulation_steps >= 1, f"train.gradient_accumulation_steps={train.gradient_accumulation_steps} must be >= 1")
    need(train.num_inner_epochs >= 1, f"train.num_inner_epochs={train.num_inner_epochs} must be >= 1")
    need(train.learning_rate > 0, f"train.learning_rate={train.learning_rate} must be > 0")
    need(train.clip_range > 0, f"train.clip_range={train.clip_range} must be > 0")
    need(train.adv_clip_max > 0, f"train.adv_clip_max={train.adv_clip_max} must be > 0")
    try:
        configured_pairs(train.pairs_per_forward)
    except ValueError as error:
        errors.append(str(error))
    need(config.device in ("", "cpu", "cuda"), f"device={config.device!r} must be '', 'cpu' or 'cuda'")

    samples_per_process = sample.batch_size * sample.num_batches_per_epoch
    if train.batch_size >= 1 and samples_per_process % train.batch_size != 0:
        errors.append(
            f"train.batch_size={train.batch_size} must divide the samples per process per epoch, "
            f"sample.batch_size * sample.num_batches_per_epoch = {sample.batch_size} * {sample.num_batches_per_epoch} "
            f"= {samples_per_process}"
        )
    elif train.batch_size >= 1 and train.gradient_accumulation_steps >= 1:
        train_batches = samples_per_process // train.batch_size
        if train_batches % train.gradient_accumulation_steps != 0:
            errors.append(
                f"train.gradient_accumulation_steps={train.gradient_accumulation_steps} must divide the train batches "
                f"per epoch, {samples_per_process} / train.batch_size={train.batch_size} = {train_batches}"
            )

    need(train.group_size >= 1, f"train.group_size={train.group_size} must be >= 1")
    samples_per_epoch = samples_per_process * num_processes
    if train.group_size >= 1 and samples_per_epoch % train.group_size != 0:
        errors.append(
            f"train.group_size={train.group_size} must divide the samples per epoch, num_processes * "
            f"sample.batch_size * sample.num_batches_per_epoch = {num_processes} * {sample.batch_size} * "
            f"{sample.num_batches_per_epoch} = {samples_per_epoch}"
        )
    if num_processes > 1 and train.group_size >= 1 and samples_per_process % train.group_size != 0:
        wholes = ([f"algorithm.objective={config.algorithm.objective!r}"] if _is_preference(config) else []) + (
            [f"the groupwise reward_fn={_as_plain(config.reward_fn)!r}"] if groupwise_reward else [])
        errors.extend(
            f"{what} needs whole prompt groups on each of the {num_processes} processes: train.group_size="
            f"{train.group_size} must divide the samples per process, sample.batch_size * sample.num_batches_per_epoch = "
            f"{sample.batch_size} * {sample.num_batches_per_epoch} = {samples_per_process}"
            for what in wholes)

    return errors


def groupwise_reward_errors(config) -> list[str]:
    """A groupwise reward scores whole prompt groups: the estimators that score single samples outside a group refuse
    it (ReMax's greedy baseline: one sample per group; GROUP_PPO's Tweedie values: one-step predictions)."""
    spec = _estimator(config.algorithm.adv_estimator)
    if spec is None:
        return []
    head = (f"reward_fn={_as_plain(config.reward_fn)!r} is groupwise (it scores a prompt group's images together) "
            f"and algorithm.adv_estimator={config.algorithm.adv_estimator!r}")
    errors = []
    if spec.needs_greedy_rewards:
        errors.append(f"{head} scores one greedy sample per group, which has no group to be scored in: use a group "
                      "estimator (grpo, rloo, dr_grpo, group_ppo, ...) or a pointwise reward")
    if spec.reads(config, "tweedie_values"):
        errors.append(f"{head} with group_ppo.value_source={config.group_ppo.value_source!r} scores each step's "
                      "one-step prediction alone: set group_ppo.value_source to 'critic', 'residual_critic' or "
                      "'tree', or use a pointwise reward")
    return errors


def _as_plain(value):
    return value.to_dict() if hasattr(value, "to_dict") else value


def _is_preference(config) -> bool:
    """Whether algorithm.objective names a preference objective (an unknown one: objective_errors names it)."""
    from ddpo_group.algorithms import OBJECTIVE_REGISTRY, get_objective
    from ddpo_group.algorithms.objectives import PREFERENCE

    objective = _resolve("algorithm.objective", config.algorithm.objective, get_objective, OBJECTIVE_REGISTRY, [])
    return objective is not None and objective.kind == PREFERENCE


def run_errors(config, num_processes: int) -> list[str]:
    """Contradictions of the run's fields (precision, logging, epochs, checkpoints, LoRA, stat tracker)."""
    errors = []
    need = _collector(errors)
    need(config.mixed_precision in tuple(DTYPES), f"mixed_precision={config.mixed_precision!r} must be one of {tuple(DTYPES)}")
    for check in (lambda: compile_mode(config.compile_denoiser),
                  lambda: attention_backends(config.attention_backend, "cuda")):  # the device's own check: trainer
        try:
            check()
        except ConfigError as error:
            errors.append(str(error))
    need(config.wandb.mode in WANDB_MODES, f"wandb.mode={config.wandb.mode!r} must be one of {WANDB_MODES}")
    threads = config.num_cpu_threads
    need(isinstance(threads, int) and threads >= 0,
         f"num_cpu_threads={threads!r} must be an integer >= 0 (0: chosen from the cores and the launcher)")
    timeout = config.collective_timeout_s
    need(isinstance(timeout, (int, float)) and timeout > 0,
         f"collective_timeout_s={timeout!r} must be a number of seconds > 0 (how long a process waits for the others)")
    need(config.num_epochs >= 1, f"num_epochs={config.num_epochs} must be >= 1")
    sft = config.sft
    need(isinstance(sft.epochs, int) and not isinstance(sft.epochs, bool) and 0 <= sft.epochs <= config.num_epochs,
         f"sft.epochs={sft.epochs!r} must be an integer from 0 to num_epochs={config.num_epochs} (the run's first epochs "
         "that fine-tune on sft.data_dir's images)")
    need(not (isinstance(sft.epochs, int) and sft.epochs > 0) or bool(sft.data_dir),
         f"sft.epochs={sft.epochs} needs sft.data_dir: the folder of images and prompts to fine-tune on")
    need(not sft.data_dir or (isinstance(sft.epochs, int) and sft.epochs > 0),
         f"sft.data_dir={sft.data_dir!r} is read only in the first sft.epochs epochs: set sft.epochs >= 1 (0 now)")
    if sft.data_dir and isinstance(sft.epochs, int) and sft.epochs > 0:
        from ddpo_group.rollout.image_folder import read_folder

        try:
            read_folder(sft.data_dir)
        except ConfigError as error:
            errors.append(str(error))
    need(config.save_freq >= 0, f"save_freq={config.save_freq} must be >= 0")
    need(config.num_checkpoint_limit >= 1, f"num_checkpoint_limit={config.num_checkpoint_limit} must be >= 1")
    need(not config.use_lora or config.lora_rank >= 1, f"lora_rank={config.lora_rank} must be >= 1 with use_lora")
    need(isinstance(config.lora_dropout, (int, float)) and 0 <= config.lora_dropout < 1,
         f"lora_dropout={config.lora_dropout!r} must be a number in [0, 1) (peft's dropout of the adapter's input)")
    tracking = config.per_prompt_stat_tracking
    if tracking:
        need(tracking.buffer_size >= 1, f"per_prompt_stat_tracking.buffer_size={tracking.buffer_size} must be >= 1")
        need(tracking.min_count >= 1, f"per_prompt_stat_tracking.min_count={tracking.min_count} must be >= 1")
    need(num_processes >= 1, f"num_processes={num_processes} must be >= 1")
    return errors


def evaluation_and_ema_errors(config) -> list[str]:
    """The evaluation during training (eval_*) and the EMA of the weights (train.ema*)."""
    from pathlib import Path

    errors = []
    need = _collector(errors)

    def count(name: str, value, low: int) -> None:
        need(isinstance(value, int) and not isinstance(value, bool) and value >= low,
             f"{name}={value!r} must be an integer >= {low}")

    count("eval_freq", config.eval_freq, 0)
    if config.eval_freq:
        count("eval_num_prompts", config.eval_num_prompts, 1)
        count("eval_num_seeds", config.eval_num_seeds, 1)
        path = config.eval_prompt_file
        need(not path or Path(path).expanduser().is_file(),
             f"eval_prompt_file={path!r} does not exist; give a text file with one prompt per line, or '' to draw "
             "eval_num_prompts prompts from prompt_fn")
        need(isinstance(config.eval_group_by, str),
             f"eval_group_by={config.eval_group_by!r} must be a prompt metadata key (a string), or '' (per prompt)")
    else:
        need(not config.eval_reward_fn, f"eval_reward_fn={config.eval_reward_fn!r} is scored by the evaluation during "
                                        "training, which eval_freq=0 turns off: set eval_freq > 0")
    guard = config.guard
    need(guard.on_alarm in ON_ALARM, f"guard.on_alarm={guard.on_alarm!r} must be one of {ON_ALARM}")
    need(isinstance(guard.heldout_drop, (int, float)) and guard.heldout_drop >= 0,
         f"guard.heldout_drop={guard.heldout_drop!r} must be >= 0 (standard errors of the evaluation)")
    need(isinstance(guard.min_diversity, (int, float)) and 0 <= guard.min_diversity <= 1,
         f"guard.min_diversity={guard.min_diversity!r} must be in [0, 1] (a fraction of the diversity before training)")
    need(isinstance(guard.max_drift, (int, float)) and guard.max_drift > 0,
         f"guard.max_drift={guard.max_drift!r} must be > 0 (times a statistic's spread over the images before "
         "training)")
    need(isinstance(guard.fall_drop, (int, float)) and guard.fall_drop >= 0,
         f"guard.fall_drop={guard.fall_drop!r} must be >= 0 (standard errors of the evaluation)")
    train = config.train
    decay, interval = train.ema_decay, train.ema_update_interval
    if train.ema:
        need(isinstance(decay, (int, float)) and 0 <= decay < 1,
             f"train.ema_decay={decay!r} must be in [0, 1) (Flow-GRPO: 0.9)")
        count("train.ema_update_interval", interval, 1)
    need(not train.ema_export or train.ema,
         "train.ema_export=True exports the EMA weights and needs train.ema=True")
    return errors


def family_errors(config) -> list[str]:
    """The model family's contradictions (the family is read from the model's model_index.json before the model loads;
    a model that cannot be found is reported by the load itself, after the cheaper checks of prompts and rewards)."""
    from ddpo_group.models.families import FAMILY_REGISTRY, family_name, get_family

    chosen = config.pretrained.family
    if chosen and chosen not in FAMILY_REGISTRY:
        return [f"pretrained.family={chosen!r} must be one of {FAMILY_REGISTRY.names()} (or '': from the model)"]
    try:
        name = family_name(config.pretrained.model, chosen)
    except (OSError, ValueError, KeyError):
        return []
    family = get_family(name)
    unknown = sorted(set(config.sample.pipeline_guidance) - set(family.guidance_passes))
    errors = [f"sample.pipeline_guidance sets {unknown}: the {name} family's call takes "
              f"{list(family.guidance_passes) or 'none of its own'}"] if unknown else []
    if config.sample.audio and not family.optional_audio:
        errors.append(f"sample.audio=True: the {name} family has no optional soundtrack (Cosmos 3's; LTX-2 and "
                      "Kandinsky 6 always sample theirs)")
    return errors + family.config_errors(config)


def prompt_and_reward_errors(config) -> list[str]:
    """Keywords the chosen prompt function or reward factory does not take (config.prompt_fn_kwargs holds the
    overrides of the chosen prompt function's registration defaults only: another function's keywords never carry
    over, prompts.py). A name that does not resolve is left to the prompt sampler and the reward builder, which name
    it with the registered ones."""
    from ddpo_group.prompts import get_prompt_spec
    from ddpo_group.registry import keyword_errors
    from ddpo_group.rewards import REWARD_REGISTRY
    from ddpo_group.rewards.combine import parse_reward_spec, split_kwargs

    errors = []
    try:
        spec = get_prompt_spec(config.prompt_fn)
    except (ValueError, TypeError, ImportError, OSError, AttributeError):
        spec = None
    if spec is not None:
        errors.extend(spec.kwargs_errors(_as_dict(config.prompt_fn_kwargs)))
    try:
        components = parse_reward_spec(config.reward_fn)
    except ValueError:
        return errors
    kwargs = _as_dict(config.reward_fn_kwargs)
    try:
        per_component = split_kwargs(components, kwargs)
    except ValueError as error:
        return errors + [str(error)]
    # split_kwargs' rule: one reward takes flat keywords, or its own under its name
    nested = len(components) > 1 or isinstance(kwargs.get(next(iter(components))), dict)
    for name in components:
        try:
            factory = REWARD_REGISTRY.resolve(name)
        except (ValueError, TypeError, ImportError, OSError, AttributeError):
            continue
        field = f"reward_fn_kwargs.{name}" if nested else "reward_fn_kwargs"
        errors.extend(keyword_errors(factory, per_component[name], field, f"reward_fn {name!r}"))
    return errors


def _as_dict(value) -> dict:
    return value.to_dict() if hasattr(value, "to_dict") else dict(value or {})


def algorithm_errors(config) -> list[str]:
    """Contradictions of the RL algorithm's fields: each registry is asked about its own (estimator, loss, KL)."""
    from ddpo_group.algorithms import (
        ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY, canonical_agg_mode, get_adv_estimator, get_policy_loss,
    )
    from ddpo_group.algorithms.rollout_correction import correction_errors
    from ddpo_group.reference.regularizer import kl_config_errors
    from ddpo_group.reference.teachers import teacher_errors
    from ddpo_group.update.critic import critic_config_errors

    algorithm, train, errors = config.algorithm, config.train, []
    need = _collector(errors)
    estimator = _resolve("algorithm.adv_estimator", algorithm.adv_estimator, get_adv_estimator, ADV_ESTIMATOR_REGISTRY, errors)
    loss = _resolve("algorithm.policy_loss", algorithm.policy_loss, get_policy_loss, POLICY_LOSS_REGISTRY, errors)
    if loss is not None:  # its keywords, checked by the loss's registration (ratio_norm: reweight)
        kwargs = algorithm.policy_loss_kwargs
        errors.extend(loss.config_errors(kwargs.to_dict() if hasattr(kwargs, "to_dict") else dict(kwargs or {})))
    try:
        canonical_agg_mode(algorithm.loss_agg_mode)
    except ValueError as error:
        errors.append(f"algorithm.loss_agg_mode: {error}")
    if estimator is not None:
        errors.extend(estimator.config_errors(config))
        if estimator.needs_groups and train.group_size < 2:
            errors.append(
                f"algorithm.adv_estimator={algorithm.adv_estimator!r} compares the samples of a prompt group and needs "
                f"train.group_size >= 2 samples per prompt per epoch, got train.group_size={train.group_size}"
            )
        if algorithm.filter_groups:
            need(estimator.needs_groups,
                 f"algorithm.filter_groups=True drops prompt groups whose rewards are all equal and needs a group "
                 f"estimator, got algorithm.adv_estimator={algorithm.adv_estimator!r}")
    if algorithm.filter_groups:
        need(algorithm.max_num_gen_batches >= 1, f"algorithm.max_num_gen_batches={algorithm.max_num_gen_batches} must be >= 1")
    errors.extend(multi_reward_errors(config, estimator))
    need(algorithm.clip_ratio_c is None or algorithm.clip_ratio_c > 1, f"algorithm.clip_ratio_c={algorithm.clip_ratio_c} must be > 1 (or None)")
    errors.extend(objective_errors(config, estimator))
    errors.extend(correction_errors(config))
    if loss is not None and not loss.per_step:
        need(algorithm.rollout_correction.is_level != "step",
             f"algorithm.rollout_correction.is_level='step' weighs each step's loss; algorithm.policy_loss="
             f"{algorithm.policy_loss!r} is one loss a trajectory: use is_level='trajectory'")
    return errors + kl_config_errors(config, estimator) + critic_config_errors(config) + teacher_errors(config)


def objective_errors(config, estimator) -> list[str]:
    """``algorithm.objective``: known, its keywords; a matching objective reads one advantage per sample (no critic,
    no per-step rewards) and is the only one that may sample deterministically (``sample.deterministic``)."""
    from ddpo_group.algorithms import OBJECTIVE_REGISTRY, get_objective
    from ddpo_group.algorithms.objectives import POLICY_GRADIENT

    algorithm, errors = config.algorithm, []
    need = _collector(errors)
    objective = _resolve("algorithm.objective", algorithm.objective, get_objective, OBJECTIVE_REGISTRY, errors)
    if objective is None:
        return errors
    kwargs = algorithm.objective_kwargs
    errors.extend(objective.config_errors(kwargs.to_dict() if hasattr(kwargs, "to_dict") else dict(kwargs or {})))
    correction = algorithm.rollout_correction
    need(objective.kind == POLICY_GRADIENT or not (correction.is_level or correction.rs_level),
         f"algorithm.rollout_correction (is_level={correction.is_level!r}, rs_level={correction.rs_level!r}) weighs "
         f"the policy-gradient loss's pairs by the rollout's log-probabilities; algorithm.objective="
         f"{algorithm.objective!r} has no such loss: set both to \"\"")
    if not objective.is_matching:
        need(not config.sample.deterministic,
             f"sample.deterministic=True samples without log-probs, which algorithm.objective={algorithm.objective!r} "
             "trains on: use a matching objective (awm, nft, sft) or sample.deterministic=False")
        return errors
    need(not config.train.recompute_rollout, f"train.recompute_rollout=True recomputes the rollout's log-probabilities; "
         f"algorithm.objective={algorithm.objective!r} samples deterministically and records none: set it False")
    if estimator is not None:
        need(not estimator.needs_critic and not estimator.accepts_step_rewards,
             f"algorithm.objective={algorithm.objective!r} weighs each sample by one advantage; algorithm.adv_estimator="
             f"{algorithm.adv_estimator!r} gives per-step advantages (critic or step rewards): use a per-sample estimator "
             "(grpo, dr_grpo, rloo, ddpo, ...)")
    if objective.kind == "preference":
        need(config.kl.use_reference_model, f"algorithm.objective={algorithm.objective!r} compares the policy with a reference "
             "model: set kl.use_reference_model=True (kl.beta may stay 0)")
        need(not config.kl.beta, f"kl.beta={config.kl.beta} with algorithm.objective={algorithm.objective!r}: the preference "
             "objective's reference is in its loss already and no KL term is added: set kl.beta=0")
        need(estimator is None or estimator.needs_groups, f"algorithm.objective={algorithm.objective!r} pairs the best and the "
             f"worst sample of each prompt group: algorithm.adv_estimator={algorithm.adv_estimator!r} is no group estimator "
             "(grpo, dr_grpo, rloo, ...)")
        need(not algorithm.filter_groups, f"algorithm.objective={algorithm.objective!r} forms its pairs from one round's groups: set "
             "algorithm.filter_groups=False")
    need(not config.kl.in_reward, f"kl.in_reward=True puts a per-step KL in the reward; algorithm.objective="
         f"{algorithm.objective!r} has no steps to put it on: use kl.beta with kl.in_reward=False")
    from ddpo_group.algorithms.objectives import TIME_SAMPLINGS

    need(algorithm.objective_times in TIME_SAMPLINGS, f"algorithm.objective_times={algorithm.objective_times!r} must be one of "
         f"{TIME_SAMPLINGS}")
    need(algorithm.objective_time_shift > 0, f"algorithm.objective_time_shift={algorithm.objective_time_shift} must be > 0")
    need(algorithm.old_decay_flat_steps >= 0, f"algorithm.old_decay_flat_steps={algorithm.old_decay_flat_steps} must be >= 0")
    need(algorithm.old_decay_ramp >= 0, f"algorithm.old_decay_ramp={algorithm.old_decay_ramp} must be >= 0")
    need(0 <= algorithm.old_decay_max < 1, f"algorithm.old_decay_max={algorithm.old_decay_max} must be in [0, 1) (1 would freeze the "
         "old model)")
    need(not (config.cuda_graphs and objective.needs_old_model), f"cuda_graphs=True: algorithm.objective="
         f"{algorithm.objective!r} samples the rollouts with its old model, which the CUDA-graph copy of the policy does not "
         "follow: set cuda_graphs=False")
    return errors


def multi_reward_errors(config, estimator) -> list[str]:
    """``algorithm.multi_reward_mix``: a known value; "advantage_aggr" needs a group estimator without a critic whose
    normalisation after the sum keeps the groups apart (algorithms/multi_reward.py). A single reward is allowed: it is
    its own component (weight 1)."""
    from ddpo_group.algorithms import ADV_ESTIMATOR_REGISTRY, MULTI_REWARD_MIXES

    mix = config.algorithm.multi_reward_mix
    if mix not in MULTI_REWARD_MIXES:
        return [f"algorithm.multi_reward_mix={mix!r} must be one of {MULTI_REWARD_MIXES}"]
    if mix != "advantage_aggr" or estimator is None:
        return []
    name = config.algorithm.adv_estimator
    usable = [n for n in ADV_ESTIMATOR_REGISTRY.names()
              if ADV_ESTIMATOR_REGISTRY.get(n).needs_groups and not ADV_ESTIMATOR_REGISTRY.get(n).needs_critic]
    head = f"algorithm.multi_reward_mix='advantage_aggr' with algorithm.adv_estimator={name!r}"
    if not estimator.needs_groups:
        return [f"{head}: normalising each reward within its prompt group needs an estimator that compares a prompt "
                f"group's samples, one of {usable}"]
    if estimator.needs_critic:  # the critic would regress S_i, which moves with the other samples of i's group
        return [f"{head}: the normalised sum depends on the other samples of a group, not on the sample alone, so a "
                f"critic cannot learn it; use one of {usable}"]
    params = estimator.params_from(config)
    if params.get("norm_adv_by_std") and not params.get("global_std"):
        fixes = "train.scale_rewards=False (MixGRPO: no scaling after the sum)"
        if "global_std" in estimator.params:
            fixes = f"algorithm.global_std=True (GDPO: the batch std) or {fixes}"
        return [f"{head} would divide the normalised sum by its group std again, which gives every 2-sample group "
                f"+-1/sqrt(2) whatever its components did (the collapse GDPO removes); set {fixes}"]
    return []


def _resolve(field: str, value, get, registry, errors: list):
    """``get(value)``, or None with a message naming the field: an unknown name lists the registered ones."""
    try:
        return get(value)
    except (ValueError, TypeError, ImportError, OSError, AttributeError) as error:
        if isinstance(value, str) and ":" not in value:
            errors.append(f"{field}={value!r} is unknown; registered: {registry.names()}; or give a plugin "
                          "'package.module:function' or '/path/file.py:function'")
        else:
            errors.append(f"{field}={value!r}: {error}")
        return None
