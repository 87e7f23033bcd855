"""Sizes that fit the card (update/memory_fit.py): "auto" pairs per forward, back-off on out-of-memory errors, the error
naming the setting; on CUDA the probe under a memory cap, and bf16 / fp16 epochs."""

import pytest
import torch

from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_trainer

from helpers.batch_helpers import rollout_batch
from ddpo_group.rollout.reward_scorer import RewardScorer
from ddpo_group.sampling.trajectories import DECODE_CHUNKS, decode_latents
from ddpo_group.update.memory_fit import (
    CPU_PAIRS_PER_FORWARD, DeviceOutOfMemory, configured_pairs, names_the_setting, probe_batch,
)


def test_the_setting_is_auto_or_a_positive_integer():
    assert configured_pairs("auto") is None and configured_pairs(12) == 12 and configured_pairs("7") == 7
    for bad in (0, -3, "big", 2.5, True):
        with pytest.raises(ValueError, match="train.pairs_per_forward=.* must be 'auto' or an integer >= 1"):
            configured_pairs(bad)


def test_auto_is_the_cpu_value_on_the_cpu_and_is_logged(tiny_model_dir, tmp_path):
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "auto_cpu", **{"train.pairs_per_forward": "auto",
                                                                            "device": "cpu"})
    metrics = trainer.run()
    assert metrics["train/pairs_per_forward"] == CPU_PAIRS_PER_FORWARD
    assert trainer.state.sizes == {}  # nothing measured, nothing to keep


def test_the_probe_batch_holds_exactly_the_asked_pairs_of_trainable_steps():
    batch = rollout_batch({}, torch.zeros(5, 6, 1), torch.zeros(5, 6, 1), torch.zeros(5, 6), {})
    trainable = torch.tensor([False, True, True, True, False, False])  # an SDE window of 3 steps
    probe, rows, mask = probe_batch(batch, 7, trainable)
    assert rows.tolist() == [0, 1, 2] and mask.sum() == 7 and mask[:, ~trainable].sum() == 0
    assert mask.tolist()[:2] == [[0, 1, 1, 1, 0, 0]] * 2 and mask[2].tolist() == [0, 1, 0, 0, 0, 0]
    assert torch.equal(probe.advantages, torch.zeros(5, 6))  # a rollout-KL batch has none yet


def test_out_of_memory_names_the_setting_to_lower():
    with pytest.raises(DeviceOutOfMemory, match=r"while training \(now train.pairs_per_forward=48\): lower "
                                                r"train.pairs_per_forward .*torch said: CUDA out of memory"):
        with names_the_setting("training", "train.pairs_per_forward=48"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore text")


def test_a_probe_peak_over_the_budget_fits_the_pairs_again_from_the_peak_of_many(monkeypatch):
    """A compiled forward's first call inflates peak(1): the two-point estimate (10 per pair) says 86 pairs fit a
    budget of 1000 where each pair takes 30; peak(86) = 2680 is over the budget, so the pairs are fitted again with
    (2680 - 150) // 85 = 29 per pair: (1000 - (150 - 29)) // 29 = 30 pairs, whose peak (1000) is within it. Above 3000
    the card runs out of memory: with a budget of 4000, 256 and 128 pairs do, 64 (2020) fit."""
    from types import SimpleNamespace

    from ml_collections import ConfigDict

    from ddpo_group.update import memory_fit

    def peak(k):  # bytes above the allocation of k pairs: 100 + 30 k, the first call 20 more (compilation)
        tried.append(k)
        if 100 + 30 * k > 3000:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return 150 if k == 1 else 100 + 30 * k

    config = ConfigDict({"train": {"batch_size": 16, "step_fraction": 1.0, "pairs_per_forward": "auto"},
                         "sample": {}})
    family = SimpleNamespace(stochastic_steps=lambda sample: torch.ones(16, dtype=torch.bool))  # at most 256 pairs
    probe = memory_fit.PairsPerForward(config, SimpleNamespace(device=torch.device("cpu")), family, {})
    probe.peak = lambda updater, batch, k, trainable: peak(k)
    monkeypatch.setattr(memory_fit, "traced_plan", lambda: [])  # no traced row: measured from 1 and 2
    updater = SimpleNamespace(optimizer=None)
    for budget, expected, sizes, said in ((1000, 30, [1, 2, 86, 30], "86 peaked at "),
                                          (4000, 64, [1, 2, 256, 128, 64], "256 ran out of memory, 128 ran out")):
        tried = []
        original = memory_fit.memory_budget
        memory_fit.memory_budget = lambda device: budget / memory_fit.HEADROOM
        try:
            n, detail = probe._fit(updater, {})
        finally:
            memory_fit.memory_budget = original
        assert (n, tried) == (expected, sizes) and 100 + 30 * n <= budget and said in detail, (budget, n, tried, detail)


class ChunkedFamily:
    """decode() runs out of memory above ``most`` latents at a time; records the chunk sizes it was called with."""

    def __init__(self, most: int):
        self.most, self.calls = most, []

    def decode(self, latents):
        self.calls.append(len(latents))
        if len(latents) > self.most:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return latents * 2


def test_decoding_halves_its_chunk_after_an_out_of_memory_error_and_remembers_it():
    family, latents = ChunkedFamily(most=3), torch.arange(10.0)[:, None]
    torch.testing.assert_close(decode_latents(family, latents), latents * 2)
    assert family.calls[:3] == [10, 5, 2] and DECODE_CHUNKS[family] == 2  # 10 and 5 failed
    family.calls.clear()
    torch.testing.assert_close(decode_latents(family, latents), latents * 2)
    assert family.calls == [2] * 5  # no failed attempt the second time


def test_a_reward_that_runs_out_of_memory_is_called_on_halves_with_per_image_info():
    calls = []

    def reward(images, prompts, metadata):
        calls.append(len(prompts))
        if len(prompts) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return images.double().sum(dim=1), {"doubled": 2 * images.double().sum(dim=1), "model": "m"}

    images = torch.arange(5.0)[:, None]
    score = RewardScorer(reward, "oom_test")
    rewards, info = score(images, list("abcde"), [{}] * 5)
    torch.testing.assert_close(rewards, torch.arange(5.0, dtype=torch.float64))
    torch.testing.assert_close(info["doubled"], 2 * torch.arange(5.0, dtype=torch.float64))
    assert info["model"] == "m" and calls == [5, 2, 2, 1] and score.chunk == 2
    calls.clear()  # the scorer remembers the size that fits: no failed attempt the second time
    torch.testing.assert_close(score(images, list("abcde"), [{}] * 5)[0], rewards)
    assert calls == [2, 2, 1] and RewardScorer(reward, "oom_test").chunk is None  # another scorer starts afresh


# ------------------------------------------------------------------------------------------------ on a GPU
@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_mixed_precision_epoch_on_cuda_trains(tiny_model_dir, tmp_path, precision):
    trainer = tiny_trainer("group_ppo", tiny_model_dir, tmp_path, precision, **{"mixed_precision": precision,
                                                                                 "device": "cuda"})
    before = [p.detach().clone() for p in trainer.updater.params]
    metrics = trainer.run()
    assert trainer.accelerator.device.type == "cuda"
    assert all(p.dtype == torch.float32 for p in trainer.updater.params)  # LoRA weights train in fp32
    assert trainer.family.model.dtype in (torch.bfloat16, torch.float16) or precision == "no"
    assert torch.isfinite(torch.tensor(metrics["train/policy_loss"])) and metrics["reward_count"] == 8
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, trainer.updater.params))


@pytest.mark.cuda
def test_auto_pairs_fit_a_memory_cap_and_are_kept_in_the_checkpoint(tiny_sd3_dir, tmp_path):
    """Uncapped, the tiny model fits a whole train batch; under a cap of the allocation plus a few pairs' worth, the
    probe picks fewer, the epoch runs without an out-of-memory error and its peak stays under the cap."""
    overrides = {**FAMILY_OVERRIDES["sd3"], "sample.resolution": 128,  # 256 tokens: about a MB a pair
                 "train.pairs_per_forward": "auto", "device": "cuda", "train.batch_size": 8,
                 "sample.batch_size": 8, "sample.num_batches_per_epoch": 1, "save_freq": 1}
    free = tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "uncapped", **overrides)
    uncapped = free.run()["train/pairs_per_forward"]
    t, steps = free.config.train, int(free.family.stochastic_steps(free.config.sample).sum())
    assert uncapped == int(t.batch_size * steps * t.step_fraction)  # a whole train batch's pairs
    assert free.pairs_per_forward.sizes["pairs_per_forward"] == uncapped  # recorded for the checkpoint
    del free
    torch.cuda.empty_cache()

    trainer = tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "capped", **overrides)
    device, total = trainer.accelerator.device, torch.cuda.get_device_properties(0).total_memory
    from ddpo_group.update.memory_fit import PairsPerForward

    rollouts = trainer.rollouts.estimate(trainer.rollouts.collect(0))
    trainer.updater.model.train()
    peaks = [PairsPerForward.peak(trainer.pairs_per_forward, trainer.updater, rollouts.batch, k,
                                   trainer.family.stochastic_steps(trainer.config.sample)) for k in (1, 2)]
    per = peaks[1] - peaks[0]
    cap = torch.cuda.memory_allocated(device) + peaks[0] + 6 * per  # room for about 7 pairs before the headroom
    torch.cuda.set_per_process_memory_fraction(cap / total, torch.cuda.current_device())
    try:
        torch.cuda.reset_peak_memory_stats(device)
        train = trainer.updater.train_epoch(rollouts.batch, show_progress=False)
        assert torch.cuda.max_memory_allocated(device) <= cap
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
    assert 1 <= train["pairs_per_forward"] < uncapped
    assert trainer.state.state_dict()["sizes"]["pairs_per_forward"] == train["pairs_per_forward"]
    trainer.rollouts.close()


def test_a_traced_plan_row_of_the_run_is_the_first_guess(tmp_path, monkeypatch):
    """With the memory plan's row of this very run (``plan_key``'s fields and the state's shape), the size is its
    first guess, run once: a budget of 0.85 x 20 = 17 GiB, the trace's 1 GiB a pair and 3 - 1 = 2 GiB fixed give
    floor((17 - 2) / 1) = 15 pairs, whose peak (2 + 15 = 17 GiB) is within it. A row of another run (other trainable
    parameters) is no guess, nor a row that fits no 80 GB card: 1 and 2 pairs are measured. A guess over the budget (a pair takes 1.5 GiB, not the
    trace's 1) falls back to the measurement: 10 pairs. A trace that was high (2 GiB a pair, so 3 - 2 = 1 GiB fixed:
    8 pairs) grows to the size its own peak gives: (2 + 8 - 1) / 8 = 1.125 GiB a pair, floor(16 / 1.125) = 14."""
    import json
    from types import SimpleNamespace

    from ml_collections import ConfigDict

    from ddpo_group.update import memory_fit

    gib = 2**30
    config = ConfigDict({"train": {"batch_size": 16, "step_fraction": 1.0, "pairs_per_forward": "auto",
                                   "use_8bit_adam": False, "ema": False},
                         "sample": {}, "use_lora": True, "lora_dropout": 0.0, "mixed_precision": "bf16",
                         "algorithm": {"objective": "policy_gradient"}, "pretrained": {"text_encoder_device": ""}})
    family = SimpleNamespace(name="sd3", stochastic_steps=lambda sample: torch.ones(16, dtype=torch.bool),
                             model=SimpleNamespace(is_gradient_checkpointing=False))
    updater = SimpleNamespace(optimizer=None, params=[torch.zeros(10, 10)], uses_reference=True,
                              scorer=SimpleNamespace(guidance_scale=4.5))
    batch = SimpleNamespace(latents=torch.zeros(2, 3, 16, 8, 8))
    row = {**memory_fit.plan_key(family, config, updater), "state": [16, 8, 8], "shape": "sd35m", "pairs_80GB": 12,
           "per_pair_gib": 1.0, "held_gib": 7.0, "kinds_1_gib": {"parameters": 5.0, "gradients": 0.0, "activations": 3.0,
                                                               "temporaries": 0.0}}
    assert row["trainable"] == 100 and row["mode"] == "lora" and row["cfg"] and row["reference_forward"]
    monkeypatch.setattr(memory_fit, "PLAN_PATH", tmp_path / "plan.jsonl")
    monkeypatch.setattr(memory_fit, "memory_budget", lambda device: 20 * gib)
    probe = memory_fit.PairsPerForward(config, SimpleNamespace(device=torch.device("cpu")), family, {})
    cases = ((row, 1.0, 15, [15]), ({**row, "trainable": 99}, 1.0, 15, [1, 2]), (row, 1.5, 10, [15, 1, 2]),
             ({**row, "pairs_80GB": 0}, 1.0, 15, [1, 2]),
             ({**row, "per_pair_gib": 2.0}, 1.0, 14, [8, 14]))
    for plan_row, per_pair, expected, tried_first in cases:
        (tmp_path / "plan.jsonl").write_text("not json\n" + json.dumps(plan_row) + "\n")
        tried = []

        def peak(updater, batch, k, trainable):  # 2 GiB fixed, per_pair GiB a pair
            tried.append(k)
            return int((2 + per_pair * k) * gib)

        probe.peak = peak
        n, detail = probe._fit(updater, batch)
        assert (n, tried[:len(tried_first)]) == (expected, tried_first), (plan_row["trainable"], per_pair, n, tried)
        assert ("first guess" in detail) == (tried_first[0] != 1), detail
