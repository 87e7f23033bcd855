"""The run's optional parts as components (rollout/component.py, run/components.py): a run has exactly the components
its config asks for, in their registered order, and its checkpoint holds their state under their names; a component
registered from outside the package joins every run it builds itself for."""

import json

import pytest

from ddpo_group.rollout.component import Component
from ddpo_group.run.components import COMPONENT_REGISTRY, register_component
from helpers.trainer_helpers import tiny_trainer

ORDER = ["critic", "kl", "estimator_controller", "ema", "old_model", "teachers", "tweedie_values", "tree", "greedy_rewards",
         "adaptive_branching", "best_weights", "fresh_evaluation"]


def test_the_components_are_registered_in_their_order():
    assert [component.name for component in COMPONENT_REGISTRY.in_order()][:len(ORDER)] == ORDER


@pytest.mark.parametrize("preset, overrides, expected", [
    ("ddpo", {}, []),
    ("grpo", {}, ["kl"]),
    ("grpo", {"train.ema": True, "eval_freq": 1,
              "eval_num_prompts": 2, "eval_num_seeds": 2, "device": "cpu"}, ["kl", "ema", "best_weights"]),
    ("group_ppo", {}, ["critic", "estimator_controller"]),
    ("group_ppo", {"group_ppo.value_source": "tweedie"}, ["critic", "estimator_controller", "tweedie_values"]),
    ("group_ppo", {"group_ppo.value_source": "tree", "sample.branch_steps": (0, 2), "sample.branch_factors": (2, 2),
                   "sample.adaptive_branching": True},
     ["critic", "estimator_controller", "tree", "adaptive_branching"]),
    ("remax", {}, ["greedy_rewards"]),
])
def test_a_run_has_the_components_its_config_asks_for_and_checkpoints_them_by_name(tiny_model_dir, tmp_path, preset,
                                                                                   overrides, expected):
    trainer = tiny_trainer(preset, tiny_model_dir, tmp_path, "run", **{"save_freq": 1, **overrides})
    assert trainer.components.names == [*expected, "fresh_evaluation"]  # every run's (final_eval_num_seeds=0: off)
    trainer.run()
    state = json.loads((tmp_path / "run" / "checkpoints" / "checkpoint_00000" / "training_state.json").read_text())
    stateful = [name for name in expected if trainer.components[name].stateful]
    assert [piece["name"] for piece in state["pieces"]] == ["prompt_sampler", "counters", "stat_tracker", *stateful,
                                                            "fresh_evaluation"]


def test_a_component_registered_outside_the_package_adds_to_each_round_and_its_state_is_resumed(tiny_model_dir,
                                                                                                tmp_path):
    """A plugin component counts the rounds it saw (its state, checkpointed under its name) and adds each sample's
    reward plus one to the gathered round: a run of 2 epochs, stopped and resumed for a third, ends with 3 rounds."""

    @register_component("round_counter")
    class RoundCounter(Component):
        stateful = True

        @classmethod
        def build(cls, parts):
            return cls()

        def __init__(self):
            self.rounds = 0

        def round_inputs(self, sampled):
            self.rounds += 1
            return {"counted": sampled.batch.rewards + 1}

        def after_update(self, epoch, rollouts, train):
            assert bool((rollouts.gathered("counted") == rollouts.rewards + 1).all())  # every process's, every round
            return {"counter/rounds": self.rounds}

        def state_dict(self):
            return {"rounds": self.rounds}

        def load_state_dict(self, state):
            self.rounds = int(state["rounds"])

    try:
        first = tiny_trainer("ddpo", tiny_model_dir, tmp_path, "run", num_epochs=2, save_freq=1)
        assert first.components.names == ["fresh_evaluation", "round_counter"]
        assert first.run()["counter/rounds"] == 2
        resumed = tiny_trainer("ddpo", tiny_model_dir, tmp_path, "run", num_epochs=3, save_freq=1,
                               resume_from=str(tmp_path / "run"))
        assert resumed.run()["counter/rounds"] == 3
    finally:
        COMPONENT_REGISTRY._items.pop("round_counter", None)
