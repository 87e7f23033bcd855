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

Hot loop: no host-device synchronisation inside a train batch. The step mask and the (sample,
step) pair indices are built on the CPU and moved once per train batch; metrics are accumulated as
device tensors and read once at the end of the epoch; the non-finite check (losses and grad norm)
is one sync per train batch, before its optimizer step.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext

import torch
from tqdm.auto import tqdm

from ddpo_group.algorithms import aggregation_weights, get_policy_loss
from ddpo_group.errors import NonFiniteLossError


def random_step_mask(batch: int, num_steps: int, fraction: float, generator=None, device=None,
                     trainable: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] 0/1 mask choosing int(W * fraction) random steps of each trajectory (DDPO's timestep subsampling)
    among its W trainable steps (``trainable`` [T] bool, default all: the SDE window's steps otherwise)."""
    trainable = torch.ones(num_steps, dtype=torch.bool) if trainable is None else trainable.cpu().bool()
    k = max(1, int(int(trainable.sum()) * fraction))
    scores = torch.rand(batch, num_steps, generator=generator)
    scores[:, ~trainable] = 2.0  # after every trainable step (scores of those are < 1)
    order = scores.argsort(dim=1)[:, :k]
    mask = torch.zeros(batch, num_steps)
    mask.scatter_(1, order, 1.0)
    return mask.to(device)


class PolicyUpdater:
    """Runs ``train.num_inner_epochs`` passes of clipped policy-gradient updates over an epoch's samples.

    ``scorer`` (sampling.trajectories.TransitionScorer) gives the step output of recorded transitions under a model;
    ``kl`` (reference.regularizer.KLRegularizer or None) adds the KL term when it is in the loss.
    """

    def __init__(self, config, accelerator, model, optimizer, trainable_params, scorer, kl=None, pairs_per_forward=None,
                 after_optimizer_step=None):
        self.config = config
        # an int, or a callable (updater, batch) -> int: update/memory_fit.PairsPerForward resolves "auto"
        self.pairs_per_forward = config.train.pairs_per_forward if pairs_per_forward is None else pairs_per_forward
        self.loss = get_policy_loss(config.algorithm.policy_loss)
        kwargs = config.algorithm.policy_loss_kwargs
        self.loss_kwargs = kwargs.to_dict() if hasattr(kwargs, "to_dict") else dict(kwargs or {})
        self.kl = kl
        self.clip_range = float(config.train.clip_range)
        self.accelerator = accelerator
        self.model = model
        self.optimizer = optimizer
        self.params = trainable_params
        self.scorer = scorer
        self.after_optimizer_step = after_optimizer_step  # called after every optimizer step (the EMA: update/ema.py)

    @property
    def uses_reference(self) -> bool:
        """The reference forward runs only when the KL term is in the loss with weight (beta > 0)."""
        return self.kl is not None and self.kl.in_loss

    def train_epoch(self, batch: dict, show_progress: bool = True) -> dict:
        """Update the policy on ``batch`` (the local rows); return averaged metrics, the optimizer steps taken and
        ``pairs``: the (sample, step) pairs trained (the step masks' nonzero entries, every inner epoch)."""
        t = self.config.train
        num_samples, num_steps = batch["log_probs"].shape
        self.scorer.prepare(self.config.sample.num_steps, self.accelerator.device)
        self.model.train()
        chunk = self.chunk_size(batch)  # "auto" is measured here the first time, in training mode, before any update
        sums, count, optimizer_steps, pairs = defaultdict(float), 0, 0, 0
        total = t.num_inner_epochs * (num_samples // t.batch_size)
        progress = tqdm(total=total, desc="training", disable=not show_progress, leave=False)
        device = batch["log_probs"].device
        row_mask = batch["row_mask"].cpu() if "row_mask" in batch else None  # one transfer per epoch
        for inner in range(t.num_inner_epochs):
            perm = torch.randperm(num_samples)
            step_mask = random_step_mask(num_samples, num_steps, t.timestep_fraction,  # on the CPU: no syncs
                                         trainable=self.trainable_steps())
            if row_mask is not None:  # dynamic sampling: padded rows take no part in the loss
                step_mask = step_mask * row_mask[:, None]
            pairs += int(step_mask.count_nonzero())  # a CPU tensor: no sync
            for start in range(0, num_samples, t.batch_size):
                rows = perm[start : start + t.batch_size]
                self._position = (inner, start // t.batch_size, optimizer_steps)  # named by a non-finite loss error
                metrics = self._train_batch(batch, rows.to(device, non_blocking=True), step_mask[rows])
                grad_norm = metrics.pop("grad_norm", None)
                if grad_norm is not None:  # only on optimizer steps
                    sums["grad_norm"] += grad_norm
                    optimizer_steps += 1
                for key, value in metrics.items():
                    sums[key] += value
                count += 1
                progress.update(1)
        progress.close()
        self.model.eval()
        out = {key: float(value) / max(count, 1) for key, value in sums.items() if key != "grad_norm"}  # the one sync
        out["grad_norm"] = float(sums["grad_norm"]) / max(optimizer_steps, 1)
        out["optimizer_steps"] = optimizer_steps
        out["pairs_per_forward"] = chunk
        out["pairs"] = pairs
        return out

    def trainable_steps(self) -> torch.Tensor:
        """[T] bool: the steps a pair may be drawn from (the SDE window's stochastic steps)."""
        return self.scorer.family.stochastic_steps(self.config.sample)

    def _train_batch(self, batch: dict, rows: torch.Tensor, step_mask: torch.Tensor) -> dict:
        with self.accelerator.accumulate(self.model):
            metrics = self.accumulate_gradients(batch, rows, step_mask)
            if self.accelerator.sync_gradients:
                norm = self.accelerator.clip_grad_norm_(self.params, self.config.train.max_grad_norm)
                metrics["grad_norm"] = norm.detach() if isinstance(norm, torch.Tensor) else norm  # read at epoch end
            # one host-device sync per train batch, before the optimizer step the losses would feed; with several
            # processes only where the gradients were all-reduced, so all raise at the same step (run/process_failures.py)
            if self.accelerator.sync_gradients or self.accelerator.num_processes == 1:
                self.check_finite(policy_loss=metrics.get("policy_loss"), kl_loss=metrics.get("kl_loss"),
                                  grad_norm=metrics.get("grad_norm"))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.accelerator.sync_gradients and self.after_optimizer_step is not None:
                self.after_optimizer_step()
        return metrics

    def chunk_size(self, batch: dict) -> int:
        """(sample, step) pairs per forward (``train.pairs_per_forward``; "auto" is resolved on first use)."""
        return self.pairs_per_forward(self, batch) if callable(self.pairs_per_forward) else int(self.pairs_per_forward)

    def accumulate_gradients(self, batch: dict, rows: torch.Tensor, step_mask: torch.Tensor,
                             pairs_per_forward: int | None = None) -> dict:
        """Backpropagate one train batch's loss, chunk by chunk of (sample, step) pairs.

            loss = policy_loss + beta * sum over masked pairs (i, n) of w_{i,n} * KL_{i,n}

        with w the aggregation weights of ``algorithm.loss_agg_mode`` over the batch's step mask. A loss
        with a per-step matrix is backpropagated chunk by chunk with its weights (the chunks' gradients add
        up to the whole batch's; memory is one chunk's). Any other loss gets the chunks' log-probs gathered
        into the batch's [b, T] matrix and is backpropagated once (memory: the train batch's activations).

        ``step_mask`` may live on the CPU (the trainer's case: the pair indices are then found without a
        device sync); the returned metrics are detached tensors (or floats).
        """
        device = rows.device
        weights = aggregation_weights(step_mask, self.config.algorithm.loss_agg_mode)
        pair_rows, pair_steps = step_mask.nonzero(as_tuple=True)
        if pair_rows.numel() == 0:  # every row padded: one zero-weight pair keeps the processes' backward calls in step
            pair_rows = pair_steps = torch.zeros(1, dtype=torch.long, device=step_mask.device)
        pair_weights = weights[pair_rows, pair_steps].to(device, non_blocking=True)
        pair_rows, pair_steps = pair_rows.to(device, non_blocking=True), pair_steps.to(device, non_blocking=True)
        size = pairs_per_forward or self.chunk_size(batch)
        chunks = torch.split(torch.arange(pair_rows.numel(), device=device), size)
        per_step = self.loss.loss_matrix is not None
        sums, log_probs, kls = defaultdict(float), [], []
        for k, chunk in enumerate(chunks):
            r, n = rows[pair_rows[chunk]], pair_steps[chunk]
            # per-step losses: gradients are all-reduced once per train batch, on its last chunk
            sync = nullcontext() if (k == len(chunks) - 1 or not per_step) else self.accelerator.no_sync(self.model)
            with sync, self.accelerator.autocast():
                out = self.scorer(self.model, batch, r, n)
                kl = None
                if self.uses_reference:
                    kl = self.kl.step_kl(out, lambda model: self.scorer(model, batch, r, n),
                                         self.accelerator.unwrap_model(self.model))
                if per_step:
                    self._backward_chunk(batch, r, n, out, kl, pair_weights[chunk], len(pair_rows), sums)
                else:
                    log_probs.append(out.log_prob)
                    kls.append(kl)
        if not per_step:
            sums.update(self._trajectory_loss(batch, rows, step_mask.to(device), pair_weights, pair_rows, pair_steps,
                                              log_probs, kls))
        return dict(sums)

    def _backward_chunk(self, batch, r, n, out, kl, w, num_pairs: int, sums) -> None:
        """A step-decomposable loss: this chunk's weighted loss matrix (plus its KL term), backpropagated now."""
        loss_mat, info = self.loss.loss_matrix(
            old_log_prob=batch["log_probs"][r, n], log_prob=out.log_prob, advantages=batch["advantages"][r, n],
            step_mask=torch.ones_like(out.log_prob), clip_low=self.clip_range, clip_high=self.clip_range,
            clip_ratio_c=self.config.algorithm.clip_ratio_c, **self._step_means(batch, r, n, out), **self.loss_kwargs,
        )
        policy_loss = (w * loss_mat).sum()
        loss = policy_loss
        if kl is not None:
            kl_loss = (w * kl).sum()
            loss = loss + self.kl.beta * kl_loss
            sums["kl_loss"] += kl_loss.detach()
            sums["kl"] += kl.detach().sum() / num_pairs
        self.accelerator.backward(loss)
        share = len(r) / num_pairs
        sums["policy_loss"] += policy_loss.detach()
        for key, value in info.items():
            sums[key] += share * (value.detach() if isinstance(value, torch.Tensor) else value)

    def _step_means(self, batch, r, n, out) -> dict:
        """What a loss declaring ``needs_old_means`` gets besides the log-probs (nothing for the others)."""
        if not self.loss.needs_old_means:
            return {}
        if "step_means" not in batch:
            raise ValueError(f"policy loss {self.loss.name!r} needs the rollout policy's step means, but the batch has "
                             "no 'step_means': collect the rollouts with record_means=True (RolloutCollector does so "
                             "for such a loss)")
        return {"mean": out.mean, "old_mean": batch["step_means"][r, n], "std": out.std,
                "step_length": out.step_length, "log_prob_reduce": self.scorer.reduce}

    def check_finite(self, **values) -> None:
        """Raise NonFiniteLossError naming the non-finite values and the train batch (before the optimizer step).

        Called once per train batch on its summed losses (and the grad norm): a NaN or inf in any chunk
        makes the sum non-finite, and no weight has changed yet.
        """
        values = {name: torch.as_tensor(v).detach() for name, v in values.items() if v is not None}
        finite = {name: torch.isfinite(v.float()).all() for name, v in values.items()}
        if not values or bool(torch.stack(list(finite.values())).all()):  # the one sync when all is well
            return
        bad = {name: float(v.float().sum()) for name, v in values.items() if not bool(finite[name])}
        if len(bad) > 1:  # a non-finite loss makes the grad norm non-finite too: name the cause
            bad.pop("grad_norm", None)
        inner, index, steps = getattr(self, "_position", (0, 0, 0))
        listed = ", ".join(f"{name}={value}" for name, value in bad.items())
        raise NonFiniteLossError(f"non-finite {listed} in train batch {index} of inner epoch {inner}", steps)

    def _trajectory_loss(self, batch, rows, step_mask, pair_weights, pair_rows, pair_steps, log_probs, kls) -> dict:
        """A loss without a per-step matrix (gspo, geo_mean): the loss on the gathered [b, T] log-prob matrix, one
        backward."""
        a = self.config.algorithm
        with self.accelerator.autocast():
            flat = torch.cat(log_probs)
            log_prob = torch.zeros(step_mask.shape, dtype=flat.dtype, device=flat.device).index_put(
                (pair_rows, pair_steps), flat
            )
            old = batch["log_probs"][rows].to(flat.dtype)
            log_prob = torch.where(step_mask != 0, log_prob, old)  # untrained steps: ratio 1, masked anyway
            policy_loss, info = self.loss(
                old, log_prob, batch["advantages"][rows], step_mask, a.loss_agg_mode,
                clip_low=self.clip_range, clip_high=self.clip_range, clip_ratio_c=a.clip_ratio_c, **self.loss_kwargs,
            )
            loss = policy_loss + 0.0 * flat.sum()  # stays connected to the denoiser even when every step is masked
            metrics = {"policy_loss": policy_loss.detach(),
                       **{k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in info.items()}}
            if kls and kls[0] is not None:
                kl = torch.cat(kls)
                kl_loss = (pair_weights * kl).sum()
                loss = loss + self.kl.beta * kl_loss
                metrics["kl_loss"] = kl_loss.detach()
                metrics["kl"] = kl.detach().mean()
            self.accelerator.backward(loss)
        return metrics
