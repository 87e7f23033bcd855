"""Training objectives: what the update minimises, one decorated function each, chosen by ``algorithm.objective``.

The kinds:

* ``policy_gradient`` (the default): the clipped policy gradients over the rollout's recorded step log-probs
  (``algorithm.policy_loss`` picks the loss; update/policy_update.py). It needs a stochastic sampler.
* ``distillation`` (``opd``): on-policy distillation. The student (the policy) samples as a policy-gradient run does;
  frozen teachers (reference/teachers.py) score its recorded steps with their own forward, and the loss is the
  closed-form KL of each step's Gaussian under the student to the teacher's (``opd_kl`` below), beside
  ``opd.reward_weight`` times the policy loss on the reward's advantages (update/distillation_update.py).
* **matching** objectives (``awm``, ``nft``): the rollout only has to produce final samples x_clean (any solver; with
  ``sample.deterministic`` the deterministic one, and no log-prob is recorded). The update noises x_clean with the
  forward process at drawn times and trains the denoiser with a weighted matching loss (update/matching_update.py).
  Rewards, the stat tracker, group statistics and advantages are the policy gradient's: the matching loss reads
  each sample's advantage A_i (the estimator's, clipped to ``train.adv_clip_max``).

Forward processes (``FORWARD_PROCESSES``), eps ~ N(0, I):

* ``flow``: the flow-matching families (every family but sd and sdxl; the rectified flow of Esser et al. 2024), sigma
  s in [0, 1] (s = 1: pure noise)::

    x_s = (1 - s) x_clean + s eps,        target velocity u = eps - x_clean,        clean_hat(v) = x_s - s v

* ``ddpm``: the DDPM / DDIM families (Stable Diffusion 1.x / 2.x, SDXL), ab_t = alphas_cumprod[t]::

    x_t = sqrt(ab_t) x_clean + sqrt(1 - ab_t) eps,
    target eps (epsilon), sqrt(ab_t) eps - sqrt(1 - ab_t) x_clean (v_prediction) or x_clean (sample)

  the noise level passed to the objectives as ``sigma`` is sqrt(1 - ab_t)

An objective registers the processes its paper defines it on (``processes``).

A matching objective has the signature

    fn(pred, target, advantages, sigma, old_pred=None, adv_clip_max=5.0, **kwargs) -> (loss [N], metrics)

over N (sample, time) pairs: ``pred`` the policy's velocity v_theta(x_s, s, c) [N, ...] (with gradient), ``target`` u,
``advantages`` A [N], ``sigma`` s [N], ``old_pred`` the old model's velocity (no gradient; for an objective that
registers ``needs_old_model``). It ignores unknown keywords (the update passes ``algorithm.objective_kwargs``); the
update averages ``loss`` over the train batch's pairs. A plugin (``algorithm.objective=/path/file.py:fn``) declares
itself with ``@objective(...)``; a plain function is a matching objective that needs no old model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ddpo_group.algorithms.kl import gaussian_kl
from ddpo_group.registry import Registry

POLICY_GRADIENT = "policy_gradient"
MATCHING = "matching"
PREFERENCE = "preference"  # a matching loss on preference pairs of each group, against a reference model (dpo)
# on-policy distillation (opd): the student's recorded steps scored by frozen teachers, the closed-form KL per step
DISTILLATION = "distillation"
KINDS = (POLICY_GRADIENT, MATCHING, PREFERENCE, DISTILLATION)
ADAPTIVE_WEIGHT_FLOOR = 1e-5  # DiffusionNFT's floor of the adaptive weight (its released training script)


@dataclass(frozen=True)
class ObjectiveSpec:
    """An objective: its kind, its loss (matching objectives) and what it needs; calling it runs the loss."""

    name: str
    kind: str
    fn: Optional[Callable] = None  # a matching objective's per-pair loss (module docstring); None for policy_gradient
    needs_old_model: bool = False  # the update keeps an old model (old_pred); rollouts sample with it
    processes: tuple = ("flow",)  # the forward processes it is defined on (FORWARD_PROCESSES)
    units: str = "pairs"  # a preference objective's units: "pairs" (each group's best, worst) or "groups" (all rows)
    # kwargs -> True when these objective_kwargs ask for an old model that only gives old_pred (awm's old_kl_beta);
    # rollouts then sample with the policy
    old_model_if: Optional[Callable] = None
    check: Optional[Callable] = None  # check(objective_kwargs: dict) -> list of config error messages

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"objective {self.name!r}: kind {self.kind!r} must be one of {KINDS}")
        if self.kind != POLICY_GRADIENT and self.fn is None:
            raise ValueError(f"{self.kind} objective {self.name!r} needs a loss function")

    @property
    def is_matching(self) -> bool:
        """Trains on the forward process of the final samples (a matching or a preference objective)."""
        return self.kind in (MATCHING, PREFERENCE)

    def uses_old_model(self, kwargs: dict) -> bool:
        """Whether the update keeps an old model with these ``algorithm.objective_kwargs``."""
        return self.needs_old_model or (self.old_model_if is not None and bool(self.old_model_if(dict(kwargs))))

    def config_errors(self, kwargs: dict) -> list:
        return list(self.check(dict(kwargs))) if self.check is not None else []

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


OBJECTIVE_REGISTRY = Registry("objective", entry_point_group="ddpo_group.objectives")


def objective(needs_old_model: bool = False, processes: tuple = ("flow",),
              check: Optional[Callable] = None) -> Callable:
    """Decorator declaring a matching objective (a plugin) without registering a name."""
    def decorator(fn: Callable) -> ObjectiveSpec:
        return ObjectiveSpec(name=fn.__name__, kind=MATCHING, fn=fn, needs_old_model=needs_old_model,
                             processes=tuple(processes), check=check)
    return decorator


def register_objective(name: str, kind: str = MATCHING, needs_old_model: bool = False, processes: tuple = ("flow",),
                       units: str = "pairs", old_model_if: Optional[Callable] = None,
                       check: Optional[Callable] = None) -> Callable:
    """Decorator registering an objective under ``name`` (fails if the name is taken)."""
    def decorator(fn: Optional[Callable]) -> ObjectiveSpec:
        spec = ObjectiveSpec(name=name, kind=kind, fn=fn, needs_old_model=needs_old_model, processes=tuple(processes),
                             units=units, old_model_if=old_model_if, check=check)
        return OBJECTIVE_REGISTRY.register(name)(spec)
    return decorator


def get_objective(spec: str) -> ObjectiveSpec:
    """The objective a config names: registered name, ``module:function``, ``/path/file.py:function`` or entry point."""
    return OBJECTIVE_REGISTRY.resolve_spec(spec, ObjectiveSpec,
                                           lambda fn, name: ObjectiveSpec(name=name, kind=MATCHING, fn=fn))


def flow_forward(x_clean: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The flow-matching forward process at sigma s [N]: (x_s = (1 - s) x_clean + s eps, target u = eps - x_clean).

    (The rectified flow alpha_t = 1 - t, sigma_t = t of DiffusionNFT's Sec. 2.1, where the velocity target of its
    Eq. 1 simplifies to eps - x_clean.)"""
    s = _per_row(sigma, x_clean)
    return (1 - s) * x_clean + s * noise, noise - x_clean


DDPM_TARGETS = ("epsilon", "v_prediction", "sample")
FORWARD_PROCESSES = ("flow", "ddpm")


def ddpm_forward(x_clean: torch.Tensor, noise: torch.Tensor, alpha_bar: torch.Tensor,
                 prediction_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The DDPM forward process at ab_t [N]: (x_t = sqrt(ab) x_clean + sqrt(1 - ab) eps, the denoiser's target for its
    ``prediction_type``: eps, sqrt(ab) eps - sqrt(1 - ab) x_clean, or x_clean).

    (Diffusion-DPO's q(x_t | x_clean) = N(alpha_t x_clean, sigma_t^2 I) of its Eq. 2, with alpha_t = sqrt(ab), sigma_t =
    sqrt(1 - ab).)"""
    if prediction_type not in DDPM_TARGETS:
        raise ValueError(f"prediction_type={prediction_type!r} is not supported; use one of {DDPM_TARGETS}")
    a, b = _per_row(alpha_bar.sqrt(), x_clean), _per_row((1 - alpha_bar).sqrt(), x_clean)
    x_t = a * x_clean + b * noise
    target = {"epsilon": noise, "v_prediction": a * noise - b * x_clean, "sample": x_clean}[prediction_type]
    return x_t, target


TIME_SAMPLINGS = ("schedule", "uniform", "logit_normal")


def draw_times(count: int, sampling: str, shift: float = 1.0, device=None) -> torch.Tensor:
    """``count`` training times s in (0, 1) (1: pure noise) for ``sampling`` "uniform" (s ~ U(0, 1)) or
    "logit_normal" (s = sigmoid(z), z ~ N(0, 1); SD3's training distribution), then shifted as SD3's schedule shifts:
    s <- shift s / (1 + (shift - 1) s) (shift > 1 moves them toward the noise). "schedule" (the rollout's own times)
    draws nothing: the update reads them from the batch."""
    if sampling == "uniform":
        s = torch.rand(count, device=device)
    elif sampling == "logit_normal":
        s = torch.sigmoid(torch.randn(count, device=device))
    else:
        raise ValueError(f"time sampling {sampling!r} draws no times; use one of {TIME_SAMPLINGS[1:]}")
    if not shift > 0:
        raise ValueError(f"time shift {shift} must be > 0")
    return shift * s / (1 + (shift - 1) * s)


def _per_row(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return values.to(like.dtype).reshape(-1, *([1] * (like.dim() - 1)))


def _mean_dims(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(1).mean(dim=1)


def _check_pairs(pred, target, advantages, sigma):
    if pred.shape != target.shape:
        raise ValueError(f"pred and target must have the same shape, got {tuple(pred.shape)} and {tuple(target.shape)}")
    n = pred.shape[0]
    if advantages.shape != (n,) or sigma.shape != (n,):
        raise ValueError(f"advantages and sigma must be [{n}] (one per pair), got {tuple(advantages.shape)} and "
                         f"{tuple(sigma.shape)}")


register_objective(POLICY_GRADIENT, kind=POLICY_GRADIENT)(None)


AWM_WEIGHTINGS = ("uniform", "t", "ghuber")
GHUBER_EPS = 1e-10  # the released AWM script's epsilon of the generalised Huber weighting


def _awm_check(kwargs: dict) -> list:
    errors = []
    if "weighting" in kwargs and kwargs["weighting"] not in AWM_WEIGHTINGS:  # absent: the function's default
        errors.append(f"algorithm.objective_kwargs.weighting={kwargs['weighting']!r} must be one of {AWM_WEIGHTINGS}")
    power = kwargs["ghuber_power"] if "ghuber_power" in kwargs else None
    if "ghuber_power" in kwargs and not (isinstance(power, (int, float)) and power > 0):
        errors.append(f"algorithm.objective_kwargs.ghuber_power={kwargs['ghuber_power']!r} must be > 0")
    kl = kwargs["old_kl_beta"] if "old_kl_beta" in kwargs else None
    if "old_kl_beta" in kwargs and not (isinstance(kl, (int, float)) and kl >= 0):
        errors.append(f"algorithm.objective_kwargs.old_kl_beta={kwargs['old_kl_beta']!r} must be >= 0")
    return errors


def _awm_old_model(kwargs: dict) -> bool:
    return "old_kl_beta" in kwargs and kwargs["old_kl_beta"] > 0


def awm_weighted_error(error: torch.Tensor, sigma: torch.Tensor, weighting: str, ghuber_power: float) -> torch.Tensor:
    """phi(l, s) of AWM's loss on the per-pair matching error l: l ("uniform"), s l ("t"), or the generalised Huber
    s ((l + e)^p - e^p) / p ("ghuber", p = ``ghuber_power``, e = 1e-10), the released script's options."""
    if weighting == "uniform":
        return error
    if weighting == "t":
        return sigma * error
    if weighting == "ghuber":
        p = float(ghuber_power)
        return sigma * ((error + GHUBER_EPS).pow(p) - GHUBER_EPS ** p) / p
    raise ValueError(f"awm weighting {weighting!r} must be one of {AWM_WEIGHTINGS}")


@register_objective("awm", processes=FORWARD_PROCESSES, old_model_if=_awm_old_model, check=_awm_check)
def awm_loss(pred, target, advantages, sigma, old_pred=None, weighting: str = "uniform", ghuber_power: float = 0.25,
             old_kl_beta: float = 0.0, **_):
    """Advantage Weighted Matching (Xue, Ge, Zhang, Li, Ma 2025, arXiv:2509.25050): the pretraining flow-matching loss
    of each rollout sample, weighted by its advantage,

        L(theta) = E_{c, x_clean ~ pi_old(.|c), s, eps} [ A(x_clean, c) * phi(l, s) ],
        l = mean_dims || v_theta(x_s, s, c) - (eps - x_clean) ||^2

    (the paper's AWM objective: DDPO's policy gradient is a noisy denoising score matching, its Theorem 1, and AWM
    replaces it with the matching loss of the forward process; the paper states it for score matching (its EDM
    experiments) and flow matching alike, so it runs on both forward processes: on ``ddpm`` the error is the
    denoiser's own (eps, v or the clean latent) and s is sqrt(1 - ab_t)). phi (``awm_weighted_error``) is l, s l or the
    generalised Huber of l. A > 0 pulls the velocity toward the sample's target, A < 0 pushes it away; A = 0 gives a
    zero loss and a zero gradient. The released script writes it as a PPO ratio exp(-phi + sg(phi)) of the first pass
    (on-policy: the same gradient, -A grad(-phi)) and scales A by advantage_max / adv_clip_max (1 / 5 in its
    recipe). The KL term to a reference (its velocity penalty beta mean (v_theta - v_ref)^2) is ``kl.beta`` with
    ``kl.use_reference_model``.

    ``old_kl_beta`` > 0 adds old_kl_beta * mean_dims (v_theta - v_old)^2 to every pair: the KL to a lagging copy of the
    policy (the update's old model, ``algorithm.old_decay_*``; rollouts still sample with the policy) that Flow-Factory
    recommends against AWM's collapse (its ema_kl_beta 0.1) and the released script applies (its EMA KL).

    Returns the per-pair loss [N] and metrics (the unweighted matching error ``matching_error``).
    """
    _check_pairs(pred, target, advantages, sigma)
    error = _mean_dims((pred.float() - target.float()).pow(2))
    loss = advantages.to(error.dtype) * awm_weighted_error(error, sigma.float(), weighting, ghuber_power)
    metrics = {"matching_error": error.detach().mean()}
    if old_kl_beta > 0:
        if old_pred is None:
            raise ValueError("awm old_kl_beta > 0 needs the old model's prediction (old_pred)")
        old_kl = _mean_dims((pred.float() - old_pred.float().detach()).pow(2))
        loss = loss + float(old_kl_beta) * old_kl
        metrics["old_kl"] = old_kl.detach().mean()
    return loss, metrics


def _sft_check(kwargs: dict) -> list:
    value = kwargs.get("min_advantage", 0.0)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return []
    return [f"algorithm.objective_kwargs.min_advantage={value!r} must be a number (the advantage a sample must pass "
            "to be trained on)"]


@register_objective("sft", processes=FORWARD_PROCESSES, check=_sft_check)
def sft_loss(pred, target, advantages, sigma, old_pred=None, min_advantage: float = 0.0, **_):
    """Supervised fine-tuning on the run's own best samples (reward-filtered, as RAFT and the anchors' SFT on
    filtered rollouts): the pretraining matching loss of each kept sample, the others left out,

        L(theta) = E_{c, x_clean ~ pi(.|c), s, eps} [ 1{A(x_clean, c) > min_advantage} * l ],
        l = mean_dims || v_theta(x_s, s, c) - target ||^2

    (the forward process's target: eps - x_clean on flow matching, the scheduler's eps / v / x_clean on DDPM). With
    group advantages (grpo) min_advantage 0 keeps each group's samples above its mean reward and 1 those a group std
    above it. Unlike awm the kept samples weigh alike whatever their advantage, and nothing pushes away from the others.

    Returns the per-pair loss [N] and metrics (``matching_error`` of the kept pairs, ``kept``: their share)."""
    _check_pairs(pred, target, advantages, sigma)
    error = _mean_dims((pred.float() - target.float()).pow(2))
    keep = (advantages.float() > float(min_advantage)).to(error.dtype)
    kept = keep.sum()
    return keep * error, {"matching_error": (keep * error).detach().sum() / kept.clamp(min=1), "kept": keep.mean()}


def _nft_check(kwargs: dict) -> list:
    if "beta" not in kwargs or (isinstance(kwargs["beta"], (int, float)) and kwargs["beta"] > 0):
        return []
    return [f"algorithm.objective_kwargs.beta={kwargs['beta']!r} must be > 0 (DiffusionNFT's guidance strength)"]


def optimality_probability(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """DiffusionNFT's reward as an optimality probability: r = 1/2 + 1/2 clip(A / Z, -1, 1), with the normaliser
    Z = ``adv_clip_max`` (the released training script's choice on group-normalised advantages). The paper's
    "Optimality Reward" of Sec. 3.3 (an unnumbered display; its Algorithm 1, line 5)."""
    if not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max={adv_clip_max} must be > 0")
    return 0.5 + 0.5 * (advantages.float() / float(adv_clip_max)).clamp(-1.0, 1.0)


@register_objective("nft", needs_old_model=True, check=_nft_check)
def nft_loss(pred, target, advantages, sigma, old_pred=None, adv_clip_max: float = 5.0, beta: float = 1.0,
             adaptive_weight: bool = True, **_):
    """DiffusionNFT, negative-aware fine-tuning on the forward process (Zheng et al. 2025, arXiv:2509.16117, Sec. 3).

    Implicit positive and negative policies around the old model's velocity v_old (no gradient):

        v+ = (1 - beta) v_old + beta v_theta,        v- = (1 + beta) v_old - beta v_theta

    (the paper's Theorem 3.2) and the reward as an optimality probability r = 1/2 + 1/2 clip(A / Z, -1, 1)
    (``optimality_probability``):

        L(theta) = E_{c, x_clean ~ pi_old, s, eps} [ r ||v+(x_s) - u||^2 + (1 - r) ||v-(x_s) - u||^2 ] / beta

    with u = eps - x_clean: the paper's Eq. 5 (Theorem 3.2; Algorithm 1, line 12), which has no 1 / beta (the released
    script divides by beta). ``adaptive_weight`` (the paper's adaptive loss weighting, Sec. 3.3, an unnumbered display
    that replaces the w(t) of its Eq. 1 and takes clean_hat = x_t - t v under rectified flow; as released): each squared
    error is taken on the clean-latent prediction clean_hat = x_s - s v and divided by sg(mean |clean_hat - x_clean|),
    floored at 1e-5; since clean_hat - x_clean = -s (v - u), that term is s * mean (v - u)^2 / sg(mean |v - u|).
    Without it, the plain velocity errors mean (v+- - u)^2.

    Defined on the flow-matching forward process only (the paper's velocity parameterisation and clean-latent
    weighting): the DDPM families are refused.

    Limits (tests/algorithms/test_objectives.py): at v_theta = v_old (every update's start) the gradient with respect to
    v_theta is 2 (2r - 1) (v_old - u) / D for every beta (without the adaptive weight), so A = 0 (r = 1/2) gives a zero
    gradient; beta = 1 with r = 1 is plain flow matching on v_theta (supervised fine-tuning on the sample); as
    beta -> 0 the gradient tends to that same advantage-weighted direction. The released script multiplies the loss by
    ``adv_clip_max`` besides (a constant factor of the learning rate; not here).
    """
    _check_pairs(pred, target, advantages, sigma)
    if old_pred is None:
        raise ValueError("nft needs the old model's velocity (old_pred): the update keeps an old model for it")
    if not beta > 0:
        raise ValueError(f"nft beta={beta} must be > 0")
    v, v_old, u = pred.float(), old_pred.float().detach(), target.float()
    r = optimality_probability(advantages, adv_clip_max)
    positive = (1 - beta) * v_old + beta * v
    negative = (1 + beta) * v_old - beta * v

    def error(velocity):
        diff = velocity - u
        squared = _mean_dims(diff.pow(2))
        if not adaptive_weight:
            return squared
        s = sigma.float()
        scale = (s * _mean_dims(diff.detach().abs())).clamp(min=ADAPTIVE_WEIGHT_FLOOR)
        return s.pow(2) * squared / scale

    positive_error, negative_error = error(positive), error(negative)
    loss = (r * positive_error + (1 - r) * negative_error) / beta
    metrics = {"optimality_mean": r.detach().mean(), "positive_error": positive_error.detach().mean(),
               "negative_error": negative_error.detach().mean(),
               "old_deviation": _mean_dims((v.detach() - v_old).pow(2)).mean()}
    return loss, metrics


def preference_pairs(group_index: torch.Tensor, scores: torch.Tensor,
                     row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[P, 2] row indices (winner, loser) of each prompt group: its highest- and lowest-scoring rows (the first of
    equal ones), among the rows given (``row_mask``: 1 where a row counts). A group with fewer than 2 rows or all
    scores equal has no preference and no pair."""
    pairs = []
    keep = torch.ones_like(scores, dtype=torch.bool) if row_mask is None else row_mask.bool()
    for g in torch.unique(group_index[keep]).tolist():
        rows = torch.nonzero((group_index == g) & keep).flatten()
        values = scores[rows]
        if len(rows) < 2 or bool(values.max() == values.min()):
            continue
        pairs.append((int(rows[values.argmax()]), int(rows[values.argmin()])))
    return torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)


def group_rows(group_index: torch.Tensor, row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[U, G] the rows of each prompt group (the groups present, in index order); ValueError naming the sizes when the
    groups' row counts differ (a group split between processes, or padded rows)."""
    keep = torch.ones_like(group_index, dtype=torch.bool) if row_mask is None else row_mask.bool()
    groups = [torch.nonzero((group_index == g) & keep).flatten() for g in torch.unique(group_index[keep]).tolist()]
    sizes = sorted({len(rows) for rows in groups})
    if len(sizes) > 1:
        raise ValueError(f"prompt groups of different sizes {sizes} on this process: a group objective needs whole "
                         "groups (sample.batch_size x sample.num_batches_per_epoch a multiple of train.group_size, no "
                         "dynamic sampling)")
    return torch.stack(groups) if groups else torch.zeros(0, 0, dtype=torch.long)


def _beta_check(what: str) -> Callable:
    def check(kwargs: dict) -> list:
        if "beta" not in kwargs or (isinstance(kwargs["beta"], (int, float)) and kwargs["beta"] > 0):
            return []
        return [f"algorithm.objective_kwargs.beta={kwargs['beta']!r} must be > 0 ({what})"]
    return check


def _group_preference(errors, ref_errors, weights, beta: float):
    """softplus((beta / K) sum_k a_k (e_k - sg(e_ref_k))) per unit [U] (units of K rows) and the implicit-reward
    metrics: -log sigmoid(-S) with S = (beta / K) sum_k a_k (e_k - e_ref_k)."""
    if not beta > 0:
        raise ValueError(f"beta={beta} must be > 0")
    if not (errors.shape == ref_errors.shape == weights.shape and errors.dim() == 2):
        raise ValueError(f"errors, ref_errors and advantages must be [U, K], got {tuple(errors.shape)}, "
                         f"{tuple(ref_errors.shape)}, {tuple(weights.shape)}")
    delta = errors - ref_errors.detach()
    score = float(beta) / errors.shape[1] * (weights.to(delta.dtype) * delta).sum(dim=1)
    return torch.nn.functional.softplus(score), {"accuracy": (score.detach() < 0).float().mean(),
                                                  "implicit_score": score.detach().mean()}


@register_objective("dpo", kind=PREFERENCE, processes=FORWARD_PROCESSES, units="pairs",
                    check=_beta_check("Diffusion-DPO's temperature"))
def dpo_loss(errors, ref_errors, advantages=None, beta: float = 2000.0, **_):
    """Online Diffusion-DPO (Wallace et al. 2023, arXiv:2311.12908), the group's best sample against its worst: with the
    matching errors e = mean_dims ||pred(x_s) - target||^2 of the winner w and the loser l (``errors`` [U, 2], winner
    first) at the same time s and noise eps, under the policy (e) and the reference model (e_ref),

        L = -log sigmoid( -beta / 2 * [ (e_w - e_ref_w) - (e_l - e_ref_l) ] )

    (the paper's loss, its Eq. 14 in Sec. 4, with its time weighting omega(lambda_t) and the constant T folded into
    beta; beta / 2 as in its released training code; beta 2000
    is Flow-Factory's online default on flow models). It is DGPO's loss on the pair with advantages (+1, -1). At the
    reference (e = e_ref) the loss is log 2 and the gradient beta / 4 (grad e_w - grad e_l). ``accuracy``: the share of
    pairs whose implicit reward prefers the winner. ``advantages`` is not read.
    """
    signs = torch.tensor([1.0, -1.0], dtype=errors.dtype, device=errors.device).expand_as(errors)
    return _group_preference(errors, ref_errors, signs, beta)


@register_objective("dgpo", kind=PREFERENCE, processes=FORWARD_PROCESSES, units="groups",
                    check=_beta_check("DGPO's temperature"))
def dgpo_loss(errors, ref_errors, advantages, beta: float = 100.0, **_):
    """DGPO, direct group preference optimisation (Luo et al. 2025, arXiv:2510.08425): a group-level DPO over all K
    samples of a prompt group at one time s and one noise eps (``errors``, ``ref_errors``, ``advantages`` [U, K]):

        L = -log sigmoid( -(beta / K) sum_k A_k (e_k - e_ref_k) )

    (the paper's final objective, its Eq. 17 in Sec. 3.2: with the weights w = |A| of its Eq. 14 on the positive
    (A > 0) and negative (A <= 0) groups of its Eq. 13, its sum over G+ minus its sum over G- of w (L_dsm - L_dsm_ref)
    is sum_k A_k (e_k - e_ref_k); its weighting lambda_t and constant T are folded into beta here, and its L_dsm is the
    clean-latent prediction error ||f_theta(x_t, t, c) - x||^2. It shares the noise eps within each group "to reduce the
    variance".)

    The gradient, sigmoid((beta / K) sum_k A_k (e_k - e_ref_k)) * (beta / K) A_k grad e_k, is the gradient-equivalent
    loss of the released code and of Flow-Factory (a sigmoid group weight times A_k e_k). Zero advantages (a group whose
    rewards are all equal) give a constant loss log 2 and a zero gradient. beta 100 is Flow-Factory's default (10 to 100
    with a frozen reference).
    """
    return _group_preference(errors, ref_errors, advantages, beta)


@register_objective("opd", kind=DISTILLATION)
def opd_kl(student_mean: torch.Tensor, teacher_mean: torch.Tensor, std, reduce: str = "mean") -> torch.Tensor:
    """On-policy distillation's per-step loss [N] (DiffusionOPD; slime's and VeRL-Omni's OPD on the token axis): the
    reverse KL of the student's step Gaussian to the teacher's on the student's own state x_n. Both steps share the
    sampler's sigma_n, so per latent dimension

        KL(N(mu_student, sigma_n^2) || N(mu_teacher, sigma_n^2)) = (mu_student - mu_teacher)^2 / (2 sigma_n^2)

    reduced over the latent dimensions as the log-probabilities are (``reduce``: "mean" or "sum"); on a deterministic
    step (sigma_n = 0) the unit-variance surrogate (mu_student - mu_teacher)^2 / 2. ``std``: sigma_n [N] (or one
    number); the gradient flows through ``student_mean``."""
    std = torch.as_tensor(std, dtype=torch.promote_types(student_mean.dtype, torch.float32), device=student_mean.device)
    return gaussian_kl(student_mean, teacher_mean, torch.where(std > 0, std, torch.ones_like(std)), reduce=reduce)

