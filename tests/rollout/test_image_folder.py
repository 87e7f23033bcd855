"""Supervised fine-tuning on a folder of images (rollout/image_folder.py, sft.data_dir / sft.epochs): the folder's two
layouts and their errors, the epochs' rows, the images' resize and crop, the batch record, and a run that fine-tunes
on the folder, then learns by reward, and resumes exactly across the two stages."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from ddpo_group.errors import ConfigError
from ddpo_group.rollout.image_folder import epoch_rows, load_image, read_folder


def write_image(path, size=(16, 16), colour=(200, 30, 30)):
    pixels = np.zeros((size[1], size[0], 3), dtype=np.uint8)
    pixels[...] = colour
    pixels[: size[1] // 2, : size[0] // 3] = (20, 200, 40)
    Image.fromarray(pixels).save(path)


def metadata_folder(root, rows):
    root.mkdir(parents=True, exist_ok=True)
    for row in rows:
        if not (root / row["file_name"]).exists():
            write_image(root / row["file_name"])
    (root / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def test_a_metadata_folder_gives_prompts_free_metadata_and_absolute_source_images(tmp_path):
    write_image(tmp_path / "source.png")
    folder = metadata_folder(tmp_path, [
        {"file_name": "a.png", "text": " a red cat ", "style": "photo"},
        {"file_name": "b.png", "prompt": "a dog", "negative_prompt": "blurry", "image": "source.png"},
    ])
    rows = read_folder(folder)
    assert [(file.name, prompt) for file, prompt, _ in rows] == [("a.png", "a red cat"), ("b.png", "a dog")]
    assert rows[0][2] == {"style": "photo"}
    assert rows[1][2] == {"negative_prompt": "blurry", "image": str((tmp_path / "source.png").resolve())}


def test_a_folder_without_metadata_reads_the_prompt_beside_each_image(tmp_path):
    for name, prompt in (("b.jpg", "second"), ("a.png", "first\n")):
        write_image(tmp_path / name)
        (tmp_path / name).with_suffix(".txt").write_text(prompt)
    (tmp_path / "notes.md").write_text("not an image")
    assert [(file.name, prompt, meta) for file, prompt, meta in read_folder(tmp_path)] == [
        ("a.png", "first", {}), ("b.jpg", "second", {})]


@pytest.mark.parametrize("case, message", [
    ("missing folder", "sft.data_dir='.*nowhere' is not a folder"),
    ("empty folder", "holds no image with a prompt"),
    ("no caption", "has no prompt: write it in a.txt beside it"),
    ("empty caption", "a.txt is empty"),
    ("bad json", "metadata.jsonl, line 2: not valid JSON"),
    ("no text", "line 1: the prompt \\('text' or 'prompt'\\) is None"),
    ("missing image", "line 1: file_name 'gone.png' .* does not exist"),
    ("no file name", "line 1: a row must be a JSON object with 'file_name'"),
])
def test_a_bad_folder_is_refused_naming_the_file_and_line(tmp_path, case, message):
    folder = tmp_path / "data"
    folder.mkdir()
    if case == "missing folder":
        folder = tmp_path / "nowhere"
    elif case in ("no caption", "empty caption"):
        write_image(folder / "a.png")
        if case == "empty caption":
            (folder / "a.txt").write_text("  \n")
    elif case == "bad json":
        metadata_folder(folder, [{"file_name": "a.png", "text": "a cat"}])
        (folder / "metadata.jsonl").write_text((folder / "metadata.jsonl").read_text() + "{oops\n")
    elif case == "no text":
        metadata_folder(folder, [{"file_name": "a.png"}])
    elif case == "missing image":
        (folder / "metadata.jsonl").write_text(json.dumps({"file_name": "gone.png", "text": "a cat"}) + "\n")
    elif case == "no file name":
        (folder / "metadata.jsonl").write_text(json.dumps({"text": "a cat"}) + "\n")
    with pytest.raises(ConfigError, match=message):
        read_folder(folder)


def test_the_config_check_names_the_sft_fields(tmp_path):
    from config.base import get_config
    from ddpo_group.run.config_checks import validate_config

    def refused(**fields):
        config = get_config("grpo")
        for key, value in fields.items():
            config.sft[key] = value
        with pytest.raises(ConfigError) as error:
            validate_config(config)
        return str(error.value)

    assert "sft.epochs=2 needs sft.data_dir" in refused(epochs=2)
    assert "is read only in the first sft.epochs epochs" in refused(data_dir=str(tmp_path))
    assert "sft.epochs=999 must be an integer from 0 to num_epochs=" in refused(epochs=999, data_dir=str(tmp_path))
    assert "holds no image with a prompt" in refused(epochs=1, data_dir=str(tmp_path))


def test_each_pass_draws_every_image_once_and_the_processes_split_an_epoch():
    size, per, procs = 10, 3, 2  # 6 rows an epoch: passes of 10 wrap inside epochs 1 and 3
    rows = [[epoch_rows(e, size, per, procs, p, seed=5) for p in range(procs)] for e in range(5)]
    flat = [i for epoch in rows for part in epoch for i in part]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert flat[:10] != flat[10:20]  # each pass its own order
    assert rows == [[epoch_rows(e, size, per, procs, p, seed=5) for p in range(procs)] for e in range(5)]  # resumable
    assert flat[:10] != [i for e in range(2) for p in range(procs) for i in epoch_rows(e, size, per, procs, p, 6)][:10]


def test_an_image_is_resized_to_cover_and_center_cropped(tmp_path):
    """40 x 20 px to 16 x 16: scale 0.8 covers it (32 x 16, bilinear), then the middle 16 columns."""
    write_image(tmp_path / "wide.png", size=(40, 20))
    out = load_image(tmp_path / "wide.png", 16, 16)
    expected = Image.open(tmp_path / "wide.png").convert("RGB").resize((32, 16), Image.BILINEAR).crop((8, 0, 24, 16))
    assert out.shape == (3, 16, 16) and out.dtype == torch.float32
    torch.testing.assert_close(out, torch.from_numpy(np.asarray(expected, dtype=np.float32) / 255).permute(2, 0, 1))


def shapes_folder(root, count=8):
    """``count`` correctly drawn images of the embedded model's hard captions (the shapes data set's renderer)."""
    from ddpo_group.models import shapes_data

    rng, rows = np.random.default_rng(0), []
    root.mkdir(parents=True, exist_ok=True)
    for k in range(count):
        colour, shape, background = shapes_data.HARD_CAPTIONS[k % len(shapes_data.HARD_CAPTIONS)]
        size = rng.uniform(shapes_data.MIN_SIZE, shapes_data.MAX_SIZE, 1).astype(np.float32)
        centre = rng.uniform(size + 1, shapes_data.RESOLUTION - size - 1, (2, 1)).astype(np.float32)
        labels = np.array([shapes_data.attribute_labels(colour, shape, background)])
        image = shapes_data.render(labels, size, centre[0], centre[1])[0]
        Image.fromarray((image.transpose(1, 2, 0) * 255).round().astype(np.uint8)).save(root / f"{k}.png")
        rows.append({"file_name": f"{k}.png", "text": shapes_data.caption(colour, shape, background)})
    (root / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def test_the_record_holds_each_images_clean_latents_as_every_steps_state(tiny_model_dir, tmp_path):
    from helpers.trainer_helpers import tiny_config

    from ddpo_group.models.trainable import build_policy
    from ddpo_group.rollout.image_folder import ImageFolderRecords

    folder = shapes_folder(tmp_path / "data", count=6)
    config = tiny_config("grpo", tiny_model_dir, tmp_path, **{"sft.data_dir": str(folder), "sft.epochs": 1})
    family, _ = build_policy(config, "cpu")
    records = ImageFolderRecords(config, family, num_processes=2, process=1)
    batch = records.record(0)
    rows, steps = 8, config.sample.num_steps  # 4 x 2 rows a process
    picks = epoch_rows(0, 6, rows, 2, 1, config.seed)
    files = [records.rows[i] for i in picks]
    assert batch.prompts == [prompt for _, prompt, _ in files]
    height, width = family.height_width
    images = torch.stack([load_image(file, height, width) for file, _, _ in files])
    torch.testing.assert_close(batch.images, images)
    clean = family.clean_latents(images)
    assert batch.next_latents.shape == (rows, steps, *family.latent_shape())
    torch.testing.assert_close(batch.next_latents[:, -1], clean)
    torch.testing.assert_close(batch.latents[:, 0], clean)
    assert torch.equal(batch.advantages, torch.ones(rows, steps))
    schedule = family.schedule(steps, "cpu")["timesteps"]
    assert torch.equal(batch.times["timesteps"], schedule.expand(rows, steps))
    torch.testing.assert_close(batch.cond["prompt_embeds"], family.condition(batch.prompts)["prompt_embeds"])


@pytest.mark.slow
def test_a_run_fine_tunes_on_the_folder_then_by_reward_and_resumes_exactly(tiny_model_dir, tmp_path):
    """grpo with sft.epochs=2 of num_epochs=3: epochs 0 and 1 fit the folder's images (their matching loss falls, no
    reward is queried), epoch 2 is grpo's; a run resumed from epoch 0's checkpoint ends with the same weights."""
    from helpers.trainer_helpers import tiny_trainer

    folder = shapes_folder(tmp_path / "data")
    fields = {"sft.data_dir": str(folder), "sft.epochs": 2, "num_epochs": 3, "save_freq": 1,
              "prompt_fn": "tiny_shapes_hard", "train.learning_rate": 3e-3}
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "whole", **fields)
    start = [p.detach().clone() for p in trainer.updater.params]
    trainer.run()
    logged = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [("sft/policy_loss" in m, "reward_mean" in m) for m in logged] == [(True, False), (True, False),
                                                                          (False, True)]
    assert logged[0]["sft/kept"] == 1.0 and logged[1]["sft/policy_loss"] < logged[0]["sft/policy_loss"]
    assert logged[1]["global_step"] > logged[0]["global_step"] > 0 and logged[2]["global_step"] > logged[1]["global_step"]
    whole = [p.detach().clone() for p in trainer.updater.params]
    assert any(not torch.equal(a, b) for a, b in zip(start, whole))

    resumed = tiny_trainer("grpo", tiny_model_dir, tmp_path, "whole", **fields,
                           resume_from=str(tmp_path / "whole" / "checkpoints" / "checkpoint_00000"))
    resumed.run()
    for a, b in zip(whole, resumed.updater.params):
        assert torch.equal(a, b.detach())


def test_reinforcement_learning_starts_from_the_fine_tuned_policy(tiny_model_dir, tmp_path):
    """After the last supervised epoch the KL term's reference (a LoRA run's: an adapter) is the fine-tuned policy, as
    RLHF's reference is its SFT model; the supervised steps are counted apart (an old model's decay starts after
    them)."""
    from helpers.trainer_helpers import tiny_trainer

    from ddpo_group.reference.model import POLICY_ADAPTER, lora_layers

    folder = shapes_folder(tmp_path / "data")
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "handover",
                           **{"sft.data_dir": str(folder), "sft.epochs": 1, "num_epochs": 1,
                              "kl.beta": 0.01, "kl.use_reference_model": True})
    reference = trainer.kl.reference
    assert reference.mode == "adapter"
    metrics = trainer.run()
    model = trainer.accelerator.unwrap_model(trainer.model)
    layers = list(lora_layers(model, POLICY_ADAPTER))
    assert any(layer.lora_B[POLICY_ADAPTER].weight.abs().max() > 0 for layer in layers)  # the policy moved
    for layer in layers:
        for name in ("lora_A", "lora_B"):
            adapters = getattr(layer, name)
            assert torch.equal(adapters[reference.adapter_name].weight, adapters[POLICY_ADAPTER].weight)
    assert trainer.state.supervised_steps == metrics["global_step"] > 0


def test_the_critics_warm_up_counts_the_reinforcement_learning_epochs(tiny_model_dir, tmp_path):
    """ppo_gae with critic.warmup_epochs=1 after one supervised epoch: epoch 1 trains the critic only, the policy's
    optimizer steps are the supervised epoch's."""
    from helpers.trainer_helpers import tiny_trainer

    folder = shapes_folder(tmp_path / "data")
    trainer = tiny_trainer("ppo_gae", tiny_model_dir, tmp_path, "warmup",
                           **{"sft.data_dir": str(folder), "sft.epochs": 1, "num_epochs": 2,
                              "critic.warmup_epochs": 1})
    metrics = trainer.run()
    assert metrics["global_step"] == trainer.state.supervised_steps > 0 and "critic/value_loss" in metrics


def test_an_unreadable_image_is_refused_at_start(tmp_path):
    folder = metadata_folder(tmp_path, [{"file_name": "a.png", "text": "a cat"}])
    (folder / "a.png").write_bytes(b"not a png")
    with pytest.raises(ConfigError, match=r"a\.png is not an image PIL can read"):
        read_folder(folder)
