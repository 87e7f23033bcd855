"""Qwen-Image-Edit-Plus (qwenimage_edit_plus) on a tiny pipeline built from config: the sampler against the pipeline's
own call with one and two source images, the image latents and their grids, true CFG with each row's own
unconditional branch, log-prob recomputation, rows whose images have other grids, the condition itself (transformers'
Qwen2VLProcessor: without torchvision, built without its video processor, tests/helpers/processor_without_video.py), the
cache, an editing dataset's epoch and the LoRA export (the presets: test_family_matrix.py).

The pipeline resizes the source images to CONDITION_IMAGE_SIZE (384^2) and VAE_IMAGE_SIZE (1024^2) pixels, constants
of its module, which the family reads there: the tests make them small (``small_sources``), for both."""

import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus
from PIL import Image

from ddpo_group.sampling.trajectories import SamplingOptions, sample_trajectories
from helpers import family_checks
from helpers.family_checks import assert_the_recorded_log_probs_come_back, generators
from helpers.trainer_helpers import FAMILY_OVERRIDES, small_qwen_edit_sources, tiny_trainer

NAME = "qwenimage_edit_plus"
# examples/edit_reward.py compares an edit with one source image; these prompts have two: a built-in reward
REWARD = "jpeg_compressibility"


@pytest.fixture(autouse=True)
def small_sources(monkeypatch):
    """The pipelines' source sizes made tiny (the families read them from the pipelines' modules): 64^2 px for the
    Plus pipeline's text encoder, 32^2 px for its VAE (a square source: 4 x 4 packed tokens) and for both of
    Qwen-Image-Edit's (trainer_helpers.small_qwen_edit_sources)."""
    small_qwen_edit_sources(monkeypatch.setattr)


def sources(folder: Path) -> list[str]:
    """Three PNG sources: a square on a background, 32 x 32, 40 x 24 and 24 x 40 px."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (size, colour) in enumerate([((32, 32), (220, 30, 30)), ((40, 24), (30, 200, 60)),
                                        ((24, 40), (40, 60, 230))]):
        pixels = np.full((size[1], size[0], 3), 240, dtype=np.uint8)
        pixels[4:20, 4 + i : 20 + i] = colour
        Image.fromarray(pixels).save(folder / f"source_{i}.png")
        paths.append(str(folder / f"source_{i}.png"))
    return paths


family_of = partial(family_checks.family_of, NAME)  # family_of(model_dir, preset="grpo", **overrides)


def given_text(family, images_per_row, lengths, seed=0):
    """Rows of a condition and of its negative condition with random text embeddings (in place of the processor's:
    [1, length, 16] each, the negative's 5 tokens) and the family's image condition of each row's images; also the
    embeddings themselves."""
    rows, negatives, texts = [], [], []
    g = torch.Generator().manual_seed(seed)
    for images, length in zip(images_per_row, lengths):
        embeds, negative = torch.randn(1, length, 16, generator=g), torch.randn(1, 5, 16, generator=g)
        texts.append((embeds, negative))
        image_part = family.image_condition(images)[1]
        rows.append({**family.padded_condition(embeds, None), **image_part})
        negatives.append({**family.padded_condition(negative, None), **image_part})
    stack = lambda parts: {key: torch.cat([part[key] for part in parts]) for key in parts[0]}  # noqa: E731
    return stack(rows), stack(negatives), texts


def assert_the_lora_gives_the_trained_edit(pipe, trainer, prompt: str, metadata: list, lora) -> None:
    """The exported LoRA loaded by the pipeline's own ``load_lora_weights`` edits as the trained model samples (noise
    level 0, the same noise), and training moved the model away from the base (so the check can fail)."""
    family = trainer.family
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompt=[prompt], num_inference_steps=4, output_type="pt", **family.pipeline_row_kwargs(metadata),
                **family.pipeline_kwargs(trainer.config.sample, trainer.config.pretrained))
    base_images = pipe(generator=generators(1), **call).images
    pipe.load_lora_weights(str(lora))
    loaded = pipe(generator=generators(1), **call).images
    trained = sample_trajectories(family, family.model, family.condition([prompt], metadata),
                                  family.negative_for(metadata),
                                  SamplingOptions(4, trainer.config.sample.guidance_scale, [0.0] * 4,
                                                  compute_log_prob=False),
                                  generator=generators(1)).images
    assert float((trained - base_images).abs().max()) > 1e-4  # training moved the model, so the check can fail
    torch.testing.assert_close(loaded, trained, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_the_sampler_reproduces_the_pipelines_own_call_given_the_text(count, guidance, tiny_qwenimage_edit_plus_dir,
                                                                      tmp_path):
    """The pipeline's own ``__call__`` with the same text embeddings (``prompt_embeds``, ``negative_prompt_embeds``),
    source images and generator, at noise level 0: its images bitwise, with one and with two sources (of other sizes:
    each resized to the VAE size of its aspect ratio, its grid in img_shapes)."""
    family, config = family_of(tiny_qwenimage_edit_plus_dir)
    assert family.name == NAME and isinstance(family.pipe, QwenImageEditPlusPipeline) and family.text_dim == 16
    images = [Image.open(path).convert("RGB") for path in sources(tmp_path)[:count]]
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    assert kwargs == {"height": 32, "width": 32, "max_sequence_length": 128, "true_cfg_scale": 5.0,
                      "negative_prompt": " "}
    cond, negative_cond, [(embeds, negative)] = given_text(family, [images], [7])
    assert cond["image_shapes"].tolist() == [[[4, 4], [4, 4]][:count]]  # 32^2 px VAE sources, f = 4, 2 x 2 patches
    assert cond["image_latents"].shape == (1, 16 * count, 16) and cond["prompt_embeds"].shape == (1, 128, 16)
    pipe = family.pipe
    pipe.set_progress_bar_config(disable=True)
    ones = torch.ones(1, 7, dtype=torch.long)
    want = pipe(image=images, prompt_embeds=embeds, prompt_embeds_mask=ones, negative_prompt_embeds=negative,
                negative_prompt_embeds_mask=torch.ones(1, 5, dtype=torch.long), true_cfg_scale=guidance, height=32,
                width=32, num_inference_steps=4, generator=generators(1), output_type="pt").images
    traj = sample_trajectories(family, family.model, cond, negative_cond,
                               SamplingOptions(4, guidance, [0.0] * 4, compute_log_prob=False), generator=generators(1))
    assert torch.equal(traj.images, want)
    if count == 2:  # the second source changes the images
        one, negative_one, _ = given_text(family, [images[:1]], [7])
        first = sample_trajectories(family, family.model, one, negative_one,
                                    SamplingOptions(4, guidance, [0.0] * 4, compute_log_prob=False),
                                    generator=generators(1)).images
        assert float((first - want).abs().max()) > 1e-3


def test_the_first_training_forwards_ratio_is_one(tiny_qwenimage_edit_plus_dir, tmp_path, monkeypatch):
    """Recorded transitions scored again with the record's condition (both branches of true CFG, the image latents)
    give back the recorded log-probs: bitwise on the sampling batch, the ratio within 3e-6 on other chunks; the rows'
    sources have two grids (40 x 24 and 24 x 40 px: 12 x 8 and 8 x 12 packed tokens), one forward each."""
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", 64 * 64)
    family, config = family_of(tiny_qwenimage_edit_plus_dir, **{"sample.sde_window_size": 0})
    _, wide, tall = (Image.open(path).convert("RGB") for path in sources(tmp_path))
    cond, negative, _ = given_text(family, [[wide], [tall], [wide], [tall]], [7, 3, 9, 7])
    assert cond["image_shapes"][:2].tolist() == [[[8, 12]], [[12, 8]]]
    assert config.train.cfg and config.sample.guidance_scale == 5.0
    assert family.negative_condition() == {}  # each row's negative is its own, in the record
    assert_the_recorded_log_probs_come_back(family, config, cond, tolerance=3e-6, negative=negative)


def test_chunked_decoding_changes_nothing(tiny_qwenimage_edit_plus_dir, tmp_path):
    family, _ = family_of(tiny_qwenimage_edit_plus_dir)
    images = [Image.open(path).convert("RGB") for path in sources(tmp_path)[:2]]
    cond, negative, _ = given_text(family, [images] * 4, [7, 3, 9, 7])
    whole, chunked = (sample_trajectories(family, family.model, cond, negative,
                                          SamplingOptions(2, 4.0, [0.0, 0.0], compute_log_prob=False,
                                                          decode_batch_size=size),
                                          generator=generators(4)).images for size in (0, 3))
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)


def test_what_the_family_refuses(tiny_qwenimage_edit_plus_dir):
    family, _ = family_of(tiny_qwenimage_edit_plus_dir)
    with pytest.raises(ValueError, match="condition\\(prompts, metadata\\)"):
        family.encode(["a cat"])
    with pytest.raises(ValueError, match="takes one prompt a call; got 2 rows"):
        family.pipeline_row_kwargs([{}, {}])
    if family.pipe.processor is None:
        with pytest.raises(ValueError, match="has no processor"):
            family.condition(["edit"], [{"image": "unused.png"}])
    else:
        with pytest.raises(ValueError, match="prompt 'a cat' has none"):
            family.condition(["a cat"], [{}])


def test_the_pipelines_keywords_name_the_default_size(tiny_qwenimage_edit_plus_dir):
    """At sample.resolution=0 the family samples default_sample_size times the VAE factor, square (512 px here, 1024 on
    the real model); the pipeline's own default follows each source's aspect at about 1 MP, so its keywords name the
    family's size: evaluation samples what training sampled."""
    family, config = family_of(tiny_qwenimage_edit_plus_dir, **{"sample.resolution": 0})
    assert family.height_width == (512, 512)
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    assert (kwargs["height"], kwargs["width"]) == (512, 512)


def test_the_bench_shape_is_qwenimage_edit_plus_at_its_real_size():
    """models/full_size.py's qwenimage_edit_plus on the meta device: Qwen-Image's 20.4B transformer (the Edit
    models share it) and Qwen2.5-VL-7B's text model and vision tower."""
    from ddpo_group.models import full_size
    with torch.device("meta"):
        full = full_size.BUILDERS[NAME]()
        part = full_size.build_qwenimage_edit_plus(blocks=0.05)
    assert isinstance(full, QwenImageEditPlusPipeline)
    assert sum(p.numel() for p in full.transformer.parameters()) / 1e9 == pytest.approx(20.43, abs=0.01)
    assert full.text_encoder.config.vision_config.depth == 32
    assert len(part.transformer.transformer_blocks) == 3


# ------------------------------------------------------------------ with the processor (torchvision)
def edit_dataset(folder: Path) -> str:
    """A .jsonl editing dataset: two source images a prompt (32 x 32 and 40 x 24 px: the same VAE grid at 32^2 px)."""
    first, second = (Path(path).name for path in sources(folder)[:2])
    rows = [{"prompt": "put the first square on the second", "image": [first, second]},
            {"prompt": "make the square blue", "image": [second, first]},
            {"prompt": "turn the background green", "image": [first, first]}]
    path = folder / "edits.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return str(path)


@pytest.mark.parametrize("count", [1, 2])
def test_the_condition_and_sampler_reproduce_the_pipelines_own_call(count, tiny_qwenimage_edit_plus_dir, tmp_path):
    family, config = family_of(tiny_qwenimage_edit_plus_dir)
    paths = sources(tmp_path)[:count]
    metadata = [{"image": paths if count > 1 else paths[0]}]
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(prompt=["make it red"], generator=generators(1), num_inference_steps=4, output_type="pt",
                       **family.pipeline_row_kwargs(metadata), **kwargs).images
    cond = family.condition(["make it red"], metadata)
    traj = sample_trajectories(family, family.model, cond, family.negative_for(metadata),
                               SamplingOptions(4, config.sample.guidance_scale, [0.0] * 4, compute_log_prob=False),
                               generator=generators(1))
    assert torch.equal(traj.images, want)


def test_a_rows_negative_prompt_sees_its_images_as_in_the_pipeline(tiny_qwenimage_edit_plus_dir, tmp_path):
    """A row's own negative prompt (``metadata["negative_prompt"]``) is encoded with the row's images, as the
    pipeline's ``negative_prompt=``: the images bitwise; the family's negatives are per row, each (text, images)
    encoded once."""
    family, config = family_of(tiny_qwenimage_edit_plus_dir, **{"sample.text_embedding_cache": 4})
    paths = sources(tmp_path)
    metadata = [{"image": paths[:2], "negative_prompt": "blurry"}]
    rows = family.pipeline_row_kwargs(metadata)
    assert rows["negative_prompt"] == ["blurry"] and len(rows["image"]) == 2
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(prompt=["make it red"], generator=generators(1), num_inference_steps=4, output_type="pt",
                       **{**family.pipeline_kwargs(config.sample, config.pretrained), **rows}).images
    negative = family.negative_for(metadata)
    assert list(family._negatives) == [("blurry", tuple(paths[:2]))]
    traj = sample_trajectories(family, family.model, family.condition(["make it red"], metadata), negative,
                               SamplingOptions(4, config.sample.guidance_scale, [0.0] * 4, compute_log_prob=False),
                               generator=generators(1))
    assert torch.equal(traj.images, want)
    default = family.negative_for([{"image": paths[:2]}])
    assert not torch.equal(default["prompt_embeds"], negative["prompt_embeds"])
    assert torch.equal(default["image_latents"], negative["image_latents"])


def test_an_editing_dataset_trains_an_epoch_and_the_lora_loads_in_the_pipeline(tiny_qwenimage_edit_plus_dir,
                                                                                tmp_path):
    from ddpo_group.rollout.sampler import TextEmbeddingCache, encode_unique

    path = edit_dataset(tmp_path / "data")
    trainer = tiny_trainer("grpo", tiny_qwenimage_edit_plus_dir, tmp_path, "edits", **FAMILY_OVERRIDES[NAME],
                           prompt_fn="from_file", prompt_fn_kwargs={"path": path}, reward_fn=REWARD, device="cpu",
                           **{"sample.text_embedding_cache": 8, "sample.decode_batch_size": 3})
    metrics = trainer.run()
    assert metrics["global_step"] == 2 and np.isfinite(metrics["train/policy_loss"])
    family = trainer.family
    source = str(tmp_path / "data" / "source_0.png")
    metadata = [{"image": [source, source]}]
    cache = TextEmbeddingCache(size=4)
    cached = encode_unique(family, ["edit", "edit"], cache, metadata * 2)
    assert list(cache.entries) == [("edit", (source, source))]
    for key in family.cond_keys:
        assert torch.equal(cached[key][0], cached[key][1])
    assert_the_lora_gives_the_trained_edit(QwenImageEditPlusPipeline.from_pretrained(tiny_qwenimage_edit_plus_dir),
                                           trainer, "edit", metadata, tmp_path / "edits" / "lora")

    from config.base import base
    from ddpo_group.offline.comparison import EvaluationRequest, evaluate

    report = evaluate(EvaluationRequest(str(tmp_path / "edits"), num_prompts=2, num_seeds=2, batch_size=4,
                                        show_progress=False, device="cpu"), base())
    assert report["family"] == NAME and report["batch_size"] == 1 and report["num_steps"] == 4
    assert report["rewards"]["reward"]["difference"]["n"] == 4


@pytest.mark.slow
def test_the_flow_grpo_edit_recipe_runs_on_the_tiny_model(tiny_qwenimage_edit_plus_dir, tmp_path):
    path = edit_dataset(tmp_path / "data")
    overrides = {**FAMILY_OVERRIDES[NAME], "sample.text_embedding_cache": 16, "sample.decode_batch_size": 3,
                 "sample.num_steps": 3, "train.pairs_per_forward": 4, "mixed_precision": "no",
                 "train.gradient_accumulation_steps": 1, "pretrained.text_encoder_device": "cpu", "device": "cpu",
                 "prompt_fn": "from_file", "prompt_fn_kwargs": {"path": path}, "reward_fn": REWARD}
    trainer = tiny_trainer("flow_grpo_qwenimage_edit_plus", tiny_qwenimage_edit_plus_dir, tmp_path, "recipe",
                           **overrides)
    assert trainer.family.model.is_gradient_checkpointing
    metrics = trainer.run()
    assert metrics["global_step"] >= 1 and torch.isfinite(torch.tensor(metrics["train/policy_loss"]))


def test_the_recipe_is_flow_grpos():
    from config.base import get_config

    recipe = get_config("flow_grpo_qwenimage_edit_plus")
    assert recipe.pretrained.model == "Qwen/Qwen-Image-Edit-2509" and recipe.prompt_fn == "from_file"
    assert (recipe.lora_rank, recipe.lora_alpha, recipe.sample.guidance_scale, recipe.train.cfg) == (64, 128, 4.0, True)


# ------------------------------------------------------------------ Qwen-Image-Edit (one source image)
@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_qwen_image_edit_reproduces_its_pipelines_own_call_given_the_text(guidance, tiny_qwenimage_edit_dir, tmp_path):
    from diffusers import QwenImageEditPipeline

    family, _ = family_of(tiny_qwenimage_edit_dir, **FAMILY_OVERRIDES["qwenimage_edit"])
    assert family.name == "qwenimage_edit" and isinstance(family.pipe, QwenImageEditPipeline)
    image = Image.open(sources(tmp_path)[1]).convert("RGB")  # 40 x 24 px
    cond, negative_cond, [(embeds, negative)] = given_text(family, [[image]], [7])
    assert cond["image_shapes"].tolist() == [[[4, 4]]] and cond["image_latents"].shape == (1, 16, 16)
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(image=image, prompt_embeds=embeds, prompt_embeds_mask=torch.ones(1, 7, dtype=torch.long),
                       negative_prompt_embeds=negative, negative_prompt_embeds_mask=torch.ones(1, 5, dtype=torch.long),
                       true_cfg_scale=guidance, height=32, width=32, num_inference_steps=4, generator=generators(1),
                       output_type="pt").images
    traj = sample_trajectories(family, family.model, cond, negative_cond,
                               SamplingOptions(4, guidance, [0.0] * 4, compute_log_prob=False), generator=generators(1))
    assert torch.equal(traj.images, want)
    with pytest.raises(ValueError, match="edits one source image a prompt"):
        family.sources("edit", {"image": sources(tmp_path)[:2]})


def test_qwen_image_edit_condition_reproduces_its_pipelines_own_call(tiny_qwenimage_edit_dir, tmp_path):
    family, config = family_of(tiny_qwenimage_edit_dir, **FAMILY_OVERRIDES["qwenimage_edit"])
    metadata = [{"image": sources(tmp_path)[1]}]
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(prompt=["make it red"], generator=generators(1), num_inference_steps=4, output_type="pt",
                       **family.pipeline_row_kwargs(metadata),
                       **family.pipeline_kwargs(config.sample, config.pretrained)).images
    traj = sample_trajectories(family, family.model, family.condition(["make it red"], metadata),
                               family.negative_for(metadata),
                               SamplingOptions(4, config.sample.guidance_scale, [0.0] * 4, compute_log_prob=False),
                               generator=generators(1))
    assert torch.equal(traj.images, want)


def test_qwen_image_edit_trains_an_epoch_on_edits_and_its_lora_loads_in_the_pipeline(tiny_qwenimage_edit_dir, tmp_path):
    """One source image a prompt (a .jsonl dataset, one row with its own negative prompt): a grpo epoch with true CFG
    trains the LoRA, whose export loaded by QwenImageEditPipeline gives the trained model's edits."""
    from diffusers import QwenImageEditPipeline

    folder = tmp_path / "data"
    names = [Path(path).name for path in sources(folder)]
    rows = [{"prompt": "make the square blue", "image": names[0]}, {"prompt": "turn it green", "image": names[1]},
            {"prompt": "a red border", "image": names[2], "negative_prompt": "blurry"}]
    (folder / "edits.jsonl").write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    trainer = tiny_trainer("grpo", tiny_qwenimage_edit_dir, tmp_path, "edit1", **FAMILY_OVERRIDES["qwenimage_edit"],
                           prompt_fn="from_file", prompt_fn_kwargs={"path": str(folder / "edits.jsonl")},
                           reward_fn=REWARD, device="cpu")
    assert trainer.family.name == "qwenimage_edit" and trainer.config.sample.guidance_scale > 1
    before = [p.detach().clone() for p in trainer.updater.params]
    metrics = trainer.run()
    assert metrics["global_step"] == 2 and np.isfinite(metrics["train/policy_loss"])
    assert sum(not torch.equal(b, p.detach()) for b, p in zip(before, trainer.updater.params)) > len(before) // 2
    metadata = [{"image": str(folder / names[1])}]
    assert_the_lora_gives_the_trained_edit(QwenImageEditPipeline.from_pretrained(tiny_qwenimage_edit_dir), trainer,
                                           "turn it green", metadata, tmp_path / "edit1" / "lora")
