"""What a person sees when a run does not finish: scripts/train.py run as a command, one case per kind of stop.

Every case checks the last lines of stderr (the message, and for a stop after training started the kept checkpoint
and the resume command), that no traceback is printed unless DDPO_GROUP_TRACEBACK is set, and the exit code of
ddpo_group/run/command/cli_errors.py: 2 usage error, 1 failure while training, 130 Ctrl-C. The last test records what
accelerate's own launcher adds on top.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpo_group.run.command.cli_errors import FAILURE, USAGE_ERROR
from helpers.trainer_helpers import MECHANICS

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "tests" / "plugins"


def environment(**extra) -> dict:
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for name in ("DDPO_GROUP_TRACEBACK", "FAIL_REWARD_AT", "NAN_LOSS_FROM_CALL", "HANG_REWARD_AT", "DIE_REWARD_AT",
                 "DDPO_REWARD_TOKEN"):
        env.pop(name, None)
    env.update(extra)
    return env


def tiny_args(model_dir, logdir, run_name: str = "run", **extra) -> list[str]:
    """Four-step sampling of 2 batches of 4 images an epoch on the tiny random model: 2 reward calls an epoch."""
    values = {
        "pretrained.model": model_dir, "logdir": str(logdir), "run_name": run_name, "num_epochs": 4, "save_freq": 2,
        "prompt_fn": "simple_animals", "reward_fn": f"{PLUGINS / 'failing_reward.py'}:make", "sample.num_steps": 4,
        "sample.batch_size": 4, "sample.num_batches_per_epoch": 2, "train.batch_size": 4,
        "train.pairs_per_forward": 6, "train.learning_rate": 1e-2, "train.clip_range": 0.2,
        "per_prompt_stat_tracking.min_count": 2, "log_images_every": 0, **MECHANICS,
    }
    values.update(extra)
    return [f"--config.{key}={value}" for key, value in values.items()]


def train(args: list[str], env: dict | None = None, preset: str = "ddpo", timeout: float = 300):
    command = [sys.executable, "scripts/train.py", "--config", f"config/base.py:{preset}", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env or environment())


def last_lines(stderr: str, n: int) -> list[str]:
    """The last ``n`` non-blank lines a terminal shows: progress bars redraw with carriage returns."""
    return [line for line in re.split(r"[\r\n]", stderr) if line.strip()][-n:]


def assert_reported(out, code: int, *expected: str, lines: int = 3) -> str:
    """Exit ``code``, no traceback, and every ``expected`` fragment within the last ``lines`` lines of stderr."""
    assert out.returncode == code, f"exit {out.returncode}, expected {code}\n{out.stderr[-3000:]}"
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    tail = "\n".join(last_lines(out.stderr, lines))
    for fragment in expected:
        assert fragment in tail, f"{fragment!r} not in the last {lines} lines:\n{tail}"
    assert tail.endswith("(set DDPO_GROUP_TRACEBACK=1 to see the traceback)") or code == 130, tail
    return tail


# ---------------------------------------------------------------- usage errors: the run does not start
def test_an_unknown_preset_names_the_valid_ones():
    out = train([], preset="nope")
    from config.base import PRESETS
    from config.recipes import RECIPES

    valid = ", ".join(sorted({**PRESETS, **RECIPES}))
    assert len(valid.split(", ")) > 12  # the presets and the recipes
    assert_reported(out, USAGE_ERROR, "[ddpo_group] error: flag --config=config/base.py:nope: unknown preset 'nope'; "
                                      f"valid presets: {valid}")


def test_an_unknown_field_names_the_override_and_the_suggestion():
    out = train(["--config.train.learnin_rate=1e-3"])
    assert_reported(out, USAGE_ERROR, "[ddpo_group] error: --config.train.learnin_rate=1e-3: the config has no field "
                                      "'learnin_rate'; did you mean 'learning_rate'?")
    assert len(last_lines(out.stderr, 100)) == 2  # the message and the hint, nothing else


def test_the_traceback_switch_prints_the_traceback_above_the_message():
    out = train(["--config.train.learnin_rate=1e-3"], environment(DDPO_GROUP_TRACEBACK="1"))
    assert out.returncode == USAGE_ERROR
    assert "Traceback (most recent call last)" in out.stderr
    assert last_lines(out.stderr, 1) == ["[ddpo_group] error: --config.train.learnin_rate=1e-3: the config has no "
                                         "field 'learnin_rate'; did you mean 'learning_rate'?"]


@pytest.mark.slow
def test_contradictions_and_a_missing_model_are_usage_errors(tmp_path):
    out = train(["--config.sample.noise_level=0", "--config.train.batch_size=7", f"--config.logdir={tmp_path}"])
    assert_reported(out, USAGE_ERROR, "[ddpo_group] error: invalid config:", "sample.noise_level=0.0 must be > 0",
                    "train.batch_size=7 must divide the samples per process per epoch", lines=4)
    missing = tmp_path / "no_such_model"
    out = train([f"--config.pretrained.model={missing}", f"--config.logdir={tmp_path}"])
    assert_reported(out, USAGE_ERROR, f"[ddpo_group] error: pretrained.model='{missing}': no such directory")
    assert not list(tmp_path.iterdir())  # no run directory


# ---------------------------------------------------------------- failures while training
@pytest.mark.slow
def test_a_reward_failure_after_some_epochs_names_the_kept_checkpoint_and_the_resume_command(tiny_model_dir,
                                                                                             tmp_path):
    # calls 0-1 epoch 0, 2-3 epoch 1 (checkpointed: save_freq 2), 4-5 epoch 2, call 6 is epoch 3's first batch
    out = train(tiny_args(tiny_model_dir, tmp_path), environment(FAIL_REWARD_AT="6"))
    run = tmp_path / "run"
    assert_reported(
        out, FAILURE,
        "raised ValueError: the scoring service refused call 6",
        f"The last complete checkpoint, {run / 'checkpoints' / 'checkpoint_00001'} (epoch 1), is kept. "
        "Epoch 2 finished after it and runs again on resume. Resume with: python scripts/train.py --config "
        "config/base.py:ddpo ",
    )
    # the command it prints works as pasted: the run continues at epoch 2 and finishes
    (line,) = [line for line in out.stderr.splitlines() if "Resume with: " in line]
    pasted = shlex.split(line.split("Resume with: ")[1].split(" (it continues")[0])
    assert pasted[:2] == ["python", "scripts/train.py"] and pasted[-1] == f"--config.resume_from={run}"
    assert tiny_args(tiny_model_dir, tmp_path)[0] in pasted  # the overrides given are in it
    resumed = subprocess.run([sys.executable, *pasted[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env=environment())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "for epochs 2..3" in resumed.stdout


@pytest.mark.slow
def test_a_non_finite_loss_is_a_failure_naming_the_epoch_and_the_kept_checkpoint(tiny_model_dir, tmp_path):
    # 8 samples x 4 steps = 32 pairs an epoch, 2 train batches of 16 pairs, 6 per forward: 3 loss calls a batch,
    # 6 an epoch; call 12 is epoch 2's first
    args = tiny_args(tiny_model_dir, tmp_path, reward_fn="jpeg_compressibility",
                     **{"algorithm.policy_loss": f"{PLUGINS / 'nan_loss.py'}:nan_after"})
    out = train(args, environment(NAN_LOSS_FROM_CALL="12"))
    checkpoint = tmp_path / "run" / "checkpoints" / "checkpoint_00001"
    assert_reported(out, FAILURE, "non-finite policy_loss=nan in train batch 0 of inner epoch 0 at epoch 2",
                    f"The last complete checkpoint, {checkpoint} (epoch 1), is kept.")


@pytest.mark.slow
def test_a_failure_in_the_first_epoch_leaves_no_run_directory(tiny_model_dir, tmp_path):
    out = train(tiny_args(tiny_model_dir, tmp_path), environment(FAIL_REWARD_AT="0"))
    assert_reported(out, FAILURE, "refused call 0",
                    f"No epoch had finished, so the run directory {tmp_path / 'run'} was removed")
    assert not (tmp_path / "run").exists()


def start_reward_server(port: int, env: dict) -> tuple[subprocess.Popen, str]:
    """``python -m ddpo_group.rewards.http_server`` serving tests/plugins/dying_reward.py on ``port`` (0: any), and
    the first line it prints, once it serves."""
    command = [sys.executable, "-m", "ddpo_group.rewards.http_server", "--reward_fn",
               f"{PLUGINS / 'dying_reward.py'}:make", "--port", str(port)]
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready, _, _ = select.select([server.stdout], [], [], 120)
    line = server.stdout.readline() if ready else ""
    if not line.startswith("serving "):
        server.kill()
        raise AssertionError(f"the reward server did not start: {line!r} {server.communicate()[1][-3000:]}")
    return server, line


@pytest.mark.slow
def test_an_http_reward_server_killed_mid_run_stops_the_run_which_resumes_once_it_is_back(tiny_model_dir, tmp_path):
    token = "tok-e2e-7d41c9"
    server, line = start_reward_server(0, environment(DDPO_REWARD_TOKEN=token, DIE_REWARD_AT="4"))
    try:
        port = int(re.search(r"http://127\.0\.0\.1:(\d+) ", line).group(1))
        assert "requests need the token of $DDPO_REWARD_TOKEN" in line and token not in line
        url = f"http://127.0.0.1:{port}/score"
        kwargs = json.dumps({"url": url, "retries": 2, "retry_backoff": 0.2, "timeout": 5})
        args = tiny_args(tiny_model_dir, tmp_path, reward_fn="http", reward_fn_kwargs=kwargs)
        # calls 0-1 epoch 0, 2-3 epoch 1 (checkpointed: save_freq 2); the server dies inside call 4 (epoch 2)
        started = time.monotonic()
        out = train(args, environment(DDPO_REWARD_TOKEN=token))
        try:
            assert server.wait(timeout=10) == -signal.SIGKILL
        except subprocess.TimeoutExpired:  # the run ended before call 4: say how
            raise AssertionError(f"the server is alive after the run (exit {out.returncode}): {out.stderr[-3000:]}")
    finally:
        server.kill()
    run = tmp_path / "run"
    tail = assert_reported(
        out, FAILURE,
        f"reward function 'http' raised RewardServerUnavailable: reward server {url}: 3 attempts failed over ",
        "not reachable", "is it running?",
        f"The last complete checkpoint, {run / 'checkpoints' / 'checkpoint_00001'} (epoch 1), is kept.",
    )
    seconds = float(re.search(r"3 attempts failed over (\S+) s", tail).group(1))
    assert 0.6 <= seconds < 5, tail  # the two backoffs (0.2 + 0.4 s); the refused attempts do not wait for the timeout
    assert "raised on batch indices" not in tail and "on no single image" not in tail  # not asked image by image
    assert time.monotonic() - started < 240
    for text in (out.stdout, out.stderr, (run / "config.json").read_text()):
        assert token not in text
    assert json.loads((run / "config.json").read_text())["reward_fn_kwargs"] == json.loads(kwargs)

    # the server back on its port: the pasted resume command finishes the run
    (resume_line,) = [line for line in out.stderr.splitlines() if "Resume with: " in line]
    pasted = shlex.split(resume_line.split("Resume with: ")[1].split(" (it continues")[0])
    server, _ = start_reward_server(port, environment(DDPO_REWARD_TOKEN=token))
    try:
        resumed = subprocess.run([sys.executable, *pasted[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300,
                                 env=environment(DDPO_REWARD_TOKEN=token))
    finally:
        server.kill()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "for epochs 2..3" in resumed.stdout
    assert "checkpoint_00003" in [p.name for p in (run / "checkpoints").iterdir()]


# ---------------------------------------------------------------- interrupts
@pytest.mark.slow
def test_ctrl_c_stops_cleanly_with_130_the_checkpoint_and_the_resume_command(tiny_model_dir, tmp_path):
    marker = tmp_path / "hang.marker"
    env = environment(HANG_REWARD_AT="4", HANG_REWARD_MARKER=str(marker), HANG_REWARD_SECONDS="2")
    args = tiny_args(tiny_model_dir, tmp_path, reward_fn=f"{PLUGINS / 'hang_reward.py'}:make")
    command = [sys.executable, "scripts/train.py", "--config", "config/base.py:ddpo", *args]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not marker.exists():  # call 4: epoch 2 is sampling, epoch 1 is checkpointed
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=300)
    out = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    run = tmp_path / "run"
    assert_reported(out, 128 + signal.SIGINT,
                    "[ddpo_group] training stopped by SIGINT while sampling epoch 2; the epoch was dropped",
                    f"checkpoint {run / 'checkpoints' / 'checkpoint_00001'} (epoch 1). Resume with: python "
                    "scripts/train.py --config config/base.py:ddpo", lines=1)


# ---------------------------------------------------------------- under accelerate launch
@pytest.mark.slow
def test_accelerate_launch_adds_its_own_traceback_and_exit_code_1_and_quiet_drops_the_traceback():
    """What remains under the launcher (accelerate/commands/launch.py, simple_launcher): a child that exits non-zero
    makes it raise CalledProcessError (a traceback after our message, exit 1); with --quiet it exits 1 silently.
    Either way the child's exit code is not passed on. This test records that, so the README stays true."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no"]
    script = ["scripts/train.py", "--config", "config/base.py:ddpo", "--config.train.learnin_rate=1e-3"]
    loud = subprocess.run(launch + script, cwd=ROOT, capture_output=True, text=True, timeout=300, env=environment())
    assert loud.returncode == 1
    ours = "the config has no field 'learnin_rate'; did you mean 'learning_rate'?"
    assert ours in loud.stderr and loud.stderr.index(ours) < loud.stderr.index("Traceback")
    assert last_lines(loud.stderr, 1)[0].startswith("subprocess.CalledProcessError: Command ")
    quiet = subprocess.run(launch[:3] + ["--quiet"] + launch[3:] + script, cwd=ROOT, capture_output=True, text=True,
                           timeout=300, env=environment())
    assert_reported(quiet, 1, ours)
