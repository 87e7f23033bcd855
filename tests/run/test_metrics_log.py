"""metrics.jsonl after a kill: a cut last line is skipped, and a resume drops the epochs after its checkpoint."""

from ddpo_group.run.persistence.metrics_log import append_metrics, read_metric_lines, rewind_metrics
from ddpo_group.run.persistence.metrics_log import read_metrics


def test_a_cut_line_is_skipped_and_rewind_keeps_the_checkpointed_epochs(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for epoch in range(4):
        append_metrics(path, {"epoch": epoch, "reward_mean": epoch / 10})
    with open(path, "a") as f:
        f.write('{"epoch": 4, "reward_me')  # SIGKILL in the middle of a write
    assert [r["epoch"] for r in read_metric_lines(path)] == [0, 1, 2, 3]
    assert [r["epoch"] for r in read_metrics(path)] == [0, 1, 2, 3]

    assert rewind_metrics(path, 1) == 3  # epochs 2, 3 and the cut line
    assert path.read_text() == '{"epoch": 0, "reward_mean": 0.0}\n{"epoch": 1, "reward_mean": 0.1}\n'
    assert rewind_metrics(path, 1) == 0
    append_metrics(path, {"epoch": 2, "reward_mean": 0.25})
    assert [(r["epoch"], r["reward_mean"]) for r in read_metrics(path)] == [(0, 0.0), (1, 0.1), (2, 0.25)]
    assert rewind_metrics(tmp_path / "missing.jsonl", 0) == 0
