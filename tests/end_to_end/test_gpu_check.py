"""bench/gpu_check.py as a user runs it (tests/helpers/bench_helpers.py): its dry run on the tiny models goes through
every step and reads the suite's junit file; its plan of the epoch runs under a budget."""

import json
import tarfile

import pytest

from helpers.bench_helpers import refused, succeeded

# a suite of one failure, one error, one skip and two passes, two of them in 2-process test files (MULTIPROCESS)
SUITE = {
    "tests/run/test_scale_out.py": 'import pytest\n\n\n@pytest.mark.parametrize("case", ["a"])\n'
                                   'def test_fsdp_on_the_cpu(case):\n    assert case == "b"\n',
    "tests/end_to_end/test_train_e2e.py": 'import pytest\n\n\n@pytest.mark.parametrize("preset", ["grpo"])\n'
                                          'def test_two_processes_and_one(preset):\n    pass\n\n\n'
                                          'def test_one_epoch():\n    pass\n',
    "tests/rewards/test_ocr.py": 'import pytest\n\n\ndef test_ocr():\n    pytest.skip("no rapidocr")\n',
    "tests/run/test_x.py": 'import pytest\n\n\n@pytest.fixture\ndef broken():\n    raise RuntimeError("boom")\n\n\n'
                           'def test_y(broken):\n    pass\n',
}


@pytest.mark.slow
def test_the_dry_run_goes_through_every_step_on_the_tiny_models(tmp_path):
    """Every step on the tiny models, the suite step on a suite of its own (its junit file read: the counts, the failed
    tests, the 2-process tests' outcomes); a second call with the same --models-dir keeps the pipeline the first
    built."""
    suite = tmp_path / "suite"
    for path, text in SUITE.items():
        (suite / path).parent.mkdir(parents=True, exist_ok=True)
        (suite / path).write_text(text)
    (suite / "pytest.ini").write_text("[pytest]\n")  # the suite's own root: node ids tests/run/test_scale_out.py::...
    out, models = tmp_path / "out", tmp_path / "models"
    common = ["--out", out, "--dry-run", "--models-dir", models, "--shapes", "sd35m"]  # FLUX: as sd35m
    succeeded("gpu_check", *common, "--suite", suite / "tests")
    results = json.loads((out / "summary.json").read_text())
    assert results["not_run"] == []
    counts = results["suite"]
    assert [counts[key] for key in ("tests", "passed", "failures", "errors", "skipped")] == [5, 2, 1, 1, 1]
    assert counts["time_s"] > 0
    assert counts["failed"] == ["tests/run/test_scale_out.py::test_fsdp_on_the_cpu[a]", "tests/run/test_x.py::test_y"]
    assert counts["multiprocess"] == {"tests/run/test_scale_out.py::test_fsdp_on_the_cpu[a]": "failure",
                                      "tests/end_to_end/test_train_e2e.py::test_two_processes_and_one[grpo]": "passed"}
    assert (out / "suite.txt").read_text().splitlines() == [
        f"2 passed, 1 failed, 1 errors, 1 skipped of 5 in {counts['wall_s']:.0f} s",
        "FAILED tests/run/test_scale_out.py::test_fsdp_on_the_cpu[a]", "FAILED tests/run/test_x.py::test_y"]
    assert set(results["steps"]) == {"sd35m", "sd35m full fine-tuning"}
    for name, epoch in results["steps"].items():
        perf = epoch["perf"]
        # 4 images of 2 steps; flow_grpo's step_fraction 0.99 trains int(2 * 0.99) = 1 step of each
        assert perf["perf/images_sampled"] == 4 and perf["perf/pairs_trained"] == 4, name
        assert perf["perf/pairs_per_s"] > 0 and epoch["phases"]["training"] > 0
    assert results["steps"]["sd35m full fine-tuning"]["gradient_checkpointing"]
    assert not results["steps"]["sd35m"]["gradient_checkpointing"]
    text = (out / "summary.md").read_text()
    assert "| sd35m full fine-tuning | 4 x 2 | 32 (GC) |" in text
    assert "**Suite**: 2 passed, 1 failed, 1 errors, 1 skipped of 5" in text
    assert "**2-process tests**: 1 passed of 2 (failure, passed)." in text
    assert "* `tests/run/test_scale_out.py::test_fsdp_on_the_cpu[a]`: failure" in text
    with tarfile.open(out / "details.tar.gz") as tar:
        assert sorted(tar.getnames()) == sorted(f"{name}.json" for name in results["steps"])
    assert len(list(out.iterdir())) <= 8  # what the GPU machine's tool sends back
    assert (models / "sd35m" / "model_index.json").is_file()

    succeeded("gpu_check", *common, "--only", "models")  # the second call keeps the first's pipeline
    log = (out / "log.txt").read_text()  # both calls' lines
    assert log.count("models/sd35m: exit 0") == 1 and f"models/sd35m: kept from an earlier call ({models / 'sd35m'})" in log


def test_runs_are_planned_in_order_and_a_run_the_budget_cannot_hold_is_not_started(tmp_path):
    """--plan: each run started or not as the budget decides when every run takes its EXPECTED_S (seconds on an H200);
    after a run left out, the next ones are tried. Nothing runs."""
    planned = succeeded("gpu_check", "--out", tmp_path / "default", "--plan").stdout
    lines = [line.split("] ", 1)[1] for line in planned.splitlines() if line.startswith("[")]
    assert lines == [  # ORDER, in a budget of 530 s less 20 s of grace
        "planned sd15 (24 GiB cap): about 70 s on an H200 (EXPECTED_S)",
        "planned sd35m: about 170 s on an H200 (EXPECTED_S)",
        "planned flux: about 200 s on an H200 (EXPECTED_S)",
        "NOT RUN flux (24 GiB cap): about 100 s on an H200 (EXPECTED_S), 70 s of the budget left",
        "NOT RUN sd35m (24 GiB cap): about 75 s on an H200 (EXPECTED_S), 70 s of the budget left",
        "planned sd15: about 55 s on an H200 (EXPECTED_S)",
        "NOT RUN sd35m full fine-tuning: about 150 s on an H200 (EXPECTED_S), 15 s of the budget left"]
    # --runs: these runs in this order; with 100 s, FLUX.1's whole-card run (200 s) is not started, SD-1.5's (55 s) is
    succeeded("gpu_check", "--out", tmp_path / "chosen", "--plan", "--budget-s", "100", "--runs",
              "flux:whole,sd15:whole,sd35m:cap")
    results = json.loads((tmp_path / "chosen" / "summary.json").read_text())
    assert results["planned"] == [{"what": "sd15", "expected_s": 55}]
    assert [(n["what"], n["why"]) for n in results["not_run"]] == [
        ("flux", "about 200 s on an H200 (EXPECTED_S), 80 s of the budget left"),
        ("sd35m (24 GiB cap)", "about 75 s on an H200 (EXPECTED_S), 25 s of the budget left")]
    assert "**Planned** (--plan: nothing ran):\n* sd15: about 55 s" in (tmp_path / "chosen" / "summary.md").read_text()
    error = refused("gpu_check", "--out", tmp_path / "bad", "--runs", "sd15:half")
    assert "--runs: sd15:half unknown; allowed: sd15:cap, sd35m:whole" in error
