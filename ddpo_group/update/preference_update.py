"""The training phase of a preference objective (algorithms/objectives.py: dpo, dgpo): units of K rows of one prompt
group, all noised at the same time with the same noise, the policy's and the reference's matching errors.

Each epoch the units are (the objective's ``units``):
* "pairs" (dpo): each prompt group's highest- and lowest-advantage rows on this process (``preference_pairs``; a group
  whose advantages are all equal gives none, so equal rewards train nothing), K = 2;
* "groups" (dgpo): every prompt group's rows (``group_rows``: whole groups on this process), K = G.
Each unit gets int(T * train.timestep_fraction) of the rollout schedule's times, one noise eps shared by its rows:

    e = mean_dims || pred(x_s) - target ||^2   per row, under the policy (gradient) and the reference (no gradient)
    loss = mean over the train batch's (unit, time) pairs of  objective(e [U, K], e_ref [U, K], A [U, K])

The reference is the KL machinery's (kl.use_reference_model: with LoRA the base model). A train batch holds
train.batch_size / K units (about as many samples as a policy-gradient batch); ``train.pairs_per_forward`` / K units
run per forward (a unit's rows in one forward). The loop (inner epochs, gradient accumulation, the non-finite check)
is the policy update's.

Several processes: each holds whole prompt groups (the rollouts sample them so: PromptSampler.sample_epoch's
``whole_groups``), so each forms its own units. Their counts can differ (dpo: a group whose advantages are all equal
gives no pair), and DDP needs the same forward/backward calls on every process: each process pads its units to the
most any process holds (``pad_units``; one gather of the counts per epoch) with units of weight 0, placed after its
real ones. A padded unit runs its forwards and backward, and adds nothing to the loss or the metrics. Each process's
loss is the mean over its real (unit, time) pairs of the train batch; DDP averages the processes' gradients.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext

import torch
from tqdm.auto import tqdm

from ddpo_group.algorithms.objectives import group_rows, preference_pairs
from ddpo_group.distributed import check_peers
from ddpo_group.errors import ConfigError
from ddpo_group.update.matching_update import MatchingUpdater
from ddpo_group.update.policy_update import random_step_mask


class PreferenceUpdater(MatchingUpdater):
    """``train.num_inner_epochs`` passes of a preference objective over an epoch's units (module docstring)."""

    def __init__(self, config, accelerator, model, optimizer, trainable_params, family, objective, kl=None, **kwargs):
        if kl is None:
            raise ConfigError(f"algorithm.objective={objective.name!r} compares the policy with a reference model: set "
                              "kl.use_reference_model=True (kl.beta may stay 0)")
        super().__init__(config, accelerator, model, optimizer, trainable_params, family, objective, kl=kl, **kwargs)
        self.units = torch.zeros(0, 2, dtype=torch.long)  # [U, K] this epoch's units, padded ones last
        self.real = torch.zeros(0, dtype=torch.bool)  # [U] which of them are real (not padding)

    def make_units(self, batch: dict) -> torch.Tensor:
        """[U, K] rows of this epoch's units (module docstring), on the CPU."""
        row_mask = batch["row_mask"].cpu() if "row_mask" in batch else None
        groups = batch["group_index"].cpu()
        if self.objective.units == "groups":
            return group_rows(groups, row_mask)
        return preference_pairs(groups, batch["advantages"][:, 0].cpu(), row_mask)

    def prepare_units(self, batch: dict) -> int:
        """Set this epoch's units (``make_units``), padded to the most any process holds (module docstring);
        returns the real units of every process together."""
        units = self.make_units(batch)
        counts = torch.tensor([len(units)])
        if self.accelerator.num_processes > 1:  # one gather per epoch
            check_peers(self.accelerator)
            counts = self.accelerator.gather(counts.to(self.accelerator.device)).cpu()
        width = 2 if self.objective.units == "pairs" else self.config.train.group_size
        self.units, self.real = pad_units(units, int(counts.max()), width)
        return int(counts.sum())

    def train_epoch(self, batch: dict, show_progress: bool = True) -> dict:
        """Update the policy on this epoch's units; returns averaged metrics, the optimizer steps, ``pairs`` (this
        process's (sample, time) pairs trained: K per real unit and time; the trainer sums them over the processes)
        and ``preference_units`` (the real units of every process together)."""
        t = self.config.train
        total_units = self.prepare_units(batch)
        num_units, num_real, num_steps = len(self.units), int(self.real.sum()), self.config.sample.num_steps
        width = max(self.units.shape[1], 1)
        self.scorer.prepare(num_steps, self.accelerator.device)
        self.model.train()
        chunk = self.chunk_size(batch) if num_units else None  # "auto" probes with this epoch's units
        per_batch = max(1, t.batch_size // width)
        sums, count, optimizer_steps, trained = defaultdict(float), 0, 0, 0
        progress = tqdm(total=t.num_inner_epochs * -(-num_units // per_batch), desc="training",
                        disable=not show_progress, leave=False)
        for inner in range(t.num_inner_epochs):
            # the real units shuffled, the padded ones after them
            perm = torch.cat([torch.randperm(num_real), torch.arange(num_real, num_units)])
            step_mask = random_step_mask(num_units, num_steps, t.timestep_fraction, trainable=self.trainable_steps())
            trained += width * int(step_mask[:num_real].count_nonzero())
            for start in range(0, num_units, per_batch):
                rows = perm[start : start + per_batch]
                self._position = (inner, start // per_batch, optimizer_steps)
                metrics = self._train_batch(batch, rows, step_mask[rows])
                grad_norm = metrics.pop("grad_norm", None)
                if grad_norm is not None:
                    sums["grad_norm"] += grad_norm
                    optimizer_steps += 1
                if bool(self.real[rows].any()):  # a batch of padded units only adds no metrics
                    for key, value in metrics.items():
                        sums[key] += value
                    count += 1
                progress.update(1)
        progress.close()
        self.model.eval()
        out = {key: float(value) / max(count, 1) for key, value in sums.items() if key != "grad_norm"}
        out["grad_norm"] = float(sums["grad_norm"]) / max(optimizer_steps, 1)
        out.update(optimizer_steps=optimizer_steps, pairs_per_forward=chunk, pairs=trained,
                   preference_units=total_units)
        return out

    def accumulate_gradients(self, batch: dict, rows: torch.Tensor, step_mask: torch.Tensor,
                             pairs_per_forward: int | None = None) -> dict:
        """Backpropagate one train batch of units (``rows``: indices into this epoch's units, ``step_mask`` [b, T]
        their times), chunk by chunk; every real (unit, time) pair weighs 1 / (the batch's real (unit, time) pairs),
        a padded one 0."""
        device = batch["advantages"].device
        unit_index, unit_steps = step_mask.nonzero(as_tuple=True)
        # ``rows`` on the CPU (the trainer's loop) costs no sync; the memory probe (update/memory_fit.py) passes sample
        # rows, which wrap around this epoch's units so that it measures their forwards
        index = rows.cpu()[unit_index] % max(len(self.units), 1)
        real = self.real[index]
        weight = 1.0 / max(int(real.sum()), 1)
        units = self.units[index].to(device)  # [pairs, K] rows of the batch record
        unit_steps = unit_steps.to(device)
        size = max(1, (pairs_per_forward or self.chunk_size(batch)) // max(units.shape[1], 1))
        chunks = torch.split(torch.arange(len(units)), size)
        sums = defaultdict(float)
        for k, chunk in enumerate(chunks):
            sync = nullcontext() if k == len(chunks) - 1 else self.accelerator.no_sync(self.model)
            with sync, self.accelerator.autocast():
                self._backward_units(batch, units[chunk], unit_steps[chunk], real[chunk], weight, sums)
        return dict(sums)

    def _backward_units(self, batch, units: torch.Tensor, n: torch.Tensor, real: torch.Tensor, weight: float,
                        sums) -> None:
        """One forward chunk: ``real`` [u] (on the CPU) marks its real units; each weighs ``weight`` per time."""
        u, width = units.shape
        r = units.reshape(-1)  # unit by unit, its rows together
        first = self.train_step(batch, units[:, 0], n)  # one time per unit
        step = {key: value.repeat_interleave(width) for key, value in first.items()}
        noise = torch.randn_like(batch["next_latents"][units[:, 0], -1].float()).repeat_interleave(width, dim=0)
        x_s, target, _ = self.noised(batch, r, step, noise)
        unwrapped = self.accelerator.unwrap_model(self.model)
        with self.kl.timer.phase("reference"), torch.no_grad(), self.kl.reference.applied(unwrapped) as reference:
            ref_error = self.errors(self.velocity(reference, batch, r, step, x_s), target).view(u, width)
        error = self.errors(self.velocity(self.model, batch, r, step, x_s), target).view(u, width)
        advantages = batch["advantages"][r, 0].float().view(u, width)
        num_real, policy_loss = int(real.sum()), 0.0
        if num_real < u:  # padded units: in the graph (DDP's backward) with weight 0, out of the loss and the metrics
            policy_loss = 0.0 * error[torch.nonzero(~real).flatten().to(error.device)].sum()
            keep = torch.nonzero(real).flatten().to(error.device)
            error, ref_error, advantages = error[keep], ref_error[keep], advantages[keep]
        if num_real:
            losses, info = self.objective(error, ref_error, advantages, **self.objective_kwargs)
            policy_loss = policy_loss + weight * losses.sum()
            for key, value in info.items():
                sums[key] += num_real * weight * (value.detach() if isinstance(value, torch.Tensor) else value)
        self.accelerator.backward(policy_loss)
        sums["policy_loss"] += policy_loss.detach()

    @staticmethod
    def errors(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (pred.float() - target.float()).pow(2).flatten(1).mean(dim=1)


def pad_units(units: torch.Tensor, count: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``units`` [U, width] followed by ``count - U`` padded units (rows 0..width-1 of the batch record: any real rows,
    they only run forwards), and [count] bool, True for the real units."""
    if count < len(units) or (len(units) and units.shape[1] != width):
        raise ValueError(f"pad_units: {len(units)} units of width {units.shape[1]} cannot be padded to {count} units "
                         f"of width {width}")
    padding = torch.arange(width, dtype=torch.long).expand(count - len(units), width)
    return torch.cat([units.reshape(-1, width), padding]), torch.arange(count) < len(units)
