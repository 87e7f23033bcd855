"""FLUX.2 [klein] and [dev] (models/families/flux2.py) on the tiny random pipelines: the sampler against
Flux2KleinPipeline's own call (step-distilled: no guidance; base: CFG with the empty prompt) and Flux2Pipeline's (the
guidance embedding), the Qwen3 / Mistral3 conditions, the text encoder on its own device, the base model's CFG ratio,
the Flow-Factory recipe, the full-size bench shape (the LoRA export in the pipelines: test_family_matrix.py)."""

import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline

from config.base import base as base_config
from ddpo_group.models import load_family
from ddpo_group.models.tiny_random import QWEN3_CHAT_TEMPLATE
from ddpo_group.sampling.trajectories import SamplingOptions, TransitionScorer, sample_trajectories
from helpers.batch_helpers import batch_of
from helpers.family_checks import PROMPTS, assert_rescored, assert_the_pipelines_images, generators
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_config, tiny_trainer


def flux2_family(model_dir, distilled=True, **overrides):
    config = tiny_config("grpo", model_dir, "unused", **{**FAMILY_OVERRIDES["flux2"], **overrides})
    family = load_family(model_dir, config=config)
    family.pipe.register_to_config(is_distilled=distilled)
    family.pipe.set_progress_bar_config(disable=True)
    return family, config


@pytest.mark.parametrize("distilled", [True, False])
def test_noise_level_zero_reproduces_the_pipelines_own_call(distilled, tiny_flux2_dir):
    """Same generators, the deterministic Euler sampler, guidance 4: the pipeline's images bitwise, with
    ``pipeline_kwargs``. Distilled: the scale is ignored (the same images as at 1); base: CFG with the empty prompt
    (the pipeline encodes it as a batch of B empty prompts, so ours is too), other images than without guidance."""
    family, config = flux2_family(tiny_flux2_dir, distilled)
    assert isinstance(family.pipe, Flux2KleinPipeline) and family.name == "flux2"
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    assert kwargs == {"height": 32, "width": 32, "max_sequence_length": 32}
    images, traj = assert_the_pipelines_images(family, family.encode(PROMPTS), family.encode([""] * 4), kwargs)
    assert traj.images.shape == (4, 3, 32, 32) and traj.latents.shape == (4, 5, 64, 16)  # 8x8 tokens of 4 x 4 channels
    assert torch.equal(traj.times["next_sigmas"][:, -1], torch.zeros(4))
    difference = float((images[4.0] - images[1.0]).abs().max())
    assert difference == 0 if distilled else difference > 1e-3


def test_the_condition_is_qwen3_layers_9_18_27_of_the_chat_template(tiny_flux2_dir):
    """prompt_embeds [B, 32, 48]: the hidden states of layers 9, 18, 27 (3 x 16) per token of the prompt in Qwen3's
    chat template, padded with '<|endoftext|>' to pretrained.max_sequence_length."""
    family, _ = flux2_family(tiny_flux2_dir)
    tokenizer = family.pipe.tokenizer
    assert tokenizer.chat_template == QWEN3_CHAT_TEMPLATE
    text = tokenizer.apply_chat_template([{"role": "user", "content": "a cat"}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)
    assert text == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    embeds = family.encode(PROMPTS)["prompt_embeds"]
    assert embeds.shape == (4, 32, 48)
    inputs = tokenizer(text, padding="max_length", max_length=32, return_tensors="pt")
    assert int(inputs["attention_mask"].sum()) == 30  # 30 byte tokens, then 2 pads
    with torch.no_grad():
        hidden = family.pipe.text_encoder(**inputs, output_hidden_states=True).hidden_states
    assert len(hidden) == 28
    torch.testing.assert_close(embeds[1], torch.cat([hidden[9][0], hidden[18][0], hidden[27][0]], dim=-1))


def test_flux2_dev_reproduces_its_pipeline_with_the_guidance_embedding(tiny_flux2_dev_dir):
    """FLUX.2 [dev]: the guidance scale enters every forward as an embedding (sampling and training alike: train.cfg has
    no effect); the condition is Mistral3's layers 10, 20, 30 of the prompt after BFL's system message."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    config = tiny_config("grpo", tiny_flux2_dev_dir, "unused", **FAMILY_OVERRIDES["flux2_dev"])
    family = load_family(tiny_flux2_dev_dir, config=config)
    assert isinstance(family.pipe, Flux2Pipeline) and family.name == "flux2_dev"
    family.pipe.set_progress_bar_config(disable=True)
    assert family.config_errors(config) == [] and family.training_guidance(config) == 4.0  # train.cfg=False
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    assert kwargs == {"height": 32, "width": 32, "max_sequence_length": 256}
    cond = family.encode(PROMPTS)
    images, _ = assert_the_pipelines_images(family, cond, None, kwargs)
    assert float((images[4.0] - images[1.0]).abs().max()) > 1e-3

    tokenizer = family.pipe.tokenizer
    messages = [{"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
                {"role": "user", "content": [{"type": "text", "text": "a cat"}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == f"<s>[SYSTEM_PROMPT]{SYSTEM_MESSAGE}[/SYSTEM_PROMPT][INST]a cat[/INST]"
    inputs = tokenizer(text, add_special_tokens=False, padding="max_length", max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = family.pipe.text_encoder(**inputs, output_hidden_states=True).hidden_states
    assert len(hidden) == 31 and cond["prompt_embeds"].shape == (4, 256, 48)
    torch.testing.assert_close(cond["prompt_embeds"][1], torch.cat([hidden[10][0], hidden[20][0], hidden[30][0]], -1))


def test_the_text_encoder_runs_where_it_is(tiny_flux2_dir):
    """pretrained.text_encoder_device: the prompts meet the Qwen3 encoder on its device; the embeddings move to the
    transformer's (here on the meta device)."""
    from ddpo_group.models.trainable import TEXT_ENCODERS

    family, _ = flux2_family(tiny_flux2_dir)
    assert [n for n in family.pipe.components if n.startswith("text_encoder")] == ["text_encoder"]
    assert "text_encoder" in TEXT_ENCODERS
    on_cpu = family.encode(PROMPTS)["prompt_embeds"]
    torch.nn.Module.to(family.pipe.transformer, "meta")
    moved = family.encode(PROMPTS)["prompt_embeds"]
    assert family.pipe.text_encoder.device.type == "cpu"
    assert moved.device.type == "meta" and moved.shape == on_cpu.shape


def test_the_base_models_cfg_training_forward_gives_ratio_one(tiny_flux2_dir):
    """klein base with CFG (guidance 4 in sampling and training, train.cfg): the recorded log-probs re-scored under the
    sampling policy, the sampling batch bitwise, other chunks to within 1e-6; the distilled model rejects nothing but
    ignores the scale (its training forward is the unguided one)."""
    family, config = flux2_family(tiny_flux2_dir, distilled=False, **{"sample.guidance_scale": 4.0, "train.cfg": True},
                                  sde_window_size=0)
    assert family.config_errors(config) == [] and family.training_guidance(config) == 4.0
    cond = family.encode(PROMPTS)
    traj = sample_trajectories(family, family.model, cond, family.negative_condition(),
                               SamplingOptions(4, 4.0, family.noise_levels(config.sample)), generator=generators(4))
    batch = batch_of(traj, cond)
    scorer = assert_rescored(family, config, traj, batch, tolerance=1e-6, chunks=(3,))
    rows, steps = torch.arange(4).repeat_interleave(4), torch.arange(4).repeat(4)
    with torch.no_grad():
        unguided = TransitionScorer(family, 1.0, scorer.noise_level)(family.model, batch, rows, steps).log_prob
        assert float((unguided - traj.log_probs[rows, steps]).abs().max()) > 1e-4  # the guidance is in the forward
    config.train.cfg = False
    assert "train.cfg=False contradicts sample.guidance_scale=4.0" in family.config_errors(config)[0]


@pytest.mark.slow
@pytest.mark.parametrize("recipe, distilled, steps, level, guidance", [
    ("flow_factory_flux2_klein", True, 4, 0.5, 1.0), ("flow_factory_flux2_klein_base", False, 8, 0.7, 4.0)])
def test_the_flow_factory_recipes_run_on_the_tiny_model(recipe, distilled, steps, level, guidance, tiny_flux2_dir,
                                                        tmp_path):
    """Flow-Factory's FLUX.2 [klein] settings (their model replaced by the tiny one, their sizes by tiny ones, the
    reward by one that downloads nothing): the Flow-SDE window on step 1, EMA, LoRA 64 / 128; the distilled model
    without guidance, the base model with CFG 4 in sampling and training (the tiny model's is_distilled set to match)."""
    from ddpo_group.models.tiny_random import build_tiny_flux2_pipeline, save_pipeline

    model_dir = tiny_flux2_dir if distilled else save_pipeline(build_tiny_flux2_pipeline(is_distilled=False),
                                                               tmp_path / "base")
    overrides = {"sample.resolution": 32, "pretrained.max_sequence_length": 32, "sample.num_steps": steps,
                 "sample.text_embedding_cache": 16, "sample.decode_batch_size": 3, "train.pairs_per_forward": 4,
                 "train.gradient_checkpointing": True, "mixed_precision": "no", "train.gradient_accumulation_steps": 1,
                 "sample.sde_window_start": 1, "sample.sde_window_size": 1}  # the recipe's (the tiny config's is 0)
    trainer = tiny_trainer(recipe, model_dir, tmp_path, "recipe", **overrides)
    config = trainer.config
    assert (config.lora_rank, config.lora_alpha, config.sample.noise_level) == (64, 128, level)
    assert config.train.ema and config.sample.guidance_scale == guidance and config.train.cfg == (not distilled)
    assert trainer.family.name == "flux2" and trainer.family.model.is_gradient_checkpointing
    assert trainer.family.classifier_free == (not distilled)
    assert trainer.family.stochastic_steps(config.sample).tolist() == [False, True] + [False] * (steps - 2)
    metrics = trainer.run()
    assert metrics["global_step"] == 2 and torch.isfinite(torch.tensor(metrics["train/policy_loss"]))
    assert len(trainer.rollouts.sampler.text_cache.entries) > 0


def test_the_full_size_bench_shape_composes():
    """models/full_size.py's flux2_klein4b, built on the meta device (no memory): klein 4B's 3.9B transformer
    and 4.0B Qwen3, whose stacked layers are the transformer's 7680-wide text input; a 1024 px image is 4096 tokens of
    128 channels, decoded through the VAE's batch norm and 2x2 unpatchify to 32 x 128 x 128 latents."""
    from ddpo_group.models.full_size import BUILDERS

    from ddpo_group.models.families.flux2 import Flux2Family

    with torch.device("meta"):
        pipe = BUILDERS["flux2_klein4b"]()
    millions = {name: round(sum(p.numel() for p in getattr(pipe, name).parameters()) / 1e6)
                for name in ("transformer", "text_encoder", "vae")}
    assert millions == {"transformer": 3876, "text_encoder": 4022, "vae": 84}
    family = Flux2Family(pipe, base_config())
    assert family.resolution == 1024 and family.latent_shape() == (4096, 128)
    x = torch.empty(1, 4096, 128, device="meta")
    embeds = torch.empty(1, 512, 3 * pipe.text_encoder.config.hidden_size, device="meta")
    times = {key: values[0] for key, values in family.schedule(4, "cpu").items()}
    assert family.model_output(pipe.transformer, x, times, {"prompt_embeds": embeds}, None, 1.0).shape == x.shape
    latents = family.decode_latents(x)
    assert latents.shape == (1, 32, 128, 128)
    assert pipe.vae.decode(latents, return_dict=False)[0].shape == (1, 3, 1024, 1024)


def test_a_text_encoder_with_fewer_layers_takes_its_own_out_layers(tiny_flux2_dir, tmp_path):
    """diffusers' own klein test model has a two-layer Qwen3 and samples with text_encoder_out_layers=(1,): the
    pipeline's default layers (9, 18, 27) do not exist there. pretrained.text_encoder_out_layers chooses them, the
    family passes them to encode_prompt and to the pipeline's call (bitwise the same images); unset, a clear error."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ddpo_group.models.tiny_random import save_pipeline

    pipe = Flux2KleinPipeline.from_pretrained(tiny_flux2_dir)
    old = pipe.text_encoder.config
    two_layers = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=old.vocab_size, hidden_size=48, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=old.pad_token_id,
        eos_token_id=old.eos_token_id, bos_token_id=None, tie_word_embeddings=True))  # one layer of 48 = 3 x 16
    directory = save_pipeline(Flux2KleinPipeline(**{**pipe.components, "text_encoder": two_layers}), tmp_path / "m")
    family, config = flux2_family(directory)
    with pytest.raises(ValueError, match=r"the pipeline's default text_encoder_out_layers \(9, 18, 27\) "
                                         r"\(pretrained.text_encoder_out_layers=\(\)\): every layer must be in 0..2"):
        family.encode(PROMPTS)
    family, config = flux2_family(directory, **{"pretrained.text_encoder_out_layers": (1,)})
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    assert kwargs["text_encoder_out_layers"] == (1,)
    cond = family.encode(PROMPTS)
    assert cond["prompt_embeds"].shape == (4, 32, 48)
    want = family.pipe(prompt=PROMPTS, num_inference_steps=3, guidance_scale=1.0, generator=generators(4),
                       output_type="pt", **kwargs).images
    traj = sample_trajectories(family, family.model, cond, None,
                               SamplingOptions(3, 1.0, [0.0] * 3, compute_log_prob=False), generator=generators(4))
    assert torch.equal(traj.images, want)
