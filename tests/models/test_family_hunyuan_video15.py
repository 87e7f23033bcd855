"""The HunyuanVideo 1.5 family on a tiny random HunyuanVideo15Pipeline (Qwen2.5-VL and ByT5 text encoders, a guider
component): the sampler against the pipeline's own call (CFG through the guider and none; a quoted text for ByT5), a
batch of several videos decoded, the guiders it refuses, the LoRA loaded by the pipeline's transformer, the full-size
shape, the UniRL recipe (every preset and objective, evaluate.py, trees and two processes: test_family_matrix.py)."""

import pytest
import torch
from diffusers import HunyuanVideo15Pipeline
from diffusers.guiders import ClassifierFreeGuidance

from config.base import base as base_config
from ddpo_group.errors import ConfigError
from ddpo_group.models.families.hunyuan_video15 import HunyuanVideo15Family
from ddpo_group.sampling.trajectories import SamplingOptions, sample_trajectories
from helpers.family_checks import family_of, full_size_on_meta, generators
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_trainer

PROMPTS = ["a red circle", 'a sign that says "hi"']  # the second has a quoted text: ByT5 encodes it


@pytest.fixture(scope="module")
def hv15_dir(family_model_dirs):
    return family_model_dirs["hunyuan_video15"]


def test_an_evaluation_scale_reaches_the_pipelines_call(hv15_dir):
    """evaluate.py's ``--guidance_scale`` (the family's ``guidance_kwargs``) sets the guider the pipeline's call
    reads: a run at 6 evaluated at 1 gives the latents the sampler gives at 1, not those at 6."""
    family, config = family_of("hunyuan_video15", hv15_dir, **{"sample.guidance_scale": 6.0, "train.cfg": True})
    family.pipe.set_progress_bar_config(disable=True)
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    latents = {scale: family.pipe(prompt=PROMPTS, num_inference_steps=3, generator=generators(2),
                                  output_type="latent", **kwargs, **family.guidance_kwargs(scale)).frames
               for scale in (6.0, 1.0)}
    assert family.pipe.guider.guidance_scale == 1.0
    options = SamplingOptions(3, 1.0, [0.0] * 3, compute_log_prob=False)
    traj = sample_trajectories(family, family.model, family.encode(PROMPTS), family.negative_condition(), options,
                               generator=generators(2))
    assert torch.equal(traj.latents[:, -1], latents[1.0])
    assert (latents[1.0] - latents[6.0]).abs().amax() > 0.01


@pytest.mark.parametrize("guidance, negative", [(6.0, ""), (6.0, "blurry"), (1.0, "")])
def test_noise_level_zero_reproduces_the_pipelines_own_call(guidance, negative, hv15_dir):
    """The family gives its pipeline the run's guidance through the guider; the pipeline's own call then samples our
    Euler steps at noise level 0: the same frames bitwise, with CFG (the default and a given negative prompt) and
    without."""
    family, config = family_of("hunyuan_video15", hv15_dir, **{"sample.guidance_scale": guidance,
                                                                 "train.cfg": guidance > 1,
                                                                 "sample.negative_prompt": negative})
    assert isinstance(family, HunyuanVideo15Family) and HunyuanVideo15Family.config_errors(config) == []
    assert family.pipe.guider.guidance_scale == guidance and family.guidance_kwargs(guidance) == {}
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    assert kwargs == {"height": 32, "width": 32, "num_frames": 5}
    rows = family.pipeline_row_kwargs([{}, {}])
    assert rows == ({"negative_prompt": [negative] * 2} if negative else {})
    family.pipe.set_progress_bar_config(disable=True)
    options = SamplingOptions(3, guidance, [0.0] * 3, compute_log_prob=False)
    # both prompts in one batch: the final latents (the pipeline's VAE cannot decode a batch of videos)
    latents = family.pipe(prompt=PROMPTS, num_inference_steps=3, generator=generators(2), output_type="latent",
                          **kwargs, **rows).frames
    traj = sample_trajectories(family, family.model, family.encode(PROMPTS), family.negative_condition(), options,
                               generator=generators(2))
    assert traj.images.shape == (2, 5, 3, 32, 32) and traj.latents.shape == (2, 4, 4, 2, 2, 2)
    assert torch.equal(traj.latents[:, -1], latents)
    # each prompt alone: the frames
    for i, prompt in enumerate(PROMPTS):
        want = family.pipe(prompt=[prompt], num_inference_steps=3, generator=generators(1, i), output_type="pt",
                           **kwargs, **family.pipeline_row_kwargs([{}])).frames
        alone = sample_trajectories(family, family.model, family.encode([prompt]), family.negative_condition(),
                                    options, generator=generators(1, i))
        assert torch.equal(alone.images, want), prompt
        assert float(alone.images.std()) > 0.01


def test_several_videos_decode_as_each_alone(hv15_dir):
    """The pipeline's VAE fails on a batch of two videos (its mid-block mask); the family's decode gives each video as
    the VAE decodes it alone."""
    family, _ = family_of("hunyuan_video15", hv15_dir)
    latents = torch.randn(3, *family.latent_shape(), generator=torch.Generator().manual_seed(0))
    vae = family.pipe.vae
    with pytest.raises(RuntimeError):
        vae.decode(latents[:2] / vae.config.scaling_factor, return_dict=False)
    frames = family.decode(latents)
    assert frames.shape == (3, 5, 3, 32, 32)
    for i in range(3):
        assert torch.equal(frames[i : i + 1], family.decode(latents[i : i + 1]))


def test_guiders_it_does_not_reproduce_are_refused(hv15_dir):
    pipe = HunyuanVideo15Pipeline.from_pretrained(hv15_dir)
    config = base_config()
    pipe.guider = ClassifierFreeGuidance(guidance_scale=6.0, start=0.2)
    with pytest.raises(ConfigError, match=r"\[start, stop\) = \[0.2, 1.0\)"):
        HunyuanVideo15Family(pipe, config)
    pipe.guider = ClassifierFreeGuidance(guidance_scale=6.0, enabled=False)
    with pytest.raises(ConfigError, match=r"its guider is disabled .* sample.guidance_scale=5 guides"):
        HunyuanVideo15Family(pipe, config)
    config.sample.guidance_scale = 0.5
    assert any("sample.guidance_scale=0.5" in e for e in HunyuanVideo15Family.config_errors(config))


def test_the_guidance_rescale_is_the_pipelines(hv15_dir):
    """A guider with guidance_rescale: the family rescales as the guider does, bitwise."""
    family, config = family_of("hunyuan_video15", hv15_dir, **{"sample.guidance_scale": 6.0})
    family.pipe.guider = family.pipe.guider.new(guidance_rescale=0.7)
    family.pipe.set_progress_bar_config(disable=True)
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    want = family.pipe(prompt=PROMPTS[:1], num_inference_steps=2, generator=generators(1), output_type="pt",
                       **kwargs).frames
    traj = sample_trajectories(family, family.model, family.encode(PROMPTS[:1]), family.negative_condition(),
                               SamplingOptions(2, 6.0, [0.0] * 2, compute_log_prob=False), generator=generators(1))
    assert torch.equal(traj.images, want)


def test_the_full_size_bench_shape_builds():
    """models/full_size.py's hunyuan_video15, on the meta device: the 8.3B transformer, Qwen2.5-VL-7B's text model,
    ByT5-small; the family reads its sizes (480p: 121 frames of 480 x 848)."""
    from ddpo_group.models.full_size import build_hunyuan_video15

    pipe, millions = full_size_on_meta(build_hunyuan_video15)
    assert 8000 < millions["transformer"] < 8700, millions
    assert 7000 < millions["text_encoder"] < 7700, millions
    family = HunyuanVideo15Family(pipe, base_config())
    assert family.frames == 121 and family.latent_shape()[:2] == (32, 31)


@pytest.mark.slow
def test_the_unirl_recipe_runs_on_the_tiny_model(hv15_dir, tmp_path):
    overrides = {**FAMILY_OVERRIDES["hunyuan_video15"], "sample.num_steps": 3, "sample.sde_window_size": 2,
                 "sample.num_batches_per_epoch": 2, "train.gradient_accumulation_steps": 2, "mixed_precision": "no",
                 "sample.batch_size": 2, "train.batch_size": 2}
    trainer = tiny_trainer("unirl_hunyuan_video15", hv15_dir, tmp_path, "recipe", **overrides)
    config = trainer.config
    assert (config.lora_rank, config.lora_alpha, config.sample.noise_level) == (64, 64, 0.25)
    assert trainer.family.name == "hunyuan_video15" and trainer.family.model.is_gradient_checkpointing
    metrics = trainer.run()
    assert metrics["global_step"] >= 1 and torch.isfinite(torch.tensor(metrics["train/policy_loss"]))
