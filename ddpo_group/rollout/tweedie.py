"""GROUP_PPO's Tweedie values (``group_ppo.value_source`` "tweedie" or "blend"): the reward of a step's one-step
prediction of the clean image, as Stepwise-Flow-GRPO scores clean_hat at every step,

    V(x_n) = r(decode(clean_hat(x_n)), prompt)    clean_hat: DDIM (x_n - sqrt(1 - ab_t) eps_hat) / sqrt(ab_t),
                                                       flow x_n - s_n v_hat                 (StepOutput.clean_hat)

No training; one VAE decode and one reward query per sample and valued step, counted as reward queries. GROUP_PPO reads
V(x_n) for n >= 1 only (its post-step values; the start value is the group mean). After the last stochastic step the
rest of a trajectory is deterministic, so there V(x_n) = R exactly and nothing is queried: the valued steps are
n = 1 .. the last stochastic step (with the default 2-step window, n = 1: one query per sample).
"""

from __future__ import annotations

import torch

from ddpo_group.sampling.family import Family
from ddpo_group.sampling.trajectories import decode_audio_latents, decode_latents, with_audio


def valued_steps(stochastic: torch.Tensor) -> list[int]:
    """The pre-step columns that get a Tweedie value: 1 <= n <= the last stochastic step (``stochastic`` [T] bool)."""
    on = torch.as_tensor(stochastic).nonzero().flatten()
    return list(range(1, int(on.max()) + 1)) if len(on) else []


@torch.no_grad()
def tweedie_values(family: Family, clean_hat: torch.Tensor | None, steps: list[int], num_steps: int, score,
                   prompts: list[str], metadata: list[dict], dtype=None, decode_batch_size: int = 0) -> torch.Tensor:
    """[B, T] float64: column steps[k] holds score(decode(clean_hat[:, k])), the others NaN (``with_rewards`` fills
    them). ``clean_hat`` [B, len(steps), ...] (Trajectories.clean_hat recorded at ``steps``); ``num_steps`` T;
    ``score(images, prompts, metadata) -> rewards``; a family with audio: each prediction's audio in its metadata
    (``with_audio``), as the samples' own."""
    batch = len(prompts)
    values = torch.full((batch, num_steps), float("nan"), dtype=torch.float64)
    if not steps:
        return values
    latents = clean_hat.flatten(0, 1)  # sample-major: row b * len(steps) + k is sample b at steps[k]
    images = decode_latents(family, latents.to(dtype or latents.dtype), decode_batch_size)
    rows = [m for m in metadata for _ in steps]
    if family.capabilities.audio:
        rows = with_audio(rows, decode_audio_latents(family, latents, decode_batch_size), family.audio_sample_rate)
    rewards = score(images, [p for p in prompts for _ in steps], rows)
    values[:, steps] = rewards.double().cpu().view(batch, len(steps))
    return values


def with_rewards(values: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """The columns without a Tweedie value get the sample's reward: exact after the last stochastic step (the rest is
    deterministic); column 0 is never read by GROUP_PPO."""
    rewards = rewards.double().cpu()[:, None].expand_as(values)
    return torch.where(torch.isnan(values), rewards, values)
