"""Training configurations: one base, named presets derived from it.

    accelerate launch scripts/train.py --config config/base.py:ddpo --config.train.learning_rate=1e-4

Field names follow ddpo-pytorch where it has them.
"""

import ml_collections
from ml_collections.config_dict import FieldReference

from config.recipes import RECIPES


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
    config.num_epochs = 40  # epochs to train
    config.save_freq = 20  # epochs between checkpoints (0: only at the end)
    config.num_checkpoint_limit = 5  # checkpoints kept per run; older ones are deleted
    config.mixed_precision = "no"  # "no", "fp16" or "bf16"
    config.allow_tf32 = True  # TF32 matrix multiplications on CUDA (Ampere and newer)
    config.device = ""  # "": CUDA when visible (accelerate's choice); "cpu": the CPU even on a GPU machine
    # bitwise-reproducible CUDA runs and resume: deterministic kernels, CUBLAS_WORKSPACE_CONFIG (docs/performance.md
    # has its cost); CPU runs are deterministic already
    config.deterministic = False
    # torch threads per process; 0: the environment's, or the cores per process on a CPU run that accelerate launch
    # left at its default of one thread (ddpo_group/run/processes/threads.py)
    config.num_cpu_threads = 0
    # several processes: a collective that waits longer than this (a process hung or died) stops every process with an
    # error instead of leaving them blocked (ddpo_group/run/processes/process_failures.py)
    config.collective_timeout_s = 1800
    config.resume_from = ""  # a checkpoint directory or a run directory (its newest checkpoint that verifies); "": a new run
    config.use_lora = True  # train LoRA adapters (peft); False: the whole denoiser
    config.lora_rank = 4  # LoRA rank r
    config.lora_alpha = 0  # LoRA scale alpha / rank; 0: alpha = rank (Flow-GRPO's recipes use rank 32, alpha 64)
    # peft's lora_dropout of the policy's adapter: its input dropped in the update's forward only (sampling runs in eval
    # mode), so the training forward is random and not the sampler's (algorithm.rollout_correction weighs that)
    config.lora_dropout = 0.0
    # performance options (docs/performance.md): none helps the embedded model on a CPU
    config.unet_channels_last = False  # channels-last memory format for a UNet denoiser (convolutions on GPUs)
    # torch.compile the denoiser (a minute or more of compilation in the first epoch, applied after the reference model
    # is built): "auto" ("regional" on CUDA for a transformer denoiser of 1B parameters or more; off on the CPU, for
    # smaller models, for UNets, under FSDP and with deterministic=True), False (off), "full" (its whole forward; True
    # means the same) or "regional" (diffusers' compile_repeated_blocks: each repeated block, one compilation for all)
    config.compile_denoiser = FieldReference("auto", field_type=object)
    # CUDA graphs for the sampling steps: the rollouts' (and ReMax's greedy) denoiser forwards go through a copy of the
    # denoiser sharing its weights, compiled with torch.compile(mode="reduce-overhead"), each batch shape recorded once
    # and replayed (a minute or more of compilation in the first epoch; the graphs' memory stays reserved through
    # training, which pairs_per_forward="auto" measures after it; training keeps compile_denoiser's, evaluation the
    # plain denoiser). CUDA only, not under FSDP, nor with an objective that samples with its old model (nft); off by
    # default until it is measured beside regional compilation (docs/performance.md)
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
    # "qwenimage_edit_plus", "qwenimage_edit", "sana", "qwenimage21", "hunyuan_video15" or "ltx2"; "": from
    # model_index.json's pipeline class
    pretrained.family = ""
    # text tokens per prompt of the T5 / LLM text encoder (SD3, FLUX.1, Wan: T5; Z-Image, FLUX.2: Qwen3 / Mistral;
    # Qwen-Image: Qwen2.5-VL, at most 1024; SANA: Gemma-2, after its instruction; Qwen-Image 2.1: Qwen3-VL, whose
    # pipeline keeps every token: a longer prompt is refused; LTX-2: Gemma-3), the stored embeddings padded to it; 0: the
    # pipeline's default (SD3: 256, SANA: 300, LTX-2: 1024, the others 512)
    pretrained.max_sequence_length = 0
    pretrained.text_encoder_device = ""  # "cpu" keeps the text encoders off the GPU (their embeddings move to it)
    # FLUX.2: the text encoder's hidden layers stacked into the condition (the pipeline's text_encoder_out_layers);
    # (): the pipeline's default, klein's 9, 18, 27 and dev's 10, 20, 30 (a smaller text encoder needs its own)
    pretrained.text_encoder_out_layers = ()

    # ---- sampling (the rollouts) ----
    config.sample = sample = ml_collections.ConfigDict()
    sample.num_steps = 10  # denoising steps of a rollout (Flow-GRPO's 10)
    # steps of the deterministic evaluation (eval_freq) and of scripts/evaluate.py; 0: num_steps (Flow-GRPO's 40)
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
    # video families (Wan, Wan image-to-video, HunyuanVideo 1.5, SANA-Video, Kandinsky 6, Cosmos 3: 4 k + 1, e.g. 5,
    # 33, 81; LTX-2: 8 k + 1; Cosmos 3: 1 is an image): frames per video; 0: the pipeline's default (Wan's and
    # SANA-Video's 81, HunyuanVideo 1.5's, LTX-2's and Kandinsky 6's 121, Cosmos 3's 189)
    sample.num_frames = 0
    # Cosmos 3 only (a sound-capable checkpoint): sample its soundtrack with the video (its call's enable_sound) and
    # give it to the rewards; LTX-2 and Kandinsky 6 always sample theirs
    sample.audio = False
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
    # the dtype the step's Gaussian log-density is computed and reduced in: "float32" (the step's math) or "float64"
    # (Flow-Factory's: less rounding of a large latent's reduction; scripts/check.py measures what it changes)
    sample.log_prob_dtype = "float32"
    # the sampling forwards' precision: "" the run's (mixed_precision); "bf16" or "fp16": under that autocast while the
    # update trains in mixed_precision, as a rollout engine in lower precision samples: the sampler and the trainer then
    # differ (train/ratio_before_update shows by how much; train.recompute_rollout removes it)
    sample.precision = ""
    # every step the family's deterministic step (noise level 0; the ODE solver of flow models) and no log-probs: only
    # for a matching objective (algorithm.objective), which trains on the final samples
    sample.deterministic = False
    sample.same_initial_noise = False  # the copies of a prompt share their initial noise x_0 and differ by their step noise only
    # SDE window (Flow-GRPO-Fast): only steps [start, start + size) are stochastic and trained; the others are
    # deterministic DDIM steps. Size 0: every step. Early steps decide the composition, so a small early window
    # concentrates the credit of the reward on few steps (and trains size / num_steps of the pairs).
    # Default: the first 2 of 10 steps, where the embedded model decides the shape (docs/studies/learning_proof/).
    sample.sde_window_start = 0  # the window's first step
    sample.sde_window_size = 2  # the window's number of steps (0: every step is stochastic and trained)
    # tree rollouts (docs/design/TREES.md): a prompt group's copies share x_0 and their first steps and split at these
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
    # LTX-2 only: its call's guidance keywords beyond guidance_scale (audio_guidance_scale, stg_scale, audio_stg_scale,
    # modality_scale, audio_modality_scale, guidance_rescale, audio_guidance_rescale, spatio_temporal_guidance_blocks),
    # in sampling and the training forward; one unset is the call's default (its audio CFG 7, spatio-temporal guidance 1
    # at block 28, modality isolation 3, rescale 0.7: 4 forwards a step); an audio one 0 is the video's
    sample.pipeline_guidance = ml_collections.ConfigDict()

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
    # Flow-DPPO's trust region (algorithm.policy_loss="dppo"): the exact KL of a step's Gaussians, rollout to trained
    # policy, at which a pair the update moves further away is masked (UniRL's and VeRL-Omni's kl_mask_threshold)
    train.policy_kl_threshold = 1e-5
    # before the epoch's first update, recompute the rollout policy's log-probabilities and step means with the
    # training forward at the weights that sampled (verl's recomputed old log-probs; UniRL's replay for Flow-DPPO):
    # where the sampler and the trainer differ (another engine or precision), the update's ratios start at 1 and its
    # KL at 0 instead of clipping or masking on the difference (train/rollout_recomputed_kl says how far they were);
    # one forward (no backward) a trained pair
    train.recompute_rollout = False
    # the share of a trajectory's trainable steps each inner epoch trains, int(W * step_fraction) of its W drawn at random
    # (ddpo-pytorch's timestep_fraction: it chooses step indices, not timesteps)
    train.step_fraction = 1.0
    # (sample, step) pairs per training forward, or "auto": 32 on the CPU; on CUDA the most that fit the card, measured
    # at the first update with the loaded model (first guessed from the traced memory plan when it holds this run) and
    # kept in checkpoints (ddpo_group/update/memory_fit.py)
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
    # the KL term only on prompts that fell below their start: a sample's term counts while its prompt's mean reward over
    # its last kl.start_window samples is below the mean of its first kl.start_window (the term in the loss)
    kl.only_below_start = False
    kl.start_window = 16  # samples of a prompt in its start and in its current level

    # ---- on-policy distillation (algorithm.objective="opd"; ddpo_group/reference/teachers.py, docs/algorithms.md) ----
    config.opd = opd = ml_collections.ConfigDict()
    # the frozen teachers, {name: path}: a LoRA directory in diffusers format (a run's lora/, or the run directory),
    # an adapter on the student's own denoiser; or a denoiser directory (config.json and weights), a frozen copy.
    #   --config.opd.teachers='{"aesthetic": "runs/aesthetic", "ocr": "runs/ocr"}'
    opd.teachers = FieldReference({}, field_type=object)
    opd.route_key = ""  # a prompt metadata key naming each prompt's teacher; "": every teacher scores every prompt
    opd.beta = 1.0  # weight of the teachers' closed-form KL per step (slime's --opd-kl-coef)
    opd.reward_weight = 0.0  # weight of the policy loss on the reward's advantages beside it (0: distillation alone)

    # ---- supervised fine-tuning on a folder of images, the run's first epochs (ddpo_group/rollout/image_folder.py) ----
    config.sft = sft = ml_collections.ConfigDict()
    # the folder: metadata.jsonl (file_name, text: Hugging Face's imagefolder) or a .txt prompt beside each image;
    # "": none. Its images are encoded by the model's VAE and fitted by the matching loss (the sft objective's)
    sft.data_dir = ""
    # the run's first sft.epochs epochs train on the folder (each: sample.batch_size * num_batches_per_epoch images a
    # process), then reinforcement learning goes on to num_epochs; sft.epochs = num_epochs: supervised only
    sft.epochs = 0

    # ---- algorithm ----
    config.algorithm = algorithm = ml_collections.ConfigDict()
    # a registered name, or a plugin "package.module:function" / "/path/file.py:function" (docs/algorithms.md)
    algorithm.adv_estimator = "ddpo"
    algorithm.adv_estimator_kwargs = ml_collections.ConfigDict()  # keywords of the estimator (add to / override its own)
    # what the update minimises (docs/algorithms.md): "policy_gradient" (algorithm.policy_loss over the recorded
    # step log-probs), or a matching objective on the forward process of the final samples: "awm" (advantage weighted
    # matching), "nft" (DiffusionNFT), "sft" (supervised fine-tuning on the run's own samples whose advantage passes
    # objective_kwargs.min_advantage), "dpo" (online Diffusion-DPO, each group's best against its worst, against the
    # kl section's reference model), "dgpo" (a group-level preference of every sample of a group, against that
    # reference); "opd" (on-policy distillation from the opd section's teachers); or a plugin path, as adv_estimator
    # (ddpo_group/algorithms/objectives.py)
    algorithm.objective = "policy_gradient"
    # keywords of the objective: awm's weighting ("uniform", "t" or "ghuber"), ghuber_power and old_kl_beta (> 0: a KL
    # to the old model, which then follows the old_decay_* schedule); nft's beta (its guidance strength, > 0) and
    # adaptive_weight (True: its adaptive loss weighting); sft's min_advantage (0: the samples above their group's mean);
    # dpo's and dgpo's beta (their temperature, > 0)
    algorithm.objective_kwargs = ml_collections.ConfigDict()
    # the matching objectives' training times: "schedule" (the rollout schedule's times, int(T * step_fraction) of
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
    # rollout correction (verl's, decoupled mode; algorithms/rollout_correction.py): for rollouts sampled by something
    # other than the training forward (sample.precision, another engine), the rollout's log-probabilities are
    # recomputed by the training forward at the weights that sampled (as train.recompute_rollout) and each trained
    # pair's loss is weighed by the ratio pi_old / pi_rollout, truncated, and/or dropped when that ratio leaves a band;
    # train/rollout_is_weight_mean, _std, rollout_is_truncated, rollout_rs_masked, rollout_log_ratio_abs say how much
    algorithm.rollout_correction = rollout_correction = ml_collections.ConfigDict()
    # the importance weights' level: "" none, "step" (each step's ratio; verl's "token"), "trajectory" (the product of
    # its trained steps' ratios; verl's "sequence")
    rollout_correction.is_level = ""
    rollout_correction.is_threshold = 2.0  # the weights' cap (truncated importance sampling)
    rollout_correction.rs_level = ""  # rejection's level: "" none, "step" or "trajectory", as is_level
    rollout_correction.rs_threshold = 2.0  # a pair (or trajectory) whose ratio is above this is not trained
    rollout_correction.rs_threshold_lower = 0.0  # ... or below this (0: 1 / rs_threshold)
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
    # decoded one-step prediction clean_hat(x_n): one more reward query per sample and valued step), "blend", "tree" (the
    # mean reward of the leaves below each node of tree rollouts, measured, no query more; cuts at the branch steps;
    # without sample.branch_steps a default tree: sampling/tree.py)
    group_ppo.value_source = "critic"
    group_ppo.value_blend = 0.5  # "blend": V = w * tweedie + (1 - w) * residual critic
    # residual_critic / blend: the critic's deviation f weighted by its explained variance of the epoch before,
    # clip(EV, 0, 1) (0 before it is measured): a critic that explains nothing adds nothing to the advantages (grpo's)
    group_ppo.critic_weight_by_ev = False

    # ---- critic V(latent, timestep, text) (ppo_gae, group_ppo) ----
    config.critic = critic = ml_collections.ConfigDict()
    critic.hidden_dim = 64  # the value network's width
    critic.learning_rate = 1e-3  # the critic's AdamW learning rate
    critic.weight_decay = 0.0  # the critic's AdamW weight decay
    critic.value_clip_range = 0.2  # clipped value loss range, in reward units (None: unclipped)
    critic.num_updates = 1  # passes over the epoch's samples per epoch
    critic.warmup_epochs = 0  # the first epochs train the critic only: the policy stays as it is
    # "latent": V(x_n, t_n, c); "latent_clean_hat": V([x_n, clean_hat(x_n)], t_n, c), the step's one-step prediction of the
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
    # the metrics, eval.jsonl, samples/eval_*.png; the curves and the guard read it
    config.eval_freq = 10
    config.eval_num_prompts = 8  # distinct prompts drawn once from prompt_fn by a generator seeded by seed (its own)
    config.eval_num_seeds = 8  # initial noises per prompt (noise j is the same for every prompt)
    config.eval_prompt_file = ""  # a text file, one prompt a line: evaluate these instead of the drawn ones
    config.eval_group_by = ""  # a prompt metadata key (tiny_shapes: "shape", "color", ...) to group eval/ by; "": prompt
    config.eval_train_sampler = False  # also evaluate with the training sampler (noise level, SDE window)
    # held-out rewards scored on the evaluation's images beside the training reward, never trained on (a proxy's
    # hacking shows as these falling): a name, a path or {name: weight}, as reward_fn; "": none (eval_heldout/*)
    config.eval_reward_fn = FieldReference("", field_type=object)
    config.eval_reward_fn_kwargs = ml_collections.ConfigDict()  # its factory's keywords, as reward_fn_kwargs
    # the image features of eval/diversity (ddpo_group/run/reporting/image_stats.py): "" a reward's own CLIP image
    # encoder when one has it (pickscore, clipscore, aesthetic), else "pixels" (the images at 32 x 32 px: no download);
    # or a CLIP model to load (a hub id or directory of a transformers CLIPModel)
    config.eval_diversity_features = ""
    # the fresh final evaluation (ddpo_group/run/fresh_evaluation.py): at the end, the weights handed over (lora/) and
    # the best evaluation's (lora_best/) beside the base model on the evaluation's prompts x this many initial noises
    # that no evaluation during training uses; the run summary's before -> after, its standard error and the verdict
    # (summary.json); 0: none
    config.final_eval_num_seeds = 16

    # ---- the guard (ddpo_group/run/guard.py): rules over the evaluations that name reward hacking when it starts ----
    config.guard = guard = ml_collections.ConfigDict()
    # what an alarm does: "warn" (one line naming the rule, its numbers and the best evaluation), "stop" (a checkpoint,
    # then a clean exit 0 with the resume command), "restore" (the line, and on the fall and held-out rules the best
    # evaluation's weights loaded back into the policy with all the run had learned then (its optimizers' state, the
    # critic, the estimator's controller, the KL term's gates and reference, the EMA), and training goes on; a restore
    # after the last epoch is evaluated again) or "off"; the best evaluation's weights are kept either way
    guard.on_alarm = "warn"
    # held-out reward below its best by more than this many standard errors of the evaluation while the evaluation's
    # training reward rose above its value then (eval_reward_fn set; a groupwise reward: its pointwise score)
    guard.heldout_drop = 2.0
    # the evaluation's training reward (a groupwise reward: its pointwise score) below its best by more than this many
    # standard errors and below its value before training: the run is losing what it learnt
    guard.fall_drop = 2.0
    guard.min_diversity = 0.5  # eval/diversity below this fraction of its value before training
    # some |eval/drift/*| (brightness, contrast, saturation, high-frequency share; with audio its level and flatness)
    # above this many times that statistic's spread (its std) over the evaluation's samples before training. Healthy
    # flow-recipe runs move their look by up to 1.15 spreads while they learn (48 runs), hacked runs the rule named by
    # 1.43 and more (docs/studies/guard/README.md)
    guard.max_drift = 1.25

    # ---- logging ----
    config.wandb = wandb = ml_collections.ConfigDict()
    wandb.mode = "online"  # "online", "offline" or "disabled"; online falls back to offline without an API key
    wandb.project = "ddpo-group"  # the wandb project
    wandb.entity = ""  # the wandb entity (user or team); "": your default
    config.log_images_every = 1  # epochs between image grids (0: never)
    config.export_lora = True  # with use_lora: diffusers-format LoRA in <run>/lora and in every checkpoint
    return config


def ddpo() -> ml_collections.ConfigDict:
    """DDPO (Black et al.): per-prompt stat tracker advantages, clipped PPO loss: base()'s algorithm."""
    return base()


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
    """GROUP_PPO (GROUP_PPO.md): dynamic step groups per prompt group, critic at the endpoints, adaptive tau; its
    advantages divided by the group's reward std (base()'s train.scale_rewards: GROUP_PPO.md makes it optional, it
    learns faster on the default task, docs/group_ppo.md)."""
    config = base()
    config.algorithm.adv_estimator = "group_ppo"
    config.train.group_size = 8
    # the critic learns each sample's deviation from its group's mean reward: an untrained critic gives grpo's
    # advantages instead of noise (docs/studies/group_ppo_values/: the study of the value sources)
    config.group_ppo.value_source = "residual_critic"
    # what it hands over: the guard's restore, evaluated every 5 epochs, on a fall of 1 standard error below the best
    # evaluation and below the start (docs/studies/handover/: ended at or above its start on fresh images)
    config.eval_freq = 5
    config.guard.on_alarm = "restore"
    config.guard.fall_drop = 1.0
    return config


PRESETS = {
    "ddpo": ddpo, "grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo, "grpo_passk": grpo_passk,
    "reinforce_pp": reinforce_pp, "remax": remax, "ppo_gae": ppo_gae, "group_ppo": group_ppo,
}


def get_config(name: str = "group_ppo") -> ml_collections.ConfigDict:
    """The preset or recipe ``name`` (config/recipes.py: a function of the preset it starts from), its name in
    ``config.preset``."""
    if name in PRESETS:
        config = PRESETS[name]()
    elif name in RECIPES:
        preset, change = RECIPES[name]
        config = change(PRESETS[preset]())
    else:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(sorted({**PRESETS, **RECIPES}))}")
    config.preset = name
    return config
