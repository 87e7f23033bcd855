"""The learning-proof script runs end to end (mechanics only, on the tiny random model)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_compare_algorithms_runs(tiny_model_dir, tmp_path):
    import compare_algorithms

    sets = ["pretrained.model=" + tiny_model_dir, "prompt_fn=simple_animals", "reward_fn=jpeg_compressibility",
            "sample.num_steps=3", "sample.batch_size=4", "sample.num_batches_per_epoch=1", "train.batch_size=4",
            "train.group_size=2", "train.pairs_per_forward=12"]
    args = ["--presets", "grpo,remax", "--seeds", "0,1", "--queries", "8", "--eval-samples", "4", "--threshold", "-100",
            "--out", str(tmp_path)] + [x for s in sets for x in ("--set", s)]
    rows = compare_algorithms.main(args)
    assert len(rows) == 4 and all(r["queries_to_threshold"] is not None for r in rows)
    assert [r["queries"] for r in rows] == [8, 8, 6, 6]  # remax: 4 samples + 2 greedy per epoch, 1 epoch
    assert (tmp_path / "reward_vs_queries.png").exists() and "| grpo |" in (tmp_path / "results.md").read_text()
