"""Training configurations: one base, named presets derived from it.

    accelerate launch scripts/train.py --config config/base.py:ddpo --config.train.learning_rate=1e-4

Field names follow ddpo-pytorch where it has them.
"""

import ml_collections


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

    # ---- algorithm ----
    config.algorithm = algorithm = ml_collections.ConfigDict()
    algorithm.adv_estimator = "ddpo"
    algorithm.policy_loss = "vanilla"
    algorithm.loss_agg_mode = "step-mean"

    # ---- prompts and rewards ----
    config.prompt_fn = "tiny_shapes"
    config.prompt_fn_kwargs = ml_collections.ConfigDict()
    config.reward_fn = "shapes_alignment"  # the embedded model's prompt alignment (classifier judge)
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
