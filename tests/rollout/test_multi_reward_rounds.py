"""multi_reward_mix="advantage_aggr" in a run: config checks, and one epoch with two built-in rewards."""

import json

import pytest
import torch

from config.base import get_config
from ddpo_group.run.config_checks import ConfigError, validate_config
from helpers.trainer_helpers import tiny_trainer

COMBINATION = {"jpeg_compressibility": 1.0, "shapes_alignment": 2.0}


def config_of(preset, **overrides):
    config = get_config(preset)
    config.reward_fn = COMBINATION
    config.algorithm.multi_reward_mix = "advantage_aggr"
    for key, value in overrides.items():
        section, field = key.split(".")
        config[section][field] = value
    return config


@pytest.mark.parametrize("preset, overrides", [
    ("grpo", {"algorithm.global_std": True}),  # GDPO
    ("grpo", {"train.scale_rewards": False}),  # MixGRPO
    ("dr_grpo", {}),
    ("rloo", {}),
    ("grpo_passk", {"train.scale_rewards": False}),
])
def test_group_estimators_that_keep_the_groups_apart_are_accepted(preset, overrides):
    validate_config(config_of(preset, **overrides))
    single = config_of(preset, **overrides)
    single.reward_fn = "jpeg_compressibility"  # a single reward is its own component
    validate_config(single)


@pytest.mark.parametrize("preset, overrides, message", [
    ("grpo", {}, r"divide the normalised sum by its group std again.*algorithm.global_std=True \(GDPO"),
    ("grpo_passk", {}, r"group std again.*set train.scale_rewards=False \(MixGRPO"),
    ("ddpo", {}, r"compares a prompt group's samples, one of \['dr_grpo', 'grpo', 'grpo_passk', 'rloo', 'tree_grpo'\]"),
    ("reinforce_pp", {}, r"adv_estimator='reinforce_plus_plus': normalising each reward within its prompt group"),
    ("group_ppo", {}, r"a critic cannot learn it"),
    ("grpo", {"algorithm.multi_reward_mix": "gdpo"}, r"multi_reward_mix='gdpo' must be one of \('reward_aggr', 'adv"),
])
def test_contradictions_are_named(preset, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(config_of(preset, **overrides))


def test_one_epoch_logs_each_components_advantages(tiny_model_dir, tmp_path):
    """GDPO (grpo with the batch std) on jpeg_compressibility + 2 x shapes_alignment: the advantages and the logged
    adv/<component>/* are those of the round's component rewards, recomputed here by hand."""
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "gdpo", **{
        "prompt_fn": "tiny_shapes", "reward_fn": COMBINATION, "algorithm.multi_reward_mix": "advantage_aggr",
        "algorithm.global_std": True, "kl.beta": 0.0, "kl.use_reference_model": False})
    epochs, estimate = [], trainer.rollouts.estimate
    trainer.rollouts.estimate = lambda rounds: epochs.append(estimate(rounds)) or epochs[-1]
    before = [p.detach().clone() for p in trainer.updater.params]
    metrics = trainer.run()
    (logged,) = [json.loads(line) for line in (tmp_path / "gdpo" / "metrics.jsonl").read_text().splitlines()]

    round0 = epochs[0].rounds[0]
    batch, groups = round0.batch, torch.tensor(round0.groups)
    info = batch.reward_info
    jpeg, shapes = info["jpeg_compressibility"], info["shapes_alignment"]
    torch.testing.assert_close(round0.gathered.rewards, jpeg + 2 * shapes, rtol=0, atol=1e-12)  # the sum is logged
    zs = {}
    for label, r in (("jpeg_compressibility", jpeg), ("shapes_alignment", shapes)):
        z = torch.empty_like(r)
        for g in groups.unique():  # 2 groups of 4: (r - mean) / (Bessel std + 1e-6)
            rows = groups == g
            z[rows] = (r[rows] - r[rows].mean()) / (r[rows].std() + 1e-6)
        zs[label] = z
        assert z.abs().max() > 0.1  # both rewards vary within a group: both components drive the advantage
        for stat in ("mean", "std", "min", "max"):
            value = {"mean": z.mean(), "std": z.std(unbiased=False), "min": z.min(), "max": z.max()}[stat]
            assert logged[f"adv/{label}/{stat}"] == pytest.approx(float(value), abs=1e-9), (label, stat)
        assert logged[f"adv/{label}/zero_std_ratio"] == 0.0
    S = zs["jpeg_compressibility"] + 2 * zs["shapes_alignment"]
    gdpo = ((S - S.mean()) / (S.std() + 1e-6)).clamp(-5, 5)
    torch.testing.assert_close(batch.advantages.cpu(), gdpo.float()[:, None].expand(-1, 4), rtol=1e-6, atol=1e-6)
    assert logged["adv/std"] == pytest.approx(float(gdpo.std(unbiased=False)), abs=1e-9)
    assert metrics["adv/jpeg_compressibility/std"] == logged["adv/jpeg_compressibility/std"]
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, trainer.updater.params))


def test_default_logs_no_component_advantages(tiny_model_dir, tmp_path):
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "sum", **{
        "prompt_fn": "tiny_shapes", "reward_fn": COMBINATION, "kl.beta": 0.0, "kl.use_reference_model": False})
    round0 = trainer.rollouts.estimate_round(trainer.rollouts.sample_round(0, 0))
    trainer.rollouts.close()
    assert round0.component_metrics == {}
    R, groups = round0.gathered.rewards, torch.tensor(round0.groups)
    mean = torch.stack([R[groups == g].mean() for g in groups.tolist()])
    std = torch.stack([R[groups == g].std() for g in groups.tolist()])
    torch.testing.assert_close(round0.batch.advantages[:, 0].cpu(), ((R - mean) / (std + 1e-6)).clamp(-5, 5).float())
