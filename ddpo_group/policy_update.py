"""The training phase of an epoch: clipped policy-gradient updates over recorded (sample, step) pairs.

Every train batch flattens its trained (sample, step) pairs into the batch dimension and runs
them through the UNet ``train.pairs_per_forward`` at a time (one guided forward per chunk),
instead of one timestep of the whole batch at a time. For a step-decomposable loss (vanilla PPO),
each chunk is backpropagated at once with its aggregation weights, so memory is one chunk's
activations while the gradient equals that of the whole train batch's aggregated loss.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext

import torch
from tqdm.auto import tqdm

from ddpo_group.algorithms import aggregation_weights, vanilla_loss_matrix
from ddpo_group.sampling.pipeline import step_log_prob


def random_step_mask(batch: int, num_steps: int, fraction: float, generator=None, device=None) -> torch.Tensor:
    """[B, T] 0/1 mask choosing int(T * fraction) random steps of each trajectory (DDPO's timestep subsampling)."""
    k = max(1, int(num_steps * fraction))
    order = torch.rand(batch, num_steps, generator=generator).argsort(dim=1)[:, :k]
    mask = torch.zeros(batch, num_steps)
    mask.scatter_(1, order, 1.0)
    return mask.to(device)


class PolicyUpdater:
    """Runs ``train.num_inner_epochs`` passes of clipped policy-gradient updates over an epoch's samples."""

    def __init__(self, config, accelerator, unet, scheduler, optimizer, trainable_params, negative_prompt_embeds):
        self.config = config
        self.accelerator = accelerator
        self.unet = unet
        self.scheduler = scheduler
        self.optimizer = optimizer
        self.params = trainable_params
        self.negative_prompt_embeds = negative_prompt_embeds
        self.guidance_scale = config.sample.guidance_scale if config.train.cfg else 1.0

    def train_epoch(self, batch: dict, show_progress: bool = True) -> dict:
        """Update the policy on ``batch`` (the local rows); return averaged metrics."""
        t = self.config.train
        num_samples, num_steps = batch["log_probs"].shape
        self.scheduler.set_timesteps(self.config.sample.num_steps, device=self.accelerator.device)
        self.unet.train()
        sums, count, optimizer_steps = defaultdict(float), 0, 0
        total = t.num_inner_epochs * (num_samples // t.batch_size)
        progress = tqdm(total=total, desc="training", disable=not show_progress, leave=False)
        for _ in range(t.num_inner_epochs):
            perm = torch.randperm(num_samples)
            step_mask = random_step_mask(num_samples, num_steps, t.timestep_fraction, device=batch["log_probs"].device)
            for start in range(0, num_samples, t.batch_size):
                rows = perm[start : start + t.batch_size].to(batch["log_probs"].device)
                metrics = self._train_batch(batch, rows, step_mask[rows])
                grad_norm = metrics.pop("grad_norm", None)
                if grad_norm is not None:  # only on optimizer steps
                    sums["grad_norm"] += grad_norm
                    optimizer_steps += 1
                for key, value in metrics.items():
                    sums[key] += value
                count += 1
                progress.update(1)
        progress.close()
        self.unet.eval()
        out = {key: value / max(count, 1) for key, value in sums.items() if key != "grad_norm"}
        out["grad_norm"] = sums["grad_norm"] / max(optimizer_steps, 1)
        out["optimizer_steps"] = optimizer_steps
        return out

    def _train_batch(self, batch: dict, rows: torch.Tensor, step_mask: torch.Tensor) -> dict:
        with self.accelerator.accumulate(self.unet):
            metrics = self.accumulate_gradients(batch, rows, step_mask)
            if self.accelerator.sync_gradients:
                metrics["grad_norm"] = float(self.accelerator.clip_grad_norm_(self.params, self.config.train.max_grad_norm))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def accumulate_gradients(self, batch: dict, rows: torch.Tensor, step_mask: torch.Tensor) -> dict:
        """Backpropagate the aggregated policy loss of one train batch, chunk by chunk of (sample, step) pairs.

        loss = sum over masked pairs (i, n) of w_{i,n} * L_{i,n}, with w the aggregation weights of
        ``algorithm.loss_agg_mode`` over the batch's step mask, so the chunks' gradients add up to
        the gradient of the whole batch's loss.
        """
        t = self.config.train
        weights = aggregation_weights(step_mask, self.config.algorithm.loss_agg_mode)
        pair_rows, pair_steps = step_mask.nonzero(as_tuple=True)
        chunks = torch.split(torch.arange(pair_rows.numel(), device=pair_rows.device), t.pairs_per_forward)
        sums = defaultdict(float)
        for k, chunk in enumerate(chunks):
            r, n = rows[pair_rows[chunk]], pair_steps[chunk]
            # gradients are all-reduced once per train batch, on its last chunk
            sync = nullcontext() if k == len(chunks) - 1 else self.accelerator.no_sync(self.unet)
            with sync, self.accelerator.autocast():
                out = step_log_prob(
                    self.unet, self.scheduler, batch["latents"][r, n], batch["next_latents"][r, n],
                    batch["timesteps"][r, n], batch["prompt_embeds"][r],
                    self.negative_prompt_embeds.expand(len(chunk), -1, -1), self.guidance_scale,
                    self.config.sample.eta,
                )
                loss_mat, info = vanilla_loss_matrix(
                    old_log_prob=batch["log_probs"][r, n].unsqueeze(1),
                    log_prob=out.log_prob.unsqueeze(1),
                    advantages=batch["advantages"][r, n].unsqueeze(1),
                    step_mask=torch.ones_like(out.log_prob).unsqueeze(1),
                    clip_low=t.clip_range,
                    clip_high=t.clip_range,
                )
                loss = (weights[pair_rows[chunk], n] * loss_mat.squeeze(1)).sum()
                self.accelerator.backward(loss)
            share = len(chunk) / pair_rows.numel()
            sums["policy_loss"] += float(loss.detach())
            for key, value in info.items():
                sums[key] += share * float(value)
        return dict(sums)
