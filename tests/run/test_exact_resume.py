"""Exact resume after a real SIGKILL, and a resumable checkpoint after SIGTERM (real training subprocesses).

Every run trains 4 epochs and checkpoints every 2 (epochs 1 and 3). The interrupted run's reward
(tests/plugins/hang_reward.py) hangs on a chosen call after writing a marker: the test waits for
the marker and signals the process, which is then sampling epoch 3, with epoch 2 trained and
logged but not checkpointed. After SIGKILL the resume starts from epoch 1 and runs epoch 2 again;
SIGTERM drops epoch 3, checkpoints epoch 2 and exits 143. Either way the resumed run must end with
the same bytes (and the same logged metrics) as a run that was never interrupted. ddpo and
group_ppo (critic, group-threshold controller) train LoRA; grpo trains the full UNet with a KL term
to a frozen reference copy; group_ppo@flux trains LoRA on the tiny FLUX model (flow-matching SDE steps,
the critic on packed latents); grpo@zimage trains the whole tiny Z-Image transformer with guidance (its list inputs,
the Qwen3 condition stored with its lengths) and a KL to a frozen copy; grpo@krea2 trains the whole tiny Krea 2
transformer (the condition [B, L, K, D] with its bool mask, two forwards of guidance) and grpo@sana_video the whole
tiny SANA-Video transformer (video latents, the state in float32, CFG in one batched forward) and grpo@ideogram4 the
whole tiny Ideogram 4 transformer (its guidance through the frozen unconditional transformer, the lengths of the
left-padded condition) and grpo@kandinsky6 the whole tiny Kandinsky 6 transformer (the video's and the audio's latents
one state) and grpo@hunyuan_image the whole tiny HunyuanImage 2.1 transformer (APG's momentum recorded with each
step) and grpo@cosmos3 the whole tiny Cosmos 3 transformer (token ids as its condition, one sample a forward), each
with a KL to a frozen copy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpo_group.run.persistence.state_files import read_states
from helpers.resume_helpers import assert_identical, comparable, load_everything, read_metrics

ROOT = Path(__file__).resolve().parents[2]
HANG_REWARD = f"{ROOT / 'tests' / 'plugins' / 'hang_reward.py'}:make"
EPOCHS, SAVE_FREQ = 4, 2
# 2 reward calls an epoch: call 7 is the last of epoch 3's sampling; when it hangs, the trainer has sampled
# every batch of epoch 3 and waits for that reward (no further stop check before it returns)
HANG_AT = 7


def train_command(case: str, model_dir: str, logdir: Path, run: str, **extra) -> list[str]:
    """The command of a case "preset", "preset@family" (the family's tiny-model settings added), "preset#adaptive"
    (tree rollouts of 4 leaves a root branching at steps 0 and 2, the branch steps adapted) or "preset+cuda".

    Runs are on the CPU, whose kernels are deterministic, unless the case says "+cuda": then on the GPU with
    config.deterministic=True (without it CUDA's atomic-add kernels make two runs of one seed part at once)."""
    from helpers.trainer_helpers import FAMILY_OVERRIDES, MECHANICS

    case, _, on = case.partition("+")
    case, _, shape = case.partition("#")
    preset, _, family = case.partition("@")
    values = {
        "pretrained.model": model_dir, "logdir": str(logdir), "run_name": run, "num_epochs": EPOCHS,
        "save_freq": SAVE_FREQ, "prompt_fn": "simple_animals", "reward_fn": HANG_REWARD, "sample.num_steps": 4,
        "sample.batch_size": 4, "sample.num_batches_per_epoch": 2, "train.batch_size": 4,
        "train.pairs_per_forward": 8, "train.learning_rate": 1e-2, "train.clip_range": 0.2,
        "per_prompt_stat_tracking.min_count": 2, "log_images_every": 0, "wandb.mode": "disabled", **MECHANICS,
    }
    if preset != "ddpo":
        values["train.group_size"] = 4
    if preset == "grpo":  # full fine-tuning: the reference is a frozen UNet copy, saved with the checkpoint; the KL
        # term on the prompts below their start (four captions, so that they come back; its gates' rewards resumed)
        values.update({"use_lora": False, "train.learning_rate": 1e-4, "prompt_fn": "tiny_shapes_hard",
                       "kl.only_below_start": True, "kl.start_window": 2})
    values.update(FAMILY_OVERRIDES[family or "sd"])
    if shape == "adaptive":  # tree rollouts, the second branch free to move either way
        values.update({"sample.branch_steps": "(0,2)", "sample.branch_factors": "(2,2)",
                       "sample.adaptive_branching": True})
    values.update({"device": "", "deterministic": True} if on == "cuda" else {"device": "cpu"})
    values.update(extra)
    return [sys.executable, "scripts/train.py", "--config", f"config/base.py:{preset}"] + [
        f"--config.{key}={value}" for key, value in values.items()
    ]


def environment(**extra) -> dict:
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("HANG_REWARD_AT", None)
    env.update(extra)
    return env


def start(command: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def finish(process: subprocess.Popen, log: Path, timeout: float = 300) -> str:
    process.wait(timeout=timeout)
    text = log.read_text()
    assert process.returncode == 0, f"training failed ({process.returncode}):\n{text[-5000:]}"
    return text


def wait_for(path: Path, process: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, f"training ended before {path.name}:\n{log.read_text()[-5000:]}"
        assert time.monotonic() < deadline, f"no {path} after {timeout}s"
        time.sleep(0.05)


def wandb_run_id(checkpoint: Path) -> str:
    for name, state in read_states(checkpoint):
        if name == "counters":
            return state["wandb_run_id"]
    raise AssertionError(f"no wandb_run_id in {checkpoint}")


_REFERENCE_RUNS: dict[str, Path] = {}


def interrupted_and_reference(preset: str, model_dir: str, tmp: Path, sig: int) -> tuple[Path, Path, subprocess.Popen, Path]:
    """Start the run signalled while sampling epoch 3, and train the never-interrupted run (once per preset) in this
    process (trainer_helpers.train_in_this_process: the same command line, a fresh Python's imports saved): while
    the signalled run hangs on its reward (SIGKILL), or before it starts (SIGTERM: its reward hangs 2 s only).

    Returns (reference run dir, interrupted run dir, the signalled process, its log).
    """
    from helpers.trainer_helpers import train_in_this_process

    name = preset.replace("@", "_").replace("#", "_")
    marker, run = tmp / f"{name}_{sig}.marker", f"{name}_signal{sig}"
    log = tmp / f"{run}.log"
    hang = environment(HANG_REWARD_AT=str(HANG_AT), HANG_REWARD_MARKER=str(marker),
                       HANG_REWARD_SECONDS="600" if sig == signal.SIGKILL else "2")
    command = train_command(preset, model_dir, tmp, run)
    process = start(command, hang, log) if sig == signal.SIGKILL else None
    if preset not in _REFERENCE_RUNS:
        train_in_this_process(train_command(preset, model_dir, tmp, f"{name}_reference")[2:])
        _REFERENCE_RUNS[preset] = tmp / f"{name}_reference"
    process = process or start(command, hang, log)
    wait_for(marker, process, log)
    process.send_signal(sig)
    return _REFERENCE_RUNS[preset], tmp / run, process, log


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    _REFERENCE_RUNS.clear()
    return tmp_path_factory.mktemp("exact_resume")


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["ddpo", "grpo", "group_ppo", "group_ppo@flux", "grpo@zimage", "grpo@krea2",
                                    "grpo@sana_video", "grpo@ideogram4", "grpo@kandinsky6",
                                    "grpo@hunyuan_image", "grpo@cosmos3", "group_ppo#adaptive",
                                    pytest.param("grpo+cuda", marks=pytest.mark.cuda),
                                    pytest.param("group_ppo+cuda", marks=pytest.mark.cuda)])
def test_sigkill_mid_epoch_then_resume_is_bitwise_identical(preset, family_model_dirs, runs_dir):
    model_dir = family_model_dirs[preset.partition("+")[0].partition("#")[0].partition("@")[2] or "sd"]
    reference, killed, process, log = interrupted_and_reference(preset, model_dir, runs_dir, signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    # killed in epoch 3: epoch 2 was logged but only epoch 1 is checkpointed
    assert [m["epoch"] for m in read_metrics(killed)] == [0, 1, 2]
    assert [p.name for p in sorted((killed / "checkpoints").glob("checkpoint_*"))] == ["checkpoint_00001"]
    first_id = wandb_run_id(killed / "checkpoints" / "checkpoint_00001")

    text = finish(start(train_command(preset, model_dir, runs_dir, killed.name, resume_from=killed),
                        environment(), log.with_suffix(".resume.log")), log.with_suffix(".resume.log"))
    assert "finished epoch 1" in text and "dropped 1 metrics line(s)" in text, text[-3000:]

    final = "checkpoints/checkpoint_00003"
    expected, got = load_everything(reference / final), load_everything(killed / final)
    assert sorted(expected) == sorted(got) and any(name.endswith(".safetensors") for name in got)
    assert_identical(expected, got, preset)
    assert wandb_run_id(killed / final) == first_id  # the resumed run logs to the same wandb run

    ref_metrics, resumed_metrics = read_metrics(reference), read_metrics(killed)
    assert [m["epoch"] for m in resumed_metrics] == [0, 1, 2, 3]  # each epoch once
    for a, b in zip(ref_metrics[2:], resumed_metrics[2:]):  # the epochs run after the resume
        assert json.dumps(comparable(a), sort_keys=True) == json.dumps(comparable(b), sort_keys=True)
    assert ref_metrics[3]["global_step"] == resumed_metrics[3]["global_step"] > ref_metrics[1]["global_step"]


@pytest.mark.slow
def test_sigterm_while_sampling_drops_the_epoch_checkpoints_the_last_one_and_resumes_exactly(tiny_model_dir, runs_dir):
    reference, stopped, process, log = interrupted_and_reference("ddpo", tiny_model_dir, runs_dir, signal.SIGTERM)
    assert process.wait(timeout=120) == 128 + signal.SIGTERM
    text = log.read_text()
    assert "received SIGTERM: stopping cleanly" in text, text[-3000:]
    assert "training stopped by SIGTERM while sampling epoch 3; the epoch was dropped before any update" in text
    assert f"--config.resume_from={stopped}" in text
    # epoch 2 (trained, not yet checkpointed with save_freq=2) is checkpointed now; epoch 3 left no trace
    assert [m["epoch"] for m in read_metrics(stopped)] == [0, 1, 2]
    checkpoints = sorted((stopped / "checkpoints").glob("checkpoint_*"))
    assert [p.name for p in checkpoints] == ["checkpoint_00001", "checkpoint_00002"]
    assert (checkpoints[-1] / "COMPLETE").exists() and not list((stopped / "checkpoints").glob(".*"))

    resumed_log = log.with_suffix(".resume.log")
    text = finish(start(train_command("ddpo", tiny_model_dir, runs_dir, stopped.name, resume_from=stopped),
                        environment(), resumed_log), resumed_log)
    assert "finished epoch 2" in text and "dropped" not in text
    final = "checkpoints/checkpoint_00003"
    assert_identical(load_everything(reference / final), load_everything(stopped / final), "sigterm")
    assert comparable(read_metrics(reference)[3]) == comparable(read_metrics(stopped)[3])


@pytest.mark.slow
def test_a_second_sigterm_stops_at_once_even_with_a_hung_reward(tiny_model_dir, runs_dir):
    run, marker = "ddpo_twice", runs_dir / "twice.marker"
    log = runs_dir / f"{run}.log"
    env = environment(HANG_REWARD_AT=str(HANG_AT), HANG_REWARD_MARKER=str(marker), HANG_REWARD_SECONDS="600")
    process = start(train_command("ddpo", tiny_model_dir, runs_dir, run), env, log)
    wait_for(marker, process, log)
    process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert process.poll() is None  # the first signal waits for a clean point (the reward still hangs)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 128 + signal.SIGTERM  # not the 600 s of the hung reward call
    text = log.read_text()
    assert "training stopped at once by a second SIGTERM; no checkpoint of the unfinished epoch was written" in text
    assert f"--config.resume_from={runs_dir / run}" in text
    assert [p.name for p in sorted((runs_dir / run / "checkpoints").glob("checkpoint_*"))] == ["checkpoint_00001"]
    assert (runs_dir / run / "checkpoints" / "checkpoint_00001" / "COMPLETE").exists()


@pytest.mark.slow
def test_evaluation_and_ema_after_sigkill_and_resume_are_bitwise_those_of_an_uninterrupted_run(tiny_model_dir, tmp_path):
    """Evaluations before the first update and after epochs 1 and 3 (eval_freq=2), with the EMA weights (train.ema,
    updated every 2 optimizer steps, exported to the checkpoints' lora/): killed while sampling epoch 3 and resumed
    from epoch 1's checkpoint, the run must evaluate and save exactly as a run never stopped."""
    extra = {"eval_freq": 2, "eval_num_prompts": 2, "eval_num_seeds": 2, "train.ema": True,
             "train.ema_update_interval": 2, "train.ema_export": True}
    # reward calls (4 eval rows = one batch): eval before 0; epoch 0: 1, 2; epoch 1: 3, 4, its eval 5; epoch 2: 6, 7;
    # epoch 3: 8, 9 (the last sampling batch: hang there), then its eval 10
    from helpers.trainer_helpers import train_in_this_process

    killed_log, marker = tmp_path / "killed.log", tmp_path / "eval.marker"
    hang = environment(HANG_REWARD_AT="9", HANG_REWARD_MARKER=str(marker), HANG_REWARD_SECONDS="600")
    process = start(train_command("ddpo", tiny_model_dir, tmp_path, "killed", **extra), hang, killed_log)
    train_in_this_process(train_command("ddpo", tiny_model_dir, tmp_path, "reference", **extra)[2:])  # meanwhile
    wait_for(marker, process, killed_log)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    killed = tmp_path / "killed"
    assert [m["epoch"] for m in read_metrics(killed)] == [0, 1, 2]
    assert [json.loads(line)["epoch"] for line in (killed / "eval.jsonl").read_text().splitlines()] == [-1, 1]

    resumed_log = tmp_path / "resumed.log"
    finish(start(train_command("ddpo", tiny_model_dir, tmp_path, "killed", resume_from=killed, **extra),
                 environment(), resumed_log), resumed_log)
    final = "checkpoints/checkpoint_00003"
    expected, got = load_everything(tmp_path / "reference" / final), load_everything(killed / final)
    assert sorted(expected) == sorted(got) and any(name.startswith("lora/") for name in got)
    assert_identical(expected, got, "eval+ema")
    evaluations = [(tmp_path / run / "eval.jsonl").read_text() for run in ("reference", "killed")]
    assert evaluations[0] == evaluations[1]  # every evaluation, the one after the resume included, to the bit
    records = [json.loads(line) for line in evaluations[0].splitlines()]
    assert [(r["epoch"], r["weights"], r["eval/num_images"]) for r in records] == [(-1, "ema", 4), (1, "ema", 4),
                                                                                  (3, "ema", 4)]
    ref_metrics, resumed_metrics = read_metrics(tmp_path / "reference"), read_metrics(killed)
    for a, b in zip(ref_metrics[2:], resumed_metrics[2:]):
        assert json.dumps(comparable(a), sort_keys=True) == json.dumps(comparable(b), sort_keys=True)
    assert resumed_metrics[3]["eval/reward_mean"] == records[2]["eval/reward_mean"]
    assert resumed_metrics[3]["ema/updates"] == resumed_metrics[3]["global_step"] // 2 > 0
