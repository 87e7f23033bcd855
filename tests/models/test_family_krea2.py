"""The Krea 2 family on a tiny Krea2Pipeline built from config: the sampler against the pipeline's own call (guided and
not, the Turbo schedule), the condition (the tapped layers stacked per token, the fixed layout's mask), the config's
refusals (the LoRA export in the pipeline and every preset: test_family_matrix.py)."""

from functools import partial

import pytest
import torch
from diffusers import Krea2Pipeline

from ddpo_group.models.families.krea2 import DISTILLED_MU, Krea2Family
from ddpo_group.sampling.trajectories import SamplingOptions, sample_trajectories
from helpers import family_checks
from helpers.family_checks import PROMPTS, generators

family_of = partial(family_checks.family_of, "krea2")  # family_of(model_dir, preset="grpo", **overrides)


@pytest.mark.parametrize("guidance", [3.0, 0.0])
def test_noise_level_zero_reproduces_the_pipelines_own_call(guidance, tiny_krea2_dir):
    """Same generators, the deterministic Euler sampler: the pipeline's images exactly, guided (its negative prompt ""
    encoded as the call encodes it) and not (guidance 0, Turbo's); pipeline_kwargs are that call's keywords."""
    family, config = family_of(tiny_krea2_dir, **{"sample.guidance_scale": guidance, "train.cfg": guidance > 0})
    assert isinstance(family.pipe, Krea2Pipeline) and isinstance(family, Krea2Family)
    assert family.config_errors(config) == []
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    assert kwargs == {"height": 32, "width": 32, "max_sequence_length": 16}
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(PROMPTS, num_inference_steps=4, generator=generators(4), output_type="pt",
                       guidance_scale=guidance, **kwargs).images
    traj = sample_trajectories(family, family.model, family.encode(PROMPTS), family.negative_condition(),
                               SamplingOptions(4, guidance, [0.0] * 4, compute_log_prob=False), generator=generators(4))
    assert torch.equal(traj.images, want)
    assert traj.latents.shape == (4, 5, 4, 16)  # 32 px, VAE factor 8: a 4 x 4 latent packed into 2 x 2 tokens of 16
    assert torch.equal(traj.times["next_sigmas"][:, -1], torch.zeros(4))


def test_a_distilled_checkpoint_samples_with_the_fixed_shift(tiny_krea2_dir):
    """Krea 2 Turbo (is_distilled): mu = 1.15 whatever the size, as the call's; the base model's mu follows the tokens."""
    family, _ = family_of(tiny_krea2_dir)
    assert family.schedule_kwargs(4)["mu"] != DISTILLED_MU
    family.pipe.register_to_config(is_distilled=True)
    assert family.schedule_kwargs(4)["mu"] == DISTILLED_MU
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(PROMPTS[:2], num_inference_steps=3, generator=generators(2), output_type="pt", guidance_scale=0.0,
                       height=32, width=32, max_sequence_length=16).images
    traj = sample_trajectories(family, family.model, family.encode(PROMPTS[:2]), None,
                               SamplingOptions(3, 0.0, [0.0] * 3, compute_log_prob=False), generator=generators(2))
    assert torch.equal(traj.images, want)


def test_the_condition_is_the_pipelines_stack_of_tapped_layers(tiny_krea2_dir):
    """encode: the pipeline's encode_prompt, [B, L, K, D] with L = pretrained.max_sequence_length (the prompt padded
    before the template's 5 suffix tokens) and K = the tapped layers; the mask marks the prompt's tokens and the
    suffix's; a prompt longer than its room (11 tokens) is truncated as the pipeline does, with a warning."""
    family, _ = family_of(tiny_krea2_dir)
    with pytest.warns(UserWarning, match="prompt 'a blue square on green' has 16 text tokens, more than the 11 the "
                                         "layout keeps"):
        cond = family.encode(PROMPTS)
    want, want_mask = family.pipe.encode_prompt(PROMPTS, max_sequence_length=16)
    assert cond["prompt_embeds"].shape == (4, 16, 2, 16) and cond["prompt_embeds_mask"].dtype == torch.bool
    assert torch.equal(cond["prompt_embeds"], want) and torch.equal(cond["prompt_embeds_mask"], want_mask)
    tokenizer = family.pipe.tokenizer
    assert cond["prompt_embeds_mask"].sum(dim=1).tolist() == [min(len(tokenizer(p).input_ids), 11) + 5 for p in PROMPTS]


def test_config_errors_name_the_bad_values(tiny_krea2_dir):
    _, config = family_of(tiny_krea2_dir, **{"sample.guidance_scale": 1.0, "train.cfg": False})
    errors = Krea2Family.config_errors(config)
    assert len(errors) == 1 and "train.cfg=False contradicts sample.guidance_scale=1.0" in errors[0]
    assert "guidance_scale > 0" in errors[0]
    _, config = family_of(tiny_krea2_dir, **{"pretrained.max_sequence_length": 5})
    assert Krea2Family.config_errors(config) == [
        "pretrained.max_sequence_length=5 must be 0 (the call's 512) or more than the 5 tokens of Krea 2's template "
        "suffix it holds"]
    assert family_of(tiny_krea2_dir)[0].pipe.prompt_template_encode_num_suffix_tokens == 5


@pytest.mark.slow
def test_the_miles_nft_recipe_runs_on_the_tiny_model(tiny_krea2_dir, tmp_path):
    """Miles's DiffusionNFT recipe for Krea 2 (its model replaced by the tiny one, its sizes by tiny ones)."""
    from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_trainer

    overrides = {**FAMILY_OVERRIDES["krea2"], "sample.guidance_scale": 0.0, "train.cfg": False, "sample.num_steps": 3,
                 "mixed_precision": "no", "prompt_fn": "simple_animals", "reward_fn": "jpeg_compressibility"}
    trainer = tiny_trainer("miles_krea2_nft", tiny_krea2_dir, tmp_path, "recipe", **overrides)
    config = trainer.config
    assert (config.lora_rank, config.lora_alpha, config.algorithm.objective) == (32, 64, "nft")
    assert config.kl.beta == 0.0 and not config.kl.use_reference_model and trainer.kl is None
    assert not config.train.ema and config.sample.deterministic
    assert trainer.family.name == "krea2" and trainer.family.model.is_gradient_checkpointing
    metrics = trainer.run()
    assert metrics["global_step"] >= 1 and torch.isfinite(torch.tensor(metrics["train/policy_loss"]))


def test_the_full_size_bench_shape_builds():
    """models/full_size.py's krea2, on the meta device: Krea 2's transformer (the class defaults) and a Qwen3-VL-4B
    text encoder; the family reads its sizes (1024 px: 64 x 64 tokens of 64 channels)."""
    from config.base import base as base_config
    from ddpo_group.models.full_size import build_krea2

    pipe, millions = family_checks.full_size_on_meta(build_krea2)
    assert 12200 < millions["transformer"] < 13450, millions
    assert 4200 < millions["text_encoder"] < 4650, millions  # Qwen3-VL-4B with its vision tower, no LM head
    family = Krea2Family(pipe, base_config())
    assert family.height_width == (1024, 1024) and family.latent_shape() == (4096, 64)
