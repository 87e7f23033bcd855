"""What a run hands over, scored where nothing was chosen (run/fresh_evaluation.py), its verdict
(run/reporting/verdict.py, summary.json), and the guard's complete restore (run/best_weights.py: the weights with
everything else the run had learned at the restored evaluation)."""

import json
import math

import pytest
import torch

from ddpo_group.run.fresh_evaluation import FRESH_NOISE, paired
from ddpo_group.run.persistence.manifest import MANIFEST, write_manifest
from ddpo_group.run.reporting.verdict import DID_NOT_LEARN, FELL, HACKED, LEARNED, verdict
from helpers.trainer_helpers import tiny_trainer

EVALUATED = {"eval_freq": 1, "eval_num_prompts": 2, "eval_num_seeds": 2, "final_eval_num_seeds": 3, "device": "cpu"}


def test_paired_change_and_its_standard_error_by_hand():
    weights, base = torch.tensor([1.0, 2.0, 4.0, 3.0]), torch.tensor([0.5, 2.0, 3.0, 3.5])
    out = paired(weights, base, ["a", "a", "b", "b"])
    difference = [0.5, 0.0, 1.0, -0.5]  # mean 0.25, sample variance (0.0625 + 0.0625 + 0.5625 + 0.5625) / 3
    assert out["change"] == pytest.approx(0.25) and out["before"] == pytest.approx(2.25)
    assert out["se"] == pytest.approx(math.sqrt(1.25 / 3) / 2)
    assert out["per_prompt"] == pytest.approx({"a": 0.25, "b": 0.25})
    assert sum(difference) / 4 == pytest.approx(out["change"])


@pytest.mark.parametrize("change, se, same, heldout, expected", [
    (0.05, 0.01, False, None, LEARNED),
    (0.019, 0.01, False, None, DID_NOT_LEARN),  # within 2 SE
    (-0.019, 0.01, False, None, DID_NOT_LEARN),
    (-0.03, 0.01, False, None, FELL),
    (0.0, 0.0, True, None, DID_NOT_LEARN),  # the starting weights: every image the base model's
    (0.05, float("nan"), False, None, DID_NOT_LEARN),  # one image: no standard error, no claim
    (0.05, 0.01, False, {"change": -0.03, "se": 0.01}, HACKED),
    (0.05, 0.01, False, {"change": -0.01, "se": 0.01}, LEARNED),
])
def test_the_verdict_reads_the_change_against_two_standard_errors(change, se, same, heldout, expected):
    name, why = verdict(change, se, same, heldout)
    assert name == expected
    assert ("starting weights" in why) == same and "+0.000 " not in why


@pytest.mark.parametrize("heldout", ["", "jpeg_incompressibility"])
def test_a_run_scores_what_it_hands_over_and_its_best_beside_the_base_model_on_fresh_noises(tiny_model_dir, tmp_path,
                                                                                           heldout):
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "run", num_epochs=2, eval_reward_fn=heldout, **EVALUATED)
    fresh = trainer.evaluations.fresh.periodic
    during = trainer.evaluations.periodic
    rows = list(range(fresh.num_rows))
    assert fresh.num_rows == 2 * 3 and fresh.first_noise == FRESH_NOISE
    used = during.initial_noise(list(range(during.num_rows)))
    assert not any(torch.equal(noise, seen) for noise in fresh.initial_noise(rows) for seen in used)
    trainer.run()
    record = json.loads((tmp_path / "run" / "summary.json").read_text())
    final = record["fresh"]["reward"]["final"]
    # the weights it hands over, scored again on the fresh noises; the base model's scores kept from before training
    after = fresh.run(0).rewards
    base = trainer.evaluations.fresh.base
    assert final["after"] == pytest.approx(float(after.mean()), abs=1e-12)
    assert final["before"] == pytest.approx(float(base.mean()), abs=1e-12)
    assert final["se"] == pytest.approx(float((after - base).std()) / math.sqrt(6), abs=1e-12)
    untrained = tiny_trainer("grpo", tiny_model_dir, tmp_path, "untrained", num_epochs=2, **EVALUATED)
    assert torch.equal(untrained.evaluations.fresh.periodic.run(-1).rewards, base)  # the base model's, exactly
    untrained.rollouts.close()
    best = record["fresh"]["reward"]["best"]
    with trainer.evaluations.best.swapped_in():
        assert best["after"] == pytest.approx(float(fresh.run(0).rewards.mean()), abs=1e-12)
    assert best["epoch"] == json.loads((tmp_path / "run" / "lora_best" / "best.json").read_text())["epoch"]
    heldout_final = record["fresh"]["heldout"]["final"] if heldout else None
    assert record["verdict"] == verdict(final["change"], final["se"], heldout=heldout_final)[0]
    assert record["restores"] == [] and ("heldout" in record["fresh"]) == bool(heldout)
    text = (tmp_path / "run" / "summary.txt").read_text()
    assert f"{final['change']:+.4f} ± {final['se']:.4f}" in text and record["why"] in text
    assert (tmp_path / "run" / "samples" / "fresh_final.png").is_file()
    trainer.rollouts.close()


def test_a_groupwise_reward_is_judged_on_each_images_own_score(tiny_model_dir, tmp_path):
    """A rank's mean over a group is 1/2 whatever the images: the fresh evaluation pairs each image's own score (the
    ranked reward's, rewards/base.py's pointwise_score) with the base model's instead, as the guard reads it."""
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "run", num_epochs=2, reward_fn="rank",
                           reward_fn_kwargs={"reward_fn": "jpeg_incompressibility"}, **EVALUATED)
    trainer.run()
    record = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert record["fresh"]["reward_measure"] == "eval/reward_info/score"
    result = trainer.evaluations.fresh.periodic.run(0)
    assert float(result.rewards.mean()) == pytest.approx(0.5, abs=1e-12)  # the rank's mean says nothing
    final = record["fresh"]["reward"]["final"]
    assert final["after"] == pytest.approx(float(result.pointwise.mean()), abs=1e-12)
    assert final["before"] == pytest.approx(float(trainer.evaluations.fresh.base.mean()), abs=1e-12)
    base = trainer.evaluations.fresh.base
    assert final["change"] == pytest.approx(float((result.pointwise - base).mean()), abs=1e-12)
    assert final["before"] != pytest.approx(0.5, abs=0.05)  # the scores' mean, not the ranks' 1/2
    assert "each image's own score, reward_info/score" in (tmp_path / "run" / "summary.txt").read_text()
    trainer.rollouts.close()


def test_a_run_that_cannot_learn_says_it_did_not_learn(tiny_model_dir, tmp_path):
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "run", num_epochs=2,
                           **{**EVALUATED, "train.learning_rate": 1e-12})
    trainer.run()
    record = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert record["verdict"] == DID_NOT_LEARN
    assert "did not learn" in (tmp_path / "run" / "summary.txt").read_text()
    trainer.rollouts.close()


def test_a_run_resumed_from_a_checkpoint_without_the_base_models_fresh_scores_scores_them_at_the_end(tiny_model_dir,
                                                                                                    tmp_path):
    """A checkpoint written before the fresh evaluation existed (its piece removed): the run resumes, and with LoRA
    the base model's fresh scores come from the adapters disabled, the same as a run that kept them."""
    overrides = {**EVALUATED, "save_freq": 1}
    whole = tiny_trainer("grpo", tiny_model_dir, tmp_path, "whole", num_epochs=2, **overrides)
    whole.run()
    whole.rollouts.close()
    first = tiny_trainer("grpo", tiny_model_dir, tmp_path, "old", num_epochs=1, **overrides)
    first.run()
    first.rollouts.close()
    state_file = tmp_path / "old" / "checkpoints" / "checkpoint_00000" / "training_state.json"
    state = json.loads(state_file.read_text())
    state["pieces"] = [piece for piece in state["pieces"] if piece["name"] != "fresh_evaluation"]
    state_file.write_text(json.dumps(state))
    record = json.loads((state_file.parent / MANIFEST).read_text())
    write_manifest(state_file.parent, {k: v for k, v in record.items() if k != "files"})
    resumed = tiny_trainer("grpo", tiny_model_dir, tmp_path, "old", num_epochs=2,
                           resume_from=str(tmp_path / "old"), **overrides)
    resumed.run()
    resumed.rollouts.close()
    kept, rescored = (json.loads((tmp_path / name / "summary.json").read_text())["fresh"]["reward"]["final"]
                      for name in ("whole", "old"))
    assert rescored["before"] == pytest.approx(kept["before"], abs=1e-6)


def flat(tree, path=""):
    """{path: leaf} of a state tree."""
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in flat(value, f"{path}/{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, value in enumerate(tree) for k, v in flat(value, f"{path}/{i}").items()}
    return {path: tree}


def same(a, b) -> bool:
    a, b = flat(a), flat(b)
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else
        (a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k]))) for k in a)


def test_a_restore_puts_back_everything_the_run_had_learned_at_the_restored_evaluation(tiny_model_dir, tmp_path):
    """GROUP_PPO with its critic and controller, a KL term to a reference adapter that follows the policy and gates
    on the prompts below their start, an EMA: after a fall the policy's weights and optimizer, the stat tracker, the
    critic's network and optimizer, the controller's tau, the KL term's gates and reference adapter, the EMA are each
    bitwise what they were at the restored evaluation; listed in best.json, the metrics and the summary."""
    from test_guard import scripted_falls

    overrides = {**EVALUATED, "num_epochs": 4, "guard.on_alarm": "restore", "train.ema": True,
                 "train.ema_eval": False, "kl.beta": 0.5,
                 "kl.use_reference_model": True, "kl.reference_update_freq": 1, "kl.only_below_start": True}
    trainer = tiny_trainer("group_ppo", tiny_model_dir, tmp_path, "run", **overrides)
    learned = {}
    evaluate = trainer.evaluations.evaluate

    def evaluate_and_keep(epoch, restored=None):
        metrics = evaluate(epoch, restored)
        learned[epoch] = (trainer.learned_state(), [p.detach().clone() for p in trainer.params])
        return metrics

    trainer.evaluations.evaluate = evaluate_and_keep
    scripted_falls(trainer, {2})
    trainer.evaluations.evaluate = evaluate_and_keep  # scripted_falls wraps evaluate: keep after it
    trainer.run()
    metrics = {m["epoch"]: m for m in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    state = learned[1][0]
    assert {"optimizer", "stat_tracker", "critic", "kl", "estimator_controller", "ema"} <= set(state)
    assert state["kl"]["adapter"] and "below_start" in state["kl"]["state"]  # the reference adapter, the gates
    (restore,) = json.loads((tmp_path / "run" / "lora_best" / "best.json").read_text())["restores"]
    assert restore["after_epoch"] == 2 and metrics[2]["guard/restored_epoch"] == restore["to_epoch"]
    to = restore["to_epoch"]
    after_restore = learned[2]
    assert same(after_restore[0], learned[to][0])  # everything learned, bitwise as at the restored evaluation
    assert all(torch.equal(a, b) for a, b in zip(after_restore[1], learned[to][1]))
    assert not same(learned[2][0]["critic"], learned[3][0]["critic"])  # and trained on from there
    assert f"after epoch 2: the weights of epoch {to}" in (tmp_path / "run" / "summary.txt").read_text()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["restores"] == [restore]
    trainer.rollouts.close()
