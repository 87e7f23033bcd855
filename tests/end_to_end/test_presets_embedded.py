"""Every preset trains 2 short epochs on each embedded model (tiny-shapes, DDIM; tiny-shapes-flow, Flow-SDE) with the
shapes_alignment reward.

Skipped (with the reason) while an embedded model is not part of the package.
"""

import functools

import pytest
import torch

from config.base import PRESETS, base
from helpers.trainer_helpers import tiny_trainer


@functools.lru_cache(maxsize=None)  # a test worker asks once per model (20 preset tests, the learning tests' marks)
def embedded_model_available(model: str = "tiny-shapes") -> bool:
    try:
        from ddpo_group.models import load_pipeline

        load_pipeline(model, config=base())
        from ddpo_group.rewards import make_reward_fn

        make_reward_fn("shapes_alignment")
        return True
    except Exception:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-shapes", "tiny-shapes-flow"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_two_epochs_on_the_embedded_model(preset, model, tmp_path):
    if not embedded_model_available(model):
        pytest.skip(f"the embedded {model} model is not installed")
    trainer = tiny_trainer(preset, model, tmp_path, preset, **{
        "num_epochs": 2, "prompt_fn": "tiny_shapes", "reward_fn": "shapes_alignment", "sample.num_steps": 4})
    before = [p.detach().clone() for p in trainer.updater.params]
    metrics = trainer.run()
    assert trainer.family.name == ("sd3" if model.endswith("flow") else "sd")
    assert metrics["epoch"] == 1 and metrics["global_step"] == 4
    assert torch.isfinite(torch.tensor(metrics["reward_mean"]))
    changed = sum(not torch.equal(b, p.detach()) for b, p in zip(before, trainer.updater.params))
    assert changed > len(before) // 2
