"""The Cosmos 3 family on a tiny random Cosmos3OmniPipeline (a mixture-of-transformers reading token ids, the tiny Wan
VAE, the released UniPC scheduler's config, a sound tokenizer): the sampler's frames and sound against the pipeline's
own call, one prompt a call (CFG with its inverse sentences, a given negative prompt, none, an image), the scheduler
swap onto the released schedule, the condition (the call's token ids), the recorded log-probs scored again, the
refusals (every preset and objective, the LoRA export in the pipeline, evaluate.py, trees and two processes:
test_family_matrix.py)."""

from functools import partial

import pytest
import torch
from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler

from ddpo_group.errors import ConfigError
from ddpo_group.models.families.cosmos3 import Cosmos3Family, EulerOnTheSchedule
from ddpo_group.models.tiny_random import COSMOS3_UNIPC
from ddpo_group.sampling.trajectories import SamplingOptions, sample_trajectories
from helpers import family_checks
from helpers.batch_helpers import batch_of
from helpers.family_checks import (PROMPTS, assert_rescored, assert_the_float32_state_is_the_pipelines, bf16_family_of,
                                   generators)
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_config, tiny_trainer

family_of = partial(family_checks.family_of, "cosmos3")  # family_of(model_dir, preset="grpo", **overrides)


@pytest.fixture(scope="module")
def cosmos3_dir(family_model_dirs):
    return family_model_dirs["cosmos3"]


def sampled(family, guidance, steps=3, rows=2, levels=None):
    return sample_trajectories(family, family.model, family.encode(PROMPTS[:rows]), family.negative_condition(),
                               SamplingOptions(steps, guidance, levels or [0.0] * steps,
                                               compute_log_prob=levels is not None), generator=generators(rows))


def pipeline_calls(family, config, guidance, rows=2, steps=3, **extra):
    """The pipeline's own call, one prompt a call (its only way), each with its row's generator."""
    family.pipe.set_progress_bar_config(disable=True)
    kwargs = {**family.pipeline_kwargs(config.sample, config.pretrained), **extra}
    return [family.pipe(PROMPTS[i], num_inference_steps=steps, guidance_scale=guidance, output_type="pt",
                        generator=generators(rows)[i], **kwargs) for i in range(rows)]


@pytest.mark.parametrize("audio", [False, True])
@pytest.mark.parametrize("guidance, negative", [(6.0, ""), (6.0, "blurry"), (1.0, "")])
def test_noise_level_zero_reproduces_the_pipelines_frames_and_sound(guidance, negative, audio, cosmos3_dir):
    """The released UniPC swapped for Euler steps on its own schedule (0.995 ... 0.128, integer timesteps): the
    pipeline's call and our sampler give the same frames (and sound) bitwise, with CFG (the inverse sentences, a given
    negative prompt) and without, with the sound (the state the video's and the sound's latents joined) and without."""
    family, config = family_of(cosmos3_dir, **{"sample.guidance_scale": guidance, "train.cfg": guidance > 1,
                                               "sample.negative_prompt": negative, "sample.audio": audio})
    assert isinstance(family, Cosmos3Family) and family.config_errors(config) == []
    assert isinstance(family.pipe.scheduler, EulerOnTheSchedule) and family.capabilities.audio == audio
    assert family.pipeline_kwargs(config.sample, config.pretrained) == {"height": 32, "width": 32, "num_frames": 5,
                                                                          "enable_sound": audio}
    outputs = pipeline_calls(family, config, guidance, **({"negative_prompt": negative} if negative else {}))
    traj = sampled(family, guidance)
    assert traj.latents.shape[2:] == ((16, 2, 4, 4) if not audio else (16 * 2 * 4 * 4 + 8 * 6, 1))
    assert torch.equal(traj.images, torch.cat([family.pipeline_images(o) for o in outputs]))
    assert traj.images.shape == (2, 5, 3, 32, 32) and float(traj.images.std()) > 0.01
    if audio:
        want = torch.cat([family.pipeline_audio(o) for o in outputs])
        assert traj.audio.shape == (2, 2, 6 * 1920) and torch.equal(traj.audio, want)
        assert family.audio_sample_rate == 48000
    assert family.pipe.scheduler.timesteps.tolist() == [995.0, 929.0, 128.0]


@pytest.mark.parametrize("guidance", [6.0, 1.0])
def test_in_bf16_the_state_stays_in_float32_as_the_pipelines(guidance, cosmos3_dir):
    """Loaded in bfloat16, the call keeps its latents in float32 (the model reads a bf16 copy, its velocities cast back
    for CFG and the step): our sampler at noise level 0 gives its frames bitwise, guided and not; rounding the state to
    bf16 every step would not."""
    family, config = bf16_family_of("cosmos3", cosmos3_dir, **{"sample.guidance_scale": guidance,
                                                               "train.cfg": guidance > 1})
    want = torch.cat([family.pipeline_images(o) for o in pipeline_calls(family, config, guidance)])
    assert_the_float32_state_is_the_pipelines(family, lambda: sampled(family, guidance), want)


def test_the_schedule_is_the_released_solvers_and_an_image_is_one_frame(cosmos3_dir):
    """EulerOnTheSchedule sets the released UniPC's sigmas and integer timesteps for any step count; the released
    solver itself samples another trajectory from the same noise. num_frames=1 is an image (the call's image
    sentences)."""
    unipc = UniPCMultistepScheduler(**COSMOS3_UNIPC)
    euler = EulerOnTheSchedule.of(unipc)
    for steps in (3, 10):
        unipc.set_timesteps(steps)
        euler.set_timesteps(steps)
        assert torch.equal(euler.sigmas, unipc.sigmas.float()) and euler.timesteps.tolist() == unipc.timesteps.tolist()
    family, config = family_of(cosmos3_dir, **{"sample.num_frames": 1})
    assert family.latent_shape() == (16, 1, 4, 4)
    ids = family.encode(["a cat"])
    text = family.pipe.text_tokenizer.decode(ids["input_ids"][0, :int(ids["input_lengths"][0])])
    assert "a cat. This image is of 32x32 resolution." in text and "seconds" not in text
    output = pipeline_calls(family, config, 6.0, rows=1)[0]
    traj = sampled(family, 6.0, rows=1)
    assert torch.equal(traj.images, family.pipeline_images(output)) and traj.images.shape == (1, 1, 3, 32, 32)
    released = Cosmos3OmniPipeline.from_pretrained(cosmos3_dir)
    released.set_progress_bar_config(disable=True)
    other = released(PROMPTS[0], num_inference_steps=3, output_type="pt", generator=generators(1)[0], height=32,
                     width=32, num_frames=1).video
    assert not torch.equal(other[None], traj.images)


def test_the_condition_is_the_calls_token_ids(cosmos3_dir):
    """encode: the call's tokenize_prompt of each prompt (its sentences, the end-of-text and start-of-generation
    tokens), zero-padded with the lengths; encode_negative: the negative prompt with the inverse sentences."""
    family, _ = family_of(cosmos3_dir)
    cond, negative = family.encode(PROMPTS), family.encode_negative(["blurry"])
    for i, prompt in enumerate(PROMPTS):
        want, _ = family.pipe.tokenize_prompt(prompt, "", num_frames=5, height=32, width=32, fps=24.0)
        assert cond["input_ids"][i, :int(cond["input_lengths"][i])].tolist() == want
        assert not cond["input_ids"][i, int(cond["input_lengths"][i]):].any()
    _, want = family.pipe.tokenize_prompt("x", "blurry", num_frames=5, height=32, width=32, fps=24.0)
    assert negative["input_ids"][0, :int(negative["input_lengths"][0])].tolist() == want
    assert "blurry. The video is not 0.2 seconds long" in family.pipe.text_tokenizer.decode(want)
    embeds = family.text_embeds(cond)  # the critic's text input: the model's embeddings, zero past each row's length
    assert embeds.shape == (4, 512, 32) and not embeds[0, int(cond["input_lengths"][0]):].any()
    # every row the same width whatever its batch (the text cache, per-row negative prompts, pooled rounds join rows)
    alone = family.encode(PROMPTS[:1])
    assert torch.equal(alone["input_ids"], cond["input_ids"][:1])
    rows = family.negative_rows([{"negative_prompt": "blurry"}, {}])
    assert rows["input_ids"].shape == (2, 512) and torch.equal(rows["input_ids"][0], negative["input_ids"][0])
    short, _ = family_of(cosmos3_dir, **{"pretrained.max_sequence_length": 40})
    with pytest.raises(ValueError, match=r"prompt 'a cat' is \d+ tokens with the call's sentences and template, more "
                                         r"than pretrained.max_sequence_length=40"):
        short.encode(["a cat"])


@pytest.mark.parametrize("audio", [False, True])
def test_the_recorded_log_probs_come_back(audio, cosmos3_dir):
    """Stochastic steps (over the joined state with the sound): the recorded log-probs come back bitwise in the
    sampling batch and to 1e-5 in chunks of the training forward."""
    family, config = family_of(cosmos3_dir, **{"sample.audio": audio})
    traj = sampled(family, config.sample.guidance_scale, levels=[0.7] * 3)
    assert (traj.log_probs != 0).all()
    assert_rescored(family, config, traj, batch_of(traj, family.encode(PROMPTS[:2])), tolerance=1e-5)


def test_the_sound_reaches_a_reward_written_outside(cosmos3_dir, tmp_path):
    """sample.audio: a grpo epoch rewarded by tests/plugins/audio_reward.py: every reward call got the stereo
    waveform at 48 kHz, and the epoch trained."""
    trainer = tiny_trainer("grpo", cosmos3_dir, tmp_path, "sound", device="cpu", **FAMILY_OVERRIDES["cosmos3"],
                           reward_fn="tests/plugins/audio_reward.py:make_loudness", **{"sample.audio": True})
    metrics = trainer.run()
    assert metrics["global_step"] == 2 and metrics["reward_info/channels"] == 2
    assert metrics["reward_info/samples"] == 6 * 1920 and metrics["reward_std"] > 0


def test_what_the_family_refuses_is_named(cosmos3_dir, tmp_path):
    """Frames that are not 4 k + 1; the sound on a checkpoint without one; sample.audio on another family; a
    weight below 1."""
    with pytest.raises(ConfigError, match=r"sample.num_frames=6 must be 1 more than a multiple of 4"):
        family_of(cosmos3_dir, **{"sample.num_frames": 6})
    config = tiny_config("grpo", cosmos3_dir, "unused", **{**FAMILY_OVERRIDES["cosmos3"], "sample.audio": True})
    pipe = Cosmos3OmniPipeline.from_pretrained(cosmos3_dir)
    pipe.sound_tokenizer = None
    with pytest.raises(ValueError, match="sample.audio=True needs a sound-capable Cosmos 3 checkpoint"):
        Cosmos3Family(pipe, config)
    with pytest.raises(ConfigError, match="sample.audio=True: the sd family has no optional soundtrack"):
        tiny_trainer("grpo", family_model_dir_of_sd(tmp_path), tmp_path, "sd", device="cpu", **{"sample.audio": True})
    config.sample.guidance_scale, config.train.cfg = 0.5, False
    assert any("sample.guidance_scale=0.5 must be >= 1" in e for e in Cosmos3Family.config_errors(config))


def family_model_dir_of_sd(tmp_path):
    from ddpo_group.models.tiny_random import build_tiny_pipeline

    directory = tmp_path / "sd"
    build_tiny_pipeline().save_pretrained(directory)
    return str(directory)


@pytest.mark.slow
def test_the_miles_recipe_runs_on_the_tiny_model(cosmos3_dir, tmp_path):
    """Miles's Flow-GRPO recipe for Cosmos 3 (its model replaced by the tiny one, its sizes by tiny ones, its window
    moved onto the 3 steps): LoRA 64 / 128 on the generation tokens' attention, CFG 4 in training, one frame."""
    overrides = {**FAMILY_OVERRIDES["cosmos3"], "sample.num_frames": 1, "sample.num_steps": 3,
                 "sample.sde_window_start": 1, "sample.num_batches_per_epoch": 4, "train.gradient_accumulation_steps": 4,
                 "mixed_precision": "no"}
    trainer = tiny_trainer("miles_cosmos3_pickscore", cosmos3_dir, tmp_path, "recipe", reward_fn="jpeg_compressibility",
                           **overrides)
    config = trainer.config
    assert (config.lora_rank, config.lora_alpha, config.train.group_size, config.kl.beta) == (64, 128, 4, 0.0)
    assert not config.kl.use_reference_model and trainer.kl is None
    assert config.sample.guidance_scale == 4.0 and config.train.cfg and config.algorithm.global_std
    assert trainer.family.name == "cosmos3" and trainer.family.latent_shape() == (16, 1, 4, 4)
    metrics = trainer.run()
    assert metrics["global_step"] >= 1 and torch.isfinite(torch.tensor(metrics["train/policy_loss"]))


def test_the_full_size_bench_shape_builds():
    """models/full_size.py's cosmos3, on the meta device: Cosmos 3's transformer (the class defaults, with the sound
    head; no text encoder: it embeds the token ids) and its sound tokenizer; the family reads its sizes (189 frames of
    720 x 1280: 48 x 45 x 80 latents of 48 channels)."""
    from config.base import base as base_config
    from ddpo_group.models.full_size import build_cosmos3

    pipe, millions = family_checks.full_size_on_meta(build_cosmos3)
    assert 14400 < millions["transformer"] < 15900, millions
    assert "text_encoder" not in millions and 470 < millions["sound_tokenizer"] < 520, millions
    family = Cosmos3Family(pipe, base_config())
    assert family.frames == 189 and family.height_width == (720, 1280)
    assert family.latent_shape() == (48, 48, 45, 80)
