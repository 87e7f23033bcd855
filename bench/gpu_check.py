"""The one-command GPU check: the test suite on CUDA and one training epoch at each model size users train, in one
command meant to take at most 9 minutes (``--budget-s``), everything it measures written into one folder.

    bash bench/gpu_wheels.sh    # here, once: the wheels the GPU image lacks (diffusers, ml_collections, wandb) in .whl/
    # on the GPU machine, from the repository root:
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 bench/gpu_check.py --out DIR

    python bench/gpu_check.py --out DIR --dry-run     # on a CPU: every step on the tiny models (tests/end_to_end)
    python bench/gpu_check.py --out DIR --plan        # the epoch runs the budget would start, in order; none runs

Steps (``--only`` picks some), each a subprocess, so one that fails leaves the others; by default they run side by side
(``--suite-first``: the epochs after the suite, alone, which takes longer than 9 minutes on an H100):

1. ``env``: the GPU, driver, torch / CUDA and the packages' versions.
2. ``suite``: the test suite (``python -m pytest -rf --junitxml DIR/junit.xml``, test by test on all cores but four
   with pytest-xdist when it is installed, one thread each), its output in DIR/suite_log.txt, its counts and failures
   in DIR/suite.txt. The 2-process tests (``MULTIPROCESS``) are part of it (on one GPU they run on the CPU with the GPU
   hidden, tests/helpers/launch_helpers.py); the summary lists their outcomes apart.
3. ``models``: random pipelines of the real shapes (bench/random_model.py) on two cores, one after the other (the
   capped epochs of a shape start once it is saved, the whole-card ones once all are): SD-1.5 (UNet 860M, 512 px),
   SD 3.5 Medium (2.24B transformer, CLIP-L/G, no T5) and FLUX.1 [dev] widths with half its blocks (10 double + 19
   single, 6.2B; T5-XXL's width with 12 of its 24 layers): the whole 12B does not fit the 24 GiB cap.
4. ``epochs`` on four cores: a two-epoch run of each shape's recipe (``SHAPES``: grpo on SD-1.5, flow_grpo_sd35 and
   flow_grpo_flux on the others; bf16, LoRA, ``train.pairs_per_forward="auto"``), the second epoch reported by
   bench/epoch.py, under a 24 GiB cap and on the whole card (once the building, which initialises on the GPU, is
   over), one after the other in ``ORDER`` or ``--runs`` (a run the budget cannot hold by its ``EXPECTED_S`` is not
   started, the next ones are tried): peak CUDA memory, the phase split,
   images/s, pairs/s, training and sampling MFU. The whole-card runs keep config/base.py's speed options
   (``compile_denoiser="auto"`` compiles the transformers' blocks in the first epoch; a reached recompile limit is
   reported); the capped and full fine-tuning runs are eager (``EAGER``), to keep the budget. A run that fails with a
   CUDA error other than out-of-memory makes its shape's next runs launch-blocking (``CUDA_LAUNCH_BLOCKING=1``, named
   so in the tables), so that their traceback names the kernel.
5. ``full_ft``: the SD 3.5 Medium epoch with full fine-tuning and gradient checkpointing, eager.

Then DIR/summary.md (the tables for docs/studies/performance/) and DIR/summary.json; what could not run is listed with
the reason, and whether the epochs ran beside the suite (sharing the GPU with its tests: the runs on the whole card then
leave SUITE_GB to them). DIR receives 7 files: summary.md, summary.json, junit.xml, suite.txt, suite_log.txt, log.txt,
details.tar.gz (each run's JSON). ``--budget-s`` (default 530) bounds the whole: a run that would start past it is
listed as not run, one still going at it is killed, and the suite is interrupted (pytest then writes its junit file).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
STEPS = ("env", "suite", "models", "epochs", "full_ft")
CAP_GB = 24
SUITE_GB = 16  # beside the suite, the "whole card" runs leave this much to its tests' tiny models
GRACE_S = 20  # an interrupted suite's time to write its junit file
# the tests that start 2 processes (accelerate launch or workers one by one): on one GPU they run on the CPU
MULTIPROCESS = ("tests/end_to_end/test_process_failures.py", "tests/run/test_scale_out.py",
                "tests/end_to_end/test_train_e2e.py::test_two_processes")
COMMON = {"prompt_fn": "simple_animals", "reward_fn": "jpeg_compressibility", "use_lora": "True", "eval_freq": "0",
          "sample.sde_window_size": "0",
          "sample.num_batches_per_epoch": "1", "sample.batch_size": "8", "train.batch_size": "8",
          "train.group_size": "8"}
# shape: (random_model.py arguments, tiny family of the dry run, preset, fields set on top of COMMON)
SHAPES = {
    "sd15": (["--shape", "sd15"], "sd", "grpo", {"sample.num_steps": "20", "mixed_precision": "bf16"}),
    "sd35m": (["--shape", "sd35m"], "sd3", "flow_grpo_sd35", {"mixed_precision": "bf16"}),
    "flux": (["--shape", "flux", "--blocks", "0.5"], "flux", "flow_grpo_flux", {"mixed_precision": "bf16"}),
}
EAGER = {"compile_denoiser": "False"}  # the capped and full fine-tuning runs: no compilation minute in the budget
FULL_FT_SHAPE, FULL_FT = "sd35m", {"use_lora": "False", "train.gradient_checkpointing": "True", **EAGER}
# the epoch runs in turn: SD-1.5 under the cap (beside the building: its model is saved first), then what no check has
# measured yet: the default configuration (compiled) on the whole card at SD3.5-M and FLUX.1 shapes, FLUX.1 under the
# cap; then those measured before: SD3.5-M under the cap, SD-1.5 on the whole card, the full fine-tuning (its
# checkpoint writes every weight and Adam's state). On an H200 the building and the first three take about 8 of the 9
# minutes (EXPECTED_S; an H100 is slower); --runs picks others
ORDER = (("sd15", "cap"), ("sd35m", "whole"), ("flux", "whole"), ("flux", "cap"), ("sd35m", "cap"), ("sd15", "whole"),
         (FULL_FT_SHAPE, "full"))
assert {shape for shape, _ in ORDER} == set(SHAPES), "every shape has its runs in ORDER"
# seconds a run takes on an H200 beside the suite, start-up and checkpoint included (the check's runs of 2026-11-26:
# their "exit after"; the compiled first epoch about 70 s more than eager; FLUX.1's estimated from its size): a run
# whose estimate exceeds what the budget leaves is not started (named so), and the next ones in order are tried
EXPECTED_S = {("sd15", "cap"): 70, ("sd35m", "cap"): 75, ("sd35m", "whole"): 170, ("flux", "whole"): 200,
              ("flux", "cap"): 100, ("sd15", "whole"): 55, (FULL_FT_SHAPE, "full"): 150}
assert set(EXPECTED_S) == set(ORDER)
BUILT = "built_by_gpu_check.txt"  # in a pipeline's folder once built: a later call with --models-dir keeps it
DRY_SUITE = "tests/run/test_throughput.py"  # a few seconds
DRY = {"sample.num_steps": "2", "sample.batch_size": "4", "train.batch_size": "4", "train.group_size": "4",
       "sample.resolution": "0", "mixed_precision": "no", "pretrained.max_sequence_length": "16"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the folder every result is written to")
    parser.add_argument("--dry-run", action="store_true", help="CPU: the tiny models, two steps, a few tests")
    parser.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps of {', '.join(STEPS)}")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated shapes of {', '.join(SHAPES)}")
    parser.add_argument("--runs", default=",".join(f"{shape}:{kind}" for shape, kind in ORDER),
                        help="the epoch runs in the order to run them, comma-separated shape:kind (kind: cap, the "
                             "24 GiB cap; whole, the whole card; full, full fine-tuning); default: ORDER")
    parser.add_argument("--budget-s", type=float, default=530.0, help="seconds for the whole check")
    parser.add_argument("--plan", action="store_true",
                        help="run nothing: list the epoch runs in order, each planned or not run as the budget would "
                             "decide if every run took its EXPECTED_S")
    parser.add_argument("--suite", default="", help="pytest's arguments for the suite step, space-separated (default: "
                                                   "tests; with --dry-run: DRY_SUITE)")
    parser.add_argument("--workers", type=int, default=0, help="pytest-xdist workers (0: the cores left by the bench)")
    parser.add_argument("--suite-first", action="store_true",
                        help="the epochs after the suite, alone on the machine (longer than the budget on an H100) "
                             "instead of beside it")
    parser.add_argument("--suite-s", type=float, default=0.0,
                        help="with --suite-first: seconds the suite may take before it is interrupted (default: "
                             "the budget less 5 minutes for the epochs)")
    parser.add_argument("--models-dir", default="", help="where the random pipelines are saved (default: a temporary "
                                                         "folder, removed at the end); one an earlier call built "
                                                         "there whole is kept")
    args = parser.parse_args(argv)
    args.suite = args.suite or (DRY_SUITE if args.dry_run else "tests")
    for name, allowed in (("only", STEPS), ("shapes", SHAPES)):
        chosen = [s for s in getattr(args, name).split(",") if s]
        if unknown := [s for s in chosen if s not in allowed]:
            parser.error(f"--{name}: {', '.join(unknown)} unknown; allowed: {', '.join(allowed)}")
        setattr(args, name, chosen)
    runs = [tuple(r.split(":", 1)) for r in args.runs.split(",") if r]
    if bad := [":".join(r) for r in runs if r not in EXPECTED_S]:
        parser.error(f"--runs: {', '.join(bad)} unknown; allowed: "
                     f"{', '.join(f'{shape}:{kind}' for shape, kind in ORDER)}")
    args.runs = runs
    return args


class Check:
    """The folder, the log, the clock and what was measured or not run."""

    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        self.models = Path(args.models_dir) if args.models_dir else self.work / "models"
        self.log = open(self.out / "log.txt", "a")
        self.lock = threading.Lock()  # the model-building thread and the main one write the log
        self.processes: list[subprocess.Popen] = []  # every process started: none outlives the check
        self.start = time.monotonic()
        self.results: dict = {"dry_run": args.dry_run, "steps": {}, "not_run": []}
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                        PYTHONUNBUFFERED="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
        if args.dry_run:  # the tiny models on the CPU, also on a GPU machine (the suite's own test of the dry run)
            self.env["CUDA_VISIBLE_DEVICES"] = ""
        self.blocking: set[str] = set()  # shapes whose run failed with a CUDA error: the next runs launch-blocking

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.start)

    def say(self, line: str) -> None:
        stamp = f"[{time.monotonic() - self.start:6.1f} s] {line}"
        with self.lock:
            print(stamp, flush=True)
            self.log.write(stamp + "\n")
            self.log.flush()

    def not_run(self, what: str, why: str) -> None:
        self.say(f"NOT RUN {what}: {why}")
        self.results["not_run"].append({"what": what, "why": why})

    def run(self, what: str, command: list[str], timeout: float, **kwargs) -> int | None:
        """``command`` with its output in the log (or ``output``); None when it did not start (the budget is spent)
        or ran past ``timeout`` (then it is killed)."""
        if timeout <= 5:
            self.not_run(what, f"the budget of {self.args.budget_s:.0f} s is spent")
            return None
        self.say(f"{what}: {' '.join(command)}")
        return self.wait(what, self.start_process(command, **kwargs), timeout)

    def start_process(self, command: list[str], cores: set[int] | None = None, output: Path | None = None,
                      env: dict | None = None):
        """``command`` started in its own session (so that its children can be stopped with it), on ``cores`` (set by
        a small exec wrapper: no preexec_fn while a thread runs), writing to ``output`` (default: the log), with
        ``env`` on top of the check's environment."""
        if cores:
            pin = ("import os, sys; os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')}); "
                   "os.execvp(sys.argv[2], sys.argv[2:])")
            command = [python(), "-c", pin, ",".join(map(str, sorted(cores))), *command]
        with self.lock:
            self.log.flush()
            stream = open(output, "w") if output else self.log
            try:
                process = subprocess.Popen(command, cwd=ROOT, env={**self.env, **(env or {})}, stdout=stream,
                                           stderr=subprocess.STDOUT, start_new_session=True)
            finally:
                if output:
                    stream.close()  # the child holds its own copy
            self.processes.append(process)
        return process

    def wait(self, what: str, process, timeout: float, interrupt_first: bool = False,
             started: float | None = None) -> int | None:
        """The exit code of ``process`` (started at ``started``, default now), or None when it ran past ``timeout``:
        then it is killed with its children, after ``interrupt_first`` a SIGINT to it alone and up to GRACE_S seconds
        (pytest then writes its junit file)."""
        started = time.monotonic() if started is None else started
        try:
            code = process.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            if interrupt_first:
                process.send_signal(signal.SIGINT)  # the controller: its xdist workers are stopped by it
                try:
                    process.wait(timeout=GRACE_S)
                except subprocess.TimeoutExpired:
                    pass
            stop(process)
            counted = "; what it reached is counted" if interrupt_first else ""
            self.not_run(what, f"stopped after {time.monotonic() - started:.0f} s (the budget{counted})")
            return None
        self.say(f"{what}: exit {code} after {time.monotonic() - started:.1f} s")
        return code


def stop(process: subprocess.Popen) -> None:
    """Kill ``process`` and its children (its session) unless it has ended."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def python() -> str:
    return sys.executable


def env_step(check: Check) -> None:
    lines = [f"python {platform.python_version()} ({python()}), {os.cpu_count()} CPUs, {platform.platform()}"]
    code = ("import torch, diffusers, transformers, peft, accelerate; "
            "print('torch', torch.__version__, 'cuda', torch.version.cuda, 'GPU', torch.cuda.get_device_name() "
            "if torch.cuda.is_available() else None); print('diffusers', diffusers.__version__, 'transformers', "
            "transformers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)")
    try:
        versions = subprocess.run([python(), "-c", code], cwd=ROOT, env=check.env, capture_output=True, text=True,
                                  timeout=120)
        lines += versions.stdout.strip().splitlines()[-2:] or versions.stderr.strip().splitlines()[-1:]
        if shutil.which("nvidia-smi"):
            query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
            smi = subprocess.run(query, capture_output=True, text=True, timeout=60)
            lines.append("nvidia-smi: " + smi.stdout.strip())
    except subprocess.TimeoutExpired as error:
        lines.append(f"{error.cmd[0]}: no answer in {error.timeout:.0f} s")
    check.results["env"] = lines
    for line in lines:
        check.say(line)


def cores(check: Check) -> dict[str, set[int] | None]:
    """Which cores each part uses: beside the suite, the epochs get four (compilation runs on them), two of which the
    model building shares while it lasts; the suite the rest (all of them with --suite-first). None: anywhere (a
    machine of fewer than 8 cores, or the dry run)."""
    every = sorted(os.sched_getaffinity(0))
    if len(every) < 8 or check.args.dry_run:
        return {"epochs": None, "models": None, "suite": None}
    if check.args.suite_first:
        return {"epochs": None, "models": set(every[:2]), "suite": set(every)}
    return {"epochs": set(every[:4]), "models": set(every[2:4]), "suite": set(every[4:])}


def suite_command(check: Check, junit: Path, suite_cores: set[int] | None) -> list[str]:
    command = [python(), "-m", "pytest", "-rf", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
               *check.args.suite.split()]
    found = subprocess.run([python(), "-c", "import xdist; print(xdist.__version__)"], env=check.env,
                           capture_output=True, text=True, timeout=60)
    has_xdist = found.returncode == 0
    if has_xdist and suite_cores:
        # test by test; "worksteal" (pytest-xdist 3.2+) moves queued tests to idle workers, so the slow tests the
        # workers' collection puts first (tests/conftest.py) do not leave one worker a tail of them
        version = tuple(int(x) for x in found.stdout.strip().split(".")[:2] if x.isdigit())
        command += ["-n", str(check.args.workers or len(suite_cores)),
                    "--dist", "worksteal" if version >= (3, 2) else "load"]
    elif not has_xdist:
        check.results["suite_note"] = "pytest-xdist is not installed: the suite ran in one process"
    return command


def junit_counts(junit: Path) -> dict:
    """Totals of a junit file, and the outcome of every test of ``MULTIPROCESS``."""
    root = ElementTree.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["time_s"] = sum(float(s.get("time", 0)) for s in suites)
    failed, multiprocess = [], {}
    for case in root.iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        file, _, cls = path.rpartition("/test_")
        node = f"{file}/test_{cls}.py::{case.get('name')}" if file else f"{path}::{case.get('name')}"
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = tag
        if outcome in ("failure", "error"):
            failed.append(node)
        if any(node.startswith(prefix) for prefix in MULTIPROCESS):
            multiprocess[node] = outcome
    counts["failed"] = failed
    counts["multiprocess"] = multiprocess
    return counts


class Models(threading.Thread):
    """Builds the shapes' random pipelines one after the other, in the background: the epochs of a shape start once
    its pipeline is saved, while the next one is built (random initialisation on the GPU takes seconds; the rest is
    writing files). ``ready(shape)`` waits for a shape's and returns its folder, or None when it was not built."""

    def __init__(self, check: Check, model_cores: set[int] | None):
        super().__init__(daemon=True)
        self.check, self.cores = check, model_cores
        self.dirs: dict[str, Path | None] = {}
        self.done = {shape: threading.Event() for shape in check.args.shapes}

    def run(self) -> None:
        try:
            for shape in self.check.args.shapes:
                self.dirs[shape] = self.build(shape)
                self.done[shape].set()
        finally:  # whatever happened: nobody waits for a shape that will not come
            for event in self.done.values():
                event.set()

    def build(self, shape: str) -> Path | None:
        check = self.check
        target, output = check.models / shape, check.work / f"build_{shape}.log"
        builder, family = SHAPES[shape][0], SHAPES[shape][1]
        if check.args.dry_run:
            command = [python(), "-c", "import sys; from ddpo_group.models.tiny_random import TINY_BUILDERS, "
                       "save_pipeline; save_pipeline(TINY_BUILDERS[sys.argv[1]](), sys.argv[2])", family, str(target)]
        else:
            command = [python(), str(BENCH / "random_model.py"), *builder, "--out", str(target)]
        built = target / BUILT  # a pipeline a call before this one built whole in --models-dir, by the same command
        recipe = " ".join(command[1:])
        if built.is_file() and built.read_text() == recipe:
            check.say(f"models/{shape}: kept from an earlier call ({target})")
            return target
        code = check.run(f"models/{shape}", command, check.left() - 60, cores=self.cores, output=output)
        if output.exists():
            check.say(f"models/{shape} printed: " + " | ".join(output.read_text().strip().splitlines()[-3:]))
        if code != 0:
            check.not_run(f"the {shape} epochs", "its random pipeline was not built (log.txt)")
            return None
        built.write_text(recipe)
        return target

    def ready(self, shape: str) -> Path | None:
        self.done[shape].wait(timeout=max(self.check.left(), 0))
        return self.dirs.get(shape)


def epoch_run(check: Check, name: str, shape: str, model: Path, extra: dict, cap_gb: float | None,
              leave_gb: float | None, epoch_cores: set[int] | None) -> None:
    preset, sets = SHAPES[shape][2], {**COMMON, **SHAPES[shape][3], **extra}
    if check.args.dry_run:
        sets.update(DRY)
    sets["pretrained.model"] = str(model)
    env = None
    if shape in check.blocking:  # an earlier run of the shape failed with a CUDA error: name the kernel this time
        name, env = f"{name} (CUDA_LAUNCH_BLOCKING=1)", {"CUDA_LAUNCH_BLOCKING": "1"}
    target = check.work / f"{name}.json"
    threads = str(len(epoch_cores)) if epoch_cores else "0"  # torch would start a thread per core of the machine
    command = [python(), str(BENCH / "epoch.py"), "--preset", preset, "--epochs", "2", "--threads", threads,
               "--json", str(target)]
    command += [x for key, value in sets.items() for x in ("--set", f"{key}={value}")]
    if cap_gb:
        command += ["--memory-gb", str(cap_gb)]
    if leave_gb:
        command += ["--leave-gb", str(leave_gb)]
    with check.lock:  # the run writes into the log as it goes (a killed check keeps it); its part is read after
        check.log.flush()
        offset = (check.out / "log.txt").stat().st_size
    code = check.run(name, command, check.left() - GRACE_S - 10, cores=epoch_cores, env=env)
    with open(check.out / "log.txt", "rb") as log:
        log.seek(offset)
        printed = log.read().decode(errors="replace")
    if "recompile_limit" in printed:
        check.say(f"{name}: dynamo's recompile limit was reached (part of the compiled blocks ran eager)")
        check.results.setdefault("recompile_limit", []).append(name)
    if code == 0 and target.exists():
        check.results["steps"][name] = json.loads(target.read_text())
    else:
        cuda_errors = [line for line in printed.splitlines() if "CUDA error" in line and "out of memory" not in line]
        if cuda_errors:
            check.blocking.add(shape)
        if name not in {n["what"] for n in check.results["not_run"]}:
            check.not_run(name, "it failed (log.txt)")


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def summary(check: Check) -> str:
    r = check.results
    lines = ["# GPU check" + (" (dry run: tiny models on the CPU)" if r["dry_run"] else ""), ""]
    lines += [f"    {line}" for line in r.get("env", [])] + [""]
    if "suite" in r:
        s = r["suite"]
        lines += [f"**Suite**: {s['passed']} passed, {s['failures']} failed, {s['errors']} errors, {s['skipped']} "
                  f"skipped of {s['tests']} in {s['wall_s']:.0f} s ({s['command']})."]
        lines += [f"* failed: `{node}`" for node in s["failed"]]
        if s["multiprocess"]:
            outcomes = list(s["multiprocess"].values())
            lines += ["", f"**2-process tests**: {outcomes.count('passed')} passed of {len(outcomes)} "
                          f"({', '.join(sorted(set(outcomes)))})."]
            lines += [f"* `{node}`: {outcome}" for node, outcome in s["multiprocess"].items() if outcome != "passed"]
        if r.get("suite_note"):
            lines.append(r["suite_note"])
        lines.append("")
    epochs = {name: e for name, e in r["steps"].items()}
    if epochs and r.get("epochs_beside_the_suite"):
        lines += [f"The epochs ran beside the suite (four cores for them, two of which the model building shared, the "
                  f"rest for the tests; the GPU shared with the tests' tiny models, the uncapped runs leaving them "
                  f"{SUITE_GB} GiB); "
                  f"`--suite-first` measures them alone.", ""]
    if epochs:
        lines += ["| run | samples x steps | pairs per forward | CUDA max allocated GiB | sampling s | training s | "
                  "epoch s | images/s | pairs/s | MFU training | MFU sampling |", "|---|---:|---:|---:|---:|---:|---:|"
                  "---:|---:|---:|---:|"]
        for name, e in epochs.items():
            perf = e["perf"]
            memory = e["cuda_max_allocated_mib"] / 1024 if e["cuda_max_allocated_mib"] is not None else None

            def number(value, digits=2, percent=False):
                if value is None:
                    return "n/a"
                return f"{100 * value:.1f}%" if percent else f"{value:.{digits}f}"

            lines.append(
                f"| {name} | {e['samples']} x {e['steps']} | {e['pairs_per_forward']}"
                f"{' (GC)' if e['gradient_checkpointing'] else ''} | {number(memory, 1)} | "
                f"{e['phases']['sampling']:.2f} | {e['phases']['training']:.2f} | {e['wall_s']:.2f} | "
                f"{number(perf.get('perf/images_per_s'))} | {number(perf.get('perf/pairs_per_s'))} | "
                f"{number(perf.get('perf/mfu_training'), percent=True)} | "
                f"{number(perf.get('perf/mfu_sampling'), percent=True)} |")
        lines += ["", "Phase split of each epoch (seconds):", ""]
        phases = list(next(iter(epochs.values()))["phases"])
        lines += ["| run | " + " | ".join(phases) + " |", "|---|" + "---:|" * len(phases)]
        for name, e in epochs.items():
            lines.append(f"| {name} | " + " | ".join(f"{e['phases'][p]:.2f}" for p in phases) + " |")
        lines.append("")
    if "planned" in r:
        lines += ["**Planned** (--plan: nothing ran):"] + [f"* {p['what']}: about {p['expected_s']} s"
                                                          for p in r["planned"]] + [""]
    if r["not_run"]:
        lines += ["**Not run**:"] + [f"* {n['what']}: {n['why']}" for n in r["not_run"]]
    lines += ["", f"Whole check: {r['wall_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    check = Check(args)
    try:
        if args.plan:
            plan(check)
        else:
            run_steps(check)
    finally:  # an error or Ctrl-C here: no test or epoch process goes on without the check
        for process in check.processes:
            stop(process)
    check.results["wall_s"] = time.monotonic() - check.start
    (check.out / "summary.json").write_text(json.dumps(check.results, indent=2, default=str))
    text = summary(check)
    (check.out / "summary.md").write_text(text)
    with tarfile.open(check.out / "details.tar.gz", "w:gz") as tar:
        for path in sorted(check.work.glob("*.json")):
            tar.add(path, arcname=path.name)
    print(text)
    check.log.close()
    shutil.rmtree(check.work, ignore_errors=True)
    return check.results


def run_steps(check: Check) -> None:
    args = check.args
    if not args.dry_run and not cuda_available():
        check.say("no CUDA GPU here: the epochs would measure nothing (use --dry-run on a CPU)")
        args.only = [s for s in args.only if s in ("env", "suite")]
    if "env" in args.only:
        env_step(check)
    parts = cores(check)
    suite = None
    if "suite" in args.only:
        junit = check.out / "junit.xml"
        junit.unlink(missing_ok=True)  # an earlier run's file must not pass for this one's
        command = suite_command(check, junit, parts["suite"])
        where = f" (cores {min(parts['suite'])}-{max(parts['suite'])})" if parts["suite"] else ""
        check.say(f"suite: {' '.join(command)}{where}")
        # one thread per test process and per process a test starts (tests/conftest.py's two per worker put 24 threads
        # on 12 cores, and a started process takes one per core)
        threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"} if parts["suite"] else None
        suite = (check.start_process(command, cores=parts["suite"], output=check.out / "suite_log.txt", env=threads),
                 time.monotonic(), junit, command)
    models = None
    if {"models", "epochs", "full_ft"} & set(args.only):
        models = Models(check, parts["models"])
        models.start()
    if suite and args.suite_first:
        wait_suite(check, suite, min(args.suite_s or check.left() - 300, check.left() - GRACE_S - 10))
        suite = None
    beside = suite is not None and not args.dry_run
    check.results["epochs_beside_the_suite"] = beside
    # a "whole card" run beside the suite leaves SUITE_GB
    for name, shape, extra, cap, leave, expected in epoch_runs(check, SUITE_GB if beside else None):
        if models and cap is None:  # the building initialises on the GPU (FLUX's held 34 GiB): a run sized to the
            models.join(timeout=max(check.left(), 1))  # whole card starts after it, the capped ones beside it
        model = models.ready(shape) if models else None
        if model is not None and start_or_skip(check, name, expected):
            epoch_run(check, name, shape, model, extra, cap, leave, parts["epochs"])
    if models:
        models.join(timeout=max(check.left(), 1))
    if suite:
        wait_suite(check, suite, check.left() - GRACE_S - 5)


def epoch_runs(check: Check, whole: float | None) -> list[tuple]:
    """The epoch runs of ``--runs`` (ORDER by default) in that order, those of ``--shapes`` and ``--only``: (name, shape,
    fields, memory cap GiB, GiB left to others (``whole`` for a run on the whole card), expected seconds: None in the
    dry run). What the budget may leave out comes last."""
    args, runs = check.args, []
    for shape, kind in args.runs:
        if shape not in args.shapes or ("full_ft" if kind == "full" else "epochs") not in args.only:
            continue
        expected = None if args.dry_run else EXPECTED_S[shape, kind]
        if kind == "cap" and not args.dry_run:  # a memory cap is CUDA's
            runs.append((f"{shape} ({CAP_GB} GiB cap)", shape, EAGER, CAP_GB, None, expected))
        elif kind == "whole":
            runs.append((shape, shape, {}, None, whole, expected))
        elif kind == "full":
            runs.append((f"{shape} full fine-tuning", shape, FULL_FT, None, whole, expected))
    if "full_ft" in args.only and FULL_FT_SHAPE not in args.shapes:
        check.not_run(f"{FULL_FT_SHAPE} full fine-tuning", f"no {FULL_FT_SHAPE} model (--shapes)")
    return runs


def plan(check: Check) -> None:
    """``--plan``: the epoch runs in the order they would start, each started or left out by ``start_or_skip`` as
    though every run started before it took its EXPECTED_S; nothing runs."""
    for name, *_, expected in epoch_runs(check, None):
        if start_or_skip(check, name, expected):
            check.say(f"planned {name}: about {expected} s on an H200 (EXPECTED_S)")
            check.results.setdefault("planned", []).append({"what": name, "expected_s": expected})
            check.start -= expected or 0  # the budget's clock moved on by the run's expected seconds


def start_or_skip(check: Check, name: str, expected: float | None) -> bool:
    """Whether the run ``name`` of ``expected`` seconds (None: unknown, the dry run's) fits what the budget leaves; a
    run that does not is listed as not run."""
    left = check.left() - GRACE_S
    if expected is not None and expected > left:
        check.not_run(name, f"about {expected} s on an H200 (EXPECTED_S), {max(left, 0):.0f} s of the budget left")
        return False
    return True


def wait_suite(check: Check, suite, timeout: float) -> None:
    process, started, junit, command = suite
    code = check.wait("suite", process, timeout, interrupt_first=True, started=started)
    wall = time.monotonic() - started
    try:
        counts = junit_counts(junit)
    except (OSError, ElementTree.ParseError) as error:
        check.not_run("the suite's counts", f"no readable junit file ({type(error).__name__}: {error}; suite_log.txt)")
        return
    counts.update(wall_s=wall, exit=code, command=" ".join(Path(c).name if c == python() else c for c in command))
    check.results["suite"] = counts
    failed = "".join(f"FAILED {node}\n" for node in counts["failed"])
    (check.out / "suite.txt").write_text(f"{counts['passed']} passed, {counts['failures']} failed, "
                                         f"{counts['errors']} errors, {counts['skipped']} skipped of "
                                         f"{counts['tests']} in {wall:.0f} s\n{failed}")


if __name__ == "__main__":
    main()
