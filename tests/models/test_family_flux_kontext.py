"""FLUX.1 Kontext (flux_kontext) on a tiny pipeline built from config: the sampler against the pipeline's own call
with a source image, the conditioning latents in the batch record, log-prob recomputation, the cache keyed by prompt
and image, an editing dataset (.jsonl) training an epoch, the LoRA export in FluxKontextPipeline."""

import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxKontextPipeline
from PIL import Image

from ddpo_group.models import load_family
from ddpo_group.rollout.sampler import TextEmbeddingCache, encode_unique
from ddpo_group.sampling.trajectories import SamplingOptions, sample_trajectories
from helpers import family_checks
from helpers.family_checks import assert_the_recorded_log_probs_come_back, generators
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_config, tiny_trainer

EDIT_REWARD = str(Path(__file__).resolve().parents[2] / "examples" / "edit_reward.py") + ":edit_reward"
COLOURS = [(220, 30, 30), (30, 200, 60), (40, 60, 230)]


def edit_dataset(folder: Path) -> str:
    """A .jsonl editing dataset: three 32 px PNG sources (a square on a background) and an edit prompt each."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, colour in enumerate(COLOURS):
        pixels = np.full((32, 32, 3), 240, dtype=np.uint8)
        pixels[8:24, 8 + i : 24 + i] = colour
        Image.fromarray(pixels).save(folder / f"source_{i}.png")
        rows.append({"prompt": ["make the square blue", "make it red", "turn the background green"][i],
                     "image": f"source_{i}.png", "row": i})
    path = folder / "edits.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return str(path)


family_of = partial(family_checks.family_of, "flux_kontext")  # family_of(model_dir, preset="grpo", **overrides)


@pytest.mark.parametrize("guidance", [1.0, 3.5])
def test_noise_level_zero_reproduces_the_pipelines_own_call(guidance, tiny_flux_kontext_dir, tmp_path):
    """Same generators, the deterministic Euler sampler, the same source image: the pipeline's images bitwise, with
    ``family.pipeline_kwargs``; a prompt without an image is FLUX.1's text-to-image, as the pipeline without one."""
    family, config = family_of(tiny_flux_kontext_dir)
    assert family.name == "flux_kontext" and isinstance(family.pipe, FluxKontextPipeline)
    path = edit_dataset(tmp_path)
    source = str(tmp_path / "source_0.png")
    prompts, metadata = ["make the square blue", "a cat"], [{"image": source}, {"image": source}]
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    assert kwargs == {"height": 32, "width": 32, "max_area": 1024, "_auto_resize": False, "max_sequence_length": 16}
    family.pipe.set_progress_bar_config(disable=True)
    call = dict(num_inference_steps=4, guidance_scale=guidance, output_type="pt", **kwargs)
    rows = family.pipeline_row_kwargs(metadata)
    assert [image.size for image in rows["image"]] == [(32, 32)] * 2
    want = family.pipe(prompt=prompts, generator=generators(2), **rows, **call).images
    assert torch.equal(want, family.pipe(prompt=prompts, image=Image.open(source), generator=generators(2),
                                         **call).images)  # a source of the sampled size is used as it is
    cond = family.condition(prompts, metadata)
    assert cond["image_latents"].shape == (2, 64, 16) and cond["image_ids"].shape == (2, 64, 3)
    assert torch.equal(cond["image_ids"][:, :, 0], torch.ones(2, 64))  # the image tokens' first coordinate is 1
    traj = sample_trajectories(family, family.model, cond, family.negative_condition(),
                               SamplingOptions(4, guidance, [0.0] * 4, compute_log_prob=False), generator=generators(2))
    assert torch.equal(traj.images, want)
    text_only = family.pipe(prompt=prompts, generator=generators(2), **call).images
    plain = sample_trajectories(family, family.model, family.condition(prompts), family.negative_condition(),
                                SamplingOptions(4, guidance, [0.0] * 4, compute_log_prob=False),
                                generator=generators(2))
    assert torch.equal(plain.images, text_only)
    assert float((text_only - want).abs().max()) > 1e-3  # the source image changes the images
    assert Path(path).exists()
    # a source of another size and shape is resized to the sampled size, by the family and for the pipeline alike
    Image.open(source).resize((40, 24)).save(tmp_path / "wide.png")
    metadata = [{"image": str(tmp_path / "wide.png")}] * 2
    want = family.pipe(prompt=prompts, generator=generators(2), **family.pipeline_row_kwargs(metadata), **call).images
    traj = sample_trajectories(family, family.model, family.condition(prompts, metadata), family.negative_condition(),
                               SamplingOptions(4, guidance, [0.0] * 4, compute_log_prob=False), generator=generators(2))
    assert torch.equal(traj.images, want)
    with pytest.raises(ValueError, match="cannot mix rows with and without a source image"):
        family.pipeline_row_kwargs([metadata[0], {}])


def test_the_first_training_forwards_ratio_is_one(tiny_flux_kontext_dir, tmp_path):
    """The recorded transitions scored again with the batch record's condition (image latents included) give back the
    recorded log-probs: bitwise on the sampling batch, to 1e-6 in the ratio on other chunks."""
    edit_dataset(tmp_path)
    family, config = family_of(tiny_flux_kontext_dir, **{"sample.sde_window_size": 0})
    prompts = ["make the square blue", "make it red", "a", "turn the background green"]
    metadata = [{"image": str(tmp_path / f"source_{i % 3}.png")} for i in range(4)]
    cond = family.condition(prompts, metadata)
    assert_the_recorded_log_probs_come_back(family, config, cond, tolerance=1e-6)


def test_the_cache_is_keyed_by_prompt_and_image(tiny_flux_kontext_dir, tmp_path):
    edit_dataset(tmp_path)
    family, _ = family_of(tiny_flux_kontext_dir)
    red, green = str(tmp_path / "source_0.png"), str(tmp_path / "source_1.png")
    prompts = ["edit", "edit", "other", "edit"]
    metadata = [{"image": red}, {"image": green}, {"image": red}, {"image": red}]
    cache = TextEmbeddingCache(size=8)
    cached = encode_unique(family, prompts, cache, metadata)
    assert list(cache.entries) == [("edit", red), ("edit", green), ("other", red)]
    direct = encode_unique(family, prompts, None, metadata)
    for key in family.cond_keys:
        torch.testing.assert_close(cached[key], direct[key], rtol=1e-5, atol=1e-6)
        assert torch.equal(cached[key][0], cached[key][3])
    assert not torch.equal(cached["image_latents"][0], cached["image_latents"][1])  # another image, other latents
    assert torch.equal(cached["prompt_embeds"][0], cached["prompt_embeds"][1])
    with pytest.raises(ValueError, match="rows with and without a source image"):
        encode_unique(family, ["edit", "a cat"], cache, [{"image": red}, {}])


def test_a_text_only_family_ignores_source_images_with_one_warning(family_model_dirs, tmp_path):
    from ddpo_group.models.families import base

    edit_dataset(tmp_path)
    config = tiny_config("grpo", family_model_dirs["flux"], "unused", **FAMILY_OVERRIDES["flux"])
    family = load_family(family_model_dirs["flux"], config=config)
    base._IGNORED_IMAGES_WARNED.discard("flux")
    metadata = [{"image": str(tmp_path / "source_0.png")}]
    with pytest.warns(UserWarning, match="'flux' generates from the text only"):
        cond = family.condition(["edit"], metadata)
    assert set(cond) == set(family.cond_keys)
    assert family.condition_key("edit", metadata[0]) == "edit"


def train_edits(model_dir, preset, tmp_path, run_name, **overrides):
    path = edit_dataset(tmp_path / "data")
    values = {**FAMILY_OVERRIDES["flux_kontext"], "prompt_fn": "from_file", "prompt_fn_kwargs": {"path": path},
              "reward_fn": EDIT_REWARD, **overrides}
    return tiny_trainer(preset, model_dir, tmp_path, run_name, **values)


def test_an_editing_dataset_trains_an_epoch_and_the_lora_loads_in_the_pipeline(tiny_flux_kontext_dir, tmp_path):
    """grpo on the .jsonl edits with the edit reward plugin: the record holds each sample's image latents; the
    exported LoRA, loaded by FluxKontextPipeline.load_lora_weights, gives the trained model's edits."""
    trainer = train_edits(tiny_flux_kontext_dir, "grpo", tmp_path, "edits", device="cpu")
    metrics = trainer.run()
    assert metrics["global_step"] == 2 and np.isfinite(metrics["train/policy_loss"])
    assert 0 < metrics["reward_info/edit_keep"] <= 1  # the reward met the source images
    lora = tmp_path / "edits" / "lora"
    assert (lora / "pytorch_lora_weights.safetensors").exists()
    family = trainer.family
    source = str(tmp_path / "data" / "source_1.png")
    prompts, metadata = ["make it red", "make it red"], [{"image": source}] * 2
    pipe = FluxKontextPipeline.from_pretrained(tiny_flux_kontext_dir)
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompt=prompts, image=Image.open(source), num_inference_steps=4, output_type="pt",
                guidance_scale=trainer.config.sample.guidance_scale,
                **family.pipeline_kwargs(trainer.config.sample, trainer.config.pretrained))
    base_images = pipe(generator=generators(2), **call).images
    pipe.load_lora_weights(str(lora))
    loaded = pipe(generator=generators(2), **call).images
    trained = sample_trajectories(family, family.model, family.condition(prompts, metadata),
                                  family.negative_condition(),
                                  SamplingOptions(4, trainer.config.sample.guidance_scale, [0.0] * 4,
                                                  compute_log_prob=False),
                                  generator=generators(2)).images
    assert float((trained - base_images).abs().max()) > 1e-4  # training moved the model, so the check can fail
    torch.testing.assert_close(loaded, trained, rtol=1e-4, atol=1e-5)

    # scripts/evaluate.py's comparison on the run: the pipeline gets each prompt's source image
    from config.base import base
    from ddpo_group.offline.comparison import EvaluationRequest, evaluate

    report = evaluate(EvaluationRequest(str(tmp_path / "edits"), num_prompts=2, num_seeds=2, batch_size=4,
                                        show_progress=False, device="cpu"), base())
    assert report["family"] == "flux_kontext" and report["loaded"].startswith("lora:") and report["num_steps"] == 4
    difference = report["rewards"]["reward"]["difference"]
    assert difference["n"] == 4 and difference["std"] > 0


def test_the_bench_shape_is_flux_kontext_at_its_real_size():
    """models/full_size.py's flux_kontext, built on the meta device (no memory): FLUX.1's 11.9B transformer
    and a T5-XXL-sized encoder; a fraction of the blocks keeps the widths."""
    from ddpo_group.models import full_size

    def billions(pipe, name):
        return sum(p.numel() for p in getattr(pipe, name).parameters()) / 1e9

    with torch.device("meta"):
        full = full_size.BUILDERS["flux_kontext"]()
        part = full_size.build_flux_kontext(blocks=0.05)
    assert isinstance(full, FluxKontextPipeline)
    assert billions(full, "transformer") == pytest.approx(11.90, abs=0.01)
    assert billions(full, "text_encoder_2") == pytest.approx(4.76, abs=0.01)
    assert (len(part.transformer.transformer_blocks), len(part.transformer.single_transformer_blocks)) == (1, 2)
    assert part.transformer.config.num_attention_heads == 24 and part.text_encoder_2.config.d_model == 4096


@pytest.mark.slow
def test_the_flow_factory_kontext_recipe_runs_on_the_tiny_model(tiny_flux_kontext_dir, tmp_path):
    """Flow-Factory's published Kontext settings (their model replaced by the tiny one, their sizes by tiny ones,
    their PickScore by the edit reward plugin, which downloads nothing), with the memory options: the cache of
    (prompt, source image) conditions, chunked decoding, gradient checkpointing, the text encoders on the CPU."""
    from config.base import get_config

    recipe = get_config("flow_factory_flux_kontext")
    assert (recipe.lora_rank, recipe.lora_alpha, recipe.train.group_size, recipe.sample.guidance_scale) == (
        64, 128, 16, 2.5)
    overrides = {"sample.text_embedding_cache": 16, "sample.decode_batch_size": 3, "sample.num_steps": 3,
                 "sample.resolution": 32, "pretrained.max_sequence_length": 16, "train.pairs_per_forward": 4,
                 "train.gradient_checkpointing": True, "mixed_precision": "no", "train.gradient_accumulation_steps": 1,
                 "pretrained.text_encoder_device": "cpu", "device": "cpu"}
    trainer = train_edits(tiny_flux_kontext_dir, "flow_factory_flux_kontext", tmp_path, "recipe", **overrides)
    assert trainer.family.name == "flux_kontext" and trainer.family.model.is_gradient_checkpointing
    metrics = trainer.run()
    assert metrics["global_step"] >= 1 and torch.isfinite(torch.tensor(metrics["train/policy_loss"]))
    keys = list(trainer.rollouts.sampler.text_cache.entries)
    assert keys and all(isinstance(key, tuple) and key[1].endswith(".png") for key in keys)
