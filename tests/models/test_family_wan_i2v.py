"""Wan image-to-video (wan_i2v) on tiny WanImageToVideoPipelines built from config: Wan2.1-I2V's layout (a CLIP image
encoder whose tokens the cross-attention reads beside 512 text tokens) and Wan2.2-I2V-A14B's (two experts, no image
encoder). The sampler against the pipeline's own call, the recorded log-probs against a re-score, the source image in
the condition and in the cache key, what the family refuses, Flow-Factory's recipe trained from a two-row .jsonl, the
full-size bench shape. Every preset and objective, scripts/evaluate.py, the exported LoRA in the pipeline, trees and
two processes: tests/models/test_family_matrix.py."""

import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
from PIL import Image

from config.base import get_config
from ddpo_group.errors import ConfigError
from ddpo_group.models.families.wan_i2v import WanImageToVideoFamily
from ddpo_group.models.tiny_random import build_tiny_wan_i2v_pipeline, save_pipeline
from ddpo_group.sampling.trajectories import SamplingOptions, sample_trajectories
from helpers import family_checks
from helpers.family_checks import assert_the_recorded_log_probs_come_back, generators
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_config, tiny_trainer

PROMPTS = ["the square turns", "a red box spins", "x"]


def sources(folder: Path) -> list[str]:
    """Two PNG sources of other sizes than the video: 32 x 32 and 40 x 24 px, a square on a background."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (size, colour) in enumerate([((32, 32), (220, 30, 30)), ((40, 24), (30, 60, 230))]):
        pixels = np.full((size[1], size[0], 3), 240, dtype=np.uint8)
        pixels[4:20, 4 + 4 * i : 20 + 4 * i] = colour
        Image.fromarray(pixels).save(folder / f"source_{i}.png")
        paths.append(str(folder / f"source_{i}.png"))
    return paths


family_of = partial(family_checks.family_of, "wan_i2v")  # family_of(model_dir, **overrides)


@pytest.fixture(scope="module")
def tiny_a14b_dir(tmp_path_factory):
    """Wan2.2-I2V-A14B's layout, tiny: two experts switched at boundary_ratio 0.9, no image encoder."""
    return save_pipeline(build_tiny_wan_i2v_pipeline(boundary_ratio=0.9), tmp_path_factory.mktemp("a14b") / "model")


@pytest.mark.parametrize("guidance, negative", [(5.0, ""), (5.0, "static, blurred"), (1.0, "")])
def test_noise_level_zero_reproduces_the_pipelines_own_call(guidance, negative, family_model_dirs, tmp_path):
    """Three prompts animating one source image (the pipeline conditions a call on one image): the pipeline's own
    frames bitwise, with and without guidance, the empty or a given negative prompt. The condition is the pipeline's:
    512 UMT5 tokens, the image's 17 CLIP tokens, the first-frame mask (its latent frame's 4 channels ones, the later
    frames' zeros) over the VAE latent of [image, 4 zero frames]; another source gives other frames."""
    family, config = family_of(family_model_dirs["wan_i2v"], **{"sample.guidance_scale": guidance,
                                                                 "sample.negative_prompt": negative})
    assert isinstance(family, WanImageToVideoFamily) and isinstance(family.pipe, WanImageToVideoPipeline)
    assert isinstance(family.pipe.scheduler, FlowMatchEulerDiscreteScheduler)  # the released UniPC swapped
    paths = sources(tmp_path)
    metadata = [{"image": paths[1]}] * 3
    cond = family.condition(PROMPTS, metadata)
    assert {key: tuple(value.shape) for key, value in cond.items()} == {
        "prompt_embeds": (3, 512, 32), "image_condition": (3, 20, 2, 2, 2), "image_embeds": (3, 17, 4)}
    mask = cond["image_condition"][:, :4]
    assert bool((mask[:, :, 0] == 1).all()) and bool((mask[:, :, 1:] == 0).all())
    image = family.pipeline_row_kwargs(metadata[:1])["image"]  # as loaded: the pipeline resizes it
    kwargs = {**family.pipeline_kwargs(config.sample, config.pretrained), "image": image}
    assert image.size == (40, 24) and (kwargs["height"], kwargs["width"], kwargs["num_frames"]) == (16, 16, 5)
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(prompt=list(PROMPTS), num_inference_steps=3, guidance_scale=guidance, generator=generators(3),
                       output_type="pt", **kwargs).frames
    traj = sample_trajectories(family, family.model, cond, family.negative_condition(),
                               SamplingOptions(3, guidance, [0.0] * 3, compute_log_prob=False), generator=generators(3))
    assert traj.images.shape == (3, 5, 3, 16, 16) and torch.equal(traj.images, want)
    other = sample_trajectories(family, family.model, family.condition(PROMPTS, [{"image": paths[0]}] * 3),
                                family.negative_condition(),
                                SamplingOptions(3, guidance, [0.0] * 3, compute_log_prob=False),
                                generator=generators(3))
    assert not torch.equal(other.images, want)  # the source image conditions the video


def test_two_experts_without_an_image_encoder_sample_as_the_pipeline(tiny_a14b_dir, tmp_path):
    """Wan2.2-I2V-A14B's layout: the transformer reads no CLIP tokens (image_embeds empty), the high-noise expert is
    the trained model, the low-noise steps run the frozen transformer_2 and are deterministic; the pipeline's own
    frames bitwise at noise level 0."""
    family, config = family_of(tiny_a14b_dir, **{"sample.sde_window_size": 0})
    assert family.pipe.image_encoder is None and family.model is family.pipe.transformer and family.boundary == 900.0
    assert family.stochastic_steps(config.sample).tolist() == [True, False, False, False]  # t: 1000, 858, 602, 9
    metadata = [{"image": sources(tmp_path)[0]}] * 3
    cond = family.condition(PROMPTS, metadata)
    assert cond["image_embeds"].shape == (3, 0, 1)
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(prompt=list(PROMPTS), num_inference_steps=4, guidance_scale=5.0, generator=generators(3),
                       output_type="pt", **family.pipeline_kwargs(config.sample, config.pretrained),
                       **family.pipeline_row_kwargs(metadata[:1])).frames
    traj = sample_trajectories(family, family.model, cond, family.negative_condition(),
                               SamplingOptions(4, 5.0, [0.0] * 4, compute_log_prob=False), generator=generators(3))
    assert torch.equal(traj.images, want)


def test_the_recorded_log_probs_equal_a_re_score(family_model_dirs, tmp_path):
    """The recorded transitions scored again with the batch record's condition (the image's latent and tokens
    included, rows of two sources): the recorded log-probs bitwise in the sampling batch, the ratio 1 to within 3e-6
    in other chunks."""
    family, config = family_of(family_model_dirs["wan_i2v"], **{"sample.sde_window_size": 0})
    paths = sources(tmp_path)
    cond = family.condition(PROMPTS + ["y"], [{"image": paths[i % 2]} for i in range(4)])
    assert_the_recorded_log_probs_come_back(family, config, cond, tolerance=3e-6)


def test_the_cache_is_keyed_by_prompt_and_image(family_model_dirs, tmp_path):
    """The text-embedding cache keeps each (prompt, source image) once: another image, another condition; the same
    pair, the same condition as encoded directly."""
    from ddpo_group.rollout.sampler import TextEmbeddingCache, encode_unique

    family, _ = family_of(family_model_dirs["wan_i2v"])
    red, blue = sources(tmp_path)
    prompts = ["spin", "spin", "other", "spin"]
    metadata = [{"image": red}, {"image": blue}, {"image": red}, {"image": red}]
    cache = TextEmbeddingCache(size=8)
    cached = encode_unique(family, prompts, cache, metadata)
    assert list(cache.entries) == [("spin", red), ("spin", blue), ("other", red)]
    direct = family.condition(prompts, metadata)
    for key in family.cond_keys:
        torch.testing.assert_close(cached[key], direct[key], rtol=1e-5, atol=1e-6)
        assert torch.equal(cached[key][0], cached[key][3])
    assert not torch.equal(cached["image_condition"][0], cached["image_condition"][1])
    assert torch.equal(cached["prompt_embeds"][0], cached["prompt_embeds"][1])


def test_what_the_family_refuses(family_model_dirs, tmp_path):
    """A prompt without a source image or with two; a token budget other than the 512 the transformer splits its
    context by; Wan2.2-TI2V-5B's expand_timesteps; a transformer reading CLIP tokens without an image encoder."""
    model_dir = family_model_dirs["wan_i2v"]
    family, _ = family_of(model_dir)
    paths = sources(tmp_path)
    with pytest.raises(ValueError, match=r"wan_i2v animates one source image a prompt: prompt 'a' has 0"):
        family.condition(["a"], [{}])
    with pytest.raises(ValueError, match=r"prompt 'b' has 2"):
        family.condition(["b"], [{"image": paths}])
    with pytest.raises(ConfigError, match=r"pretrained.max_sequence_length=16: .* takes the last 512 tokens of its "
                                          r"context as the text's"):
        family_of(model_dir, **{"pretrained.max_sequence_length": 16})
    pipe = WanImageToVideoPipeline.from_pretrained(model_dir)
    pipe.register_to_config(expand_timesteps=True)
    config = tiny_config("grpo", model_dir, "unused", **FAMILY_OVERRIDES["wan_i2v"])
    with pytest.raises(ValueError, match=r"expand_timesteps=True \(Wan2.2-TI2V-5B's image-to-video"):
        WanImageToVideoFamily(pipe, config)
    pipe.register_to_config(expand_timesteps=False)
    pipe.image_encoder = None
    with pytest.raises(ValueError, match=r"reads CLIP image embeddings \(image_dim=4\) but the pipeline has no "
                                         r"image_encoder"):
        WanImageToVideoFamily(pipe, config)


@pytest.mark.slow
def test_the_flow_factory_recipe_trains_from_a_two_row_jsonl(family_model_dirs, tmp_path):
    """Flow-Factory's Wan2.1 image-to-video recipe (its model replaced by the tiny one, its sizes by tiny ones, its
    PickScore by the built-in jpeg reward), from a two-row .jsonl of source images, with the cache of (prompt, image)
    conditions, chunked decoding and gradient checkpointing: an epoch trains and the reward sees the sources."""
    recipe = get_config("flow_factory_wan21_i2v")
    assert recipe.pretrained.model == "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers" and recipe.prompt_fn == "from_file"
    assert (recipe.lora_rank, recipe.lora_alpha, recipe.train.group_size, recipe.sample.resolution,
            recipe.sample.num_frames) == (64, 128, 16, 240, 5)
    assert (recipe.sample.noise_level, recipe.sample.guidance_scale, recipe.train.cfg, recipe.train.learning_rate) == (
        0.9, 5.0, True, 1e-4)
    assert recipe.sample.batch_size * recipe.sample.num_batches_per_epoch * 8 == 48 * 16  # 48 prompts over 8 processes
    paths = sources(tmp_path / "data")
    rows = [{"prompt": "the square turns blue", "image": Path(paths[0]).name},
            {"prompt": "a red square spins", "image": Path(paths[1]).name, "negative_prompt": "static"}]
    (tmp_path / "data" / "rows.jsonl").write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    overrides = {**FAMILY_OVERRIDES["wan_i2v"], "prompt_fn": "from_file",
                 "prompt_fn_kwargs": {"path": str(tmp_path / "data" / "rows.jsonl")},
                 "reward_fn": "jpeg_compressibility", "sample.text_embedding_cache": 16, "sample.decode_batch_size": 3,
                 "sample.num_steps": 4, "sample.batch_size": 4, "sample.num_batches_per_epoch": 2,
                 "train.batch_size": 4, "train.gradient_accumulation_steps": 2, "train.pairs_per_forward": 4,
                 "train.gradient_checkpointing": True, "mixed_precision": "no", "eval_freq": 0, "device": "cpu"}
    trainer = tiny_trainer("flow_factory_wan21_i2v", family_model_dirs["wan_i2v"], tmp_path, "recipe", **overrides)
    assert trainer.family.name == "wan_i2v" and trainer.family.model.is_gradient_checkpointing
    assert trainer.config.train.group_size == 4  # 16 in the recipe
    metrics = trainer.run()
    assert metrics["global_step"] == 1 and np.isfinite(metrics["train/policy_loss"])
    keys = set(trainer.rollouts.sampler.text_cache.entries)  # the epoch's prompts (drawn from the two rows) with their images
    assert keys and keys <= {(row["prompt"], str(tmp_path / "data" / row["image"])) for row in rows}


def test_the_bench_shape_is_wan21_i2v_14b():
    """models/full_size.py's wan21_i2v14b on the meta device: Wan2.1-I2V-14B's transformer (16.4B, 36 input
    channels, CLIP tokens of width 1280) and CLIP ViT-H/14 vision encoder (0.63B); the family takes it and samples the
    pipeline's 81 frames of 480 x 832 (21 latent frames of 60 x 104)."""
    from ddpo_group.models.full_size import BUILDERS
    with torch.device("meta"):
        pipe = BUILDERS["wan21_i2v14b"]()
    billions = {name: round(sum(p.numel() for p in module.parameters()) / 1e9, 2)
                for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}
    assert billions["transformer"] == pytest.approx(16.4, abs=0.01) and billions["image_encoder"] == pytest.approx(0.63)
    assert pipe.transformer.config.in_channels == 36 and pipe.transformer.config.image_dim == 1280
    family = WanImageToVideoFamily(pipe, get_config("grpo"))
    assert family.latent_shape() == (16, 21, 60, 104) and family.height_width == (480, 832)
