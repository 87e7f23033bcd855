"""The update starts on-policy: the training forward scores the rollout's transitions as the sampler drew them (bf16
too), train/ratio_before_update and train/clipped_before_update measure it every epoch against the precision's
rounding and the clip range, and a run warns once, naming the check script, when it is not (update/on_policy.py);
train/policy_kl is the exact KL of each trained step's Gaussian to the rollout's."""

import json

import pytest
import torch

from ddpo_group.algorithms import gaussian_kl
from ddpo_group.update.on_policy import CLIPPED_SHARE, RATIO_TOLERANCE, OnPolicyWatch, ratio_deviation
from helpers.trainer_helpers import tiny_trainer

EMBEDDED = {"tiny-shapes": {}, "tiny-shapes-flow": {"prompt_fn": "tiny_shapes_flow_hard"}}


def rescored_ratio_gap(trainer, batch) -> float:
    """max |ratio - 1| of every recorded (sample, step) pair scored again as the update scores them, 6 pairs a forward."""
    steps = batch.num_steps
    rows, columns = torch.arange(len(batch)).repeat_interleave(steps), torch.arange(steps).repeat(len(batch))
    trainer.scorer.prepare(steps, trainer.accelerator.device)
    trainer.model.train()
    with torch.no_grad(), trainer.accelerator.autocast():
        log_prob = torch.cat([trainer.scorer(trainer.model, batch, rows[c], columns[c]).log_prob.float()
                              for c in torch.split(torch.arange(len(rows)), 6)])
    return float(ratio_deviation(log_prob, batch.log_probs[rows, columns]).max())


@pytest.mark.parametrize("model", sorted(EMBEDDED))
def test_bf16_rollouts_record_the_rounded_sample_the_training_forward_scores(model, tmp_path):
    """Under bf16 the sampler goes on from each x_{n+1} rounded to bf16: that rounded latent is the sample, recorded
    with its log-probability. Recording the float32 one instead put every ratio of a bf16 run off 1 before any update
    (1.0e-2 on tiny-shapes, 6.8e-2 on tiny-shapes-flow, measured on this CPU), 100 to 700 times the clip range."""
    trainer = tiny_trainer("grpo", model, tmp_path, "bf16", mixed_precision="bf16", device="cpu",
                           **{"sample.sde_window_size": 0, **EMBEDDED[model]})
    batch = trainer.rollouts.sample_round(0, 0).batch
    trainer.rollouts.close()
    assert batch.cond["prompt_embeds"].dtype == torch.bfloat16
    assert torch.equal(batch.next_latents.bfloat16().float(), batch.next_latents)  # the rounded samples
    assert rescored_ratio_gap(trainer, batch) < 1e-5


def test_every_epoch_logs_the_ratio_before_its_update(tiny_model_dir, tmp_path):
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "ratio", num_epochs=2, device="cpu")
    said = []
    trainer.on_policy.say = said.append
    trainer.run()
    lines = [json.loads(line) for line in (tmp_path / "ratio" / "metrics.jsonl").read_text().splitlines()]
    assert [0 <= line["train/ratio_before_update"] < 1e-5 for line in lines] == [True, True]
    assert [line["train/clipped_before_update"] for line in lines] == [0.0, 0.0]  # clip_range 0.2 of the tiny runs
    assert said == []


def test_a_training_forward_that_differs_from_the_sampler_is_measured_and_warned_about_once(tiny_model_dir, tmp_path):
    """A training forward with another guidance scale than the sampler's (a mismatch built for the test) is off-policy
    from its first step: the epoch's ratio before the update says by how much, and one warning names the check."""
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "off", num_epochs=2, device="cpu")
    trainer.scorer.guidance_scale = trainer.config.sample.guidance_scale + 2.0
    said = []
    trainer.on_policy.say = said.append
    trainer.run()
    lines = [json.loads(line) for line in (tmp_path / "off" / "metrics.jsonl").read_text().splitlines()]
    assert all(line["train/ratio_before_update"] > RATIO_TOLERANCE["no"] for line in lines)
    assert len(said) == 1 and "train/ratio_before_update=" in said[0] and "scripts/check.py" in said[0]


def test_the_warning_judges_the_ratio_against_the_clip_range_too():
    """A ratio within bf16's rounding tolerance (5e-3) but 30 times the clip range (1e-4) on 40% of the pairs: the
    clip acts on rounding before any update, and the warning says so; below 1% clipped and within the tolerance,
    nothing is said."""
    said = []
    watch = OnPolicyWatch("bf16", "train.clip_range=0.0001", say=said.append)
    watch(3e-3, 0.4 * CLIPPED_SHARE)
    assert said == []  # within the tolerance, fewer pairs clipped than the bound
    watch(3e-3, 40 * CLIPPED_SHARE)
    assert len(said) == 1 and "train/clipped_before_update=0.4" in said[0] and "train.clip_range=0.0001" in said[0]
    assert "ratio_before_update" not in said[0].split("train/clipped_before_update")[0]  # the ratio is not the reason
    watch(1.0, 1.0)
    assert len(said) == 1  # once


def test_a_clip_range_below_the_rounding_shows_in_the_share_clipped_before_the_update(tiny_model_dir, tmp_path):
    """The same run, a training forward off the sampler's by a guidance change: with a clip range far above the
    ratios none of the pairs is clipped before the update; with one far below them every pair is."""
    shares = {}
    for clip in (10.0, 1e-9):
        trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, f"clip{clip}", device="cpu",
                               **{"train.clip_range": clip})
        trainer.scorer.guidance_scale = trainer.config.sample.guidance_scale + 2.0
        trainer.on_policy.say = lambda line: None
        shares[clip] = trainer.run()["train/clipped_before_update"]
    assert shares == {10.0: 0.0, 1e-9: 1.0}


def test_the_policy_kl_is_the_gaussian_kl_of_the_recorded_and_recomputed_step_means(tiny_model_dir, tmp_path):
    """train/policy_kl of an epoch of one train batch, before its optimizer step, against the KL computed by hand from
    the batch's recorded step means and the training forward's: equal; 0 at the rollout weights for any
    noise in the recorded latents, and positive once the weights moved."""
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "kl", device="cpu", **{"sample.num_batches_per_epoch": 1})
    prompts, metadata, _ = trainer.prompt_sampler.sample_epoch(1, 4)
    batch = trainer.rollouts.sampler.sample(trainer.family.model, prompts, metadata, desc=None)
    trainer.rollouts.close()
    assert batch.step_means is not None and batch.step_means.shape[:2] == batch.log_probs.shape
    import dataclasses

    batch = dataclasses.replace(batch, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand(4, 4).clone())
    first = trainer.updater.train_epoch(batch, show_progress=False)
    assert first["policy_kl"] == pytest.approx(0.0, abs=1e-10) and first["policy_kl_max"] == pytest.approx(0.0, abs=1e-10)
    rows, steps = torch.arange(4).repeat_interleave(4), torch.arange(4).repeat(4)
    trainer.model.train()
    with torch.no_grad():  # by hand at the weights after the first epoch's optimizer step
        out = trainer.scorer(trainer.model, batch, rows, steps)
    by_hand = gaussian_kl(out.mean, batch.step_means[rows, steps], out.std)
    second = trainer.updater.train_epoch(batch, show_progress=False)  # its KL read before its own optimizer step
    assert second["policy_kl"] > 0
    assert second["policy_kl"] == pytest.approx(float(by_hand.mean()), rel=1e-4)
    assert second["policy_kl_max"] == pytest.approx(float(by_hand.max()), rel=1e-4)


def test_recomputing_the_rollout_with_the_training_forward_puts_a_differing_sampler_back_on_policy(tiny_model_dir,
                                                                                                  tmp_path):
    """Flow-DPPO with a training forward off the sampler's (another guidance scale): the mask blocks pairs before any
    update, the share it blocks (not every pair beyond the bound) is the one warned about; with
    train.recompute_rollout the rollout's log-probabilities and step means are the training forward's at the rollout
    weights: every ratio 1, nothing blocked, and rollout_recomputed_kl says how far the sampler was."""
    results = {}
    for recompute in (False, True):
        trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, f"recompute{recompute}", device="cpu",
                               **{"algorithm.policy_loss": "dppo", "train.recompute_rollout": recompute})
        trainer.scorer.guidance_scale = trainer.config.sample.guidance_scale + 2.0
        trainer.on_policy.say = lambda line: None
        results[recompute] = trainer.run()
    off, on = results[False], results[True]
    assert off["train/ratio_before_update"] > 1e-2 and 0 < off["train/clipped_before_update"] < 1.0
    assert "train/rollout_recomputed_kl" not in off
    assert on["train/ratio_before_update"] < 1e-5 and on["train/clipped_before_update"] == 0.0
    assert on["train/rollout_recomputed_kl"] > 1e-5
