"""Evaluation during training (run/periodic_eval.py): fixed prompts x fixed noise, deterministic, no training
randomness used, on SD and FLUX; the EMA weights when asked; the slices of several processes; the metrics by hand;
the summary's before -> after; the config checks."""

from __future__ import annotations

import json
from contextlib import nullcontext
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_config, tiny_trainer

from ddpo_group.errors import ConfigError
from ddpo_group.rollout.reward_scorer import RewardScorer
from ddpo_group.run.config_checks import validate_config
from ddpo_group.run.periodic_eval import PeriodicEvaluation
from ddpo_group.run.reporting.summary import format_summary

EVAL = {"eval_freq": 1, "eval_num_prompts": 3, "eval_num_seeds": 2}


def rng_states() -> tuple:
    return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


def same_rng(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


@pytest.mark.parametrize("family", ["sd", "flux"])
def test_the_evaluation_repeats_exactly_and_uses_no_training_randomness(family, family_model_dirs, tmp_path):
    trainer = tiny_trainer("ddpo", family_model_dirs[family], tmp_path, **EVAL, **FAMILY_OVERRIDES[family])
    evaluation = trainer.evaluations.periodic
    assert len(set(evaluation.prompts)) == 3 and evaluation.num_rows == 6
    scored = []

    def greedy_reward(images, prompts, metadata):  # a reward that draws from every global generator
        torch.rand(3), np.random.rand(), random.random()
        scored.append(images.clone())
        return trainer.reward_fn(images, prompts, metadata)

    evaluation.reward_scorer = RewardScorer(greedy_reward, trainer.config.reward_fn)
    weights = [p.detach().clone() for p in trainer.params]
    timesteps = trainer.family.schedule(trainer.config.sample.num_steps, "cpu")["timesteps"].clone()
    before = rng_states()
    first = evaluation.run(0)
    assert same_rng(before, rng_states())  # restored although the reward drew from them
    torch.rand(5)  # the global stream moves on between evaluations: the evaluation does not depend on it
    second = evaluation.run(1)
    assert first.metrics == second.metrics and torch.equal(first.rewards, second.rewards)
    assert len(scored) == 4  # 6 rows in batches of sample.batch_size = 4, twice
    assert torch.equal(torch.cat(scored[:2]), torch.cat(scored[2:]))  # the same images, from the same noise
    assert first.metrics["eval/num_images"] == 6 and len(first.rewards) == 6
    assert first.metrics["eval/reward_mean"] == pytest.approx(float(first.rewards.mean()))
    # the sampler is deterministic: noise j is shared by every prompt, so rows 0 and 2 differ only by the prompt
    assert not torch.equal(scored[0][0], scored[0][1])  # two noises of one prompt
    assert all(torch.equal(a, b) for a, b in zip(weights, trainer.params)) and not trainer.model.training
    assert torch.equal(trainer.pipe.scheduler.timesteps.cpu(), timesteps)
    assert first.grid is not None and first.grid.size[0] > 0


def test_the_stochastic_evaluation_is_fixed_too_and_differs_from_the_deterministic_one(tiny_model_dir, tmp_path):
    trainer = tiny_trainer("ddpo", tiny_model_dir, tmp_path, eval_train_sampler=True, **EVAL)
    first, second = trainer.evaluations.periodic.run(0), trainer.evaluations.periodic.run(0)
    assert first.metrics == second.metrics
    assert first.metrics["eval_stochastic/reward_mean"] != first.metrics["eval/reward_mean"]
    looks = {k for k in first.metrics
             if k.startswith(("eval/image/", "eval/image_spread/", "eval/drift/")) or k == "eval/diversity"}
    assert set(k.replace("eval_stochastic/", "eval/") for k in first.metrics if k.startswith("eval_stochastic/")) \
        == set(k for k in first.metrics if k.startswith("eval/")) - {"eval/num_images"} - looks  # the deterministic's


def test_the_evaluation_uses_the_ema_weights_and_gives_the_training_weights_back_bitwise(tiny_model_dir, tmp_path):
    trainer = tiny_trainer("ddpo", tiny_model_dir, tmp_path, **EVAL, **{"train.ema": True})
    initial = [p.detach().clone() for p in trainer.params]
    before = trainer.evaluations.evaluate(-1)  # the EMA is still the initial weights
    trainer.train_epoch(0)
    trained = [p.detach().clone() for p in trainer.params]
    assert any(not torch.equal(a, b) for a, b in zip(initial, trained))
    with torch.no_grad():  # an EMA equal to the weights before training must evaluate as the untrained model did
        for ema, value in zip(trainer.ema.shadow, initial):
            ema.copy_(value)
    with_ema = trainer.evaluations.evaluate(0)
    assert with_ema == before
    assert all(torch.equal(a, b.detach()) for a, b in zip(trained, trainer.params))  # the training weights, bitwise
    trainer.evaluations.weights = nullcontext  # train.ema_eval=False
    assert trainer.evaluations.evaluate(0) == trainer.evaluations.periodic.run(0).metrics != before  # the trained weights, as they are
    records = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    # this test's -1, train_epoch(0)'s own -1 and 0 (eval_freq=1), then this test's two of epoch 0
    assert [(r["epoch"], r["weights"]) for r in records] == [(-1, "ema"), (-1, "ema"), (0, "ema"), (0, "ema"),
                                                             (0, "training")]
    assert records[0]["eval/reward_mean"] == records[1]["eval/reward_mean"] == records[3]["eval/reward_mean"]
    assert (tmp_path / "run" / "samples" / "eval_before.png").exists()


def test_processes_take_equal_padded_slices_that_gather_in_row_order():
    evaluation = PeriodicEvaluation.__new__(PeriodicEvaluation)
    evaluation.prompts, evaluation.num_seeds, evaluation.groupwise = ["a", "b", "c", "d"], 2, False  # 8 rows
    slices = []
    for rank in range(3):
        evaluation.accelerator = SimpleNamespace(num_processes=3, process_index=rank)
        slices.append(evaluation.my_rows())
    assert slices == [[0, 1, 2], [3, 4, 5], [6, 7, 7]]  # ceil(8 / 3) = 3 each, the last padded with row 7
    assert sum(slices, [])[:8] == list(range(8))  # gathered in process order, cut to the rows: row order
    evaluation.accelerator = SimpleNamespace(num_processes=16, process_index=15)
    assert evaluation.my_rows() == [7]  # more processes than rows: a padded slice of one copy
    evaluation.groupwise = True  # a groupwise reward scores a prompt's 2 images together: whole prompts on a process
    slices = []
    for rank in range(3):
        evaluation.accelerator = SimpleNamespace(num_processes=3, process_index=rank)
        slices.append(evaluation.my_rows())
    assert slices == [[0, 1, 2, 3], [4, 5, 6, 7], [7, 7, 7, 7]]  # 2 prompts each; the padding is whole groups


def test_the_reward_infos_per_image_entries_are_evaluated_too():
    from ddpo_group.run.periodic_eval import per_image

    info = {"shape_correct": torch.tensor([True, False]), "kb": [3.0, 4.0], "scalar": 1.5, "name": ["a", "b"],
            "wrong_length": torch.ones(3)}
    entries = per_image(info, 2)
    assert list(entries) == ["shape_correct", "kb"]
    assert entries["shape_correct"].tolist() == [1.0, 0.0] and entries["kb"].dtype == torch.float64


def test_metrics_by_hand_per_prompt_per_group_and_per_component():
    evaluation = PeriodicEvaluation.__new__(PeriodicEvaluation)
    evaluation.prompts = ["a red circle", "a blue circle", "a red square"]
    evaluation.metadata = [{"shape": "circle"}, {"shape": "circle"}, {"shape": "square"}]
    evaluation.num_seeds, evaluation.group_by, labels = 2, "", ["jpeg", "shapes"]
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, 0.0, 1.0], dtype=torch.float64)
    components = torch.tensor([[1, 0], [1, 2], [1, 4], [1, 6], [1, 8], [1, 10]], dtype=torch.float64)
    metrics = evaluation.metrics("eval", rewards, components, labels)
    assert metrics["eval/reward_mean"] == 2.0 and metrics["eval/reward_std"] == pytest.approx(float(np.std(
        [1, 2, 3, 5, 0, 1], ddof=1)))
    assert metrics["eval/reward_info/jpeg"] == 1.0 and metrics["eval/reward_info/shapes"] == 5.0
    assert {k: v for k, v in metrics.items() if "/prompt/" in k} == {
        "eval/prompt/a red circle": 1.5, "eval/prompt/a blue circle": 4.0, "eval/prompt/a red square": 0.5}
    evaluation.group_by = "shape"
    grouped = evaluation.metrics("eval", rewards, components, labels)
    assert grouped["eval/shape/circle"] == 2.75 and grouped["eval/shape/square"] == 0.5
    assert not any("/prompt/" in k for k in grouped)


def test_group_by_a_missing_metadata_key_names_the_keys(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"eval_group_by='shape'.*metadata keys are \[\]"):
        tiny_trainer("ddpo", tiny_model_dir, tmp_path, eval_group_by="shape", **EVAL)


def test_prompts_from_a_file_and_the_draw_are_fixed(tiny_model_dir, tmp_path):
    from ddpo_group.run.periodic_eval import eval_prompts

    config = tiny_config("ddpo", tiny_model_dir, tmp_path, **EVAL)
    drawn = eval_prompts(config)
    assert drawn == eval_prompts(config) and len(set(drawn[0])) == len(drawn[0]) == 3  # the same, distinct
    config.prompt_fn, config.eval_num_prompts = "from_file", 8
    config.prompt_fn_kwargs.path = str(tmp_path / "two.txt")
    (tmp_path / "two.txt").write_text("a cat\na dog\n")
    assert sorted(eval_prompts(config)[0]) == ["a cat", "a dog"]  # fewer distinct prompts than asked: each once
    config.prompt_fn, config.prompt_fn_kwargs, config.eval_num_prompts = "simple_animals", {}, 3
    config.seed = 43
    assert eval_prompts(config)[0] != drawn[0]  # a function of seed
    file = tmp_path / "prompts.txt"
    file.write_text("a cat\n\n  a dog \na cat\n")
    config.eval_prompt_file = str(file)
    assert eval_prompts(config) == (["a cat", "a dog"], [{}, {}])


def test_config_checks_name_the_bad_values(tiny_model_dir, tmp_path):
    bad = {"eval_freq": -1, "train.ema": True, "train.ema_decay": 1.0, "train.ema_update_interval": 0}
    with pytest.raises(ConfigError) as error:
        validate_config(tiny_config("ddpo", tiny_model_dir, tmp_path, **bad))
    message = str(error.value)
    assert "eval_freq=-1 must be an integer >= 0" in message
    assert "train.ema_decay=1.0 must be in [0, 1)" in message
    assert "train.ema_update_interval=0 must be an integer >= 1" in message
    bad = {"eval_freq": 2, "eval_num_prompts": 0, "eval_num_seeds": 0, "eval_prompt_file": "/no/such/file",
           "train.ema_export": True}
    with pytest.raises(ConfigError) as error:
        validate_config(tiny_config("ddpo", tiny_model_dir, tmp_path, **bad))
    message = str(error.value)
    for expected in ("eval_num_prompts=0 must be an integer >= 1", "eval_num_seeds=0 must be an integer >= 1",
                     "eval_prompt_file='/no/such/file' does not exist",
                     "train.ema_export=True exports the EMA weights and needs train.ema=True"):
        assert expected in message


def test_the_summary_reports_the_evaluation_before_and_after():
    metrics = [{"epoch": 0, "reward_mean": 0.2, "reward_std": 0.1}, {"epoch": 1, "reward_mean": 0.7, "reward_std": 0.1}]
    evaluations = [
        {"epoch": -1, "weights": "ema", "eval/reward_mean": 0.5, "eval/reward_std": 0.25, "eval/num_images": 16,
         "eval/prompt/a cat": 0.25},
        {"epoch": 1, "weights": "ema", "eval/reward_mean": 0.625, "eval/reward_std": 0.125, "eval/num_images": 16,
         "eval/prompt/a cat": 0.5},
    ]
    text = format_summary(metrics, {}, evaluations)
    assert "16 images: fixed prompts x fixed initial noise, deterministic sampler with the EMA weights" in text
    assert "reward before    0.5000 ± 0.2500  (evaluation before training)" in text
    assert "reward after     0.6250 ± 0.1250  (evaluation after epoch 1)" in text
    assert "change           +0.1250" in text and "prompt/a cat: 0.2500 -> 0.5000" in text
    assert "epoch means      0.2000 (epoch 0) -> 0.7000 (epoch 1), best epoch 1: 0.7000" in text
    assert "reward before    0.2000" in format_summary(metrics, {})  # no evaluation: the epoch means, as before
