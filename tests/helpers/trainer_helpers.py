"""Build a Trainer in-process on the tiny random model with a tiny, fast configuration."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from config.base import get_config
from ddpo_group.run.trainer import Trainer

# the mechanics on every step and no evaluation: the defaults' 2-step SDE window, periodic evaluation and fresh final
# evaluation are the embedded model's learning task (config/base.py); tests that count reward calls or trained pairs
# assume none of them
MECHANICS = {"sample.sde_window_size": 0, "eval_freq": 0, "final_eval_num_seeds": 0}

TINY = {
    "num_epochs": 1, "prompt_fn": "simple_animals", "reward_fn": "jpeg_compressibility", "sample.num_steps": 4,
    "sample.batch_size": 4, "sample.num_batches_per_epoch": 2, "train.batch_size": 4, "train.pairs_per_forward": 6,
    "train.learning_rate": 1e-2, "train.clip_range": 0.2, "per_prompt_stat_tracking.min_count": 2,
    "save_freq": 0, "log_images_every": 0, "wandb.mode": "disabled", **MECHANICS,
}


# what a tiny flow-matching model needs: 32 px images, 16 T5 tokens; FLUX.1-dev's guidance is an embedding (no CFG)
FAMILY_OVERRIDES = {
    "sd": {},
    "sdxl": {},
    "sd3": {"sample.resolution": 32, "pretrained.max_sequence_length": 16},
    "flux": {"sample.resolution": 32, "pretrained.max_sequence_length": 16, "sample.guidance_scale": 3.5,
             "train.cfg": False},
    # Wan: 5 frames of 16 x 16 px (latents [16, 2, 2, 2]), 16 UMT5 tokens
    "wan": {"sample.resolution": 16, "sample.num_frames": 5, "pretrained.max_sequence_length": 16},
}
# Z-Image: 32 px, 64 Qwen3 tokens (a prompt takes 19 + its bytes), its guidance u_c + w (u_c - u_uncond)
FAMILY_OVERRIDES["zimage"] = {"sample.resolution": 32, "pretrained.max_sequence_length": 64,
                              "sample.guidance_scale": 3.0, "train.cfg": True}
FAMILY_OVERRIDES["flux_kontext"] = FAMILY_OVERRIDES["flux"]  # FLUX.1's, with source images from a .jsonl prompt file
# FLUX.2 [klein]: 32 Qwen3 tokens hold the chat template around a short prompt; the tiny model is step-distilled (no CFG)
FAMILY_OVERRIDES["flux2"] = {"sample.resolution": 32, "pretrained.max_sequence_length": 32,
                             "sample.guidance_scale": 1.0, "train.cfg": False}
# FLUX.2 [dev]: BFL's system message alone is ~170 byte tokens of the tiny tokenizer; the guidance is an embedding
FAMILY_OVERRIDES["flux2_dev"] = {"sample.resolution": 32, "pretrained.max_sequence_length": 256,
                                 "sample.guidance_scale": 4.0, "train.cfg": False}
# Qwen-Image: 32 px images, prompts of at most 32 text tokens (the default guidance 5.0 is its true CFG)
FAMILY_OVERRIDES["qwenimage"] = {"sample.resolution": 32, "pretrained.max_sequence_length": 32}
# Qwen-Image-Edit-Plus: 32 px; a condition holds each source image's vision tokens (16 of the tiny processor) besides
# the prompt's, so 128 tokens
FAMILY_OVERRIDES["qwenimage_edit_plus"] = {"sample.resolution": 32, "pretrained.max_sequence_length": 128}
FAMILY_OVERRIDES["qwenimage_edit"] = FAMILY_OVERRIDES["qwenimage_edit_plus"]  # one source image a prompt
# Wan image-to-video: Wan's size and frames, source images from a .jsonl prompt file, the pipeline's 512 UMT5 tokens
# (the transformer takes its context's last 512 tokens as the text's)
FAMILY_OVERRIDES["wan_i2v"] = {"sample.resolution": 16, "sample.num_frames": 5}
# SANA: 64 px (2 x 2 latents of its 32x DC-AE), 16 Gemma tokens (the last ones after its instruction: the prompt's)
FAMILY_OVERRIDES["sana"] = {"sample.resolution": 64, "pretrained.max_sequence_length": 16}
# SANA-Video: 5 frames of 32 x 32 px (latents [16, 2, 4, 4] of Wan's 8x / 4x VAE: 2 x 2 patches), 16 Gemma tokens
FAMILY_OVERRIDES["sana_video"] = {"sample.resolution": 32, "sample.num_frames": 5, "pretrained.max_sequence_length": 16}
# Qwen-Image 2.1: 64 px (4 x 4 latent tokens of its 16x VAE), 64 stored text tokens (the pipeline keeps every token)
FAMILY_OVERRIDES["qwenimage21"] = {"sample.resolution": 64, "pretrained.max_sequence_length": 64}
# HunyuanVideo 1.5: 5 frames of 32 x 32 px (latents [4, 2, 2, 2] of its 16x / 4x VAE); its text encoders' own lengths
FAMILY_OVERRIDES["hunyuan_video15"] = {"sample.resolution": 32, "sample.num_frames": 5}
# Krea 2: 32 px (2 x 2 tokens of its packed 8x-VAE latent), 16 text tokens, its guidance v(c) + w (v(c) - v(n))
FAMILY_OVERRIDES["krea2"] = {"sample.resolution": 32, "pretrained.max_sequence_length": 16, "sample.guidance_scale": 3.0,
                             "train.cfg": True}
# Ideogram 4: 64 px (2 x 2 tokens of its packed 16x-VAE latent), 64 chat-template tokens, guidance 5 (w u_c + (1 - w) u_u)
FAMILY_OVERRIDES["ideogram4"] = {"sample.resolution": 64, "pretrained.max_sequence_length": 64}
# Kandinsky 6: 5 frames of 64 x 64 px (a 2 x 2 x 2 video latent of its 32x / 4x VAE, 27 audio latent frames), 32
# Qwen2.5-VL tokens
FAMILY_OVERRIDES["kandinsky6"] = {"sample.resolution": 64, "sample.num_frames": 5, "pretrained.max_sequence_length": 32}
# HunyuanImage 2.1: 64 px (2 x 2 latents of its 32x VAE), its guiders at the run's guidance
FAMILY_OVERRIDES["hunyuan_image"] = {"sample.resolution": 64}
# Cosmos 3: 5 frames of 32 x 32 px (latents [16, 2, 4, 4] of the tiny Wan VAE, 2 x 2 patches: 8 tokens a frame)
FAMILY_OVERRIDES["cosmos3"] = {"sample.resolution": 32, "sample.num_frames": 5}
# LTX-2: 17 frames of 64 x 64 px (a 3 x 2 x 2 video latent of its 32x / 8x VAE, 18 audio latent frames), 16 Gemma tokens
FAMILY_OVERRIDES["ltx2"] = {"sample.resolution": 64, "sample.num_frames": 17, "pretrained.max_sequence_length": 16}


def small_qwen_edit_sources(setattr) -> None:
    """The Qwen-Image-Edit pipelines' source sizes, constants of their modules (Plus: CONDITION_IMAGE_SIZE 384^2 px
    for the text encoder, VAE_IMAGE_SIZE 1024^2 for the VAE; Edit: a 1024^2 literal passed to its module's
    ``calculate_dimensions``), which the families read there too, made 64^2 and 32^2 px through ``setattr``
    (pytest's ``monkeypatch.setattr``, or ``setattr`` in a process of its own): a 1024^2 source is 16384 tokens of the
    tiny model."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus

    setattr(pipeline_qwenimage_edit_plus, "CONDITION_IMAGE_SIZE", 64 * 64)
    setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", 32 * 32)
    original = pipeline_qwenimage_edit.calculate_dimensions
    if not getattr(original, "shrunk", False):
        def calculate_dimensions(area, ratio):
            return original(area * 32 * 32 // (1024 * 1024), ratio)

        calculate_dimensions.shrunk = True
        setattr(pipeline_qwenimage_edit, "calculate_dimensions", calculate_dimensions)


def set_fields(config, values: dict) -> None:
    """Set ``config``'s fields named "section.field" (the command line's --config.section.field) to ``values``'."""
    for key, value in values.items():
        section, _, field = key.rpartition(".")
        target = config
        for part in section.split(".") if section else []:
            target = target[part]
        target[field] = value


def tiny_config(preset: str, model_dir: str, logdir, run_name: str = "run", **overrides):
    config = get_config(preset)
    values = {**TINY, "pretrained.model": model_dir, "logdir": str(logdir), "run_name": run_name}
    if config.train.group_size > 1:
        values["train.group_size"] = 4
    values.update(overrides)
    set_fields(config, values)
    return config


def tiny_trainer(preset: str, model_dir: str, logdir, run_name: str = "run", **overrides) -> Trainer:
    return Trainer(tiny_config(preset, model_dir, logdir, run_name, **overrides))


def train_in_this_process(args: list[str]) -> None:
    """What ``python scripts/train.py ARGS`` trains, in this process with one thread as a started process has: its
    command line parsed by the same config flag (the preset, every override), then ``Trainer(config).run()``, from the
    repository root as the started processes are."""
    from absl import flags
    from ml_collections import config_flags

    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=values)
    saved_argv, cwd, threads = list(sys.argv), os.getcwd(), torch.get_num_threads()
    sys.argv[:] = ["scripts/train.py", *args]  # ml_collections reads the overrides from sys.argv
    os.chdir(Path(__file__).resolve().parents[2])
    torch.set_num_threads(1)
    try:
        values(sys.argv)
        Trainer(values.config).run()
    finally:
        sys.argv[:] = saved_argv
        os.chdir(cwd)
        torch.set_num_threads(threads)
