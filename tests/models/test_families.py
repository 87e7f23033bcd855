"""The model-family seam on tiny SDXL, SD3 and FLUX pipelines built from config: detection, the sampler against the
pipeline's own call, the size rule, log-prob recomputation, the text-embedding cache. Every family on every path (the
presets and objectives, the LoRA export in the pipeline, scripts/evaluate.py): test_family_matrix.py."""

import json

import pytest
import torch
from diffusers import FluxPipeline, StableDiffusion3Pipeline, StableDiffusionXLPipeline

from ddpo_group.models.families import family_name
from ddpo_group.models.tiny_random import TINY_BUILDERS
from ddpo_group.sampling.trajectories import SamplingOptions, sample_trajectories
from helpers.family_checks import PROMPTS, assert_the_recorded_log_probs_come_back, family_of, generators
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_config, tiny_trainer


def test_the_family_is_read_from_model_index_or_set(family_model_dirs, tmp_path):
    for name in TINY_BUILDERS:
        assert family_name(family_model_dirs[name]) == name
    assert family_name("tiny-shapes") == "sd"
    assert family_name(family_model_dirs["sd3"], "flux") == "flux"  # the override wins
    with pytest.raises(ValueError, match=r"unknown model family \(pretrained.family\) 'kandinsky'"):
        family_name("tiny-shapes", "kandinsky")
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyPipeline"}))
    with pytest.raises(ValueError, match="is a KandinskyPipeline, which no model family handles"):
        family_name(str(tmp_path))


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_noise_level_zero_reproduces_the_pipelines_own_call(name, family_model_dirs):
    """Same generators, the deterministic Euler sampler: the pipeline's images exactly (its negative prompt is encoded
    as a batch of B empty prompts, so ours is too)."""
    family, _ = family_of(name, family_model_dirs[name])
    guidance = {"sd3": 4.5, "flux": 3.5}[name]
    pipeline_class = {"sd3": StableDiffusion3Pipeline, "flux": FluxPipeline}[name]
    assert isinstance(family.pipe, pipeline_class)
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(PROMPTS, num_inference_steps=4, guidance_scale=guidance, generator=generators(4), height=32,
                       width=32, max_sequence_length=16, output_type="pt").images
    traj = sample_trajectories(family, family.model, family.encode(PROMPTS), family.encode([""] * 4),
                               SamplingOptions(4, guidance, [0.0] * 4, compute_log_prob=False), generator=generators(4))
    assert torch.equal(traj.images, want)
    assert traj.latents.shape == (4, 5, *family.latent_shape())
    assert torch.equal(traj.times["next_sigmas"][:, -1], torch.zeros(4))  # the schedule ends at s = 0


def test_a_size_the_model_cannot_take_is_refused_at_start_by_name(family_model_dirs, tmp_path):
    """base.py's size rule, checked when the run starts (the Trainer's model loads), before any batch: a side not a
    multiple of the VAE factor times the patch (FLUX packs 2 x 2 latent pixels: 4 px on the tiny model; SDXL's UNet
    none: 2 px), more patches than SD3's positional table (pos_embed_max_size 96 of 2 px); each names
    sample.resolution and what the model takes, and no run directory is left behind."""
    from ddpo_group.errors import ConfigError
    from ddpo_group.run.trainer import Trainer

    cases = [("flux", 30, r"sample.resolution=30 is not a multiple of 4 px \(this model's VAE factor times its "
                          r"patch\)"),
             ("sdxl", 17, r"sample.resolution=17 is not a multiple of 2 px"),
             ("sd3", 256, r"sample.resolution=256 is 128 patches of 2 px a side, beyond this model's position table "
                          r"\(SD3Transformer2DModel's pos_embed_max_size=96: 96 patches a side, 192 px\): set "
                          r"sample.resolution to a multiple of 2 up to 192")]
    for name, resolution, message in cases:
        config = tiny_config("grpo", family_model_dirs[name], tmp_path, name,
                             **{**FAMILY_OVERRIDES[name], "sample.resolution": resolution})
        with pytest.raises(ConfigError, match=rf"the {name} model cannot sample this size:\n  - {message}"):
            Trainer(config)
        assert not (tmp_path / name).exists()
    family, _ = family_of("sd3", family_model_dirs["sd3"], **{"sample.resolution": 192})
    assert family.latent_shape() == (4, 96, 96)  # the table's largest


def test_sd3_with_t5_reproduces_its_pipeline(tmp_path):
    from ddpo_group.models.tiny_random import build_tiny_sd3_pipeline, save_pipeline

    directory = save_pipeline(build_tiny_sd3_pipeline(with_t5=True), tmp_path / "sd3_t5")
    family, _ = family_of("sd3", directory)
    assert family.pipe.text_encoder_3 is not None
    cond = family.encode(PROMPTS)
    assert float(cond["prompt_embeds"][:, 16:].abs().sum()) > 0  # the T5 tokens follow the 16 CLIP tokens
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(PROMPTS, num_inference_steps=3, guidance_scale=4.5, generator=generators(4), height=32, width=32,
                       max_sequence_length=16, output_type="pt").images
    traj = sample_trajectories(family, family.model, cond, family.encode([""] * 4),
                               SamplingOptions(3, 4.5, [0.0] * 3, compute_log_prob=False), generator=generators(4))
    assert torch.equal(traj.images, want)


@pytest.mark.parametrize("noise_level, guidance, resolution, zeros", [
    (0.0, 5.0, 0, True), (0.0, 5.0, 32, False), (1.0, 5.0, 0, True), (0.5, 1.0, 32, True),
])
def test_sdxl_sampler_reproduces_the_pipelines_own_call(noise_level, guidance, resolution, zeros, tiny_sdxl_dir):
    """Same generators, DDIM with eta = the noise level: the pipeline's images exactly, at its default size and at
    ``sample.resolution`` (the size ids follow it). The unconditional condition is zeros when the pipeline's
    force_zeros_for_empty_prompt is set (SDXL base's), else the encoded empty prompt, as the pipeline does (which
    encodes it as a batch of B empty prompts, so ours is too for the bitwise comparison)."""
    family, config = family_of("sdxl", tiny_sdxl_dir, **{"sample.resolution": resolution,
                                                          "sample.noise_level": noise_level})
    assert isinstance(family.pipe, StableDiffusionXLPipeline) and family.name == "sdxl"
    family.pipe.register_to_config(force_zeros_for_empty_prompt=zeros)
    family.pipe.set_progress_bar_config(disable=True)
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    side = resolution or 16  # the tiny UNet's 8x8 latents, a VAE scale factor of 2: the pipeline's default
    assert kwargs == {"eta": noise_level, "height": side, "width": side}  # the size named, the default too
    want = family.pipe(PROMPTS, num_inference_steps=4, guidance_scale=guidance, generator=generators(4),
                       output_type="pt", **kwargs).images
    negative = family.negative_condition()
    assert bool((negative["pooled_prompt_embeds"] == 0).all()) == zeros
    if not zeros:
        batched = family.encode([""] * 4)
        for key in family.cond_keys:
            torch.testing.assert_close(negative[key].expand_as(batched[key]), batched[key], rtol=1e-5, atol=1e-5)
        negative = batched
    traj = sample_trajectories(family, family.model, family.encode(PROMPTS), negative,
                               SamplingOptions(4, guidance, [noise_level] * 4, compute_log_prob=False),
                               generator=generators(4))
    assert traj.images.shape == (4, 3, side, side) and traj.latents.shape == (4, 5, 4, side // 2, side // 2)
    assert torch.equal(traj.images, want)


def test_sdxl_text_encoders_run_where_they_are_and_a_float16_vae_decodes_in_float32(tiny_sdxl_dir):
    """pretrained.text_encoder_device: build_policy places both text encoders by name; the prompts meet them on their
    device and the embeddings move to the UNet's (here the UNet on the meta device, the encoders on the CPU). A float16
    VAE with force_upcast decodes in float32, as the pipeline does, and is float16 again afterwards."""
    from ddpo_group.models.trainable import TEXT_ENCODERS

    family, _ = family_of("sdxl", tiny_sdxl_dir)
    encoders = [name for name, module in family.pipe.components.items() if name.startswith("text_encoder")]
    assert encoders == ["text_encoder", "text_encoder_2"] and set(encoders) <= set(TEXT_ENCODERS)
    on_cpu = family.encode(PROMPTS)
    assert on_cpu["prompt_embeds"].shape == (4, 16, 64) and on_cpu["pooled_prompt_embeds"].shape == (4, 32)

    latents = torch.randn(2, *family.latent_shape(), generator=torch.Generator().manual_seed(0))
    vae = family.pipe.vae
    torch.nn.Module.to(vae, dtype=torch.float16)
    assert vae.config.force_upcast
    images = family.decode(latents.half())
    assert vae.dtype == torch.float16 and images.dtype == torch.float32
    vae.register_to_config(force_upcast=False)  # a float16 decode gives other images: the check below can fail
    assert float((family.decode(latents.half()) - images).abs().max()) > 1e-4
    torch.nn.Module.to(vae, dtype=torch.float32)  # the float16 weights and latents, upcast: what the decode ran
    assert torch.equal(images, family.decode(latents.half().float()))

    torch.nn.Module.to(family.pipe.unet, "meta")
    cond = family.encode(PROMPTS)
    assert family.pipe.text_encoder_2.device.type == "cpu"
    assert {key: (value.device.type, value.shape) for key, value in cond.items()} == {
        key: ("meta", value.shape) for key, value in on_cpu.items()}


@pytest.mark.parametrize("name", ["sdxl", "sd3", "flux", "zimage", "flux_kontext", "flux2", "flux2_dev", "wan", "qwenimage"])
def test_the_first_training_forwards_ratio_is_one(name, family_model_dirs):
    """Scoring the recorded transitions again under the sampling policy gives back the recorded log-probs:
    bitwise when the training forward's batch is the sampling batch; otherwise the float32 kernels of another
    batch size round differently, by at most a few ulps (measured up to 1.3e-6 in the ratio on this CPU, SDXL with one
    thread), so the ratio is 1 to within 3e-6, a thirtieth of the default clip range 1e-4."""
    family, config = family_of(name, family_model_dirs[name], sde_window_size=0)
    assert_the_recorded_log_probs_come_back(family, config, family.encode(PROMPTS), tolerance=3e-6)


@pytest.mark.slow
@pytest.mark.parametrize("recipe, name", [("flow_grpo_sd35", "sd3"), ("flow_grpo_flux", "flux")])
def test_the_flow_grpo_recipes_run_on_the_tiny_models(recipe, name, family_model_dirs, tmp_path):
    """Flow-GRPO's published settings (their model replaced by the tiny one, their sizes by tiny ones): what the
    README's commands run, minus the download."""
    overrides = {**FAMILY_OVERRIDES[name], "sample.text_embedding_cache": 16, "sample.decode_batch_size": 3,
                 "sample.num_steps": 3, "train.pairs_per_forward": 4, "train.gradient_checkpointing": True,
                 "mixed_precision": "no"}
    trainer = tiny_trainer(recipe, family_model_dirs[name], tmp_path, recipe, **overrides)
    config = trainer.config
    assert (config.lora_rank, config.lora_alpha, config.train.group_size) == (32, 64, 4)  # group 24 in the recipe
    assert trainer.family.name == name and trainer.family.model.is_gradient_checkpointing
    metrics = trainer.run()
    assert metrics["global_step"] == 2 and torch.isfinite(torch.tensor(metrics["train/policy_loss"]))
    assert len(trainer.rollouts.sampler.text_cache.entries) > 0  # every prompt met the text encoders once


@pytest.mark.parametrize("name", ["sd", "sdxl", "flux", "zimage", "flux2", "flux2_dev", "wan", "qwenimage"])
def test_cached_text_embeddings_and_chunked_decoding_change_nothing(name, family_model_dirs):
    """A prompt is encoded alone into the cache: the same embedding whatever it was batched with; the VAE decodes
    3 images at a time: the same images as all at once (to float32 rounding of other batch sizes)."""
    from ddpo_group.rollout.sampler import TextEmbeddingCache, encode_unique

    family, config = family_of(name, family_model_dirs[name])
    cache = TextEmbeddingCache(size=3)
    first = encode_unique(family, PROMPTS[:2], cache)
    again = encode_unique(family, [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[0]], cache)
    assert list(cache.entries) == [PROMPTS[1], PROMPTS[0], PROMPTS[2]]  # least recently used first, at most 3
    for key in family.cond_keys:
        assert torch.equal(again[key][1], first[key][0]) and torch.equal(again[key][0], first[key][1])
        torch.testing.assert_close(again[key][:3], family.encode([PROMPTS[1], PROMPTS[0], PROMPTS[2]])[key],
                                   rtol=1e-5, atol=1e-5)
    encode_unique(family, [PROMPTS[3]], cache)
    assert list(cache.entries) == [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    cond = family.encode(PROMPTS)
    whole, chunked = (sample_trajectories(family, family.model, cond, family.negative_condition(),
                                          SamplingOptions(2, 1.0, [0.0, 0.0], compute_log_prob=False,
                                                          decode_batch_size=size),
                                          generator=generators(4)).images
                      for size in (0, 3))
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)


def test_each_family_declares_its_capabilities_and_has_every_member_of_the_seam():
    """sampling/family.py: every registered family class declares its capabilities (video, audio, image conditioning;
    none for a text-to-image family) and defines every member of the Family protocol; a built family is a Family, and
    Wan2.2-A14B's layout (two experts) declares its second transformer where Wan2.1's does not."""
    from config.base import base as base_config
    from ddpo_group.models.families import FAMILY_REGISTRY, get_family
    from ddpo_group.models.families.wan import WanFamily
    from ddpo_group.models.tiny_random import build_tiny_wan_pipeline
    from ddpo_group.sampling.family import Capabilities, Family

    declared = {"ltx2": Capabilities(video=True, audio=True), "kandinsky6": Capabilities(video=True, audio=True),
                "wan": Capabilities(video=True),
                "hunyuan_video15": Capabilities(video=True), "sana_video": Capabilities(video=True),
                "cosmos3": Capabilities(video=True),  # its audio with sample.audio (the instance's)
                "wan_i2v": Capabilities(video=True, image_conditioning=True),
                "flux_kontext": Capabilities(image_conditioning=True),
                "qwenimage_edit": Capabilities(image_conditioning=True),
                "qwenimage_edit_plus": Capabilities(image_conditioning=True)}
    members = [name for name in vars(Family) if not name.startswith("_")] + list(Family.__annotations__)
    names = FAMILY_REGISTRY.names()
    assert set(declared) <= set(names) and len(names) >= 17
    for name in names:
        family = get_family(name)
        assert family.capabilities == declared.get(name, Capabilities()), name
        assert [m for m in members if not hasattr(family, m)] == [], name
    config = base_config()
    config.sample.resolution, config.sample.num_frames = 16, 5
    one = WanFamily(build_tiny_wan_pipeline(), config)
    two = WanFamily(build_tiny_wan_pipeline(boundary_ratio=0.8), config)
    assert isinstance(one, Family) and isinstance(two, Family)
    assert (one.capabilities.second_transformer, two.capabilities.second_transformer) == (False, True)
    assert two.capabilities.video and WanFamily.capabilities == Capabilities(video=True)  # the class's stays
