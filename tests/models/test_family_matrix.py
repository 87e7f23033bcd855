"""Every model family on every path a user walks, each on its tiny random pipeline (models/tiny_random.py, built once a
session and saved like a checkpoint): the issue's command at the pipeline's own defaults, the sampler against the
pipeline's own call at its defaults, every preset and objective, scripts/evaluate.py on a run with its LoRA loaded by
the pipeline, tree rollouts, and two processes over gloo.

A run is a user's: a preset of config/base.py with only the run made small (``RUN``: one epoch of 2 samples of 2
steps, the jpeg_compressibility reward); guidance, ``train.cfg``, the token budget, the frames (but ``FRAMES``) and the
negative prompt are the defaults. The image size is the pipeline's own default in ``test_the_issues_grpo_run_at_the_pipelines_defaults``
and in ``test_the_sampler_is_the_pipelines_call_at_its_defaults`` for the families in ``AT_DEFAULT_SIZE``, and
``SIZES`` elsewhere: the tiny FLUX-class models' default is 4096 image tokens, a few seconds a step on a CPU, and
Z-Image's and Wan's defaults are beyond their tiny position tables (refused at start, by name). The editing families
and Wan image-to-video read a two-row .jsonl prompt file of source images (``prompt_rows``).

docs/model_families.md's table "Every family on every path" is ``paths_table()`` (``python
tests/models/test_family_matrix.py`` writes it there; ``test_the_documented_table_is_this_matrix`` fails while it is
stale).
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

if __name__ == "__main__":  # run as a script (it writes the documented table): the repository on the path, where
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # python -m pytest puts it (the working directory)

from config.base import PRESETS, get_config  # noqa: E402
from ddpo_group.errors import ConfigError  # noqa: E402
from ddpo_group.models import load_family  # noqa: E402
from ddpo_group.models.families import FAMILY_REGISTRY, get_family  # noqa: E402
from ddpo_group.models.tiny_random import TINY_BUILDERS  # noqa: E402
from ddpo_group.sampling.trajectories import SamplingOptions, sample_trajectories  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "model_families.md"
FAMILIES = tuple(TINY_BUILDERS)
PRESET_RUNS = tuple(sorted(PRESETS))
OBJECTIVES = ("awm", "nft", "sft", "dpo", "dgpo")  # the matching and preference objectives' recipes (config/base.py)
RUNS = PRESET_RUNS + OBJECTIVES

# what makes a run small; nothing a family reads from its pipeline
RUN = {"num_epochs": 1, "sample.num_steps": 2, "sample.batch_size": 2, "sample.num_batches_per_epoch": 1,
       "train.batch_size": 2, "per_prompt_stat_tracking.min_count": 2, "prompt_fn": "simple_animals",
       "reward_fn": "jpeg_compressibility", "eval_freq": 0, "final_eval_num_seeds": 0, "save_freq": 0, "log_images_every": 0,
       "wandb.mode": "disabled", "device": "cpu"}
# the image size, in pixels, of every run but the issue's at the defaults: the families whose tiny model's default
# costs seconds a step (4096 tokens: FLUX.1, Kontext, FLUX.2, Qwen-Image; SANA's 1024 px decode) or is beyond its
# position table (Z-Image, Wan); the others sample their pipeline's default everywhere
SIZES = {"flux": 32, "flux_kontext": 32, "flux2": 32, "flux2_dev": 32, "qwenimage": 32, "qwenimage_edit_plus": 32,
         "qwenimage_edit": 32, "zimage": 32, "wan": 16, "wan_i2v": 16, "sana": 64,
         "qwenimage21": 64, "hunyuan_video15": 32, "ltx2": 64, "krea2": 32,
         "sana_video": 32, "ideogram4": 64, "kandinsky6": 64, "hunyuan_image": 64,
         "cosmos3": 32}
AT_DEFAULT_SIZE = tuple(name for name in FAMILIES if name not in SIZES)
# (height, width) of each tiny model at its pipeline's default: its call's (Z-Image's 1024, Wan's 480 x 832) or
# default_sample_size times its VAE factor
DEFAULT_SIZES = {"sd": (16, 16), "sdxl": (16, 16), "sd3": (16, 16), "flux": (256, 256), "flux_kontext": (256, 256),
                 "flux2": (256, 256), "flux2_dev": (256, 256), "qwenimage": (512, 512),
                 "qwenimage_edit_plus": (512, 512), "qwenimage_edit": (512, 512), "zimage": (1024, 1024),
                 "wan": (480, 832), "wan_i2v": (480, 832), "sana": (1024, 1024),
                 "qwenimage21": (1024, 1024), "hunyuan_video15": (32, 32),
                 "ltx2": (512, 768), "krea2": (1024, 1024), "sana_video": (480, 832),
                 "ideogram4": (2048, 2048), "kandinsky6": (512, 768), "hunyuan_image": (2048, 2048),
                 "cosmos3": (720, 1280)}
# the tiny models whose position table cannot take their pipeline's default: refused at start, naming the field
REFUSED_DEFAULTS = {"zimage": "axes_lens=[256, 32, 32]: 32 patches a side, 128 px",
                    "wan": "rope_max_seq_len=32: 32 patches a side, 512 px",
                    "wan_i2v": "rope_max_seq_len=32: 32 patches a side, 512 px",
                    "sana_video": "rope_max_seq_len=32: 32 patches a side, 512 px"}
# the tiny models whose pipeline's defaults are more tokens a forward than a CPU test runs: their default size and
# frames resolved, their latent tokens counted, the run not made
BEYOND_A_CPU = {"cosmos3": "189 frames of 720 x 1280 px are 172,800 latent tokens a forward on the tiny model"}
# (family, run) refused at start: (what the message says, why in the documented table)
REFUSED = {("sd", "nft"): ("algorithm.objective='nft' is defined on the ('flow',) forward process(es); the 'sd' "
                           "family's is 'ddpm'", "defined on the flow-matching forward process only"),
           ("sdxl", "nft"): ("algorithm.objective='nft' is defined on the ('flow',) forward process(es); the 'sdxl' "
                             "family's is 'ddpm'", "defined on the flow-matching forward process only"),
           ("zimage", "nft"): ("train.cfg=False contradicts sample.guidance_scale=1.0: the zimage family guides exactly "
                               "when guidance_scale > 0", "its CFG-free guidance 1 guides Z-Image, whose none is 0"),
           ("krea2", "nft"): ("train.cfg=False contradicts sample.guidance_scale=1.0: the krea2 family guides exactly "
                              "when guidance_scale > 0", "its CFG-free guidance 1 guides Krea 2, whose none is 0"),
           **{("hunyuan_image", run): (f"algorithm.objective={run!r} trains at any time of the forward process; this "
                                       "'hunyuan_image' model's guidance carries ['guidance_momentum']",
                                       "its recipe's training forward guides, and APG's momentum is carried from step "
                                       "to step (unguided it trains)") for run in ("awm", "sft", "dpo", "dgpo")},
           ("ltx2", "nft"): ("train.cfg=False contradicts sample.guidance_scale=1.0 with the audio's scale 7.0",
                             "the audio's CFG stays at the call's 7 (sample.pipeline_guidance.audio_guidance_scale=1 "
                             "turns it off)")}
# each video family's default frames
VIDEO_FRAMES = {"wan": 81, "wan_i2v": 81, "hunyuan_video15": 121, "ltx2": 121, "sana_video": 81, "kandinsky6": 121,
                "cosmos3": 189}
# the frames of the runs not at the defaults where fewer keep the suite short (LTX-2's 121 frames are 5 s of audio and
# 4 forwards a step at its call's defaults); the others sample their default frames everywhere
FRAMES = {"hunyuan_video15": 5, "ltx2": 17, "sana_video": 5, "kandinsky6": 5, "cosmos3": 5}
# each preset with an option a user picks (the flow step's kind: flow families only)
OPTIONS = {
    "grpo": {"kl.reference_update_freq": 1, "kl.reference_mixup_alpha": 0.5},  # the mixup adapter
    "dr_grpo": {"train.step_fraction": 0.5},
    "rloo": {"sample.same_initial_noise": True, "sample.sde_type": "cps"},
    "grpo_passk": {"algorithm.filter_groups": True, "sample.sde_type": "dance_sde", "sample.noise_level": 0.3},
    "ppo_gae": {"use_lora": False, "kl.use_reference_model": True, "kl.beta": 0.01},  # a frozen copy
    "remax": {"algorithm.policy_loss": "dppo"},  # Flow-DPPO's exact-KL mask on every family's Gaussian step
}
FLOW_STEP = ("sample.sde_type", "sample.noise_level")
TREE = {"sample.branch_steps": (1,), "sample.branch_factors": (2,)}  # 2 leaves a root, splitting at the last step


def takes_images(name: str) -> bool:
    return get_family(name).capabilities.image_conditioning


def values(name: str, run: str, at_defaults: bool = False) -> dict:
    """The config overrides of ``run`` on family ``name``: ``RUN``, 2 copies a group, the run's option (``OPTIONS``),
    the family's size (``SIZES``) unless ``at_defaults``."""
    out = dict(RUN)
    if get_config(run).train.group_size > 1:
        out["train.group_size"] = 2
    flow = "sigmas" in get_family(name).time_keys
    out.update({k: v for k, v in OPTIONS.get(run, {}).items() if flow or k not in FLOW_STEP})
    if name in SIZES and not at_defaults:
        out["sample.resolution"] = SIZES[name]
    if name in FRAMES and not at_defaults:
        out["sample.num_frames"] = FRAMES[name]
    return out


def run_values(name: str, run: str, model_dir: str, logdir, run_name: str, rows: str, at_defaults: bool = False,
               **extra) -> dict:
    """``values`` with the model, the run directory and, for a family that reads source images, ``rows``."""
    images = {"prompt_fn": "from_file", "prompt_fn_kwargs": {"path": rows}} if takes_images(name) else {}
    return {**values(name, run, at_defaults), "pretrained.model": model_dir, "logdir": str(logdir),
            "run_name": run_name, **images, **extra}


def config(name: str, run: str, model_dir: str, logdir, run_name: str, rows: str, at_defaults: bool = False, **extra):
    from helpers.trainer_helpers import set_fields

    cfg = get_config(run)
    set_fields(cfg, run_values(name, run, model_dir, logdir, run_name, rows, at_defaults, **extra))
    return cfg


@pytest.fixture(scope="session")
def prompt_rows(tmp_path_factory) -> str:
    """A two-row .jsonl prompt file, one source image a row (32 x 32 and 40 x 24 px: a square on a background)."""
    folder = tmp_path_factory.mktemp("prompt_rows")
    rows = []
    for i, (size, colour) in enumerate([((32, 32), (220, 30, 30)), ((40, 24), (30, 60, 230))]):
        pixels = np.full((size[1], size[0], 3), 240, dtype=np.uint8)
        pixels[4:20, 4 + 4 * i : 20 + 4 * i] = colour
        Image.fromarray(pixels).save(folder / f"source_{i}.png")
        rows.append({"prompt": ["the square turns blue", "a red square spins"][i], "image": f"source_{i}.png"})
    (folder / "rows.jsonl").write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return str(folder / "rows.jsonl")


@pytest.fixture
def family_dirs(family_model_dirs, monkeypatch):
    """conftest.py's ``family_model_dirs`` (a tiny model per family, built once a session), the Qwen-Image-Edit
    pipelines' source sizes made small (trainer_helpers.small_qwen_edit_sources) for the test."""
    from helpers.trainer_helpers import small_qwen_edit_sources

    small_qwen_edit_sources(monkeypatch.setattr)
    return family_model_dirs


def trainer_of(name, run, family_dirs, rows, tmp_path, run_name="run", at_defaults=False, **extra):
    from ddpo_group.run.trainer import Trainer

    return Trainer(config(name, run, family_dirs[name], tmp_path, run_name, rows, at_defaults, **extra))


def assert_trained(trainer, metrics: dict, before: list) -> None:
    """One optimizer step on every family and run: the trained tensors moved (at least every LoRA B matrix: peft's
    A gets no gradient while B is still zero), the losses finite; a critic on every step (ppo_gae) learned."""
    assert metrics["global_step"] == 1
    changed = sum(not torch.equal(b, p.detach()) for b, p in zip(before, trainer.updater.params))
    assert changed >= max(1, len(before) // 2), f"only {changed} of {len(before)} trained tensors changed"
    for key in ("adv/mean", "train/policy_loss", "train/grad_norm"):
        assert np.isfinite(metrics[key]), (key, metrics[key])
    if trainer.critic is not None:  # GROUP_PPO's critic has a target only where a segment ends before the last step
        assert metrics["critic/value_loss"] > 0 if trainer.config.algorithm.adv_estimator == "gae" else np.isfinite(
            metrics["critic/value_loss"])
    if trainer.kl is not None and trainer.kl.beta > 0:  # one optimizer step: every KL (the rollouts', the only train
        # batch's) is the untrained policy's, which is the reference (LoRA B = 0, or a frozen copy)
        assert metrics["ref/kl"] == pytest.approx(0.0, abs=1e-6)


# ------------------------------------------------------------------ the tests
def test_the_matrix_holds_every_family():
    assert set(FAMILIES) == set(FAMILY_REGISTRY.names()) == set(DEFAULT_SIZES)
    assert set(SIZES) | set(AT_DEFAULT_SIZE) == set(FAMILIES) and set(REFUSED_DEFAULTS) | set(BEYOND_A_CPU) <= set(SIZES)
    assert all(name in FAMILIES and run in RUNS for name, run in REFUSED)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_the_issues_grpo_run_at_the_pipelines_defaults(name, family_dirs, prompt_rows, tmp_path):
    """``--config config/base.py:grpo --config.pretrained.model=DIR --config.reward_fn=jpeg_compressibility``, no size,
    frames, tokens or guidance given: the family samples its pipeline's default size and trains an epoch, or (the
    tiny models whose position table is smaller) is refused at start with a message naming sample.resolution, the
    pipeline's default and the largest size the model takes, before any batch; where the defaults are more tokens than
    a CPU test runs (``BEYOND_A_CPU``), the family resolves the pipeline's default size and frames and the run is not
    made."""
    if name in BEYOND_A_CPU:
        cfg = config(name, "grpo", family_dirs[name], tmp_path, "run", prompt_rows, at_defaults=True)
        family = load_family(family_dirs[name], config=cfg)
        assert family.height_width == DEFAULT_SIZES[name] and family.frames == VIDEO_FRAMES[name]
        kwargs = family.pipeline_kwargs(cfg.sample, cfg.pretrained)
        assert (kwargs["height"], kwargs["width"], kwargs["num_frames"]) == (*DEFAULT_SIZES[name], VIDEO_FRAMES[name])
        tokens = int(re.search(r"([\d,]+) latent tokens", BEYOND_A_CPU[name]).group(1).replace(",", ""))
        channels, *grid = family.latent_shape()
        patch = family.patch_size
        assert grid[0] * math.ceil(grid[1] / patch) * math.ceil(grid[2] / patch) == tokens
        return
    if name in REFUSED_DEFAULTS:
        with pytest.raises(ConfigError, match=re.escape(
                f"sample.resolution=0 (the pipeline's default, {DEFAULT_SIZES[name][0]} x {DEFAULT_SIZES[name][1]} "
                f"px) is ") + r".*" + re.escape(REFUSED_DEFAULTS[name])):
            trainer_of(name, "grpo", family_dirs, prompt_rows, tmp_path, at_defaults=True)
        return
    trainer = trainer_of(name, "grpo", family_dirs, prompt_rows, tmp_path, at_defaults=True)
    assert trainer.family.height_width == DEFAULT_SIZES[name]
    before = [p.detach().clone() for p in trainer.updater.params]
    assert_trained(trainer, trainer.run(), before)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_sampler_is_the_pipelines_call_at_its_defaults(name, family_dirs, prompt_rows):
    """The sampler with the pipeline's own sampler (DDIM at eta = the noise level, or the Euler steps: noise level 0)
    gives the images of the pipeline's own ``__call__`` with the family's keywords, bitwise, at the defaults: the
    token budget, the guidance 5.0, the negative prompt, the frames (and the size, for AT_DEFAULT_SIZE). The
    keywords name the size, so that evaluation samples what training did whatever the pipeline's own default."""
    from ddpo_group.prompts import PromptSampler

    cfg = config(name, "grpo", family_dirs[name], "unused", "unused", prompt_rows)
    family = load_family(family_dirs[name], config=cfg)
    prompts, metadata = PromptSampler(cfg.prompt_fn, cfg.prompt_fn_kwargs.to_dict(), seed=0).sample(1)
    kwargs = family.pipeline_kwargs(cfg.sample, cfg.pretrained)
    assert (kwargs["height"], kwargs["width"]) == family.height_width  # the size named, not left to the pipeline
    family.pipe.set_progress_bar_config(disable=True)
    guidance = cfg.sample.guidance_scale
    want = family.pipe(prompt=list(prompts), num_inference_steps=2, **family.guidance_kwargs(guidance),
                       output_type="pt", generator=[torch.Generator().manual_seed(0)], **kwargs,
                       **family.pipeline_row_kwargs(metadata))
    want = family.pipeline_images(want)
    level = kwargs.get("eta", 0.0)
    traj = sample_trajectories(family, family.model, family.condition(prompts, metadata), family.negative_for(metadata),
                               SamplingOptions(2, guidance, [level] * 2, compute_log_prob=False),
                               generator=[torch.Generator().manual_seed(0)])
    assert torch.equal(traj.images, want)


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("name", FAMILIES)
def test_every_preset_and_objective_trains_an_epoch_or_is_refused(name, run, family_dirs, prompt_rows,
                                                                    tmp_path):
    """Each preset (with an option a user picks) and each objective's recipe: one optimizer step, the trained tensors
    moved, the losses finite; or refused at start, the message naming the fields and why."""
    if (name, run) in REFUSED:
        with pytest.raises(ConfigError, match=re.escape(REFUSED[name, run][0])):
            trainer_of(name, run, family_dirs, prompt_rows, tmp_path)
        return
    trainer = trainer_of(name, run, family_dirs, prompt_rows, tmp_path)
    assert trainer.family.name == name and trainer.family.height_width == (
        (SIZES[name],) * 2 if name in SIZES else DEFAULT_SIZES[name])
    assert getattr(trainer.family, "frames", None) == FRAMES.get(name, VIDEO_FRAMES.get(name))
    before = [p.detach().clone() for p in trainer.updater.params]
    assert_trained(trainer, trainer.run(), before)


@pytest.mark.parametrize("name", FAMILIES)
def test_evaluate_on_a_run_and_its_lora_in_the_pipeline(name, family_dirs, prompt_rows, tmp_path):
    """A grpo run adapts every LoRA target module of the family (each matches a module); its LoRA export, loaded by
    the pipeline's own ``load_lora_weights``, samples what the trained model samples (the pipeline's sampler, the same
    noise; to float precision on the CPU) and differs from the base (so the check can fail); scripts/evaluate.py's
    comparison runs on the run with the family's keywords."""
    from config.base import base
    from ddpo_group.prompts import PromptSampler
    from ddpo_group.offline.comparison import EvaluationRequest, evaluate

    trainer = trainer_of(name, "grpo", family_dirs, prompt_rows, tmp_path, "lora", **{"train.learning_rate": 1e-2})
    trainer.run()
    family, cfg = trainer.family, trainer.config
    adapted = {key.split(".lora_A")[0] for key, _ in family.model.named_parameters() if ".lora_A" in key}
    unmatched = {t for t in family.lora_target_modules if not any(module.endswith(t) for module in adapted)}
    # the tiny SD3 transformer's one block is its last, whose context is pre-only: it has no to_add_out
    assert unmatched == ({"attn.to_add_out"} if name == "sd3" else set()), unmatched
    prompts, metadata = PromptSampler(cfg.prompt_fn, cfg.prompt_fn_kwargs.to_dict(), seed=1).sample(1)
    pipe = get_family(name).load_pipeline(family_dirs[name], True, None, {})
    family.prepare_pipeline(pipe)  # the run's settings the pipeline holds (HunyuanVideo 1.5's guider scale)
    pipe.set_progress_bar_config(disable=True)
    kwargs = {**family.pipeline_kwargs(cfg.sample, cfg.pretrained), **family.pipeline_row_kwargs(metadata)}

    def call():
        out = pipe(prompt=list(prompts), num_inference_steps=2, **family.guidance_kwargs(cfg.sample.guidance_scale),
                   output_type="pt", generator=[torch.Generator().manual_seed(0)], **kwargs)
        return family.pipeline_images(out)

    base_images = call()
    family.load_lora(pipe, tmp_path / "lora" / "lora")  # the pipeline's load_lora_weights (HunyuanVideo 1.5: none)
    loaded = call()
    trained = sample_trajectories(family, family.model, family.condition(prompts, metadata),
                                  family.negative_for(metadata),
                                  SamplingOptions(2, cfg.sample.guidance_scale, [kwargs.get("eta", 0.0)] * 2,
                                                  compute_log_prob=False),
                                  generator=[torch.Generator().manual_seed(0)]).images
    assert float((trained - base_images).abs().max()) > 1e-5
    torch.testing.assert_close(loaded, trained, rtol=1e-4, atol=1e-5)

    report = evaluate(EvaluationRequest(str(tmp_path / "lora"), num_prompts=2, num_seeds=1, batch_size=2,
                                        show_progress=False, device="cpu"), base())
    assert report["family"] == name and report["loaded"].startswith("lora:") and report["num_steps"] == 2
    assert report["rewards"]["reward"]["difference"]["n"] == 2
    assert (report["height"], report["width"]) == family.height_width


@pytest.mark.parametrize("name", FAMILIES)
def test_tree_rollouts(name, family_dirs, prompt_rows, tmp_path):
    """grpo with each prompt group sampled as a tree (2 leaves splitting at the last step's noise): the leaves share
    their first transition bitwise and differ after the split; the denoiser ran one row a step for the group instead
    of 2 (twice with classifier-free guidance); the epoch trains."""
    trainer = trainer_of(name, "grpo", family_dirs, prompt_rows, tmp_path, "tree", **TREE)
    with trainer.nfe.counting("sampling"):
        batch = trainer.rollouts.estimate(trainer.rollouts.collect(0)).batch
    family, sample = trainer.family, trainer.config.sample
    guided = sample.guidance_scale > family.no_guidance and not family.guidance_embedded and (
        getattr(family, "classifier_free", True))
    passes = 2 if name == "ltx2" else 0  # LTX-2's spatio-temporal and modality passes at its call's defaults
    assert trainer.nfe.take()[0] == (1 + 1) * ((2 if guided else 1) + passes)
    for key in ("latents", "next_latents", "log_probs"):
        assert torch.equal(getattr(batch, key)[0, 0], getattr(batch, key)[1, 0]), key
    assert not torch.equal(batch.next_latents[0, 1], batch.next_latents[1, 1])
    metrics = trainer.run()
    assert metrics["global_step"] == 1 and np.isfinite(metrics["train/policy_loss"])


def write_teacher(name: str, family_dirs, rows: str, directory: Path, scale: float = 0.05) -> str:
    """A teacher for on-policy distillation as another run would export it: the family's LoRA adapter with random B
    matrices, in diffusers format."""
    from ddpo_group.models.trainable import build_policy
    from ddpo_group.reference.model import lora_layers

    family, _ = build_policy(config(name, "grpo", family_dirs[name], directory.parent, "teacher", rows), "cpu")
    generator = torch.Generator().manual_seed(7)  # A and B both drawn here: the same teacher whatever ran before
    with torch.no_grad():
        for layer in lora_layers(family.model):
            for weights, std in ((layer.lora_A["default"].weight, 1.0 / layer.lora_A["default"].weight.shape[1] ** 0.5),
                                 (layer.lora_B["default"].weight, scale)):
                weights.copy_(torch.randn(weights.shape, generator=generator, dtype=weights.dtype) * std)
    return str(family.save_lora(family.model, directory))


@pytest.mark.parametrize("name", FAMILIES)
def test_on_policy_distillation_from_an_adapter_of_the_family(name, family_dirs, prompt_rows, tmp_path):
    """algorithm.objective="opd" from a LoRA teacher exported on the family's model, loaded by the family's own loader
    beside the grpo recipe's reference adapter: one optimizer step moves the student, the teacher's KL measured."""
    teacher = write_teacher(name, family_dirs, prompt_rows, tmp_path / "teacher")
    trainer = trainer_of(name, "grpo", family_dirs, prompt_rows, tmp_path, "opd",
                         **{"algorithm.objective": "opd", "opd.teachers": {"t": teacher}})
    before = [p.detach().clone() for p in trainer.updater.params]
    metrics = trainer.run()
    changed = sum(not torch.equal(b, p.detach()) for b, p in zip(before, trainer.updater.params))
    assert metrics["global_step"] == 1 and changed >= max(1, len(before) // 2)
    assert metrics["train/opd_kl"] > 0 and np.isfinite(metrics["train/opd_kl"]) and np.isfinite(metrics["train/grad_norm"])


# no image encoding: SFT on a folder is refused
VIDEO_FAMILIES = tuple(name for name in FAMILIES if get_family(name).capabilities.video)


@pytest.mark.parametrize("name", FAMILIES)
def test_clean_latents_invert_decode_on_the_vae_latents(name, family_dirs, prompt_rows, tmp_path):
    """SFT on a folder of images (rollout/image_folder.py): ``clean_latents`` feeds the VAE encoder 2x - 1 and turns
    its latents into the state whose ``decode`` hands the VAE decoder those same latents (the VAE's own encode and
    decode replaced by recorders); a video family has none and is refused by name."""
    from types import SimpleNamespace

    from ddpo_group.errors import ConfigError
    from ddpo_group.models.families.base import encoder_latents
    from ddpo_group.models.trainable import build_policy
    from ddpo_group.rollout.image_folder import ImageFolderRecords

    family, _ = build_policy(config(name, "grpo", family_dirs[name], tmp_path, "encode", prompt_rows), "cpu")
    if name in VIDEO_FAMILIES:
        assert not family.encodes_images()
        with pytest.raises(ConfigError, match=f"the {name!r} family does not encode images"):
            ImageFolderRecords(family.config, family)
        return
    height, width = family.height_width
    images = torch.rand(2, 3, height, width, generator=torch.Generator().manual_seed(0))
    vae, seen = family.pipe.vae, {}
    real_encode = vae.encode

    def encode(pixels, return_dict=True):  # latents of the real encoder's shape, drawn
        seen["pixels"] = pixels
        shape = encoder_latents(real_encode(pixels)).shape
        seen["drawn"] = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        return SimpleNamespace(latents=seen["drawn"].to(pixels.dtype))

    def decode(latents, return_dict=True):
        seen["latents"] = latents
        frame = [1] if latents.dim() == 5 else []
        out = torch.zeros(latents.shape[0], getattr(vae.config, "out_channels", 3), *frame, height, width)
        return (out,)

    vae.encode, vae.decode = encode, decode
    state = family.clean_latents(images)
    assert tuple(state.shape) == (2, *family.latent_shape()) and state.dtype == torch.float32
    pixels = seen["pixels"].reshape(2, -1, height, width).float()
    torch.testing.assert_close(pixels[:, :3], images * 2 - 1)
    family.decode(state)
    torch.testing.assert_close(seen["latents"].float(), seen["drawn"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", [name for name in FAMILIES if name not in VIDEO_FAMILIES])
def test_a_supervised_epoch_on_a_folder_of_images(name, family_dirs, prompt_rows, tmp_path):
    """sft.epochs=1 of a 1-epoch run on a folder of two images (an editing family's rows with their source image):
    one optimizer step of the matching loss on the encoded images moves the trained tensors; no reward is queried."""
    folder = tmp_path / "data"
    folder.mkdir()
    source = json.loads(Path(prompt_rows).read_text().splitlines()[0])["image"]
    rows = []
    for i, colour in enumerate([(220, 30, 30), (30, 60, 230)]):
        pixels = np.full((24, 40, 3), 240, dtype=np.uint8)
        pixels[4:20, 4 + 8 * i : 20 + 8 * i] = colour
        Image.fromarray(pixels).save(folder / f"{i}.png")
        row = {"file_name": f"{i}.png", "text": ["a red square", "a blue square"][i]}
        if takes_images(name):
            row["image"] = str(Path(prompt_rows).parent / source)
        rows.append(row)
    (folder / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    # a family whose guidance carries state (HunyuanImage 2.1's APG momentum) trains its supervised epochs unguided
    unguided = {"sample.guidance_scale": 1.0, "train.cfg": False} if get_family(name).carried_keys else {}
    trainer = trainer_of(name, "grpo", family_dirs, prompt_rows, tmp_path, "sft",
                         **{"sft.data_dir": str(folder), "sft.epochs": 1, **unguided})
    before = [p.detach().clone() for p in trainer.updater.params]
    metrics = trainer.run()
    changed = sum(not torch.equal(b, p.detach()) for b, p in zip(before, trainer.updater.params))
    assert metrics["global_step"] == 1 and changed >= max(1, len(before) // 2) and "reward_mean" not in metrics
    assert np.isfinite(metrics["sft/policy_loss"]) and metrics["sft/policy_loss"] > 0 and metrics["sft/kept"] == 1.0


@pytest.mark.slow
def test_two_processes_over_gloo_train_every_family(family_dirs, prompt_rows, tmp_path):
    """Every family's grpo run on 2 processes (one launch, each process training the families one after another, as
    family_processes.py does): each run gathers both processes' samples (4 rewards) and takes its optimizer step
    on both; the SD family's on-policy distillation from a teacher adapter, and its supervised epoch on a folder of
    images before a grpo epoch."""
    from helpers.launch_helpers import launch_environment, start_workers

    runs = [{"name": name, "config": run_values(name, "grpo", family_dirs[name], tmp_path, name, prompt_rows)}
            for name in FAMILIES]
    teacher = write_teacher("sd", family_dirs, prompt_rows, tmp_path / "teacher")
    runs.append({"name": "sd_opd", "config": run_values("sd", "grpo", family_dirs["sd"], tmp_path, "sd_opd", prompt_rows,
                                                        **{"algorithm.objective": "opd", "opd.teachers": {"t": teacher}})})
    folder = tmp_path / "sft_data"  # three images: the two processes' 2 + 2 rows of an epoch wrap around the folder
    folder.mkdir()
    for i in range(3):
        Image.fromarray(np.full((16, 16, 3), 60 * i, dtype=np.uint8)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(f"a square of grey {i}")
    runs.append({"name": "sd_sft", "config": run_values("sd", "grpo", family_dirs["sd"], tmp_path, "sd_sft", prompt_rows,
                                                        **{"sft.data_dir": str(folder), "sft.epochs": 1,
                                                           "num_epochs": 2})})
    plan = tmp_path / "runs.json"
    plan.write_text(json.dumps(runs))
    workers = start_workers([str(plan)], 2, tmp_path / "logs", env=launch_environment(), timeout=600,
                            script="tests/helpers/family_processes.py")
    assert [w.returncode for w in workers] == [0, 0], workers[0].stderr[-3000:] + workers[1].stderr[-3000:]
    for name in FAMILIES:
        metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert len(metrics) == 1 and metrics[0]["global_step"] == 1, name
        assert metrics[0]["reward_count"] == 4 and np.isfinite(metrics[0]["train/policy_loss"]), name
    distilled = json.loads((tmp_path / "sd_opd" / "metrics.jsonl").read_text().splitlines()[0])
    assert distilled["reward_count"] == 4 and distilled["train/opd_kl"] > 0
    supervised, reinforced = [json.loads(line) for line in (tmp_path / "sd_sft" / "metrics.jsonl").read_text().splitlines()]
    assert supervised["global_step"] == 1 and np.isfinite(supervised["sft/policy_loss"]) and "reward_count" not in supervised
    assert reinforced["global_step"] == 2 and reinforced["reward_count"] == 4


# ------------------------------------------------------------------ the documented table
def paths_table() -> str:
    """docs/model_families.md's table of what this module runs on each family."""
    lines = [f"| family | the issue's `grpo` run at the pipeline's defaults | the other runs' size | the sampler = "
             f"`pipe()`, bitwise | presets ({len(PRESET_RUNS)}) and objectives ({len(OBJECTIVES)}) | "
             "`scripts/evaluate.py`, the LoRA in the pipeline | trees | 2 processes (gloo) |",
             "|---|---|---|---|---|---|---|---|"]
    for name in FAMILIES:
        height, width = DEFAULT_SIZES[name]
        default = f"{height} x {width} px" if height != width else f"{height} px"
        first = (f"refused at start: {default} is beyond the tiny model's position table" if name in REFUSED_DEFAULTS
                 else f"not run: {BEYOND_A_CPU[name]}" if name in BEYOND_A_CPU else f"trains ({default})")
        size = f"{SIZES[name]} px" if name in SIZES else f"the default ({default})"
        if name in VIDEO_FRAMES:
            size += f", {FRAMES[name]} frames" if name in FRAMES else f", {VIDEO_FRAMES[name]} frames (the default)"
        refused = [f"`{run}` refused at start ({REFUSED[name, run][1]})" for run in RUNS if (name, run) in REFUSED]
        runs = "; ".join([f"{len(RUNS) - len(refused)} train", *refused])
        if takes_images(name):
            runs += "; source images from a .jsonl file"
        lines.append(f"| `{name}` | {first} | {size} | yes | {runs} | yes | yes | yes |")
    return "\n".join(lines)


MARKERS = ("<!-- paths table: tests/models/test_family_matrix.py writes it -->", "<!-- end of the paths table -->")


def documented_table() -> str:
    text = DOC.read_text()
    start, end = (text.index(marker) for marker in MARKERS)
    return text[start + len(MARKERS[0]) : end].strip()


def test_the_documented_table_is_this_matrix():
    assert documented_table() == paths_table(), ("docs/model_families.md is stale: "
                                                 "python tests/models/test_family_matrix.py")


if __name__ == "__main__":  # write the table into docs/model_families.md
    text = DOC.read_text()
    start, end = (text.index(marker) for marker in MARKERS)
    DOC.write_text(text[: start + len(MARKERS[0])] + "\n" + paths_table() + "\n" + text[end:])
    sys.exit(0)
