"""The training phase of an epoch: clipped policy-gradient updates over recorded (sample, step) pairs.

Every train batch flattens its trained (sample, step) pairs into the batch dimension and runs
them through the denoiser ``train.pairs_per_forward`` at a time (one guided forward per chunk),
instead of one timestep of the whole batch at a time. For a loss registered with a per-step loss
matrix (vanilla PPO, or any plugin that declares one), each chunk is backpropagated at once with its
aggregation weights, so memory is one chunk's activations while the gradient equals that of the
whole train batch's aggregated loss.

The policy loss is looked up by name or plugin path (``algorithm.policy_loss``, with
``algorithm.policy_loss_kwargs``). A loss without a matrix (gspo, geo_mean: a trajectory-level
ratio) gathers the chunks' log-probs into the train batch's [b, T] matrix and backpropagates once. A loss that
declares ``needs_old_means`` (ratio_norm) also gets each pair's step mean under the policy and under the rollout
policy (batch["step_means"]), the step's std and its length in flow time.
With the KL in the loss (reference/regularizer.py), every chunk also runs the reference (no grad) and
adds ``beta * sum_{i,n} w_{i,n} KL_{i,n}`` with the same aggregation weights; with beta = 0 the
reference forward is skipped (the KL would only be a metric).

The loop (inner epochs, train batches, chunks, gradient accumulation, the non-finite check) is update/updater.py's.
"""

from __future__ import annotations

import torch

from ddpo_group.algorithms import aggregation_weights, get_policy_loss
from ddpo_group.distributed import check_peers
from ddpo_group.update.updater import Chunk, Updater


class PolicyUpdater(Updater):
    """The clipped policy-gradient update over an epoch's (sample, step) pairs (module docstring)."""

    def __init__(self, config, accelerator, model, optimizer, trainable_params, scorer, kl=None, pairs_per_forward=None,
                 after_optimizer_step=None):
        super().__init__(config, accelerator, model, optimizer, trainable_params, scorer, kl, pairs_per_forward,
                         after_optimizer_step)
        self.loss = get_policy_loss(config.algorithm.policy_loss)
        kwargs = config.algorithm.policy_loss_kwargs
        self.loss_kwargs = kwargs.to_dict() if hasattr(kwargs, "to_dict") else dict(kwargs or {})
        self.clip_range = float(config.train.clip_range)
        # a loss with a per-step matrix backpropagates chunk by chunk; any other once per train batch
        self.backward_per_chunk = self.loss.loss_matrix is not None
        self.ratio_gap = None  # max |ratio - 1| at the rollout weights this epoch (update/on_policy.py), on the device

    def train_epoch(self, batch, show_progress: bool = True) -> dict:
        """The update loop (update/updater.py), and ``ratio_before_update``: the largest |ratio - 1| of the pairs
        trained before the epoch's first optimizer step, over every process (update/on_policy.py)."""
        self.ratio_gap = torch.zeros((), device=self.accelerator.device)
        out = super().train_epoch(batch, show_progress)
        gap = self.ratio_gap[None]
        if self.accelerator.num_processes > 1:  # one gather per epoch
            check_peers(self.accelerator)
            gap = self.accelerator.gather(gap)
        out["ratio_before_update"] = float(gap.max())
        return out

    def pair_weights(self, step_mask: torch.Tensor, num_pairs: int) -> torch.Tensor:
        """The aggregation weights w_{i,n} of ``algorithm.loss_agg_mode`` over the train batch's step mask, of each
        pair: loss = sum over the pairs of w_{i,n} L_{i,n}."""
        step_mask = step_mask.cpu()
        return aggregation_weights(step_mask, self.config.algorithm.loss_agg_mode)[step_mask.nonzero(as_tuple=True)]

    def chunk_loss(self, batch, chunk: Chunk, sums: dict):
        """The chunk's policy step outputs (and KL to the reference, with the KL in the loss); with a loss matrix
        its weighted loss backpropagated now:

            loss = sum_pairs w_{i,n} L_{i,n}  +  beta sum_pairs w_{i,n} KL_{i,n}
        """
        device = self.accelerator.device
        r, n = chunk.units.to(device, non_blocking=True), chunk.steps.to(device, non_blocking=True)
        out = self.scorer(self.model, batch, r, n)
        if chunk.at_rollout_weights:  # the policy is still the rollout policy: each ratio is 1 up to rounding
            with torch.no_grad():
                ratio = torch.exp(out.log_prob.float() - batch.log_probs[r, n].float())
                self.ratio_gap = torch.maximum(self.ratio_gap, (ratio - 1).abs().max())
        kl = None
        if self.uses_reference:
            kl = self.kl.step_kl(out, lambda model: self.scorer(model, batch, r, n),
                                 self.accelerator.unwrap_model(self.model))
        if not self.backward_per_chunk:
            return out.log_prob, kl
        w = chunk.weights.to(device, non_blocking=True)
        loss_mat, info = self.loss.loss_matrix(
            old_log_prob=batch.log_probs[r, n], log_prob=out.log_prob, advantages=batch.advantages[r, n],
            step_mask=torch.ones_like(out.log_prob), clip_low=self.clip_range, clip_high=self.clip_range,
            clip_ratio_c=self.config.algorithm.clip_ratio_c, **self.step_means(batch, r, n, out), **self.loss_kwargs,
        )
        policy_loss = (w * loss_mat).sum()
        loss = policy_loss
        if kl is not None:
            kl_loss = (w * kl).sum()
            loss = loss + self.kl.beta * kl_loss
            sums["kl_loss"] += kl_loss.detach()
            sums["kl"] += kl.detach().sum() / chunk.num_pairs
        self.accelerator.backward(loss)
        sums["policy_loss"] += policy_loss.detach()
        for key, value in info.items():
            sums[key] += chunk.share * (value.detach() if isinstance(value, torch.Tensor) else value)

    def step_means(self, batch, r, n, out) -> dict:
        """What a loss declaring ``needs_old_means`` gets besides the log-probs (nothing for the others)."""
        if not self.loss.needs_old_means:
            return {}
        if batch.step_means is None:
            raise ValueError(f"policy loss {self.loss.name!r} needs the rollout policy's step means, but the batch has "
                             "no step_means: collect the rollouts with record_means=True (RolloutCollector does so "
                             "for such a loss)")
        return {"mean": out.mean, "old_mean": batch.step_means[r, n], "std": out.std,
                "step_length": out.step_length, "log_prob_reduce": self.scorer.reduce}

    def batch_loss(self, batch, units, step_mask, pairs, outputs, sums) -> None:
        """A loss without a per-step matrix (gspo, geo_mean): the loss on the train batch's gathered [b, T] log-prob
        matrix, one backward."""
        a, device = self.config.algorithm, self.accelerator.device
        rows, step_mask = units.to(device, non_blocking=True), step_mask.to(device)
        pair_units, pair_steps, weights = (t.to(device, non_blocking=True) for t in pairs)
        with self.accelerator.autocast():
            flat = torch.cat([log_prob for log_prob, _ in outputs])
            log_prob = torch.zeros(step_mask.shape, dtype=flat.dtype, device=flat.device).index_put(
                (pair_units, pair_steps), flat
            )
            old = batch.log_probs[rows].to(flat.dtype)
            log_prob = torch.where(step_mask != 0, log_prob, old)  # untrained steps: ratio 1, masked anyway
            policy_loss, info = self.loss(
                old, log_prob, batch.advantages[rows], step_mask, a.loss_agg_mode,
                clip_low=self.clip_range, clip_high=self.clip_range, clip_ratio_c=a.clip_ratio_c, **self.loss_kwargs,
            )
            loss = policy_loss + 0.0 * flat.sum()  # stays connected to the denoiser even when every step is masked
            sums["policy_loss"] = policy_loss.detach()
            sums.update({k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in info.items()})
            if outputs[0][1] is not None:
                kl = torch.cat([kl for _, kl in outputs])
                kl_loss = (weights * kl).sum()
                loss = loss + self.kl.beta * kl_loss
                sums["kl_loss"] = kl_loss.detach()
                sums["kl"] = kl.detach().mean()
            self.accelerator.backward(loss)
