"""Ten SIGKILLs at random moments of one run with a checkpoint every epoch, each followed by a resume from the run
directory: the run ends with the weights and the metrics of a run that was never killed.

The moments: the reward plugin tests/plugins/write_faults.py numbers the events of a training process (reward calls,
optimizer steps, metrics lines, every file a checkpoint writes, its renames and removals) and kills the process at one
of them, before it or in the middle of its write. The i-th kill is drawn (seeded) among the events of the i-th tenth of
the run, as the never-killed run counted them, so the kills cover the run from its first epoch to its last. A quarter
of the kills come instead at a random time of the start (imports, model loading, the resume), where no event is (at
the latest at its first event).
"""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import pytest

from ddpo_group.run.persistence.checkpointing import CHECKPOINT_PATTERN, checkpoint_problem, complete_checkpoints
from ddpo_group.run.persistence.metrics_log import read_metrics
from helpers.resume_helpers import assert_identical, comparable, load_everything
from test_exact_resume import environment, finish, start, train_command

WRITE_FAULTS = f"{Path(__file__).resolve().parents[1] / 'plugins' / 'write_faults.py'}:make"
KILLS, EPOCHS, SEED = 10, 6, 2024
TIMED_KILLS = 0.25  # the share of kills at a random time of the start


def command(model_dir: str, logdir: Path, run: str, **extra) -> list[str]:
    return train_command("ddpo", model_dir, logdir, run, num_epochs=EPOCHS, save_freq=1, reward_fn=WRITE_FAULTS,
                         **extra)


def read_trace(path: Path) -> list[tuple[float, str]]:
    """(time, event) of each line of a trace: ``<time> <number> <event>``."""
    if not path.exists():
        return []
    lines = [line.split(" ", 2) for line in path.read_text().splitlines()]
    return [(float(when), event) for when, _, event in lines]


def events_until_checkpoint(trace: list[tuple[float, str]], epoch: int) -> int:
    """How many events of the never-killed run came up to the rename of the checkpoint of ``epoch`` into place."""
    if epoch < 0:
        return 0
    renamed = f".tmp_checkpoint_{epoch:05d} "
    return 1 + next(i for i, (_, event) in enumerate(trace) if event.startswith("replace") and renamed in event + " ")


def newest_epoch(run: Path) -> int:
    checkpoints = complete_checkpoints(run / "checkpoints")
    return int(CHECKPOINT_PATTERN.match(checkpoints[-1].name).group(1)) if checkpoints else -1


@pytest.mark.slow
def test_ten_sigkills_at_random_moments_each_resumed_end_as_a_run_never_killed(tiny_model_dir, tmp_path):
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    began = time.time()
    finish(start(command(tiny_model_dir, tmp_path, "reference"),
                 environment(WRITE_FAULTS_TRACE=str(tmp_path / "reference.trace")), tmp_path / "reference.log"),
           tmp_path / "reference.log")
    never_killed = time.time() - began
    reference_trace = read_trace(tmp_path / "reference.trace")
    start_up = reference_trace[0][0] - began  # seconds from the process start to its first event

    rng = random.Random(SEED)
    kills, seconds = [], []
    attempt = 0
    while True:
        epoch = newest_epoch(killed)
        resume = {"resume_from": killed} if epoch >= 0 else {}  # no checkpoint yet: the run starts again
        trace, log = tmp_path / f"attempt{attempt}.trace", tmp_path / f"attempt{attempt}.log"
        env = environment(WRITE_FAULTS_TRACE=str(trace))
        delay = None
        if len(kills) < KILLS:
            if rng.random() < TIMED_KILLS:
                delay = rng.uniform(0, start_up)
            else:
                # a moment of the run's k-th tenth (as the never-killed run counted its events), from where it resumes
                tenth = len(reference_trace) / KILLS
                moment = rng.randint(int(len(kills) * tenth) + 1, int((len(kills) + 1) * tenth))
                env.update(WRITE_FAULTS_AT=str(max(1, moment - events_until_checkpoint(reference_trace, epoch))),
                           WRITE_FAULTS_DO=rng.choice(["kill", "kill-mid"]))
        began = time.perf_counter()
        process = start(command(tiny_model_dir, tmp_path, "killed", **resume), env, log)
        if delay is not None:  # at the drawn time of the start, or at its first event if that comes sooner (a start
            # faster than the never-killed run's, which ran beside another test, must not outrun the kill)
            deadline = time.perf_counter() + delay
            while process.poll() is None and time.perf_counter() < deadline and not read_trace(trace):
                time.sleep(0.02)
            process.send_signal(signal.SIGKILL)
        code = process.wait(timeout=300)
        seconds.append(time.perf_counter() - began)
        text = log.read_text()
        if "resumed from" in text:  # each resume starts from the newest checkpoint that verifies
            assert f"resumed from {killed}/checkpoints/checkpoint_{epoch:05d} (finished epoch {epoch})" in text, text
        if code == 0:
            break
        assert code == -signal.SIGKILL and len(kills) < KILLS, f"attempt {attempt} ended with {code}:\n{text[-3000:]}"
        events = read_trace(trace)
        landed = next((event for _, event in reversed(events) if event.endswith(("<- kill", "<- kill-mid"))), None)
        if landed is None:  # a timed kill
            landed = f"at {delay:.1f} s, " + (f"after {events[-1][1]}" if events else "before the first event")
        kills.append((epoch, landed.replace(f"{killed}/", ""), "/checkpoints/" in landed))
        attempt += 1

    in_save = sum(saving for _, _, saving in kills)
    print(f"\n{len(kills)} kills ({in_save} inside a checkpoint save), {attempt + 1} attempts in {sum(seconds):.0f} s "
          f"({sum(seconds) / len(seconds):.1f} s each, the last {seconds[-1]:.1f} s); the run never killed: "
          f"{never_killed:.1f} s")
    for epoch, landed, saving in kills:
        print(f"  from checkpoint {epoch}: killed {landed}{' (in a save)' if saving else ''}")
    assert len(kills) == KILLS

    final = f"checkpoints/checkpoint_{EPOCHS - 1:05d}"
    expected, got = load_everything(reference / final), load_everything(killed / final)
    assert sorted(expected) == sorted(got) and any(name.endswith(".safetensors") for name in got)
    assert_identical(expected, got, "final checkpoint")
    assert_identical(load_everything(reference / "lora"), load_everything(killed / "lora"), "exported LoRA")
    assert [p.name for p in complete_checkpoints(killed / "checkpoints")] == \
        [p.name for p in complete_checkpoints(reference / "checkpoints")]
    assert all(checkpoint_problem(p) is None for p in complete_checkpoints(killed / "checkpoints"))
    ref_metrics, killed_metrics = read_metrics(reference / "metrics.jsonl"), read_metrics(killed / "metrics.jsonl")
    assert [m["epoch"] for m in killed_metrics] == list(range(EPOCHS))
    for a, b in zip(ref_metrics, killed_metrics):  # as JSON: a NaN metric equals itself
        assert json.dumps(comparable(a), sort_keys=True) == json.dumps(comparable(b), sort_keys=True)
