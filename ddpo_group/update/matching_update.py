"""The training phase of a matching objective (algorithms/objectives.py: awm, nft, sft): the forward process on the rollout's
final samples, a weighted matching loss.

For each train batch, every sample i gets int(T * train.step_fraction) of the rollout schedule's times s_{i,n}
(drawn without replacement from all T steps, DiffusionNFT's time sampling: its training times are the sampler's
discretisation times; ``algorithm.objective_times`` "uniform" / "logit_normal" draws as many fresh times), and each
(sample, time) pair fresh noise eps. For one chunk of pairs:

    1. x_s, u   = the forward process of the samples' final latents x_clean at their times (update/forward_process.py)
    2. v_old    = the old model's output at x_s, for an objective that needs one (update/old_model.py: it is mixed
                  toward the policy after every epoch)
    3. v_theta  = the denoiser's output at x_s under the training guidance (``train.cfg``)
    4. loss     = sum over the pairs of w objective(v_theta, u, A_i, s, v_old),   w = 1 / the train batch's pairs
    5. loss    += beta sum g w mean (v_theta - v_ref)^2   with the KL in the loss (kl.beta > 0, kl.use_reference_model;
                  g the row's prompt gate under kl.only_below_start, else 1)
    6. backward (memory: one chunk's activations), in the policy-gradient update's loop (update/updater.py)

An objective runs only on the forward processes it registers.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import ml_collections
import torch

from ddpo_group.algorithms import get_objective
from ddpo_group.update.forward_process import ForwardProcess
from ddpo_group.update.updater import Chunk, UpdateOptions, Updater, fold_metrics


class MatchingUpdater(Updater):
    """``train.num_inner_epochs`` passes of a matching objective (``algorithm.objective``, an ObjectiveSpec of kind
    "matching") over an epoch's final samples (module docstring). The options' ``old`` (update/old_model.OldModel) when
    the objective needs an old model; their ``step_count()``: the optimizer steps taken before this epoch (the old
    model's decay schedule reads it)."""

    def __init__(self, options: UpdateOptions):
        config = options.config
        objective = get_objective(config.algorithm.objective)
        self.forward = ForwardProcess(config, options.scorer.family, objective)
        kwargs = config.algorithm.objective_kwargs
        if objective.uses_old_model(kwargs) and options.old is None:
            raise ValueError(f"objective {objective.name!r} with algorithm.objective_kwargs={dict(kwargs)} needs an old "
                             "model")
        super().__init__(options)
        self.objective, self.old = objective, options.old
        self.objective_kwargs = kwargs.to_dict() if hasattr(kwargs, "to_dict") else dict(kwargs or {})
        self.step_count = options.step_count

    @classmethod
    def supervised(cls, options: UpdateOptions) -> "MatchingUpdater":
        """The ``sft`` objective's update keeping every row (min_advantage 0 below the records' advantage 1), whatever
        the run's objective: the supervised epochs' on a folder of images (rollout/image_folder.py)."""
        config = options.config.copy_and_resolve_references()
        config.algorithm.objective = "sft"
        config.algorithm.objective_kwargs = ml_collections.ConfigDict({"min_advantage": 0.0})
        return cls(replace(options, config=config, old=None))

    def trainable_steps(self) -> torch.Tensor:
        return self.forward.every_step()

    def rollout_policy(self, policy):
        """The old model's weights for an objective that samples with it (DiffusionNFT samples with v_old), the
        policy's (``policy``) otherwise."""
        if self.old is None or not self.objective.needs_old_model:  # awm's old model only regularises
            return nullcontext(policy)
        return self.old.applied(self.accelerator.unwrap_model(self.model))

    def end_epoch(self, metrics: dict) -> None:
        """The old model's update after the epoch's optimizer steps, and its metrics."""
        if self.old is not None:
            unwrapped = self.accelerator.unwrap_model(self.model)
            self.old.update(unwrapped, self.step_count() + metrics["optimizer_steps"])
            metrics.update(self.old.metrics(unwrapped))

    def chunk_loss(self, batch, chunk: Chunk, sums: dict) -> None:
        """Steps 1-6 of the module docstring on one chunk."""
        device, forward = self.accelerator.device, self.forward
        r, n, weight = chunk.units.to(device, non_blocking=True), chunk.steps.to(device, non_blocking=True), chunk.weights
        times = forward.train_times(batch, r, n)
        x_s, target, sigma = forward.noised(batch, r, times, torch.randn_like(batch.next_latents[r, -1].float()))  # 1.
        unwrapped = self.accelerator.unwrap_model(self.model)
        old_pred = None
        if self.old is not None:  # 2.
            with torch.no_grad(), self.old.applied(unwrapped) as old_model:
                old_pred = forward.velocity(old_model, batch, r, times, x_s)
        pred = forward.velocity(self.model, batch, r, times, x_s)  # 3.
        losses, info = self.objective(pred, target, batch.advantages[r, 0].float(), sigma, old_pred=old_pred,  # 4.
                                      adv_clip_max=float(self.config.train.adv_clip_max), **self.objective_kwargs)
        policy_loss = weight * losses.sum()
        loss = policy_loss
        if self.uses_reference:  # 5.
            with self.kl.timer.phase("reference"), torch.no_grad(), self.kl.reference.applied(unwrapped) as ref:
                ref_pred = forward.velocity(ref, batch, r, times, x_s)
            kl = (pred.float() - ref_pred.float()).pow(2).flatten(1).mean(dim=1)
            loss = loss + self.kl.loss_term(kl, batch.kl_pair_weights(weight, r), chunk.num_pairs, sums)
        self.accelerator.backward(loss)  # 6.
        sums["policy_loss"] += policy_loss.detach()
        fold_metrics(sums, info, chunk.share)
