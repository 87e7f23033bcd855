"""The Qwen-Image 2.1 family on a tiny random QwenImage21Pipeline (a Qwen3-VL text encoder in its processor, a 16x
RGBA VAE): the sampler against the pipeline's own call (true CFG and none; at the call's defaults with its KV cache on
and off), the condition (the pipeline's, padded; a longer prompt refused), the checkpoint's sample_sigmas, the
processor without torchvision, the full-size shape, the recipe (every preset and objective, the LoRA export in the
pipeline, evaluate.py, trees and two processes: test_family_matrix.py)."""

import pytest
import torch
from diffusers import QwenImage21Pipeline

from config.base import base as base_config
from ddpo_group.errors import ConfigError
from ddpo_group.models.families.qwenimage import QwenImageFamily
from ddpo_group.models.families.qwenimage21 import QwenImage21Family
from ddpo_group.models.tiny_random import QWEN_IMAGE21_TEMPLATE
from ddpo_group.sampling.trajectories import SamplingOptions, sample_trajectories
from helpers.family_checks import PROMPTS, family_of, full_size_on_meta, generators
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_trainer


@pytest.fixture(scope="module")
def qwen21_dir(family_model_dirs):
    return family_model_dirs["qwenimage21"]


@pytest.mark.parametrize("guidance", [4.0, 1.0])
def test_noise_level_zero_reproduces_the_pipelines_own_call(guidance, qwen21_dir):
    """Same generators, the deterministic Euler sampler: the pipeline's images bitwise, with true CFG (its negative
    prompt given once a row) and without; the family's keywords are that call's."""
    family, config = family_of("qwenimage21", qwen21_dir, **{"sample.guidance_scale": guidance,
                                                             "train.cfg": guidance > 1})
    assert isinstance(family.pipe, QwenImage21Pipeline) and QwenImage21Family.config_errors(config) == []
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    assert kwargs == {"height": 64, "width": 64, "use_kv_cache": False}
    rows = family.pipeline_row_kwargs([{}] * 4)
    assert rows == ({"negative_prompt": [""] * 4} if guidance > 1 else {}) and family.pipeline_max_batch == 1
    family.pipe.set_progress_bar_config(disable=True)
    options = SamplingOptions(3, guidance, [0.0] * 3, compute_log_prob=False)
    call = dict(num_inference_steps=3, **family.guidance_kwargs(guidance), **kwargs, **family.pipeline_row_kwargs([{}]))
    for i, prompt in enumerate(PROMPTS):  # each prompt alone, as the pipeline samples it alone: the family's policy
        alone = sample_trajectories(family, family.model, family.encode([prompt]), family.negative_condition(),
                                    options, generator=generators(1, i))
        out = family.pipe([prompt], generator=generators(1, i), output_type="pt", **call)
        assert out.images.shape == (1, 4, 64, 64)  # the pipeline's RGBA, composited over white for the rewards
        assert alone.images.shape == (1, 3, 64, 64) and torch.equal(alone.images, family.pipeline_images(out)), prompt
        assert float(alone.images.std()) > 0.01
    # a batch of them: each row the prompt's policy (the same latents as alone, to the batch's rounding)
    traj = sample_trajectories(family, family.model, family.encode(PROMPTS), family.negative_condition(), options,
                               generator=generators(4))
    assert traj.latents.shape == (4, 4, 16, 8)
    for i, prompt in enumerate(PROMPTS):
        latents = family.pipe([prompt], generator=generators(1, i), output_type="latent", **call).images
        torch.testing.assert_close(traj.latents[i, -1], latents[0], rtol=1e-5, atol=1e-5)
    # called with a longer prompt beside it, the pipeline pads "x" and moves its image's positions: another image
    together = family.pipe(PROMPTS[2:], generator=generators(2, 2), output_type="latent",
                           **{**call, **family.pipeline_row_kwargs([{}] * 2)}).images
    assert float((together[1] - traj.latents[3, -1]).abs().max()) > 1e-3


def test_the_sampler_is_the_call_at_its_own_defaults_with_its_kv_cache(qwen21_dir):
    """No size, guidance or cache setting given to the pipeline: its 1024 px, no guidance (true_cfg_scale 1) and its
    text KV cache on; the family's resolution 0 and guidance 1 sample the same images bitwise (float32 on the CPU:
    the cache's other rounding does not show; the family's keywords turn it off all the same)."""
    family, _ = family_of("qwenimage21", qwen21_dir, **{"sample.resolution": 0, "sample.guidance_scale": 1.0,
                                                        "train.cfg": False})
    assert family.height_width == (1024, 1024) and family.latent_shape() == (4096, 8)
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipeline_images(family.pipe(PROMPTS[:1], num_inference_steps=2, generator=generators(1),
                                              output_type="pt"))
    traj = sample_trajectories(family, family.model, family.encode(PROMPTS[:1]), family.negative_condition(),
                               SamplingOptions(2, 1.0, [0.0] * 2, compute_log_prob=False), generator=generators(1))
    assert traj.images.shape == (1, 3, 1024, 1024) and torch.equal(traj.images, want)


def test_the_template_is_the_pipelines(qwen21_dir):
    family, _ = family_of("qwenimage21", qwen21_dir)
    assert family.pipe.prompt_template_t2i == QWEN_IMAGE21_TEMPLATE


def test_the_condition_is_the_pipelines_padded_and_a_longer_prompt_is_refused(qwen21_dir):
    family, _ = family_of("qwenimage21", qwen21_dir)
    cond = family.encode(PROMPTS)
    assert cond["prompt_embeds"].shape[:2] == (4, 64)
    for i, prompt in enumerate(PROMPTS):  # each row: the pipeline's condition of the prompt alone, padded
        want, want_mask, _ = family.pipe.encode_prompt([prompt])
        embeds, mask = QwenImageFamily.text_inputs(cond["prompt_embeds"][i : i + 1], cond["prompt_embeds_mask"][i : i + 1])
        assert want_mask is None and mask is None and torch.equal(embeds, want), prompt
    together, _, _ = family.pipe.encode_prompt(PROMPTS)  # in a batch the encoder reads the short ones left-padded
    assert together.shape[1] == int(cond["prompt_embeds_mask"].sum(dim=1).max())
    short, _ = family_of("qwenimage21", qwen21_dir, **{"pretrained.max_sequence_length": 8})
    with pytest.raises(ValueError, match=r"prompt 'a red circle' has 20 text tokens, more than "
                                         r"pretrained.max_sequence_length=8 .* keeps every token, so set it to at "
                                         r"least 20"):
        short.encode(PROMPTS)


def test_the_configured_sample_sigmas_fix_the_step_count(qwen21_dir, tmp_path):
    from ddpo_group.models.tiny_random import save_pipeline

    pipe = QwenImage21Pipeline.from_pretrained(qwen21_dir)
    pipe.register_to_config(sample_sigmas=[1.0, 0.75, 0.5, 0.25])
    model = save_pipeline(pipe, tmp_path / "sigmas")
    with pytest.raises(ConfigError, match=r"samples the 4 sigmas its checkpoint configures \(sample_sigmas\).*"
                                          r"sample.num_steps=3, sample.eval_num_steps=3 must be 4"):
        family_of("qwenimage21", model, **{"sample.num_steps": 3})
    family, config = family_of("qwenimage21", model, **{"sample.num_steps": 4})
    schedule = family.schedule(4, "cpu")
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(PROMPTS[:1], num_inference_steps=10, generator=generators(1), output_type="pt",
                       **family.pipeline_kwargs(config.sample, config.pretrained), **family.guidance_kwargs(1.0))
    traj = sample_trajectories(family, family.model, family.encode(PROMPTS[:1]), family.negative_condition(),
                               SamplingOptions(4, 1.0, [0.0] * 4, compute_log_prob=False), generator=generators(1))
    assert len(schedule["timesteps"]) == 4 and torch.equal(traj.images, family.pipeline_images(want))


def test_a_missing_processor_names_the_extra(qwen21_dir, monkeypatch):
    from transformers import Qwen3VLProcessor

    def needs_torchvision(*args, **kwargs):
        raise ImportError("Qwen3VLVideoProcessor requires the Torchvision library")

    monkeypatch.setattr(Qwen3VLProcessor, "from_pretrained", classmethod(needs_torchvision))
    with pytest.raises(ImportError, match=r'needs torchvision, which is not installed: pip install -e "\.\[models\]"'):
        QwenImage21Family.load_pipeline(qwen21_dir, True, None, {})


def test_the_full_size_bench_shape_builds():
    """models/full_size.py's qwenimage21, on the meta device: the released transformer's shape (the class defaults)
    and a Qwen3-VL-8B text encoder; the family reads its sizes (1024 px: 64 x 64 tokens of 64 channels)."""
    from ddpo_group.models.full_size import build_qwenimage21

    pipe, millions = full_size_on_meta(build_qwenimage21)
    assert 6500 < millions["transformer"] < 8500, millions
    assert 8000 < millions["text_encoder"] < 9500, millions
    family = QwenImage21Family(pipe, base_config())
    assert family.height_width == (1024, 1024) and family.latent_shape() == (4096, 64)


@pytest.mark.slow
def test_the_recipe_runs_on_the_tiny_model(qwen21_dir, tmp_path):
    overrides = {**FAMILY_OVERRIDES["qwenimage21"], "sample.num_steps": 3, "train.pairs_per_forward": 4,
                 "train.gradient_checkpointing": True, "mixed_precision": "no", "sample.sde_window_size": 0}
    trainer = tiny_trainer("flow_grpo_qwenimage21", qwen21_dir, tmp_path, "recipe", **overrides)
    assert trainer.family.name == "qwenimage21" and trainer.family.model.is_gradient_checkpointing
    metrics = trainer.run()
    assert metrics["global_step"] >= 1 and torch.isfinite(torch.tensor(metrics["train/policy_loss"]))
