"""The seam of a run's optional parts (the critic, the KL term, the estimator's controller, the EMA, the old model,
tree rollouts, ReMax's greedy baselines, GROUP_PPO's Tweedie values, the evaluation's best weights): a ``Component``
says what it adds to each sampling round, what it does after the policy's update, and the state a checkpoint keeps
under its name. The collector (rollout/collector.py) and the trainer (run/trainer.py) loop over the run's components
in their order and never ask which exist; run/components.py builds them from the config.

A round (rollout/collector.py's ``Round``) passes through a component twice:

    round_inputs(sampled)      per-sample tensors of this process's rows [B_local, ...], gathered over the processes
                               with the rewards (GatheredRound: what the estimator reads)
    batch_fields(round)        fields of this process's batch record, made with the advantages (the critic's
                               targets, the KL term's row weights)

and an epoch once, after the policy's update (``after_update``: its own update, its metrics), in the components'
order: the order fixes what draws random numbers first, so it is the order the checkpoint lists them in.

What a component has learned (``learned_state``: by default its checkpointed state) is copied with the policy's weights
at every best evaluation and put back with them when the guard restores them (run/best_weights.py): a restore returns
the whole run to that evaluation, not only its weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def copied(tree):
    """``tree`` (dicts, lists, tuples of tensors and plain values) with each tensor a detached CPU copy: a state that
    later training cannot change, nor loading it alias."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {key: copied(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(copied(value) for value in tree)
    return tree


@dataclass(frozen=True)
class SampledRound:
    """What a component sees of a round this process sampled, before the gather: ``batch`` (its RolloutBatch),
    ``groups`` (each of its rows' prompt group), the denoiser it was sampled with, the rows' shared initial noise (or
    None), and ``num_samples``: the round's samples over every process."""

    epoch: int
    batch: object
    groups: list
    model: object
    num_samples: int
    initial_noise: torch.Tensor | None = None


class Component:
    """An optional part of a run (module docstring). Every hook does nothing by default."""

    name = ""  # its key in checkpoints (training_state.json) and in the trainer's components
    stateful = False  # a checkpoint keeps its state_dict() under its name

    def before_round(self, sampler) -> None:
        """Before a round is sampled with ``sampler`` (rollout/sampler.py's RolloutSampler)."""

    def round_inputs(self, sampled: SampledRound) -> dict:
        """{name: [B_local, ...] tensor}: what it adds to the round, gathered with its rewards."""
        return {}

    def round_queries(self, sampled: SampledRound) -> int:
        """The reward evaluations it spent on the round over every process (beside one a sample)."""
        return 0

    def batch_fields(self, estimated) -> dict:
        """{RolloutBatch field: this process's rows} made with the round's advantages (``estimated``: the Round)."""
        return {}

    def trains_policy(self, epoch: int) -> bool:
        """Whether the policy is updated in epoch ``epoch`` (the critic's warm-up says no)."""
        return True

    def after_update(self, epoch: int, rollouts, train: dict) -> dict:
        """After the policy's update of epoch ``epoch`` (``rollouts``: the collector's EpochRollouts, ``train``: the
        update's metrics): its own update; returns its metrics."""
        return {}

    def epoch_line(self, epoch: int, metrics: dict) -> str | None:
        """A line for the console after the epoch's metrics are logged, or None."""
        return None

    def apply_settings(self) -> list[str]:
        """After a resume: the config's settings over the checkpoint's (an optimizer's); lines saying what changed."""
        return []

    def denoiser_copies(self) -> list:
        """The frozen denoiser copies it holds (full fine-tuning's reference and old model), whose forwards count."""
        return []

    def learned_state(self):
        """What it has learned, which the guard's restore puts back with the policy's weights (module docstring): its
        checkpointed state when it is stateful (a copy), else None."""
        return copied(self.state_dict()) if self.stateful else None

    def load_learned_state(self, state) -> None:
        """``learned_state()``'s value back (the guard's restore)."""
        self.load_state_dict(copied(state))

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
