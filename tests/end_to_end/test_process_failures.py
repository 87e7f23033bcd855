"""One process failing stops them all (ddpo_group/run/processes/process_failures.py): 2 CPU workers over gloo, started one by one
as torchrun starts them on each machine of a multi-node run, so no launcher kills the healthy one for us. Only
process 1 fails, at epoch 1 (its reward raises, returns NaN, or its policy loss turns NaN, or its part of epoch 1's
checkpoint cannot be written); each worker must stop by itself, well within the subprocess timeout, with the exit code
of a failure (run/command/cli_errors.py), the main process naming the failed process and its cause, and the checkpoint of
epoch 0 must resume.
"""

from __future__ import annotations

import pytest

from ddpo_group.run.persistence.checkpointing import checkpoint_problem, complete_checkpoints
from ddpo_group.run.command.cli_errors import FAILURE
from helpers.launch_helpers import ROOT, launch_environment, start_workers
from helpers.trainer_helpers import MECHANICS

PLUGINS = ROOT / "tests" / "plugins"
TIMEOUT = 300  # the subprocess limit; a blocked worker would reach it (collective_timeout_s is far above it)
BOUND = 120  # seconds a worker may run in all: start-up, epoch 0 with its checkpoint, part of epoch 1 (measured: ~25 s)


def worker_args(model_dir, logdir, **extra) -> list[str]:
    """3 epochs of 2 reward calls per process (2 batches of 4 images), a checkpoint after each epoch."""
    values = {
        "pretrained.model": model_dir, "logdir": str(logdir), "run_name": "run", "num_epochs": 3, "save_freq": 1,
        "prompt_fn": "simple_animals", "reward_fn": f"{PLUGINS / 'rank_failing_reward.py'}:make",
        "sample.num_steps": 4, "sample.batch_size": 4, "sample.num_batches_per_epoch": 2, "train.batch_size": 4,
        "train.pairs_per_forward": 6, "train.learning_rate": 1e-2, "train.clip_range": 0.2,
        "per_prompt_stat_tracking.min_count": 2, "log_images_every": 0, **MECHANICS,
    }
    values.update(extra)
    return ["--config", "config/base.py:ddpo", *[f"--config.{k}={v}" for k, v in values.items()]]


def assert_every_worker_stopped(workers, *cause: str) -> None:
    for worker in workers:
        assert worker.returncode == FAILURE, f"rank {worker.rank}: exit {worker.returncode}, expected {FAILURE}\n" + \
            "".join(f"rank {w.rank}:\n{w.stderr[-3000:]}\n" for w in workers)
        assert worker.seconds < BOUND, f"rank {worker.rank} ran {worker.seconds:.0f} s"
    main = workers[0].stderr
    for fragment in cause:
        assert fragment in main, main[-3000:]
    assert "Traceback" not in main


def resume_one_epoch(model_dir, tmp_path, logs, **extra) -> None:
    """The kept checkpoint (epoch 0) resumes with both processes and trains epoch 1."""
    run = tmp_path / "run"
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == ["checkpoint_00000"]
    args = worker_args(model_dir, tmp_path, num_epochs=2, resume_from=str(run), **extra)
    workers = start_workers(args, 2, logs, launch_environment(), timeout=TIMEOUT)
    assert [w.returncode for w in workers] == [0, 0], workers[0].stderr[-3000:] + workers[1].stderr[-3000:]
    assert "resumed from" in workers[0].stdout and "checkpoint_00001" in workers[0].stdout


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["raise", "nan"])
def test_a_reward_failing_on_process_1_stops_both_processes(tiny_model_dir, tmp_path, mode):
    env = launch_environment(FAIL_REWARD_AT="2", FAIL_REWARD_RANK="1", FAIL_REWARD_MODE=mode)  # call 2: epoch 1
    workers = start_workers(worker_args(tiny_model_dir, tmp_path), 2, tmp_path / "logs", env, timeout=TIMEOUT)
    cause = "the scoring service refused call 2 on process 1" if mode == "raise" else "returned non-finite rewards"
    assert_every_worker_stopped(workers, "process 1 failed:", cause, "(epoch 0), is kept")
    assert cause in workers[1].stderr and "[ddpo_group rank 1] error:" in workers[1].stderr
    print({f"rank {w.rank} seconds": round(w.seconds, 1) for w in workers})
    resume_one_epoch(tiny_model_dir, tmp_path, tmp_path / "logs_resume")


@pytest.mark.slow
def test_a_non_finite_loss_on_process_1_stops_both_processes(tiny_model_dir, tmp_path):
    # epoch 0: 2 train batches of 16 (sample, step) pairs in chunks of 6, 6 loss calls: call 6 is epoch 1's first
    env = launch_environment(NAN_LOSS_FROM_CALL="6", NAN_LOSS_RANK="1")
    same = {"reward_fn": "jpeg_compressibility", "algorithm.policy_loss": f"{PLUGINS / 'nan_loss.py'}:nan_after"}
    args = worker_args(tiny_model_dir, tmp_path, **same)
    workers = start_workers(args, 2, tmp_path / "logs", env, timeout=TIMEOUT)
    # the gradients are all-reduced: process 0 sees the NaN as its gradient norm, process 1 as its loss
    assert_every_worker_stopped(workers, "non-finite grad_norm=nan in train batch 0 of inner epoch 0 at epoch 1")
    assert "non-finite policy_loss=nan in train batch 0 of inner epoch 0 at epoch 1" in workers[1].stderr
    print({f"rank {w.rank} seconds": round(w.seconds, 1) for w in workers})
    resume_one_epoch(tiny_model_dir, tmp_path, tmp_path / "logs_resume", **same)


@pytest.mark.slow
def test_a_process_that_hangs_stops_the_others_after_the_collective_timeout(tiny_model_dir, tmp_path):
    """The backstop: process 1 hangs in its reward (no error to share); process 0 waits at its next collective for
    collective_timeout_s, then stops with an error saying so. Process 1 would sleep 600 s: the launcher (torchrun)
    kills it once process 0 failed; here the test does, 2 s after process 0 exited."""
    env = launch_environment(FAIL_REWARD_AT="2", FAIL_REWARD_RANK="1", FAIL_REWARD_MODE="hang")
    args = worker_args(tiny_model_dir, tmp_path, collective_timeout_s=15)
    workers = start_workers(args, 2, tmp_path / "logs", env, timeout=TIMEOUT, grace_after_first_exit=2)
    main, hung = workers
    assert main.returncode == FAILURE, main.stderr[-3000:]
    assert "another process did not reach this point: it died, or it hung past collective_timeout_s" in main.stderr
    # start-up, epoch 0, then 15 s of waiting (measured: 24 s in all)
    assert main.seconds < 15 + BOUND and hung.returncode == -9
    print({"rank 0 seconds": round(main.seconds, 1)})


@pytest.mark.slow
def test_a_reward_server_killed_mid_run_stops_both_processes_and_the_run_resumes_once_it_is_back(tiny_model_dir,
                                                                                                   tmp_path):
    import json
    import re

    from test_cli_errors import environment, start_reward_server

    # 4 requests an epoch (2 processes x 2 batches): the server dies inside request 4, epoch 1's first
    server, line = start_reward_server(0, environment(DIE_REWARD_AT="4"))
    try:
        port = int(re.search(r"http://127\.0\.0\.1:(\d+) ", line).group(1))
        url = f"http://127.0.0.1:{port}/score"
        http = {"reward_fn": "http",
                "reward_fn_kwargs": json.dumps({"url": url, "retries": 1, "retry_backoff": 0.2, "timeout": 5})}
        workers = start_workers(worker_args(tiny_model_dir, tmp_path, **http), 2, tmp_path / "logs",
                                launch_environment(), timeout=TIMEOUT)
        assert server.wait(timeout=10) == -9  # SIGKILL: gone mid-request
    finally:
        server.kill()
    assert_every_worker_stopped(workers, f"reward server {url}: 2 attempts failed over ", "(epoch 0), is kept")
    for worker in workers:  # each process asked the dead server itself, or stopped with the one that did
        assert f"reward server {url}" in worker.stderr, worker.stderr[-3000:]
    print({f"rank {w.rank} seconds": round(w.seconds, 1) for w in workers})
    server, _ = start_reward_server(port, environment())
    try:
        resume_one_epoch(tiny_model_dir, tmp_path, tmp_path / "logs_resume", **http)
    finally:
        server.kill()


@pytest.mark.slow
def test_a_save_failing_on_process_1_stops_both_processes_at_that_save(tiny_model_dir, tmp_path):
    """Process 1's random states in epoch 1's checkpoint cannot be written (the file on /dev/full: the kernel's
    ENOSPC under torch.save). Both processes stop at that save, seconds apart, not at a barrier after
    collective_timeout_s (1800 s: the subprocess timeout would end them first); the unfinished checkpoint is removed and
    epoch 0's verifies, with both processes' parts."""
    env = launch_environment(WRITE_FAULTS_TRACE=str(tmp_path / "trace.txt"), WRITE_FAULTS_RANK="1",
                             WRITE_FAULTS_MATCH="random_states_1.pkl", WRITE_FAULTS_NTH="2", WRITE_FAULTS_DO="disk-full")
    args = worker_args(tiny_model_dir, tmp_path, reward_fn=f"{PLUGINS / 'write_faults.py'}:make")
    workers = start_workers(args, 2, tmp_path / "logs", env, timeout=TIMEOUT)
    cause = ".tmp_checkpoint_00001 (process 1's part of accelerate's state: its random states) could not be written"
    assert_every_worker_stopped(workers, f"process 1 failed: {tmp_path / 'run' / 'checkpoints'}/{cause}",
                                "checkpoint_00001 was not saved (its unfinished files are removed) (every process "
                                "stopped)", "(epoch 0), is kept")
    assert cause in workers[1].stderr and "[ddpo_group rank 1] error:" in workers[1].stderr
    assert abs(workers[0].seconds - workers[1].seconds) < 10, [w.seconds for w in workers]
    assert "random_states_1.pkl <- disk-full" in (tmp_path / "trace.txt").read_text()
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_00000"]  # nothing unfinished left
    assert checkpoint_problem(checkpoints / "checkpoint_00000") is None
    assert sorted(p.name for p in (checkpoints / "checkpoint_00000").glob("random_states_*")) == [
        "random_states_0.pkl", "random_states_1.pkl"]
    print({f"rank {w.rank} seconds": round(w.seconds, 1) for w in workers})
