"""The HunyuanImage 2.1 family on a tiny random HunyuanImagePipeline (Qwen2.5-VL and ByT5, a 32x VAE, the released
kind of guiders: CFG then APG with momentum, an OCR guider): the sampler against the pipeline's own call through the
CFG and APG steps (with and without quoted text, with and without guidance), the momentum carried from step to step and
recorded, the recorded log-probs scored again from it, the refusals (every preset and objective, the LoRA export in the
pipeline, evaluate.py, trees and two processes: test_family_matrix.py)."""

from functools import partial

import pytest
import torch
from diffusers import HunyuanImagePipeline

from ddpo_group.errors import ConfigError
from ddpo_group.models.families.hunyuan_image import MOMENTUM, HunyuanImageFamily
from ddpo_group.sampling.trajectories import SamplingOptions, sample_trajectories
from helpers import family_checks
from helpers.batch_helpers import batch_of
from helpers.family_checks import assert_rescored, generators
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_config, tiny_trainer

family_of = partial(family_checks.family_of, "hunyuan_image")  # family_of(model_dir, preset="grpo", **overrides)
PLAIN = ["a red circle", "a cat"]
QUOTED = ['a sign that says "open"', "a label 'tea' on a jar"]


@pytest.fixture(scope="module")
def hunyuan_image_dir(family_model_dirs):
    return family_model_dirs["hunyuan_image"]


def sampled(family, prompts, guidance, steps, levels=None):
    return sample_trajectories(family, family.model, family.encode(prompts), family.negative_condition(),
                               SamplingOptions(steps, guidance, levels or [0.0] * steps,
                                               compute_log_prob=levels is not None), generator=generators(len(prompts)))


@pytest.mark.parametrize("prompts", [PLAIN, QUOTED], ids=["guider", "ocr_guider"])
@pytest.mark.parametrize("guidance", [5.0, 1.0])
def test_noise_level_zero_reproduces_the_pipelines_own_call(prompts, guidance, hunyuan_image_dir):
    """8 steps: CFG to the guider's start step, then APG with its momentum (the OCR guider's from its step 2, for the
    prompts with quoted text), the pipeline's images bitwise; at guidance 1 none."""
    family, config = family_of(hunyuan_image_dir, **{"sample.guidance_scale": guidance, "train.cfg": guidance > 1})
    assert isinstance(family, HunyuanImageFamily) and family.config_errors(config) == []
    assert family.pipe.guider.guidance_scale == family.pipe.ocr_guider.guidance_scale == guidance  # the run's scale
    family.pipe.set_progress_bar_config(disable=True)
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    assert kwargs == {"height": 64, "width": 64} and family.guidance_kwargs(guidance) == {}
    want = family.pipe(prompts, num_inference_steps=8, generator=generators(2), output_type="pt", **kwargs).images
    traj = sampled(family, prompts, guidance, 8)
    assert torch.equal(traj.images, want) and float(traj.images.std()) > 0.01
    momentum = traj.times[MOMENTUM]
    assert momentum.shape == (2, 8, 8, 2, 2) and not momentum[:, 0].any()  # the buffer each step starts from
    assert momentum[:, 1:].abs().amax() > 0 if guidance > 1 else not momentum.any()


def test_an_evaluation_scale_reaches_the_pipelines_call(hunyuan_image_dir):
    """evaluate.py's ``--guidance_scale`` (the family's ``guidance_kwargs``) sets the guiders the pipeline's call
    reads: a run at 5 evaluated at 1 gives the images the sampler gives at 1, not those at 5."""
    family, config = family_of(hunyuan_image_dir, **{"sample.guidance_scale": 5.0, "train.cfg": True})
    family.pipe.set_progress_bar_config(disable=True)
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    images = {scale: family.pipe(PLAIN, num_inference_steps=8, generator=generators(2), output_type="pt", **kwargs,
                                 **family.guidance_kwargs(scale)).images for scale in (5.0, 1.0)}
    assert family.pipe.guider.guidance_scale == family.pipe.ocr_guider.guidance_scale == 1.0
    assert torch.equal(images[1.0], sampled(family, PLAIN, 1.0, 8).images)
    assert (images[1.0] - images[5.0]).abs().amax() > 0.01


def test_the_momentum_makes_apg_differ_from_cfg_and_the_recorded_one_scores_again(hunyuan_image_dir):
    """The APG steps read the momentum: with it zeroed the images differ. The transitions of an SDE trajectory over
    the CFG and APG steps come back bitwise in the sampling batch and to 1e-5 in chunks, each from its recorded
    buffer; read with no buffer the APG steps' log-probs would not."""
    family, config = family_of(hunyuan_image_dir, **{"sample.num_steps": 8, "sample.sde_window_size": 0})
    traj = sampled(family, PLAIN, 5.0, 8, levels=[0.7] * 8)
    batch = batch_of(traj, family.encode(PLAIN))
    assert_rescored(family, config, traj, batch, tolerance=1e-5)
    scorer = assert_rescored(family, config, traj, batch, steps=1)
    zeroed = batch_of(traj, family.encode(PLAIN))
    zeroed.times[MOMENTUM].zero_()
    with torch.no_grad():
        apg = scorer(family.model, zeroed, torch.arange(2), torch.full((2,), 6)).log_prob
    assert not torch.equal(apg, traj.log_probs[:, 6])


def test_what_the_family_refuses_is_named(hunyuan_image_dir, tmp_path):
    """The distilled checkpoint (guidance embedded, meanflow) and a pipeline without a guider; a matching objective
    with a guided training forward (no recorded momentum off the rollout's steps); unguided it trains."""
    config = tiny_config("grpo", hunyuan_image_dir, "unused", **FAMILY_OVERRIDES["hunyuan_image"])
    pipe = HunyuanImagePipeline.from_pretrained(hunyuan_image_dir)
    pipe.transformer.register_to_config(guidance_embeds=True, use_meanflow=True)
    with pytest.raises(ValueError, match="HunyuanImage-2.1-Distilled"):
        HunyuanImageFamily(pipe, config)
    pipe.transformer.register_to_config(guidance_embeds=False, use_meanflow=False)
    pipe.guider = None
    with pytest.raises(ValueError, match="has no guider"):
        HunyuanImageFamily(pipe, config)
    config.sample.guidance_scale, config.train.cfg = 0.5, False
    assert "sample.guidance_scale=0.5 must be >= 1" in HunyuanImageFamily.config_errors(config)[-1]
    assert HunyuanImageFamily(HunyuanImagePipeline.from_pretrained(hunyuan_image_dir),
                              tiny_config("grpo", hunyuan_image_dir, "unused", **FAMILY_OVERRIDES["hunyuan_image"])
                              ).pipeline_max_batch == 1  # an OCR guider: one prompt a call in evaluation
    with pytest.raises(ConfigError, match=r"algorithm.objective='awm' .* carries \['guidance_momentum'\]"):
        tiny_trainer("awm", hunyuan_image_dir, tmp_path, "awm", device="cpu", **FAMILY_OVERRIDES["hunyuan_image"],
                     **{"sample.guidance_scale": 5.0, "train.cfg": True})
    trainer = tiny_trainer("awm", hunyuan_image_dir, tmp_path, "unguided", device="cpu",
                           **FAMILY_OVERRIDES["hunyuan_image"], **{"sample.guidance_scale": 1.0, "train.cfg": False})
    assert trainer.run()["global_step"] > 0  # unguided, the training forward reads no momentum


def test_the_full_size_bench_shape_builds():
    """models/full_size.py's hunyuan_image, on the meta device: HunyuanImage 2.1's 17B transformer, Qwen2.5-VL-7B and
    ByT5-small; the family reads its sizes (2048 px: 64 x 64 latents of 64 channels)."""
    from config.base import base as base_config
    from ddpo_group.models.full_size import build_hunyuan_image

    pipe, millions = family_checks.full_size_on_meta(build_hunyuan_image)
    assert 16550 < millions["transformer"] < 18300, millions
    assert 7900 < millions["text_encoder"] < 8700, millions  # Qwen2.5-VL-7B with its vision tower and LM head
    assert 207 < millions["text_encoder_2"] < 229, millions
    family = HunyuanImageFamily(pipe, base_config())
    assert family.height_width == (2048, 2048) and family.latent_shape() == (64, 64, 64)


def test_gradient_checkpointing_trains_with_the_same_gradients(hunyuan_image_dir):
    """HunyuanImage 2.1's transformer hands its blocks ``attention_mask=`` by keyword, which diffusers' own
    checkpointing function refuses (a TypeError); the project's (models/trainable.py's ``enable_checkpointing``)
    passes it on: the log-probs of an APG step and their gradients are those without checkpointing."""
    from ddpo_group.models.trainable import enable_checkpointing
    from ddpo_group.sampling.trajectories import TransitionScorer

    family, config = family_of(hunyuan_image_dir, **{"sample.num_steps": 8, "sample.sde_window_size": 0})
    traj = sampled(family, PLAIN, 5.0, 8, levels=[0.7] * 8)
    batch = batch_of(traj, family.encode(PLAIN))
    scorer, model = TransitionScorer.from_config(config, family), family.model
    weight = next(p for name, p in model.named_parameters() if name.endswith("to_q.weight"))
    model.train().requires_grad_(True)

    def log_prob_and_gradient():
        model.zero_grad()
        log_prob = scorer(model, batch, torch.arange(2), torch.full((2,), 6)).log_prob
        log_prob.sum().backward()
        return log_prob.detach(), weight.grad.clone()

    plain = log_prob_and_gradient()
    enable_checkpointing(model)
    assert model.is_gradient_checkpointing
    checkpointed = log_prob_and_gradient()
    torch.testing.assert_close(checkpointed, plain)
    assert plain[1].abs().amax() > 0
