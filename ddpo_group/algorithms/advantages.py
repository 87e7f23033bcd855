"""Advantage estimators on the denoising-step axis, one decorated function each.

Every estimator has ONE signature and declares what it needs and gives in its registration::

    @register_adv_est("grpo", needs_groups=True,
                      params={"norm_adv_by_std": "train.scale_rewards", "global_std": "algorithm.global_std"})
    def grpo_advantage(inputs: AdvantageInputs, norm_adv_by_std=True, global_std=False, **_) -> AdvantageOutput:

* ``needs_groups``: compares the G samples of a prompt group (``inputs.group_index``, at least 2 per group;
  the run checks ``train.group_size >= 2`` at start and DAPO's dynamic sampling is allowed);
* ``needs_critic``: reads ``inputs.values`` [B, T] (pre-step critic values): the trainer builds and trains a
  critic on ``critic_targets(out) -> (targets, mask)`` [B, T] (default: ``returns`` on every step);
* ``accepts_step_rewards``: takes per-step rewards (``kl.in_reward``); the others reject them;
* ``needs_greedy_rewards``: reads ``inputs.greedy_rewards`` [B] (ReMax's greedy baseline, sampled by the trainer);
* ``params``: keyword -> the config field it is read from; ``algorithm.adv_estimator_kwargs`` adds or
  overrides keywords;
* ``check(config) -> [messages]``: contradictions of its own fields, reported at start;
* ``controller(config)``: adaptive state whose ``params()`` override keywords each epoch, updated after the
  epoch from the critic's targets (GROUP_PPO's threshold tau).

The estimator returns raw advantages [B, T] (float64 is fine); the registration's wrapper multiplies them by
the step mask, clips them to [-adv_clip_max, adv_clip_max] (``train.adv_clip_max``), casts them to the
rewards' floating dtype (float32 for integer rewards) and adds the ``adv/*`` metrics. ``returns`` are the
critic regression targets where the estimator defines them, else the final advantages. Unknown keyword
params are ignored by the built-ins. All math is float64 and vectorised over groups (index_add /
scatter_reduce; loops only over the T steps).

A plugin (``algorithm.adv_estimator=/path/file.py:my_estimator`` or ``package.module:my_estimator``) is
a function of the same signature; it declares its needs with ``@adv_estimator(needs_groups=True, ...)``
(the same keywords, no name; an undecorated function needs nothing) and gets
``algorithm.adv_estimator_kwargs`` as keywords.

On the step mask: for the step-level estimators (gae, reinforce_plus_plus, remax, group_ppo) recursions
over steps run over all T steps (every step of a diffusion trajectory exists; the mask only selects
trained steps), and the mask enters only the whitening statistics and the final multiplication.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional

import torch

from .aggregation import compact_group_index, group_stats, masked_stats, masked_whiten
from .filters import zero_variance_group_filter
from .group_ppo import GroupThresholdController, group_ppo_from_values, tree_value_ev, tree_values
from ddpo_group.registry import Registry, read_field


@dataclass
class AdvantageInputs:
    """Inputs shared by all estimators (B samples, T denoising steps).

    rewards [B]: terminal rewards R_i. step_mask [B, T]: 1 where the step is trained.
    group_index [B] long: prompt group of each sample. prompts: prompt texts (ddpo).
    values [B, T]: PRE-step critic values V(x_n, t_n, c) (gae, group_ppo).
    step_rewards [B, T]: per-step rewards added to the terminal one (e.g. -beta * KL_n).
    greedy_rewards [B]: reward of the eta = 0 sample of each sample's prompt (remax).
    tweedie_values [B, T]: V(x_n) = reward of the decoded one-step prediction clean_hat(x_n), the terminal reward where
        the rest of the trajectory is deterministic (group_ppo's value_source "tweedie" / "blend"; rollout/tweedie.py).
    tree_nodes [B, T+1] long: tree rollouts' first sample sharing each sample's state x_n (group_ppo's value_source
        "tree"; sampling/trajectories.py).
    stat_tracker: PerPromptStatTracker (ddpo).
    """

    rewards: torch.Tensor
    step_mask: torch.Tensor
    group_index: Optional[torch.Tensor] = None
    prompts: Optional[List[str]] = None
    values: Optional[torch.Tensor] = None
    step_rewards: Optional[torch.Tensor] = None
    greedy_rewards: Optional[torch.Tensor] = None
    tweedie_values: Optional[torch.Tensor] = None
    tree_nodes: Optional[torch.Tensor] = None
    stat_tracker: Optional[object] = None


@dataclass
class AdvantageOutput:
    """advantages [B, T]; returns [B, T] (None: the advantages); metrics (floats).

    group_ppo also fills endpoint_mask [B, T] (critic loss mask) and critic_targets [B, T], both in the
    pre-step indexing of ``values`` (see group_ppo.py), and extras["step_endpoints"].
    """

    advantages: torch.Tensor
    returns: Optional[torch.Tensor] = None
    metrics: Dict[str, float] = field(default_factory=dict)
    endpoint_mask: Optional[torch.Tensor] = None
    critic_targets: Optional[torch.Tensor] = None
    extras: Dict[str, torch.Tensor] = field(default_factory=dict)


def every_step_returns(out: AdvantageOutput) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic regresses ``returns`` at every step (gae)."""
    return out.returns, torch.ones_like(out.returns)


def endpoint_targets(out: AdvantageOutput) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic regresses ``critic_targets`` at the group endpoints only (group_ppo)."""
    return out.critic_targets, out.endpoint_mask


@dataclass(frozen=True)
class EstimatorSpec:
    """An advantage estimator with what it declares (module docstring); calling it runs and finalizes it."""

    fn: Callable[..., AdvantageOutput]
    name: str
    needs_groups: bool = False
    needs_critic: bool = False
    accepts_step_rewards: bool = False
    needs_greedy_rewards: bool = False
    critic_targets: Optional[Callable[[AdvantageOutput], tuple]] = None
    params: Mapping[str, str] = field(default_factory=dict)
    check: Optional[Callable[[object], List[str]]] = None
    controller: Optional[Callable[[object], object]] = None
    # config -> the optional inputs this configuration of the estimator reads ({"tweedie_values"} or none)
    optional_inputs: Optional[Callable[[object], set]] = None

    def __call__(self, inputs: AdvantageInputs, adv_clip_max: Optional[float] = None, **params) -> AdvantageOutput:
        self.check_inputs(inputs)
        out = self.fn(inputs, **params)
        return _finalize(out, inputs, adv_clip_max)

    def params_from(self, config, controller=None) -> dict:
        """Keywords for one call: the declared config fields, ``algorithm.adv_estimator_kwargs``, the controller's."""
        params = {keyword: read_field(config, dotted) for keyword, dotted in self.params.items()}
        kwargs = config.algorithm.adv_estimator_kwargs
        params.update(kwargs.to_dict() if hasattr(kwargs, "to_dict") else dict(kwargs or {}))
        if controller is not None:
            params.update(controller.params())
        return params

    def critic_regression(self, out: AdvantageOutput) -> tuple[torch.Tensor, torch.Tensor]:
        """(targets, mask) [B, T] of the critic, pre-step indexing."""
        return (self.critic_targets or every_step_returns)(out)

    def config_errors(self, config) -> List[str]:
        return list(self.check(config)) if self.check is not None else []

    def reads(self, config, name: str) -> bool:
        """Whether this estimator, configured by ``config``, reads the optional input ``name``."""
        return self.optional_inputs is not None and name in self.optional_inputs(config)

    def check_inputs(self, inputs: AdvantageInputs) -> None:
        """The declared needs, with an error naming what is missing."""
        name, B = self.name, torch.as_tensor(inputs.rewards).reshape(-1).shape[0]
        if self.needs_groups:
            if inputs.group_index is None:
                raise ValueError(f"{name} needs group_index (the prompt group of each sample)")
            gi, P = compact_group_index(torch.as_tensor(inputs.group_index))
            if gi.shape[0] != B:
                raise ValueError(f"{name}: group_index has {gi.shape[0]} entries for {B} samples")
            count = torch.bincount(gi, minlength=P)
            if count.numel() and int(count.min()) < 2:
                raise ValueError(f"{name} needs at least 2 samples per prompt group (train.group_size >= 2); "
                                 f"found a group with {int(count.min())} sample")
        if self.needs_critic and inputs.values is None:
            raise ValueError(f"{name} needs inputs.values [B, T] (pre-step critic values)")
        if self.needs_greedy_rewards and inputs.greedy_rewards is None:
            raise ValueError(f"{name} needs inputs.greedy_rewards [B] (reward of the greedy eta=0 sample per prompt)")
        if not self.accepts_step_rewards and inputs.step_rewards is not None:
            raise ValueError(f"{name} uses the terminal reward only and cannot take step_rewards (KL in reward): use "
                             f"one of {step_reward_estimators()} or the KL loss")


ADV_ESTIMATOR_REGISTRY = Registry("advantage estimator", entry_point_group="ddpo_group.adv_estimators")


def adv_estimator(**needs) -> Callable[[Callable], EstimatorSpec]:
    """Decorator declaring an estimator's needs (module docstring) without registering a name (plugins)."""
    def decorator(fn: Callable) -> EstimatorSpec:
        return EstimatorSpec(fn=fn, name=needs.pop("name", fn.__name__), **needs)
    return decorator


def register_adv_est(name: str, **needs) -> Callable[[Callable], EstimatorSpec]:
    """Decorator registering an estimator under ``name`` with its needs (fails if the name is taken)."""
    def decorator(fn: Callable) -> EstimatorSpec:
        return ADV_ESTIMATOR_REGISTRY.register(name)(EstimatorSpec(fn=fn, name=name, **needs))
    return decorator


def step_reward_estimators() -> List[str]:
    """The registered estimators that accept per-step rewards (KL in the reward)."""
    return [name for name in ADV_ESTIMATOR_REGISTRY if ADV_ESTIMATOR_REGISTRY.get(name).accepts_step_rewards]


def get_adv_estimator(spec: str) -> EstimatorSpec:
    """The estimator a config names: registered name, ``module:function``, ``/path/file.py:function`` or entry
    point. A plugin function that was not declared with ``@adv_estimator`` needs nothing."""
    return ADV_ESTIMATOR_REGISTRY.resolve_spec(spec, EstimatorSpec, lambda fn, name: EstimatorSpec(fn=fn, name=name))


# ----------------------------------------------------------------------------------- helpers
def _finalize(out: AdvantageOutput, inputs: AdvantageInputs, adv_clip_max: Optional[float]) -> AdvantageOutput:
    """Mask, clip, cast; add adv/* metrics (the same for every estimator, plugins included)."""
    rewards = torch.as_tensor(inputs.rewards)
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    m = (torch.as_tensor(inputs.step_mask, device=out.advantages.device) != 0).double()
    adv = out.advantages.double() * m
    if adv_clip_max is not None:
        adv = adv.clamp(-float(adv_clip_max), float(adv_clip_max))
    metrics = dict(out.metrics)
    metrics.update(masked_stats(adv, m, "adv/"))
    if adv_clip_max is not None:
        clipped = ((adv.abs() >= float(adv_clip_max)) & (m > 0)).double().sum()
        metrics["adv/clipfrac"] = float(clipped / m.sum().clamp(min=1))
    returns = adv if out.returns is None else out.returns
    out.advantages, out.returns, out.metrics = adv.to(dtype), returns.to(dtype), metrics
    return out


def _prepare(inputs: AdvantageInputs, name: str):
    """(R [B] float64, m [B, T] float64, group index [B] or None, P) with shape checks."""
    rewards = torch.as_tensor(inputs.rewards)
    if rewards.dim() != 1:
        raise ValueError(f"{name}: rewards must be [B], got shape {tuple(rewards.shape)}")
    mask = torch.as_tensor(inputs.step_mask, device=rewards.device)
    if mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"{name}: step_mask must be [B, T] with B = {rewards.shape[0]}, got {tuple(mask.shape)}")
    R = rewards.detach().double()
    if not bool(torch.isfinite(R).all()):
        raise ValueError(f"{name}: rewards contain non-finite values")
    gi = P = None
    if inputs.group_index is not None:
        gi, P = compact_group_index(torch.as_tensor(inputs.group_index, device=rewards.device))
        if gi.shape[0] != R.shape[0]:
            raise ValueError(f"{name}: group_index has {gi.shape[0]} entries for {R.shape[0]} samples")
    return R, (mask != 0).double(), gi, P


def _values(inputs: AdvantageInputs, m: torch.Tensor, name: str) -> torch.Tensor:
    V = torch.as_tensor(inputs.values, device=m.device).detach().double()
    if V.shape != m.shape:
        raise ValueError(f"{name}: values must be [B, T] = {tuple(m.shape)}, got {tuple(V.shape)}")
    return V


def _step_rewards(inputs: AdvantageInputs, R: torch.Tensor, T: int) -> torch.Tensor:
    """r [B, T] float64: step_rewards (if any) plus R at the last step."""
    r = torch.zeros(R.shape[0], T, dtype=torch.float64, device=R.device)
    if inputs.step_rewards is not None:
        sr = torch.as_tensor(inputs.step_rewards, device=R.device).detach().double()
        if sr.shape != r.shape:
            raise ValueError(f"step_rewards must be [B, T] = {tuple(r.shape)}, got {tuple(sr.shape)}")
        r = r + sr
    r[:, -1] += R
    return r


def _discounted_returns(r: torch.Tensor, gamma: float) -> torch.Tensor:
    """G[:, n] = sum_{m >= n} gamma^(m-n) r[:, m] over all T steps."""
    G = torch.zeros_like(r)
    run = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    for n in range(r.shape[1] - 1, -1, -1):
        run = r[:, n] + gamma * run
        G[:, n] = run
    return G


def _group_metrics(R, gi, P, std, eps=1e-6) -> Dict[str, float]:
    _, zero_ratio = zero_variance_group_filter(R, gi, eps=eps)
    return {
        "reward/num_groups": float(P),
        "reward/mean_group_std": float(std.mean()) if P else 0.0,
        "reward/zero_std_ratio": zero_ratio,
    }


def _broadcast(A: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return A[:, None].expand_as(m)


# --------------------------------------------------------------------------- their own config checks
def _gamma_in_range(config) -> List[str]:
    gamma = config.algorithm.gamma
    return [] if 0 < gamma <= 1 else [f"algorithm.gamma={gamma} must be in (0, 1]"]


def _never_std_scaled(config) -> List[str]:
    if not config.train.scale_rewards:
        return []
    name = config.algorithm.adv_estimator
    return [f"train.scale_rewards=True contradicts algorithm.adv_estimator={name!r}, which never divides by the "
            "group std (set train.scale_rewards=False, or use grpo)"]


def _gae_checks(config) -> List[str]:
    algorithm, errors = config.algorithm, _gamma_in_range(config)
    if not 0 <= algorithm.gae_lambda <= 1:
        errors.append(f"algorithm.gae_lambda={algorithm.gae_lambda} must be in [0, 1]")
    if algorithm.gae_start_value not in GAE_START_VALUES:
        errors.append(f"algorithm.gae_start_value={algorithm.gae_start_value!r} must be one of {GAE_START_VALUES}")
    return errors


def _group_ppo_checks(config) -> List[str]:
    group_ppo, errors = config.group_ppo, []
    if group_ppo.max_segment_steps < 1:
        errors.append(f"group_ppo.max_segment_steps={group_ppo.max_segment_steps} must be >= 1")
    if not group_ppo.numerical_floor > 0:
        errors.append(f"group_ppo.numerical_floor={group_ppo.numerical_floor} must be > 0")
    if not 0 <= group_ppo.gae_lambda <= 1:
        errors.append(f"group_ppo.gae_lambda={group_ppo.gae_lambda} must be in [0, 1]")
    if group_ppo.value_source not in GROUP_PPO_VALUE_SOURCES:
        errors.append(f"group_ppo.value_source={group_ppo.value_source!r}; allowed: {list(GROUP_PPO_VALUE_SOURCES)}")
    if not 0 <= group_ppo.value_blend <= 1:
        errors.append(f"group_ppo.value_blend={group_ppo.value_blend} must be in [0, 1]")
    return errors + GroupThresholdController.config_errors(config)


GAE_START_VALUES = ("critic", "group_mean")
GROUP_PPO_VALUE_SOURCES = ("critic", "residual_critic", "tweedie", "blend", "tree")
TWEEDIE_VALUE_SOURCES = ("tweedie", "blend")  # read inputs.tweedie_values
RESIDUAL_VALUE_SOURCES = ("residual_critic", "blend")  # the critic's output is a deviation from the group mean


def _group_ppo_inputs(config) -> set:
    source = config.group_ppo.value_source
    return {"tweedie_values"} if source in TWEEDIE_VALUE_SOURCES else {"tree_nodes"} if source == "tree" else set()


# ---------------------------------------------------------------------------------- estimators
@register_adv_est("ddpo")
def ddpo_advantage(inputs: AdvantageInputs, **_) -> AdvantageOutput:
    """DDPO: per-prompt stat tracker (buffer mode), broadcast over steps.

    A_i = (R_i - mu_p) / (sd_p + eps) with mu_p, sd_p of the prompt's FIFO buffer once it holds
    >= min_count rewards, of the whole batch before (stat_tracker.py). Needs
    inputs.stat_tracker and inputs.prompts.
    """
    R, m, _, _ = _prepare(inputs, "ddpo")
    if inputs.stat_tracker is None or inputs.prompts is None:
        raise ValueError("ddpo needs inputs.stat_tracker (PerPromptStatTracker) and inputs.prompts")
    a = inputs.stat_tracker.update(list(inputs.prompts), R.cpu().numpy())
    A = torch.as_tensor(a, dtype=torch.float64, device=R.device)
    metrics = inputs.stat_tracker.get_metrics("stat_tracker/") if hasattr(inputs.stat_tracker, "get_metrics") else {}
    return AdvantageOutput(_broadcast(A, m), metrics=metrics)


@register_adv_est("grpo", needs_groups=True,
                  params={"norm_adv_by_std": "train.scale_rewards", "global_std": "algorithm.global_std"})
def grpo_advantage(inputs: AdvantageInputs, *, norm_adv_by_std: bool, global_std: bool, eps: float = 1e-6,
                   **_) -> AdvantageOutput:
    """GRPO: A_i = (R_i - mean_g) / (std_g + eps), broadcast over steps.

    std_g is the Bessel-corrected std of the G rewards of the group (torch.std, as verl);
    global_std=True uses the Bessel-corrected std of all B rewards instead (group mean, batch
    std); norm_adv_by_std=False gives Dr.GRPO (R_i - mean_g).
    """
    R, m, gi, P = _prepare(inputs, "grpo")
    _, mean, std, _, _ = group_stats(R, gi, P, unbiased=True)
    A = R - mean[gi]
    if norm_adv_by_std:
        A = A / ((R.std(unbiased=True) if global_std else std[gi]) + eps)
    return AdvantageOutput(_broadcast(A, m), metrics=_group_metrics(R, gi, P, std))


@register_adv_est("tree_grpo", needs_groups=True, params={"norm_adv_by_std": "train.scale_rewards"},
                  optional_inputs=lambda config: {"tree_nodes"})
def tree_grpo_advantage(inputs: AdvantageInputs, *, norm_adv_by_std: bool, eps: float = 1e-6, **_) -> AdvantageOutput:
    """GRPO on tree rollouts, BranchGRPO-style: the steps are cut into segments at each branch step b_k (a segment from
    step 0 to the first branch step, when it is later than 0, and one from each b_k to b_{k+1} - 1, the last to T - 1),
    and the steps of a segment [a, e] get the difference of the values at its ends,

        A = (V(x_{e+1}) - V(x_a)) / (std_g(R) + eps),   V(x_n) = the mean reward of the leaves sharing x_n

    (group_ppo.tree_values; V(x_T) = R; the first segment starts from the prompt group's mean reward, the mean of its
    roots): each branch's credit from its node's and its parent's leaf means, without GROUP_PPO's variance test
    (group_ppo_from_values with tau = 0, lambda = 0 and cuts at the branch steps). A tree branching once, at step 0,
    gives grpo's advantages. Needs inputs.tree_nodes (sample.branch_steps, or the default tree: sampling/tree.py).
    """
    R, m, gi, P = _prepare(inputs, "tree_grpo")
    if inputs.tree_nodes is None:
        raise ValueError("tree_grpo needs inputs.tree_nodes [B, T+1] (tree rollouts: sample.branch_steps)")
    if inputs.step_rewards is not None:
        raise ValueError("tree_grpo takes no step_rewards (the KL in the reward): use group_ppo's value_source='tree'")
    V, branch = tree_values(inputs.tree_nodes, R)
    _, _, std, _, _ = group_stats(R, gi, P, unbiased=True)
    res = group_ppo_from_values(V, R, gi, tau=0.0, max_segment_steps=V.shape[1], numerical_floor=eps, gae_lambda=0.0,
                               norm_adv_by_std=norm_adv_by_std, cut_steps=branch)
    segments = float(res.step_endpoints.sum(1).double().mean())
    metrics = {**_group_metrics(R, gi, P, std), "tree/segments": segments,
               "tree/value_ev": tree_value_ev(inputs.tree_nodes, R, gi)}
    return AdvantageOutput(res.advantages * m, metrics=metrics)


@register_adv_est("dr_grpo", needs_groups=True, check=_never_std_scaled)
def dr_grpo_advantage(inputs: AdvantageInputs, **_) -> AdvantageOutput:
    """Dr.GRPO: A_i = R_i - mean_g (no std division), broadcast over steps."""
    R, m, gi, P = _prepare(inputs, "dr_grpo")
    _, mean, std, _, _ = group_stats(R, gi, P, unbiased=True)
    return AdvantageOutput(_broadcast(R - mean[gi], m), metrics=_group_metrics(R, gi, P, std))


@register_adv_est("rloo", needs_groups=True, check=_never_std_scaled)
def rloo_advantage(inputs: AdvantageInputs, **_) -> AdvantageOutput:
    """RLOO: A_i = R_i - mean_{j != i in g} R_j = G/(G-1) * (R_i - mean_g), broadcast over steps."""
    R, m, gi, P = _prepare(inputs, "rloo")
    count, mean, std, _, _ = group_stats(R, gi, P, unbiased=True)
    G = count[gi]
    A = G / (G - 1) * (R - mean[gi])
    return AdvantageOutput(_broadcast(A, m), metrics=_group_metrics(R, gi, P, std))


@register_adv_est("grpo_passk", needs_groups=True, params={"norm_adv_by_std": "train.scale_rewards"})
def grpo_passk_advantage(inputs: AdvantageInputs, *, norm_adv_by_std: bool, eps: float = 1e-6,
                         **_) -> AdvantageOutput:
    """Pass@k GRPO: only the group's best sample gets A = r_max - r_second_max (divided by
    std_g + eps, Bessel-corrected, if norm_adv_by_std); every other sample gets 0. With ties at
    the top the difference is 0. Broadcast over steps.
    """
    R, m, gi, P = _prepare(inputs, "grpo_passk")
    _, _, std, _, gmax = group_stats(R, gi, P, unbiased=True)
    B = R.shape[0]
    idx = torch.arange(B, device=R.device)
    cand = torch.where(R == gmax[gi], idx, torch.full_like(idx, B))
    best = torch.full((P,), B, dtype=torch.long, device=R.device).scatter_reduce(0, gi, cand, reduce="amin")
    others = R.clone()
    others[best] = -float("inf")
    second = torch.full((P,), -float("inf"), dtype=R.dtype, device=R.device).scatter_reduce(
        0, gi, others, reduce="amax")
    gap = gmax - second
    if norm_adv_by_std:
        gap = gap / (std + eps)
    A = torch.zeros_like(R)
    A[best] = gap
    return AdvantageOutput(_broadcast(A, m), metrics=_group_metrics(R, gi, P, std))


@register_adv_est("reinforce_plus_plus", accepts_step_rewards=True, params={"gamma": "algorithm.gamma"},
                  check=_gamma_in_range)
def reinforce_plus_plus_advantage(inputs: AdvantageInputs, *, gamma: float, **_) -> AdvantageOutput:
    """REINFORCE++: G_n = sum_{m >= n} gamma^(m-n) r_m with r = step_rewards + R at the last
    step; A = masked_whiten(G) over the batch's trained steps (mean 0, unbiased var 1);
    returns = G.
    """
    R, m, _, _ = _prepare(inputs, "reinforce_plus_plus")
    G = _discounted_returns(_step_rewards(inputs, R, m.shape[1]), gamma)
    return AdvantageOutput(masked_whiten(G, m), G, metrics={"returns/mean": float(G.mean())})


@register_adv_est("remax", accepts_step_rewards=True, needs_greedy_rewards=True)
def remax_advantage(inputs: AdvantageInputs, **_) -> AdvantageOutput:
    """ReMax: A_{i,n} = (R_i + sum_{m >= n} step_rewards_{i,m}) - R_greedy_i, where R_greedy_i is
    the reward of the eta = 0 (greedy) sample of the sample's prompt (inputs.greedy_rewards [B]).
    returns = the reward-to-go.
    """
    R, m, _, _ = _prepare(inputs, "remax")
    g = torch.as_tensor(inputs.greedy_rewards, device=R.device).detach().double().reshape(-1)
    if g.shape != R.shape:
        raise ValueError(f"remax: greedy_rewards must be [B] = [{R.shape[0]}], got {tuple(g.shape)}")
    G = _discounted_returns(_step_rewards(inputs, R, m.shape[1]), 1.0)
    return AdvantageOutput(G - g[:, None], G, metrics={"reward/greedy_mean": float(g.mean())})


@register_adv_est("gae", needs_critic=True, accepts_step_rewards=True, critic_targets=every_step_returns,
                  params={"gamma": "algorithm.gamma", "gae_lambda": "algorithm.gae_lambda", "whiten": "algorithm.gae_whiten",
                          "gae_start_value": "algorithm.gae_start_value"},
                  check=_gae_checks)
def gae_advantage(inputs: AdvantageInputs, *, gamma: float, gae_lambda: float, whiten: bool, gae_start_value: str,
                  **_) -> AdvantageOutput:
    """GAE(gamma, lambda) over the T steps with the critic's pre-step values V_n = values[:, n]:

        r_n     = step_rewards_n + [n = T-1] R,     V_T = 0
        delta_n = r_n + gamma V_{n+1} - V_n
        A_n     = delta_n + gamma lambda A_{n+1}       (lambda = gae_lambda)
        returns = A + V          (critic targets, un-whitened)
        A       = masked_whiten(A) if whiten, then * mask

    gae_start_value="group_mean" replaces V_0 = V(x_0) by the group mean reward b_g, which is
    the GROUP_PPO convention u_{-1} = b_g (then GROUP_PPO with tau = 0 equals this estimator
    with gamma = 1 and whiten=False exactly); the default "critic" uses V(x_0).
    """
    R, m, gi, P = _prepare(inputs, "gae")
    V = _values(inputs, m, "gae")
    if gae_start_value == "group_mean":
        if gi is None:
            raise ValueError("gae with gae_start_value='group_mean' needs group_index (the prompt group of each sample)")
        _, mean, _, _, _ = group_stats(R, gi, P)
        V = V.clone()
        V[:, 0] = mean[gi]
    elif gae_start_value != "critic":
        raise ValueError(f"gae_start_value must be one of {GAE_START_VALUES}, got {gae_start_value!r}")
    r = _step_rewards(inputs, R, m.shape[1])
    B, T = m.shape
    A = torch.zeros_like(V)
    last = torch.zeros(B, dtype=V.dtype, device=V.device)
    next_v = torch.zeros(B, dtype=V.dtype, device=V.device)
    for n in range(T - 1, -1, -1):
        delta = r[:, n] + gamma * next_v - V[:, n]
        last = delta + gamma * gae_lambda * last
        A[:, n] = last
        next_v = V[:, n]
    returns = A + V
    if whiten:
        A = masked_whiten(A, m)
    return AdvantageOutput(A, returns, metrics={"critic/values_mean": float(V.mean()), "returns/mean": float(returns.mean())})


@register_adv_est("group_ppo", needs_groups=True, needs_critic=True, accepts_step_rewards=True,
                  critic_targets=endpoint_targets, controller=GroupThresholdController.from_config,
                  params={"tau": "group_ppo.variance_threshold", "max_segment_steps": "group_ppo.max_segment_steps",
                          "numerical_floor": "group_ppo.numerical_floor", "gae_lambda": "group_ppo.gae_lambda",
                          "norm_adv_by_std": "train.scale_rewards", "value_source": "group_ppo.value_source",
                          "value_blend": "group_ppo.value_blend"},
                  check=_group_ppo_checks, optional_inputs=_group_ppo_inputs)
def group_ppo_advantage(inputs: AdvantageInputs, *, tau: float, max_segment_steps: int, numerical_floor: float,
                        gae_lambda: float, norm_adv_by_std: bool, value_source: str, value_blend: float,
                        critic_gae_lambda: Optional[float] = None, segment_weight_by_mask: bool = False,
                        critic_weight: float = 1.0, **_) -> AdvantageOutput:
    """GROUP_PPO (GROUP_PPO.md; formulas in group_ppo.py): dynamic segments of steps, the segment
    advantage A_k = sum_{j >= k} lambda^(j-k) Delta_j (lambda = gae_lambda) broadcast to its steps (optionally
    / (std_g(R) + numerical_floor), 0 for a group whose rewards are all equal), never whitened. tau comes from the
    GroupThresholdController each epoch. Fills endpoint_mask / critic_targets (pre-step indexing,
    K-1 per trajectory), returns = critic_targets, extras step_endpoints / segment_id.
    Endpoints do not depend on the step mask unless segment_weight_by_mask=True.
    value_source, the endpoint values V (b_g: the group's mean reward, f: the critic's output, Q: tweedie_values):
        "critic"           V = f
        "residual_critic"  V = b_g + f       (f learns the deviation from the group mean; at f = 0 this is grpo)
        "tweedie"          V = Q             (no training; the critic is still trained, unused)
        "blend"            V = w Q + (1 - w)(b_g + f),  w = value_blend
        "tree"             V(x_n) = the mean return of the samples sharing x_n (tree rollouts: group_ppo.tree_values),
                           and the variance cuts only at the branch steps; the critic is trained but gives no value,
                           only its explained variance to the adaptive threshold
    The critic's targets are deviations from b_g whenever f enters as a deviation (residual_critic, blend).
    ``critic_weight`` c (the threshold controller's clip(EV, 0, 1) with group_ppo.critic_weight_by_ev, else 1): f
    enters those two as c f, so a critic that explains nothing adds nothing (at c = 0 residual_critic is grpo).
    """
    R, m, gi, P = _prepare(inputs, "group_ppo")
    V = _values(inputs, m, "group_ppo")
    if value_source in RESIDUAL_VALUE_SOURCES and critic_weight != 1.0:
        V = critic_weight * V
    _, mean, std, _, _ = group_stats(R, gi, P, unbiased=True)
    if value_source in TWEEDIE_VALUE_SOURCES:
        if inputs.tweedie_values is None:
            raise ValueError(f"group_ppo with value_source={value_source!r} needs inputs.tweedie_values [B, T]")
        Q = torch.as_tensor(inputs.tweedie_values, device=R.device).detach().double()
        if Q.shape != V.shape:
            raise ValueError(f"tweedie_values has shape {tuple(Q.shape)}, values {tuple(V.shape)}")
        # blend in deviation space: b_g + w (Q - b_g) + (1 - w) f = w Q + (1 - w)(b_g + f)
        V = Q if value_source == "tweedie" else value_blend * (Q - mean[gi][:, None]) + (1 - value_blend) * V
    sr = None if inputs.step_rewards is None else torch.as_tensor(inputs.step_rewards, device=R.device).detach().double()
    cut_steps = None
    if value_source == "tree":
        if inputs.tree_nodes is None:
            raise ValueError("group_ppo with value_source='tree' needs inputs.tree_nodes [B, T+1] (tree rollouts)")
        V, cut_steps = tree_values(inputs.tree_nodes, R, sr)
    res = group_ppo_from_values(
        V, R, gi, tau=tau, max_segment_steps=max_segment_steps, numerical_floor=numerical_floor, gae_lambda=gae_lambda,
        norm_adv_by_std=norm_adv_by_std, step_mask=m, step_rewards=sr, critic_gae_lambda=critic_gae_lambda,
        weight_by_mask=segment_weight_by_mask,
        residual=value_source in RESIDUAL_VALUE_SOURCES, cut_steps=cut_steps,
    )
    metrics = {**res.metrics, **_group_metrics(R, gi, P, std)}
    if value_source in RESIDUAL_VALUE_SOURCES:
        metrics["segment/critic_weight"] = float(critic_weight)
    if value_source == "tree":
        metrics["tree/value_ev"] = tree_value_ev(inputs.tree_nodes, R, gi, sr)
    dtype = inputs.rewards.dtype if torch.as_tensor(inputs.rewards).is_floating_point() else torch.float32
    return AdvantageOutput(
        res.advantages, res.critic_targets, metrics, endpoint_mask=res.endpoint_mask.to(dtype),
        critic_targets=res.critic_targets.to(dtype), extras={"step_endpoints": res.step_endpoints, "segment_id": res.segment_id},
    )
