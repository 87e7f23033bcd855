"""bench/gpu_check.py: its dry run on the tiny models goes through every step, and its junit reading."""

import json
import shutil
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def test_junit_counts_and_the_two_process_tests(tmp_path):
    from gpu_check import junit_counts

    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest" tests="5" failures="1" errors="1" skipped="1" time="12.5">'
        '<testcase classname="tests.run.test_scale_out" name="test_fsdp_on_the_cpu[a]"><failure message="x"/></testcase>'
        '<testcase classname="tests.end_to_end.test_train_e2e" name="test_two_processes_and_one[grpo]"/>'
        '<testcase classname="tests.end_to_end.test_train_e2e" name="test_one_epoch"/>'
        '<testcase classname="tests.rewards.test_ocr" name="test_ocr"><skipped message="no rapidocr"/></testcase>'
        '<testcase classname="tests.run.test_x" name="test_y"><error message="boom"/></testcase>'
        '</testsuite></testsuites>')
    counts = junit_counts(junit)
    assert (counts["tests"], counts["passed"], counts["failures"], counts["errors"], counts["skipped"]) == (5, 2, 1, 1, 1)
    assert counts["time_s"] == 12.5
    assert counts["failed"] == ["tests/run/test_scale_out.py::test_fsdp_on_the_cpu[a]", "tests/run/test_x.py::test_y"]
    assert counts["multiprocess"] == {"tests/run/test_scale_out.py::test_fsdp_on_the_cpu[a]": "failure",
                                      "tests/end_to_end/test_train_e2e.py::test_two_processes_and_one[grpo]": "passed"}


@pytest.mark.slow
def test_the_dry_run_goes_through_every_step_on_the_tiny_models(tmp_path):
    import gpu_check

    results = gpu_check.main(["--out", str(tmp_path), "--dry-run", "--shapes", "sd35m"])  # FLUX: as sd35m
    assert results["not_run"] == []
    suite = results["suite"]
    assert suite["tests"] > 0 and suite["passed"] == suite["tests"] - suite["skipped"] and suite["failed"] == []
    assert set(results["steps"]) == {"sd35m", "sd35m full fine-tuning"}
    for name, epoch in results["steps"].items():
        perf = epoch["perf"]
        # 4 images of 2 steps; flow_grpo's timestep_fraction 0.99 trains int(2 * 0.99) = 1 step of each
        assert perf["perf/images_sampled"] == 4 and perf["perf/pairs_trained"] == 4, name
        assert perf["perf/pairs_per_s"] > 0 and epoch["phases"]["training"] > 0
    assert results["steps"]["sd35m full fine-tuning"]["gradient_checkpointing"]
    assert not results["steps"]["sd35m"]["gradient_checkpointing"]
    text = (tmp_path / "summary.md").read_text()
    assert "| sd35m full fine-tuning | 4 x 2 | 32 (GC) |" in text and f"{suite['passed']} passed" in text
    assert json.loads((tmp_path / "summary.json").read_text())["steps"].keys() == results["steps"].keys()
    with tarfile.open(tmp_path / "details.tar.gz") as tar:
        assert sorted(tar.getnames()) == sorted(f"{name}.json" for name in results["steps"])
    assert len(list(tmp_path.iterdir())) <= 8  # what the GPU machine's tool sends back


def test_runs_are_chosen_in_order_and_a_run_the_budget_cannot_hold_is_not_started(tmp_path, capsys):
    import gpu_check

    args = gpu_check.parse_args(["--out", str(tmp_path), "--runs", "flux:cap,sd15:whole"])
    assert args.runs == [("flux", "cap"), ("sd15", "whole")]
    assert gpu_check.parse_args(["--out", str(tmp_path)]).runs == list(gpu_check.ORDER)
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--out", str(tmp_path), "--runs", "sd15:half"])
    assert "--runs: sd15:half unknown; allowed: sd15:cap, sd35m:whole" in capsys.readouterr().err
    # on a GPU each run has its expected seconds: with 80 s left, FLUX.1's whole-card run (200 s) is not started,
    # SD-1.5's (55 s) is
    check = gpu_check.Check(gpu_check.parse_args(["--out", str(tmp_path), "--budget-s", "100", "--only", "epochs"]))
    assert gpu_check.start_or_skip(check, "flux", gpu_check.EXPECTED_S["flux", "whole"]) is False
    assert check.results["not_run"][0]["why"].startswith("about 200 s on an H200 (EXPECTED_S)")
    assert gpu_check.start_or_skip(check, "sd15", gpu_check.EXPECTED_S["sd15", "whole"]) is True
    check.log.close()
    shutil.rmtree(check.work)


def test_a_pipeline_an_earlier_call_built_in_the_models_folder_is_kept(tmp_path):
    import gpu_check

    args = ["--out", str(tmp_path / "out"), "--dry-run", "--models-dir", str(tmp_path / "models"), "--shapes", "sd35m"]
    checks = [gpu_check.Check(gpu_check.parse_args(args)) for _ in range(2)]
    built = [gpu_check.Models(check, None).build("sd35m") for check in checks]  # the second call keeps the first's
    assert built == [tmp_path / "models" / "sd35m"] * 2 and (built[0] / "model_index.json").is_file()
    log = (tmp_path / "out" / "log.txt").read_text()
    assert log.count("models/sd35m: exit 0") == 1 and "models/sd35m: kept from an earlier call" in log  # built once
    for check in checks:
        check.log.close()
        shutil.rmtree(check.work)
