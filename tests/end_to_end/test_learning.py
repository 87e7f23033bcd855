"""ddpo, grpo and group_ppo learn: on a caption the embedded model draws wrong most of the time, 10 epochs raise
the reward of a fixed evaluation set (the learning proof's settings on one prompt; about 30 s each)."""

import sys
from pathlib import Path

import pytest

from test_presets_embedded import embedded_model_available

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

HARD_PROMPT = "a white circle on a yellow background"  # base model: the right shape about a quarter of the time


@pytest.mark.slow
@pytest.mark.skipif(not embedded_model_available(), reason="the embedded tiny-shapes model is not installed")
@pytest.mark.parametrize("preset", ["ddpo", "grpo", "group_ppo"])
def test_ten_epochs_raise_the_reward_of_a_hard_prompt(preset, tmp_path):
    import compare_algorithms

    prompts = tmp_path / "prompt.txt"
    prompts.write_text(HARD_PROMPT + "\n")
    # on the CPU, where the thresholds were measured: a GPU draws other random streams (group_ppo gained 0.029 there
    # from another starting point, 0.778), and three seeds of a 10-epoch run are not a GPU's learning proof
    sets = ["device=cpu", "sample.num_steps=10", "sample.sde_window_size=2", "train.learning_rate=0.003", "prompt_fn=from_file",
            f"prompt_fn_kwargs.path={prompts}"]
    (row,) = compare_algorithms.main(["--presets", preset, "--seeds", "0", "--queries", "320", "--eval-samples", "32",
                                      "--out", str(tmp_path / "out")] + [x for s in sets for x in ("--set", s)])
    # measured: 0.733 before; after 10 epochs ddpo 0.884, grpo 0.895, group_ppo 0.819
    assert row["queries"] == 320 and row["before"] < 0.8
    assert row["after"] - row["before"] > 0.04, row
