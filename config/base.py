"""Training configurations: one base, named presets derived from it.

    accelerate launch scripts/train.py --config config/base.py:ddpo --config.train.learning_rate=1e-4

Field names follow ddpo-pytorch where it has them.
"""

import ml_collections
from ml_collections.config_dict import FieldReference


def base() -> ml_collections.ConfigDict:
    """Every field and its default. A field's default lives here only: the package reads ``config.section.field``.

    A comment on a field's own line (or just above it) is its documentation; docs/configuration.md is generated from
    these comments (``python scripts/config_reference.py``)."""
    config = ml_collections.ConfigDict()

    # ---- run ----
    config.preset = ""  # the preset's name (get_config sets it); "": a config built from base() by hand
    config.run_name = ""  # the run directory's name under logdir; "": "<preset>_<timestamp>"
    config.seed = 42  # seeds the prompts, the noise of every round, the weights' initialisation and the evaluation
    config.logdir = "logs"  # where run directories are created
    config.num_epochs = 40  # epochs to train; every preset's default run fits in 10 minutes on a 2-core CPU
    config.save_freq = 20  # epochs between checkpoints (0: only at the end)
    config.num_checkpoint_limit = 5  # checkpoints kept per run; older ones are deleted
    config.mixed_precision = "no"  # "no", "fp16" or "bf16"
    config.allow_tf32 = True  # TF32 matrix multiplications on CUDA (Ampere and newer)
    config.device = ""  # "": CUDA when visible (accelerate's choice); "cpu": the CPU even on a GPU machine
    # bitwise-reproducible CUDA runs and resume: deterministic kernels, CUBLAS_WORKSPACE_CONFIG (docs/performance.md
    # has its cost); CPU runs are deterministic already
    config.deterministic = False
    # torch threads per process; 0: the environment's, or the cores per process on a CPU run that accelerate launch
    # left at its default of one thread (ddpo_group/run/threads.py)
    config.num_cpu_threads = 0
    # several processes: a collective that waits longer than this (a process hung or died) stops every process with an
    # error instead of leaving them blocked (ddpo_group/run/process_failures.py)
    config.collective_timeout_s = 1800
    config.resume_from = ""  # a checkpoint directory or a run directory (its newest checkpoint that verifies); "": a new run
    config.use_lora = True  # train LoRA adapters (peft); False: the whole denoiser
    config.lora_rank = 4  # LoRA rank r
    config.lora_alpha = 0  # LoRA scale alpha / rank; 0: alpha = rank (Flow-GRPO's recipes use rank 32, alpha 64)
    # performance options (docs/performance.md): none helps the embedded model on a CPU
    config.unet_channels_last = False  # channels-last memory format for a UNet denoiser (convolutions on GPUs)
    # torch.compile the denoiser (a minute or more of compilation in the first epoch, applied after the reference model
    # is built): "auto" ("regional" on CUDA for a transformer denoiser of 1B parameters or more, where it measured 1.6x;
    # off on the CPU, for smaller models, for UNets, under FSDP and with deterministic=True), False (off), "full" (its
    # whole forward; True means the same) or "regional" (each of its repeated blocks, diffusers'
    # compile_repeated_blocks: the same code for every block)
    config.compile_denoiser = FieldReference("auto", field_type=object)
    # CUDA graphs for the sampling steps: the rollouts' (and ReMax's greedy) denoiser forwards go through a copy of the
    # denoiser sharing its weights, compiled with torch.compile(mode="reduce-overhead"), each batch shape recorded once
    # and replayed (a minute or more of compilation in the first epoch; the graphs' memory stays reserved through
    # training, which pairs_per_forward="auto" measures after it; training keeps compile_denoiser's, evaluation the
    # plain denoiser). CUDA only, not under FSDP, nor with an objective that samples with its old model (nft). Off:
    # measured 2.09x eager sampling at SD3.5-M shape, not yet beside regional compilation's 1.7x (docs/performance.md)
    config.cuda_graphs = False
    # the scaled-dot-product attention kernels torch may use: "auto" (torch's choice among all but cuDNN's, whose
    # backward failed at FLUX.1 shape), "flash", "cudnn", "efficient" (these two CUDA only) or "math"; flash and cudnn
    # need fp16 / bf16 on CUDA (mixed_precision); a named kernel leaves the calls it cannot run (the VAE's 512-channel
    # attention head under flash) to the math one
    config.attention_backend = "auto"

    # ---- model: "tiny-shapes" and "tiny-shapes-flow" are the embedded models; anything else is a hub id or a path ----
    config.pretrained = pretrained = ml_collections.ConfigDict()
    pretrained.model = "tiny-shapes"  # the model to fine-tune: an embedded model's name, a hub id or a local directory
    pretrained.revision = ""  # the hub revision (branch, tag or commit); "": the default branch
    # "sd", "sdxl", "sd3", "flux", "zimage", "qwenimage", "flux_kontext", "flux2", "flux2_dev", "wan", "wan_i2v",
    # "qwenimage_edit_plus" or "qwenimage_edit"; "": from
    # model_index.json's pipeline class
    pretrained.family = ""
    # text tokens per prompt of the T5 / LLM text encoder (SD3, FLUX.1, Wan: T5; Z-Image, FLUX.2: Qwen3 / Mistral;
    # Qwen-Image: Qwen2.5-VL, at most 1024), the stored embeddings padded to it; 0: the pipeline's default (SD3: 256,
    # the others 512)
    pretrained.max_sequence_length = 0
    pretrained.text_encoder_device = ""  # "cpu" keeps the text encoders off the GPU (their embeddings move to it)
    # FLUX.2: the text encoder's hidden layers stacked into the condition (the pipeline's text_encoder_out_layers);
    # (): the pipeline's default, klein's 9, 18, 27 and dev's 10, 20, 30 (a smaller text encoder needs its own)
    pretrained.text_encoder_out_layers = ()

    # ---- sampling (the rollouts) ----
    config.sample = sample = ml_collections.ConfigDict()
    sample.num_steps = 10  # denoising steps of a rollout (Flow-GRPO's 10)
    # steps of the deterministic evaluation (eval_freq) and of scripts/evaluate.py; 0: num_steps (Flow-GRPO trains on 10
    # and evaluates on 40)
    sample.eval_num_steps = 0
    # the stochastic steps' noise level (0 would make every step deterministic): DDIM's eta on Stable Diffusion 1.x/2.x
    # and SDXL (1: DDPM-like, ddpo-pytorch's), the flow step's a on the flow-matching families (every other one;
    # Flow-GRPO: 0.7 for SD3.5, 0.9 for FLUX); None: the family's standard level, 1.0 on Stable Diffusion (SDXL too) and
    # 0.7 on the flow-matching families
    sample.noise_level = ml_collections.config_dict.placeholder(float)
    # flow-matching families (all but sd and sdxl): the stochastic step (sampling/flow_steps.py): "flow_sde" (Flow-GRPO), "cps"
    # (coefficients-preserving), "dance_sde" (DanceGRPO, with noise_level 0.3)
    sample.sde_type = "flow_sde"
    # image height and width in pixels (every family but sd, whose UNet fixes it; Wan: each frame's); 0: the pipeline's
    # default (its default_sample_size times its VAE factor; Z-Image's 1024, Wan's 480 x 832). A size the model cannot
    # take (not a multiple of its VAE factor times its patch, beyond its position table) is refused at start
    sample.resolution = 0
    # video families (Wan, Wan image-to-video): frames per video, 4 k + 1 (5, 33, 81); 0: the pipeline's default (81)
    sample.num_frames = 0
    # the run's negative prompt, the unconditional branch of classifier-free guidance, for every family that guides
    # with one: a prompt row's own "negative_prompt" (a .jsonl prompt file's) wins, else this, else ("") the family's
    # default: the empty prompt (SDXL: zeros when force_zeros_for_empty_prompt), Qwen-Image's " "; a given negative
    # prompt is always encoded (models/families/base.py). Wan: diffusers' example lists defects ("blurred details, ...")
    sample.negative_prompt = ""
    # memory of large models: text embeddings of this many prompts kept on the CPU (each prompt then meets the text
    # encoders once; 0: encode every round)
    sample.text_embedding_cache = 0
    sample.decode_batch_size = 0  # images decoded by the VAE at a time (0: a whole batch)
    # classifier-free guidance scale (<= 1: none; Z-Image: 0 is none; Qwen-Image: the pipeline's true_cfg_scale, with
    # its norm-preserving rescale; FLUX.1-dev, FLUX.2-dev, Kontext: the guidance embedding; distilled FLUX.2 klein: none)
    sample.guidance_scale = 5.0
    sample.batch_size = 16  # images sampled at a time, per process
    sample.num_batches_per_epoch = 2  # sampling batches per process per epoch
    sample.log_prob_reduce = "mean"  # over latent dims; "sum" needs a much smaller clip range
    # every step the family's deterministic step (noise level 0; the ODE solver of flow models) and no log-probs: only
    # for a matching objective (algorithm.objective), which trains on the final samples
    sample.deterministic = False
    sample.same_initial_noise = False  # the copies of a prompt share x_T and differ by their step noise only
    # SDE window (Flow-GRPO-Fast): only steps [start, start + size) are stochastic and trained; the others are
    # deterministic DDIM steps. Size 0: every step. Early steps decide the composition, so a small early window
    # concentrates the credit of the reward on few steps (and trains size / num_steps of the pairs).
    # Default: the first 2 of 10 steps, where the embedded model decides the shape (docs/learning_proof.md).
    sample.sde_window_start = 0  # the window's first step
    sample.sde_window_size = 2  # the window's number of steps (0: every step is stochastic and trained)
    # tree rollouts (docs/design/TREES.md): a prompt group's copies share x_T and their first steps and split at these
    # steps (stochastic ones, ascending) into children that draw their own step noise; (): flat sampling. A root has
    # prod(branch_factors) leaves, which divide train.group_size (the quotient: roots per prompt) and
    # sample.batch_size (a sampling batch holds whole trees); a node's steps are computed once. Each leaf is recorded
    # as a full trajectory: the estimator, the loss and the KL see leaves (a shared transition is trained once per
    # leaf below it, the per-leaf policy gradient)
    sample.branch_steps = ()
    sample.branch_factors = ()  # the children of each node at each branch step (>= 2)
    # move the branch steps after the first, one step an epoch at most, toward where the reward's variance is decided
    # (rollout/branching.py); needs 2 branches or more
    sample.adaptive_branching = False
    # Z-Image only: its pipeline's options of these names (Z-Image guides with u_c + w (u_c - u_uncond), so there
    # sample.guidance_scale = 0 is no guidance)
    sample.cfg_normalization = 0.0  # > 0: the guided output's norm capped at this multiple of the conditional one's
    sample.cfg_truncation = 1.0  # no guidance on the steps with (1000 - t) / 1000 above it (1: guidance on every step)

    # ---- training (the policy update) ----
    config.train = train = ml_collections.ConfigDict()
    train.batch_size = 8  # samples per process per train batch
    train.use_8bit_adam = False  # bitsandbytes' 8-bit AdamW (CUDA)
    train.learning_rate = 3e-3  # for the embedded model's rank-4 LoRA; ddpo-pytorch uses 3e-4 on Stable Diffusion
    train.adam_beta1 = 0.9  # AdamW's beta1
    train.adam_beta2 = 0.999  # AdamW's beta2
    train.adam_weight_decay = 1e-4  # AdamW's weight decay
    train.adam_epsilon = 1e-8  # AdamW's epsilon (the denominator's floor)
    train.gradient_accumulation_steps = 1  # train batches per optimizer step
    train.max_grad_norm = 1.0  # gradient clipping by global norm
    train.num_inner_epochs = 1  # passes over an epoch's samples
    train.cfg = True  # classifier-free guidance in the training forward (must match sampling)
    train.adv_clip_max = 5.0  # advantages are clipped to [-adv_clip_max, adv_clip_max]
    train.clip_range = 1e-4  # PPO's clip range of the probability ratio (GRPO's epsilon)
    train.timestep_fraction = 1.0  # the fraction of a trajectory's steps trained (ddpo-pytorch's)
    # (sample, step) pairs per training forward, or "auto": 32 on the CPU; on CUDA the most that fit the card, measured
    # at the first update with the loaded model and kept in checkpoints (ddpo_group/update/memory_fit.py)
    train.pairs_per_forward = FieldReference("auto", field_type=object)
    # recompute the denoiser's activations in the backward: less memory, ~1/3 more compute; "auto" pairs_per_forward
    # also switches it on when fewer than 4 pairs fit without it
    train.gradient_checkpointing = False
    train.group_size = 1  # samples per prompt per epoch, the prompt's group (copies spread over processes and batches)
    train.scale_rewards = True  # divide group advantages by the group std
    # EMA of the trainable weights (Flow-GRPO's EMAModuleWrapper, ddpo_group/update/ema.py): after optimizer step k,
    # when (k + 1) % ema_update_interval == 0, ema += (1 - min((1 + k) / (10 + k), ema_decay)) * (theta - ema)
    train.ema = False
    train.ema_decay = 0.9  # Flow-GRPO's
    train.ema_update_interval = 8  # optimizer steps between EMA updates (Flow-GRPO's)
    train.ema_eval = True  # with ema: the evaluation during training (eval_freq) samples with the EMA weights
    train.ema_export = False  # with ema and use_lora: <run>/lora and the checkpoints' lora/ hold the EMA weights

    # ---- KL to a reference model (docs/algorithms.md) ----
    # LoRA: the reference is the base model with adapters disabled, or (reference_update_freq > 0) a second adapter
    # mixed every F epochs; full fine-tuning: a frozen copy of the denoiser (ddpo_group/reference/model.py)
    config.kl = kl = ml_collections.ConfigDict()
    kl.beta = 0.0  # weight of the KL term to the reference model (0: no KL)
    kl.use_reference_model = False  # keep a reference model (needed by beta > 0)
    kl.reference_mixup_alpha = 1.0  # at each reference update, theta_ref <- alpha * theta + (1 - alpha) * theta_ref
    kl.reference_update_freq = 0  # epochs between reference updates (0: never, the frozen base model)
    kl.kind = "gaussian"  # analytic KL of the two step Gaussians; or k1, abs, k2, k3 (log-prob estimators)
    kl.in_reward = False  # r_n -= beta * KL_n before the advantage (step-level estimators only); False: a loss term
    kl.controller = "fixed"  # "fixed" or "adaptive" (PPO's adaptive beta toward kl.target)
    kl.target = 0.01  # the adaptive controller's target KL per step
    kl.horizon = 10000.0  # samples; adaptive beta *= 1 + clip(kl / target - 1, +-0.2) * n / horizon

    # ---- algorithm ----
    config.algorithm = algorithm = ml_collections.ConfigDict()
    # a registered name, or a plugin "package.module:function" / "/path/file.py:function" (docs/algorithms.md)
    algorithm.adv_estimator = "ddpo"
    algorithm.adv_estimator_kwargs = ml_collections.ConfigDict()  # keywords of the estimator (add to / override its own)
    # what the update minimises (docs/algorithms.md): "policy_gradient" (algorithm.policy_loss over the recorded
    # step log-probs), or a matching objective on the forward process of the final samples: "awm" (advantage weighted
    # matching), "nft" (DiffusionNFT), "dpo" (online Diffusion-DPO, each group's best against its worst, against the
    # kl section's reference model), "dgpo" (a group-level preference of every sample of a group, against that
    # reference); or a plugin path, as adv_estimator (ddpo_group/algorithms/objectives.py)
    algorithm.objective = "policy_gradient"
    # keywords of the objective: awm's weighting ("uniform", "t" or "ghuber"), ghuber_power and old_kl_beta (> 0: a KL
    # to the old model, which then follows the old_decay_* schedule); nft's beta (its guidance
    # strength, > 0) and adaptive_weight (True: its adaptive loss weighting); dpo's and dgpo's beta (their temperature,
    # > 0)
    algorithm.objective_kwargs = ml_collections.ConfigDict()
    # the matching objectives' training times: "schedule" (the rollout schedule's times, int(T * timestep_fraction) of
    # them per sample: DiffusionNFT's), "uniform" or "logit_normal" (fresh times s in (0, 1), shifted by
    # objective_time_shift; flow-matching families read timestep = 1000 s, DDPM ones the nearest of theirs)
    algorithm.objective_times = "schedule"
    algorithm.objective_time_shift = 1.0  # s <- shift s / (1 + (shift - 1) s) for drawn times (1: none; SD3 uses 3)
    # the old model of an objective that needs one (nft; awm with old_kl_beta): after each epoch theta_old <- d theta_old + (1 - d) theta,
    # with k optimizer steps so far d = 0 for k < flat steps, else min((k - flat) * ramp, max) (ddpo_group/update/
    # old_model.py); 0, 0.001, 0.5 are DiffusionNFT's defaults
    algorithm.old_decay_flat_steps = 0
    algorithm.old_decay_ramp = 0.001  # the old model's decay added per optimizer step after the flat steps
    algorithm.old_decay_max = 0.5  # the old model's largest decay (0: the old model is the policy after every epoch)
    algorithm.policy_loss = "vanilla"  # a registered name or a plugin path, as adv_estimator
    algorithm.policy_loss_kwargs = ml_collections.ConfigDict()  # keywords of the policy loss
    # how the per-(sample, step) losses are averaged: "step-mean", "traj-mean-step-mean", "traj-mean-step-sum",
    # "traj-mean-step-sum-norm" (docs/algorithms.md)
    algorithm.loss_agg_mode = "step-mean"
    algorithm.clip_ratio_c = 3.0  # dual clip for negative advantages (vanilla, gspo)
    algorithm.gamma = 1.0  # discount over denoising steps (gae, reinforce_plus_plus)
    algorithm.gae_lambda = 0.95  # GAE's lambda over denoising steps (gae)
    algorithm.gae_whiten = True  # whiten GAE's advantages over the batch
    algorithm.gae_start_value = "critic"  # "critic": V(x_0); "group_mean": the group's mean reward (GROUP_PPO's u_-1)
    algorithm.global_std = False  # grpo: group mean, batch std
    # several rewards (reward_fn = {name: weight}): "reward_aggr" normalises the weighted sum (Flow-GRPO);
    # "advantage_aggr" normalises each component within its prompt group, then sums (GDPO / MixGRPO; docs/rewards.md)
    algorithm.multi_reward_mix = "reward_aggr"
    # DAPO's dynamic sampling: drop groups whose rewards are all equal, sample more until the batch is full
    algorithm.filter_groups = False
    algorithm.max_num_gen_batches = 4  # sampling rounds per epoch at most (the batch may stay short)

    # ---- GROUP_PPO (docs/group_ppo.md): segments of denoising steps, the value read at each segment's endpoint ----
    config.group_ppo = group_ppo = ml_collections.ConfigDict()
    # tau, the initial variance threshold of the segment test; in [min_threshold, max_threshold] unless
    # adaptive_threshold=False
    group_ppo.variance_threshold = 1.0
    group_ppo.max_segment_steps = 16  # no segment is longer than this many steps
    group_ppo.numerical_floor = 1e-6  # floor of the variance ratio's denominator and of std divisions
    group_ppo.adaptive_threshold = True  # False: tau stays fixed, any value >= 0 (0: every step its own segment)
    group_ppo.threshold_lr = 0.01  # the threshold controller's step size
    group_ppo.min_threshold = 0.1  # the adaptive tau's lower bound
    group_ppo.max_threshold = 10.0  # the adaptive tau's upper bound
    group_ppo.gae_lambda = 1.0  # lambda over segments (1: Monte-Carlo return with a critic baseline)
    group_ppo.target_explained_variance = 0.5  # the critic quality the threshold controller aims for
    # V at the endpoints: "critic" (the value network), "residual_critic" (the prompt group's mean reward + the value
    # network, which then learns only the deviation: at 0 the advantages are grpo's), "tweedie" (the reward of the
    # decoded one-step prediction x0_hat(x_n): one more reward query per sample and valued step), "blend", "tree" (the
    # mean reward of the leaves below each node of tree rollouts, measured, no query more; cuts at the branch steps;
    # without sample.branch_steps a default tree: sampling/tree.py)
    group_ppo.value_source = "critic"
    group_ppo.value_blend = 0.5  # "blend": V = w * tweedie + (1 - w) * residual critic

    # ---- critic V(latent, timestep, text) (ppo_gae, group_ppo) ----
    config.critic = critic = ml_collections.ConfigDict()
    critic.hidden_dim = 64  # the value network's width
    critic.learning_rate = 1e-3  # the critic's AdamW learning rate
    critic.weight_decay = 0.0  # the critic's AdamW weight decay
    critic.clip_range = 0.2  # clipped value loss range, in reward units (None: unclipped)
    critic.num_updates = 1  # passes over the epoch's samples per epoch
    critic.warmup_epochs = 0  # the first epochs train the critic only: the policy stays as it is
    # "latent": V(x_n, t_n, c); "latent_x0": V([x_n, x0_hat(x_n)], t_n, c), the step's one-step prediction of the
    # clean latent too (the rollout keeps it for every step: one more latent-sized tensor per step)
    critic.input = "latent"
    critic.max_grad_norm = 1.0  # the critic's gradient clipping by global norm

    # ---- prompts and rewards ----
    # prompt_fn / reward_fn: a registered name, "package.module:function", or an installed plugin's
    # entry point (groups ddpo_group.prompts / ddpo_group.rewards). reward_fn may also be a weighted
    # combination {"name": weight, ...}: on the command line
    #   --config.reward_fn='{"jpeg_compressibility": 1.0, "shapes_alignment": 2.0}'
    # with per-component factory arguments --config.reward_fn_kwargs='{"shapes_alignment": {...}}'.
    # tiny_shapes_hard: the four captions the embedded model gets wrong most often (tiny_shapes: every caption)
    config.prompt_fn = "tiny_shapes_hard"
    config.prompt_fn_kwargs = ml_collections.ConfigDict()  # keywords of the prompt function (override its defaults)
    # the embedded model's prompt alignment (classifier judge); a name or {name: weight}
    config.reward_fn = FieldReference("shapes_alignment", field_type=object)
    config.reward_fn_kwargs = ml_collections.ConfigDict()  # keywords of the reward factory (or {name: {...}} per reward)

    # ---- DDPO's per-prompt stat tracking (buffer mode); None: whole-batch statistics (ddpo-pytorch's None) ----
    config.per_prompt_stat_tracking = tracking = ml_collections.ConfigDict()
    tracking.buffer_size = 16  # rewards kept per prompt
    tracking.min_count = 16  # below this many rewards of a prompt, the batch's statistics are used

    # ---- evaluation during training (ddpo_group/run/periodic_eval.py) ----
    # every eval_freq epochs (0: off), and then also before the first update and after the last epoch: the same prompts
    # from the same initial noise with the deterministic sampler (noise level 0, sample.eval_num_steps); eval/* in
    # the metrics, eval.jsonl, samples/eval_*.png; the run summary's before -> after is this evaluation's
    config.eval_freq = 10
    config.eval_num_prompts = 8  # distinct prompts drawn once from prompt_fn by a generator seeded by seed (its own)
    config.eval_num_seeds = 8  # initial noises per prompt (noise j is the same for every prompt)
    config.eval_prompt_file = ""  # a text file, one prompt a line: evaluate these instead of the drawn ones
    config.eval_group_by = ""  # a prompt metadata key (tiny_shapes: "shape", "color", ...) to group eval/ by; "": prompt
    config.eval_train_sampler = False  # also evaluate with the training sampler (noise level, SDE window)

    # ---- logging ----
    config.wandb = wandb = ml_collections.ConfigDict()
    wandb.mode = "online"  # "online", "offline" or "disabled"; online falls back to offline without an API key
    wandb.project = "ddpo-group"  # the wandb project
    wandb.entity = ""  # the wandb entity (user or team); "": your default
    config.log_images_every = 1  # epochs between image grids (0: never)
    config.export_lora = True  # with use_lora: diffusers-format LoRA in <run>/lora and in every checkpoint
    return config


def ddpo() -> ml_collections.ConfigDict:
    """DDPO (Black et al.): per-prompt stat tracker advantages, clipped PPO loss on every step."""
    config = base()
    config.algorithm.adv_estimator = "ddpo"
    return config


def grpo() -> ml_collections.ConfigDict:
    """GRPO (Flow-GRPO): group-normalised advantages (R - mean_g) / std_g, KL to the frozen base model."""
    config = base()
    config.algorithm.adv_estimator = "grpo"
    config.train.group_size = 8
    config.kl.beta = 0.004
    config.kl.use_reference_model = True
    return config


def dr_grpo() -> ml_collections.ConfigDict:
    """Dr.GRPO: R - mean_g without the std division, sum over steps normalised by the constant T."""
    config = base()
    config.algorithm.adv_estimator = "dr_grpo"
    config.algorithm.loss_agg_mode = "traj-mean-step-sum-norm"
    config.train.group_size = 8
    config.train.scale_rewards = False
    return config


def rloo() -> ml_collections.ConfigDict:
    """RLOO: leave-one-out baseline G/(G-1) * (R - mean_g)."""
    config = base()
    config.algorithm.adv_estimator = "rloo"
    config.train.group_size = 8
    config.train.scale_rewards = False
    return config


def grpo_passk() -> ml_collections.ConfigDict:
    """Pass@k GRPO: only the best sample of a group learns, with r_max - r_second / std_g."""
    config = base()
    config.algorithm.adv_estimator = "grpo_passk"
    config.train.group_size = 8
    return config


def reinforce_pp() -> ml_collections.ConfigDict:
    """REINFORCE++: per-step returns with the KL to the reference in the reward, whitened over the batch."""
    config = base()
    config.algorithm.adv_estimator = "reinforce_plus_plus"
    config.kl.in_reward = True
    config.kl.beta = 0.01
    config.kl.use_reference_model = True
    return config


def remax() -> ml_collections.ConfigDict:
    """ReMax: R - R_greedy, the reward of a greedy (noise level 0) sample of the same prompt."""
    config = base()
    config.algorithm.adv_estimator = "remax"
    return config


def ppo_gae() -> ml_collections.ConfigDict:
    """PPO with a critic and GAE(gamma, lambda) over the denoising steps, whitened; critic on every step."""
    config = base()
    config.algorithm.adv_estimator = "gae"
    return config


def group_ppo() -> ml_collections.ConfigDict:
    """GROUP_PPO (GROUP_PPO.md): dynamic step groups per prompt group, critic at the endpoints, adaptive tau."""
    config = base()
    config.algorithm.adv_estimator = "group_ppo"
    config.train.group_size = 8
    # GROUP_PPO.md makes it optional; dividing by the group std learns faster on the default task (docs/group_ppo.md)
    config.train.scale_rewards = True
    # the critic learns each sample's deviation from its group's mean reward: an untrained critic gives grpo's
    # advantages instead of noise (docs/group_ppo.md: the study of the value sources)
    config.group_ppo.value_source = "residual_critic"
    return config


def on_flow_model(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """``config`` on the embedded flow-matching model: its hardest captions (it already draws the SD model's right) and
    half the learning rate (3e-3 makes its rank-4 LoRA collapse; docs/embedded_models.md)."""
    config.pretrained.model = "tiny-shapes-flow"
    config.prompt_fn = "tiny_shapes_flow_hard"
    config.train.learning_rate = 1.5e-3
    return config


def grpo_flow() -> ml_collections.ConfigDict:
    """GRPO on the embedded flow-matching model (10 Flow-SDE steps, the first 2 stochastic and trained)."""
    return on_flow_model(grpo())


def group_ppo_flow() -> ml_collections.ConfigDict:
    """GROUP_PPO on the embedded flow-matching model."""
    return on_flow_model(group_ppo())


def matching(objective: str) -> ml_collections.ConfigDict:
    """A matching objective on the embedded flow-matching model: GRPO's group advantages (group 8), rollouts with the
    deterministic Euler solver (no SDE, no log-probs), every rollout step's time trained once per epoch."""
    config = on_flow_model(grpo())
    config.algorithm.objective = objective
    config.sample.deterministic = True
    config.kl.beta = 0.0
    config.kl.use_reference_model = False
    return config


def awm() -> ml_collections.ConfigDict:
    """AWM (advantage weighted matching, arXiv:2509.25050): the flow-matching loss of each sample weighted by its
    group advantage, on the embedded flow model."""
    return matching("awm")


def nft() -> ml_collections.ConfigDict:
    """DiffusionNFT (arXiv:2509.16117) on the embedded flow model, CFG-free as the paper trains it (guidance 1 in
    sampling and training): implicit positive / negative policies around an old model that samples the rollouts,
    beta 1, its adaptive loss weighting, the old model's decay min(0.001 k, 0.5) after k optimizer steps."""
    config = matching("nft")
    config.algorithm.objective_kwargs = ml_collections.ConfigDict({"beta": 1.0, "adaptive_weight": True})
    config.sample.guidance_scale, config.train.cfg = 1.0, False
    return config


def dpo() -> ml_collections.ConfigDict:
    """Online Diffusion-DPO (arXiv:2311.12908) on the embedded flow model: each prompt group's best sample against its
    worst (group 8), against the frozen base model (the KL section's reference, no KL term), deterministic rollouts,
    beta 2000 (Flow-Factory's online default)."""
    config = matching("dpo")
    config.kl.use_reference_model = True
    config.algorithm.objective_kwargs = ml_collections.ConfigDict({"beta": 2000.0})
    return config


def dgpo() -> ml_collections.ConfigDict:
    """DGPO (arXiv:2510.08425) on the embedded flow model: a group-level preference over every sample of a prompt group
    (group 8, advantage-weighted), against the frozen base model (no KL term), deterministic rollouts, beta 100
    (Flow-Factory's default)."""
    config = matching("dgpo")
    config.kl.use_reference_model = True
    config.algorithm.objective_kwargs = ml_collections.ConfigDict({"beta": 100.0})
    return config


def flow_grpo(model: str) -> ml_collections.ConfigDict:
    """Flow-GRPO's published recipe on a flow-matching model: GRPO with group 24, 10 rollout steps (40 to evaluate),
    Flow-SDE, clip 1e-4, LoRA rank 32 / alpha 64, lr 3e-4, 512 px; the OCR (text rendering) task, which needs no
    downloaded reward model (RapidOCR ships its own)."""
    config = grpo()
    config.pretrained.model = model
    config.pretrained.max_sequence_length = 128  # T5 tokens: the captions are short
    config.use_lora, config.lora_rank, config.lora_alpha = True, 32, 64
    config.sample.resolution = 512
    config.sample.num_steps, config.sample.eval_num_steps = 10, 40
    config.sample.sde_type = "flow_sde"
    config.sample.batch_size, config.sample.num_batches_per_epoch = 8, 3  # 24 images per process: whole groups
    config.sample.text_embedding_cache = 4096  # T5 meets each caption once
    config.train.group_size = 24
    config.train.batch_size = 8
    config.train.learning_rate = 3e-4
    config.train.clip_range = 1e-4
    config.train.timestep_fraction = 0.99
    config.prompt_fn = "ocr"
    config.reward_fn = "ocr"
    config.num_epochs = 500
    config.save_freq = 20
    return config


def flow_grpo_sd35() -> ml_collections.ConfigDict:
    """Flow-GRPO on Stable Diffusion 3.5 Medium: noise level 0.7, CFG 4.5 in sampling and training, KL beta 0.04 to
    the base model, fp16."""
    config = flow_grpo("stabilityai/stable-diffusion-3.5-medium")
    config.mixed_precision = "fp16"  # Flow-GRPO's choice for SD3: a smaller rollout / training log-prob mismatch
    config.sample.noise_level = 0.7
    config.sample.guidance_scale, config.train.cfg = 4.5, True
    config.kl.beta = 0.04
    return config


def flow_grpo_flux() -> ml_collections.ConfigDict:
    """Flow-GRPO on FLUX.1-dev: 6 rollout steps (28 to evaluate), noise level 0.9, guidance 3.5 as FLUX's guidance
    embedding (no CFG), no KL, bf16."""
    config = flow_grpo("black-forest-labs/FLUX.1-dev")
    config.mixed_precision = "bf16"
    config.sample.num_steps, config.sample.eval_num_steps = 6, 28
    config.sample.noise_level = 0.9
    config.sample.guidance_scale, config.train.cfg = 3.5, False
    config.kl.beta = 0.0
    config.kl.use_reference_model = False
    return config


def flow_grpo_qwenimage() -> ml_collections.ConfigDict:
    """Flow-GRPO on Qwen-Image (yifan123/flow_grpo, config/grpo.py ``pickscore_qwenimage``, commit 54809b5): 10 rollout
    steps (50 to evaluate), true CFG 4 in sampling and training (negative prompt " "), noise level 1.2 on a 2-step SDE
    window, groups of 16 sampled 4 at a time, 2 optimizer steps an epoch, no KL, bf16, gradient checkpointing; LoRA rank
    64 / alpha 128 on the attention and MLPs (that repository's Qwen-Image-Edit-Plus script, its only Qwen-Image training
    script in the index; the family's ``lora_target_modules``). Their reward is PickScore and their window starts at a
    step drawn at random in [0, 5); here the OCR task of ``flow_grpo`` (no downloaded reward model) and the window at
    the first steps. Qwen/Qwen-Image-2512 takes the same settings (``pretrained.model``)."""
    config = flow_grpo("Qwen/Qwen-Image")
    config.mixed_precision = "bf16"
    config.lora_rank, config.lora_alpha = 64, 128
    config.sample.num_steps, config.sample.eval_num_steps = 10, 50
    config.sample.noise_level = 1.2
    config.sample.sde_window_start, config.sample.sde_window_size = 0, 2
    config.sample.guidance_scale, config.train.cfg = 4.0, True  # true_cfg_scale 4 (models/families/qwenimage.py)
    config.sample.batch_size, config.sample.num_batches_per_epoch = 4, 4  # 16 images per process: whole groups
    config.train.group_size = 16
    config.train.batch_size = 4
    config.train.gradient_accumulation_steps = 2  # theirs: num_batches_per_epoch // 2
    config.train.timestep_fraction = 1.0  # every step of the window
    config.train.gradient_checkpointing = True  # their activation_checkpointing
    config.kl.beta = 0.0
    config.kl.use_reference_model = False
    return config


def flow_grpo_qwenimage_edit_plus() -> ml_collections.ConfigDict:
    """Flow-GRPO on Qwen-Image-Edit-Plus (yifan123/flow_grpo, scripts/train_qwenimage_edit_plus.py and
    flow_grpo/diffusers_patch/qwenimage_edit_plus_pipeline_with_logprob.py, commit 9dcdc35; launched by
    scripts/single_node/grpo_qwenimage_edit_plus.sh with config/grpo.py ``dual_ref_qwenimage_edit_plus_fast``, which
    is not in the stored copies: its numbers are ``flow_grpo_qwenimage``'s, their Qwen-Image config): that recipe with
    Qwen/Qwen-Image-Edit-2509 (-2511 takes the same settings), two source images a prompt in their data (a .jsonl row's
    ``image`` list here), the negative prompt " " encoded with the source images, LoRA rank 64 / alpha 128 on the
    attention and MLPs, no EMA. Differences: their sources are resized to the sampled size and to 512^2 px for the
    VAE, here the pipeline's own sizes (384^2 px for the text encoder, 1024^2 for the VAE: what the pipeline's
    ``__call__`` evaluates with); their reward (image similarity and GenEval) needs their data: PickScore here, and the
    editing dataset is yours (prompt_fn_kwargs.path)."""
    config = flow_grpo_qwenimage()
    config.pretrained.model = "Qwen/Qwen-Image-Edit-2509"
    # each source image adds its vision tokens (~200 at 384^2 px) to the prompt's: 0 keeps the pipeline's 512
    config.pretrained.max_sequence_length = 0
    config.sample.text_embedding_cache = 4096  # Qwen2.5-VL and the VAE meet each (prompt, source images) once
    config.prompt_fn = "from_file"
    config.reward_fn = "pickscore"
    return config


def flow_factory(model: str) -> ml_collections.ConfigDict:
    """What Flow-Factory's GRPO LoRA recipes share (github:X-GenGroup/Flow-Factory, examples/grpo/, commit 5f6cda1a):
    LoRA rank 64 / alpha 128, bf16, Flow-SDE, groups of 16, lr 3e-4, clip 1e-4, advantages clipped at 5, no KL, the
    PickScore reward. Their one stochastic step is drawn at random among the first steps of each rollout; here the
    SDE window is fixed (each recipe says which). Their caption sets are not shipped: simple_animals stands in
    (prompt_fn="from_file" with prompt_fn_kwargs.path reads yours)."""
    config = grpo()
    config.pretrained.model = model
    config.mixed_precision = "bf16"
    config.use_lora, config.lora_rank, config.lora_alpha = True, 64, 128
    config.sample.sde_type = "flow_sde"
    config.train.group_size = 16
    config.train.learning_rate = 3e-4
    config.train.clip_range, config.train.adv_clip_max = 1e-4, 5.0
    config.kl.beta, config.kl.use_reference_model = 0.0, False
    config.prompt_fn = "simple_animals"
    config.reward_fn = "pickscore"
    return config


def nft_sd35() -> ml_collections.ConfigDict:
    """DiffusionNFT's published recipe on Stable Diffusion 3.5 Medium (NVlabs/DiffusionNFT config/nft.py, its OCR task):
    CFG-free (guidance 1 in sampling and training), deterministic rollouts of 10 steps (40 to evaluate; the paper's
    dpm2 solver is the Euler one here), beta 0.1, the old model's decay min(0.0075 (k - 75), 0.999) after 75 steps,
    KL 1e-4 to the base model, group 24, LoRA rank 32 / alpha 64, lr 3e-4, 512 px, fp16. Its script also multiplies
    the loss by adv_clip_max (5): the learning rate here is the same, the loss 5 times smaller."""
    config = flow_grpo("stabilityai/stable-diffusion-3.5-medium")
    config.mixed_precision = "fp16"
    config.algorithm.objective = "nft"
    config.algorithm.objective_kwargs = ml_collections.ConfigDict({"beta": 0.1, "adaptive_weight": True})
    config.algorithm.old_decay_flat_steps, config.algorithm.old_decay_ramp = 75, 0.0075
    config.algorithm.old_decay_max = 0.999
    config.sample.deterministic = True
    config.sample.guidance_scale, config.train.cfg = 1.0, False
    config.kl.beta, config.kl.use_reference_model = 1e-4, True
    return config


def awm_sd35() -> ml_collections.ConfigDict:
    """AWM's published settings on Stable Diffusion 3.5 Medium (scxue/advantage_weighted_matching config/dgx_awm.py,
    its GenEval recipe, on the OCR task here: GenEval's detector is not shipped): CFG-free, deterministic rollouts of
    14 steps (40 to evaluate), the generalised Huber weighting (p = 0.25), KL 1e-3 to the base model, group 24, lr 3e-4,
    512 px, fp16. Not reproduced: its EMA-model KL, its time shift 3 on the training times (here the rollout
    schedule's), its advantage scale 1 / adv_clip_max (the loss here is 5 times larger)."""
    config = flow_grpo("stabilityai/stable-diffusion-3.5-medium")
    config.mixed_precision = "fp16"
    config.algorithm.objective = "awm"
    config.algorithm.objective_kwargs = ml_collections.ConfigDict({"weighting": "ghuber", "ghuber_power": 0.25})
    config.sample.deterministic = True
    config.sample.num_steps, config.sample.eval_num_steps = 14, 40
    config.sample.guidance_scale, config.train.cfg = 1.0, False
    config.kl.beta, config.kl.use_reference_model = 1e-3, True
    return config


def dgpo_sd35() -> ml_collections.ConfigDict:
    """DGPO's published OCR recipe on Stable Diffusion 3.5 Medium (Luo-Yihong/DGPO config/dgpo.py
    ``general_ocr_sd3_4gpu``, commit 01ceb4b, its default mode: rollouts with CFG 4.5), 8 groups of 16 an epoch on one
    process (theirs: 4 GPUs, 2 groups each), one optimizer step an epoch: beta 100, deterministic rollouts of 10 steps
    (14 to evaluate; their DPM-Solver is the Euler one here), 4 training times a sample among the rollout's, one noise
    per group, the frozen base model as reference, batch std, EMA 0.9 every 8 steps (evaluated and exported), LoRA
    rank 64 / alpha 128, lr 3e-4, 512 px, bf16. Differences: their training forward is the conditional branch alone,
    which the guidance check refuses after CFG sampling: here policy and reference are guided at 4.5 (train.cfg); their
    KL 0.02 to the base model (preference objectives take no kl.beta), PPO-style clip 1e-2 of the matching error
    against an EMA copy, rollouts from that copy after 200 steps and the truncation of the times to the 7 noisiest of
    the 10 steps are not reproduced; the gradient here is beta times theirs (theirs is the sigmoid weight times
    A_k e_k averaged, without the beta / K)."""
    config = flow_grpo("stabilityai/stable-diffusion-3.5-medium")
    config.mixed_precision = "bf16"  # their base config's
    config.lora_rank, config.lora_alpha = 64, 128
    config.algorithm.objective = "dgpo"
    config.algorithm.objective_kwargs = ml_collections.ConfigDict({"beta": 100.0})  # their train.beta_dpo
    config.algorithm.objective_times = "schedule"
    config.algorithm.global_std = True  # their sample.global_std
    config.sample.deterministic = True  # their noise_level 0
    config.sample.num_steps, config.sample.eval_num_steps = 10, 14
    config.sample.guidance_scale, config.train.cfg = 4.5, True
    config.sample.batch_size, config.sample.num_batches_per_epoch = 16, 8  # 8 groups of 16 on one process
    config.train.group_size = 16
    config.train.batch_size = 16  # one group a train batch
    config.train.gradient_accumulation_steps = 8  # theirs: one optimizer step an epoch
    config.train.timestep_fraction = 0.4  # int(10 * 0.4) = 4 times a sample: their num_train_timesteps
    config.train.ema, config.train.ema_decay, config.train.ema_update_interval = True, 0.9, 8
    config.train.ema_export = True  # their checkpoints hold the EMA weights
    config.kl.beta, config.kl.use_reference_model = 0.0, True
    config.save_freq, config.eval_freq = 60, 60
    return config


def dpo_sd35() -> ml_collections.ConfigDict:
    """Online Diffusion-DPO as Flow-Factory ships it on Stable Diffusion 3.5 Medium (X-GenGroup/Flow-Factory
    examples/dpo/lora/sd3_5/default.yaml and src/flow_factory/trainers/dpo.py, commit a0b2bc5): each group's best
    against its worst, 48 groups of 4 an epoch on one process (theirs: 8 GPUs), one optimizer step an epoch over the
    48 pairs, beta 100, one logit-normal training time a pair (no shift), the frozen base model as reference, CFG-free
    deterministic rollouts of 40 steps (40 to evaluate), group std, EMA 0.99 every 4 steps, LoRA rank 32 / alpha 64,
    lr 1e-5 (theirs: 3e-4 collapses), 512 px, bf16, the PickScore reward. Differences: their caption set is not
    shipped (simple_animals stands in, prompt_fn="from_file" reads yours); their times lie in [10, 1000] (timestep
    range 0.99), here in (0, 1000)."""
    config = flow_grpo("stabilityai/stable-diffusion-3.5-medium")
    config.mixed_precision = "bf16"
    config.algorithm.objective = "dpo"
    config.algorithm.objective_kwargs = ml_collections.ConfigDict({"beta": 100.0})
    config.algorithm.objective_times, config.algorithm.objective_time_shift = "logit_normal", 1.0
    config.algorithm.global_std = False
    config.sample.deterministic = True  # their ODE dynamics
    config.sample.num_steps, config.sample.eval_num_steps = 40, 40
    config.sample.guidance_scale, config.train.cfg = 1.0, False
    config.sample.batch_size, config.sample.num_batches_per_epoch = 24, 8  # 48 groups of 4 on one process
    config.train.group_size = 4
    config.train.batch_size = 96  # 48 pairs a train batch: all of an epoch's
    config.train.gradient_accumulation_steps = 1
    config.train.timestep_fraction = 0.025  # int(40 * 0.025) = 1 drawn time a pair
    config.train.learning_rate = 1e-5
    config.train.ema, config.train.ema_decay, config.train.ema_update_interval = True, 0.99, 4
    config.kl.beta, config.kl.use_reference_model = 0.0, True
    config.prompt_fn = "simple_animals"
    config.reward_fn = "pickscore"
    config.save_freq, config.eval_freq = 60, 60
    return config


def flow_factory_zimage_common(model: str) -> ml_collections.ConfigDict:
    """Flow-Factory's GRPO settings for Z-Image (X-GenGroup/Flow-Factory, examples/grpo/lora/z_image/default.yaml and
    examples/grpo/full/z_image_turbo/default.yaml): group 16, 512 px, Flow-SDE at noise level 0.7, clip 1e-4, advantages
    clipped at 5, no KL, the PickScore reward, bf16. Where ours differs: Flow-Factory makes one step of 1..3 stochastic
    (drawn at random), here the window is those 3 steps; their prompts are Pick-a-Pic's captions (dataset/pickscore),
    which are not shipped: simple_animals here (prompt_fn="from_file" with prompt_fn_kwargs.path reads a captions
    file)."""
    config = flow_factory(model)
    # Qwen3 tokens: only a prompt's own tokens reach the transformer, so this cuts nothing but captions over ~100 tokens
    config.pretrained.max_sequence_length = 128
    config.sample.resolution = 512
    config.sample.noise_level = 0.7
    config.sample.sde_window_start, config.sample.sde_window_size = 1, 3
    config.sample.batch_size, config.sample.num_batches_per_epoch = 8, 2  # 16 images per process: whole groups
    config.sample.text_embedding_cache = 4096  # Qwen3 meets each caption once
    config.train.batch_size = 8
    config.num_epochs, config.save_freq = 500, 40
    return config


def flow_factory_zimage() -> ml_collections.ConfigDict:
    """Flow-Factory's GRPO on Z-Image (the base model): LoRA rank 64 / alpha 128, lr 3e-4, 10 rollout steps (40 to
    evaluate), classifier-free guidance 4.0 (Z-Image's u_c + w (u_c - u_uncond)) in sampling and training."""
    config = flow_factory_zimage_common("Tongyi-MAI/Z-Image")
    config.sample.num_steps, config.sample.eval_num_steps = 10, 40
    config.sample.guidance_scale, config.train.cfg = 4.0, True
    return config


def flow_factory_zimage_turbo() -> ml_collections.ConfigDict:
    """Flow-Factory's GRPO on Z-Image-Turbo: full fine-tuning at lr 1e-5, 6 rollout steps (10 to evaluate), no guidance
    (guidance_scale 0, as the model card samples it)."""
    config = flow_factory_zimage_common("Tongyi-MAI/Z-Image-Turbo")
    config.use_lora = False
    config.train.learning_rate = 1e-5
    config.sample.num_steps, config.sample.eval_num_steps = 6, 10
    config.sample.guidance_scale, config.train.cfg = 0.0, False
    return config


def flow_factory_flux_kontext() -> ml_collections.ConfigDict:
    """Flow-Factory's GRPO LoRA recipe for FLUX.1 Kontext [dev] (github:X-GenGroup/Flow-Factory,
    examples/grpo/lora/flux1_kontext/default.yaml at 5f6cda1): LoRA rank 64 / alpha 128, 384 px (the source images
    too), 10 rollout steps (20 to evaluate), guidance 2.5 as FLUX's guidance embedding, Flow-SDE at noise level 0.9
    with one stochastic step (theirs drawn from steps 1-3 each epoch, ours fixed at step 1), group 16, 48 prompts
    per epoch over 8 processes, 2 optimizer steps per epoch, clip 1e-4, advantages clipped at 5, no KL, lr 3e-4,
    EMA 0.9 every 4 steps, bf16, PickScore. Their evaluation samples at 512 px; ours at the training size. The
    editing dataset is yours: a .jsonl prompt file (prompt_fn from_file, rows {"prompt", "image"}) in
    prompt_fn_kwargs.path."""
    config = flow_factory("black-forest-labs/FLUX.1-Kontext-dev")
    config.sample.resolution = 384
    config.sample.num_steps, config.sample.eval_num_steps = 10, 20
    config.sample.guidance_scale, config.train.cfg = 2.5, False
    config.sample.noise_level = 0.9
    config.sample.sde_window_start, config.sample.sde_window_size = 1, 1
    config.sample.batch_size, config.sample.num_batches_per_epoch = 8, 12  # 96 per process: 48 groups of 16 over 8
    config.sample.text_embedding_cache = 4096  # T5 and the VAE meet each (prompt, source image) once
    config.train.batch_size, config.train.gradient_accumulation_steps = 8, 6  # 2 optimizer steps per epoch
    config.train.ema, config.train.ema_decay, config.train.ema_update_interval = True, 0.9, 4
    config.prompt_fn = "from_file"
    config.num_epochs, config.save_freq = 500, 20
    return config


def flow_factory_flux2_klein() -> ml_collections.ConfigDict:
    """Flow-Factory's GRPO recipe on FLUX.2 [klein] 9B (step-distilled), X-GenGroup/Flow-Factory
    examples/grpo/lora/flux2_klein/default.yaml (commit 5f6cda1a): LoRA rank 64 / alpha 128, 384 px, 4 rollout steps
    (10 to evaluate), guidance 1 (the distilled model has no CFG), Flow-SDE at noise level 0.5 on one step, group 16,
    clip 1e-4, advantages clipped at 5, no KL, lr 3e-4, EMA 0.9, bf16, PickScore. Differences: their one SDE step is
    drawn from steps {1, 2} per rollout, here the window is step 1; they evaluate at 1024 px, here at the training
    resolution; their prompts (a ShareGPT-4o image-caption set) are not shipped: simple_animals stands in."""
    config = flow_factory("black-forest-labs/FLUX.2-klein-9B")
    config.sample.resolution = 384
    config.sample.num_steps, config.sample.eval_num_steps = 4, 10
    config.sample.guidance_scale, config.train.cfg = 1.0, False
    config.sample.noise_level = 0.5
    config.sample.sde_window_start, config.sample.sde_window_size = 1, 1
    # 48 prompts x 16 copies per epoch over 8 GPUs: 96 images per process, 2 optimizer steps of 48
    config.sample.batch_size, config.sample.num_batches_per_epoch = 16, 6
    config.train.batch_size, config.train.gradient_accumulation_steps = 16, 3
    config.train.ema, config.train.ema_decay = True, 0.9
    config.train.ema_update_interval = 8  # theirs: every 4 epochs of 2 optimizer steps
    config.eval_freq = 20
    config.save_freq = 20
    return config


def flow_factory_flux2_klein_base() -> ml_collections.ConfigDict:
    """Flow-Factory's GRPO recipe on FLUX.2 [klein] base 9B (not distilled), X-GenGroup/Flow-Factory
    examples/grpo/lora/flux2_klein_base/default.yaml (commit 5f6cda1a): the klein recipe's settings but 8 rollout steps
    (28 to evaluate), CFG 4 with the empty prompt in sampling and training, noise level 0.7 (their one SDE step is
    drawn from steps {1, 2, 3}; here the window is step 1)."""
    config = flow_factory_flux2_klein()
    config.pretrained.model = "black-forest-labs/FLUX.2-klein-base-9B"
    config.sample.num_steps, config.sample.eval_num_steps = 8, 28
    config.sample.guidance_scale, config.train.cfg = 4.0, True
    config.sample.noise_level = 0.7
    return config


def flow_factory_wan21() -> ml_collections.ConfigDict:
    """Flow-Factory's GRPO LoRA recipe for Wan2.1 text-to-video (github:X-GenGroup/Flow-Factory,
    examples/grpo/lora/wan21/t2v.yaml, commit 5f6cda1a; Flow-GRPO publishes no Wan recipe): Wan2.1-T2V-14B, LoRA
    rank 64 / alpha 128, bf16, 5 frames of 256 px, 10 Flow-SDE steps at noise level 0.9 (28 to evaluate), CFG 5.0 in
    sampling and training, group 16, clip 1e-4, advantages clipped to 5, no KL, lr 1e-4, weight decay 1e-4, EMA 0.9
    every 4 steps, one video per process at a time; the flow shift is the model's scheduler's (3.0 for 480p).
    Differences: Flow-Factory trains one SDE step drawn from steps 1-3 each time, here the window is steps 1-3;
    its rewards are CLIP text alignment (1.0) and PickScore (0.5) on the PickScore prompts, here the same rewards
    (their models download) with advantages normalised per reward ("gdpo") on the embedded animal prompts
    (--config.prompt_fn=from_file with the PickScore prompt list for theirs)."""
    config = flow_factory("Wan-AI/Wan2.1-T2V-14B-Diffusers")
    config.sample.resolution, config.sample.num_frames = 256, 5
    config.sample.num_steps, config.sample.eval_num_steps = 10, 28
    config.sample.noise_level = 0.9
    config.sample.sde_window_start, config.sample.sde_window_size = 1, 3
    config.sample.guidance_scale, config.train.cfg = 5.0, True
    config.sample.batch_size, config.sample.num_batches_per_epoch = 1, 16
    config.sample.text_embedding_cache = 1024  # UMT5 meets each prompt once
    config.train.batch_size = 1
    config.train.learning_rate, config.train.adam_weight_decay, config.train.max_grad_norm = 1e-4, 1e-4, 1.0
    config.train.ema, config.train.ema_decay, config.train.ema_update_interval = True, 0.9, 4
    config.reward_fn = {"clipscore": 1.0, "pickscore": 0.5}
    config.algorithm.multi_reward_mix, config.algorithm.global_std = "advantage_aggr", True  # GDPO: the batch std
    config.save_freq, config.eval_freq = 20, 20
    return config



def flow_factory_wan21_i2v() -> ml_collections.ConfigDict:
    """Flow-Factory's GRPO LoRA recipe for Wan2.1 image-to-video (github:X-GenGroup/Flow-Factory,
    examples/grpo/lora/wan21/i2v.yaml, commit 5f6cda1a; Flow-GRPO publishes none): Wan2.1-I2V-14B-480P (the 720P
    model takes the same settings), LoRA rank 64 / alpha 128 on the attention and feed-forward (their adapter's
    default targets), bf16, 5 frames of 240 px animating each prompt's source image, 10 Flow-SDE steps at noise level
    0.9 (28 to evaluate), CFG 5.0 in sampling and training, groups of 16, 48 prompts an epoch over 8 processes (96
    videos a process, one at a time) and 2 optimizer steps an epoch, clip 1e-4, advantages clipped to 5, no KL, lr 1e-4,
    weight decay 1e-4, EMA 0.9, the PickScore reward. Differences: their one stochastic step is drawn from steps 1-3
    each rollout, here the window is steps 1-3; their SDE runs on the released UniPC scheduler, here on the flow Euler
    scheduler of the model's shift (models/families/wan.py); their EMA moves every 4 epochs (8 optimizer steps here);
    they evaluate at 480 px, here at the training size; their dataset (ShareGPT-4o images with captions) is not
    shipped: a .jsonl prompt file of yours (prompt_fn from_file, rows {"prompt", "image"}) in prompt_fn_kwargs.path."""
    config = grpo()
    config.pretrained.model = "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"
    config.mixed_precision = "bf16"
    config.use_lora, config.lora_rank, config.lora_alpha = True, 64, 128
    config.sample.resolution, config.sample.num_frames = 240, 5
    config.sample.num_steps, config.sample.eval_num_steps = 10, 28
    config.sample.sde_type, config.sample.noise_level = "flow_sde", 0.9
    config.sample.sde_window_start, config.sample.sde_window_size = 1, 3
    config.sample.guidance_scale, config.train.cfg = 5.0, True
    config.sample.batch_size, config.sample.num_batches_per_epoch = 1, 96  # 48 groups of 16 over 8 processes
    config.sample.text_embedding_cache = 1024  # UMT5, CLIP and the VAE meet each (prompt, source image) once
    config.train.group_size = 16
    config.train.batch_size, config.train.gradient_accumulation_steps = 1, 48  # 2 optimizer steps an epoch
    config.train.learning_rate, config.train.adam_weight_decay, config.train.max_grad_norm = 1e-4, 1e-4, 1.0
    config.train.clip_range, config.train.adv_clip_max = 1e-4, 5.0
    config.train.ema, config.train.ema_decay, config.train.ema_update_interval = True, 0.9, 8
    config.kl.beta, config.kl.use_reference_model = 0.0, False
    config.prompt_fn = "from_file"
    config.reward_fn = "pickscore"
    config.num_epochs, config.save_freq, config.eval_freq = 500, 20, 20
    return config

PRESETS = {
    "ddpo": ddpo, "grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo, "grpo_passk": grpo_passk,
    "reinforce_pp": reinforce_pp, "remax": remax, "ppo_gae": ppo_gae, "group_ppo": group_ppo,
}
# recipes: the embedded flow model's task, and the published recipes on the models people train (their weights
# download from the hub)
RECIPES = {"grpo_flow": grpo_flow, "group_ppo_flow": group_ppo_flow, "awm": awm, "nft": nft, "dpo": dpo, "dgpo": dgpo,
           "flow_grpo_sd35": flow_grpo_sd35, "flow_grpo_flux": flow_grpo_flux,
           "flow_factory_zimage": flow_factory_zimage, "flow_factory_zimage_turbo": flow_factory_zimage_turbo,
           "flow_factory_flux_kontext": flow_factory_flux_kontext, "flow_factory_flux2_klein": flow_factory_flux2_klein,
           "flow_factory_flux2_klein_base": flow_factory_flux2_klein_base, "flow_factory_wan21": flow_factory_wan21,
           "flow_grpo_qwenimage": flow_grpo_qwenimage,
           "flow_grpo_qwenimage_edit_plus": flow_grpo_qwenimage_edit_plus, "nft_sd35": nft_sd35, "awm_sd35": awm_sd35,
           "dgpo_sd35": dgpo_sd35, "dpo_sd35": dpo_sd35, "flow_factory_wan21_i2v": flow_factory_wan21_i2v}


def get_config(name: str = "ddpo") -> ml_collections.ConfigDict:
    known = {**PRESETS, **RECIPES}
    if name not in known:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(sorted(known))}")
    config = known[name]()
    config.preset = name
    return config
