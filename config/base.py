"""Training configurations: one base, named presets derived from it.

    accelerate launch scripts/train.py --config config/base.py:ddpo --config.train.learning_rate=1e-4

Field names follow ddpo-pytorch where it has them.
"""

import ml_collections
from ml_collections.config_dict import FieldReference


def base() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()

    # ---- run ----
    config.run_name = ""  # empty: "<preset>_<timestamp>"
    config.seed = 42
    config.logdir = "logs"
    config.num_epochs = 100
    config.save_freq = 20  # epochs between checkpoints (0: only at the end)
    config.num_checkpoint_limit = 5
    config.mixed_precision = "no"  # "no", "fp16" or "bf16"
    config.allow_tf32 = True
    config.resume_from = ""  # a checkpoint directory or a run directory (its latest checkpoint)
    config.use_lora = True
    config.lora_rank = 4

    # ---- model: "tiny-shapes" is the embedded model; anything else is a hub id or a local path ----
    config.pretrained = pretrained = ml_collections.ConfigDict()
    pretrained.model = "tiny-shapes"
    pretrained.revision = ""

    # ---- sampling ----
    config.sample = sample = ml_collections.ConfigDict()
    sample.num_steps = 20
    sample.eta = 1.0
    sample.guidance_scale = 5.0
    sample.batch_size = 16  # per process
    sample.num_batches_per_epoch = 2
    sample.log_prob_reduce = "mean"  # over latent dims; "sum" needs a much smaller clip range

    # ---- training ----
    config.train = train = ml_collections.ConfigDict()
    train.batch_size = 8  # samples per process per train batch
    train.use_8bit_adam = False
    train.learning_rate = 3e-4
    train.adam_beta1 = 0.9
    train.adam_beta2 = 0.999
    train.adam_weight_decay = 1e-4
    train.adam_epsilon = 1e-8
    train.gradient_accumulation_steps = 1  # train batches per optimizer step
    train.max_grad_norm = 1.0
    train.num_inner_epochs = 1
    train.cfg = True  # classifier-free guidance in the training forward (must match sampling)
    train.adv_clip_max = 5.0
    train.clip_range = 1e-4
    train.timestep_fraction = 1.0
    train.pairs_per_forward = 32  # (sample, step) pairs per training forward
    train.group_size = 1  # samples per prompt per epoch (copies spread over processes and batches)
    # KL to a reference model and GRPO-family options (fields only here; see ALGORITHMS.md)
    train.beta = 0.0  # weight of the KL term to the reference model
    train.epsilon = 1e-4  # clip range of the GRPO-family losses
    train.scale_rewards = True  # divide group advantages by the group std
    train.use_reference_model = False
    train.reference_model_mixup_alpha = 1.0  # theta_ref <- alpha * theta + (1 - alpha) * theta_ref
    train.reference_update_freq = 0  # epochs between reference updates (0: never)

    # ---- algorithm ----
    config.algorithm = algorithm = ml_collections.ConfigDict()
    algorithm.adv_estimator = "ddpo"
    algorithm.policy_loss = "vanilla"
    algorithm.loss_agg_mode = "step-mean"

    # ---- GROUP_PPO (GROUP_PPO.md) ----
    config.group_params = group = ml_collections.ConfigDict()
    group.group_variance_threshold = 1.0
    group.group_max_size = 16
    group.group_epsilon = 1e-6
    group.adaptive_threshold = True
    group.threshold_lr = 0.01
    group.min_threshold = 0.1
    group.max_threshold = 10.0

    # ---- prompts and rewards ----
    # prompt_fn / reward_fn: a registered name, "package.module:function", or an installed plugin's
    # entry point (groups ddpo_group.prompts / ddpo_group.rewards). reward_fn may also be a weighted
    # combination {"name": weight, ...}: on the command line
    #   --config.reward_fn='{"jpeg_compressibility": 1.0, "shapes_alignment": 2.0}'
    # with per-component factory arguments --config.reward_fn_kwargs='{"shapes_alignment": {...}}'.
    config.prompt_fn = "tiny_shapes"
    config.prompt_fn_kwargs = ml_collections.ConfigDict()
    # the embedded model's prompt alignment (classifier judge); a name or {name: weight}
    config.reward_fn = FieldReference("shapes_alignment", field_type=object)
    config.reward_fn_kwargs = ml_collections.ConfigDict()

    # ---- DDPO's per-prompt stat tracking (buffer mode) ----
    config.per_prompt_stat_tracking = tracking = ml_collections.ConfigDict()
    tracking.buffer_size = 16
    tracking.min_count = 16

    # ---- logging ----
    config.wandb = wandb = ml_collections.ConfigDict()
    wandb.mode = "online"  # "online", "offline" or "disabled"; online falls back to offline without an API key
    wandb.project = "ddpo-group"
    wandb.entity = ""
    config.log_images_every = 1  # epochs between image grids (0: never)
    config.export_lora = True  # with use_lora: diffusers-format LoRA in <run>/lora and in every checkpoint
    return config


def ddpo() -> ml_collections.ConfigDict:
    """DDPO (Black et al.): per-prompt stat tracker advantages, clipped PPO loss on every step."""
    config = base()
    config.algorithm.adv_estimator = "ddpo"
    return config


PRESETS = {"ddpo": ddpo}


def get_config(name: str = "ddpo") -> ml_collections.ConfigDict:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(sorted(PRESETS))}")
    config = PRESETS[name]()
    config.preset = name
    return config
