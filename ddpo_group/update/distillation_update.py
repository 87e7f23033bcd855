"""On-policy distillation's update (``algorithm.objective="opd"``): the student's own recorded steps, scored by its
frozen teachers (reference/teachers.py), in the policy-gradient update's loop and chunks. For one chunk of N pairs
(rows r, steps n; w the pairs' aggregation weights of algorithm.loss_agg_mode):

    1. mu_student = the student's step mean [N, ...] at each recorded state x_n (the training forward, with gradient;
                    the policy update's chunk_loss, which adds the loss below as its ``added_loss``)
    2. mu_teacher = each row's teacher's step mean at the same x_n, its own forward (no gradient); KL_n the
                    closed-form KL of the two step Gaussians (algorithms/objectives.py's ``opd_kl``), the mean over
                    the row's teachers when no route picks one
    3. loss       = opd.beta * sum w KL_n
                  + opd.reward_weight * the policy loss on the reward's advantages (mixed mode; 0: distillation alone)
                  + beta * sum w KL(student step || reference step) when the KL term has weight (kl.beta)
    4. backward

Metrics: ``opd_kl`` (the mean KL_n over the trained pairs), ``opd_kl_<teacher>`` (each teacher's, over the pairs it
scored), ``opd_loss`` (sum w KL_n), and the policy-gradient update's (the on-policy measures, ``policy_kl``; with a
reward weight, the policy loss's).
"""

from __future__ import annotations

import torch

from ddpo_group.update.policy_update import PolicyUpdater
from ddpo_group.update.updater import Chunk, UpdateOptions

TEACHER_SUM, TEACHER_PAIRS = "opd_teacher_sum/", "opd_teacher_pairs/"


class DistillationUpdater(PolicyUpdater):
    """The opd update (module docstring)."""

    def __init__(self, options: UpdateOptions):
        super().__init__(options)
        self.teachers = options.teachers
        self.beta = float(options.config.opd.beta)
        self.policy_weight = float(options.config.opd.reward_weight)

    def added_loss(self, batch, chunk: Chunk, r, n, out, w, sums: dict) -> torch.Tensor:
        """Steps 2 and 3's first term (module docstring): opd.beta * sum w KL_n; the policy update adds the rest."""
        metadata = [batch.metadata[i] for i in chunk.units.tolist()]  # the CPU's rows: no sync
        kl, per_teacher = self.teachers.step_kl(
            out, lambda module, index: self.scorer(module, batch, r[index], n[index]), metadata,
            self.accelerator.unwrap_model(self.model))
        opd_loss = (w * kl).sum()
        sums["opd_loss"] += opd_loss.detach()
        sums["opd_kl"] += kl.detach().sum() / chunk.num_pairs
        for name, (kl_sum, pairs) in per_teacher.items():
            sums[TEACHER_SUM + name] += kl_sum
            sums[TEACHER_PAIRS + name] += pairs
        return self.beta * opd_loss

    def end_epoch(self, metrics: dict) -> None:
        """Each teacher's mean KL over the pairs it scored (``opd_kl_<teacher>``), then the policy update's."""
        for name in self.teachers.names:
            kl_sum, pairs = metrics.pop(TEACHER_SUM + name, 0.0), metrics.pop(TEACHER_PAIRS + name, 0.0)
            if pairs:
                metrics[f"opd_kl_{name}"] = kl_sum / pairs
        super().end_epoch(metrics)
