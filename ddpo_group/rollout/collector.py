"""An epoch's rollouts: sampling rounds over all processes, the estimator's inputs, advantages, DAPO's dynamic
sampling.

A round is P prompts x group_size copies spread over the processes (for a preference objective, tree rollouts or a
groupwise reward each process holds whole groups, each group's copies consecutive: PromptSampler.sample_epoch's
``whole_groups``; a groupwise reward scores each group on the process that sampled it). ``RolloutCollector.collect``:
each process samples and scores its slice (sampler.py, reward_scorer.py), and the rewards (and critic values, greedy
baselines, KL step rewards, reward info) are gathered (``GatheredRound``). ``RolloutCollector.estimate``: the estimator
computes the advantages on each whole round (so every prompt group is complete), and each process keeps its own rows, in
a batch record made whole with them. With ``algorithm.multi_reward_mix="advantage_aggr"`` each component of a weighted
combination is gathered too and normalised within its prompt group before the weighted sum the estimator gets
(algorithms/multi_reward.py). With ``algorithm.filter_groups`` (DAPO), groups whose rewards are all equal are dropped
and further rounds are sampled until every process holds a full batch of kept rows, or ``algorithm.max_num_gen_batches``
rounds were sampled; a process still short pads with dropped rows whose ``row_mask`` is 0 (they take no part in the
loss), so every process runs the same number of steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from ddpo_group.algorithms import (
    AdvantageInputs, AdvantageOutput, component_metrics, component_normalized_sum, get_objective,
    zero_variance_group_filter,
)
from ddpo_group.algorithms.advantages import EstimatorSpec
from ddpo_group.algorithms.stat_tracker import PerPromptStatTracker
from ddpo_group.algorithms.objectives import PREFERENCE
from ddpo_group.distributed import ProcessShards
from ddpo_group.errors import ConfigError, EpochAbandoned
from ddpo_group.rewards.combine import component_label
from ddpo_group.rollout.component import SampledRound
from ddpo_group.rollout.reward_scorer import RewardScorer
from ddpo_group.rollout.sampler import RolloutSampler, TextEmbeddingCache, sampling_precision, widened
from ddpo_group.rollout.snapshot import SamplingSnapshot
from ddpo_group.rollout.tweedie import valued_steps
from ddpo_group.sampling.noise import group_initial_noise, round_seed, sample_generators
from ddpo_group.sampling.tree import tree_branches
from ddpo_group.sampling.batch import RolloutBatch
from ddpo_group.sampling.family import Family
from ddpo_group.sampling.trajectories import SamplingOptions
from ddpo_group.timing import NULL_TIMER


@dataclass(frozen=True)
class GatheredRound:
    """A round's per-sample tensors over every process, rows in process order (B: the round's samples): the rewards,
    the reward info's per-image entries, and what the estimator declares it reads (None when it reads none)."""

    rewards: torch.Tensor  # [B]
    reward_info: dict  # {key: [B]} each per-image entry of the reward's info
    values: torch.Tensor | None = None  # [B, T] the critic's pre-step values
    tweedie_values: torch.Tensor | None = None  # [B, T] float64 (rollout/tweedie.py)
    tree_nodes: torch.Tensor | None = None  # [B, T+1] rows of the gathered round
    greedy_rewards: torch.Tensor | None = None  # [B] ReMax's baseline
    step_kl: torch.Tensor | None = None  # [B, T] the KL to the reference of each step (kl.in_reward)
    step_rewards: torch.Tensor | None = None  # [B, T] -beta KL_n (kl.in_reward)
    inputs: dict = field(default_factory=dict)  # {name: [B, ...]} what other components add (a plugin's)

    def __post_init__(self):
        size = len(self.rewards)
        entries = [*vars(self).items(), *self.reward_info.items(), *self.inputs.items()]
        wrong = {name: len(value) for name, value in entries if isinstance(value, torch.Tensor) and len(value) != size}
        if wrong:
            raise ValueError(f"a gathered round of {size} rewards has entries of other lengths: {wrong}")

    def get(self, name: str) -> torch.Tensor | None:
        """The field ``name``, or the component input of that name (None: the round has none)."""
        return getattr(self, name) if name in GATHERED_FIELDS else self.inputs.get(name)


GATHERED_FIELDS = {entry.name for entry in fields(GatheredRound)} - {"inputs", "reward_info"}


@dataclass(frozen=True)
class Round:
    """One sampling round: this process's batch record, the gathered per-sample tensors, the rewards the estimator
    normalises, which groups have reward variance, and the per-component advantage metrics (adv/<component>/*) under
    multi_reward_mix="advantage_aggr". ``RolloutCollector.estimate_round`` returns it with the estimator's output
    ``out`` and the batch record made whole with its advantages."""

    batch: RolloutBatch
    gathered: GatheredRound
    estimator_rewards: torch.Tensor  # [B_global] the weighted sum, or the normalised sum S under advantage_aggr
    prompts: list  # [B_global]
    groups: list  # [B_global] the prompt group of each sample
    keep: torch.Tensor  # [B_global] bool; all True without filter_groups
    dropped_share: float
    num_groups: int
    reward_queries: int  # reward evaluations of the round (ReMax's greedy samples included)
    component_metrics: dict = field(default_factory=dict)
    out: AdvantageOutput | None = None  # the estimator's output on the round (estimate_round)

    def advantage_inputs(self, num_steps: int, stat_tracker=None) -> AdvantageInputs:
        """The estimator's inputs on the whole round (float64). Every step is in the estimator's step mask (the
        policy update chooses its trained steps itself; the advantages of untrained steps are simply not used)."""
        gathered = self.gathered

        def double(tensor):
            return tensor.double() if tensor is not None else None

        return AdvantageInputs(
            rewards=self.estimator_rewards.double(), step_mask=torch.ones(len(self.prompts), num_steps, dtype=torch.float64),
            group_index=torch.as_tensor(self.groups, dtype=torch.long), prompts=list(self.prompts),
            stat_tracker=stat_tracker, values=double(gathered.values), step_rewards=double(gathered.step_rewards),
            greedy_rewards=double(gathered.greedy_rewards), tweedie_values=double(gathered.tweedie_values),
            tree_nodes=gathered.tree_nodes,
        )


@dataclass
class EpochRollouts:
    rounds: list
    batch: RolloutBatch  # the rows this process trains on (pooled from the rounds under dynamic sampling)
    batch_fill: float | None = None  # dynamic sampling: the share of kept rows in every process's batch

    @property
    def rewards(self) -> torch.Tensor:
        """Every process's rewards of every round."""
        return torch.cat([r.gathered.rewards for r in self.rounds])

    @property
    def reward_queries(self) -> int:
        return sum(r.reward_queries for r in self.rounds)

    def gathered(self, name: str) -> torch.Tensor | None:
        """Every round's gathered ``name`` (a GatheredRound field, or a component's input), or None when the rounds
        have none."""
        parts = [r.gathered.get(name) for r in self.rounds]
        return torch.cat(parts) if parts[0] is not None else None


@dataclass
class Estimation:
    """What computes the advantages: the estimator (algorithms/advantages.py), DDPO's per-prompt stat tracker and the
    estimator's controller (GROUP_PPO's threshold), whose parameters the estimator reads."""

    estimator: EstimatorSpec
    stat_tracker: PerPromptStatTracker
    controller: object | None = None


def estimate_advantages(estimator, config, inputs: AdvantageInputs, controller=None) -> AdvantageOutput:
    """The estimator's output on a whole (gathered) round: advantages [B, T], returns, masks, metrics. Its keywords
    are its declared config fields, ``algorithm.adv_estimator_kwargs`` and its controller's."""
    return estimator(inputs, adv_clip_max=config.train.adv_clip_max, **estimator.params_from(config, controller))


def rollout_tree(config, family: Family, estimator: EstimatorSpec) -> dict[int, int]:
    """Tree rollouts' {step: children} (sample.branch_steps, or GROUP_PPO's default tree), {} for flat sampling; a
    branch step must be one the family samples with noise."""
    stochastic = family.stochastic_steps(config.sample).nonzero().flatten().tolist()
    branches = tree_branches(config, estimator.reads(config, "tree_nodes"), stochastic)
    if not set(branches) <= set(stochastic):
        raise ConfigError(f"the tree's branch steps {sorted(branches)} (sample.branch_steps, or the default "
                          f"tree) must be steps {family.name} samples with noise: {stochastic}")
    return branches


def pool_rows(batches: list[RolloutBatch], keeps: list[torch.Tensor], size: int) -> RolloutBatch:
    """The first ``size`` kept rows of this process's rounds, padded with dropped rows, with their ``row_mask``
    [size] (1 kept, 0 padding). ``batches`` are the rounds' local batch records, ``keeps`` their local keep masks
    [local] bool."""
    kept = [(r, i) for r, keep in enumerate(keeps) for i in range(len(keep)) if keep[i]]
    dropped = [(r, i) for r, keep in enumerate(keeps) for i in range(len(keep)) if not keep[i]]
    picks = (kept + dropped)[:size]
    row_mask = torch.tensor([1.0 if keeps[r][i] else 0.0 for r, i in picks], device=batches[0].log_probs.device)
    return batches[0].take([(batches[r], i) for r, i in picks], row_mask=row_mask)


class RolloutCollector:
    """Samples, scores and estimates an epoch (module docstring). ``should_stop()`` is asked before each sampling
    batch and after the last round: when true, the epoch is abandoned (EpochAbandoned) and what sampling changed
    (prompt sampler, stat tracker, random generators) is restored.

    ``shards``: the round's slices and gathers over the processes (distributed.py); ``reward_scorer``: the reward
    calls (rollout/reward_scorer.py); ``estimation``: the estimator and what it reads (``Estimation``);
    ``components``: the run's components (rollout/component.py), which add to each round and its batch record;
    ``branches``: tree rollouts' {step: children} ({} for flat sampling: ``rollout_tree``); ``critic``: the value
    network whose values the sampler records (an estimator with a critic); ``timer``: the trainer's PhaseTimer.
    """

    def __init__(self, config, shards: ProcessShards, family: Family, reward_scorer: RewardScorer, prompt_sampler,
                 estimation: Estimation, components=(), branches: dict | None = None, critic=None, timer=NULL_TIMER,
                 should_stop=lambda: False):
        self.config, self.shards, self.family = config, shards, family
        self.reward_fn = reward_scorer.reward_fn
        self.accelerator = shards.accelerator
        self.prompt_sampler, self.estimation, self.components = prompt_sampler, estimation, components
        self.should_stop, self.timer, self.branches = should_stop, timer, branches or {}
        estimator = estimation.estimator
        # (label, weight) of each reward component: a combination's, or the single reward itself with weight 1
        single = [(component_label(str(config.reward_fn)), 1.0)]
        self.reward_components = list(getattr(self.reward_fn, "components", None) or single)
        # whole prompt groups on each process (PromptSampler.sample_epoch): a preference objective's units, a group's
        # trees (its leaves consecutive), a groupwise reward's calls (one per group, on the process that sampled it)
        self.whole_groups = (get_objective(config.algorithm.objective).kind == PREFERENCE or bool(branches)
                             or reward_scorer.groupwise)
        # GROUP_PPO's Tweedie values: the steps whose one-step prediction is scored (rollout/tweedie.py)
        tweedie_steps = None
        if estimator.reads(config, "tweedie_values"):
            tweedie_steps = valued_steps(family.stochastic_steps(config.sample))
        cache_size = int(config.sample.text_embedding_cache)
        # the rollout policy's step means (a latent-sized tensor a step): the policy gradient's exact policy KL
        # (update/policy_update.py) and a loss that reads them (ratio_norm)
        options = SamplingOptions.rollouts(
            config.sample, family, record_means=not get_objective(config.algorithm.objective).is_matching,
            branches=branches or None)
        # the reward calls (RewardScorer: after an out-of-memory error the batch size that fits is kept for the run)
        self.sampler = RolloutSampler(family, options, reward_scorer, critic=critic, tweedie_steps=tweedie_steps,
                                      text_cache=TextEmbeddingCache(cache_size) if cache_size > 0 else None,
                                      timer=timer, should_stop=should_stop)

    @property
    def reward_scorer(self) -> RewardScorer:
        """The run's reward calls (the sampling's; ReMax's greedy samples and the evaluation during training share it)."""
        return self.sampler.score

    def collect(self, epoch: int, model=None) -> list[Round]:
        """The epoch's rounds (one, or more under dynamic sampling), sampled with ``model`` (the denoiser the
        sampling steps call: the trainer's rollout policy; None: the family's), scored and gathered."""
        snapshot = SamplingSnapshot(self.prompt_sampler, self.estimation.stat_tracker)
        try:
            rounds = [self.sample_round(epoch, 0, model)]
            if self.config.algorithm.filter_groups:  # DAPO: more rounds until every process holds a full batch
                while len(rounds) < self.config.algorithm.max_num_gen_batches and self.short_of_kept_rows(rounds):
                    rounds.append(self.sample_round(epoch, len(rounds), model))
            if self.should_stop():
                raise EpochAbandoned(f"epoch {epoch} sampled; stopped before its update")
        except EpochAbandoned:
            snapshot.restore()
            raise
        return rounds

    def estimate(self, rounds: list[Round]) -> EpochRollouts:
        """The advantages of every round (in order), and the batch this process trains on (pooled from the rounds'
        kept rows under dynamic sampling)."""
        rounds = [self.estimate_round(r) for r in rounds]
        if not self.config.algorithm.filter_groups:
            return EpochRollouts(rounds, rounds[0].batch)
        keeps = [self.shards.local_rows(r.keep).bool() for r in rounds]
        batches = [r.batch for r in rounds]
        if any(b.negative is not None for b in batches):  # rows with a prompt's own negative condition beside rows
            batches = [b.with_negative(self.family) for b in batches]  # without: each row gets its own
        batch = pool_rows(batches, keeps, self.shards.local)
        return EpochRollouts(rounds, batch, batch_fill=float(self.shards.gather(batch.row_mask).mean()))

    def sample_round(self, epoch: int, round_index: int, model=None) -> Round:
        """Sample one round, score it and gather it with what the components add (module docstring); ``model`` None:
        the family's denoiser."""
        config, shards, accelerator = self.config, self.shards, self.accelerator
        model = model if model is not None else self.family.model
        group_size = config.train.group_size
        prompts, metadata, groups = self.prompt_sampler.sample_epoch(shards.total // group_size, group_size,
                                                                     whole_groups=self.whole_groups)
        mine = shards.mine
        seed = round_seed(config.seed, epoch, round_index)
        initial_noise = None
        if config.sample.same_initial_noise:
            initial_noise = group_initial_noise(seed, groups[mine], self.family.latent_shape(), accelerator.device)
        for component in self.components:
            component.before_round(self.sampler)
        with accelerator.autocast():  # the precision the training forward recomputes log-probs in
            desc = f"epoch {epoch}: sampling" if accelerator.is_local_main_process else None
            with sampling_precision(config.sample.precision, accelerator.device):
                batch = self.sampler.sample(
                    model, prompts[mine], metadata[mine], generators=sample_generators(seed, mine, accelerator.device),
                    initial_noise=initial_noise, desc=desc, groups=groups[mine])
            batch = widened(batch, config.sample.precision)
            sampled = SampledRound(epoch, batch, groups[mine], model, len(groups), initial_noise)
            extra = {}
            for component in self.components:
                extra.update(component.round_inputs(sampled))
        return self.gather_round(sampled, extra, prompts, groups)

    def gather_round(self, sampled: SampledRound, extra: dict, prompts: list[str], groups: list[int]) -> Round:
        """Gather the round's rewards, what the components add and the reward info over the processes."""
        config, shards, batch = self.config, self.shards, sampled.batch
        values = {key: shards.gather(value) for key, value in {"rewards": batch.rewards, **extra}.items()}
        gathered = GatheredRound(
            **{key: value for key, value in values.items() if key in GATHERED_FIELDS},
            reward_info={key: shards.gather(value) for key, value in batch.reward_info.items()},
            inputs={key: value for key, value in values.items() if key not in GATHERED_FIELDS})
        rewards, metrics = gathered.rewards, {}  # what the estimator normalises: the weighted sum by default
        if config.algorithm.multi_reward_mix == "advantage_aggr":
            rewards, metrics = self.component_advantages(gathered, groups)
        # a group is dropped when what the estimator got is constant in it (under advantage_aggr: every component is)
        keep, dropped_share = zero_variance_group_filter(rewards.double(), torch.as_tensor(groups))
        if not config.algorithm.filter_groups:
            keep = torch.ones_like(keep)
        queries = len(groups) + sum(component.round_queries(sampled) for component in self.components)
        return Round(batch=batch, gathered=gathered, estimator_rewards=rewards, prompts=list(prompts),
                     groups=list(groups), keep=keep, dropped_share=dropped_share, num_groups=len(set(groups)),
                     reward_queries=queries, component_metrics=metrics)

    def estimate_round(self, r: Round) -> Round:
        """The estimator on the whole gathered round (every prompt group complete); each process keeps its rows of the
        advantages, and of what the components make with them."""
        shards, estimation, batch = self.shards, self.estimation, r.batch
        inputs = r.advantage_inputs(batch.num_steps, estimation.stat_tracker)
        out = estimate_advantages(estimation.estimator, self.config, inputs, estimation.controller)
        advantages = shards.local_rows(out.advantages)
        estimated = {"advantages": advantages,
                     "group_index": torch.tensor(r.groups)[shards.mine].to(advantages.device)}  # prompt groups
        r = replace(r, out=out)
        for component in self.components:
            estimated.update(component.batch_fields(r))
        return replace(r, batch=replace(batch, **estimated))

    def component_advantages(self, gathered: GatheredRound, groups) -> tuple[torch.Tensor, dict]:
        """GDPO's decoupled normalisation on the gathered round: (S [B_global], adv/<component>/* metrics), with
        S_i = sum_k w_k (r_{i,k} - mean_g(r_k)) / (std_g(r_k) + eps) (algorithms/multi_reward.py).

        A combination's info holds each component's unweighted reward under its label: those are gathered (in
        process order, as the rewards); a single reward is its own component.
        """
        labels = [label for label, _ in self.reward_components]
        if getattr(self.reward_fn, "components", None):
            components = torch.stack([gathered.reward_info[label] for label in labels], dim=1)
        else:
            components = gathered.rewards.double()[:, None]
        group_index = torch.as_tensor(groups)
        S, z = component_normalized_sum(components, [w for _, w in self.reward_components], group_index)
        return S, component_metrics(components, z, labels, group_index)

    def short_of_kept_rows(self, rounds: list[Round]) -> bool:
        """True while some process holds fewer than a batch of rows from groups with reward variance."""
        kept = sum(int(self.shards.local_rows(r.keep).sum()) for r in rounds)
        return bool(self.shards.gather(torch.tensor([kept])).min() < self.shards.local)

    def close(self, wait: bool = True) -> None:
        self.sampler.close(wait)
