"""Z-Image on its tiny random pipeline (a Qwen3 text encoder with a locally built tokenizer and chat template): the
condition against the pipeline's own ``encode_prompt``, the sampler against its own ``__call__`` with and without
guidance and with its guidance options, the config it reads, its default size, the text encoder on its own device."""

import pytest
import torch
from diffusers import ZImagePipeline

from ddpo_group.sampling.trajectories import SamplingOptions, sample_trajectories
from helpers.family_checks import (PROMPTS, assert_the_float32_state_is_the_pipelines,
                                   assert_the_recorded_log_probs_come_back, assert_the_text_encoder_stays_where_it_is,
                                   bf16_family_of, family_of, generators)


def test_the_condition_is_the_pipelines_list_of_embeddings(tiny_zimage_dir):
    """encode_prompt's per-prompt [l_i, D] embeddings (the chat-templated prompt's tokens) stored left-aligned and
    zero-padded to pretrained.max_sequence_length, with their lengths; the model's list is exactly the pipeline's."""
    family, _ = family_of("zimage", tiny_zimage_dir)
    assert family.name == "zimage" and isinstance(family.pipe, ZImagePipeline)
    cond = family.encode(PROMPTS)
    want, _ = family.pipe.encode_prompt(list(PROMPTS), device="cpu", do_classifier_free_guidance=False,
                                        max_sequence_length=64)
    # the chat template adds 19 tokens ("<|im_start|>user\n" ... "<|im_start|>assistant\n"), one token a byte here
    assert cond["prompt_lengths"].tolist() == [19 + len(p) for p in PROMPTS] == [len(e) for e in want]
    assert cond["prompt_embeds"].shape == (4, 64, 16) and cond["prompt_lengths"].dtype == torch.long
    for got, expected, length in zip(family.embeds_list(cond, 4), want, cond["prompt_lengths"]):
        assert torch.equal(got, expected)
    for row, length in zip(cond["prompt_embeds"], cond["prompt_lengths"]):
        assert float(row[length:].abs().sum()) == 0
    negative = family.negative_condition()
    assert negative["prompt_lengths"].tolist() == [19]
    assert [e.shape for e in family.embeds_list(negative, 3)] == [(19, 16)] * 3
    short, _ = family_of("zimage", tiny_zimage_dir, **{"pretrained.max_sequence_length": 24})
    with pytest.warns(UserWarning, match="prompt 'a red circle' .* fills all 24 tokens"):
        assert short.encode(PROMPTS)["prompt_lengths"].tolist() == [24, 24, 24, 20]


@pytest.mark.parametrize("guidance, options", [
    (0.0, {}),  # Z-Image-Turbo's way: no unconditional forward
    (3.0, {}),
    (3.0, {"sample.cfg_truncation": 0.2}),  # no guidance on the last 2 of 4 steps ((1000 - t) / 1000 = 0.25, 0.5)
    (3.0, {"sample.cfg_normalization": 1.0}),
])
def test_noise_level_zero_reproduces_the_pipelines_own_call(guidance, options, tiny_zimage_dir):
    """Same generators, the deterministic Euler sampler, the family's pipeline keywords: the pipeline's images
    exactly (its negative prompt is encoded as a batch of B empty prompts, so ours is too)."""
    family, config = family_of("zimage", tiny_zimage_dir, **{"sample.guidance_scale": guidance,
                                                              "train.cfg": guidance > 0, **options})
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    assert kwargs == {"height": 32, "width": 32, "max_sequence_length": 64,
                      "cfg_normalization": config.sample.cfg_normalization,
                      "cfg_truncation": config.sample.cfg_truncation}
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(list(PROMPTS), num_inference_steps=4, guidance_scale=guidance, generator=generators(4),
                       output_type="pt", **kwargs).images
    traj = sample_trajectories(family, family.model, family.encode(PROMPTS), family.encode([""] * 4),
                               SamplingOptions(4, guidance, [0.0] * 4, compute_log_prob=False), generator=generators(4))
    assert traj.images.shape == (4, 3, 32, 32) and traj.latents.shape == (4, 5, 16, 16, 16)
    assert torch.equal(traj.images, want)
    assert torch.equal(traj.times["next_sigmas"][:, -1], torch.zeros(4))
    if options:  # the options changed the images, so the check above can fail
        plain = family.pipe(list(PROMPTS), num_inference_steps=4, guidance_scale=guidance, generator=generators(4),
                            output_type="pt", height=32, width=32, max_sequence_length=64).images
        assert float((plain - want).abs().max()) > 1e-4


@pytest.mark.parametrize("guidance", [0.0, 4.0])
def test_in_bf16_the_state_stays_in_float32_as_the_pipelines(guidance, tiny_zimage_dir):
    """Loaded in bfloat16, ZImagePipeline keeps its latents in float32 (the transformer reads a bf16 copy; its outputs
    cast to float32 for CFG and the step): our sampler at noise level 0 gives its images bitwise, guided and
    Z-Image-Turbo's unguided call; rounding the state to bf16 every step would not."""
    family, config = bf16_family_of("zimage", tiny_zimage_dir, **{"sample.guidance_scale": guidance,
                                                                  "train.cfg": guidance > 0})
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(list(PROMPTS), num_inference_steps=4, guidance_scale=guidance, generator=generators(4),
                       output_type="pt", **kwargs).images
    assert_the_float32_state_is_the_pipelines(family, lambda: sample_trajectories(
        family, family.model, family.encode(PROMPTS), family.encode([""] * 4),
        SamplingOptions(4, guidance, [0.0] * 4, compute_log_prob=False), generator=generators(4)), want)


@pytest.mark.parametrize("options", [
    {"sample.guidance_scale": 0.0, "train.cfg": False},  # Z-Image-Turbo's: the conditional forward only
    {"sample.cfg_truncation": 0.2, "sample.cfg_normalization": 1.0},  # steps 2 and 3 unguided, the rest capped
])
def test_the_first_training_forwards_ratio_is_one_with_the_guidance_options(options, tiny_zimage_dir):
    """As test_families.py's test: the recorded log-probs come back bitwise in the sampling batch, and to within 1e-6
    in the ratio when a training chunk mixes steps (with cfg_truncation, guided and unguided rows share one doubled
    forward where sampling ran the conditional one alone)."""
    family, config = family_of("zimage", tiny_zimage_dir, **options)
    assert_the_recorded_log_probs_come_back(family, config, family.encode(PROMPTS), tolerance=1e-6)


def test_the_default_size_is_the_pipelines_call_default(tiny_zimage_dir):
    """ZImagePipeline has no default_sample_size (its call samples ``height or 1024``): at sample.resolution=0 the
    family samples 1024 px, which the tiny transformer's RoPE table (axes_lens 32 patches of 4 px a side) cannot take:
    refused by name when the family is built, with the largest size it takes; a table of 256 patches takes it."""
    from ddpo_group.errors import ConfigError
    from ddpo_group.models.families.zimage import ZImageFamily

    with pytest.raises(ConfigError, match=r"sample.resolution=0 \(the pipeline's default, 1024 x 1024 px\) is 256 "
                                          r"patches of 4 px a side, beyond this model's position table "
                                          r"\(ZImageTransformer2DModel's axes_lens=\[256, 32, 32\]: 32 patches a side, "
                                          r"128 px\): set sample.resolution to a multiple of 4 up to 128"):
        family_of("zimage", tiny_zimage_dir, **{"sample.resolution": 0})
    family, config = family_of("zimage", tiny_zimage_dir)
    family.pipe.transformer.register_to_config(axes_lens=[256, 256, 256])
    config.sample.resolution = 0
    family = ZImageFamily(family.pipe, config)
    assert family.height_width == (1024, 1024) and family.latent_shape() == (16, 512, 512)
    assert family.pipeline_kwargs(config.sample, config.pretrained)["height"] == 1024


def test_the_schedule_is_the_pipelines(tiny_zimage_dir):
    """linspace(1, 1/T, T) shifted by the scheduler's shift 3 (Z-Image-Turbo's), timesteps 1000 s."""
    family, _ = family_of("zimage", tiny_zimage_dir)
    schedule = family.schedule(4, "cpu")
    s = torch.linspace(1.0, 0.25, 4)
    torch.testing.assert_close(schedule["sigmas"], 3 * s / (1 + 2 * s))
    torch.testing.assert_close(schedule["timesteps"], 1000 * schedule["sigmas"])
    assert schedule["next_sigmas"][-1] == 0


def test_the_config_it_reads_is_checked(tiny_zimage_dir):
    from ddpo_group.models.families.zimage import ZImageFamily

    family, config = family_of("zimage", tiny_zimage_dir)
    assert ZImageFamily.config_errors(config) == []
    config.train.cfg = False
    assert "train.cfg=False contradicts sample.guidance_scale=3.0" in ZImageFamily.config_errors(config)[0]
    assert family.training_guidance(config) == 0.0  # Z-Image's "no guidance"
    config.sample.guidance_scale, config.sample.cfg_truncation, config.sample.cfg_normalization = 0.0, 1.5, -1.0
    assert ZImageFamily.config_errors(config) == [
        "sample.cfg_normalization=-1.0 must be >= 0 (0: off)",
        "sample.cfg_truncation=1.5 must be in [0, 1] (1: guidance on every step)",
    ]


def test_the_text_encoder_runs_where_it_is(tiny_zimage_dir):
    """pretrained.text_encoder_device: the prompts meet Qwen3 on its device and the embeddings move to the
    transformer's (here the transformer on the meta device, the text encoder on the CPU)."""
    family, _ = family_of("zimage", tiny_zimage_dir)
    assert_the_text_encoder_stays_where_it_is(family)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["flow_factory_zimage", "flow_factory_zimage_turbo"])
def test_the_flow_factory_recipes_run_on_the_tiny_model(recipe, tiny_zimage_dir, tmp_path):
    """Flow-Factory's Z-Image settings (their model replaced by the tiny one, their sizes by tiny ones), with the
    text-embedding cache, chunked decoding and gradient checkpointing: an epoch trains."""
    from config.base import get_config
    from ddpo_group.models.families.zimage import ZImageFamily
    from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_trainer

    published = get_config(recipe)
    assert ZImageFamily.config_errors(published) == []
    assert (published.train.group_size, published.sample.resolution, published.sample.noise_level) == (16, 512, 0.7)
    overrides = {**FAMILY_OVERRIDES["zimage"], "sample.text_embedding_cache": 16, "sample.decode_batch_size": 3,
                 "sample.num_steps": 4, "sample.sde_window_size": 3, "train.pairs_per_forward": 4,
                 "train.gradient_checkpointing": True, "mixed_precision": "no",
                 "sample.guidance_scale": published.sample.guidance_scale, "train.cfg": published.train.cfg}
    trainer = tiny_trainer(recipe, tiny_zimage_dir, tmp_path, recipe, **overrides)
    config = trainer.config
    assert (config.use_lora, config.train.group_size) == (recipe == "flow_factory_zimage", 4)
    if config.use_lora:
        assert (config.lora_rank, config.lora_alpha) == (64, 128)
    assert trainer.family.name == "zimage" and trainer.family.model.is_gradient_checkpointing
    metrics = trainer.run()
    assert metrics["global_step"] == 2 and torch.isfinite(torch.tensor(metrics["train/policy_loss"]))
    assert len(trainer.rollouts.sampler.text_cache.entries) > 0  # every prompt met the text encoder once


def test_the_bench_shape_has_the_real_models_sizes():
    """models/full_size.py's zimage, built on the meta device (no memory): Z-Image's 6.2B transformer reading
    the 2560-wide hidden states of a 4.0B Qwen3-4B-sized text encoder; the zimage family drives it."""
    from ddpo_group.models.full_size import BUILDERS

    with torch.device("meta"):
        pipe = BUILDERS["zimage"]()
    billions = {name: round(sum(p.numel() for p in module.parameters()) / 1e9, 2)
                for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}
    assert billions == {"vae": 0.08, "text_encoder": 4.02, "transformer": 6.15}
    assert pipe.transformer.config.cap_feat_dim == pipe.text_encoder.config.hidden_size == 2560
    from ddpo_group.models.families import get_family

    assert isinstance(pipe, get_family("zimage").pipeline_class)
