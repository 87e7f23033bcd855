"""Every preset trains 2 short epochs on the embedded tiny-shapes model with the shapes_alignment reward.

Skipped (with the reason) while the embedded model is not part of the package.
"""

import pytest
import torch

from config.base import PRESETS
from trainer_helpers import tiny_trainer


def embedded_model_available() -> bool:
    try:
        from ddpo_group.models import load_pipeline

        load_pipeline("tiny-shapes")
        from ddpo_group.rewards import make_reward_fn

        make_reward_fn("shapes_alignment")
        return True
    except Exception:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not embedded_model_available(), reason="the embedded tiny-shapes model is not installed")
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_two_epochs_on_the_embedded_model(preset, tmp_path):
    trainer = tiny_trainer(preset, "tiny-shapes", tmp_path, preset, **{
        "num_epochs": 2, "prompt_fn": "tiny_shapes", "reward_fn": "shapes_alignment", "sample.num_steps": 8})
    before = [p.detach().clone() for p in trainer.updater.params]
    metrics = trainer.run()
    assert metrics["epoch"] == 1 and metrics["global_step"] == 4
    assert torch.isfinite(torch.tensor(metrics["reward_mean"]))
    changed = sum(not torch.equal(b, p.detach()) for b, p in zip(before, trainer.updater.params))
    assert changed > len(before) // 2
