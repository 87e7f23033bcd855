"""The recipes: the embedded flow model's task, the matching objectives on it, and the published recipes on the models
people train (their weights download from the hub). Each is a function that takes a fresh config of the preset of
config/base.py it names (``@recipe("grpo")``), sets only what differs from it (or from another recipe it calls) and
returns it. Pick one as a preset: ``--config config/base.py:NAME``.
"""

import ml_collections


RECIPES: dict = {}  # name -> (the preset of config/base.py it starts from, the function that changes that preset's config)


def recipe(preset: str):
    """Registers the decorated function as the recipe of its name: it changes a fresh config of ``preset``
    (config/base.py's get_config builds it) and returns it."""
    def register(change):
        RECIPES[change.__name__] = (preset, change)
        return change
    return register


def on_flow_model(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """``config`` on the embedded flow-matching model: its hardest captions (it already draws the SD model's right) and
    half the learning rate (3e-3 makes its rank-4 LoRA collapse; docs/embedded_models.md)."""
    config.pretrained.model = "tiny-shapes-flow"
    config.prompt_fn = "tiny_shapes_flow_hard"
    config.train.learning_rate = 1.5e-3
    return config


@recipe("grpo")
def grpo_flow(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """GRPO on the embedded flow-matching model (10 Flow-SDE steps, the first 2 stochastic and trained)."""
    return on_flow_model(config)


@recipe("group_ppo")
def group_ppo_flow(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """GROUP_PPO on the embedded flow-matching model, its residual critic weighted by its explained variance (the
    critic explains none of a sample's deviation there: EV below 0 on 16 seeds of 16, its output only noise in the
    advantages), a rank-16 LoRA and a KL term of weight 1 to the base model on the prompts whose reward fell below
    their start (kl.only_below_start): the rank-4 LoRA learning three squares lost the circle caption in about one run
    in five, by up to 0.40. On 119 seeds that chose nothing it is level with the recipe as first published (critic
    weight 1, rank 4, no KL): gain +0.005 (-0.007 to +0.017), ended below its start on 1 against 2: a rare fall in both.
    It hands over as the group_ppo preset does, through the guard's restore (every 5 epochs, at 1 standard error), which
    undoes a fall where an evaluation sees it. Counted on images no run was evaluated on: where the restore fired on the
    published recipe (12 runs of 124) it turned 4 runs below their start into 0 (exact one-sided p = 0.0625) and 6
    that fell or did not learn into 0 (p = 0.016); on 16 new seeds this recipe ended above its start on all 16
    (lowest +0.075, one restore; docs/studies/group_ppo_fall/, docs/studies/handover/)."""
    config = on_flow_model(config)
    config.group_ppo.critic_weight_by_ev = True
    config.lora_rank = 16
    config.kl.beta = 1.0
    config.kl.use_reference_model = True
    config.kl.only_below_start = True
    return config


def matching(config: ml_collections.ConfigDict, objective: str) -> ml_collections.ConfigDict:
    """A matching objective on the embedded flow-matching model: GRPO's group advantages (group 8), rollouts with the
    deterministic Euler solver (no SDE, no log-probs), every rollout step's time trained once per epoch."""
    config = on_flow_model(config)
    config.algorithm.objective = objective
    config.sample.deterministic = True
    config.kl.beta = 0.0
    config.kl.use_reference_model = False
    return config


@recipe("grpo")
def awm(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """AWM (advantage weighted matching, arXiv:2509.25050): the flow-matching loss of each sample weighted by its
    group advantage, on the embedded flow model."""
    return matching(config, "awm")


@recipe("grpo")
def nft(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """DiffusionNFT (arXiv:2509.16117) on the embedded flow model, CFG-free as the paper trains it (guidance 1 in
    sampling and training): implicit positive / negative policies around an old model that samples the rollouts,
    beta 1, its adaptive loss weighting, the old model's decay min(0.001 k, 0.5) after k optimizer steps."""
    config = matching(config, "nft")
    config.algorithm.objective_kwargs = ml_collections.ConfigDict({"beta": 1.0, "adaptive_weight": True})
    config.sample.guidance_scale, config.train.cfg = 1.0, False
    return config


@recipe("grpo")
def sft(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Supervised fine-tuning on the run's own best samples (reward-filtered) on the embedded flow model: the
    flow-matching loss of each sample above its group's mean reward (group 8, min_advantage 0), the others left out."""
    config = matching(config, "sft")
    config.algorithm.objective_kwargs = ml_collections.ConfigDict({"min_advantage": 0.0})
    return config


@recipe("grpo")
def dpo(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Online Diffusion-DPO (arXiv:2311.12908) on the embedded flow model: each prompt group's best sample against its
    worst (group 8), against the frozen base model (the KL section's reference, no KL term), deterministic rollouts,
    beta 2000 (Flow-Factory's online default)."""
    config = matching(config, "dpo")
    config.kl.use_reference_model = True
    config.algorithm.objective_kwargs = ml_collections.ConfigDict({"beta": 2000.0})
    return config


@recipe("grpo")
def dgpo(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """DGPO (arXiv:2510.08425) on the embedded flow model: a group-level preference over every sample of a prompt group
    (group 8, advantage-weighted), against the frozen base model (no KL term), deterministic rollouts, beta 100
    (Flow-Factory's default)."""
    config = matching(config, "dgpo")
    config.kl.use_reference_model = True
    config.algorithm.objective_kwargs = ml_collections.ConfigDict({"beta": 100.0})
    return config


def flow_grpo(config: ml_collections.ConfigDict, model: str) -> ml_collections.ConfigDict:
    """Flow-GRPO's published recipe on a flow-matching model: GRPO with group 24, 10 rollout steps (40 to evaluate),
    Flow-SDE, clip 1e-4, LoRA rank 32 / alpha 64, lr 3e-4, 512 px; the OCR (text rendering) task, which needs no
    downloaded reward model (RapidOCR ships its own)."""
    config.pretrained.model = model
    config.pretrained.max_sequence_length = 128  # T5 tokens: the captions are short
    config.lora_rank, config.lora_alpha = 32, 64
    config.sample.resolution = 512
    config.sample.eval_num_steps = 40
    config.sample.batch_size, config.sample.num_batches_per_epoch = 8, 3  # 24 images per process: whole groups
    config.sample.text_embedding_cache = 4096  # T5 meets each caption once
    config.train.group_size = 24
    config.train.learning_rate = 3e-4
    config.train.step_fraction = 0.99
    config.prompt_fn = "ocr"
    config.reward_fn = "ocr"
    config.num_epochs = 500
    return config


@recipe("grpo")
def flow_grpo_sd35(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Flow-GRPO on Stable Diffusion 3.5 Medium: noise level 0.7, CFG 4.5 in sampling and training, KL beta 0.04 to
    the base model, fp16."""
    config = flow_grpo(config, "stabilityai/stable-diffusion-3.5-medium")
    config.mixed_precision = "fp16"  # Flow-GRPO's choice for SD3: a smaller rollout / training log-prob mismatch
    config.sample.noise_level = 0.7
    config.sample.guidance_scale = 4.5
    config.kl.beta = 0.04
    return config


@recipe("grpo")
def flow_grpo_flux(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Flow-GRPO on FLUX.1-dev: 6 rollout steps (28 to evaluate), noise level 0.9, guidance 3.5 as FLUX's guidance
    embedding (no CFG), no KL, bf16."""
    config = flow_grpo(config, "black-forest-labs/FLUX.1-dev")
    config.mixed_precision = "bf16"
    config.sample.num_steps, config.sample.eval_num_steps = 6, 28
    config.sample.noise_level = 0.9
    config.sample.guidance_scale, config.train.cfg = 3.5, False
    config.kl.beta = 0.0
    config.kl.use_reference_model = False
    return config


@recipe("grpo")
def flow_dppo_sd35(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Flow-DPPO (arXiv 2606.11025) on Stable Diffusion 3.5 Medium: Flow-GRPO's SD3.5 recipe with the ratio clip
    replaced by the exact-KL divergence mask (algorithm.policy_loss="dppo") at UniRL's and VeRL-Omni's threshold
    train.policy_kl_threshold=1e-5, and several inner epochs over each epoch's samples (num_inner_epochs=2), where the paper
    says ratio clipping degrades. Differences: the paper's own hyperparameters beyond the loss (its learning rate,
    group size and inner epochs) are not in the stored copies of its code; Flow-GRPO's are kept, the KL term to the
    base model included."""
    config = flow_grpo_sd35(config)
    config.algorithm.policy_loss = "dppo"
    config.train.num_inner_epochs = 2
    return config


@recipe("grpo")
def flow_dppo_flux(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Flow-DPPO on FLUX.1-dev: Flow-GRPO's FLUX recipe (6 rollout steps, noise level 0.9, guidance embedding 3.5, no
    KL term, bf16) with the divergence mask at train.policy_kl_threshold=1e-5 and 2 inner epochs, as flow_dppo_sd35 (the
    same differences)."""
    config = flow_grpo_flux(config)
    config.algorithm.policy_loss = "dppo"
    config.train.num_inner_epochs = 2
    return config


@recipe("grpo")
def flow_grpo_qwenimage(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Flow-GRPO on Qwen-Image (yifan123/flow_grpo, config/grpo.py ``pickscore_qwenimage``, commit 54809b5): 10 rollout
    steps (50 to evaluate), true CFG 4 in sampling and training (negative prompt " "), noise level 1.2 on a 2-step SDE
    window, groups of 16 sampled 4 at a time, 2 optimizer steps an epoch, no KL, bf16, gradient checkpointing; LoRA rank
    64 / alpha 128 on the attention and MLPs (that repository's Qwen-Image-Edit-Plus script, its only Qwen-Image training
    script in the index; the family's ``lora_target_modules``). Their reward is PickScore and their window starts at a
    step drawn at random in [0, 5); here the OCR task of ``flow_grpo`` (no downloaded reward model) and the window at
    the first steps. Qwen/Qwen-Image-2512 takes the same settings (``pretrained.model``)."""
    config = flow_grpo(config, "Qwen/Qwen-Image")
    config.mixed_precision = "bf16"
    config.lora_rank, config.lora_alpha = 64, 128
    config.sample.eval_num_steps = 50
    config.sample.noise_level = 1.2
    config.sample.guidance_scale = 4.0  # true_cfg_scale 4 (models/families/qwenimage.py)
    config.sample.batch_size, config.sample.num_batches_per_epoch = 4, 4  # 16 images per process: whole groups
    config.train.group_size = 16
    config.train.batch_size = 4
    config.train.gradient_accumulation_steps = 2  # theirs: num_batches_per_epoch // 2
    config.train.step_fraction = 1.0  # every step of the window
    config.train.gradient_checkpointing = True  # their activation_checkpointing
    config.kl.beta = 0.0
    config.kl.use_reference_model = False
    return config


@recipe("grpo")
def flow_grpo_qwenimage_edit_plus(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
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
    config = flow_grpo_qwenimage(config)
    config.pretrained.model = "Qwen/Qwen-Image-Edit-2509"
    # each source image adds its vision tokens (~200 at 384^2 px) to the prompt's: 0 keeps the pipeline's 512
    config.pretrained.max_sequence_length = 0
    config.prompt_fn = "from_file"
    config.reward_fn = "pickscore"
    return config


def flow_factory(config: ml_collections.ConfigDict, model: str) -> ml_collections.ConfigDict:
    """What Flow-Factory's GRPO LoRA recipes share (github:X-GenGroup/Flow-Factory, examples/grpo/, commit 5f6cda1a):
    LoRA rank 64 / alpha 128, bf16, Flow-SDE, groups of 16, lr 3e-4, clip 1e-4, advantages clipped at 5, no KL, the
    PickScore reward. Their one stochastic step is drawn at random among the first steps of each rollout; here the
    SDE window is fixed (each recipe says which). Their caption sets are not shipped: simple_animals stands in
    (prompt_fn="from_file" with prompt_fn_kwargs.path reads yours)."""
    config.pretrained.model = model
    config.mixed_precision = "bf16"
    config.lora_rank, config.lora_alpha = 64, 128
    config.train.group_size = 16
    config.train.learning_rate = 3e-4
    config.kl.beta, config.kl.use_reference_model = 0.0, False
    config.prompt_fn = "simple_animals"
    config.reward_fn = "pickscore"
    return config


@recipe("grpo")
def nft_sd35(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """DiffusionNFT's published recipe on Stable Diffusion 3.5 Medium (NVlabs/DiffusionNFT config/nft.py, its OCR task):
    CFG-free (guidance 1 in sampling and training), deterministic rollouts of 10 steps (40 to evaluate; the paper's
    dpm2 solver is the Euler one here), beta 0.1, the old model's decay min(0.0075 (k - 75), 0.999) after 75 steps,
    KL 1e-4 to the base model, group 24, LoRA rank 32 / alpha 64, lr 3e-4, 512 px, fp16. Its script also multiplies
    the loss by adv_clip_max (5): the learning rate here is the same, the loss 5 times smaller."""
    config = flow_grpo(config, "stabilityai/stable-diffusion-3.5-medium")
    config.mixed_precision = "fp16"
    config.algorithm.objective = "nft"
    config.algorithm.objective_kwargs = ml_collections.ConfigDict({"beta": 0.1, "adaptive_weight": True})
    config.algorithm.old_decay_flat_steps, config.algorithm.old_decay_ramp = 75, 0.0075
    config.algorithm.old_decay_max = 0.999
    config.sample.deterministic = True
    config.sample.guidance_scale, config.train.cfg = 1.0, False
    config.kl.beta = 1e-4
    return config


@recipe("grpo")
def awm_sd35(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """AWM's published settings on Stable Diffusion 3.5 Medium (scxue/advantage_weighted_matching config/dgx_awm.py,
    its GenEval recipe, on the OCR task here: GenEval's detector is not shipped): CFG-free, deterministic rollouts of
    14 steps (40 to evaluate), the generalised Huber weighting (p = 0.25), KL 1e-3 to the base model, group 24, lr 3e-4,
    512 px, fp16. Not reproduced: its EMA-model KL, its time shift 3 on the training times (here the rollout
    schedule's), its advantage scale 1 / adv_clip_max (the loss here is 5 times larger)."""
    config = flow_grpo(config, "stabilityai/stable-diffusion-3.5-medium")
    config.mixed_precision = "fp16"
    config.algorithm.objective = "awm"
    config.algorithm.objective_kwargs = ml_collections.ConfigDict({"weighting": "ghuber", "ghuber_power": 0.25})
    config.sample.deterministic = True
    config.sample.num_steps = 14
    config.sample.guidance_scale, config.train.cfg = 1.0, False
    config.kl.beta = 1e-3
    return config


@recipe("grpo")
def dgpo_sd35(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
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
    config = flow_grpo(config, "stabilityai/stable-diffusion-3.5-medium")
    config.mixed_precision = "bf16"  # their base config's
    config.lora_rank, config.lora_alpha = 64, 128
    config.algorithm.objective = "dgpo"
    config.algorithm.objective_kwargs = ml_collections.ConfigDict({"beta": 100.0})  # their train.beta_dpo
    config.algorithm.global_std = True  # their sample.global_std
    config.sample.deterministic = True  # their noise_level 0
    config.sample.eval_num_steps = 14
    config.sample.guidance_scale = 4.5
    config.sample.batch_size, config.sample.num_batches_per_epoch = 16, 8  # 8 groups of 16 on one process
    config.train.group_size = 16
    config.train.batch_size = 16  # one group a train batch
    config.train.gradient_accumulation_steps = 8  # theirs: one optimizer step an epoch
    config.train.step_fraction = 0.4  # int(10 * 0.4) = 4 times a sample: their num_train_timesteps
    config.train.ema = True
    config.train.ema_export = True  # their checkpoints hold the EMA weights
    config.kl.beta = 0.0
    config.save_freq, config.eval_freq = 60, 60
    return config


@recipe("grpo")
def dpo_sd35(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Online Diffusion-DPO as Flow-Factory ships it on Stable Diffusion 3.5 Medium (X-GenGroup/Flow-Factory
    examples/dpo/lora/sd3_5/default.yaml and src/flow_factory/trainers/dpo.py, commit a0b2bc5): each group's best
    against its worst, 48 groups of 4 an epoch on one process (theirs: 8 GPUs), one optimizer step an epoch over the
    48 pairs, beta 100, one logit-normal training time a pair (no shift), the frozen base model as reference, CFG-free
    deterministic rollouts of 40 steps (40 to evaluate), group std, EMA 0.99 every 4 steps, LoRA rank 32 / alpha 64,
    lr 1e-5 (theirs: 3e-4 collapses), 512 px, bf16, the PickScore reward. Differences: their caption set is not
    shipped (simple_animals stands in, prompt_fn="from_file" reads yours); their times lie in [10, 1000] (timestep
    range 0.99), here in (0, 1000)."""
    config = flow_grpo(config, "stabilityai/stable-diffusion-3.5-medium")
    config.mixed_precision = "bf16"
    config.algorithm.objective = "dpo"
    config.algorithm.objective_kwargs = ml_collections.ConfigDict({"beta": 100.0})
    config.algorithm.objective_times = "logit_normal"
    config.sample.deterministic = True  # their ODE dynamics
    config.sample.num_steps = 40
    config.sample.guidance_scale, config.train.cfg = 1.0, False
    config.sample.batch_size, config.sample.num_batches_per_epoch = 24, 8  # 48 groups of 4 on one process
    config.train.group_size = 4
    config.train.batch_size = 96  # 48 pairs a train batch: all of an epoch's
    config.train.step_fraction = 0.025  # int(40 * 0.025) = 1 drawn time a pair
    config.train.learning_rate = 1e-5
    config.train.ema, config.train.ema_decay, config.train.ema_update_interval = True, 0.99, 4
    config.kl.beta = 0.0
    config.prompt_fn = "simple_animals"
    config.reward_fn = "pickscore"
    config.save_freq, config.eval_freq = 60, 60
    return config


def flow_factory_zimage_common(config: ml_collections.ConfigDict, model: str) -> ml_collections.ConfigDict:
    """Flow-Factory's GRPO settings for Z-Image (X-GenGroup/Flow-Factory, examples/grpo/lora/z_image/default.yaml and
    examples/grpo/full/z_image_turbo/default.yaml): group 16, 512 px, Flow-SDE at noise level 0.7, clip 1e-4, advantages
    clipped at 5, no KL, the PickScore reward, bf16. Where ours differs: Flow-Factory makes one step of 1..3 stochastic
    (drawn at random), here the window is those 3 steps; their prompts are Pick-a-Pic's captions (dataset/pickscore),
    which are not shipped: simple_animals here (prompt_fn="from_file" with prompt_fn_kwargs.path reads a captions
    file)."""
    config = flow_factory(config, model)
    # Qwen3 tokens: only a prompt's own tokens reach the transformer, so this cuts nothing but captions over ~100 tokens
    config.pretrained.max_sequence_length = 128
    config.sample.resolution = 512
    config.sample.noise_level = 0.7
    config.sample.sde_window_start, config.sample.sde_window_size = 1, 3
    config.sample.batch_size = 8  # 16 images per process: whole groups
    config.sample.text_embedding_cache = 4096  # Qwen3 meets each caption once
    config.num_epochs, config.save_freq = 500, 40
    return config


@recipe("grpo")
def flow_factory_zimage(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Flow-Factory's GRPO on Z-Image (the base model): LoRA rank 64 / alpha 128, lr 3e-4, 10 rollout steps (40 to
    evaluate), classifier-free guidance 4.0 (Z-Image's u_c + w (u_c - u_uncond)) in sampling and training."""
    config = flow_factory_zimage_common(config, "Tongyi-MAI/Z-Image")
    config.sample.eval_num_steps = 40
    config.sample.guidance_scale = 4.0
    return config


@recipe("grpo")
def flow_factory_zimage_turbo(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Flow-Factory's GRPO on Z-Image-Turbo: full fine-tuning at lr 1e-5, 6 rollout steps (10 to evaluate), no guidance
    (guidance_scale 0, as the model card samples it)."""
    config = flow_factory_zimage_common(config, "Tongyi-MAI/Z-Image-Turbo")
    config.use_lora = False
    config.train.learning_rate = 1e-5
    config.sample.num_steps, config.sample.eval_num_steps = 6, 10
    config.sample.guidance_scale, config.train.cfg = 0.0, False
    return config


@recipe("grpo")
def flow_factory_flux_kontext(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Flow-Factory's GRPO LoRA recipe for FLUX.1 Kontext [dev] (github:X-GenGroup/Flow-Factory,
    examples/grpo/lora/flux1_kontext/default.yaml at 5f6cda1): LoRA rank 64 / alpha 128, 384 px (the source images
    too), 10 rollout steps (20 to evaluate), guidance 2.5 as FLUX's guidance embedding, Flow-SDE at noise level 0.9
    with one stochastic step (theirs drawn from steps 1-3 each epoch, ours fixed at step 1), group 16, 48 prompts
    per epoch over 8 processes, 2 optimizer steps per epoch, clip 1e-4, advantages clipped at 5, no KL, lr 3e-4,
    EMA 0.9 every 4 steps, bf16, PickScore. Their evaluation samples at 512 px; ours at the training size. The
    editing dataset is yours: a .jsonl prompt file (prompt_fn from_file, rows {"prompt", "image"}) in
    prompt_fn_kwargs.path."""
    config = flow_factory(config, "black-forest-labs/FLUX.1-Kontext-dev")
    config.sample.resolution = 384
    config.sample.eval_num_steps = 20
    config.sample.guidance_scale, config.train.cfg = 2.5, False
    config.sample.noise_level = 0.9
    config.sample.sde_window_start, config.sample.sde_window_size = 1, 1
    config.sample.batch_size, config.sample.num_batches_per_epoch = 8, 12  # 96 per process: 48 groups of 16 over 8
    config.sample.text_embedding_cache = 4096  # T5 and the VAE meet each (prompt, source image) once
    config.train.gradient_accumulation_steps = 6  # 2 optimizer steps per epoch
    config.train.ema, config.train.ema_update_interval = True, 4
    config.prompt_fn = "from_file"
    config.num_epochs = 500
    return config


@recipe("grpo")
def flow_factory_flux2_klein(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Flow-Factory's GRPO recipe on FLUX.2 [klein] 9B (step-distilled), X-GenGroup/Flow-Factory
    examples/grpo/lora/flux2_klein/default.yaml (commit 5f6cda1a): LoRA rank 64 / alpha 128, 384 px, 4 rollout steps
    (10 to evaluate), guidance 1 (the distilled model has no CFG), Flow-SDE at noise level 0.5 on one step, group 16,
    clip 1e-4, advantages clipped at 5, no KL, lr 3e-4, EMA 0.9, bf16, PickScore. Differences: their one SDE step is
    drawn from steps {1, 2} per rollout, here the window is step 1; they evaluate at 1024 px, here at the training
    resolution; their prompts (a ShareGPT-4o image-caption set) are not shipped: simple_animals stands in."""
    config = flow_factory(config, "black-forest-labs/FLUX.2-klein-9B")
    config.sample.resolution = 384
    config.sample.num_steps, config.sample.eval_num_steps = 4, 10
    config.sample.guidance_scale, config.train.cfg = 1.0, False
    config.sample.noise_level = 0.5
    config.sample.sde_window_start, config.sample.sde_window_size = 1, 1
    # 48 prompts x 16 copies per epoch over 8 GPUs: 96 images per process, 2 optimizer steps of 48
    config.sample.num_batches_per_epoch = 6
    config.train.batch_size, config.train.gradient_accumulation_steps = 16, 3
    config.train.ema = True
    config.eval_freq = 20
    return config


@recipe("grpo")
def flow_factory_flux2_klein_base(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Flow-Factory's GRPO recipe on FLUX.2 [klein] base 9B (not distilled), X-GenGroup/Flow-Factory
    examples/grpo/lora/flux2_klein_base/default.yaml (commit 5f6cda1a): the klein recipe's settings but 8 rollout steps
    (28 to evaluate), CFG 4 with the empty prompt in sampling and training, noise level 0.7 (their one SDE step is
    drawn from steps {1, 2, 3}; here the window is step 1)."""
    config = flow_factory_flux2_klein(config)
    config.pretrained.model = "black-forest-labs/FLUX.2-klein-base-9B"
    config.sample.num_steps, config.sample.eval_num_steps = 8, 28
    config.sample.guidance_scale, config.train.cfg = 4.0, True
    config.sample.noise_level = 0.7
    return config


@recipe("grpo")
def flow_factory_wan21(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Flow-Factory's GRPO LoRA recipe for Wan2.1 text-to-video (github:X-GenGroup/Flow-Factory,
    examples/grpo/lora/wan21/t2v.yaml, commit 5f6cda1a; Flow-GRPO publishes no Wan recipe): Wan2.1-T2V-14B, LoRA
    rank 64 / alpha 128, bf16, 5 frames of 256 px, 10 Flow-SDE steps at noise level 0.9 (28 to evaluate), CFG 5.0 in
    sampling and training, group 16, clip 1e-4, advantages clipped to 5, no KL, lr 1e-4, weight decay 1e-4, EMA 0.9
    every 4 steps, one video per process at a time; the flow shift is the model's scheduler's (3.0 for 480p).
    Differences: Flow-Factory trains one SDE step drawn from steps 1-3 each time, here the window is steps 1-3;
    its rewards are CLIP text alignment (1.0) and PickScore (0.5) on the PickScore prompts, here the same rewards
    (their models download) with advantages normalised per reward ("gdpo") on the embedded animal prompts
    (--config.prompt_fn=from_file with the PickScore prompt list for theirs)."""
    config = flow_factory(config, "Wan-AI/Wan2.1-T2V-14B-Diffusers")
    config.sample.resolution, config.sample.num_frames = 256, 5
    config.sample.eval_num_steps = 28
    config.sample.noise_level = 0.9
    config.sample.sde_window_start, config.sample.sde_window_size = 1, 3
    config.sample.batch_size, config.sample.num_batches_per_epoch = 1, 16
    config.sample.text_embedding_cache = 1024  # UMT5 meets each prompt once
    config.train.batch_size = 1
    config.train.learning_rate = 1e-4
    config.train.ema, config.train.ema_update_interval = True, 4
    config.reward_fn = {"clipscore": 1.0, "pickscore": 0.5}
    config.algorithm.multi_reward_mix, config.algorithm.global_std = "advantage_aggr", True  # GDPO: the batch std
    config.eval_freq = 20
    return config


@recipe("grpo")
def flow_factory_wan21_i2v(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Flow-Factory's GRPO LoRA recipe for Wan2.1 image-to-video (examples/grpo/lora/wan21/i2v.yaml, commit 5f6cda1a;
    Flow-GRPO publishes none): Wan2.1-I2V-14B-480P (the 720P model takes the same settings), 5 frames of 240 px
    animating each prompt's source image, 10 Flow-SDE steps at noise level 0.9 (28 to evaluate), CFG 5.0 in sampling
    and training, 48 prompts an epoch over 8 processes (96 videos a process, one at a time) and 2 optimizer steps an
    epoch, lr 1e-4, weight decay 1e-4, EMA 0.9. Differences: their one stochastic step is drawn from steps 1-3 each
    rollout, here the window is steps 1-3; their SDE runs on the released UniPC scheduler, here on the flow Euler
    scheduler of the model's shift (models/families/wan.py); their EMA moves every 4 epochs (8 optimizer steps here);
    they evaluate at 480 px, here at the training size; their dataset (ShareGPT-4o images with captions) is not
    shipped: a .jsonl prompt file of yours (rows {"prompt", "image"}) in prompt_fn_kwargs.path."""
    config = flow_factory(config, "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers")
    config.sample.resolution, config.sample.num_frames = 240, 5
    config.sample.eval_num_steps = 28
    config.sample.noise_level = 0.9
    config.sample.sde_window_start, config.sample.sde_window_size = 1, 3
    config.sample.batch_size, config.sample.num_batches_per_epoch = 1, 96  # 48 groups of 16 over 8 processes
    config.sample.text_embedding_cache = 1024  # UMT5, CLIP and the VAE meet each (prompt, source image) once
    config.train.batch_size, config.train.gradient_accumulation_steps = 1, 48  # 2 optimizer steps an epoch
    config.train.learning_rate = 1e-4
    config.train.ema = True
    config.prompt_fn = "from_file"
    config.num_epochs, config.eval_freq = 500, 20
    return config


@recipe("grpo")
def cosmos_rl_sana_nft(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Cosmos-RL's DiffusionNFT recipe for SANA (github:nvidia-cosmos/cosmos-rl, configs/sana/sana-image-nft.toml and
    cosmos_rl/policy/trainer/diffusers_trainer/nft_trainer.py, commit 89f2e5b): SANA 1.5 1.6B at 1024 px, LoRA rank 4 /
    alpha 4 on the self- and cross-attention projections (the family's targets), CFG-free (guidance 1 in sampling and
    training), deterministic rollouts of 10 steps (40 to evaluate), beta 1 with the adaptive loss weighting, the old
    model's decay min(0.001 k, 0.5) (their weight_copy_decay_type 1: the base config's old_decay_*), KL 1e-4 to the
    base model, groups of 24, lr 3e-4, weight decay 1e-4, EMA 0.9 after every optimizer step, advantages clipped at 5,
    300 Gemma tokens (0: the pipeline's), bf16, the PickScore reward. Differences: their rollouts' Euler solver runs on
    their sigmas, ours on the family's flow Euler scheduler of the checkpoint's shift (models/families/sana.py); their
    loss is multiplied by the advantage clip (5): the learning rate here is the same, the loss 5 times smaller; their
    1152 samples a replica an epoch are flow_grpo's 24 a process here; their Pick-a-Pic captions are not shipped
    (simple_animals stands in; prompt_fn="from_file" reads yours)."""
    config = flow_grpo(config, "Efficient-Large-Model/SANA1.5_1.6B_1024px_diffusers")
    config.mixed_precision = "bf16"
    config.lora_rank, config.lora_alpha = 4, 4
    config.pretrained.max_sequence_length = 0  # the pipeline's 300 (their max_prompt_length)
    config.sample.resolution = 1024
    config.algorithm.objective = "nft"
    config.algorithm.objective_kwargs = ml_collections.ConfigDict({"beta": 1.0, "adaptive_weight": True})
    config.sample.deterministic = True
    config.sample.guidance_scale, config.train.cfg = 1.0, False
    config.kl.beta = 1e-4
    config.train.ema, config.train.ema_update_interval = True, 1
    config.prompt_fn = "simple_animals"
    config.reward_fn = "pickscore"
    return config


@recipe("grpo")
def flow_grpo_qwenimage21(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Flow-GRPO's Qwen-Image recipe (``flow_grpo_qwenimage``) on Qwen/Qwen-Image-2.1, at the 2.1 pipeline's own
    sampling: no guidance (its true_cfg_scale defaults to 1: the model is sampled without it), 40 evaluation steps (its
    call's default), 512 stored text tokens (its pipeline keeps every token of a prompt; a longer one is refused);
    10 rollout steps, noise level 1.2 on a 2-step SDE window, groups of 16, LoRA rank 64 / alpha 128 on the attention
    and SwiGLU projections of its single-stream blocks, no KL, bf16, gradient checkpointing, 512 px, the OCR task.
    Flow-Factory's Qwen-Image 2.1 example (2026-09-20) and UniRL's are not in the stored copies of those repositories
    (Flow-Factory a0b2bc5 of 2026-05-02, UniRL 1a7b501 of 2026-06-13), so this recipe is not theirs: its numbers are
    Flow-GRPO's Qwen-Image ones."""
    config = flow_grpo_qwenimage(config)
    config.pretrained.model = "Qwen/Qwen-Image-2.1"
    config.pretrained.max_sequence_length = 0  # 512 stored tokens (models/families/qwenimage21.py)
    config.sample.eval_num_steps = 40
    config.sample.guidance_scale, config.train.cfg = 1.0, False
    return config


@recipe("grpo")
def unirl_hunyuan_video15(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """UniRL's GRPO recipe for HunyuanVideo 1.5 text-to-video (github:Tencent-Hunyuan/UniRL,
    examples/diffusion/hunyuan_video15_t2v_dancegrpo_trainside.yaml, commit 1a7b501; DanceGRPO's settings):
    HunyuanVideo-1.5 480p text-to-video, 5 frames of 480 px, 16 rollout steps without guidance (their cfg 0), the flow
    SDE at noise level 0.25 (their eta), the checkpoint scheduler's shift (theirs 5.0), LoRA rank 64 / alpha 64 on the
    attention and feed-forward projections of both streams (the family's targets), groups of 24 with the batch std
    (their adv_use_global_std), 48 prompts an epoch over 8 processes (144 videos a process, one at a time) and 2
    optimizer steps an epoch, lr 1e-5, weight decay 1e-4, clip 1e-4, gradient clipping at 1, no KL, gradient
    checkpointing, bf16, PickScore. Differences: they draw 8 stochastic steps at random among the first 60% of the
    schedule each rollout, here the window is the first 8 steps; their PickScore reads each video's first frame, the
    image reward here scores every frame and averages; their prompts (a data path of yours) are not shipped:
    simple_animals stands in (prompt_fn="from_file" reads yours)."""
    config.pretrained.model = "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v"
    config.mixed_precision = "bf16"
    config.lora_rank, config.lora_alpha = 64, 64
    config.sample.resolution, config.sample.num_frames = 480, 5
    config.sample.num_steps = 16
    config.sample.guidance_scale, config.train.cfg = 1.0, False
    config.sample.noise_level = 0.25
    config.sample.sde_window_size = 8
    config.sample.batch_size, config.sample.num_batches_per_epoch = 1, 144  # 48 groups of 24 over 8 processes
    config.sample.text_embedding_cache = 1024  # Qwen2.5-VL and ByT5 meet each prompt once
    config.train.group_size = 24
    config.train.batch_size, config.train.gradient_accumulation_steps = 1, 72  # 2 optimizer steps an epoch
    config.train.learning_rate = 1e-5
    config.train.gradient_checkpointing = True
    config.algorithm.global_std = True
    config.kl.beta, config.kl.use_reference_model = 0.0, False
    config.prompt_fn = "simple_animals"
    config.reward_fn = "pickscore"
    config.num_epochs, config.eval_freq = 500, 20
    return config


@recipe("grpo")
def flow_factory_ltx2(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Flow-Factory's GRPO LoRA recipe for LTX-2 text-to-audio-video (github:X-GenGroup/Flow-Factory,
    examples/grpo/lora/ltx2/t2av.yaml, commit a0b2bc5): Lightricks/LTX-2, LoRA rank 64 / alpha 128 on every Linear of
    the transformer's blocks (the family's targets), bf16, 121 frames of 512 x 768 at 24 fps (the pipeline's defaults:
    sample.resolution 0), 24 rollout steps (50 to evaluate) without guidance and without the pipeline's
    spatio-temporal, modality and rescale terms (its stg_scale 0, modality_scale 1, guidance_rescale 0 and the audio's
    CFG 1: sample.pipeline_guidance),
    CPS at noise level 0.8 on 3 stochastic steps, groups of 16 with the batch std, 48 prompts an epoch over 8
    processes (96 videos a process, one at a time) and 2 optimizer steps an epoch, lr 3e-4, weight decay 1e-4, clip
    1e-4, advantages clipped at 5, no KL, EMA 0.9, gradient checkpointing, the CLAP audio-text reward
    (laion/larger_clap_general). Differences: their 3 stochastic steps are drawn at random among steps 0-9 each
    rollout, here the window is steps 0-2; their second reward, ImageBind's audio-video alignment, is not built in
    (add it as a plugin with its weight 1); their EMA moves every 4 epochs (after every optimizer step here); they
    evaluate with guidance 4, here with the training's; their VidProM prompts are not shipped: simple_animals stands in
    (prompt_fn="from_file" reads yours)."""
    config = flow_factory(config, "Lightricks/LTX-2")
    config.sample.num_frames = 121  # of the pipeline's 512 x 768 (sample.resolution 0)
    config.sample.num_steps, config.sample.eval_num_steps = 24, 50
    config.sample.guidance_scale, config.train.cfg = 1.0, False
    config.sample.pipeline_guidance = ml_collections.ConfigDict({  # every pass of the call off: 1 forward a step
        "audio_guidance_scale": 1.0, "stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0,
        "audio_modality_scale": 1.0, "guidance_rescale": 0.0, "audio_guidance_rescale": 0.0})
    config.sample.sde_type, config.sample.noise_level = "cps", 0.8
    config.sample.sde_window_size = 3
    config.sample.batch_size, config.sample.num_batches_per_epoch = 1, 96  # 48 groups of 16 over 8 processes
    config.sample.text_embedding_cache = 1024  # Gemma-3 and the connectors meet each prompt once
    config.train.batch_size, config.train.gradient_accumulation_steps = 1, 48  # 2 optimizer steps an epoch
    config.train.gradient_checkpointing = True
    config.train.ema, config.train.ema_update_interval = True, 1
    config.algorithm.global_std = True
    config.reward_fn = "clap"
    config.num_epochs, config.eval_freq = 500, 60
    return config


@recipe("grpo")
def miles_cosmos3_pickscore(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Miles's Flow-GRPO recipe for Cosmos 3 (github:radixark/miles_diffusion,
    scripts/run_diffusion_grpo_cosmos3_pickscore_t2i_4gpu.py, commit 11eb869; the recipe radixark/miles's
    docs/diffusion/models/cosmos/cosmos3.md calls verified, PickScore 0.77 -> 0.85 over 250 rollouts): Cosmos3-Nano
    text to image (one frame), 16 rollout steps (35 to evaluate) on the released scheduler's schedule, CFG 4 in sampling
    and training, the flow SDE at noise level 0.7 on 2 of steps 8 to 11 (counted from 0: sigmas 0.91 to 0.70 on the
    released 16-step schedule, whose steps 0 to 6 sit above 0.96 with |dt| < 0.02), groups of 16 with the batch std (their
    globalize_reward_std), clip range 1e-3, no KL, lr 1e-4, weight decay 1e-4, gradient clipping at 1, LoRA rank 64 /
    alpha 128 on the generation tokens' attention projections (add_q / k / v_proj, to_add_out: the family's targets),
    bf16, PickScore. Differences: they draw the 2 steps at random among 8 to 11 each epoch, here the window is steps 8
    and 9; their 480 x 832 is 480 px square here (the family samples squares); their one optimizer step an epoch of 48
    prompts x 16 over 4 GPUs is 2 groups a process here; their Pick-a-Pic captions are not shipped: simple_animals
    stands in (prompt_fn="from_file" reads yours)."""
    config.pretrained.model = "nvidia/Cosmos3-Nano"
    config.mixed_precision = "bf16"
    config.lora_rank, config.lora_alpha = 64, 128
    config.sample.resolution, config.sample.num_frames = 480, 1
    config.sample.num_steps, config.sample.eval_num_steps = 16, 35
    config.sample.guidance_scale = 4.0
    config.sample.noise_level = 0.7
    config.sample.sde_window_start = 8
    config.sample.batch_size, config.sample.num_batches_per_epoch = 1, 32  # 2 groups of 16 a process, one at a time
    config.train.group_size = 16
    config.train.batch_size, config.train.gradient_accumulation_steps = 1, 32  # 1 optimizer step an epoch
    config.train.learning_rate = 1e-4
    config.train.clip_range = 1e-3
    config.algorithm.global_std = True
    config.kl.beta, config.kl.use_reference_model = 0.0, False  # no KL: no reference model held
    config.prompt_fn = "simple_animals"
    config.reward_fn = "pickscore"
    return config


@recipe("grpo")
def miles_krea2_nft(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Miles's DiffusionNFT recipe for Krea 2 (github:radixark/miles_diffusion, scripts/run_diffusion_nft_krea2.py,
    commit 6874704): Krea-2-Raw at 1024 px, 10 deterministic rollout steps (52 to evaluate) without guidance, NFT beta 1
    with their timestep fraction 0.99 (train.step_fraction: 9 of the 10 steps), the old model's decay min(0.001 k, 0.5)
    (their EMA rollout weights: init and ramp 0.001, max 0.5), groups of 8 with the batch std, lr 3e-4, weight decay
    1e-4, gradient clipping at 1, LoRA rank 32 / alpha 64 on the attention projections (the family's targets), bf16,
    gradient checkpointing, the OCR task. Differences: their Krea 2 LoRA's targets are their family's; no KL (no
    reference model) and no EMA of the policy (cosmos_rl_sana_nft's are undone); the adaptive loss weighting is kept."""
    config = cosmos_rl_sana_nft(config)
    config.pretrained.model = "krea/Krea-2-Raw"
    config.lora_rank, config.lora_alpha = 32, 64
    config.sample.eval_num_steps = 52
    config.sample.guidance_scale = 0.0  # Krea 2 guides above 0: none
    config.train.group_size = 8
    config.train.gradient_checkpointing = True
    config.train.ema = False
    config.kl.beta, config.kl.use_reference_model = 0.0, False
    config.algorithm.global_std = True
    config.prompt_fn, config.reward_fn = "ocr", "ocr"
    return config


@recipe("grpo")
def cosmos_rl_sana_video_nft(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Cosmos-RL's DiffusionNFT recipe for SANA-Video (github:nvidia-cosmos/cosmos-rl, configs/sana/sana-video-nft.toml,
    commit f44d98e): SANA-Video 2B 480p, 41 frames (their code's default), 10 deterministic rollout steps (40 to
    evaluate) without guidance, beta 1, KL 1e-4, advantages clipped at 5, groups of 8, lr 3e-4, weight decay 1e-4, EMA
    0.9, LoRA rank 4 / alpha 4 on the self- and cross-attention projections, bf16 (cosmos_rl_sana_nft's, whose
    differences hold). Differences: their 480 x 832 is 480 px square here (the family samples squares); their reward is
    a remote video reward service (dance_grpo's overall_reward), PickScore on every frame stands in; their
    timestep_fraction 0.99 is a key their trainer does not read (timesteps_fraction, default 1), so every step is
    trained as here."""
    config = cosmos_rl_sana_nft(config)
    config.pretrained.model = "Efficient-Large-Model/SANA-Video_2B_480p_diffusers"
    config.sample.resolution, config.sample.num_frames = 480, 41
    config.train.group_size = 8
    config.train.step_fraction = 1.0  # every step (their timestep_fraction is not read)
    return config
