"""Policy losses, one decorated function each (verl's core_algos style), over (sample, denoising step) pairs.

A per-step loss (``per_step=True``: vanilla, ratio_norm) is a weighted sum over pairs; the update calls it on each
chunk of pairs and backpropagates at once (memory: one chunk's activations; the chunks' losses add up to the train
batch's)::

    fn(rollout_log_prob, log_prob, advantages, weights, *, clip_low, clip_high, clip_ratio_c, **_) -> (loss, metrics)

with tensors of one shape: a chunk's [N] pairs, or a batch's [B, T] with weights = aggregation_weights(step_mask,
loss_agg_mode) (algorithms/aggregation.py), which gives the batch's aggregated loss. A pair of weight 0 takes no part
in the loss or the metrics.

A trajectory-level loss (gspo, geo_mean: a ratio over a trajectory's steps) gets the train batch's [B, T] matrices,
the trained steps' new log-probs gathered from its chunks::

    fn(rollout_log_prob, log_prob, advantages, step_mask, loss_agg_mode, *, clip_low, clip_high, clip_ratio_c, **_)

Every loss ignores unknown keyword arguments, so the update passes one set. The log-ratio d = l_new - l_rollout is clamped
to [-20, 20] before exponentiation. A plugin (``algorithm.policy_loss=/path/file.py:my_loss`` or
``package.module:my_loss``) is trajectory-level unless it declares ``@policy_loss(per_step=True)``, and receives
``algorithm.policy_loss_kwargs`` as keywords.

A loss that needs the rollout policy's step means (``ratio_norm``) registers ``needs_rollout_means=True``: rollouts then
record each step's mean (RolloutBatch.step_means, one latent-sized tensor per step, recorded only then) and the loss
receives, besides the above, ``mean`` (mu_theta [N, ...], with gradient), ``rollout_mean`` (mu_rollout [N, ...]),
``std`` (the step's std [N]), ``step_length`` (s_n - s_{n+1} [N], sampling/gaussian.py) and ``log_prob_reduce``.

Metrics (floats, over the trained pairs): clipfrac (the clipped branch is active), clipfrac_lower (the dual clip is
active), approx_kl = mean(d^2 / 2) (DDPO's estimate, >= 0), ppo_kl = mean(l_rollout - l_new) (verl's), ratio_mean /
ratio_min / ratio_max.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from .aggregation import agg_loss, masked_mean
from .kl import gaussian_kl
from ddpo_group.registry import Registry

LOG_RATIO_CLAMP = 20.0


def outside_ratio_clip(rollout_log_prob, log_prob, *, clip_low: float, clip_high: float, **_) -> torch.Tensor:
    """[N] bool: the pairs whose ratio r = exp(l_theta - l_rollout) lies outside [1 - clip_low, 1 + clip_high], where a
    ratio-clipping loss's trust region acts (it stops their gradient)."""
    ratio = torch.exp((log_prob - rollout_log_prob).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return (ratio > 1.0 + clip_high) | (ratio < 1.0 - clip_low)


# the trust region's settings the update gives a loss that names them: train.clip_range (both sides),
# algorithm.clip_ratio_c (the dual clip), train.policy_kl_threshold (dppo)
BOUNDS = ("clip_low", "clip_high", "clip_ratio_c", "policy_kl_threshold")
BOUND_FIELDS = {"clip_low": "train.clip_range", "clip_high": "train.clip_range",
                "clip_ratio_c": "algorithm.clip_ratio_c",
                "policy_kl_threshold": "train.policy_kl_threshold"}


@dataclass(frozen=True)
class PolicyLossSpec:
    """A policy loss and how the update calls it (module docstring); calling it runs it."""

    fn: Callable
    name: str
    per_step: bool = False  # a weighted sum over pairs (weights); False: trajectory-level ([B, T], step mask, mode)
    needs_rollout_means: bool = False  # rollouts record the step means; the loss gets mean, rollout_mean, std, step_length
    check: Optional[Callable] = None  # check(policy_loss_kwargs: dict) -> list of config error messages
    # outside(rollout_log_prob, log_prob, clip_low=, clip_high=, **the loss's keywords) -> [N] bool: the pairs the loss's
    # trust region acts on (train/clipped_before_update: before any update it should act on none)
    trust_region: Callable = outside_ratio_clip

    def outside_trust_region(self, rollout_log_prob, log_prob, **kwargs) -> torch.Tensor:
        return self.trust_region(rollout_log_prob, log_prob, **kwargs)

    @property
    def bounds(self) -> tuple:
        """The settings of BOUNDS the loss or its trust region names (all of them to a loss taking ``**kwargs``, such
        as a plugin wrapping a built-in one): the ones the update gives it."""
        own = inspect.signature(self.fn).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in own.values()):
            return BOUNDS
        named = set(own) | set(inspect.signature(self.trust_region).parameters)
        return tuple(name for name in BOUNDS if name in named)

    def trust_region_fields(self, config) -> str:
        """The config fields that set the trust region's bounds, with their values ("train.clip_range=0.0001"; dppo's
        "train.policy_kl_threshold=1e-05"), for the messages that judge it."""
        named = inspect.signature(self.trust_region).parameters
        fields = dict.fromkeys(BOUND_FIELDS[name] for name in BOUNDS if name in named)
        return ", ".join(f"{field}={config[field.split('.')[0]][field.split('.')[1]]:g}" for field in fields)

    def __post_init__(self):
        if self.needs_rollout_means and not self.per_step:  # the step means reach a per-step loss's chunks only
            raise ValueError(f"policy loss {self.name!r}: needs_rollout_means=True needs per_step=True")

    def config_errors(self, kwargs: dict) -> list:
        return list(self.check(dict(kwargs))) if self.check is not None else []

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


POLICY_LOSS_REGISTRY = Registry("policy loss", entry_point_group="ddpo_group.policy_losses")


def policy_loss(per_step: bool = False, needs_rollout_means: bool = False, check: Optional[Callable] = None,
                trust_region: Callable = outside_ratio_clip) -> Callable[[Callable], PolicyLossSpec]:
    """Decorator declaring how a loss is called (and what it needs) without registering a name (plugins)."""
    def decorator(fn: Callable) -> PolicyLossSpec:
        return PolicyLossSpec(fn=fn, name=fn.__name__, per_step=per_step, needs_rollout_means=needs_rollout_means, check=check,
                              trust_region=trust_region)
    return decorator


def register_policy_loss(name: str, per_step: bool = False, needs_rollout_means: bool = False,
                         check: Optional[Callable] = None,
                         trust_region: Callable = outside_ratio_clip) -> Callable[[Callable], PolicyLossSpec]:
    """Decorator registering a policy loss under ``name`` (fails if the name is taken)."""
    def decorator(fn: Callable) -> PolicyLossSpec:
        spec = PolicyLossSpec(fn=fn, name=name, per_step=per_step, needs_rollout_means=needs_rollout_means, check=check,
                              trust_region=trust_region)
        return POLICY_LOSS_REGISTRY.register(name)(spec)
    return decorator


def get_policy_loss(spec: str) -> PolicyLossSpec:
    """The loss a config names: registered name, ``module:function``, ``/path/file.py:function`` or entry point."""
    return POLICY_LOSS_REGISTRY.resolve_spec(spec, PolicyLossSpec, lambda fn, name: PolicyLossSpec(fn=fn, name=name))


def _check(rollout_log_prob, log_prob, advantages, mask):
    """One shape for the four (``mask``: the step mask or the weights)."""
    if not (rollout_log_prob.shape == log_prob.shape == advantages.shape == mask.shape):
        raise ValueError(
            "rollout_log_prob, log_prob, advantages and the step mask / weights must have the same shape, got "
            f"{tuple(rollout_log_prob.shape)}, {tuple(log_prob.shape)}, {tuple(advantages.shape)}, {tuple(mask.shape)}"
        )


def _check_trajectories(rollout_log_prob, log_prob, advantages, step_mask):
    _check(rollout_log_prob, log_prob, advantages, step_mask)
    if log_prob.dim() != 2:
        raise ValueError(f"expected [B, T] tensors, got shape {tuple(log_prob.shape)}")


def _check_clip(clip_low, clip_high, clip_ratio_c):
    if clip_low is None or clip_high is None:
        raise ValueError("clip_low and clip_high are required")
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low/clip_high must be >= 0, got {clip_low}, {clip_high}")
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1, got {clip_ratio_c}")


def _ratio_metrics(d: torch.Tensor, mask: torch.Tensor) -> dict:
    d = d.detach()
    ratio = torch.exp(d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    sel = ratio[mask != 0]
    return {
        "approx_kl": float(masked_mean(0.5 * d.pow(2), mask)),
        "ppo_kl": float(masked_mean(-d, mask)),
        "ratio_mean": float(sel.mean()) if sel.numel() else 1.0,
        "ratio_min": float(sel.min()) if sel.numel() else 1.0,
        "ratio_max": float(sel.max()) if sel.numel() else 1.0,
    }


def clipped_surrogate(ratio, advantages, clip_low, clip_high, clip_ratio_c):
    """PPO's clipped surrogate of each entry, and which clip acts: (L, clipped, dual).

        L = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))       clipped: the second term is the larger
        L = min(L, -A clip_ratio_c)   where A < 0                    dual: this bound acts (None: no dual clip)
    """
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clip_loss = torch.maximum(l1, l2)
    clipped = l2 > l1
    if clip_ratio_c is None:
        return clip_loss, clipped, torch.zeros_like(clipped)
    l3 = -advantages * clip_ratio_c
    neg = advantages < 0
    dual = neg & (clip_loss > l3)
    loss = torch.where(neg, torch.minimum(clip_loss, l3), clip_loss)
    return loss, clipped, dual


def weighted_sum(weights: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
    """sum w L over the pairs, a pair of weight 0 left out even where its L is inf or NaN."""
    return (weights * losses.masked_fill(weights == 0, 0.0)).sum()


@register_policy_loss("vanilla", per_step=True)
def vanilla_policy_loss(rollout_log_prob, log_prob, advantages, weights, *, clip_low: float, clip_high: float,
                        clip_ratio_c: Optional[float], **_) -> Tuple[torch.Tensor, dict]:
    """PPO-clip (ddpo-pytorch's and Flow-GRPO's loss) with an asymmetric clip range and the dual clip.

    Args:
        rollout_log_prob: [N] l_rollout, each pair's recorded step under the rollout policy
        log_prob: [N] l_theta, the same step under the policy being trained (with gradient)
        advantages: [N] A
        weights: [N] w, each pair's aggregation weight (algorithm.loss_agg_mode; 0: not trained)
        clip_low, clip_high: the clip range below and above 1 (train.clip_range)
        clip_ratio_c: the dual clip's bound for A < 0, > 1 (None: none)
    (any shape, the four alike: [B, T] with weights = aggregation_weights(step_mask, mode) is the batch's loss)

    1. r    = exp(clamp(l_theta - l_rollout, -20, 20))                   the probability ratio
    2. L    = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))     the clipped surrogate
    3. L    = min(L, -A clip_ratio_c)   where A < 0                  the dual clip
    4. loss = sum w L                                                the aggregation

    Returns (loss, metrics over the pairs of weight != 0).
    """
    _check(rollout_log_prob, log_prob, advantages, weights)
    _check_clip(clip_low, clip_high, clip_ratio_c)
    d = log_prob - rollout_log_prob
    ratio = torch.exp(d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # 1.
    losses, clipped, dual = clipped_surrogate(ratio, advantages, clip_low, clip_high, clip_ratio_c)  # 2., 3.
    loss = weighted_sum(weights, losses)  # 4.
    with torch.no_grad():
        trained = weights != 0
        metrics = {
            "clipfrac": float(masked_mean(clipped.to(d.dtype), trained)),
            "clipfrac_lower": float(masked_mean(dual.to(d.dtype), trained)),
            **_ratio_metrics(d, trained),
        }
    return loss, metrics


@register_policy_loss("gspo")
def gspo_policy_loss(
    rollout_log_prob, log_prob, advantages, step_mask, loss_agg_mode: str, *,
    clip_low: float, clip_high: float, clip_ratio_c: Optional[float], **_,
):
    """GSPO: a trajectory-level importance ratio applied per step, clipped like vanilla.

        s_i     = exp(clamp(mean_{n: m=1}(l_new - l_rollout), -20, 20))          (geometric mean ratio)
        r_{i,n} = sg[s_i] * exp(l_new_{i,n} - sg[l_new_{i,n}])              (value s_i, grad s_i * dl_n)
        L       = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), dual clip for A < 0
        loss    = agg(L)    (the GSPO paper's choice is traj-mean-step-mean)

    Use clip ranges for a trajectory-level ratio (GSPO uses much smaller ones than PPO).
    """
    _check_trajectories(rollout_log_prob, log_prob, advantages, step_mask)
    _check_clip(clip_low, clip_high, clip_ratio_c)
    d = log_prob - rollout_log_prob
    seq_d = masked_mean(d.detach(), step_mask, dim=1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_ratio = log_prob - log_prob.detach() + seq_d[:, None]
    ratio = torch.exp(log_ratio)
    loss_mat, clipped, dual = clipped_surrogate(ratio, advantages, clip_low, clip_high, clip_ratio_c)
    loss = agg_loss(loss_mat, step_mask, loss_agg_mode)
    with torch.no_grad():
        rows = step_mask.sum(dim=1) > 0
        s = torch.exp(seq_d[rows]) if rows.any() else torch.ones(1)
        metrics = {
            "clipfrac": float(masked_mean(clipped.to(d.dtype), step_mask)),
            "clipfrac_lower": float(masked_mean(dual.to(d.dtype), step_mask)),
            **_ratio_metrics(d, step_mask),
            "traj_ratio_mean": float(s.mean()),
            "traj_ratio_min": float(s.min()),
            "traj_ratio_max": float(s.max()),
        }
    return loss, metrics


def outside_log_ratio_clip(rollout_log_prob, log_prob, *, clip_low: float, clip_high: float, **_) -> torch.Tensor:
    """[N] bool: geo_mean's bound, in log space: d = l_theta - l_rollout outside [-clip_low, clip_high]."""
    d = (log_prob - rollout_log_prob).detach()
    return (d > clip_high) | (d < -clip_low)


@register_policy_loss("geo_mean", trust_region=outside_log_ratio_clip)
def geo_mean_policy_loss(
    rollout_log_prob, log_prob, advantages, step_mask, loss_agg_mode: str, *,
    clip_low: float, clip_high: float, clip_ratio_c: Optional[float], **_,
):
    """GMPO (geometric-mean policy optimisation): clip in log space by the sign of A.

        d       = l_new - l_rollout
        d_c     = clamp(d, -clip_low, clip_high)              (log-space bounds, verl convention)
        d~      = sign(A) * min(sign(A) d, sign(A) d_c)       (per step: A > 0 caps d at clip_high,
                                                               A < 0 floors it at -clip_low)
        rho_i   = exp(clamp(mean_{n: m=1} d~, -20, 20))       (trajectory ratio)
        A_i     = mean_{n: m=1} A                             (trajectory advantage)
        loss    = mean over trajectories with a trained step of (-A_i rho_i)

    The loss is trajectory-level: loss_agg_mode and clip_ratio_c are ignored (every mode
    averages over trajectories). The clip bounds are in log space: for the small clip
    ranges of diffusion (1e-4) they equal the ratio bounds of vanilla to first order.
    """
    _check_trajectories(rollout_log_prob, log_prob, advantages, step_mask)
    _check_clip(clip_low, clip_high, None)
    m = (step_mask != 0).to(log_prob.dtype)
    d = log_prob - rollout_log_prob
    d_c = torch.clamp(d, -clip_low, clip_high)
    sgn = torch.sign(advantages)
    d_t = sgn * torch.minimum(sgn * d, sgn * d_c)
    lengths = m.sum(dim=1)
    rows = lengths > 0
    traj_log_ratio = (d_t * m).sum(dim=1) / lengths.clamp(min=1.0)
    traj_ratio = torch.exp(traj_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    traj_adv = (advantages * m).sum(dim=1) / lengths.clamp(min=1.0)
    traj_loss = -traj_adv * traj_ratio
    n_rows = rows.sum().clamp(min=1).to(traj_loss.dtype)
    loss = (traj_loss * rows.to(traj_loss.dtype)).sum() / n_rows
    with torch.no_grad():
        clipped = (d_t != d)
        s = traj_ratio[rows] if rows.any() else torch.ones(1)
        metrics = {
            "clipfrac": float(masked_mean((clipped & (d > 0)).float(), step_mask)
                              + masked_mean((clipped & (d < 0)).float(), step_mask)),
            "clipfrac_upper": float(masked_mean((clipped & (d > 0)).float(), step_mask)),
            "clipfrac_lower": float(masked_mean((clipped & (d < 0)).float(), step_mask)),
            **_ratio_metrics(d, step_mask),
            "traj_ratio_mean": float(s.mean()),
            "traj_ratio_min": float(s.min()),
            "traj_ratio_max": float(s.max()),
        }
    return loss, metrics


RATIO_NORM_REWEIGHTS = ("dt", "none")


def ratio_norm_log_ratio(rollout_log_prob, log_prob, mean, rollout_mean, std, log_prob_reduce: str = "mean"):
    """(log rho_hat, d, b): GRPO-Guard's normalised log-ratio of each step, the plain per-dimension log-ratio
    d and the mean-shift term b (shapes of ``log_prob``; ``mean``/``rollout_mean`` have the latent dims after them).

        d = l_theta - l_rollout                  (divided by D, the latent dims, when log_prob_reduce="sum")
        b = mean_D((mu_theta - mu_rollout)^2) / (2 s^2)
        log rho_hat = (d + b) * s            (= mean_D(z * (mu_theta - mu_rollout)), ratio_norm_policy_loss)

    A step whose std is 0 (a deterministic step, never trained) takes s = 1 so that nothing divides by 0.
    """
    dims = tuple(range(log_prob.dim(), mean.dim()))
    d = log_prob - rollout_log_prob
    if log_prob_reduce == "sum":  # l is then D times the per-dimension mean the formula is written with
        d = d / float(mean[(0,) * log_prob.dim()].numel())
    elif log_prob_reduce != "mean":
        raise ValueError(f"log_prob_reduce={log_prob_reduce!r} must be 'mean' or 'sum'")
    s = torch.where(std > 0, std, torch.ones_like(std)).to(d.dtype)
    b = (mean.float() - rollout_mean.float()).pow(2).mean(dim=dims) / (2 * s**2)
    return (d + b) * s, d, b


def ratio_norm_config_errors(kwargs: dict) -> list:
    """algorithm.policy_loss_kwargs of ratio_norm: only ``reweight``, one of RATIO_NORM_REWEIGHTS."""
    errors = [f"algorithm.policy_loss_kwargs.{key}: ratio_norm takes no keyword {key!r}; its keywords: ['reweight']"
              for key in kwargs if key != "reweight"]
    if "reweight" in kwargs and kwargs["reweight"] not in RATIO_NORM_REWEIGHTS:  # absent: the loss's own default
        errors.append(f"algorithm.policy_loss_kwargs.reweight={kwargs['reweight']!r} must be one of "
                      f"{RATIO_NORM_REWEIGHTS} ('dt': GRPO-Guard's weight 1 / step length; 'none': weight 1)")
    return errors


def outside_normalised_ratio_clip(rollout_log_prob, log_prob, *, clip_low: float, clip_high: float, mean=None,
                                  rollout_mean=None, std=None, log_prob_reduce: str = "mean", **_) -> torch.Tensor:
    """[N] bool: ratio_norm's bound: its normalised ratio rho_hat outside [1 - clip_low, 1 + clip_high]."""
    log_ratio, _, _ = ratio_norm_log_ratio(rollout_log_prob.detach(), log_prob.detach(), mean.detach(), rollout_mean,
                                           std, log_prob_reduce)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return (ratio > 1.0 + clip_high) | (ratio < 1.0 - clip_low)


@register_policy_loss("ratio_norm", per_step=True, needs_rollout_means=True, check=ratio_norm_config_errors,
                      trust_region=outside_normalised_ratio_clip)
def ratio_norm_policy_loss(rollout_log_prob, log_prob, advantages, weights, *, clip_low: float, clip_high: float,
                           clip_ratio_c: Optional[float], mean: torch.Tensor = None, rollout_mean: torch.Tensor = None,
                           std: torch.Tensor = None, step_length: Optional[torch.Tensor] = None,
                           log_prob_reduce: str = "mean", reweight: str = "dt", **_) -> Tuple[torch.Tensor, dict]:
    """GRPO-Guard's RatioNorm (arXiv 2510.22319; Flow-GRPO's and verl-omni's grpo_guard loss): PPO-clip on a
    log-ratio normalised by the step's noise scale, with the per-step weight 1 / step_length.

    Args:
        rollout_log_prob, log_prob, advantages, weights, clip_low, clip_high, clip_ratio_c: [N] each, as vanilla's
        mean: [N, ...] mu_theta, the step's mean under the policy being trained (with gradient)
        rollout_mean: [N, ...] mu_rollout, the step's mean under the rollout policy (recorded)
        std: [N] s, the step's std (the same under both policies: it depends on the schedule only; flow_sde:
            sigma_t sqrt(-dt), DDIM: the DDIM step's sigma)
        step_length: [N] the step's length in flow time (StepOutput.step_length)
        log_prob_reduce: how l reduces the latent dims (sample.log_prob_reduce)
        reweight: "dt" (w_dt = 1 / step_length) or "none" (w_dt = 1)

    1. log rho_hat = (d + b) * s = mean_D(z * (mu_theta - mu_rollout))      ratio_norm_log_ratio (d, b there)
    2. rho_hat     = exp(clamp(log rho_hat, -20, 20))
    3. L           = w_dt * max(-A rho_hat, -A clip(rho_hat, 1 - clip_low, 1 + clip_high)),  dual clip for A < 0
    4. loss        = sum w L

    Why (1): with the recorded next latent x' = mu_rollout + s z, per latent dim log N(x'; mu_theta, s^2) - log N(x';
    mu_rollout, s^2) = z dmu / s - dmu^2 / (2 s^2), dmu = mu_theta - mu_rollout; our l reduces the latent dims by their mean,
    so d = l_theta - l_rollout = mean_D(z dmu) / s - b with b = mean_D(dmu^2) / (2 s^2). Under the rollout policy z ~ N(0,
    I) independently of dmu, so log rho_hat ~ N(0, mean_D(dmu^2) / D): centred on 0 whatever the noise level, where
    the plain d has mean -b, which grows as 1/s^2. At small noise levels (flow models, late steps) the plain ratio's
    mean sits below 1 and the clip [1 - eps, 1 + eps] acts on its lower side only: positive-advantage samples are not
    held back (GRPO-Guard's implicit over-optimisation). b is not detached (as in the reference implementations): the
    gradient is that of mean_D(z * mu_theta).

    Why (3)'s w_dt: the step's length in flow time is -dt = s_n - s_{n+1} for a flow step (GRPO-Guard's 1/dt), and for
    DDIM the same on the equivalent flow time s = sqrt(1 - ab) / (sqrt(ab) + sqrt(1 - ab)) (sampling/ddim.py). A flow
    step's mean moves with the velocity as d mu / d v = dt (1 + sigma_t^2 (1 - s) / (2 s)), so the gradient of
    log rho_hat scales with |dt|; the weight gives every step a gradient of the same size in the model's output. The
    lengths of a schedule's steps add up to about 1, so the weights average about T (the steps per trajectory): the
    effective learning rate is about T times vanilla's; reweight="none" keeps vanilla's scale.

    Returns (loss, metrics): clipfrac, clipfrac_lower and ratio_* / approx_kl / ppo_kl of the normalised ratio (the
    one clipped); plain_ratio_mean = mean exp(l_theta - l_rollout) (what vanilla would clip) and mean_shift_bias = mean b.
    """
    if mean is None or rollout_mean is None or std is None:
        raise ValueError("ratio_norm needs mean, rollout_mean and std: the policy update passes them when the rollouts "
                         "recorded the step means (RolloutBatch.step_means)")
    if not (rollout_log_prob.shape == log_prob.shape == advantages.shape == weights.shape == std.shape):
        raise ValueError("rollout_log_prob, log_prob, advantages, weights and std must have the same shape")
    if mean.shape != rollout_mean.shape or mean.shape[: log_prob.dim()] != log_prob.shape:
        raise ValueError(f"mean {tuple(mean.shape)} and rollout_mean {tuple(rollout_mean.shape)} must be the log-probs' "
                         f"shape {tuple(log_prob.shape)} followed by the latent dims")
    if reweight not in RATIO_NORM_REWEIGHTS:
        raise ValueError(f"ratio_norm: reweight={reweight!r} must be one of {RATIO_NORM_REWEIGHTS}")
    _check_clip(clip_low, clip_high, clip_ratio_c)
    log_ratio, d, b = ratio_norm_log_ratio(rollout_log_prob, log_prob, mean, rollout_mean, std, log_prob_reduce)  # 1.
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # 2.
    losses, clipped, dual = clipped_surrogate(ratio, advantages, clip_low, clip_high, clip_ratio_c)  # 3.
    if reweight == "dt":
        if step_length is None:
            raise ValueError("ratio_norm with reweight='dt' needs the step's length (StepOutput.step_length): this "
                             "model family's step does not report it; set algorithm.policy_loss_kwargs.reweight='none'")
        # a deterministic step (length 0) is never trained: weight 1 keeps its masked entry finite
        length = torch.where(step_length > 0, step_length, torch.ones_like(step_length)).to(losses.dtype)
        losses = losses / length
    loss = weighted_sum(weights, losses)  # 4.
    with torch.no_grad():
        trained = weights != 0
        plain = torch.exp((log_prob - rollout_log_prob).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        metrics = {
            "clipfrac": float(masked_mean(clipped.to(d.dtype), trained)),
            "clipfrac_lower": float(masked_mean(dual.to(d.dtype), trained)),
            **_ratio_metrics(log_ratio, trained),
            "plain_ratio_mean": float(masked_mean(plain, trained)),
            "mean_shift_bias": float(masked_mean(b.detach(), trained)),
        }
    return loss, metrics


def dppo_kl(mean, rollout_mean, std, log_prob_reduce: str = "mean") -> torch.Tensor:
    """The exact KL of a step's two Gaussians N(rollout_mean, s^2 I) and N(mean, s^2 I):
    reduce_D (mean - rollout_mean)^2 / (2 s^2), reduced over the latent dims as the log-prob is (``log_prob_reduce``); no gradient."""
    return gaussian_kl(mean.detach(), rollout_mean, std, log_prob_reduce)


def outside_kl_bound(rollout_log_prob, log_prob, *, policy_kl_threshold: float, mean=None, rollout_mean=None, std=None,
                     log_prob_reduce: str = "mean", advantages=None, **_) -> torch.Tensor:
    """[N] bool: the pairs dppo's mask blocks (its step 3): the exact step KL at or above ``policy_kl_threshold`` and
    the ratio and the advantage of one sign (the update would move the pair further away); without ``advantages``
    (scripts/check.py, before any estimate) the pairs it may block, every one at or above the threshold."""
    over = dppo_kl(mean, rollout_mean, std, log_prob_reduce) >= policy_kl_threshold
    if advantages is None:
        return over
    ratio = torch.exp((log_prob - rollout_log_prob).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return over & (((ratio > 1) & (advantages > 0)) | ((ratio < 1) & (advantages < 0)))


def dppo_config_errors(kwargs: dict) -> list:
    """algorithm.policy_loss_kwargs of dppo: none (its threshold is train.policy_kl_threshold)."""
    return [f"algorithm.policy_loss_kwargs.{key}: dppo takes no keyword {key!r}; its threshold is "
            "train.policy_kl_threshold"
            for key in kwargs]


@register_policy_loss("dppo", per_step=True, needs_rollout_means=True, check=dppo_config_errors,
                      trust_region=outside_kl_bound)
def dppo_policy_loss(rollout_log_prob, log_prob, advantages, weights, *, policy_kl_threshold: float,
                     mean: torch.Tensor = None,
                     rollout_mean: torch.Tensor = None, std: torch.Tensor = None, log_prob_reduce: str = "mean",
                     **_) -> Tuple[torch.Tensor, dict]:
    """Flow-DPPO (arXiv 2606.11025; UniRL's FlowDPPO, VeRL-Omni's and Flow-Factory's dppo): the policy gradient with
    an exact trust region instead of the ratio clip. Each step's policy is Gaussian and both its means are known, so
    the KL of the rollout policy's step to the trained one's is computed exactly; a pair is masked (no gradient) only
    when that KL reaches the threshold AND the update moves it further away (its ratio and advantage of one sign).

    Args:
        rollout_log_prob, log_prob, advantages, weights: [N] each, as vanilla's
        policy_kl_threshold: delta, the KL at which the mask may act (train.policy_kl_threshold; UniRL's
            kl_mask_threshold)
        mean: [N, ...] mu_theta, the step's mean under the policy being trained (with gradient)
        rollout_mean: [N, ...] mu_rollout, the step's mean under the rollout policy (recorded)
        std: [N] s, the step's std (the same under both policies)
        log_prob_reduce: how l and the KL reduce the latent dims (sample.log_prob_reduce)

    1. r       = exp(clamp(l_theta - l_rollout, -20, 20))
    2. KL      = reduce_D (mu_theta - mu_rollout)^2 / (2 s^2)                    the exact per-step KL (dppo_kl)
    3. blocked = KL >= delta and ((r > 1 and A > 0) or (r < 1 and A < 0))      the asymmetric divergence mask
    4. L       = -A r where not blocked, 0 where blocked                      (no gradient through the mask)
    5. loss    = sum w L

    A pair the update pulls back toward the rollout policy is never blocked, however far it is; within the threshold
    nothing is blocked, whatever the ratio (no clip). Metrics: ratio_* / approx_kl / ppo_kl as vanilla's; masked (the
    share blocked: ``clipfrac`` is it, so the update's metrics read alike), kl_mean / kl_max (the step KL) and
    kl_over (the share at or above the threshold).
    """
    if mean is None or rollout_mean is None or std is None:
        raise ValueError("dppo needs mean, rollout_mean and std: the policy update passes them when the rollouts "
                         "recorded the step means (RolloutBatch.step_means)")
    _check(rollout_log_prob, log_prob, advantages, weights)
    if not policy_kl_threshold > 0:
        raise ValueError(f"dppo: policy_kl_threshold={policy_kl_threshold!r} must be > 0 (train.policy_kl_threshold)")
    d = log_prob - rollout_log_prob
    ratio = torch.exp(d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # 1.
    kl = dppo_kl(mean, rollout_mean, std, log_prob_reduce)  # 2.
    blocked = outside_kl_bound(rollout_log_prob, log_prob, policy_kl_threshold=policy_kl_threshold, mean=mean,  # 3.
                               rollout_mean=rollout_mean, std=std, log_prob_reduce=log_prob_reduce, advantages=advantages)
    losses = torch.where(blocked, torch.zeros_like(ratio), -advantages * ratio)  # 4.
    loss = weighted_sum(weights, losses)  # 5.
    with torch.no_grad():
        trained = weights != 0
        metrics = {
            "clipfrac": float(masked_mean(blocked.to(d.dtype), trained)),
            **_ratio_metrics(d, trained),
            "kl_mean": float(masked_mean(kl.to(d.dtype), trained)),
            "kl_max": float(kl[trained].max()) if bool(trained.any()) else 0.0,
            "kl_over": float(masked_mean((kl >= policy_kl_threshold).to(d.dtype), trained)),
        }
    return loss, metrics
