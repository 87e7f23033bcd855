"""The training phase of a preference objective (algorithms/objectives.py: dpo, dgpo): units of K rows of one prompt
group, all noised at the same time with the same noise, the policy's and the reference's matching errors.

Each epoch the units are (the objective's ``units``):
* "pairs" (dpo): each prompt group's highest- and lowest-advantage rows on this process (``preference_pairs``; a group
  whose advantages are all equal gives none, so equal rewards train nothing), K = 2;
* "groups" (dgpo): every prompt group's rows (``group_rows``: whole groups on this process), K = G.
Each unit gets int(T * train.step_fraction) of the rollout schedule's times, one noise eps shared by its rows:

    e = mean_dims || pred(x_s) - target ||^2   per row, under the policy (gradient) and the reference (no gradient)
    loss = mean over the train batch's (unit, time) pairs of  objective(e [U, K], e_ref [U, K], A [U, K])

The reference is the KL machinery's (kl.use_reference_model: with LoRA the base model). A train batch holds
train.batch_size / K units (about as many samples as a policy-gradient batch); ``train.pairs_per_forward`` / K units
run per forward (a unit's rows in one forward). The loop (inner epochs, gradient accumulation, the non-finite check)
is update/updater.py's, the forward process update/forward_process.py's (shared with the matching
objectives).

Several processes: each holds whole prompt groups (the rollouts sample them so: PromptSampler.sample_epoch's
``whole_groups``), so each forms its own units. Their counts can differ (dpo: a group whose advantages are all equal
gives no pair), and DDP needs the same optimizer steps on every process: each process pads its units to the most any
process holds (``pad_units``; one gather of the counts per epoch), placed after its real ones. A padding unit takes no
part in the loss or the metrics (update/updater.py: a train batch of padding units only runs one zero-weight pair).
Each process's loss is the mean over its real (unit, time) pairs of the train batch; DDP averages the processes'
gradients.
"""

from __future__ import annotations

import torch

from ddpo_group.algorithms import get_objective
from ddpo_group.algorithms.objectives import group_rows, preference_pairs
from ddpo_group.distributed import check_peers
from ddpo_group.errors import ConfigError
from ddpo_group.update.forward_process import ForwardProcess
from ddpo_group.update.updater import Chunk, UpdateOptions, Updater, fold_metrics


class PreferenceUpdater(Updater):
    """``train.num_inner_epochs`` passes of a preference objective over an epoch's units (module docstring)."""

    unit_width = 2  # batch rows per unit: a pair's (dpo); a prompt group's (dgpo: set from train.group_size)

    def __init__(self, options: UpdateOptions):
        config = options.config
        if options.kl is None:
            raise ConfigError(f"algorithm.objective={config.algorithm.objective!r} compares the policy with a reference "
                              "model: set kl.use_reference_model=True (kl.beta may stay 0)")
        self.objective = get_objective(config.algorithm.objective)
        self.forward = ForwardProcess(config, options.scorer.family, self.objective)
        super().__init__(options)
        kwargs = config.algorithm.objective_kwargs
        self.objective_kwargs = kwargs.to_dict() if hasattr(kwargs, "to_dict") else dict(kwargs or {})
        self.unit_width = 2 if self.objective.units == "pairs" else config.train.group_size
        self.units = torch.zeros(0, self.unit_width, dtype=torch.long)  # [U, K] this epoch's units, padding last

    @property
    def uses_reference(self) -> bool:
        return True

    def trainable_steps(self) -> torch.Tensor:
        return self.forward.every_step()

    def make_units(self, batch) -> torch.Tensor:
        """[U, K] rows of this epoch's units (module docstring), on the CPU."""
        row_mask = batch.row_mask.cpu() if batch.row_mask is not None else None
        groups = batch.group_index.cpu()
        if self.objective.units == "groups":
            return group_rows(groups, row_mask)
        return preference_pairs(groups, batch.advantages[:, 0].cpu(), row_mask)

    def epoch_units(self, batch) -> tuple[torch.Tensor, dict]:
        """This epoch's units (``make_units``), padded to the most any process holds (module docstring): [U] bool,
        True for the real ones, and ``preference_units``: the real units of every process together."""
        units = self.make_units(batch)
        counts = torch.tensor([len(units)])
        if self.accelerator.num_processes > 1:  # one gather per epoch
            check_peers(self.accelerator)
            counts = self.accelerator.gather(counts.to(self.accelerator.device)).cpu()
        self.units, real = pad_units(units, int(counts.max()), self.unit_width)
        return real, {"preference_units": int(counts.sum())}

    def chunk_loss(self, batch, chunk: Chunk, sums: dict) -> None:
        """One forward chunk of (unit, time) pairs: each unit's K rows noised at its time with one noise, the
        policy's and the reference's errors, the objective; every pair weighs ``chunk.weights``."""
        forward = self.forward
        # the memory probe (update/memory_fit.py) passes sample rows, which wrap around this epoch's units so that it
        # measures their forwards
        units = self.units[chunk.units % max(len(self.units), 1)].to(self.accelerator.device)  # [u, K] batch rows
        n = chunk.steps.to(self.accelerator.device)
        u, width = units.shape
        r = units.reshape(-1)  # unit by unit, its rows together
        first = forward.train_times(batch, units[:, 0], n)  # one time per unit
        times = {key: value.repeat_interleave(width) for key, value in first.items()}
        noise = torch.randn_like(batch.next_latents[units[:, 0], -1].float()).repeat_interleave(width, dim=0)
        x_s, target, _ = forward.noised(batch, r, times, noise)
        unwrapped = self.accelerator.unwrap_model(self.model)
        with self.kl.timer.phase("reference"), torch.no_grad(), self.kl.reference.applied(unwrapped) as reference:
            ref_error = self.errors(forward.velocity(reference, batch, r, times, x_s), target).view(u, width)
        error = self.errors(forward.velocity(self.model, batch, r, times, x_s), target).view(u, width)
        advantages = batch.advantages[r, 0].float().view(u, width)
        losses, info = self.objective(error, ref_error, advantages, **self.objective_kwargs)
        policy_loss = chunk.weights * losses.sum()
        self.accelerator.backward(policy_loss)
        sums["policy_loss"] += policy_loss.detach()
        fold_metrics(sums, info, chunk.share)

    @staticmethod
    def errors(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (pred.float() - target.float()).pow(2).flatten(1).mean(dim=1)


def pad_units(units: torch.Tensor, count: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``units`` [U, width] followed by ``count - U`` padding units (rows 0..width-1 of the batch record: any rows,
    they take no part in the loss), and [count] bool, True for the real units."""
    if count < len(units) or (len(units) and units.shape[1] != width):
        raise ValueError(f"pad_units: {len(units)} units of width {units.shape[1]} cannot be padded to {count} units "
                         f"of width {width}")
    padding = torch.arange(width, dtype=torch.long).expand(count - len(units), width)
    return torch.cat([units.reshape(-1, width), padding]), torch.arange(count) < len(units)
