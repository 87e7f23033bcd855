"""Per-step KL between the policy's and the reference's sampler steps, for the loss and for the reward.

    gaussian (default):  KL_n = reduce_dims((mu_theta - mu_ref)^2) / (2 sigma_n^2)     (analytic; both
                         steps share sigma_n)
    k1 / abs / k2 / k3:  estimators on d = l_theta(x_{n+1}) - l_ref(x_{n+1}) (algorithms/kl.py)

The reference's output is one extra no-grad forward on the same (x_n, t_n, c).
"""

from __future__ import annotations

import torch

from ddpo_group.algorithms import gaussian_kl, kl_penalty
from ddpo_group.sampling.pipeline import step_log_prob


def step_kl(policy_step, reference_step, kind: str = "gaussian", reduce: str = "mean") -> torch.Tensor:
    """KL_n [N] of N flattened (sample, step) pairs from the two DDIMStepOutputs (gradient through the policy's)."""
    if kind == "gaussian":
        return gaussian_kl(policy_step.mean, reference_step.mean, policy_step.std, reduce=reduce)
    return kl_penalty(policy_step.log_prob, reference_step.log_prob, kind)


@torch.no_grad()
def reference_step(reference, unet, scheduler, latents, next_latents, timesteps, prompt_embeds, negative, guidance_scale, eta):
    """The reference model's DDIMStepOutput on the recorded transitions (``unet``: the unwrapped policy)."""
    with reference.applied(unet) as ref_unet:
        return step_log_prob(ref_unet, scheduler, latents, next_latents, timesteps, prompt_embeds, negative, guidance_scale, eta)


@torch.no_grad()
def rollout_kl(batch: dict, policy_unet, reference, scheduler, negative_prompt_embeds, guidance_scale: float, eta: float,
               kind: str, reduce: str, pairs_per_forward: int, steps: torch.Tensor | None = None) -> torch.Tensor:
    """KL_n [B, T] of the sampled trajectories (KL in reward), chunked over (sample, step) pairs.

    ``steps`` [T] bool (default all) are the stochastic steps; a deterministic step (outside an SDE
    window) is no action of the policy and gets KL 0 without a forward.
    """
    num_samples, num_steps = batch["log_probs"].shape
    device = batch["log_probs"].device
    chosen = torch.arange(num_steps) if steps is None else torch.nonzero(steps.cpu()).flatten()
    pair_rows = torch.arange(num_samples, device=device).repeat_interleave(len(chosen))
    pair_steps = chosen.to(device).repeat(num_samples)
    out = torch.zeros(num_samples, num_steps, device=device)
    for chunk in torch.split(torch.arange(pair_rows.numel(), device=device), pairs_per_forward):
        r, n = pair_rows[chunk], pair_steps[chunk]
        args = (batch["latents"][r, n], batch["next_latents"][r, n], batch["timesteps"][r, n], batch["prompt_embeds"][r],
                negative_prompt_embeds.expand(len(chunk), -1, -1), guidance_scale, eta)
        policy = step_log_prob(policy_unet, scheduler, *args)
        ref = reference_step(reference, policy_unet, scheduler, *args)
        out[r, n] = step_kl(policy, ref, kind, reduce).float()
    return out
