"""GROUP_PPO: the denoising steps cut into segments (GROUP_PPO.md), as pure tensor functions.

Vocabulary: a (prompt) group is the G samples of one prompt; a segment is a run of consecutive denoising steps of
one trajectory, ended by its endpoint (GROUP_PPO.md says "group of steps"; the metrics keep its segment/* names).

Conventions (B samples, T steps, step n = 0 noisiest):

* ``values`` [B, T] are PRE-step critic values, values[:, n] = V(x_n, t_n, c).
* Post-step values u [B, T]: u[:, n] = values[:, n + 1] for n <= T-2, u[:, T-1] = R,
  and u_{-1} = b_g (mean reward of the sample's prompt group).
* TD deltas (gamma = 1): delta[:, n] = u_n - u_{n-1} (+ step_rewards[:, n], KL in reward).
* Symbols: lambda = ``gae_lambda`` (group_ppo.gae_lambda), eps = ``numerical_floor`` (group_ppo.numerical_floor).
* Candidate segment [a, n]: A_bar_i = sum_{m=a..n} delta_{i,m} (= u_n - u_{a-1} without step
  rewards), r_grpo = sum_i W_i(a,n) A_bar_i^2, r_ppo = sum_i sum_m w_{i,m} delta_{i,m}^2 with
  W_i(a, n) = sum_{m=a..n} w_{i,m}; rho = (r_grpo + eps) / (r_ppo + eps). With uniform
  weights (the default) W = n - a + 1, exactly GROUP_PPO.md section 2.
* Segments k = 0..K-1 (0-based here) cover (e_{k-1}, e_k], e_{-1} = -1, e_{K-1} = T-1.
  Delta_k = sum of delta over segment k, A_k = sum_{j>=k} lambda^(j-k) Delta_j, broadcast to the
  steps of segment k; optionally divided by std_g(R) + eps (Bessel-corrected std, the same as
  grpo, so that the one-segment limit equals grpo exactly; a group with std_g <= eps, whose rewards are
  all equal, gets 0 as in grpo). Never mean-shifted or whitened.

Step mask and segments: the endpoints are computed over the FULL trajectory of T steps,
independent of the step mask (the critic values exist for every step, and the mask drawn by
step_fraction may change between inner epochs, so a step's advantage must not depend on
which other steps happen to be trained). The mask only zeroes the advantages of untrained
steps. ``find_segment_endpoints(..., step_mask=m)`` optionally uses the mask as the per-step
weights w of section 2 (only trained steps count in both variance sums); the estimator does
that only with ``segment_weight_by_mask=True``.

Critic (section 5), in the PRE-step indexing of ``values`` so that the trainer treats it like
gae (regress V(latents[:, n], timesteps[:, n]) on targets[:, n] under the mask): the critic
state of endpoint e_k is the post-step latent x_{e_k + 1}, i.e. pre-step column e_k + 1.

    endpoint_mask[:, n]  = 1  iff  n - 1 is an endpoint other than the last (n = e_k + 1, k < K-1)
    critic_targets[:, n] = u_{n-1} + A^{(lam_c)}_{k+1}  at those n (without std scaling), else 0

so every trajectory has K - 1 critic targets; lam_c = 1 gives critic_targets = R. The step-
indexed endpoints themselves are returned as ``step_endpoints`` [B, T] bool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional

import numpy as np
import torch

from .aggregation import compact_group_index, group_stats, group_sum


# ------------------------------------------------------------------------------- building blocks
def post_step_values(values: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """u [B, T]: u[:, n] = values[:, n+1] (n <= T-2), u[:, T-1] = rewards."""
    if values.dim() != 2 or rewards.shape != values.shape[:1]:
        raise ValueError(f"values must be [B, T] and rewards [B], got {tuple(values.shape)}, {tuple(rewards.shape)}")
    return torch.cat([values[:, 1:], rewards[:, None].to(values.dtype)], dim=1)


def td_deltas(u: torch.Tensor, start_value: torch.Tensor, step_rewards: Optional[torch.Tensor] = None) -> torch.Tensor:
    """delta[:, n] = u[:, n] - u[:, n-1] (+ step_rewards[:, n]) with u[:, -1] = start_value (b_g)."""
    prev = torch.cat([start_value[:, None].to(u.dtype), u[:, :-1]], dim=1)
    delta = u - prev
    if step_rewards is not None:
        delta = delta + step_rewards.to(u.dtype)
    return delta


@dataclass
class SegmentEndpoints:
    """Result of find_segment_endpoints (all per sample; samples of one prompt share them).

    is_endpoint [B, T] bool: step n ends a segment (the last step T-1 always does).
    segment_id [B, T] long: 0-based index k of the segment containing step n.
    num_segments [B] long: K.
    rho_at_cut [C] float64: rho(a, n) of each variance cut (one entry per prompt group and cut;
        forced cuts at max_segment_steps and the final endpoint are not included).
    """

    is_endpoint: torch.Tensor
    segment_id: torch.Tensor
    num_segments: torch.Tensor
    rho_at_cut: torch.Tensor


def find_segment_endpoints(
    u: Optional[torch.Tensor],
    delta: torch.Tensor,
    tau: float,
    max_segment_steps: int,
    numerical_floor: float = 1e-6,
    step_mask: Optional[torch.Tensor] = None,
    group_index: Optional[torch.Tensor] = None,
    cut_steps: Optional[torch.Tensor] = None,
) -> SegmentEndpoints:
    """Algorithm 2 of GROUP_PPO.md, vectorised over prompt groups (a loop over T only).

        a = 0
        for n in 0..T-1:
            if n > a and rho(a, n) > tau: close [a, n-1]; a = n     # variance cut
            if n - a + 1 >= max_segment_steps or n == T-1: close [a, n]; a = n + 1

    rho pools the samples of a prompt group (``group_index``; None = every row its own group).
    A_bar is computed from cumulative sums of ``delta`` (identical to u_n - u_{a-1} when
    delta = diff(u), and including the step rewards when KL is in the reward); ``u`` is only
    checked for shape and may be None. ``step_mask`` given = per-step weights w (module
    docstring); None = uniform weights. numerical_floor must be > 0 (then tau = 0 cuts at every step).
    ``cut_steps`` [T] bool: the steps n at which a variance cut may start a segment (None: every step); on trees
    the branch steps, so that every endpoint value is a node's (the length bound still closes anywhere).
    """
    if delta.dim() != 2:
        raise ValueError(f"delta must be [B, T], got shape {tuple(delta.shape)}")
    if u is not None and u.shape != delta.shape:
        raise ValueError(f"u {tuple(u.shape)} and delta {tuple(delta.shape)} differ")
    if int(max_segment_steps) < 1:
        raise ValueError(f"max_segment_steps must be >= 1, got {max_segment_steps}")
    if not (tau >= 0):
        raise ValueError(f"tau must be >= 0, got {tau}")
    if not (numerical_floor > 0):
        raise ValueError(f"numerical_floor must be > 0, got {numerical_floor}")
    B, T = delta.shape
    device = delta.device
    d = delta.detach().double()
    if group_index is None:
        gi, P = torch.arange(B, device=device), B
    else:
        gi, P = compact_group_index(group_index.to(device))
        if gi.shape[0] != B:
            raise ValueError(f"group_index has {gi.shape[0]} entries for {B} samples")
    w = torch.ones_like(d) if step_mask is None else (step_mask != 0).double()
    csum = torch.cumsum(d, dim=1)
    csum_ext = torch.cat([torch.zeros(B, 1, dtype=d.dtype, device=device), csum], dim=1)  # [:, a] = sum_{m<a}
    rows = torch.arange(B, device=device)
    a = torch.zeros(P, dtype=torch.long, device=device)
    ppo = torch.zeros(B, dtype=d.dtype, device=device)   # sum_{m=a..n-1} w delta^2 per sample
    wsum = torch.zeros(B, dtype=d.dtype, device=device)  # sum_{m=a..n-1} w per sample
    is_end = torch.zeros(P, T, dtype=torch.bool, device=device)
    rho_cut = torch.full((P, T), float("nan"), dtype=d.dtype, device=device)
    max_size = int(max_segment_steps)
    for n in range(T):
        a_i = a[gi]
        abar = csum[:, n] - csum_ext[rows, a_i]
        wd2 = w[:, n] * d[:, n] ** 2
        ppo_new = ppo + wd2
        wsum_new = wsum + w[:, n]
        r_grpo = group_sum(wsum_new * abar ** 2, gi, P)
        r_ppo = group_sum(ppo_new, gi, P)
        rho = (r_grpo + numerical_floor) / (r_ppo + numerical_floor)
        cut = (a < n) & (rho > tau)
        if cut_steps is not None and not bool(cut_steps[n]):
            cut = torch.zeros_like(cut)
        if n > 0:
            is_end[:, n - 1] |= cut
        rho_cut[:, n] = torch.where(cut, rho, rho_cut[:, n])
        a = torch.where(cut, torch.full_like(a, n), a)
        cut_i = cut[gi]
        ppo_new = torch.where(cut_i, wd2, ppo_new)
        wsum_new = torch.where(cut_i, w[:, n], wsum_new)
        close = ((n - a + 1) >= max_size) | (n == T - 1)
        is_end[:, n] |= close
        a = torch.where(close, torch.full_like(a, n + 1), a)
        close_i = close[gi]
        ppo = torch.where(close_i, torch.zeros_like(ppo_new), ppo_new)
        wsum = torch.where(close_i, torch.zeros_like(wsum_new), wsum_new)
    is_endpoint = is_end[gi]
    ends = is_endpoint.long()
    segment_id = torch.cumsum(ends, dim=1) - ends
    rho_vals = rho_cut[~torch.isnan(rho_cut)]
    return SegmentEndpoints(is_endpoint, segment_id, ends.sum(dim=1), rho_vals)


def segment_advantages(delta: torch.Tensor, is_endpoint: torch.Tensor, gae_lambda: float) -> torch.Tensor:
    """Per-step broadcast segment advantages [B, T] (no scaling).

    Delta_k = sum_{n in segment k} delta_n,  A_k = sum_{j >= k} lambda^(j-k) Delta_j,  adv[:, n] = A_{k(n)}.
    """
    if delta.shape != is_endpoint.shape:
        raise ValueError("delta and is_endpoint must have the same shape")
    if delta.shape[1] and not bool(is_endpoint[:, -1].all()):
        raise ValueError("the last step (T-1) must be an endpoint of every trajectory")
    B, T = delta.shape
    ends = is_endpoint.long()
    segment = torch.cumsum(ends, dim=1) - ends
    seg = torch.zeros_like(delta).scatter_add_(1, segment, delta)  # [B, K <= T], zero beyond K
    A = torch.zeros_like(seg)
    run = torch.zeros(B, dtype=delta.dtype, device=delta.device)
    for k in range(T - 1, -1, -1):
        run = seg[:, k] + gae_lambda * run
        A[:, k] = run
    return A.gather(1, segment)


def critic_endpoint_mask_and_targets(u: torch.Tensor, delta: torch.Tensor, is_endpoint: torch.Tensor,
                                     critic_gae_lambda: float):
    """(endpoint_mask [B, T] float, critic_targets [B, T]) in PRE-step indexing (module docstring).

    mask[:, n] = is_endpoint[:, n-1] for n >= 1 (the last endpoint T-1 has no column: its
    value is the reward); targets[:, n] = u[:, n-1] + A^{(critic_gae_lambda)}[:, n] there, 0 elsewhere.
    """
    B, T = u.shape
    adv_c = segment_advantages(delta, is_endpoint, critic_gae_lambda)
    mask = torch.zeros(B, T, dtype=torch.bool, device=u.device)
    mask[:, 1:] = is_endpoint[:, :-1]
    u_prev = torch.cat([torch.zeros(B, 1, dtype=u.dtype, device=u.device), u[:, :-1]], dim=1)
    targets = torch.where(mask, u_prev + adv_c, torch.zeros_like(u))
    return mask.to(u.dtype), targets


def segment_metrics(
    is_endpoint: torch.Tensor,
    step_mask: Optional[torch.Tensor] = None,
    tau: Optional[float] = None,
    rho_at_cut: Optional[torch.Tensor] = None,
) -> Dict[str, float]:
    """segment/* metrics (floats).

    segment/tau: the threshold used; segment/num_endpoints: mean K per trajectory; segment/mean_len:
    mean length of a segment (steps / segments over all trajectories); segment/max_len;
    segment/compression_ratio: 1 - (segments holding at least one trained step) / (trained steps),
    i.e. the share of trained steps that share their advantage with an earlier trained step of
    their segment (0 when every step is its own segment, 1 - 1/T for one segment and a full mask);
    segment/rho_at_cut: mean rho of the variance cuts (NaN when there was none);
    segment/num_variance_cuts: their number per prompt group-epoch total.
    """
    B, T = is_endpoint.shape
    ends = is_endpoint.long()
    K = ends.sum(dim=1).double()
    segment = torch.cumsum(ends, dim=1) - ends
    m = torch.ones(B, T, dtype=torch.bool, device=is_endpoint.device) if step_mask is None else (step_mask != 0)
    trained_in_segment = torch.zeros(B, T, dtype=torch.double, device=is_endpoint.device).scatter_add_(
        1, segment, m.double())
    segments_with_trained = (trained_in_segment > 0).double().sum()
    trained = m.double().sum()
    lengths = torch.zeros(B, T, dtype=torch.double, device=is_endpoint.device).scatter_add_(
        1, segment, torch.ones(B, T, dtype=torch.double, device=is_endpoint.device))
    out = {
        "segment/num_endpoints": float(K.mean()) if B else 0.0,
        "segment/mean_len": float(B * T / K.sum()) if B and K.sum() > 0 else 0.0,
        "segment/max_len": float(lengths.max()) if B else 0.0,
        "segment/compression_ratio": float(1.0 - segments_with_trained / trained) if trained > 0 else 0.0,
    }
    if tau is not None:
        out["segment/tau"] = float(tau)
    if rho_at_cut is not None:
        out["segment/rho_at_cut"] = float(rho_at_cut.double().mean()) if rho_at_cut.numel() else float("nan")
        out["segment/num_variance_cuts"] = float(rho_at_cut.numel())
    return out


# ------------------------------------------------------------------------------- full estimator
@dataclass
class GroupPPOResult:
    advantages: torch.Tensor        # [B, T] broadcast segment advantages (unmasked, unclipped, maybe std-scaled)
    endpoint_mask: torch.Tensor     # [B, T] float, pre-step indexing (critic loss mask)
    critic_targets: torch.Tensor    # [B, T], pre-step indexing, 0 outside endpoint_mask
    step_endpoints: torch.Tensor    # [B, T] bool, step indexing (is step n an endpoint)
    segment_id: torch.Tensor          # [B, T] long
    u: torch.Tensor                 # [B, T] post-step values
    delta: torch.Tensor             # [B, T] TD deltas
    metrics: Dict[str, float] = field(default_factory=dict)


def group_ppo_from_values(
    values: torch.Tensor,
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    tau: float,
    max_segment_steps: int,
    numerical_floor: float,
    gae_lambda: float,
    norm_adv_by_std: bool,
    step_mask: Optional[torch.Tensor] = None,
    step_rewards: Optional[torch.Tensor] = None,
    critic_gae_lambda: Optional[float] = None,
    weight_by_mask: bool = False,
    residual: bool = False,
    cut_steps: Optional[torch.Tensor] = None,
) -> GroupPPOResult:
    """GROUP_PPO advantages and critic targets from pre-step values [B, T] and rewards [B].

    u from post_step_values, b_g = group mean of R, delta from td_deltas, endpoints from
    find_segment_endpoints (pooled per prompt group), A from segment_advantages(gae_lambda), divided by
    std_g(R) + numerical_floor if norm_adv_by_std; critic mask/targets with critic_gae_lambda (default: gae_lambda),
    never std-scaled. Computed in float64; returned in float64.

    ``residual``: the values are deviations from the prompt group's mean reward, V(x_n) = b_g + values[:, n], and
    the critic targets are returned as deviations too (y - b_g). With values = 0 every delta but the last is 0, so
    every group's advantage is R - b_g: grpo's, whatever the grouping; the critic adds per-step credit only as far as
    it predicts how a sample's reward will differ from its group's mean. ``cut_steps``: see find_segment_endpoints.
    """
    if values.dim() != 2:
        raise ValueError(f"values must be [B, T], got {tuple(values.shape)}")
    B, T = values.shape
    R = rewards.detach().double().reshape(-1)
    if R.shape[0] != B:
        raise ValueError(f"rewards has {R.shape[0]} entries for {B} samples")
    gi, P = compact_group_index(group_index.to(values.device))
    count, mean, std, _, _ = group_stats(R, gi, P, unbiased=True)
    b = mean[gi]
    V = values.detach().double()
    if residual:
        V = V + b[:, None]
    u = post_step_values(V, R)
    sr = None if step_rewards is None else step_rewards.detach().double()
    delta = td_deltas(u, b, sr)
    ep = find_segment_endpoints(u, delta, tau, max_segment_steps, numerical_floor,
                              step_mask=step_mask if weight_by_mask else None, group_index=gi, cut_steps=cut_steps)
    adv = segment_advantages(delta, ep.is_endpoint, gae_lambda)
    if norm_adv_by_std:  # a group whose rewards are all equal gets 0, as grpo's (R - mean_g) does, not x / floor
        scale = std[gi][:, None]
        adv = torch.where(scale > numerical_floor, adv / (scale + numerical_floor), torch.zeros_like(adv))
    critic_lambda = gae_lambda if critic_gae_lambda is None else critic_gae_lambda
    mask, targets = critic_endpoint_mask_and_targets(u, delta, ep.is_endpoint, critic_lambda)
    if residual:
        targets = torch.where(mask > 0, targets - b[:, None], targets)
    metrics = segment_metrics(ep.is_endpoint, step_mask, tau, ep.rho_at_cut)
    metrics["segment/num_critic_targets"] = float(mask.sum(dim=1).mean()) if B else 0.0
    return GroupPPOResult(adv, mask, targets, ep.is_endpoint, ep.segment_id, u, delta, metrics)


def returns_to_go(rewards: torch.Tensor, step_rewards: Optional[torch.Tensor], states: int) -> torch.Tensor:
    """[B, states]: from each state x_n, R + the step rewards from step n on (R alone from x_T, or without step
    rewards); float64."""
    R = rewards.detach().double().reshape(-1)
    to_go = R[:, None].expand(R.shape[0], states).clone()
    if step_rewards is not None:
        sums = step_rewards.detach().double().flip(1).cumsum(1).flip(1)
        to_go[:, :sums.shape[1]] += sums
    return to_go


def tree_values(tree_nodes: torch.Tensor, rewards: torch.Tensor,
                step_rewards: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Values measured on tree rollouts (docs/design/TREES.md): ``tree_nodes`` [B, T+1] names, for each sample and
    state x_n, the first sample sharing it. Returns (values [B, T], branch_steps [T] bool):

        V(x_n) = mean over the samples sharing x_n of  R_j + sum_{m >= n} r_{j,m}     (r: step_rewards, else 0)

    the pre-step values (V(x_0): the root's leaves' mean), an unbiased Monte-Carlo estimate of the state's value under
    the rollout policy; branch_steps[n] where x_n -> x_{n+1} splits a node (its samples differ at x_{n+1})."""
    nodes = torch.as_tensor(tree_nodes, device=rewards.device).long()
    B, T = nodes.shape[0], nodes.shape[1] - 1
    R = rewards.detach().double().reshape(B)
    to_go = returns_to_go(R, step_rewards, T)
    index = nodes[:, :T] + B * torch.arange(T, device=R.device)  # (state, step) -> one slot
    sums = torch.zeros(B * T, dtype=R.dtype, device=R.device).index_add_(0, index.flatten(), to_go.flatten())
    counts = torch.zeros(B * T, dtype=R.dtype, device=R.device).index_add_(0, index.flatten(),
                                                                           torch.ones_like(to_go).flatten())
    values = (sums / counts.clamp(min=1))[index]
    return values, (nodes[:, 1:] != nodes[:, :-1]).any(dim=0)


def tree_value_ev(tree_nodes: torch.Tensor, rewards: torch.Tensor, group_index: torch.Tensor,
                  step_rewards: Optional[torch.Tensor] = None) -> float:
    """How much of the return's variance within the prompt groups the tree's measured values explain, leave-one-out
    on both sides (a sample's own return never predicts itself):

        EV = 1 - sum (G_i,k - V_-i(x_k))^2 / sum (G_i,k - b_-i,k)^2

    over the states x_k just after a branch step (x_{n+1}, n a branch step) that at least 2 samples share; G_i,k:
    sample i's return from x_k (R_i + its step rewards from step k on), V_-i(x_k): the mean of the other samples
    sharing x_k, b_-i,k: the mean of the other samples of i's prompt group (grpo's baseline). EV > 0: the node values
    foresee the returns better than the group mean; 0 at a branch whose children are alike. NaN without such a
    state (no branch, or only branches into single leaves) or where the group's returns are all equal."""
    nodes = torch.as_tensor(tree_nodes, device=rewards.device).long()
    B, T = nodes.shape[0], nodes.shape[1] - 1
    R = rewards.detach().double().reshape(B)
    to_go = returns_to_go(R, step_rewards, T + 1)  # from x_k, k = 0 .. T
    gi = torch.as_tensor(group_index, device=R.device).long().reshape(B)

    def leave_one_out(keys: torch.Tensor, column: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sums = torch.zeros(B, dtype=R.dtype, device=R.device).index_add_(0, keys, column)
        counts = torch.zeros(B, dtype=R.dtype, device=R.device).index_add_(0, keys, torch.ones_like(column))
        others = counts[keys] - 1
        return (sums[keys] - column) / others.clamp(min=1), others

    gi_slots, _ = compact_group_index(gi)
    after_branch = torch.nonzero((nodes[:, 1:] != nodes[:, :-1]).any(dim=0)).flatten() + 1
    explained = total = 0.0
    for k in after_branch.tolist():
        value, others = leave_one_out(nodes[:, k], to_go[:, k])
        base, group_others = leave_one_out(gi_slots, to_go[:, k])
        shared = (others >= 1) & (group_others >= 1)
        explained += float(((to_go[shared, k] - value[shared]) ** 2).sum())
        total += float(((to_go[shared, k] - base[shared]) ** 2).sum())
    return 1.0 - explained / total if total > 1e-12 else float("nan")


# ------------------------------------------------------------------------------- controller
class GroupThresholdController:
    """Adaptive threshold tau (GROUP_PPO.md section 6), runtime state for checkpoints.

    After each epoch, on the critic's endpoint targets y and the values u_old the critic gave
    them when the epoch was sampled:

        EV   = 1 - Var(y - u_old) / Var(y)
        s    = clip((EV* - EV) / EV*, -1, 1)                  (EV* = target_ev, must be > 0)
        tau <- clip(tau * exp(lr * s), min_tau, max_tau)

    Poor critic (EV < EV*) -> s > 0 -> tau grows -> fewer variance cuts -> longer segments (more
    Monte-Carlo); good critic -> tau shrinks -> shorter segments (finer credit). With fewer than 2
    targets or Var(y) ~ 0, EV is undefined: tau is left unchanged and last_ev is NaN.

    The initial tau: with adaptation on it must lie in [min_tau, max_tau] (ValueError otherwise,
    never a silent clamp). With adaptive=False tau is fixed at any value >= 0 and the range is not
    used: tau = 0 makes every step its own segment (GAE with lambda = gae_lambda on group-mean-based
    deltas), tau = inf one segment per trajectory (grpo / Dr.GRPO); EV is still measured for logging.
    """

    def __init__(self, tau: float = 1.0, lr: float = 0.01, min_tau: float = 0.1, max_tau: float = 10.0,
                 target_ev: float = 0.5, adaptive: bool = True, weight_by_ev: bool = False):
        for message in self.errors(tau, lr, min_tau, max_tau, target_ev, adaptive):
            raise ValueError(message)
        self.weight_by_ev = bool(weight_by_ev)
        self.min_tau = float(min_tau)
        self.max_tau = float(max_tau)
        self.tau = float(tau)
        self.lr = float(lr)
        self.target_ev = float(target_ev)
        self.adaptive = bool(adaptive)
        self.last_ev = float("nan")

    @staticmethod
    def errors(tau, lr, min_tau, max_tau, target_ev, adaptive, names=None) -> list:
        """What is wrong with these settings (``names`` maps each argument to its config field for messages)."""
        n = names or {k: k for k in ("tau", "lr", "min_tau", "max_tau", "target_ev", "adaptive")}
        errors = []
        if not tau >= 0:
            errors.append(f"{n['tau']}={tau} must be >= 0")
        if lr < 0:
            errors.append(f"{n['lr']}={lr} must be >= 0")
        if not target_ev > 0:
            errors.append(f"{n['target_ev']}={target_ev} must be > 0")
        if adaptive:
            if not 0 < min_tau <= max_tau:
                errors.append(f"need 0 < {n['min_tau']} <= {n['max_tau']}, got {min_tau}, {max_tau}")
            elif not min_tau <= tau <= max_tau:
                errors.append(f"{n['tau']}={tau} lies outside [{n['min_tau']}, {n['max_tau']}] = [{min_tau}, "
                              f"{max_tau}], the range the adaptive threshold moves in: set it inside, or set "
                              f"{n['adaptive']}=False to keep tau fixed at any value >= 0 (0: every step its own segment)")
        return errors

    @classmethod
    def from_config(cls, config) -> "GroupThresholdController":
        group_ppo = config.group_ppo
        return cls(tau=group_ppo.variance_threshold, lr=group_ppo.threshold_lr, min_tau=group_ppo.min_threshold, max_tau=group_ppo.max_threshold,
                   target_ev=group_ppo.target_explained_variance, adaptive=group_ppo.adaptive_threshold,
                   weight_by_ev=group_ppo.critic_weight_by_ev)

    @classmethod
    def config_errors(cls, config) -> list:
        group_ppo = config.group_ppo
        names = {"tau": "group_ppo.variance_threshold", "lr": "group_ppo.threshold_lr",
                 "min_tau": "group_ppo.min_threshold", "max_tau": "group_ppo.max_threshold",
                 "target_ev": "group_ppo.target_explained_variance", "adaptive": "group_ppo.adaptive_threshold"}
        return cls.errors(group_ppo.variance_threshold, group_ppo.threshold_lr, group_ppo.min_threshold, group_ppo.max_threshold,
                          group_ppo.target_explained_variance, group_ppo.adaptive_threshold, names)

    def params(self) -> Dict[str, float]:
        """The estimator's keywords this epoch: tau, and with ``weight_by_ev`` the residual critic's weight
        clip(EV, 0, 1) of the epoch before (0 before any EV is measured)."""
        if not self.weight_by_ev:
            return {"tau": self.tau}
        return {"tau": self.tau, "critic_weight": self.critic_weight}

    @property
    def critic_weight(self) -> float:
        """clip(last EV, 0, 1); 0 while it is undefined (NaN)."""
        return float(np.clip(self.last_ev, 0.0, 1.0)) if math.isfinite(self.last_ev) else 0.0

    @staticmethod
    def explained_variance(targets, old_values, mask=None) -> float:
        y = torch.as_tensor(targets).detach().double()
        v = torch.as_tensor(old_values).detach().double()
        if mask is not None:
            sel = torch.as_tensor(mask) != 0
            y, v = y[sel], v[sel]
        y, v = y.reshape(-1), v.reshape(-1)
        if y.numel() < 2:
            return float("nan")
        var_y = y.var(unbiased=False)
        if var_y <= 1e-12:
            return float("nan")
        return float(1.0 - (y - v).var(unbiased=False) / var_y)

    def update(self, targets, old_values, mask=None) -> float:
        """Measure EV on (targets, old_values) (optionally under ``mask``) and adapt tau."""
        ev = self.explained_variance(targets, old_values, mask)
        self.last_ev = ev
        if self.adaptive and math.isfinite(ev):
            s = float(np.clip((self.target_ev - ev) / self.target_ev, -1.0, 1.0))
            self.tau = float(np.clip(self.tau * math.exp(self.lr * s), self.min_tau, self.max_tau))
        return self.tau

    @property
    def value(self) -> float:
        return self.tau

    def metrics(self) -> Dict[str, float]:
        """After ``update``: the explained variance it measured and the tau of the next epoch."""
        out = {"segment/critic_ev": self.last_ev, "segment/next_tau": self.tau}
        if self.weight_by_ev:
            out["segment/next_critic_weight"] = self.critic_weight
        return out

    def summary(self, epoch: int, metrics: dict, every: int = 10) -> Optional[str]:
        """A readable GROUP_PPO line every ``every`` epochs (None otherwise)."""
        if epoch % every:
            return None
        get = lambda key: metrics.get(key, float("nan"))  # noqa: E731
        return (
            f"GROUP_PPO epoch {epoch}: {get('segment/num_endpoints'):.1f} endpoints per trajectory "
            f"(mean segment length {get('segment/mean_len'):.2f} steps), compression ratio "
            f"{get('segment/compression_ratio'):.2f}, tau {get('segment/tau'):.3f} -> {get('segment/next_tau'):.3f}, critic "
            f"explained variance {get('segment/critic_ev'):.3f}, value loss {get('critic/value_loss'):.4f}, reward "
            f"{get('reward_mean'):.4f}"
        )

    def state_dict(self) -> dict:
        return {"tau": self.tau, "last_ev": self.last_ev, "lr": self.lr, "min_tau": self.min_tau,
                "max_tau": self.max_tau, "target_ev": self.target_ev, "adaptive": self.adaptive}

    def load_state_dict(self, state: dict) -> None:
        """Restore tau (and last_ev); the configured bounds/lr of ``self`` are kept."""
        self.tau = float(state["tau"])
        self.last_ev = float(state.get("last_ev", float("nan")))
