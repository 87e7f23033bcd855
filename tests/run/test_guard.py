"""The guard (run/guard.py): its rules on scripted evaluation sequences (held-out falling, the trained reward's own
fall, a groupwise reward's pointwise score, diversity, drift in units of each statistic's spread), and in a run:
held-out rewards scored on the evaluation's images, the best evaluation's weights kept (chosen on one half of its
images, reported on the other; its images reproduce it), a stop that exits 0 with a checkpoint that resumes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ml_collections import ConfigDict

from ddpo_group.run.guard import Guard
from helpers.trainer_helpers import tiny_trainer

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
RULES = ConfigDict({"on_alarm": "warn", "heldout_drop": 2.0, "fall_drop": 2.0, "min_diversity": 0.5, "max_drift": 1.0})


def evaluation(reward, heldout=None, std=0.1, diversity=0.2, drift=0.0, images=16, reward_std=0.4):
    """An evaluation's metrics; the images' brightness and contrast spread 0.1 and 0.2 (drift: brightness's move, the
    contrast's half of it the other way, so 0.5 and 0.25 of their spreads for drift=0.05)."""
    metrics = {"eval/reward_mean": reward, "eval/reward_std": reward_std, "eval/num_images": images,
               "eval/diversity": diversity, "eval/drift/brightness": drift, "eval/drift/contrast": -drift / 2,
               "eval/image_spread/brightness": 0.1, "eval/image_spread/contrast": 0.2}
    if heldout is not None:
        metrics.update({"eval_heldout/reward_mean": heldout, "eval_heldout/reward_std": std})
    return metrics


def test_the_heldout_rule_fires_once_when_the_heldout_reward_falls_while_the_trained_one_rises():
    guard = Guard(RULES, heldout=True)
    # SE at the best = 0.1 / sqrt(16) = 0.025: a fall of more than 0.05 below the best, the trained reward above 0.6
    sequence = [(-1, 0.5, 0.80), (9, 0.6, 0.85), (19, 0.7, 0.81), (29, 0.75, 0.79), (39, 0.8, 0.70), (49, 0.9, 0.60)]
    seen = []
    for epoch, reward, heldout in sequence:
        best, alarms = guard.observe(epoch, evaluation(reward, heldout))
        seen.append((epoch, best, [a.rule for a in alarms]))
    assert seen == [(-1, True, []), (9, True, []), (19, False, []), (29, False, ["heldout"]), (39, False, []),
                    (49, False, [])]  # 0.81 is within 0.05 of 0.85; 0.79 is not; the alarm once
    assert guard.best == {"epoch": 9, "selected": 0.85, "score": 0.85, "reported": 0.85, "rising": 0.6,
                          "se": pytest.approx(0.025)}
    assert "epoch 9" in guard.best_line()


def test_the_heldout_rule_needs_the_trained_reward_to_rise():
    guard = Guard(RULES, heldout=True)
    for epoch, reward, heldout in [(-1, 0.5, 0.8), (9, 0.6, 0.9), (19, 0.5, 0.6)]:  # both fell: no hacking sign
        _, alarms = guard.observe(epoch, evaluation(reward, heldout))
        assert alarms == []


def test_diversity_and_drift_rules_and_the_best_without_heldout():
    guard = Guard(RULES, heldout=False)
    assert guard.observe(-1, evaluation(0.5, diversity=0.2)) == (True, [])
    best, alarms = guard.observe(9, evaluation(0.45, diversity=0.11, drift=0.08))
    assert not best and alarms == []  # 0.11 > 0.5 x 0.2; brightness moved 0.8 of its spread 0.1
    best, alarms = guard.observe(19, evaluation(0.7, diversity=0.09, drift=-0.12))
    assert best and [a.rule for a in alarms] == ["diversity", "drift"]
    assert "eval/drift/brightness=-0.1200" in alarms[1].message and "1.20 times its spread" in alarms[1].message
    assert "0.0900" in alarms[0].message
    assert guard.observe(29, evaluation(0.6, diversity=0.01, drift=0.5))[1] == []  # each rule once


def test_the_drift_rule_reads_each_statistic_in_its_own_spread():
    """A contrast move of 0.15 is 0.75 of contrast's spread 0.2 (no alarm) where the old absolute bound 0.15 would have
    been reached; a brightness move of 0.15 is 1.5 of brightness's spread 0.1 (an alarm naming brightness)."""
    guard = Guard(RULES, heldout=False)
    guard.observe(-1, evaluation(0.5))
    quiet = evaluation(0.5)
    quiet.update({"eval/drift/brightness": 0.0, "eval/drift/contrast": 0.15})
    assert guard.observe(9, quiet)[1] == []
    loud = evaluation(0.5)
    loud.update({"eval/drift/brightness": 0.15, "eval/drift/contrast": 0.0})
    (alarm,) = guard.observe(19, loud)[1]
    assert alarm.rule == "drift" and "brightness moved 1.50 times" in alarm.message


def test_the_drift_rule_reads_the_audio_in_its_own_spread():
    """A family with audio: its level's move of 0.03 is 1.5 of the level's spread 0.02 before training (an alarm naming
    the audio's level, in the samples' spread), where the frames have not moved."""
    guard = Guard(RULES, heldout=False)
    guard.observe(-1, {**evaluation(0.5), "eval/audio_spread/level": 0.02, "eval/audio_spread/flatness": 0.1})
    quiet = {**evaluation(0.5), "eval/drift/brightness": 0.0, "eval/drift/audio/level": 0.01,
             "eval/drift/audio/flatness": 0.05}
    assert guard.observe(9, quiet)[1] == []
    (alarm,) = guard.observe(19, {**quiet, "eval/drift/audio/level": 0.03})[1]
    assert alarm.rule == "drift" and "eval/drift/audio/level=+0.0300" in alarm.message
    assert "the audio's level moved 1.50 times its spread over the samples before training (0.0200)" in alarm.message


def test_the_fall_rule_names_a_run_losing_its_own_reward():
    """The issue's run: 0.793 before training, 0.828 at its best, 0.729 at the end. SE at the best = 0.16 / sqrt(64) =
    0.02: below 0.828 - 0.04 and below the start it fires once; a fall that stays above the start, or within 2 SE of
    the best, does not."""
    guard = Guard(RULES, heldout=False)
    seen = []
    for epoch, reward in [(-1, 0.793), (4, 0.828), (9, 0.800), (14, 0.790), (19, 0.729), (24, 0.70)]:
        seen.append([a.rule for a in guard.observe(epoch, evaluation(reward, reward_std=0.16, images=64))[1]])
    # 0.800: above the start; 0.790: below it but 0.038 below the best, within 2 SE; 0.729: both, once
    assert seen == [[], [], [], [], ["fall"], []]
    guard = Guard(RULES, heldout=False)
    for epoch, reward in [(-1, 0.793), (4, 0.828), (9, 0.795)]:  # 0.033 below the best, above the start
        assert guard.observe(epoch, evaluation(reward, reward_std=0.16, images=64))[1] == []
    guard = Guard(RULES, heldout=False)
    for epoch, reward in [(-1, 0.793), (4, 0.800), (9, 0.780)]:  # below the start, within 2 SE (0.04) of the best
        assert guard.observe(epoch, evaluation(reward, reward_std=0.16, images=64))[1] == []


def test_a_groupwise_reward_is_judged_by_its_pointwise_score():
    """A win rate's evaluation mean is 1/2 whatever the images; its judge's score is what rises. The held-out rule
    then reads the score; a groupwise reward without one (a VLM judge's win rate) lets the held-out fall alone
    decide."""
    def win_rate_evaluation(score, heldout):
        metrics = evaluation(0.5, heldout)
        metrics.update({"eval/reward_info/score": score, "eval/reward_info/score_std": 0.2})
        return metrics

    sequence = [(-1, 0.30, 0.80), (9, 0.40, 0.85), (19, 0.50, 0.70)]
    for rising, fired in (("eval/reward_mean", []), ("eval/reward_info/score", ["heldout"]), (None, ["heldout"])):
        guard = Guard(RULES, heldout=True, rising=rising)
        rules = [[a.rule for a in guard.observe(e, win_rate_evaluation(s, h))[1]] for e, s, h in sequence]
        assert rules[-1] == fired, rising  # the mean (0.5 throughout) never rose: the old rule missed the fall
    guard = Guard(RULES, heldout=False, rising="eval/reward_info/score")
    assert guard.measure == "eval/reward_info/score"  # the best evaluation is chosen by the score, not by 1/2
    for epoch, score in [(-1, 0.3), (9, 0.6), (19, 0.4)]:
        guard.observe(epoch, win_rate_evaluation(score, None))
    assert guard.best["epoch"] == 9


def test_the_best_is_chosen_on_one_half_of_the_images_and_reported_on_the_other():
    """Selected on the even initial noises, reported on the odd ones: the second evaluation's select half is higher
    (it is the best) while its report half says what it scores on images it was not chosen on."""
    guard = Guard(RULES, heldout=False)
    for epoch, select, report in [(-1, 0.50, 0.52), (9, 0.70, 0.60), (19, 0.65, 0.66)]:
        metrics = evaluation((select + report) / 2)
        metrics.update({"eval/select_half/reward_mean": select, "eval/report_half/reward_mean": report})
        guard.observe(epoch, metrics)
    assert guard.best["epoch"] == 9 and guard.best["reported"] == 0.60
    record = guard.best_record()
    assert record["score"] == 0.60 and record["selected_on"]["score"] == 0.70
    assert record["reported_on"]["score"] == 0.60 and "odd" in record["reported_on"]["images"]


def test_a_resumed_guard_replays_its_evaluations_silently():
    records = [{"epoch": e, **evaluation(r, h)} for e, r, h in [(-1, 0.5, 0.8), (9, 0.6, 0.85), (19, 0.7, 0.7)]]
    guard = Guard(RULES, heldout=True)
    guard.replay(records)
    assert guard.best["epoch"] == 9 and guard.raised == {"heldout"}
    assert guard.observe(29, evaluation(0.8, 0.5))[1] == []  # raised before the resume


def test_restore_fires_the_fall_rule_at_every_evaluation_that_finds_the_run_below_its_best():
    """With "restore" the fall rule (and the held-out one) fire again after a restore, replayed alike on a resume; the
    others, and every rule under "warn", fire once. after_evaluation says when to restore."""
    class Session:
        guard_notes, print = [], staticmethod(lambda message: None)

    class BestWeights:
        path = "lora_best"

        def keep(self, *args):
            pass

    sequence = [(-1, 0.793), (4, 0.828), (9, 0.729), (14, 0.810), (19, 0.700)]  # SE 0.02: 9 and 19 fell
    for on_alarm, expected in (("restore", [False, False, True, False, True]), ("warn", [False] * 5)):
        guard = Guard(ConfigDict({**RULES.to_dict(), "on_alarm": on_alarm}), heldout=False)
        restores = [guard.after_evaluation(e, evaluation(r, reward_std=0.16, images=64), Session(), BestWeights(),
                                           None)
                    for e, r in sequence]
        assert restores == expected, on_alarm
    assert Session.guard_notes[:2] == ["fall after epoch 9: the weights of epoch 4 restored",
                                       "fall after epoch 19: the weights of epoch 4 restored"]
    assert Session.guard_notes[2:] == ["fall after epoch 9"]  # "warn": once
    replayed = Guard(ConfigDict({**RULES.to_dict(), "on_alarm": "restore"}), heldout=False)
    replayed.replay([{"epoch": e, **evaluation(r, reward_std=0.16, images=64)} for e, r in sequence[:3]])
    assert replayed.raised == set()
    assert [a.rule for a in replayed.observe(19, evaluation(0.700, reward_std=0.16, images=64))[1]] == ["fall"]


def test_heldout_rewards_are_the_evaluations_images_scored_by_another_reward(tiny_model_dir, tmp_path):
    """The evaluation before training with reward A and held-out B scores B as a run trained on B evaluates it."""
    small = {"eval_freq": 1, "eval_num_prompts": 2, "eval_num_seeds": 2, "device": "cpu"}
    one = tiny_trainer("grpo", tiny_model_dir, tmp_path, "a", reward_fn="jpeg_compressibility",
                       eval_reward_fn="jpeg_incompressibility", **small)
    other = tiny_trainer("grpo", tiny_model_dir, tmp_path, "b", reward_fn="jpeg_incompressibility", **small)
    first, second = one.evaluations.periodic.run(-1).metrics, other.evaluations.periodic.run(-1).metrics
    assert first["eval_heldout/reward_mean"] == second["eval/reward_mean"]
    assert first["eval_heldout/jpeg_incompressibility"] == second["eval/reward_mean"]
    assert first["eval_heldout/reward_info/jpeg_kb"] == second["eval/reward_info/jpeg_kb"]
    assert first["eval/diversity"] == second["eval/diversity"] > 0
    assert first["eval/drift/brightness"] == 0.0  # the evaluation before training is drift's origin
    for trainer in (one, other):
        trainer.rollouts.close()


@pytest.mark.parametrize("use_lora", [True, False])
def test_the_best_evaluations_weights_reproduce_its_images(tiny_model_dir, tmp_path, use_lora):
    from ddpo_group.offline.comparison import load_finetuned_weights

    overrides = {"eval_freq": 1, "eval_num_prompts": 2, "eval_num_seeds": 2, "device": "cpu", "num_epochs": 3,
                 "use_lora": use_lora, "eval_reward_fn": f"{PLUGINS / 'distance_from_first.py'}:make_distance_from_first"}
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "run", **overrides)
    trainer.run()
    records = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    best_dir = tmp_path / "run" / ("lora_best" if use_lora else "best")
    best = json.loads((best_dir / "best.json").read_text())
    selected = {r["epoch"]: r["eval_heldout/select_half/reward_mean"] for r in records}
    assert best["selected_on"]["score"] == max(selected.values()) == selected[best["epoch"]]
    chosen = next(r for r in records if r["epoch"] == best["epoch"])
    assert best["score"] == best["reported_on"]["score"] == chosen["eval_heldout/report_half/reward_mean"]
    assert best["measure"] == "eval_heldout/reward_mean" and best["epoch"] >= 0  # trained weights, not the base's
    fresh = tiny_trainer("grpo", tiny_model_dir, tmp_path, "fresh", **overrides)
    if use_lora:
        fresh.pipe.load_lora_weights(str(best_dir), adapter_name="best")
        fresh.family.model.set_adapter("best")
    else:
        load_finetuned_weights(fresh.family, best_dir, fresh.config)
    again = fresh.evaluations.periodic.run(best["epoch"]).metrics  # (the plugin's own first images are these: its 0)
    evaluated = next(r for r in records if r["epoch"] == best["epoch"])
    for key in ("eval/reward_mean", "eval/image/brightness", "eval/image/high_frequency", "eval/diversity"):
        assert again[key] == pytest.approx(evaluated[key], abs=1e-6), key
    assert records[0]["eval/reward_mean"] != evaluated["eval/reward_mean"]  # not the base model's images
    text = (tmp_path / "run" / "summary.txt").read_text()
    assert f"best evaluation  {best_dir} (epoch {best['epoch']}" in text and "held-out reward  " in text
    fresh.rollouts.close()


def test_a_guard_stop_exits_0_with_a_checkpoint_that_resumes(tiny_model_dir, tmp_path):
    root = Path(__file__).resolve().parents[2]
    args = [sys.executable, "scripts/train.py", "--config", "config/base.py:grpo",
            f"--config.pretrained.model={tiny_model_dir}", "--config.prompt_fn=simple_animals",
            "--config.reward_fn=jpeg_compressibility", "--config.sample.num_steps=3", "--config.sample.batch_size=4",
            "--config.sample.num_batches_per_epoch=1", "--config.train.batch_size=4", "--config.train.group_size=4",
            "--config.eval_freq=1", "--config.eval_num_prompts=2", "--config.eval_num_seeds=2",
            "--config.num_epochs=4", "--config.save_freq=0", "--config.wandb.mode=disabled", "--config.device=cpu",
            "--config.train.learning_rate=0.05", "--config.guard.max_drift=1e-9", "--config.guard.on_alarm=stop",
            f"--config.logdir={tmp_path}", "--config.run_name=stopped"]
    out = subprocess.run(args, cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "training stopped by the guard after an alarm" in out.stderr and "guard (drift)" in out.stdout
    assert "Resume with:" in out.stderr and "checkpoint_00000" in out.stderr
    lines = [json.loads(line) for line in (tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines()]
    assert [line["epoch"] for line in lines] == [0]
    resumed = subprocess.run(args + [f"--config.resume_from={tmp_path / 'stopped'}"], cwd=root, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    lines = [json.loads(line) for line in (tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines()]
    assert [line["epoch"] for line in lines] == [0, 1, 2, 3]  # the alarm was raised before: no second stop


def scripted_falls(trainer, epochs: set[int]) -> dict:
    """Lower the trained reward's evaluation (both halves) by 1 after each epoch in ``epochs``, before the guard reads
    it, so the fall rule fires there; returns {epoch: the trainable weights after that epoch's evaluation}."""
    evaluate, seen, lowered = trainer.evaluations.periodic.run, {}, set()

    def run(epoch):
        result = evaluate(epoch)
        if epoch in epochs and epoch not in lowered:  # not the restored weights' evaluation that follows
            lowered.add(epoch)
            for key in ("eval/reward_mean", "eval/select_half/reward_mean", "eval/report_half/reward_mean"):
                result.metrics[key] -= 1.0
        return result

    original = trainer.evaluations.evaluate

    def evaluate_and_see(epoch, restored=None):
        metrics = original(epoch, restored)
        seen[epoch] = [p.detach().clone() for p in trainer.params]
        return metrics

    trainer.evaluations.periodic.run, trainer.evaluations.evaluate = run, evaluate_and_see
    return seen


def test_restore_loads_the_best_weights_back_and_the_run_ends_on_weights_it_evaluated(tiny_model_dir, tmp_path):
    """guard.on_alarm="restore": a fall after epoch 2 puts the weights of the best evaluation back (bitwise), with
    the rest of what the run had learned (tests/run/test_fresh_evaluation.py), and training goes on from them; a fall
    after the last epoch restores them again and evaluates them, so the run's last evaluation and its exported LoRA
    are the best evaluation's."""
    from safetensors.torch import load_file

    overrides = {"eval_freq": 1, "eval_num_prompts": 2, "eval_num_seeds": 2, "device": "cpu", "num_epochs": 5,
                 "guard.on_alarm": "restore", "save_freq": 0}
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "run", **overrides)
    seen = scripted_falls(trainer, {2, 4})
    trainer.run()
    records = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [-1, 0, 1, 2, 3, 4, 4]  # the last one: the restored weights evaluated
    best = max((r for r in records[:3]), key=lambda r: r["eval/select_half/reward_mean"])["epoch"]
    assert all(torch.equal(a, b) for a, b in zip(seen[2], seen[best]))  # restored bitwise after epoch 2's fall
    assert not all(torch.equal(a, b) for a, b in zip(seen[3], seen[2]))  # and trained on from there
    final = records[-1]
    assert final["guard/restored_epoch"] in (best, 3)  # epoch 3's evaluation may have become the best
    kept = next(r for r in records if r["epoch"] == final["guard/restored_epoch"])
    assert final["eval/reward_mean"] == kept["eval/reward_mean"]  # the same weights, the same images
    assert all(torch.equal(a, b) for a, b in zip(seen[4], seen[final["guard/restored_epoch"]]))
    exported = load_file(str(tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors"))
    best_lora = load_file(str(tmp_path / "run" / "lora_best" / "pytorch_lora_weights.safetensors"))
    assert exported.keys() == best_lora.keys() and all(torch.equal(exported[k], best_lora[k]) for k in exported)
    samples = tmp_path / "run" / "samples"  # the grid that fell and the restored weights' grid, side by side
    assert (samples / "eval_epoch_00004.png").is_file() and (samples / "eval_epoch_00004_restored.png").is_file()
    summary = (tmp_path / "run" / "summary.txt").read_text()
    assert f"fall after epoch 2: the weights of epoch {best} restored" in summary
    trainer.rollouts.close()


def test_a_run_resumed_after_a_restore_ends_bitwise_as_one_never_stopped(tiny_model_dir, tmp_path):
    """Falls after epochs 1 and 3, each restoring the best evaluation's weights: a run stopped after epoch 2 and
    resumed from its checkpoint (the restore point, the cleared optimizer state, the guard replayed) ends with every
    file of its last checkpoint and every evaluation as the run never stopped."""
    from helpers.resume_helpers import assert_identical, load_everything

    class Stop(Exception):
        pass

    overrides = {"eval_freq": 1, "eval_num_prompts": 2, "eval_num_seeds": 2, "device": "cpu", "num_epochs": 4,
                 "guard.on_alarm": "restore", "save_freq": 1}
    reference = tiny_trainer("grpo", tiny_model_dir, tmp_path, "reference", **overrides)
    scripted_falls(reference, {1, 3})
    reference.run()
    stopped = tiny_trainer("grpo", tiny_model_dir, tmp_path, "stopped", **overrides)
    scripted_falls(stopped, {1, 3})
    end_of_epoch = stopped.session.end_of_epoch

    def end_and_stop(epoch):
        end_of_epoch(epoch)
        if epoch == 2:
            raise Stop

    stopped.session.end_of_epoch = end_and_stop
    with pytest.raises(Stop):
        stopped.run()
    resumed = tiny_trainer("grpo", tiny_model_dir, tmp_path, "stopped", resume_from=str(tmp_path / "stopped"),
                           **overrides)
    scripted_falls(resumed, {3})
    resumed.run()
    final = "checkpoints/checkpoint_00003"
    expected, got = load_everything(tmp_path / "reference" / final), load_everything(tmp_path / "stopped" / final)
    assert sorted(expected) == sorted(got)
    assert_identical(expected, got, "restore")
    records = [[json.loads(line) for line in (tmp_path / run / "eval.jsonl").read_text().splitlines()]
               for run in ("reference", "stopped")]
    assert [r["eval/reward_mean"] for r in records[0]] == [r["eval/reward_mean"] for r in records[1]]
    assert [r["epoch"] for r in records[0]] == [-1, 0, 1, 2, 3, 3]
    for trainer in (reference, stopped, resumed):
        trainer.rollouts.close()
