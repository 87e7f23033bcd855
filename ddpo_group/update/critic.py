"""The critic V(x_n, t_n, c): a small value network with its own optimizer (ppo_gae, group_ppo).

    x   = x_n, or [x_n, clean_hat(x_n)]       critic.input "latent" / "latent_clean_hat": the latent, and the step's
                                              one-step prediction of the clean latent stacked on its channels
    h_x = pool(conv(conv(x)))                 latent features, [C, h, w] latents (SD, SD3)
        = mean over tokens of MLP(x)          packed [L, D] latents (FLUX)
    h_t = MLP(sinusoidal(t))                  timestep features
    h_c = Linear(mean over tokens of c)       text features
    V   = MLP([h_x, h_t, h_c])                a scalar: the expected terminal reward

Values are computed (no grad) for every pre-step latent while sampling, values[:, n] = V(x_n, t_n, c), the indexing of
the advantage estimators. With "latent_clean_hat" the rollout keeps clean_hat(x_n) of every step
(RolloutBatch.clean_hat, one more latent-sized tensor per step): at x_n the prediction already shows the image the
trajectory heads for, which the latent alone shows only late in the denoising. Training regresses V(latents[:, n],
timesteps[:, n], c) on the estimator's targets with the clipped value loss

    L = 0.5 * agg( max((v - y)^2, (clip(v, v_old +- c) - y)^2) )

under the critic's mask: every step for gae, the endpoint mask for group_ppo.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ddpo_group.algorithms import clipped_value_loss
from ddpo_group.errors import NonFiniteLossError


def timestep_features(timesteps: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features [N, 2 * (dim // 2)]: sin and cos of t * f_k, f_k from 1 down to 1/1000."""
    half = dim // 2
    freqs = torch.exp(-math.log(1000.0) * torch.arange(half, device=timesteps.device, dtype=torch.float32) / max(half, 1))
    angles = timesteps.float()[:, None] * freqs[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


class TokenFeatures(nn.Module):
    """Features of packed latents [N, L, D]: a per-token MLP, averaged over the tokens."""

    def __init__(self, token_dim: int, hidden_dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(token_dim, hidden_dim), nn.SiLU(), nn.Linear(hidden_dim, hidden_dim), nn.SiLU())

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.mlp(latents).mean(dim=1)


# critic.input: what the network sees of a step's state besides t_n and c
CRITIC_INPUTS = ("latent", "latent_clean_hat")


class ValueNetwork(nn.Module):
    def __init__(self, latent_shape: tuple | int, text_dim: int, hidden_dim: int = 64, with_clean_hat: bool = False):
        """``latent_shape``: one latent's shape, (C, h, w), a video's (C, F', h, w) or packed (L, D) (an int: C).
        ``with_clean_hat``: the input holds clean_hat(x_n) too, stacked on the channel (token feature) axis."""
        super().__init__()
        self.hidden_dim = hidden_dim
        self.with_clean_hat = with_clean_hat
        shape = (latent_shape,) if isinstance(latent_shape, int) else tuple(latent_shape)
        packed = len(shape) == 2
        self.channel_dim = 2 if packed else 1  # of a batch of latents [N, L, D] or [N, C, h, w]
        channels = (shape[1] if packed else shape[0]) * (2 if with_clean_hat else 1)
        if packed:
            self.latent = TokenFeatures(channels, hidden_dim)
        else:  # image latents (C, h, w): 2D convolutions; video latents (C, F', h, w): 3D ones
            conv, pool = (nn.Conv3d, nn.AdaptiveAvgPool3d) if len(shape) == 4 else (nn.Conv2d, nn.AdaptiveAvgPool2d)
            self.latent = nn.Sequential(
                conv(channels, hidden_dim, 3, padding=1), nn.SiLU(),
                conv(hidden_dim, hidden_dim, 3, stride=2, padding=1), nn.SiLU(),
                pool(1), nn.Flatten(),
            )
        self.time = nn.Sequential(nn.Linear(2 * (hidden_dim // 2), hidden_dim), nn.SiLU())
        self.text = nn.Linear(text_dim, hidden_dim)
        self.head = nn.Sequential(nn.Linear(3 * hidden_dim, hidden_dim), nn.SiLU(), nn.Linear(hidden_dim, 1))

    def forward(self, latents: torch.Tensor, timesteps: torch.Tensor, text_embeds: torch.Tensor,
                clean_hat: torch.Tensor | None = None) -> torch.Tensor:
        """latents [N, C, h, w] or [N, L, D], timesteps [N], text_embeds [N, L', D'] (and clean_hat shaped as latents,
        with ``with_clean_hat``) -> values [N] (float32)."""
        if self.with_clean_hat != (clean_hat is not None):
            raise ValueError(f"this value network {'reads' if self.with_clean_hat else 'does not read'} clean_hat(x_n); "
                             f"got {'none' if clean_hat is None else 'one'}")
        x = latents.float() if clean_hat is None else torch.cat([latents.float(), clean_hat.float()], dim=self.channel_dim)
        h = torch.cat(
            [
                self.latent(x),
                self.time(timestep_features(timesteps, self.hidden_dim)),
                self.text(text_embeds.float().flatten(1, -2).mean(dim=1)),  # [B, L, D] or [B, L, K, D] (Krea 2)
            ],
            dim=1,
        )
        return self.head(h).squeeze(1)


def pooled_text(text_embeds: torch.Tensor) -> torch.Tensor:
    """[N, 1, D] float32: the mean of a condition over its token axes (the network's own pooling, done once a row
    before a trajectory's steps repeat it: a [B, L, K, D] condition, Krea 2's, is large)."""
    return text_embeds.float().flatten(1, -2).mean(dim=1, keepdim=True)


class Critic:
    """The value network (accelerate-prepared: gradients are averaged over processes) and its optimizer."""

    def __init__(self, config, accelerator, latent_shape: tuple | int, text_dim: int, text_embeds=None):
        """``text_embeds(cond)``: a condition's text input (the family's ``text_embeds``; its ``prompt_embeds`` when
        None)."""
        critic = config.critic
        self.config = config
        self.accelerator = accelerator
        self.text_embeds = text_embeds or (lambda cond: cond["prompt_embeds"])
        network = ValueNetwork(latent_shape, text_dim, critic.hidden_dim,
                               with_clean_hat=critic.input == "latent_clean_hat").to(accelerator.device)
        self.optimizer = torch.optim.AdamW(network.parameters(), **{k: v for k, (v, _) in self.settings(config).items()})
        self.network = accelerator.prepare(network)  # saved with the accelerate state (the trainer registers the optimizer)

    @staticmethod
    def settings(config) -> dict:
        """{optimizer keyword: (its value, the config field)} of the critic's AdamW."""
        return {"lr": (config.critic.learning_rate, "critic.learning_rate"),
                "weight_decay": (config.critic.weight_decay, "critic.weight_decay")}

    @property
    def module(self) -> ValueNetwork:
        return self.accelerator.unwrap_model(self.network)

    @property
    def reads_clean_hat(self) -> bool:
        """critic.input="latent_clean_hat": the network reads clean_hat(x_n) beside x_n."""
        return self.module.with_clean_hat

    @torch.no_grad()
    def values(self, latents: torch.Tensor, timesteps: torch.Tensor, text_embeds: torch.Tensor,
               clean_hat: torch.Tensor | None = None) -> torch.Tensor:
        """V(x_n, t_n, c) [B, T] of every step of B trajectories (latents [B, T, C, h, w], timesteps [B, T],
        text_embeds [B, L, D] or [B, L, K, D], pooled once a row; clean_hat [B, T, ...] when the critic reads it) in one
        forward over the B * T pairs;
        float32, as in training."""
        b, t = timesteps.shape
        clean_hat = clean_hat.flatten(0, 1) if clean_hat is not None else None
        with torch.autocast(device_type=latents.device.type, enabled=False):
            values = self.module(latents.flatten(0, 1), timesteps.flatten(0, 1),
                                 pooled_text(text_embeds).repeat_interleave(t, dim=0), clean_hat)
        return values.view(b, t)

    def train_epoch(self, batch, batch_size: int) -> dict:
        """``critic.num_updates`` passes of clipped value regression over the local samples of ``batch`` (a
        RolloutBatch): its ``critic_targets`` under its ``critic_mask`` [B, T] (pre-step indexing; dynamic sampling's
        padding rows left out). Every process runs the same number of steps (one per train batch of ``batch_size``
        samples), whatever its number of masked pairs.
        """
        critic = self.config.critic
        targets, mask = batch.critic_targets, batch.critic_mask
        if batch.row_mask is not None:
            mask = mask * batch.row_mask[:, None]
        num_samples, num_steps = mask.shape
        sums, count = {}, 0
        self.network.train()
        for _ in range(critic.num_updates):
            perm = torch.randperm(num_samples)
            for start in range(0, num_samples, batch_size):
                rows = perm[start : start + batch_size].to(mask.device)
                b = len(rows)
                latents = batch.latents[rows].flatten(0, 1)
                timesteps = batch.timesteps[rows].flatten(0, 1)
                embeds = pooled_text(self.text_embeds({k: v[rows] for k, v in batch.cond.items()}))
                embeds = embeds.repeat_interleave(num_steps, dim=0)
                clean_hat = batch.clean_hat[rows].flatten(0, 1) if self.reads_clean_hat else None
                values = self.network(latents, timesteps, embeds, clean_hat).view(b, num_steps)
                loss, info = clipped_value_loss(
                    values, batch.values[rows].float(), targets[rows].float(), mask[rows],
                    critic.value_clip_range, "step-mean",
                )
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                info["critic/grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.network.parameters(), critic.max_grad_norm))
                # checked after backward, before the step: the gradients are all-reduced there, so a NaN on one process
                # stops every process at the same batch (run/processes/process_failures.py)
                if not (bool(torch.isfinite(loss.detach())) and math.isfinite(info["critic/grad_norm"])):
                    bad = f"value loss={float(loss.detach())}" if not bool(torch.isfinite(loss.detach())) else \
                        f"grad_norm={info['critic/grad_norm']} (the value loss was finite on this process)"
                    raise NonFiniteLossError(f"non-finite critic {bad} in critic batch {start // batch_size}", None)
                self.optimizer.step()
                info["critic/value_loss"] = float(loss.detach())
                for key, value in info.items():
                    sums[key] = sums.get(key, 0.0) + value
                count += 1
        self.network.eval()
        return {key: value / max(count, 1) for key, value in sums.items()}


def critic_config_errors(config) -> list[str]:
    """Contradictions of the critic.* fields."""
    critic, errors = config.critic, []
    if not critic.learning_rate > 0:
        errors.append(f"critic.learning_rate={critic.learning_rate} must be > 0")
    if critic.hidden_dim < 1:
        errors.append(f"critic.hidden_dim={critic.hidden_dim} must be >= 1")
    if critic.num_updates < 1:
        errors.append(f"critic.num_updates={critic.num_updates} must be >= 1")
    if critic.input not in CRITIC_INPUTS:
        errors.append(f"critic.input={critic.input!r} is not one of {list(CRITIC_INPUTS)}")
    if critic.warmup_epochs < 0:
        errors.append(f"critic.warmup_epochs={critic.warmup_epochs} must be >= 0")
    if not (critic.value_clip_range is None or critic.value_clip_range > 0):
        errors.append(f"critic.value_clip_range={critic.value_clip_range} must be > 0 (or None)")
    return errors
