"""The run's optional parts as components (rollout/component.py's seam), and which of them a config has.

In their order (the order of their hooks each round and epoch, and of their state in a checkpoint):

    critic                 GROUP_PPO's and GAE's value network: its values gathered with each round, its regression
                           targets in the batch, its update after the policy's (critic.warmup_epochs: alone), its
                           optimizer's state
    kl                     the KL term to the reference model (reference/regularizer.py): the step rewards of
                           kl.in_reward, kl.only_below_start's row weights, beta's controller and the reference's
                           update after the epoch
    estimator_controller   the estimator's controller (GROUP_PPO's threshold tau), fit on the critic's targets
    ema                    the EMA of the weights (update/ema.py): its metrics; set to the restored weights
    old_model              a matching objective's old model (update/old_model.py): set to the restored weights
    teachers               on-policy distillation's teachers (reference/teachers.py): kept by reference; a copy's
                           forwards counted
    tweedie_values         GROUP_PPO's Tweedie values (rollout/tweedie.py): gathered, their reward queries counted
    tree                   tree rollouts: each row's tree nodes, as rows of the gathered round
    greedy_rewards         ReMax's baseline: a greedy sample's reward per prompt group
    adaptive_branching     the tree's branch steps, moved after each epoch (rollout/branching.py)
    best_weights           the best evaluation's weights (run/best_weights.py): lora_best/ and the restore point

Each is registered (``@register_component(name)``) in that order and builds itself from what the trainer built
(``build(parts)``: None when the run has no such part); ``build_components`` makes the ones a run has. Adding one is
a registered class (here, or in a module the trainer imports: run/best_weights.py registers the last one).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ddpo_group.models.trainable import apply_settings
from ddpo_group.registry import Registry
from ddpo_group.rollout.branching import AdaptiveBranches
from ddpo_group.rollout.component import Component, SampledRound, copied
from ddpo_group.rollout.sampler import greedy_rewards
from ddpo_group.rollout.tweedie import valued_steps
from ddpo_group.sampling.trajectories import SamplingOptions
from ddpo_group.update.critic import Critic


COMPONENT_REGISTRY = Registry("component")


def register_component(name: str):
    """Registers a Component class under ``name`` (its key in checkpoints), after the ones registered before it: the
    order of their hooks and of their state. The class builds itself: ``build(parts: RunParts) -> Component | None``."""
    def decorator(cls):
        cls.name = name
        return COMPONENT_REGISTRY.register(name)(cls)
    return decorator


class HoldsState(Component):
    """A component whose checkpointed state is one piece's (``self.piece``: an object with state_dict)."""

    stateful = True
    piece = None

    def state_dict(self) -> dict:
        return self.piece.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.piece.load_state_dict(state)


class FollowsPolicy(HoldsState):
    """A HoldsState whose piece has a reference model (``self.reference``) that can follow the policy: as an adapter in
    the policy's denoiser (reference/model.py) its weights are the accelerate state's, so what it learned adds them."""

    reference = None
    unwrapped_policy = None

    def learned_state(self):
        return copied({"state": self.piece.state_dict(),
                       "adapter": self.reference.adapter_weights(self.unwrapped_policy())})

    @torch.no_grad()
    def load_learned_state(self, state) -> None:
        self.piece.load_state_dict(copied(state["state"]))
        for weight, saved in zip(self.reference.adapter_weights(self.unwrapped_policy()), state["adapter"], strict=True):
            weight.copy_(saved)


@register_component("critic")
class CriticComponent(HoldsState):
    @classmethod
    def build(cls, parts):
        return cls(parts.critic, parts.estimator, parts.shards, parts.config, parts.timer) if parts.critic else None

    def __init__(self, critic: Critic, estimator, shards, config, timer):
        self.critic, self.estimator, self.shards, self.config, self.timer = critic, estimator, shards, config, timer
        self.piece = critic.optimizer  # the network itself is in accelerate's state

    def learned_state(self):
        """The critic's optimizer and its network."""
        return copied({"optimizer": self.critic.optimizer.state_dict(), "network": self.critic.module.state_dict()})

    def load_learned_state(self, state) -> None:
        self.critic.optimizer.load_state_dict(copied(state["optimizer"]))
        self.critic.module.load_state_dict(state["network"])

    def round_inputs(self, sampled: SampledRound) -> dict:
        return {"values": sampled.batch.values}

    def batch_fields(self, estimated) -> dict:
        targets, mask = self.estimator.critic_regression(estimated.out)
        return {"critic_targets": self.shards.local_rows(targets), "critic_mask": self.shards.local_rows(mask)}

    def trains_policy(self, epoch: int) -> bool:
        """The first ``critic.warmup_epochs`` epochs of reinforcement learning (after the sft.epochs supervised ones) train
        the critic only (their rollouts are reward queries too)."""
        return epoch - int(self.config.sft.epochs) >= int(self.config.critic.warmup_epochs)

    def after_update(self, epoch: int, rollouts, train: dict) -> dict:
        with self.timer.phase("critic"):
            return self.critic.train_epoch(rollouts.batch, self.config.train.batch_size)

    def apply_settings(self) -> list[str]:
        return apply_settings(self.critic.optimizer, Critic.settings(self.config))


@register_component("kl")
class KLComponent(FollowsPolicy):
    @classmethod
    def build(cls, parts):
        return cls(parts.kl, parts.scorer, parts.family, parts.pairs_per_forward_of, parts.shards, parts.config,
                   parts.unwrapped_policy) if parts.kl else None

    def __init__(self, kl, scorer, family, pairs_per_forward_of, shards, config, unwrapped_policy):
        self.kl, self.scorer, self.family, self.pairs_per_forward_of = kl, scorer, family, pairs_per_forward_of
        self.shards, self.config, self.unwrapped_policy = shards, config, unwrapped_policy
        self.piece, self.reference = kl, kl.reference

    def round_inputs(self, sampled: SampledRound) -> dict:
        """kl.in_reward: the KL to the reference of every sampled step [B, T] and the step rewards -beta KL_n, the
        transitions scored as the update scores them."""
        if not self.kl.in_reward:
            return {}
        batch = sampled.batch
        with self.kl.timer.phase("reference"):
            kl = self.kl.rollout_kl(batch, self.scorer, self.family.model, self.pairs_per_forward_of(batch),
                                    self.family.stochastic_steps(self.config.sample))
        return {"step_kl": kl, "step_rewards": self.kl.step_rewards(kl)}

    def batch_fields(self, estimated) -> dict:
        """kl.only_below_start: the term's weight of each row, its prompt's gate."""
        if self.kl.below_start is None:
            return {}
        gates = self.kl.below_start.weights(estimated.prompts, estimated.gathered.rewards)
        return {"kl_weights": self.shards.local_rows(gates.to(estimated.out.advantages.device))}

    def denoiser_copies(self) -> list:
        return [self.kl.reference.copy] if self.kl.reference.copy is not None else []

    def after_update(self, epoch: int, rollouts, train: dict) -> dict:
        loss_kl = self.shards.gather(torch.tensor([train.get("kl", 0.0)]))  # every process's KL in the loss
        return self.kl.after_epoch(self.unwrapped_policy(), epoch, rollouts.gathered("step_kl"), loss_kl,
                                   self.shards.total)


@register_component("estimator_controller")
class ControllerComponent(HoldsState):
    @classmethod
    def build(cls, parts):
        return cls(parts.controller, parts.estimator, parts.timer) if parts.controller else None

    def __init__(self, controller, estimator, timer):
        self.controller, self.estimator, self.timer = controller, estimator, timer
        self.piece = controller

    def after_update(self, epoch: int, rollouts, train: dict) -> dict:
        with self.timer.phase("advantage"):  # the fit of the critic over the kept targets of every round
            self.controller.update(*self.critic_fit(rollouts.rounds))
        return self.controller.metrics()

    def critic_fit(self, rounds: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(targets, old values, mask) of the critic over the kept rows of every round (the controller's input)."""
        pairs = [self.estimator.critic_regression(r.out) + (r.gathered.values, r.keep) for r in rounds]
        return (torch.cat([t[k] for t, _, _, k in pairs]), torch.cat([v[k] for _, _, v, k in pairs]),
                torch.cat([m[k] for _, m, _, k in pairs]))

    def epoch_line(self, epoch: int, metrics: dict) -> str | None:
        return self.controller.summary(epoch, metrics)


@register_component("ema")
class EMAComponent(HoldsState):
    @classmethod
    def build(cls, parts):
        return cls(parts.ema) if parts.ema else None

    def __init__(self, ema):
        self.ema = self.piece = ema

    def after_update(self, epoch: int, rollouts, train: dict) -> dict:
        return self.ema.metrics()


@register_component("old_model")
class OldModelComponent(FollowsPolicy):
    """The old model moves in the matching update's end of epoch (update/matching_update.py); here its state."""

    @classmethod
    def build(cls, parts):
        return cls(parts.old, parts.unwrapped_policy) if parts.old else None

    def __init__(self, old, unwrapped_policy):
        self.old = self.piece = old
        self.reference, self.unwrapped_policy = old.weights, unwrapped_policy

    def denoiser_copies(self) -> list:
        return [self.old.weights.copy] if self.old.weights.copy is not None else []


@register_component("teachers")
class TeachersComponent(HoldsState):
    @classmethod
    def build(cls, parts):
        return cls(parts.teachers) if parts.teachers else None

    def __init__(self, teachers):
        self.teachers = self.piece = teachers

    def denoiser_copies(self) -> list:
        return self.teachers.denoiser_copies()


@register_component("tweedie_values")
class TweedieComponent(Component):
    @classmethod
    def build(cls, parts):
        if not parts.estimator.reads(parts.config, "tweedie_values"):
            return None
        return cls(len(valued_steps(parts.family.stochastic_steps(parts.config.sample))))

    def __init__(self, num_steps: int):
        self.num_steps = num_steps  # the valued steps: a reward query each, a sample

    def round_inputs(self, sampled: SampledRound) -> dict:
        return {"tweedie_values": sampled.batch.tweedie_values}

    def round_queries(self, sampled: SampledRound) -> int:
        return sampled.num_samples * self.num_steps


@register_component("tree")
class TreeComponent(Component):
    @classmethod
    def build(cls, parts):
        return cls(parts.shards) if parts.branches else None

    def __init__(self, shards):
        self.shards = shards

    def round_inputs(self, sampled: SampledRound) -> dict:
        return {"tree_nodes": sampled.batch.tree_nodes + self.shards.mine.start}  # rows of the gathered round


@register_component("greedy_rewards")
class GreedyComponent(Component):
    """ReMax's baseline: with shared initial noise, a group's greedy sample starts from the group's x_0 too."""

    @classmethod
    def build(cls, parts):
        if not parts.estimator.needs_greedy_rewards:
            return None
        return cls(parts.family, parts.reward_scorer, parts.shards, parts.config, parts.timer)

    def __init__(self, family, reward_scorer, shards, config, timer):
        self.family, self.reward_scorer, self.shards = family, reward_scorer, shards
        self.config, self.timer = config, timer

    def round_inputs(self, sampled: SampledRound) -> dict:
        batch, config = sampled.batch, self.config
        with self.timer.phase("sampling"):  # greedy samples and their rewards
            rewards = greedy_rewards(self.family, sampled.model, batch.prompts, batch.metadata, sampled.groups,
                                     self.reward_scorer, SamplingOptions.deterministic(config.sample),
                                     seed=config.seed * 1_000_003 + sampled.epoch, initial_noise=sampled.initial_noise)
        return {"greedy_rewards": rewards}

    def round_queries(self, sampled: SampledRound) -> int:
        """A greedy sample per prompt group of each process."""
        return int(self.shards.gather(torch.tensor([len(set(sampled.groups))])).sum())


@register_component("adaptive_branching")
class BranchingComponent(HoldsState):
    @classmethod
    def build(cls, parts):
        """sample.adaptive_branching: the tree's branch steps move among the family's stochastic steps."""
        if not parts.config.sample.adaptive_branching:
            return None
        stochastic = parts.family.stochastic_steps(parts.config.sample).nonzero().flatten().tolist()
        return cls(AdaptiveBranches(parts.branches, stochastic))

    def __init__(self, branching):
        self.branching = self.piece = branching

    def before_round(self, sampler) -> None:
        """The branch steps the last epoch chose."""
        sampler.options = replace(sampler.options, branches=self.branching.branches)

    def after_update(self, epoch: int, rollouts, train: dict) -> dict:
        return self.branching.update(rollouts.gathered("tree_nodes"), rollouts.rewards)


@dataclass
class RunParts:
    """What the trainer has built, from which the components are made (None: the run has no such piece)."""

    config: object
    shards: object
    family: object
    scorer: object
    reward_scorer: object
    estimator: object
    timer: object
    pairs_per_forward_of: object  # the updater's pairs_per_forward_of(batch)
    unwrapped_policy: object  # () -> the unwrapped policy denoiser
    critic: object = None
    kl: object = None
    controller: object = None
    ema: object = None
    old: object = None
    teachers: object = None
    branches: dict | None = None  # tree rollouts' {step: children} ({} or None: flat sampling)
    best_weights: object = None
    fresh_evaluation: object = None


def build_components(parts: RunParts) -> "Components":
    """The components of the run ``parts`` were built for, in their registered order (module docstring)."""
    made = (component_class.build(parts) for component_class in COMPONENT_REGISTRY.in_order())
    return Components([component for component in made if component is not None])


class Components:
    """The run's components in their order: iterated, or one by name (``components["critic"]``)."""

    def __init__(self, components: list[Component]):
        self.items = list(components)
        names = [component.name for component in self.items]
        if len(set(names)) != len(names):
            raise ValueError(f"two components of one name: {names}")

    def __iter__(self):
        return iter(self.items)

    def __getitem__(self, name: str) -> Component:
        return next(component for component in self.items if component.name == name)

    @property
    def names(self) -> list[str]:
        return [component.name for component in self.items]

    def stateful(self) -> dict:
        """{name: component} of the ones a checkpoint keeps."""
        return {component.name: component for component in self.items if component.stateful}
