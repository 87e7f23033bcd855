"""A real wandb run, in offline mode, read back with wandb's own reader of its transaction log (``wandb leet inspect
--json``: wandb-core's reader of the run's .wandb file, which ``wandb sync`` replays): the history holds every epoch's
metrics as metrics.jsonl has them, each epoch's sample grid, each evaluation's grid (the one before training too) and,
on a family with audio (LTX-2), each evaluation's rows' audio. Nothing goes online, and every file wandb writes stays
under tmp_path."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ddpo_group.run.persistence.metrics_log import read_metrics
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_trainer

OFFLINE = {"wandb.mode": "offline", "log_images_every": 1, "eval_freq": 1, "eval_num_prompts": 2, "device": "cpu"}


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """wandb offline (conftest.py sets WANDB_MODE=disabled for the suite), its own folders under tmp_path; the service
    process the run started is stopped afterwards."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        folder = tmp_path / "wandb_home" / name.lower()
        folder.mkdir(parents=True)
        monkeypatch.setenv(name, str(folder))
    yield
    import wandb

    wandb.teardown()


def read_offline_run(run_dir: Path, summary: dict | None = None) -> tuple[Path, dict[int, dict]]:
    """The offline run's folder in ``run_dir`` and {step: history row} of its .wandb transaction log, read by wandb's
    own reader (records as JSON lines); the run ended with exit code 0. ``summary``: filled with the run summary's
    updates."""
    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "WANDB_MODE": "offline"})
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [0]
    rows = [r["history"]["item"] for r in records if r["type"] == "history"]
    for record in records:
        if record["type"] == "summary" and summary is not None:
            summary.update(record["summary"].get("update", {}))
    history = {row["_step"]: row for row in rows}
    assert len(history) == len(rows), "a step logged in two history rows"
    return log.parent, history


def same_value(logged, value) -> bool:
    return (isinstance(value, float) and math.isnan(value) and logged == "NaN") or logged == value


def assert_the_media_file(run_files: Path, row: dict, key: str, kind: str, local: Path) -> None:
    """History entry ``key`` is a wandb media file of ``kind`` whose content is the run's own file ``local``: the same
    pixels for an image, the same bytes for audio."""
    assert row[f"{key}._type"] == kind, key
    logged = run_files / "files" / row[f"{key}.path"]
    if kind == "image-file":
        assert (row[f"{key}.width"], row[f"{key}.height"]) == Image.open(local).size
        assert np.array_equal(np.asarray(Image.open(logged)), np.asarray(Image.open(local))), key
    else:
        assert logged.read_bytes() == local.read_bytes(), key


def test_the_history_holds_the_metrics_the_grids_and_the_evaluations(offline_wandb, tiny_model_dir, tmp_path):
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "run", num_epochs=2, eval_num_seeds=2,
                           final_eval_num_seeds=2, **OFFLINE)
    assert trainer.session.wandb_mode == "offline"
    trainer.run()
    run_dir = tmp_path / "run"
    summary = {}
    run_files, history = read_offline_run(run_dir, summary)
    # the run summary: the verdict and the fresh final evaluation's numbers, as summary.json has them
    record = json.loads((run_dir / "summary.json").read_text())
    assert summary.get("verdict") == record["verdict"] and summary.get("verdict_why") == record["why"]
    assert summary.get("fresh/reward/final/change") == record["fresh"]["reward"]["final"]["change"]
    assert sorted(history) == [0, 1]  # a row an epoch, at step = epoch
    epochs = read_metrics(run_dir / "metrics.jsonl")
    assert [record["epoch"] for record in epochs] == [0, 1]
    for record in epochs:
        row = history[record["epoch"]]
        assert {"reward_mean", "train/policy_loss", "train/grad_norm", "eval/reward_mean"} <= set(record)
        different = {key: (row.get(key), value) for key, value in record.items() if not same_value(row.get(key), value)}
        assert different == {}, f"epoch {record['epoch']}: (wandb's, metrics.jsonl's) {different}"
        samples = run_dir / "samples"
        assert_the_media_file(run_files, row, "images", "image-file", samples / f"epoch_{record['epoch']:05d}.png")
        assert_the_media_file(run_files, row, "eval/images", "image-file",
                              samples / f"eval_epoch_{record['epoch']:05d}.png")
    # the evaluation before training: its metrics as eval_before/* and its grid, at step 0
    before = read_metrics(run_dir / "eval.jsonl")[0]
    assert before["epoch"] == -1 and before["eval/num_images"] == 4
    values = {"eval_before" + key[len("eval"):]: value for key, value in before.items() if key.startswith("eval")}
    assert {key: history[0][key] for key in values} == values
    assert_the_media_file(run_files, history[0], "eval_before/images", "image-file", run_dir / "samples" / "eval_before.png")


def test_an_evaluations_audio_is_logged_beside_its_grid(offline_wandb, family_model_dirs, tmp_path):
    """LTX-2: each evaluation's rows' WAV files (samples/<evaluation>/row_<r>.wav) are the history's
    <prefix>/audio/row_<r> clips, byte for byte, beside the grid and the audio's statistics."""
    trainer = tiny_trainer("grpo", family_model_dirs["ltx2"], tmp_path, "audio", eval_num_seeds=1,
                           reward_fn="tests/plugins/audio_reward.py:make_loudness", **FAMILY_OVERRIDES["ltx2"],
                           **OFFLINE)
    trainer.run()
    run_dir = tmp_path / "audio"
    run_files, history = read_offline_run(run_dir)
    assert sorted(history) == [0]
    row = history[0]
    for prefix, stem in (("eval_before", "eval_before"), ("eval", "eval_epoch_00000")):
        assert_the_media_file(run_files, row, f"{prefix}/images", "image-file", run_dir / "samples" / f"{stem}.png")
        wavs = sorted((run_dir / "samples" / stem).glob("row_*.wav"))
        assert [path.name for path in wavs] == ["row_00.wav", "row_01.wav"]  # 2 prompts x 1 seed
        for r, wav in enumerate(wavs):
            assert_the_media_file(run_files, row, f"{prefix}/audio/row_{r:02d}", "audio-file", wav)
            assert row[f"{prefix}/audio/row_{r:02d}.caption"] == f"row {r}"
        assert row[f"{prefix}/audio/level"] > 0
    assert row["eval/audio/level"] == read_metrics(run_dir / "metrics.jsonl")[0]["eval/audio/level"]
