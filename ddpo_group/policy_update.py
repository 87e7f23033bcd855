"""The training phase of an epoch: clipped policy-gradient updates over recorded (sample, step) pairs.

Every train batch flattens its trained (sample, step) pairs into the batch dimension and runs
them through the UNet ``train.pairs_per_forward`` at a time (one guided forward per chunk),
instead of one timestep of the whole batch at a time. For a step-decomposable loss (vanilla PPO),
each chunk is backpropagated at once with its aggregation weights, so memory is one chunk's
activations while the gradient equals that of the whole train batch's aggregated loss.

The policy loss is looked up by name (``algorithm.policy_loss``). The trajectory-level losses
(gspo, geo_mean) gather the chunks' log-probs into the train batch's [b, T] matrix and
backpropagate once. With a reference model, every chunk also runs the reference (no grad) and
adds ``beta * sum_{i,n} w_{i,n} KL_{i,n}`` (kl_term.py) with the same aggregation weights.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext

import torch
from tqdm.auto import tqdm

from ddpo_group.algorithms import aggregation_weights, get_policy_loss, vanilla_loss_matrix
from ddpo_group.errors import NonFiniteLossError
from ddpo_group.kl_term import reference_step, step_kl
from ddpo_group.sampling.pipeline import step_log_prob

STEP_DECOMPOSABLE_LOSSES = ("vanilla",)  # chunk-wise backward; the others gather the train batch's log-probs


def random_step_mask(batch: int, num_steps: int, fraction: float, generator=None, device=None) -> torch.Tensor:
    """[B, T] 0/1 mask choosing int(T * fraction) random steps of each trajectory (DDPO's timestep subsampling)."""
    k = max(1, int(num_steps * fraction))
    order = torch.rand(batch, num_steps, generator=generator).argsort(dim=1)[:, :k]
    mask = torch.zeros(batch, num_steps)
    mask.scatter_(1, order, 1.0)
    return mask.to(device)


class PolicyUpdater:
    """Runs ``train.num_inner_epochs`` passes of clipped policy-gradient updates over an epoch's samples."""

    def __init__(self, config, accelerator, unet, scheduler, optimizer, trainable_params, negative_prompt_embeds,
                 reference=None):
        self.config = config
        self.reference = reference  # ReferenceModel or None (no KL term)
        self.beta = float(config.train.beta)  # the trainer sets it every epoch (adaptive KL controller)
        self.clip_range = float(config.train.get("epsilon", config.train.clip_range))  # the same field (config/base.py)
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
        for inner in range(t.num_inner_epochs):
            perm = torch.randperm(num_samples)
            step_mask = random_step_mask(num_samples, num_steps, t.timestep_fraction, device=batch["log_probs"].device)
            if "row_mask" in batch:  # dynamic sampling: padded rows take no part in the loss
                step_mask = step_mask * batch["row_mask"][:, None]
            for start in range(0, num_samples, t.batch_size):
                rows = perm[start : start + t.batch_size].to(batch["log_probs"].device)
                self._position = (inner, start // t.batch_size, optimizer_steps)  # named by a non-finite loss error
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
                self.check_finite(grad_norm=torch.tensor(metrics["grad_norm"]))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def accumulate_gradients(self, batch: dict, rows: torch.Tensor, step_mask: torch.Tensor) -> dict:
        """Backpropagate one train batch's loss, chunk by chunk of (sample, step) pairs.

            loss = policy_loss + beta * sum over masked pairs (i, n) of w_{i,n} * KL_{i,n}

        with w the aggregation weights of ``algorithm.loss_agg_mode`` over the batch's step mask.
        "vanilla" is per step: each chunk is backpropagated at once with its weights (the chunks'
        gradients add up to the whole batch's; memory is one chunk's). "gspo" and "geo_mean" use a
        trajectory-level ratio: the chunks' log-probs are gathered into the batch's [b, T] matrix
        and the loss is backpropagated once (memory is the whole train batch's activations).
        """
        a = self.config.algorithm
        weights = aggregation_weights(step_mask, a.loss_agg_mode)
        pair_rows, pair_steps = step_mask.nonzero(as_tuple=True)
        if pair_rows.numel() == 0:  # every row padded: one zero-weight pair keeps the processes' backward calls in step
            pair_rows = pair_steps = torch.zeros(1, dtype=torch.long, device=step_mask.device)
        chunks = torch.split(torch.arange(pair_rows.numel(), device=pair_rows.device), self.config.train.pairs_per_forward)
        per_step = a.policy_loss in STEP_DECOMPOSABLE_LOSSES
        sums, log_probs, kls = defaultdict(float), [], []
        for k, chunk in enumerate(chunks):
            r, n = rows[pair_rows[chunk]], pair_steps[chunk]
            # per-step losses: gradients are all-reduced once per train batch, on its last chunk
            sync = nullcontext() if (k == len(chunks) - 1 or not per_step) else self.accelerator.no_sync(self.unet)
            with sync, self.accelerator.autocast():
                args = (batch["latents"][r, n], batch["next_latents"][r, n], batch["timesteps"][r, n],
                        batch["prompt_embeds"][r], self.negative_prompt_embeds.expand(len(chunk), -1, -1),
                        self.guidance_scale, self.config.sample.eta)
                out = step_log_prob(self.unet, self.scheduler, *args)
                kl = None
                if self.reference is not None:
                    ref = reference_step(self.reference, self.accelerator.unwrap_model(self.unet), self.scheduler, *args)
                    kl = step_kl(out, ref, a.kl_type, self.config.sample.log_prob_reduce)
                w = weights[pair_rows[chunk], n]
                if not per_step:
                    log_probs.append(out.log_prob)
                    kls.append(kl)
                    continue
                loss_mat, info = vanilla_loss_matrix(
                    old_log_prob=batch["log_probs"][r, n], log_prob=out.log_prob, advantages=batch["advantages"][r, n],
                    step_mask=torch.ones_like(out.log_prob), clip_low=self.clip_range, clip_high=self.clip_range,
                    clip_ratio_c=a.clip_ratio_c,
                )
                policy_loss = (w * loss_mat).sum()
                loss = policy_loss
                kl_loss = None
                if kl is not None:
                    kl_loss = (w * kl).sum()
                    loss = loss + self.beta * kl_loss
                    sums["kl_loss"] += float(kl_loss.detach())
                    sums["kl"] += float(kl.detach().sum()) / pair_rows.numel()
                self.check_finite(policy_loss=policy_loss, kl_loss=kl_loss)
                self.accelerator.backward(loss)
            share = len(chunk) / pair_rows.numel()
            sums["policy_loss"] += float(policy_loss.detach())
            for key, value in info.items():
                sums[key] += share * float(value)
        if not per_step:
            sums.update(self._trajectory_loss(batch, rows, step_mask, weights, pair_rows, pair_steps, log_probs, kls))
        return dict(sums)

    def check_finite(self, **values) -> None:
        """Raise NonFiniteLossError naming the non-finite values and the train batch (before backward / step)."""
        bad = {name: float(v.detach().float().sum()) for name, v in values.items()
               if v is not None and not bool(torch.isfinite(v.detach()).all())}
        if bad:
            inner, index, steps = getattr(self, "_position", (0, 0, 0))
            listed = ", ".join(f"{name}={value}" for name, value in bad.items())
            raise NonFiniteLossError(f"non-finite {listed} in train batch {index} of inner epoch {inner}", steps)

    def _trajectory_loss(self, batch, rows, step_mask, weights, pair_rows, pair_steps, log_probs, kls) -> dict:
        """gspo / geo_mean: the registered loss on the gathered [b, T] log-prob matrix, one backward."""
        a = self.config.algorithm
        with self.accelerator.autocast():
            flat = torch.cat(log_probs)
            log_prob = torch.zeros(step_mask.shape, dtype=flat.dtype, device=flat.device).index_put(
                (pair_rows, pair_steps), flat
            )
            old = batch["log_probs"][rows].to(flat.dtype)
            log_prob = torch.where(step_mask != 0, log_prob, old)  # untrained steps: ratio 1, masked anyway
            policy_loss, info = get_policy_loss(a.policy_loss)(
                old, log_prob, batch["advantages"][rows], step_mask, a.loss_agg_mode,
                clip_low=self.clip_range, clip_high=self.clip_range, clip_ratio_c=a.clip_ratio_c,
            )
            loss = policy_loss + 0.0 * flat.sum()  # stays connected to the UNet even when every step is masked
            metrics = {"policy_loss": float(policy_loss.detach()), **{k: float(v) for k, v in info.items()}}
            if kls and kls[0] is not None:
                kl = torch.cat(kls)
                kl_loss = (weights[pair_rows, pair_steps] * kl).sum()
                loss = loss + self.beta * kl_loss
                metrics["kl_loss"] = float(kl_loss.detach())
                metrics["kl"] = float(kl.detach().mean())
            self.check_finite(policy_loss=policy_loss, kl_loss=kl_loss if kls and kls[0] is not None else None)
            self.accelerator.backward(loss)
        return metrics
