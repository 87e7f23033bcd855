"""The Qwen-Image family on a tiny QwenImagePipeline built from config: the sampler against the pipeline's own call
(true CFG with its norm rescale, and without), the padded condition and its mask, the text encoder on its own
device, the Flow-GRPO recipe, the full-size bench shape (the LoRA export in the pipeline: test_family_matrix.py)."""

from functools import partial

import pytest
import torch
from diffusers import QwenImagePipeline

from config.base import base as base_config
from ddpo_group.models.families.qwenimage import QwenImageFamily
from ddpo_group.sampling.trajectories import SamplingOptions, sample_trajectories
from helpers import family_checks
from helpers.family_checks import PROMPTS, assert_the_text_encoder_stays_where_it_is, generators
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_trainer

family_of = partial(family_checks.family_of, "qwenimage")  # family_of(model_dir, preset="grpo", **overrides)


@pytest.mark.parametrize("guidance", [4.0, 1.0])
def test_noise_level_zero_reproduces_the_pipelines_own_call(guidance, tiny_qwenimage_dir):
    """Same generators, the deterministic Euler sampler: the pipeline's images exactly, with true CFG (its negative
    prompt " " encoded once and broadcast, as the pipeline does with a string negative prompt) and without; the
    family's pipeline_kwargs are the keywords of that call."""
    family, config = family_of(tiny_qwenimage_dir, **{"sample.guidance_scale": guidance, "train.cfg": guidance > 1})
    assert isinstance(family.pipe, QwenImagePipeline) and isinstance(family, QwenImageFamily)
    assert family.config_errors(config) == []
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    assert kwargs == {"height": 32, "width": 32, "max_sequence_length": 32, "true_cfg_scale": guidance,
                      **({"negative_prompt": " "} if guidance > 1 else {})}
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(PROMPTS, num_inference_steps=4, generator=generators(4), output_type="pt", **kwargs).images
    traj = sample_trajectories(family, family.model, family.encode(PROMPTS), family.negative_condition(),
                               SamplingOptions(4, guidance, [0.0] * 4, compute_log_prob=False), generator=generators(4))
    assert torch.equal(traj.images, want)
    assert traj.latents.shape == (4, 5, 16, 16)  # 32 px, VAE factor 4: an 8x8 latent packed into 4x4 tokens of 4 x 4
    assert torch.equal(traj.times["next_sigmas"][:, -1], torch.zeros(4))


def test_the_condition_is_the_pipelines_padded_with_its_mask(tiny_qwenimage_dir):
    """encode: the pipeline's encode_prompt (template tokens dropped, variable length) zero-padded to
    pretrained.max_sequence_length with the mask; the forward's inputs are the pipeline's again (trimmed to the rows'
    longest, mask None when all are tokens); the template's 34 dropped tokens are the system prompt and the user turn's
    start, so the first kept token is the prompt's."""
    family, _ = family_of(tiny_qwenimage_dir)
    tokenizer = family.pipe.tokenizer
    template = family.pipe.prompt_template_encode
    ids = tokenizer(template.format("a cat")).input_ids
    start = family.pipe.prompt_template_encode_start_idx
    assert tokenizer.convert_ids_to_tokens(ids[start - 3:start + 1]) == ["<|im_start|>", "user", "\u010a", "a"]
    cond = family.encode(PROMPTS)
    lengths = cond["prompt_embeds_mask"].sum(dim=1)
    assert cond["prompt_embeds"].shape == (4, 32, 16) and lengths.tolist() == [15, 10, 21, 6]
    # the prompt's tokens then the template's last 5 (<|im_end|>, \n, <|im_start|>, assistant, \n)
    assert lengths.tolist() == [len(tokenizer(prompt).input_ids) + 5 for prompt in PROMPTS]
    want, want_mask = family.pipe.encode_prompt(PROMPTS, max_sequence_length=32)
    embeds, mask = family.text_inputs(cond["prompt_embeds"], cond["prompt_embeds_mask"])
    assert torch.equal(embeds, want) and torch.equal(mask, want_mask)
    assert float(cond["prompt_embeds"][2, 21:].abs().sum()) == 0 and float(cond["prompt_embeds"][2, 20].abs().sum()) > 0
    alone = family.encode(["x"])
    embeds, mask = family.text_inputs(alone["prompt_embeds"], alone["prompt_embeds_mask"])
    assert embeds.shape == (1, 6, 16) and mask is None  # encode_prompt drops an all-ones mask
    short = family_of(tiny_qwenimage_dir, **{"pretrained.max_sequence_length": 8})[0]
    with pytest.warns(UserWarning, match="prompt 'a red circle' has 15 text tokens .* more than the 8 kept"):
        truncated = short.encode(PROMPTS)
    assert truncated["prompt_embeds"].shape == (4, 8, 16)
    assert truncated["prompt_embeds_mask"].sum(dim=1).tolist() == [8, 8, 8, 6]  # cut at 8 tokens


def test_true_cfg_is_the_pipelines_norm_preserving_combination():
    cond = torch.tensor([[[3.0, 4.0]]])
    uncond = torch.tensor([[[1.0, 0.0]]])
    out = QwenImageFamily.true_cfg(cond, uncond, 2.0)  # 2 * (3, 4) - (1, 0) = (5, 8), rescaled to norm 5
    torch.testing.assert_close(out, torch.tensor([[[5.0, 8.0]]]) * 5 / (89 ** 0.5))


def test_config_errors_name_the_bad_values(tiny_qwenimage_dir):
    _, config = family_of(tiny_qwenimage_dir, **{"sample.guidance_scale": 4.0, "train.cfg": False,
                                                 "pretrained.max_sequence_length": 2048})
    errors = QwenImageFamily.config_errors(config)
    assert len(errors) == 2 and "train.cfg=False contradicts sample.guidance_scale=4.0" in errors[0]
    assert "pretrained.max_sequence_length=2048 must be in [0, 1024]" in errors[1]


def test_a_guidance_distilled_transformer_is_refused(tiny_qwenimage_dir):
    pipe = QwenImagePipeline.from_pretrained(tiny_qwenimage_dir)
    pipe.transformer.register_to_config(guidance_embeds=True)
    with pytest.raises(ValueError, match="guidance_embeds=True"):
        QwenImageFamily(pipe, base_config())


def test_the_text_encoder_runs_where_it_is(tiny_qwenimage_dir):
    """pretrained.text_encoder_device: the prompts meet the text encoder on its device and the embeddings (and mask)
    move to the transformer's (here on the meta device, the encoder on the CPU)."""
    family, _ = family_of(tiny_qwenimage_dir)
    assert_the_text_encoder_stays_where_it_is(family)


@pytest.mark.slow
def test_the_flow_grpo_recipe_runs_on_the_tiny_model(tiny_qwenimage_dir, tmp_path):
    """Flow-GRPO's Qwen-Image settings (their model replaced by the tiny one, their sizes by tiny ones), with the
    text-embedding cache, chunked decoding and gradient checkpointing."""
    overrides = {**FAMILY_OVERRIDES["qwenimage"], "sample.text_embedding_cache": 16, "sample.decode_batch_size": 3,
                 "sample.num_steps": 3, "train.pairs_per_forward": 4, "mixed_precision": "no"}
    trainer = tiny_trainer("flow_grpo_qwenimage", tiny_qwenimage_dir, tmp_path, "recipe", **overrides)
    config = trainer.config
    assert (config.lora_rank, config.lora_alpha, config.train.group_size) == (64, 128, 4)  # group 16 in the recipe
    assert (config.sample.guidance_scale, config.train.cfg, config.sample.noise_level) == (4.0, True, 1.2)
    assert trainer.family.name == "qwenimage" and trainer.family.model.is_gradient_checkpointing
    metrics = trainer.run()
    assert metrics["global_step"] == 1  # 8 samples, train batches of 4, 2 accumulated per optimizer step
    assert torch.isfinite(torch.tensor(metrics["train/policy_loss"]))
    assert len(trainer.rollouts.sampler.text_cache.entries) > 0  # every prompt met the text encoder once


def test_the_bench_shape_is_qwen_images_full_size():
    """models/full_size.py's qwenimage, built on the meta device (no memory): the published sizes, Qwen-Image's
    20.4B transformer and Qwen2.5-VL-7B's 8.29B; and the family's condition and latents at that size (1024 px: 4096
    packed tokens of 64)."""
    from ddpo_group.models.full_size import BUILDERS

    with torch.device("meta"):
        pipe = BUILDERS["qwenimage"]()
    counts = {name: sum(p.numel() for p in getattr(pipe, name).parameters()) for name in ("transformer", "text_encoder")}
    assert counts == {"transformer": 20_430_401_088, "text_encoder": 8_292_166_656}
    family = QwenImageFamily(pipe, base_config())
    assert family.resolution == 1024 and family.latent_shape() == (4096, 64) and family.text_length == 512
    assert family.schedule_kwargs(10)["mu"] == pytest.approx(0.5 + 0.4 * (4096 - 256) / (8192 - 256))
