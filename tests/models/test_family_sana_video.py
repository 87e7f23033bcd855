"""The SANA-Video family on a tiny random SanaVideoPipeline (the 480p layout: Wan's VAE; the 720p one: LTX-2's): the
sampler against the pipeline's own call (with CFG and a negative prompt, without, in bfloat16 with the float32 state),
the condition (the call's video instruction), the size and frames at the call's defaults, the refusals (every preset
and objective, the LoRA export in the pipeline, evaluate.py, trees and two processes: test_family_matrix.py)."""

from functools import partial

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SanaVideoPipeline

from ddpo_group.errors import ConfigError
from ddpo_group.models import load_family
from ddpo_group.models.families.sana import call_default
from ddpo_group.models.families.sana_video import SanaVideoFamily
from ddpo_group.models.tiny_random import build_tiny_sana_video_pipeline
from ddpo_group.sampling.trajectories import SamplingOptions, sample_trajectories
from helpers import family_checks
from helpers.family_checks import PROMPTS, assert_the_float32_state_is_the_pipelines, bf16_family_of, generators
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_config

family_of = partial(family_checks.family_of, "sana_video")  # family_of(model_dir, preset="grpo", **overrides)


@pytest.fixture(scope="module")
def sana_video_dir(family_model_dirs):
    return family_model_dirs["sana_video"]


@pytest.fixture(scope="module")
def sana_video_720p_dir(tmp_path_factory):
    """The 720p layout: LTX-2's video VAE (32x / 8x), a transformer of patch 1 and sample_size 22."""
    directory = tmp_path_factory.mktemp("sana_video_720p")
    build_tiny_sana_video_pipeline(vae="ltx2").save_pretrained(directory)
    return str(directory)


def sampled(family, guidance, steps=3, rows=4):
    return sample_trajectories(family, family.model, family.encode(PROMPTS[:rows]), family.negative_condition(),
                               SamplingOptions(steps, guidance, [0.0] * steps, compute_log_prob=False),
                               generator=generators(rows))


@pytest.mark.parametrize("guidance, negative", [(6.0, ""), (6.0, "blurry"), (1.0, "")])
def test_noise_level_zero_reproduces_the_pipelines_own_call(guidance, negative, sana_video_dir):
    """The saved model has the released DPM-Solver++ scheduler; the family swaps it for the flow Euler one of the same
    shift, so the pipeline's own __call__ takes our sampler's Euler steps at noise level 0: the same frames bitwise,
    with CFG (the empty negative prompt or sample.negative_prompt) and without."""
    assert SanaVideoPipeline.load_config(sana_video_dir)["scheduler"][1] == "DPMSolverMultistepScheduler"
    family, config = family_of(sana_video_dir, **{"sample.guidance_scale": guidance, "train.cfg": guidance > 1,
                                                  "sample.negative_prompt": negative})
    assert isinstance(family, SanaVideoFamily) and SanaVideoFamily.config_errors(config) == []
    assert isinstance(family.pipe.scheduler, FlowMatchEulerDiscreteScheduler) and family.pipe.scheduler.config.shift == 3
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    assert kwargs == {"height": 32, "width": 32, "use_resolution_binning": False, "max_sequence_length": 16,
                      "frames": 5, **({"negative_prompt": negative} if negative else {})}
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(PROMPTS, num_inference_steps=3, guidance_scale=guidance, generator=generators(4),
                       output_type="pt", **kwargs).frames
    traj = sampled(family, guidance)
    assert traj.images.shape == (4, 5, 3, 32, 32) and traj.latents.shape == (4, 4, 16, 2, 4, 4)
    assert torch.equal(traj.images, want)
    assert float(traj.images.std()) > 0.01


def test_the_720p_layout_decodes_with_ltx2s_vae(sana_video_720p_dir):
    """The 720p model's LTX-2 video VAE (its latents_mean / latents_std buffers, 8x in time): 9 frames of 64 px are
    latents [4, 2, 2, 2], the pipeline's frames bitwise; resolution 0 is the call's 480 x 832 mapped by the 720p table."""
    family, config = family_of(sana_video_720p_dir, **{"sample.resolution": 64, "sample.num_frames": 9})
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(PROMPTS[:2], num_inference_steps=2, generator=generators(2), output_type="pt",
                       **family.pipeline_kwargs(config.sample, config.pretrained)).frames
    traj = sampled(family, 6.0, steps=2, rows=2)
    assert traj.images.shape == (2, 9, 3, 64, 64) and traj.latents.shape == (2, 3, 4, 2, 2, 2)
    assert torch.equal(traj.images, want)
    with pytest.raises(ConfigError, match=r"sample.resolution=0 \(the pipeline's default, 704 x 1280 px\) is 40 "
                                          "patches of 32 px a side"):  # beyond the tiny rotary table
        family_of(sana_video_720p_dir, **{"sample.resolution": 0, "sample.num_frames": 9})


def test_the_sampler_is_the_call_at_its_own_defaults_where_the_model_takes_them(sana_video_dir):
    """No size, frames or token count given: the call's 480 x 832, mapped by the 480p table (sample_size 30) to
    itself, 81 frames and 300 tokens after its instruction. The tiny transformer's rotary table (32 patches a side)
    cannot take 832 px: refused at start naming the field and the most it takes; its 81 frames (21 latent frames) it
    takes, and at 32 px the family samples the pipeline's call with its defaults' frames and tokens bitwise; 16 px
    (one patch) the pipeline's check_inputs refuses (a multiple of 32), and so does the family, at start."""
    with pytest.raises(ConfigError, match=r"sample.resolution=0 \(the pipeline's default, 480 x 832 px\) is 52 patches "
                                          r"of 16 px a side, beyond this model's position table "
                                          r"\(SanaVideoTransformer3DModel's rope_max_seq_len=32: 32 patches a side, "
                                          r"512 px\)"):
        family_of(sana_video_dir, **{"sample.resolution": 0, "sample.num_frames": 0})
    with pytest.raises(ConfigError, match=r"sample.resolution=16 is not a multiple of 32 px \(the pipeline's "
                                          r"check_inputs\)"):
        family_of(sana_video_dir, **{"sample.resolution": 16})
    family, _ = family_of(sana_video_dir, **{"sample.resolution": 32, "sample.num_frames": 0,
                                             "pretrained.max_sequence_length": 0})
    assert family.frames == 81 and family.latent_shape() == (16, 21, 4, 4)
    assert family.encode(["a cat"])["prompt_embeds"].shape == (1, 300, 16)
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(PROMPTS[:1], num_inference_steps=2, generator=generators(1), output_type="pt", height=32,
                       width=32, use_resolution_binning=False).frames
    traj = sampled(family, 6.0, steps=2, rows=1)
    assert traj.images.shape == (1, 81, 3, 32, 32) and torch.equal(traj.images, want)


def test_the_condition_is_the_pipelines_after_its_video_instruction(sana_video_dir):
    """The prompts are encoded after SanaVideoPipeline's own (video) complex human instruction, not SANA's; the
    negative prompt without it; each as the pipeline's encode_prompt gives them."""
    family, _ = family_of(sana_video_dir, **{"sample.negative_prompt": "blurry"})
    instruction = call_default(SanaVideoPipeline, "complex_human_instruction")
    assert "video generation" in instruction[0]
    want, want_mask, negative, negative_mask = family.pipe.encode_prompt(
        PROMPTS, do_classifier_free_guidance=True, negative_prompt="blurry", max_sequence_length=16,
        complex_human_instruction=instruction)
    cond = family.encode(PROMPTS)
    assert torch.equal(cond["prompt_embeds"], want) and torch.equal(cond["prompt_attention_mask"], want_mask)
    assert torch.equal(family.negative_condition()["prompt_embeds"], negative[:1])
    assert torch.equal(family.negative_condition()["prompt_attention_mask"], negative_mask[:1])


@pytest.mark.parametrize("guidance", [6.0, 1.0])
def test_in_bf16_the_state_stays_in_float32_as_the_pipelines(guidance, sana_video_dir):
    """Loaded in bfloat16, the pipeline keeps its latents in float32 (the transformer reads a bf16 copy): our sampler
    at noise level 0 gives its frames bitwise, with CFG and without; rounding the state to bf16 every step would not."""
    family, config = bf16_family_of("sana_video", sana_video_dir, **{"sample.guidance_scale": guidance,
                                                                     "train.cfg": guidance > 1})
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(PROMPTS, num_inference_steps=3, guidance_scale=guidance, generator=generators(4),
                       output_type="pt", **family.pipeline_kwargs(config.sample, config.pretrained)).frames
    assert want.dtype == torch.bfloat16
    assert_the_float32_state_is_the_pipelines(family, lambda: sampled(family, guidance), want)


def test_what_the_family_refuses_is_named(sana_video_dir, tmp_path):
    """Frames that are not 4 k + 1 for Wan's VAE, or beyond the rotary table, refused at start by name; a
    guidance-distilled transformer and a causal (LongLive) one refused by name; no supervised epochs on images."""
    with pytest.raises(ConfigError, match=r"sample.num_frames=6 must be 1 more than a multiple of 4 \(the VAE's "
                                          "temporal factor, AutoencoderKLWan's\\)"):
        family_of(sana_video_dir, **{"sample.num_frames": 6})
    with pytest.raises(ConfigError, match=r"sample.num_frames=129 is 33 latent frames, beyond this model's position "
                                          r"table .*: set sample.num_frames to at most 125"):
        family_of(sana_video_dir, **{"sample.num_frames": 129})
    config = tiny_config("grpo", sana_video_dir, "unused", **FAMILY_OVERRIDES["sana_video"])
    pipe = SanaVideoPipeline.from_pretrained(sana_video_dir)
    pipe.transformer.register_to_config(guidance_embeds=True)
    with pytest.raises(ValueError, match="SanaVideoTransformer3DModel has guidance_embeds=True"):
        SanaVideoFamily(pipe, config)
    pipe.transformer.register_to_config(guidance_embeds=False)
    pipe.transformer.__class__ = type("SanaVideoCausalTransformer3DModel", (type(pipe.transformer),), {})
    with pytest.raises(ValueError, match="SanaVideoCausalTransformer3DModel \\(LongLive's causal transformer"):
        SanaVideoFamily(pipe, config)
    assert not SanaVideoFamily.encodes_images() and load_family(sana_video_dir, config=config).name == "sana_video"


@pytest.mark.slow
def test_the_cosmos_rl_recipe_runs_on_the_tiny_model(sana_video_dir, tmp_path):
    """Cosmos-RL's SANA-Video DiffusionNFT recipe (its model replaced by the tiny one, its sizes by tiny ones)."""
    from helpers.trainer_helpers import tiny_trainer

    overrides = {**FAMILY_OVERRIDES["sana_video"], "sample.num_steps": 3, "mixed_precision": "no",
                 "reward_fn": "jpeg_compressibility"}
    trainer = tiny_trainer("cosmos_rl_sana_video_nft", sana_video_dir, tmp_path, "recipe", **overrides)
    config = trainer.config
    assert (config.lora_rank, config.lora_alpha, config.algorithm.objective) == (4, 4, "nft")
    assert config.sample.guidance_scale == 1.0 and not config.train.cfg and config.kl.beta == 1e-4
    assert trainer.family.name == "sana_video" and trainer.family.frames == 5
    metrics = trainer.run()
    assert metrics["global_step"] >= 1 and torch.isfinite(torch.tensor(metrics["train/policy_loss"]))


def test_the_full_size_bench_shape_builds():
    """models/full_size.py's sana_video, on the meta device: SANA-Video 2B's transformer and a Gemma-2-2B-sized text
    encoder; the family reads its sizes (81 frames of 480 x 832: 21 x 60 x 104 latents of 16 channels)."""
    from config.base import base as base_config
    from ddpo_group.models.full_size import build_sana_video

    pipe, millions = family_checks.full_size_on_meta(build_sana_video)
    assert 1950 < millions["transformer"] < 2160, millions
    assert 2480 < millions["text_encoder"] < 2750, millions  # Gemma-2-2B's decoder
    family = SanaVideoFamily(pipe, base_config())
    assert family.frames == 81 and family.height_width == (480, 832)
    assert family.latent_shape() == (16, 21, 60, 104)
