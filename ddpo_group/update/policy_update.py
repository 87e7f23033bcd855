"""The policy-gradient update: the clipped policy loss over recorded (sample, step) pairs.

Each train batch's trained pairs run through the denoiser ``train.pairs_per_forward`` at a time (update/updater.py's
loop). For one chunk of N pairs (rows r, steps n):

    1. l_theta  = the log-probability [N] of each recorded step x_n -> x_{n+1} under the training forward
                  (sampling/trajectories.py's TransitionScorer: the family's forward and its Gaussian step)
    2. loss     = the policy loss of (l_rollout, l_theta, A, w): ratio, clip and the weighted sum, w the pairs'
                  aggregation weights of algorithm.loss_agg_mode (algorithms/policy_losses.py); on-policy
                  distillation weighs it by opd.reward_weight and adds its teachers' KL (``added_loss``,
                  update/distillation_update.py)
    3. loss    += beta * sum g w KL(policy step || reference step), with the KL in the loss (reference/regularizer.py;
                  beta = 0 skips the reference forward; g the row's prompt gate under kl.only_below_start, else 1)
    4. backward (a per-step loss: every chunk, memory one chunk's activations; a trajectory-level loss, gspo or
       geo_mean: the train batch's [b, T] log-prob matrix at its last chunk, one backward)

Before the epoch's first optimizer step every ratio is 1 up to rounding (update/on_policy.py): ``ratio_before_update``
is the largest |ratio - 1| over those pairs, ``clipped_before_update`` the share of them the loss's trust region acts on
(a ratio outside the clip range; dppo: the pairs its mask blocks). With ``train.recompute_rollout`` or a rollout
correction the rollout's l_rollout and mu_rollout are first recomputed by the training forward at the weights that
sampled (``rollout_recomputed_kl``: how far the recorded ones were), and the correction
(algorithms/rollout_correction.py) of the recorded against the recomputed log-probabilities multiplies each pair's
weight w in 2 (a trajectory-level loss: its rows' advantages by their trajectory weight, its rejected steps masked). ``policy_kl`` (mean over the trained pairs) and ``policy_kl_max`` are the exact KL of
each step's Gaussian under the rollout policy to the one under the policy being trained (their means, recorded and
recomputed, and their shared std), at the weights each chunk sees, beside the log-prob estimate approx_kl.
"""

from __future__ import annotations

import torch

from ddpo_group.algorithms import aggregation_weights, gaussian_kl, get_policy_loss
from ddpo_group.algorithms.rollout_correction import rollout_correction
from ddpo_group.distributed import check_peers
from ddpo_group.update.on_policy import ratio_deviation
from ddpo_group.update.updater import Chunk, UpdateOptions, Updater, fold_metrics


class PolicyUpdater(Updater):
    """The clipped policy-gradient update over an epoch's (sample, step) pairs (module docstring)."""

    def __init__(self, options: UpdateOptions):
        super().__init__(options)
        config = options.config
        self.loss = get_policy_loss(config.algorithm.policy_loss)
        kwargs = config.algorithm.policy_loss_kwargs
        self.loss_kwargs = kwargs.to_dict() if hasattr(kwargs, "to_dict") else dict(kwargs or {})
        # the trust region's bounds the loss names (policy_losses.BOUNDS: the clip range, the dual clip, dppo's KL)
        bounds = {"clip_low": float(config.train.clip_range), "clip_high": float(config.train.clip_range),
                  "clip_ratio_c": config.algorithm.clip_ratio_c,
                  "policy_kl_threshold": float(config.train.policy_kl_threshold)}
        self.bounds = {name: bounds[name] for name in self.loss.bounds}
        self.trajectory_outputs = []  # a trajectory-level loss: the train batch's chunks' (log-probs, KL) so far
        self.policy_weight = 1.0  # the policy loss's weight (on-policy distillation's opd.reward_weight)
        self.begin_epoch(None)

    def begin_epoch(self, batch) -> None:
        """This epoch's max |ratio - 1|, pairs outside the trust region and pairs at the rollout weights, and its
        largest policy KL: zeros on the device, read at the epoch's end; with train.recompute_rollout, the rollout's
        log-probabilities and step means recomputed first."""
        device = self.accelerator.device
        self.ratio_gap, self.outside, self.counted, self.kl_max = (torch.zeros((), device=device) for _ in range(4))
        self.recomputed_kl = self.correction = None
        correcting = bool(self.config.algorithm.rollout_correction.is_level
                          or self.config.algorithm.rollout_correction.rs_level)
        if batch is not None and (self.config.train.recompute_rollout or correcting):
            recorded = batch.log_probs.clone() if correcting else None
            self.recompute_rollout(batch)
            if correcting:  # the trainable steps of the real rows; the factor on the device the chunks read it on
                mask = self.epoch_units(batch)[0][:, None] & self.trainable_steps().cpu()[None, :]
                self.correction = rollout_correction(recorded, batch.log_probs, mask.to(recorded.device),
                                                     self.config.algorithm.rollout_correction)
                self.correction.factor = self.correction.factor.to(device)

    @torch.no_grad()
    def recompute_rollout(self, batch) -> None:
        """train.recompute_rollout: every trainable (row, step) pair's l_rollout (and mu_rollout, when recorded)
        replaced, in ``batch``, by the training forward's at the weights that sampled (before any optimizer step,
        chunks of the epoch's pairs_per_forward); ``recomputed_kl``: the mean exact KL of the recorded step Gaussians
        to the recomputed ones (how far the sampler was from the trainer)."""
        device, chunk = self.accelerator.device, self.pairs_per_forward_of(batch)
        steps = self.trainable_steps().nonzero().flatten()
        rows, pair_steps = (torch.arange(len(batch)).repeat_interleave(len(steps)), steps.repeat(len(batch)))
        kl_sum = torch.zeros((), device=device)
        for start in range(0, len(rows), chunk):
            r, n = rows[start : start + chunk].to(device), pair_steps[start : start + chunk].to(device)
            with self.accelerator.autocast():
                out = self.scorer(self.model, batch, r, n)
            batch.log_probs[r, n] = out.log_prob.to(batch.log_probs.dtype)
            if batch.step_means is not None:
                kl_sum += gaussian_kl(out.mean.float(), batch.step_means[r, n].float(), out.std.float(),
                                      self.scorer.reduce).sum()
                batch.step_means[r, n] = out.mean.to(batch.step_means.dtype)
        self.recomputed_kl = kl_sum / max(len(rows), 1)

    def end_epoch(self, metrics: dict) -> None:
        """Over every process (one gather): ``ratio_before_update``, the largest |ratio - 1| of the pairs trained
        before the epoch's first optimizer step; ``clipped_before_update``, the share of them outside the loss's trust
        region; ``policy_kl_max``, the largest policy KL of a trained pair."""
        stats = torch.stack([self.ratio_gap, self.outside, self.counted, self.kl_max])[None]
        if self.accelerator.num_processes > 1:
            check_peers(self.accelerator)
            stats = self.accelerator.gather(stats)
        gap, outside, pairs, kl_max = stats[:, 0].max(), stats[:, 1].sum(), stats[:, 2].sum(), stats[:, 3].max()
        metrics.update(ratio_before_update=float(gap), clipped_before_update=float(outside) / max(float(pairs), 1.0))
        if self.recomputed_kl is not None:  # this process's (the processes sample alike)
            metrics["rollout_recomputed_kl"] = float(self.recomputed_kl)
        if self.correction is not None:  # this process's rows
            metrics.update(self.correction.metrics)
        if "policy_kl" in metrics:  # the batch held the rollout's step means
            metrics["policy_kl_max"] = float(kl_max)

    def pair_weights(self, step_mask: torch.Tensor, num_pairs: int) -> torch.Tensor:
        """The aggregation weights w_{i,n} of ``algorithm.loss_agg_mode`` over the train batch's step mask, of each
        pair: loss = sum over the pairs of w_{i,n} L_{i,n}."""
        step_mask = step_mask.cpu()
        return aggregation_weights(step_mask, self.config.algorithm.loss_agg_mode)[step_mask.nonzero(as_tuple=True)]

    def chunk_loss(self, batch, chunk: Chunk, sums: dict) -> None:
        """Steps 1-4 of the module docstring on one chunk."""
        device = self.accelerator.device
        r, n = chunk.units.to(device, non_blocking=True), chunk.steps.to(device, non_blocking=True)
        out = self.scorer(self.model, batch, r, n)  # 1.
        with torch.no_grad():
            self.watch(batch, r, n, out, batch.log_probs[r, n], chunk, sums)
        kl = self.reference_kl(batch, r, n, out)
        if not self.loss.per_step:  # 4. at the train batch's last chunk
            self.trajectory_outputs.append((out.log_prob, kl))
            if chunk.last:
                outputs, self.trajectory_outputs = self.trajectory_outputs, []
                self.trajectory_loss(batch, chunk.train_batch, outputs, sums)
            return
        w = self.chunk_weights(chunk, r, n)
        loss = self.added_loss(batch, chunk, r, n, out, w, sums)
        if self.policy_weight > 0:  # 2.
            policy_loss, info = self.loss.fn(batch.log_probs[r, n], out.log_prob, batch.advantages[r, n], w,
                                             **self.bounds, **self.step_means(batch, r, n, out), **self.loss_kwargs)
            loss = loss + self.policy_weight * policy_loss
            sums["policy_loss"] += policy_loss.detach()
            fold_metrics(sums, info, chunk.share)
        if kl is not None:  # 3.
            loss = loss + self.kl.loss_term(kl, batch.kl_pair_weights(w, r), chunk.num_pairs, sums)
        self.accelerator.backward(loss)  # 4.

    def reference_kl(self, batch, r, n, out):
        """KL_n [N] of the chunk's pairs to the reference model (the KL term in the loss), or None without one."""
        if not self.uses_reference:
            return None
        return self.kl.step_kl(out, lambda model: self.scorer(model, batch, r, n), self.accelerator.unwrap_model(self.model))

    def chunk_weights(self, chunk: Chunk, r, n):
        """The chunk's pair weights w, times the rollout correction's factor of each pair."""
        w = chunk.weights.to(self.accelerator.device, non_blocking=True)
        if self.correction is not None:
            w = w * self.correction.factor[r, n]
        return w

    def added_loss(self, batch, chunk: Chunk, r, n, out, w, sums: dict):
        """A loss beside the policy loss, of the chunk's pairs (on-policy distillation's teachers' KL,
        update/distillation_update.py); none here."""
        return 0.0

    def watch(self, batch, r, n, out, rollout_log_prob, chunk: Chunk, sums: dict) -> None:
        """The on-policy measures at the rollout weights (each ratio is 1 up to rounding there) and the exact policy
        KL of the chunk's pairs (module docstring)."""
        trained = chunk.weights.to(out.log_prob.device) != 0  # not a zero-weight pair (a train batch without real ones)
        if chunk.at_rollout_weights:
            outside = self.loss.outside_trust_region(rollout_log_prob, out.log_prob, **self.bounds,
                                                     **self.step_means(batch, r, n, out), **self.loss_kwargs,
                                                     advantages=batch.advantages[r, n])
            gap = torch.where(trained, ratio_deviation(out.log_prob, rollout_log_prob), 0.0)
            self.ratio_gap = torch.maximum(self.ratio_gap, gap.max())
            self.outside = self.outside + (outside & trained).sum()
            self.counted = self.counted + trained.sum()
        if batch.step_means is None:  # the rollouts record them for every policy-gradient run; a batch without them: no KL
            return
        kl = gaussian_kl(out.mean.float(), batch.step_means[r, n].float(), out.std.float(), self.scorer.reduce)
        kl = torch.where(trained, kl, 0.0)
        self.kl_max = torch.maximum(self.kl_max, kl.max())
        fold_metrics(sums, {"policy_kl": kl.sum() / trained.sum().clamp(min=1)}, chunk.share)

    def step_means(self, batch, r, n, out) -> dict:
        """What a loss declaring ``needs_rollout_means`` gets besides the log-probs (nothing for the others)."""
        if not self.loss.needs_rollout_means:
            return {}
        if batch.step_means is None:
            raise ValueError(f"policy loss {self.loss.name!r} needs the rollout policy's step means, but the batch has "
                             "no step_means: collect the rollouts with record_means=True (RolloutCollector does so "
                             "for such a loss)")
        return {"mean": out.mean, "rollout_mean": batch.step_means[r, n], "std": out.std,
                "step_length": out.step_length, "log_prob_reduce": self.scorer.reduce}

    def trajectory_loss(self, batch, train_batch: tuple, outputs: list, sums: dict) -> None:
        """A trajectory-level loss (gspo, geo_mean) on the train batch's [b, T] log-prob matrix gathered from its
        chunks' ``outputs``, with the KL term; one backward."""
        algorithm, device = self.config.algorithm, self.accelerator.device
        units, step_mask, pair_units, pair_steps, weights = train_batch
        rows, step_mask = units.to(device, non_blocking=True), step_mask.to(device)
        pair_units, pair_steps, weights = (t.to(device, non_blocking=True) for t in (pair_units, pair_steps, weights))
        flat = torch.cat([log_prob for log_prob, _ in outputs])
        log_prob = torch.zeros(step_mask.shape, dtype=flat.dtype, device=flat.device).index_put(
            (pair_units, pair_steps), flat
        )
        rollout = batch.log_probs[rows].to(flat.dtype)
        log_prob = torch.where(step_mask != 0, log_prob, rollout)  # untrained steps: ratio 1, masked anyway
        advantages = batch.advantages[rows]
        if self.correction is not None:  # rejected steps masked; a row's loss weighed by its trajectory weight (> 0)
            factor = self.correction.factor[rows].to(advantages.dtype)
            step_mask = step_mask * (factor != 0)
            advantages = advantages * factor.amax(dim=1).view(-1, *[1] * (advantages.ndim - 1))
        policy_loss, info = self.loss(rollout, log_prob, advantages, step_mask, algorithm.loss_agg_mode,
                                      **self.bounds, **self.loss_kwargs)
        loss = policy_loss + 0.0 * flat.sum()  # stays connected to the denoiser even when every step is masked
        if outputs[0][1] is not None:
            kl = torch.cat([kl for _, kl in outputs])
            loss = loss + self.kl.loss_term(kl, batch.kl_pair_weights(weights, rows[pair_units]), len(kl), sums)
        self.accelerator.backward(loss)
        sums["policy_loss"] += policy_loss.detach()
        fold_metrics(sums, info, 1.0)
