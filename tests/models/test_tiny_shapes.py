"""The embedded default model: data set, tokenizer, offline load, classifier and the alignment reward."""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from config.base import base
from ddpo_group.models import shapes_data as shapes
from ddpo_group.models import CLASSIFIER_DIR, TINY_SHAPES, TINY_SHAPES_DIR, load_pipeline, resolve_model_path
from ddpo_group.models.shapes_classifier import ShapesClassifier
from ddpo_group.prompts import PromptSampler
from ddpo_group.rewards import make_reward_fn

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_shapes_pipe():
    pipe = load_pipeline(TINY_SHAPES, config=base())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_dataset_is_deterministic_for_a_seed_and_differs_across_seeds():
    a, b, c = shapes.make_batch(16, seed=3), shapes.make_batch(16, seed=3), shapes.make_batch(16, seed=4)
    assert torch.equal(a.images, b.images) and a.captions == b.captions and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.images, c.images)
    assert a.images.shape == (16, 3, shapes.RESOLUTION, shapes.RESOLUTION)
    assert float(a.images.min()) >= 0.0 and float(a.images.max()) <= 1.0


def test_captions_labels_and_splits():
    batch = shapes.make_batch(64, seed=0)
    for caption, (color, shape, background) in zip(batch.captions, batch.labels.tolist()):
        names = (shapes.COLOR_NAMES[color], shapes.SHAPE_NAMES[shape], shapes.COLOR_NAMES[background])
        assert caption == shapes.caption(*names)
        assert shapes.parse_caption(caption) == names
        assert color != background and names[:2] not in shapes.HELD_OUT
    train, held = shapes.combinations(False), shapes.combinations(True)
    assert len(shapes.COLOR_NAMES) >= 6 and len(shapes.SHAPE_NAMES) >= 4
    assert not set(train) & set(held)
    assert len(train) + len(held) == len(shapes.COLOR_NAMES) * len(shapes.SHAPE_NAMES) * (len(shapes.COLOR_NAMES) - 1)
    assert {c[:2] for c in held} == set(shapes.HELD_OUT)
    held_batch = shapes.make_batch(32, seed=1, held_out=True)
    assert all(shapes.parse_caption(c)[:2] in shapes.HELD_OUT for c in held_batch.captions)


def test_image_pixels_show_the_caption_colors():
    """The center pixel of a big centered shape has the shape's color; a corner has the background's."""
    labels = torch.tensor([[0, 1, 2]]).numpy()  # red square on blue
    size, center = torch.tensor([10.0]).numpy(), torch.tensor([16.0]).numpy()
    image = torch.from_numpy(shapes.render(labels, size, center, center))[0]
    red, blue = torch.tensor(shapes.COLORS["red"]) / 255, torch.tensor(shapes.COLORS["blue"]) / 255
    assert torch.allclose(image[:, 16, 16], red, atol=1e-6)
    assert torch.allclose(image[:, 0, 0], blue, atol=1e-6)


def test_parse_caption_rejects_other_prompts():
    with pytest.raises(ValueError, match="'a photo of a cat' is not a shapes caption"):
        shapes.parse_caption("a photo of a cat")
    with pytest.raises(ValueError, match="magenta"):
        shapes.parse_caption("a magenta circle on a red background")


def test_prompt_function_draws_the_requested_split():
    sampler = PromptSampler("tiny_shapes", {"held_out": True}, seed=0)
    prompts, metadata = sampler.sample(20)
    assert all((m["color"], m["shape"]) in shapes.HELD_OUT and m["held_out"] for m in metadata)
    assert all(shapes.parse_caption(p) == (m["color"], m["shape"], m["background"]) for p, m in zip(prompts, metadata))
    train_prompts, _ = PromptSampler("tiny_shapes", {}, seed=0).sample(50)
    assert all(shapes.parse_caption(p)[:2] not in shapes.HELD_OUT for p in train_prompts)


def test_embedded_model_files_are_small_and_complete():
    assert resolve_model_path(TINY_SHAPES) == str(TINY_SHAPES_DIR)
    size = sum(f.stat().st_size for d in (TINY_SHAPES_DIR, CLASSIFIER_DIR) for f in d.rglob("*") if f.is_file())
    assert size <= 20e6, f"embedded model is {size / 1e6:.1f} MB"
    for name in ("model_index.json", "unet/config.json", "vae/config.json", "text_encoder/config.json",
                 "tokenizer/tokenizer.json", "tokenizer/vocab.json", "tokenizer/merges.txt", "scheduler/scheduler_config.json"):
        assert (TINY_SHAPES_DIR / name).is_file(), name


def test_tokenizer_round_trips_every_caption_one_token_per_word(tiny_shapes_pipe):
    tokenizer = tiny_shapes_pipe.tokenizer
    captions = [shapes.caption(*c) for c in shapes.combinations(False) + shapes.combinations(True)]
    for caption in captions:
        ids = tokenizer(caption).input_ids
        assert len(ids) == len(caption.split()) + 2  # <start> one token per word <end>
        assert tokenizer.decode(ids, skip_special_tokens=True) == caption
    # any text still tokenizes (byte-level fallback), within the model's length
    ids = tokenizer("a photo of a cat, 4k ünïcode", truncation=True, max_length=tokenizer.model_max_length).input_ids
    assert tokenizer.unk_token_id not in ids[1:-1] and len(ids) <= tokenizer.model_max_length


def test_offline_load_and_output_shapes(tiny_shapes_pipe, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(str(TINY_SHAPES_DIR), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(["a red circle on a blue background"] * 2, num_inference_steps=2, output_type="pt",
               generator=torch.Generator().manual_seed(0)).images
    assert out.shape == (2, 3, shapes.RESOLUTION, shapes.RESOLUTION)
    from ddpo_group.models.families.sd import encode_prompts
    from helpers.sd_helpers import sd_trajectories

    embeds = encode_prompts(pipe, ["a red circle on a blue background"] * 3)
    traj = sd_trajectories(pipe, embeds, encode_prompts(pipe, [""] * 3), 4, 5.0, 1.0,
                           generator=torch.Generator().manual_seed(0))
    assert traj.latents.shape == (3, 5, 4, 8, 8) and traj.log_probs.shape == (3, 4)
    assert traj.images.shape == (3, 3, shapes.RESOLUTION, shapes.RESOLUTION)


def test_missing_model_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "no_model_here"
    with pytest.raises(FileNotFoundError, match="no_model_here"):
        load_pipeline(str(missing), config=base())


def test_classifier_accuracy_on_fresh_images():
    classifier = ShapesClassifier.from_pretrained(CLASSIFIER_DIR)
    for held_out in (False, True):
        batch = shapes.make_batch(256, seed=987_654 + held_out, held_out=held_out)
        with torch.no_grad():
            logits = classifier(batch.images)
        for k, head in enumerate(("color", "shape", "background")):
            accuracy = (logits[k].argmax(1) == batch.labels[:, k]).float().mean().item()
            assert accuracy > 0.95, f"{head} accuracy {accuracy:.3f} (held_out={held_out})"


def test_alignment_reward_is_a_probability_and_prefers_the_matching_prompt():
    reward_fn = make_reward_fn("shapes_alignment")
    batch = shapes.make_batch(32, seed=5)
    matching, info = reward_fn(batch.images, batch.captions, [{}] * 32)
    # the same images against a prompt that gets every attribute wrong
    wrong = []
    for caption in batch.captions:
        color, shape, background = shapes.parse_caption(caption)
        other = lambda names, x: names[(names.index(x) + 1) % len(names)]  # noqa: E731
        wrong.append(shapes.caption(other(shapes.COLOR_NAMES, color), other(shapes.SHAPE_NAMES, shape),
                                    other(shapes.COLOR_NAMES, background)))
    mismatching, _ = reward_fn(batch.images, wrong, [{}] * 32)
    assert matching.shape == (32,) and matching.dtype == torch.float64
    for r in (matching, mismatching):
        assert float(r.min()) >= 0.0 and float(r.max()) <= 1.0
    assert bool((matching > mismatching).all())
    assert float(matching.mean()) > 0.9 and float(mismatching.mean()) < 0.1
    assert float(info["all_correct"].mean()) > 0.9
    # reward = mean of the three heads' probabilities of the prompt's attributes
    expected = (info["color_prob"] + info["shape_prob"] + info["background_prob"]) / 3
    assert torch.allclose(matching, expected)


def test_alignment_reward_uses_metadata_and_rejects_unknown_prompts():
    reward_fn = make_reward_fn("shapes_alignment")
    batch = shapes.make_batch(4, seed=6)
    by_text, _ = reward_fn(batch.images, batch.captions, [{}] * 4)
    metadata = [dict(zip(("color", "shape", "background"), shapes.parse_caption(c))) for c in batch.captions]
    by_metadata, _ = reward_fn(batch.images, ["free text"] * 4, metadata)
    assert torch.allclose(by_text, by_metadata)
    with pytest.raises(ValueError, match="'a photo of a dog' is not a shapes caption"):
        reward_fn(batch.images[:1], ["a photo of a dog"], [{}])


@pytest.mark.slow
def test_pretrain_script_rebuilds_a_loadable_model(tmp_path):
    """A --quick rebuild (two steps per phase, its sizes from the script's own flags) writes a pipeline that loads
    offline and a classifier, then the flow model beside them."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    sizes = ["--classifier-steps", "2", "--vae-steps", "2", "--vae-images", "32", "--unet-steps", "2", "--flow-steps",
             "2", "--eval-images", "4", "--batch", "4"]
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "pretrain_tiny.py"), "--quick", *sizes, "--out", str(tmp_path),
         "--grid", str(tmp_path / "grid.png")],
        check=True, env=env, capture_output=True, timeout=600,
    )
    pipe = load_pipeline(str(tmp_path / "tiny_shapes"), config=base())
    assert pipe.unet.config.sample_size == 8 and (tmp_path / "grid.png").is_file()
    ShapesClassifier.from_pretrained(tmp_path / "tiny_shapes_classifier")
    import json

    report = json.loads((tmp_path / "tiny_shapes" / "pretrain_report.json").read_text())
    assert set(report["base_model_sample_accuracy_train"]) == {"color", "shape", "background", "joint"}

    # the flow model beside it, reusing its judge and VAE
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "pretrain_tiny.py"), "--quick", *sizes, "--family", "sd3", "--out",
         str(tmp_path), "--grid", ""],
        check=True, env=env, capture_output=True, timeout=600,
    )
    from ddpo_group.models import load_family

    family = load_family(str(tmp_path / "tiny_shapes_flow"), config=base())
    assert family.name == "sd3" and family.pipe.transformer.config.sample_size == 8
    assert family.pipe.vae.config.shift_factor is not None
    report = json.loads((tmp_path / "tiny_shapes_flow" / "pretrain_report.json").read_text())
    assert report["sizes"]["flow_steps"] == 2 and "base_model_sample_accuracy_held_out" in report  # the flags' sizes


def test_prompt_filter_keeps_only_the_asked_shapes():
    prompts, metadata = PromptSampler("tiny_shapes", {"shapes": "circle, square"}, seed=0).sample(200)
    assert {m["shape"] for m in metadata} == {"circle", "square"}
    assert all(f"{m['color']} {m['shape']}" in p for p, m in zip(prompts, metadata))
    _, held = PromptSampler("tiny_shapes", {"shapes": ["triangle"], "held_out": True}, seed=0).sample(20)
    assert {(m["color"], m["shape"]) for m in held} == {("red", "triangle")}  # the one held-out triangle pair
    with pytest.raises(ValueError, match="'hexagon'.*allowed"):
        shapes.tiny_shapes(rng=random.Random(0), shapes="circle,hexagon")
