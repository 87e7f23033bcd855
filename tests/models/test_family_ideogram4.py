"""The Ideogram 4 family on a tiny random Ideogram4Pipeline (two transformers, a 36-layer Qwen3-VL of width 16, a
16x FLUX.2 VAE): the sampler against the pipeline's own call (a constant weight, none, the call's per-step schedule,
in bfloat16 with the float32 state), the condition (13 tapped layers, left-padded, with the lengths), the refusals
(every preset and objective, the LoRA export in the pipeline, evaluate.py, trees and two processes:
test_family_matrix.py)."""

from functools import partial

import pytest
import torch
from diffusers import Ideogram4Pipeline

from ddpo_group.models.families.ideogram4 import Ideogram4Family
from ddpo_group.sampling.trajectories import SamplingOptions, sample_trajectories
from helpers import family_checks
from helpers.family_checks import PROMPTS, assert_the_float32_state_is_the_pipelines, bf16_family_of, generators

family_of = partial(family_checks.family_of, "ideogram4")  # family_of(model_dir, preset="grpo", **overrides)


@pytest.fixture(scope="module")
def ideogram4_dir(family_model_dirs):
    return family_model_dirs["ideogram4"]


def sampled(family, guidance, steps=3, rows=4):
    return sample_trajectories(family, family.model, family.encode(PROMPTS[:rows]), family.negative_condition(),
                               SamplingOptions(steps, guidance, [0.0] * steps, compute_log_prob=False),
                               generator=generators(rows))


@pytest.mark.parametrize("guidance", [5.0, 1.0])
def test_noise_level_zero_reproduces_the_pipelines_own_call(guidance, ideogram4_dir):
    """Same generators, the Euler steps: the pipeline's images exactly, with a constant weight (both transformers)
    and at 1 (the conditional transformer alone; the call computes 1 u_c + 0 u_u)."""
    family, config = family_of(ideogram4_dir, **{"sample.guidance_scale": guidance, "train.cfg": guidance > 1})
    assert isinstance(family.pipe, Ideogram4Pipeline) and isinstance(family, Ideogram4Family)
    assert family.config_errors(config) == []
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    assert kwargs == {"height": 64, "width": 64, "max_sequence_length": 64}
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(PROMPTS, num_inference_steps=3, generator=generators(4), output_type="pt",
                       **family.guidance_kwargs(guidance), **kwargs).images
    traj = sampled(family, guidance)
    assert torch.equal(traj.images, want) and float(traj.images.std()) > 0.01
    assert traj.latents.shape == (4, 4, 4, 16)  # 64 px, VAE factor 16: a 4 x 4 latent packed into 2 x 2 tokens of 16
    assert torch.equal(traj.times["guidance_weights"], torch.full((4, 3), guidance))


def test_the_calls_guidance_schedule_through_pipeline_guidance(ideogram4_dir):
    """sample.pipeline_guidance.guidance_schedule: each step's weight, recorded with the step, the pipeline's call
    with that schedule bitwise; a schedule of another length or below 1, or with a run that does not guide, refused."""
    schedule = (7.0, 7.0, 3.0)
    family, config = family_of(ideogram4_dir, **{"sample.num_steps": 3,
                                                 "sample.pipeline_guidance": {"guidance_schedule": schedule}})
    assert family.config_errors(config) == []
    assert family.guidance_kwargs(5.0) == {"guidance_scale": None, "guidance_schedule": list(schedule)}
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(PROMPTS, num_inference_steps=3, generator=generators(4), output_type="pt",
                       **family.guidance_kwargs(5.0), **family.pipeline_kwargs(config.sample, config.pretrained)).images
    traj = sampled(family, 5.0)
    assert torch.equal(traj.images, want)
    assert traj.times["guidance_weights"][0].tolist() == list(schedule)
    constant = sampled(family_of(ideogram4_dir)[0], 5.0)
    assert not torch.equal(constant.images, traj.images)
    _, config = family_of(ideogram4_dir, **{"sample.num_steps": 2, "sample.guidance_scale": 1.0, "train.cfg": False,
                                            "sample.pipeline_guidance": {"guidance_schedule": (7.0, 0.5, 3.0)}})
    errors = Ideogram4Family.config_errors(config)
    assert errors == [
        "sample.pipeline_guidance.guidance_schedule has 3 weights, min 0.5: it needs one weight >= 1 a step "
        "(sample.num_steps=2; the call's default is 7.0 x 45 + 3.0 x 3 for its 48 steps)",
        "sample.pipeline_guidance.guidance_schedule guides every step with its weights, and sample.guidance_scale=1.0 "
        "says the run does not guide: set sample.guidance_scale > 1 (and train.cfg=True) with a schedule"]
    _, config = family_of(ideogram4_dir, **{"sample.num_steps": 3, "sample.eval_num_steps": 5,
                                            "sample.pipeline_guidance": {"guidance_schedule": schedule}})
    assert Ideogram4Family.config_errors(config) == [
        "sample.eval_num_steps=5: a guidance_schedule has a weight a step of sample.num_steps=3; evaluate at those "
        "steps (eval_num_steps 0)"]


def test_the_condition_is_the_pipelines_tapped_layers_left_padded(ideogram4_dir):
    """encode: the pipeline's encode_prompt's text part [B, L, 13 D] in the transformer's dtype, left-padded with
    zeros, and each prompt's token count; a prompt longer than L refused by name."""
    family, _ = family_of(ideogram4_dir)
    cond = family.encode(PROMPTS)
    embeds, _, _, _ = family.pipe.encode_prompt(PROMPTS, 2, 2, 64, torch.device("cpu"))
    assert cond["prompt_embeds"].shape == (4, 64, 13 * 16) and torch.equal(cond["prompt_embeds"], embeds[:, :64])
    lengths = [family.token_count(p) for p in PROMPTS]
    assert cond["prompt_lengths"].tolist() == lengths and min(lengths) > 10
    assert float(cond["prompt_embeds"][0, :64 - lengths[0]].abs().max()) == 0.0  # the left padding
    assert float(cond["prompt_embeds"][0, 64 - lengths[0]:].abs().min()) >= 0 and cond["prompt_embeds"][0, -1].any()
    short, _ = family_of(ideogram4_dir, **{"pretrained.max_sequence_length": 35})
    with pytest.raises(ValueError, match=r"prompt 'a blue square on green' is \d+ tokens in Ideogram 4's chat "
                                         r"template, more than pretrained.max_sequence_length=35"):
        short.encode(PROMPTS)


@pytest.mark.parametrize("guidance", [5.0, 1.0])
def test_in_bf16_the_state_stays_in_float32_as_the_pipelines(guidance, ideogram4_dir):
    """Loaded in bfloat16, the call keeps its latents and the blend in float32: our sampler at noise level 0 gives
    its images bitwise, guided and not; rounding the state to bf16 every step would not."""
    family, config = bf16_family_of("ideogram4", ideogram4_dir, **{"sample.guidance_scale": guidance,
                                                                   "train.cfg": guidance > 1})
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(PROMPTS, num_inference_steps=3, generator=generators(4), output_type="pt",
                       **family.guidance_kwargs(guidance), **family.pipeline_kwargs(config.sample, config.pretrained)).images
    assert family.pipe.transformer.dtype == torch.bfloat16 and want.dtype == torch.float32  # the call decodes .float()
    assert_the_float32_state_is_the_pipelines(family, lambda: sampled(family, guidance), want)


def test_what_the_family_refuses_is_named(ideogram4_dir):
    """A weight below 1 and a negative prompt refused at start; a row's negative prompt ignored with a warning."""
    _, config = family_of(ideogram4_dir, **{"sample.guidance_scale": 0.5, "train.cfg": False,
                                            "sample.negative_prompt": "blurry"})
    assert Ideogram4Family.config_errors(config) == [
        "sample.guidance_scale=0.5 must be >= 1 (1: the conditional transformer alone; a weight below 1 blends toward "
        "the unconditional transformer, which the family does not sample)",
        "sample.negative_prompt='blurry': Ideogram 4 has no negative prompt (its unconditional transformer reads no "
        "text); leave it ''"]
    family, _ = family_of(ideogram4_dir)
    with pytest.warns(UserWarning, match="Ideogram 4 has no negative prompt"):
        assert family.negative_rows([{"negative_prompt": "blurry"}, {}]) is None
    assert family.negative_for([{"negative_prompt": "blurry"}])["prompt_embeds"].shape == (1, 1, 13 * 16)
    assert [type(m).__name__ for m in family.denoisers()] == ["Ideogram4Transformer2DModel"] * 2


def test_under_flow_sde_the_first_step_is_deterministic(ideogram4_dir):
    """The first sigma is the schedule's clamp (1 - 1.2e-4), where flow_sde's std is about 10 at 0.7 and 10 steps:
    that step is deterministic under flow_sde (never trained), stochastic under cps and dance_sde; a window on it
    alone under flow_sde leaves nothing to train and is refused."""
    family, config = family_of(ideogram4_dir, **{"sample.num_steps": 10})
    sigmas = family.schedule(10, "cpu")["sigmas"]
    assert 1 - 2e-4 < float(sigmas[0]) < 1 and float(sigmas[1]) < 0.97
    assert family.deterministic_steps(config.sample).tolist() == [True] + [False] * 9
    assert family.noise_levels(config.sample)[:2] == [0.0, family.noise_level(config.sample)]
    config.sample.sde_type = "dance_sde"
    assert not family.deterministic_steps(config.sample).any()
    config.sample.sde_type, config.sample.sde_window_size = "flow_sde", 1
    with pytest.raises(ValueError, match="leaves no stochastic step"):
        family.check_trainable(config.sample)


def test_the_full_size_bench_shape_builds():
    """models/full_size.py's ideogram4, on the meta device: Ideogram 4's two transformers (the class defaults) and a
    Qwen3-VL-8B text encoder; the family reads its sizes (2048 px: 128 x 128 tokens of 128 channels)."""
    from config.base import base as base_config
    from ddpo_group.models.full_size import build_ideogram4

    pipe, millions = family_checks.full_size_on_meta(build_ideogram4)
    assert 8800 < millions["transformer"] < 9750, millions
    assert 8800 < millions["unconditional_transformer"] < 9750, millions
    assert 7750 < millions["text_encoder"] < 8550, millions  # Qwen3-VL-8B with its vision tower, no LM head
    family = Ideogram4Family(pipe, base_config())
    assert family.height_width == (2048, 2048) and family.latent_shape() == (128 * 128, 128)
