"""The KL term to a reference model, in one object: the reference forward, the KL kind, beta's controller, and
whether the KL goes into the loss or into the reward.

    in the loss (default):   loss = policy loss + beta * sum_{i,n} w_{i,n} KL_{i,n}    (w: the aggregation weights)
    in the reward:           r_n  = -beta * KL_n of every sampled step, before the advantages (kl.in_reward)

KL_n compares the policy's and the reference's sampler steps on the same recorded transition (one extra
no-grad forward of the reference); the kind (``kl.kind``, algorithms/kl.py) is the analytic
Gaussian KL of the two step means or a log-prob estimator (k1, abs, k2, k3). beta follows
``kl.controller`` (fixed, or PPO's adaptive controller toward ``kl.target``). The
reference's weights (model.py) are the base model, a LoRA adapter mixed into the policy every
``kl.reference_update_freq`` epochs, or a frozen copy.

With ``kl.only_below_start`` the term in the loss weighs each sample by its prompt's gate (``BelowStart``):

    g_p = 1  while  mean(R of p's last W samples) < mean(R of p's first W samples),  else 0     (W: kl.start_window)
    loss = policy loss + beta * sum_{i,n} g_{p(i)} w_{i,n} KL_{i,n}

so a prompt that gains trains free of the reference, and one whose reward fell below where it started is pulled back to
it (docs/studies/group_ppo_fall/, the fall on the flow model: one caption lost while the others gain).

Settings (the user's vocabulary of DDPO / Flow-GRPO / verl): ``kl.use_reference_model``, ``kl.beta``,
``kl.reference_mixup_alpha``, ``kl.reference_update_freq``, ``kl.kind``,
``kl.in_reward``, ``kl.controller``, ``kl.target``, ``kl.horizon``, ``kl.only_below_start``, ``kl.start_window``.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

import torch

from ddpo_group.algorithms import KL_CONTROLLER_REGISTRY, KL_KIND_REGISTRY, get_kl_controller, get_kl_kind
from ddpo_group.reference.model import ReferenceModel
from ddpo_group.timing import NULL_TIMER


class BelowStart:
    """Each prompt's gate g_p of ``kl.only_below_start`` (module docstring), from the rewards of the rounds in order:
    its start is the mean of its first ``window`` rewards, its level the mean of its last ``window``; g_p = 0 until it
    has ``window`` rewards. The same rounds give the same gates on every process (they read gathered rounds)."""

    def __init__(self, window: int):
        self.window = int(window)
        self.first: dict[str, list[float]] = {}
        self.last: dict[str, deque] = {}
        self.share = 0.0  # the share of the last round's samples whose prompt was below its start

    def weights(self, prompts: Sequence[str], rewards: torch.Tensor) -> torch.Tensor:
        """Record a gathered round's rewards [B]; return its samples' gates g_{p(i)} [B] (float, on the CPU)."""
        for prompt, reward in zip(prompts, rewards.double().tolist()):
            first = self.first.setdefault(prompt, [])
            if len(first) < self.window:
                first.append(reward)
            self.last.setdefault(prompt, deque(maxlen=self.window)).append(reward)
        below = {prompt: self.below(prompt) for prompt in set(prompts)}
        gates = torch.tensor([float(below[prompt]) for prompt in prompts])
        self.share = float(gates.mean()) if len(gates) else 0.0
        return gates

    def below(self, prompt: str) -> bool:
        first, last = self.first[prompt], self.last[prompt]
        return len(first) == self.window and sum(last) / len(last) < sum(first) / len(first)

    def state_dict(self) -> dict:
        return {"first": {p: list(v) for p, v in self.first.items()}, "last": {p: list(v) for p, v in self.last.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.first = {p: [float(x) for x in v] for p, v in state["first"].items()}
        self.last = {p: deque((float(x) for x in v), maxlen=self.window) for p, v in state["last"].items()}


class KLRegularizer:
    """beta * KL(policy || reference) per sampled step, in the loss or in the reward (module docstring)."""

    def __init__(self, reference: ReferenceModel, kind: str, controller, in_reward: bool, reduce: str = "mean",
                 timer=NULL_TIMER, below_start: BelowStart | None = None):
        self.reference = reference
        self.below_start = below_start  # kl.only_below_start: the per-prompt gates of the term in the loss
        self.kind = get_kl_kind(kind)
        self.controller = controller
        self.in_reward = bool(in_reward)
        self.reduce = reduce
        self.timer = timer  # the trainer's PhaseTimer: reference forwards count as "reference"

    @classmethod
    def from_config(cls, config, model, lora_config=None, timer=NULL_TIMER) -> "KLRegularizer | None":
        """None without a reference model (kl.use_reference_model=False). Build before accelerate wraps ``model``
        (a LoRA reference adds its adapter to it, full fine-tuning copies it)."""
        reference = ReferenceModel.from_config(config, model, lora_config)
        if reference is None:
            return None
        kl = config.kl
        controller = get_kl_controller(kl.controller, kl.beta, kl.target, kl.horizon)
        below_start = BelowStart(kl.start_window) if kl.only_below_start else None
        return cls(reference, kl.kind, controller, kl.in_reward, config.sample.log_prob_reduce, timer, below_start)

    @property
    def beta(self) -> float:
        return self.controller.value

    @property
    def in_loss(self) -> bool:
        """The loss carries the term; its reference forward runs only when it has weight (beta > 0)."""
        return not self.in_reward and self.beta > 0

    def loss_term(self, kl: torch.Tensor, weights, num_pairs: int, sums: dict) -> torch.Tensor:
        """beta * sum_pairs w KL of a chunk's pairs (``kl`` [N], ``weights`` [N] or one number for every pair, the
        loss's aggregation weights), the term the update adds to its loss; adds ``kl_loss`` (sum w KL) and ``kl`` (the
        mean KL over the train batch's ``num_pairs`` pairs) to the update's metric ``sums``."""
        kl_loss = (weights * kl).sum() if isinstance(weights, torch.Tensor) else weights * kl.sum()
        sums["kl_loss"] += kl_loss.detach()
        sums["kl"] += kl.detach().sum() / num_pairs
        return self.beta * kl_loss

    def step_kl(self, policy_step, score: Callable, policy_model) -> torch.Tensor:
        """KL_n [N] of N (sample, step) pairs, gradient through ``policy_step``; ``score(model)`` gives the pairs' step
        output under a model (``policy_model``: the unwrapped policy, which the reference may share weights with)."""
        with self.timer.phase("reference"), torch.no_grad(), self.reference.applied(policy_model) as reference_model:
            reference_step = score(reference_model)
        return self.kind(policy_step, reference_step, self.reduce)

    @torch.no_grad()
    def rollout_kl(self, batch, scorer, policy_model, pairs_per_forward: int, steps: torch.Tensor) -> torch.Tensor:
        """KL_n [B, T] of the sampled trajectories (for the reward), chunked over (sample, step) pairs.

        ``steps`` [T] bool are the stochastic steps; a deterministic step (outside an SDE window) is no action of
        the policy and gets KL 0 without a forward.
        """
        num_samples, num_steps = batch.log_probs.shape
        device = batch.log_probs.device
        chosen = torch.nonzero(steps.cpu()).flatten()
        pair_rows = torch.arange(num_samples, device=device).repeat_interleave(len(chosen))
        pair_steps = chosen.to(device).repeat(num_samples)
        out = torch.zeros(num_samples, num_steps, device=device)
        for chunk in torch.split(torch.arange(pair_rows.numel(), device=device), pairs_per_forward):
            r, n = pair_rows[chunk], pair_steps[chunk]
            policy_step = scorer(policy_model, batch, r, n)
            out[r, n] = self.step_kl(policy_step, lambda model: scorer(model, batch, r, n), policy_model).float()
        return out

    def step_rewards(self, kl: torch.Tensor) -> torch.Tensor:
        """r_n = -beta * KL_n (in the reward)."""
        return -self.beta * kl

    def after_epoch(self, policy_model, epoch: int, rollout_kl: torch.Tensor | None, loss_kl: torch.Tensor,
                    num_samples: int) -> dict:
        """Measure the epoch's KL, adapt beta, update the reference when due; return the ref/* and train/beta metrics.

        The measured KL is the mean over the sampled steps of ``rollout_kl`` (in the reward) or the trained steps'
        ``loss_kl`` (in the loss; 0 when beta = 0, since the term then runs no reference forward).
        """
        kl = rollout_kl.mean() if self.in_reward else loss_kl.mean()
        metrics = {"train/beta": self.beta, "ref/kl": float(kl)}
        if self.below_start is not None:  # the share of the samples the term weighed (the epoch's last round)
            metrics["ref/below_start"] = self.below_start.share
        self.controller.update(float(kl), num_samples)
        with self.timer.phase("reference"):
            self.reference.maybe_update(policy_model, epoch)
            metrics.update(self.reference.metrics(policy_model))
        return metrics

    def state_dict(self) -> dict:
        state = {"controller": self.controller.state_dict(), "reference": self.reference.state_dict()}
        if self.below_start is not None:
            state["below_start"] = self.below_start.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.controller.load_state_dict(state["controller"])
        self.reference.load_state_dict(state["reference"])
        if self.below_start is not None and "below_start" in state:
            self.below_start.load_state_dict(state["below_start"])


def kl_config_errors(config, estimator) -> list[str]:
    """Contradictions of the KL and reference fields (``estimator``: the EstimatorSpec, for kl.in_reward)."""
    from ddpo_group.algorithms import step_reward_estimators

    kl, errors = config.kl, []

    def need(condition: bool, message: str) -> None:
        if not condition:
            errors.append(message)

    need(kl.beta >= 0, f"kl.beta={kl.beta} must be >= 0")
    need(kl.kind in KL_KIND_REGISTRY, f"kl.kind={kl.kind!r} must be one of {KL_KIND_REGISTRY.names()}")
    if kl.controller in KL_CONTROLLER_REGISTRY:
        errors.extend(KL_CONTROLLER_REGISTRY.get(kl.controller).config_errors(config))
    else:
        errors.append(f"kl.controller={kl.controller!r} must be one of {KL_CONTROLLER_REGISTRY.names()}")
    if kl.beta > 0:
        need(kl.use_reference_model,
             f"kl.beta={kl.beta} asks for a KL term but kl.use_reference_model=False: set "
             "kl.use_reference_model=True (or kl.beta=0)")
    if kl.in_reward:
        need(estimator is None or estimator.accepts_step_rewards,
             f"kl.in_reward=True needs a step-level estimator (one that accepts per-step rewards: "
             f"{step_reward_estimators()}), got algorithm.adv_estimator={config.algorithm.adv_estimator!r} (use the KL loss, "
             "kl.beta, instead)")
        need(kl.beta > 0, f"kl.in_reward=True needs kl.beta > 0, got {kl.beta}")
    if kl.only_below_start:
        need(kl.beta > 0 and not kl.in_reward,
             f"kl.only_below_start=True weighs the KL term in the loss, which needs kl.beta > 0 and kl.in_reward=False; "
             f"got kl.beta={kl.beta}, kl.in_reward={kl.in_reward}")
    need(kl.start_window >= 1, f"kl.start_window={kl.start_window} must be >= 1 (rewards of a prompt)")
    alpha = kl.reference_mixup_alpha
    need(0 <= alpha <= 1, f"kl.reference_mixup_alpha={alpha} must be in [0, 1]")
    need(kl.reference_update_freq >= 0, f"kl.reference_update_freq={kl.reference_update_freq} must be >= 0 (0: never)")
    if kl.reference_update_freq > 0:
        need(kl.use_reference_model,
             f"kl.reference_update_freq={kl.reference_update_freq} updates a reference model, but "
             "kl.use_reference_model=False")
    return errors
