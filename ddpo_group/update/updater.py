"""The update loop every objective shares: ``train.num_inner_epochs`` passes over an epoch's units in train batches,
each train batch's (unit, step) pairs run ``train.pairs_per_forward`` at a time, gradient accumulation and its syncs,
the non-finite check before each optimizer step, and the metrics averaged over the epoch.

A unit is what a train batch draws: a sample (the policy gradient, update/policy_update.py; a matching objective,
update/matching_update.py) or a preference objective's K rows of one prompt group (update/preference_update.py). Each
updater contributes its loss on one chunk of pairs (``chunk_loss``) and, where it needs them, its units
(``epoch_units``), what its pairs weigh (``pair_weights``) and what it does before and after the epoch
(``begin_epoch``, ``end_epoch``); ``train_epoch`` is this file's alone:

    for each inner epoch:
        order = the real units shuffled, the padding ones after them
        step mask [U, T] = int(W x train.step_fraction) random steps of each real unit's W trainable steps, none
                           of a padding unit's (so padding draws no random number)
        for each train batch of units (train.batch_size samples):
            pairs = its step mask's (unit, step) entries, their weights
            for each chunk of pairs_per_forward pairs:  chunk_loss: forward, backward (gradients synced on the
                                                        last chunk only)
            the losses and the gradient norm checked, clipped, the optimizer step (every gradient_accumulation_steps)

Several processes: every process runs the same number of train batches (they hold equal units: padding units, e.g.
dynamic sampling's dropped rows, weigh nothing), and a train batch without a real pair runs one zero-weight pair so
that every process meets the same backward calls.

Hot loop: the step mask and the pair indices are built on the CPU and moved once per train batch; the non-finite check
(losses and gradient norm) is one host-device sync per train batch, before its optimizer step. A loss's metrics are
read as numbers where it computes them (algorithms/policy_losses.py: a few syncs a chunk).
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm.auto import tqdm

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


@dataclass
class Chunk:
    """One forward's pairs of a train batch, on the CPU: ``units`` [n] (the updater's units: batch rows for a sample
    a unit) and ``steps`` [n]; ``weights``: a [n] tensor, or one number for every pair; ``num_pairs``: the train
    batch's pairs; ``share``: the chunk's part of the train batch (the weight of its mean metrics); ``last``: the train
    batch's last chunk; ``train_batch``: the train batch's (units [b], step mask [b, T], pair positions [P], pair steps
    [P], pair weights), for a loss over whole trajectories."""

    units: torch.Tensor
    steps: torch.Tensor
    weights: torch.Tensor | float
    num_pairs: int
    share: float
    at_rollout_weights: bool = False  # no optimizer step yet this epoch: the policy is the rollout policy
    last: bool = True
    train_batch: tuple = ()


def fold_metrics(sums: dict, info: dict, share: float) -> None:
    """Add a chunk's metrics ``info`` (floats or tensors, detached here) to ``sums``, weighted by its ``share`` of the
    train batch: the sums are then the train batch's means."""
    for key, value in info.items():
        sums[key] += share * (value.detach() if isinstance(value, torch.Tensor) else value)


@dataclass(frozen=True)
class UpdateOptions:
    """What an updater is built from (every objective's the same).

    config, accelerator, optimizer: the run's; model: the policy denoiser (accelerate-prepared); params: its trainable
    parameters (clipped); scorer: sampling/trajectories.py's TransitionScorer, the step output of recorded transitions
    under a model; kl: reference/regularizer.py's KLRegularizer, or None: the KL term; pairs_per_forward: an int, a
    callable (updater, batch) -> int (update/memory_fit.py's PairsPerForward resolves "auto"), or None: the config's;
    ema: update/ema.py's EMAWeights, stepped after every optimizer step, or None; old: a matching objective's old model
    (update/old_model.py), or None; teachers: on-policy distillation's (reference/teachers.py), or None; step_count(): the optimizer steps taken before this epoch (its decay reads them).
    """

    config: object
    accelerator: object
    model: object
    optimizer: object
    params: list
    scorer: object
    kl: object = None
    pairs_per_forward: object = None
    ema: object = None
    old: object = None
    teachers: object = None
    step_count: Callable[[], int] = lambda: 0


class Updater:
    """``train.num_inner_epochs`` passes over an epoch's units (module docstring), built from ``UpdateOptions``. A
    subclass gives ``chunk_loss`` and, where it differs from a sample a unit with equal weights over the SDE window's
    steps, the hooks ``epoch_units``, ``pair_weights``, ``trainable_steps``, ``begin_epoch`` and ``end_epoch``."""

    unit_width = 1  # batch rows per unit

    def __init__(self, options: UpdateOptions):
        self.options = options
        self.config, self.accelerator, self.model, self.optimizer = (options.config, options.accelerator, options.model,
                                                                     options.optimizer)
        self.params, self.scorer, self.kl, self.ema = list(options.params), options.scorer, options.kl, options.ema
        self.pairs_per_forward = (self.config.train.pairs_per_forward if options.pairs_per_forward is None
                                  else options.pairs_per_forward)

    @property
    def uses_reference(self) -> bool:
        """Whether the update runs the reference model's forward on its pairs: the KL term in the loss with weight
        (beta > 0); a preference objective always (it compares the policy with the reference)."""
        return self.kl is not None and self.kl.in_loss

    # ------------------------------------------------------------------ the hooks
    def trainable_steps(self) -> torch.Tensor:
        """[T] bool: the steps a pair may be drawn from (the SDE window's stochastic steps)."""
        return self.scorer.family.stochastic_steps(self.config.sample)

    def epoch_units(self, batch) -> tuple[torch.Tensor, dict]:
        """([U] bool: which of this epoch's units are real, the epoch's metrics about them). A unit is a batch row;
        dynamic sampling's padding rows (row_mask 0) are not real."""
        real = batch.row_mask.cpu().bool() if batch.row_mask is not None else torch.ones(len(batch), dtype=torch.bool)
        return real, {}

    def pair_weights(self, step_mask: torch.Tensor, num_pairs: int) -> torch.Tensor | float:
        """The weight of each of a train batch's pairs (its step mask's nonzero entries, in order): every pair weighs
        1 / (the train batch's pairs)."""
        return 1.0 / max(num_pairs, 1)

    def rollout_policy(self, policy):
        """Context in which the rollouts are sampled; it yields the denoiser they sample with: ``policy`` (the policy's
        sampling denoiser) unless the objective samples with another."""
        return nullcontext(policy)

    def begin_epoch(self, batch) -> None:
        """Before the epoch's first train batch."""

    def end_epoch(self, metrics: dict) -> None:
        """After the epoch's last optimizer step: add to the epoch's ``metrics``."""

    def chunk_loss(self, batch, chunk: Chunk, sums: dict) -> None:
        """Backpropagate the chunk's weighted loss (its weights sum to its share of the train batch's loss; a loss over
        whole trajectories backpropagates the train batch's at its ``last`` chunk); add its detached metrics to
        ``sums`` (``fold_metrics``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the loop
    def pairs_per_forward_of(self, batch) -> int:
        """(sample, step) pairs per forward (``train.pairs_per_forward``; "auto" is resolved on first use)."""
        return self.pairs_per_forward(self, batch) if callable(self.pairs_per_forward) else int(self.pairs_per_forward)

    def train_epoch(self, batch, show_progress: bool = True) -> dict:
        """Update the policy on ``batch`` (this process's rows); returns the metrics averaged over the train batches
        that hold a real unit, the optimizer steps taken and ``pairs``: the (sample, step) pairs trained (every inner
        epoch; a unit of K rows counts K a step)."""
        train, accelerator = self.config.train, self.accelerator
        real, unit_metrics = self.epoch_units(batch)
        num_units, num_steps = len(real), batch.num_steps
        self.scorer.prepare(self.config.sample.num_steps, accelerator.device)
        self.model.train()
        chunk = self.pairs_per_forward_of(batch) if num_units else None  # "auto" is measured here, in training mode
        self.begin_epoch(batch)
        per_batch = max(1, train.batch_size // self.unit_width)
        real_units, padding_units = real.nonzero().flatten(), (~real).nonzero().flatten()
        sums, count, optimizer_steps, pairs = defaultdict(float), 0, 0, 0
        progress = tqdm(total=train.num_inner_epochs * -(-num_units // per_batch), desc="training",
                        disable=not show_progress, leave=False)
        for inner in range(train.num_inner_epochs):
            order = torch.cat([real_units[torch.randperm(len(real_units))], padding_units])
            step_mask = torch.zeros(num_units, num_steps)  # padding units take no part in the loss
            step_mask[real_units] = random_step_mask(len(real_units), num_steps, train.step_fraction,
                                                     trainable=self.trainable_steps())  # on the CPU: no syncs
            pairs += self.unit_width * int(step_mask.count_nonzero())  # a CPU tensor: no sync
            for start in range(0, num_units, per_batch):  # a train batch: its chunks' gradients, one optimizer step
                units = order[start : start + per_batch]
                with accelerator.accumulate(self.model):
                    metrics = defaultdict(float)
                    for chunk_pairs in self.chunks(batch, units, step_mask[units],
                                                   at_rollout_weights=optimizer_steps == 0):
                        # gradients are all-reduced once per train batch, at the backward of its last chunk
                        with nullcontext() if chunk_pairs.last else accelerator.no_sync(self.model), \
                                accelerator.autocast():
                            self.chunk_loss(batch, chunk_pairs, metrics)
                    position = f"train batch {start // per_batch} of inner epoch {inner}"
                    grad_norm = self.optimizer_step(metrics, position, optimizer_steps)
                if grad_norm is not None:  # only on optimizer steps
                    sums["grad_norm"] += grad_norm
                    optimizer_steps += 1
                if bool(real[units].any()):  # a train batch of padding units only adds no metrics
                    for key, value in metrics.items():
                        sums[key] += value
                    count += 1
                progress.update(1)
        progress.close()
        self.model.eval()
        out = {key: float(value) / max(count, 1) for key, value in sums.items() if key != "grad_norm"}  # the one sync
        out["grad_norm"] = float(sums["grad_norm"]) / max(optimizer_steps, 1)
        out.update(optimizer_steps=optimizer_steps, pairs_per_forward=chunk, pairs=pairs, **unit_metrics)
        self.end_epoch(out)
        return out

    def optimizer_step(self, metrics: dict, position: str, optimizer_steps: int):
        """After a train batch's backward passes: where the gradients are synced, their norm clipped (returned, read
        at the epoch's end; None elsewhere), the non-finite check (naming ``position``), the optimizer step, the EMA's."""
        grad_norm = None
        if self.accelerator.sync_gradients:
            norm = self.accelerator.clip_grad_norm_(self.params, self.config.train.max_grad_norm)
            grad_norm = norm.detach() if isinstance(norm, torch.Tensor) else norm
        # one host-device sync per train batch, before the optimizer step the losses would feed; with several
        # processes only where the gradients were all-reduced, so all raise at the same step
        # (run/processes/process_failures.py)
        if self.accelerator.sync_gradients or self.accelerator.num_processes == 1:
            check_finite(position, optimizer_steps, policy_loss=metrics.get("policy_loss"),
                         kl_loss=metrics.get("kl_loss"), opd_loss=metrics.get("opd_loss"), grad_norm=grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.accelerator.sync_gradients and self.ema is not None:
            self.ema.step()
        return grad_norm

    def chunks(self, batch, units: torch.Tensor, step_mask: torch.Tensor, pairs_per_forward: int | None = None,
               at_rollout_weights: bool = False) -> list[Chunk]:
        """One train batch's (unit, step) pairs in chunks of ``pairs_per_forward`` (default: ``pairs_per_forward_of``):
        the pairs are ``step_mask``'s [b, T] nonzero entries, ``units`` [b] the train batch's units (its rows, for a sample a
        unit). ``step_mask`` may live on the CPU (the loop's case: the pairs are then found without a device sync)."""
        pair_units, pair_steps = step_mask.cpu().nonzero(as_tuple=True)
        weights = self.pair_weights(step_mask, int(pair_units.numel()))
        if pair_units.numel() == 0:  # no real pair: one zero-weight pair keeps the processes' backward calls in step
            pair_units = pair_steps = torch.zeros(1, dtype=torch.long)
            weights = torch.zeros(1) if isinstance(weights, torch.Tensor) else 0.0
        pair_rows, num_pairs = units.cpu()[pair_units], len(pair_steps)
        size = max(1, (pairs_per_forward or self.pairs_per_forward_of(batch)) // self.unit_width)
        indices = torch.split(torch.arange(num_pairs), size)
        train_batch = (units, step_mask, pair_units, pair_steps, weights)
        chunks = []
        for k, index in enumerate(indices):
            if isinstance(weights, torch.Tensor):
                share, chunk_weights = len(index) / num_pairs, weights[index]
            else:
                share, chunk_weights = len(index) * weights, weights
            chunks.append(Chunk(pair_rows[index], pair_steps[index], chunk_weights, num_pairs, share,
                                at_rollout_weights, k == len(indices) - 1, train_batch))
        return chunks

    def accumulate_gradients(self, batch, units: torch.Tensor, step_mask: torch.Tensor,
                             pairs_per_forward: int | None = None, at_rollout_weights: bool = False) -> dict:
        """Backpropagate one train batch's loss chunk by chunk (``chunks``), as the loop does, without an optimizer
        step (the memory probes, the pre-flight check): the chunks' gradients add up to the whole train batch's;
        memory is one chunk's activations; returns detached metrics."""
        sums = defaultdict(float)
        for chunk in self.chunks(batch, units, step_mask, pairs_per_forward, at_rollout_weights):
            with nullcontext() if chunk.last else self.accelerator.no_sync(self.model), self.accelerator.autocast():
                self.chunk_loss(batch, chunk, sums)
        return dict(sums)


def check_finite(position: str, optimizer_steps: int, **values) -> None:
    """Raise NonFiniteLossError naming the non-finite values and the train batch at ``position`` (before the
    optimizer step). Called once per train batch on its summed losses (and the grad norm): a NaN or inf in any chunk
    makes the sum non-finite, and no weight has changed yet."""
    values = {name: torch.as_tensor(v).detach() for name, v in values.items() if v is not None}
    finite = {name: torch.isfinite(v.float()).all() for name, v in values.items()}
    if not values or bool(torch.stack(list(finite.values())).all()):  # the one sync when all is well
        return
    bad = {name: float(v.float().sum()) for name, v in values.items() if not bool(finite[name])}
    if len(bad) > 1:  # a non-finite loss makes the grad norm non-finite too: name the cause
        bad.pop("grad_norm", None)
    listed = ", ".join(f"{name}={value}" for name, value in bad.items())
    raise NonFiniteLossError(f"non-finite {listed} in {position}", optimizer_steps)
