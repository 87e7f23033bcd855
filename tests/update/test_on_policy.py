"""The update starts on-policy: the training forward scores the rollout's transitions as the sampler drew them (bf16
too), train/ratio_before_update measures it every epoch and a run warns once, naming the check script, when it is not
(update/on_policy.py)."""

import json

import pytest
import torch

from ddpo_group.update.on_policy import RATIO_TOLERANCE
from ddpo_group.update.on_policy import ratio_deviation
from trainer_helpers import tiny_trainer

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
