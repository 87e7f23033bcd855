"""Advantage estimators on the denoising-step axis, registered by name.

Every estimator has ONE signature so the trainer can call any by name with one params dict:

    fn(inputs: AdvantageInputs, **params) -> AdvantageOutput

Unknown keyword params are ignored. All math is done in float64 and vectorised over groups
(torch index_add / scatter_reduce; loops only over the T steps). Output tensors have the
rewards' floating dtype (float32 for integer rewards) and device.

Common post-processing: advantages are multiplied by the step mask, then clipped to
[-adv_clip_max, adv_clip_max] when adv_clip_max is given. ``returns`` are the critic
regression targets where the estimator defines them (gae, group_ppo, reinforce_plus_plus,
remax: the un-whitened returns), else equal to the advantages.

Group estimators (grpo, dr_grpo, rloo, grpo_passk, group_ppo) need at least 2 samples per
prompt group: they raise otherwise (``validate_group_size`` is the start-of-run check).
Estimators that reason on the terminal reward only (ddpo, grpo, dr_grpo, rloo, grpo_passk)
reject ``step_rewards`` (KL in reward is for gae, reinforce_plus_plus, remax, group_ppo).

On the step mask: for the step-level estimators (gae, reinforce_plus_plus, remax, group_ppo)
recursions over steps run over all T steps (every step of a diffusion trajectory exists; the
mask only selects trained steps), and the mask enters only the whitening statistics and the
final multiplication.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from .aggregation import compact_group_index, group_stats, masked_stats, masked_whiten
from .filters import zero_variance_group_filter
from .group_ppo import group_ppo_advantages
from ddpo_group.registry import Registry

ADV_ESTIMATOR_REGISTRY = Registry("advantage estimator")

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "grpo_passk", "group_ppo")
CRITIC_ESTIMATORS = ("gae", "group_ppo")


def register_adv_est(name: str):
    """Decorator registering an advantage estimator under ``name`` (fails if taken)."""
    return ADV_ESTIMATOR_REGISTRY.register(name)


def get_adv_estimator(name: str):
    """The estimator registered under ``name``; ValueError listing the registered names."""
    return ADV_ESTIMATOR_REGISTRY.get(name)


def validate_group_size(estimator: str, num_images_per_prompt: int) -> None:
    """Start-of-run check: group estimators need G >= 2 samples per prompt."""
    get_adv_estimator(estimator)
    if estimator in GROUP_ESTIMATORS and int(num_images_per_prompt) < 2:
        raise ValueError(
            f"advantage estimator {estimator!r} compares the samples of a prompt group and needs "
            f"sample.num_images_per_prompt >= 2, got {num_images_per_prompt}"
        )


@dataclass
class AdvantageInputs:
    """Inputs shared by all estimators (B samples, T denoising steps).

    rewards [B]: terminal rewards R_i. step_mask [B, T]: 1 where the step is trained.
    group_index [B] long: prompt group of each sample. prompts: prompt texts (ddpo).
    values [B, T]: PRE-step critic values V(x_n, t_n, c) (gae, group_ppo).
    step_rewards [B, T]: per-step rewards added to the terminal one (e.g. -beta * KL_n).
    greedy_rewards [B]: reward of the eta = 0 sample of each sample's prompt (remax).
    stat_tracker: PerPromptStatTracker (ddpo).
    """

    rewards: torch.Tensor
    step_mask: torch.Tensor
    group_index: Optional[torch.Tensor] = None
    prompts: Optional[List[str]] = None
    values: Optional[torch.Tensor] = None
    step_rewards: Optional[torch.Tensor] = None
    greedy_rewards: Optional[torch.Tensor] = None
    stat_tracker: Optional[object] = None


@dataclass
class AdvantageOutput:
    """advantages [B, T] (masked, clipped); returns [B, T]; metrics (floats).

    group_ppo also fills endpoint_mask [B, T] (critic loss mask) and critic_targets [B, T], both
    in the pre-step indexing of ``values`` (see group_ppo.py), and extras["step_endpoints"].
    """

    advantages: torch.Tensor
    returns: torch.Tensor
    metrics: Dict[str, float] = field(default_factory=dict)
    endpoint_mask: Optional[torch.Tensor] = None
    critic_targets: Optional[torch.Tensor] = None
    extras: Dict[str, torch.Tensor] = field(default_factory=dict)


# ----------------------------------------------------------------------------------- helpers
def _out_dtype(rewards: torch.Tensor) -> torch.dtype:
    return rewards.dtype if rewards.is_floating_point() else torch.float32


def _prepare(inputs: AdvantageInputs, name: str, need_groups: bool = False, allow_step_rewards: bool = True):
    rewards = torch.as_tensor(inputs.rewards)
    if rewards.dim() != 1:
        raise ValueError(f"{name}: rewards must be [B], got shape {tuple(rewards.shape)}")
    mask = torch.as_tensor(inputs.step_mask, device=rewards.device)
    if mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"{name}: step_mask must be [B, T] with B = {rewards.shape[0]}, got {tuple(mask.shape)}")
    R = rewards.detach().double()
    if not bool(torch.isfinite(R).all()):
        raise ValueError(f"{name}: rewards contain non-finite values")
    m = (mask != 0).double()
    if not allow_step_rewards and inputs.step_rewards is not None:
        raise ValueError(
            f"{name} uses the terminal reward only and cannot take step_rewards (KL in reward): "
            f"use a step-level estimator (gae, reinforce_plus_plus, remax, group_ppo) or the KL loss"
        )
    gi = P = None
    if need_groups:
        if inputs.group_index is None:
            raise ValueError(f"{name} needs group_index (the prompt group of each sample)")
        gi, P = compact_group_index(torch.as_tensor(inputs.group_index, device=rewards.device))
        if gi.shape[0] != R.shape[0]:
            raise ValueError(f"{name}: group_index has {gi.shape[0]} entries for {R.shape[0]} samples")
    return rewards, R, m, gi, P


def _require_pairs(name: str, count: torch.Tensor) -> None:
    if count.numel() and float(count.min()) < 2:
        raise ValueError(
            f"{name} needs at least 2 samples per prompt group (sample.num_images_per_prompt >= 2); "
            f"found a group with {int(count.min())} sample"
        )


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


def _finalize(adv, returns, m, rewards, adv_clip_max, metrics, **extra) -> AdvantageOutput:
    """Mask, clip, cast; add adv/* metrics."""
    dtype = _out_dtype(rewards)
    adv = adv * m
    if adv_clip_max is not None:
        adv = adv.clamp(-float(adv_clip_max), float(adv_clip_max))
    returns = adv if returns is None else returns
    metrics = dict(metrics)
    metrics.update(masked_stats(adv, m, "adv/"))
    if adv_clip_max is not None:
        metrics["adv/clipfrac"] = float(((adv.abs() >= float(adv_clip_max)) & (m > 0)).double().sum() / m.sum().clamp(min=1))
    out = AdvantageOutput(advantages=adv.to(dtype), returns=returns.to(dtype), metrics=metrics)
    for k, v in extra.items():
        setattr(out, k, v)
    return out


def _group_metrics(R, gi, P, std, eps=1e-6) -> Dict[str, float]:
    _, zero_ratio = zero_variance_group_filter(R, gi, eps=eps)
    return {
        "reward/num_groups": float(P),
        "reward/mean_group_std": float(std.mean()) if P else 0.0,
        "reward/zero_std_ratio": zero_ratio,
    }


# ---------------------------------------------------------------------------------- estimators
@register_adv_est("ddpo")
def ddpo_advantage(inputs: AdvantageInputs, adv_clip_max: Optional[float] = None, **_) -> AdvantageOutput:
    """DDPO: per-prompt stat tracker (buffer mode), broadcast over steps.

    A_i = (R_i - mu_p) / (sd_p + eps) with mu_p, sd_p of the prompt's FIFO buffer once it holds
    >= min_count rewards, of the whole batch before (stat_tracking.py). Needs
    inputs.stat_tracker and inputs.prompts.
    """
    rewards, R, m, _, _ = _prepare(inputs, "ddpo", allow_step_rewards=False)
    if inputs.stat_tracker is None or inputs.prompts is None:
        raise ValueError("ddpo needs inputs.stat_tracker (PerPromptStatTracker) and inputs.prompts")
    a = inputs.stat_tracker.update(list(inputs.prompts), R.cpu().numpy())
    A = torch.as_tensor(a, dtype=torch.float64, device=R.device)
    metrics = inputs.stat_tracker.get_metrics("stat_tracker/") if hasattr(inputs.stat_tracker, "get_metrics") else {}
    return _finalize(A[:, None].expand_as(m), None, m, rewards, adv_clip_max, metrics)


@register_adv_est("grpo")
def grpo_advantage(inputs: AdvantageInputs, eps: float = 1e-6, norm_adv_by_std: bool = True,
                   global_std: bool = False, adv_clip_max: Optional[float] = None, **_) -> AdvantageOutput:
    """GRPO: A_i = (R_i - mean_g) / (std_g + eps), broadcast over steps.

    std_g is the Bessel-corrected std of the G rewards of the group (torch.std, as verl);
    global_std=True uses the Bessel-corrected std of all B rewards instead (group mean, batch
    std); norm_adv_by_std=False gives Dr.GRPO (R_i - mean_g).
    """
    rewards, R, m, gi, P = _prepare(inputs, "grpo", need_groups=True, allow_step_rewards=False)
    count, mean, std, _, _ = group_stats(R, gi, P, unbiased=True)
    _require_pairs("grpo", count)
    A = R - mean[gi]
    if norm_adv_by_std:
        scale = (R.std(unbiased=True) if global_std else std[gi]) + eps
        A = A / scale
    metrics = _group_metrics(R, gi, P, std)
    return _finalize(A[:, None].expand_as(m), None, m, rewards, adv_clip_max, metrics)


@register_adv_est("dr_grpo")
def dr_grpo_advantage(inputs: AdvantageInputs, adv_clip_max: Optional[float] = None, **_) -> AdvantageOutput:
    """Dr.GRPO: A_i = R_i - mean_g (no std division), broadcast over steps."""
    rewards, R, m, gi, P = _prepare(inputs, "dr_grpo", need_groups=True, allow_step_rewards=False)
    count, mean, std, _, _ = group_stats(R, gi, P, unbiased=True)
    _require_pairs("dr_grpo", count)
    A = R - mean[gi]
    return _finalize(A[:, None].expand_as(m), None, m, rewards, adv_clip_max, _group_metrics(R, gi, P, std))


@register_adv_est("rloo")
def rloo_advantage(inputs: AdvantageInputs, adv_clip_max: Optional[float] = None, **_) -> AdvantageOutput:
    """RLOO: A_i = R_i - mean_{j != i in g} R_j = G/(G-1) * (R_i - mean_g), broadcast over steps."""
    rewards, R, m, gi, P = _prepare(inputs, "rloo", need_groups=True, allow_step_rewards=False)
    count, mean, std, _, _ = group_stats(R, gi, P, unbiased=True)
    _require_pairs("rloo", count)
    G = count[gi]
    A = G / (G - 1) * (R - mean[gi])
    return _finalize(A[:, None].expand_as(m), None, m, rewards, adv_clip_max, _group_metrics(R, gi, P, std))


@register_adv_est("grpo_passk")
def grpo_passk_advantage(inputs: AdvantageInputs, eps: float = 1e-6, norm_adv_by_std: bool = True,
                         adv_clip_max: Optional[float] = None, **_) -> AdvantageOutput:
    """Pass@k GRPO: only the group's best sample gets A = r_max - r_second_max (divided by
    std_g + eps, Bessel-corrected, if norm_adv_by_std); every other sample gets 0. With ties at
    the top the difference is 0. Broadcast over steps.
    """
    rewards, R, m, gi, P = _prepare(inputs, "grpo_passk", need_groups=True, allow_step_rewards=False)
    count, mean, std, _, gmax = group_stats(R, gi, P, unbiased=True)
    _require_pairs("grpo_passk", count)
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
    return _finalize(A[:, None].expand_as(m), None, m, rewards, adv_clip_max, _group_metrics(R, gi, P, std))


@register_adv_est("reinforce_plus_plus")
def reinforce_plus_plus_advantage(inputs: AdvantageInputs, gamma: float = 1.0, adv_clip_max: Optional[float] = None,
                                  **_) -> AdvantageOutput:
    """REINFORCE++: G_n = sum_{m >= n} gamma^(m-n) r_m with r = step_rewards + R at the last
    step; A = masked_whiten(G) over the batch's trained steps (mean 0, unbiased var 1);
    returns = G.
    """
    rewards, R, m, _, _ = _prepare(inputs, "reinforce_plus_plus")
    r = _step_rewards(inputs, R, m.shape[1])
    G = _discounted_returns(r, gamma)
    A = masked_whiten(G, m)
    return _finalize(A, G, m, rewards, adv_clip_max, {"returns/mean": float(G.mean())})


@register_adv_est("remax")
def remax_advantage(inputs: AdvantageInputs, adv_clip_max: Optional[float] = None, **_) -> AdvantageOutput:
    """ReMax: A_{i,n} = (R_i + sum_{m >= n} step_rewards_{i,m}) - R_greedy_i, where R_greedy_i is
    the reward of the eta = 0 (greedy) sample of the sample's prompt (inputs.greedy_rewards [B]).
    returns = the reward-to-go.
    """
    rewards, R, m, _, _ = _prepare(inputs, "remax")
    if inputs.greedy_rewards is None:
        raise ValueError("remax needs inputs.greedy_rewards [B] (reward of the greedy eta=0 sample per prompt)")
    g = torch.as_tensor(inputs.greedy_rewards, device=R.device).detach().double().reshape(-1)
    if g.shape != R.shape:
        raise ValueError(f"remax: greedy_rewards must be [B] = [{R.shape[0]}], got {tuple(g.shape)}")
    G = _discounted_returns(_step_rewards(inputs, R, m.shape[1]), 1.0)
    A = G - g[:, None]
    return _finalize(A, G, m, rewards, adv_clip_max, {"reward/greedy_mean": float(g.mean())})


@register_adv_est("gae")
def gae_advantage(inputs: AdvantageInputs, gamma: float = 1.0, lam: float = 1.0, whiten: bool = True,
                  gae_start_value: str = "critic", adv_clip_max: Optional[float] = None, **_) -> AdvantageOutput:
    """GAE(gamma, lambda) over the T steps with the critic's pre-step values V_n = values[:, n]:

        r_n     = step_rewards_n + [n = T-1] R,     V_T = 0
        delta_n = r_n + gamma V_{n+1} - V_n
        A_n     = delta_n + gamma lam A_{n+1}
        returns = A + V          (critic targets, un-whitened)
        A       = masked_whiten(A) if whiten (default), then * mask

    gae_start_value="group_mean" replaces V_0 = V(x_0) by the group mean reward b_g, which is
    the GROUP_PPO convention u_{-1} = b_g (then GROUP_PPO with tau = 0 equals this estimator
    with gamma = 1 and whiten=False exactly); the default "critic" uses V(x_0).
    """
    rewards, R, m, gi, P = _prepare(inputs, "gae", need_groups=(gae_start_value == "group_mean"))
    if inputs.values is None:
        raise ValueError("gae needs inputs.values [B, T] (pre-step critic values)")
    V = torch.as_tensor(inputs.values, device=R.device).detach().double()
    if V.shape != m.shape:
        raise ValueError(f"gae: values must be [B, T] = {tuple(m.shape)}, got {tuple(V.shape)}")
    if gae_start_value == "group_mean":
        _, mean, _, _, _ = group_stats(R, gi, P)
        V = V.clone()
        V[:, 0] = mean[gi]
    elif gae_start_value != "critic":
        raise ValueError(f"gae_start_value must be 'critic' or 'group_mean', got {gae_start_value!r}")
    r = _step_rewards(inputs, R, m.shape[1])
    B, T = m.shape
    A = torch.zeros_like(V)
    last = torch.zeros(B, dtype=V.dtype, device=V.device)
    next_v = torch.zeros(B, dtype=V.dtype, device=V.device)
    for n in range(T - 1, -1, -1):
        delta = r[:, n] + gamma * next_v - V[:, n]
        last = delta + gamma * lam * last
        A[:, n] = last
        next_v = V[:, n]
    returns = A + V
    if whiten:
        A = masked_whiten(A, m)
    metrics = {"critic/values_mean": float(V.mean()), "returns/mean": float(returns.mean())}
    return _finalize(A, returns, m, rewards, adv_clip_max, metrics)


@register_adv_est("group_ppo")
def group_ppo_advantage(inputs: AdvantageInputs, tau: Optional[float] = None, group_max_size: int = 16,
                        group_epsilon: float = 1e-6, lam: float = 1.0, norm_adv_by_std: bool = False,
                        critic_lam: Optional[float] = None, group_weight_by_mask: bool = False,
                        adv_clip_max: Optional[float] = None, group_variance_threshold: float = 1.0,
                        **_) -> AdvantageOutput:
    """GROUP_PPO (GROUP_PPO.md; formulas in group_ppo.py): dynamic step groups, the group
    advantage A_k = sum_{j >= k} lam^(j-k) Delta_j broadcast to its steps (optionally / (std_g(R)
    + group_epsilon)), never whitened. tau defaults to group_variance_threshold (pass the
    GroupThresholdController's tau). Fills endpoint_mask / critic_targets (pre-step indexing,
    K-1 per trajectory), returns = critic_targets, extras step_endpoints / group_id.
    Endpoints do not depend on the step mask unless group_weight_by_mask=True.
    """
    rewards, R, m, gi, P = _prepare(inputs, "group_ppo", need_groups=True)
    if inputs.values is None:
        raise ValueError("group_ppo needs inputs.values [B, T] (pre-step critic values)")
    V = torch.as_tensor(inputs.values, device=R.device).detach().double()
    if V.shape != m.shape:
        raise ValueError(f"group_ppo: values must be [B, T] = {tuple(m.shape)}, got {tuple(V.shape)}")
    count, _, std, _, _ = group_stats(R, gi, P, unbiased=True)
    _require_pairs("group_ppo", count)
    sr = None
    if inputs.step_rewards is not None:
        sr = torch.as_tensor(inputs.step_rewards, device=R.device).detach().double()
    res = group_ppo_advantages(
        V, R, gi, tau=group_variance_threshold if tau is None else tau, group_max_size=group_max_size,
        eps=group_epsilon, lam=lam, norm_adv_by_std=norm_adv_by_std, step_mask=m, step_rewards=sr,
        critic_lam=critic_lam, weight_by_mask=group_weight_by_mask,
    )
    metrics = dict(res.metrics)
    metrics.update(_group_metrics(R, gi, P, std))
    dtype = _out_dtype(rewards)
    return _finalize(
        res.advantages, res.critic_targets, m, rewards, adv_clip_max, metrics,
        endpoint_mask=res.endpoint_mask.to(dtype), critic_targets=res.critic_targets.to(dtype),
        extras={"step_endpoints": res.step_endpoints, "group_id": res.group_id},
    )
