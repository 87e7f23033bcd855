"""The training phase of a matching objective (algorithms/objectives.py: awm, nft): the forward process on the rollout's
final samples, a weighted matching loss.

For each train batch, every sample i gets int(T * train.timestep_fraction) of the rollout schedule's times s_{i,n}
(drawn without replacement from all T steps, DiffusionNFT's time sampling: its training times are the sampler's
discretisation times; ``algorithm.objective_times`` "uniform" / "logit_normal" draws as many fresh times, shifted by
``algorithm.objective_time_shift``), and each (sample, time) pair fresh noise eps:

    x0 = the sample's final latent,   x_s = (1 - s) x0 + s eps,   u = eps - x0
    loss = mean over the batch's pairs of  objective(v_theta(x_s, s, c), u, A_i, s, v_old)
           [+ beta mean (v_theta - v_ref)^2]

with v_theta the denoiser's velocity under the training guidance (``train.cfg``), A_i the sample's advantage, v_old the
old model's velocity for an objective that needs it (update/old_model.py; it is mixed toward the policy after every
epoch) and v_ref the KL reference's (``kl.beta`` > 0 with ``kl.use_reference_model``). The pairs run
``train.pairs_per_forward`` at a time and each chunk is backpropagated at once (memory: one chunk's activations), as
in the policy-gradient update, whose loop (inner epochs, train batches, the non-finite check, gradient accumulation)
this one shares.

The forward process is the family's: ``flow`` for the flow-matching families (their steps record sigmas), ``ddpm`` for
the DDPM / DDIM families (x_t = sqrt(ab_t) x0 + sqrt(1 - ab_t) eps at the rollout's timesteps t, the target of the
scheduler's prediction_type; algorithms/objectives.py). An objective runs only on the processes it registers.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from ddpo_group.algorithms import get_objective
from ddpo_group.algorithms.objectives import ddpm_forward, draw_times, flow_forward
from ddpo_group.errors import ConfigError
from ddpo_group.update.updater import Chunk, Updater


def forward_process(family) -> str:
    """The family's forward process: "flow" when its steps record sigmas, "ddpm" when its scheduler has
    alphas_cumprod."""
    if "sigmas" in family.step_keys:
        return "flow"
    if hasattr(family.pipe.scheduler, "alphas_cumprod"):
        return "ddpm"
    raise ConfigError(f"the {family.name!r} family has neither flow sigmas nor DDPM alphas_cumprod: no forward process "
                      "for a matching objective")


class MatchingUpdater(Updater):
    """``train.num_inner_epochs`` passes of a matching objective (``algorithm.objective``, an ObjectiveSpec of kind
    "matching") over an epoch's final samples (module docstring). ``old`` (update/old_model.OldModel) when the
    objective needs an old model; ``step_count()``: the optimizer steps taken before this epoch (the old model's decay
    schedule reads it)."""

    def __init__(self, config, accelerator, model, optimizer, trainable_params, scorer, kl=None, pairs_per_forward=None,
                 after_optimizer_step=None, old=None, step_count=lambda: 0):
        family, objective = scorer.family, get_objective(config.algorithm.objective)
        self.process = forward_process(family)
        if self.process not in objective.processes:
            raise ConfigError(f"algorithm.objective={objective.name!r} is defined on the {objective.processes} forward "
                              f"process(es); the {family.name!r} family's is {self.process!r}: use a flow-matching "
                              "model (sd3, flux, zimage, tiny-shapes-flow), another objective (awm runs on both) or "
                              "algorithm.objective='policy_gradient'")
        if family.frozen_steps:
            raise ConfigError(f"algorithm.objective={objective.name!r} trains at any time of the forward process; this "
                              f"{family.name!r} model runs some steps with a frozen module (Wan2.2-A14B's low-noise "
                              "expert), which the objective cannot train: use algorithm.objective='policy_gradient' "
                              "(it trains the high-noise expert's steps) or a one-expert model")
        kwargs = config.algorithm.objective_kwargs
        if objective.uses_old_model(kwargs) and old is None:
            raise ValueError(f"objective {objective.name!r} with algorithm.objective_kwargs={dict(kwargs)} needs an old "
                             "model")
        super().__init__(config, accelerator, model, optimizer, trainable_params, scorer, kl, pairs_per_forward,
                         after_optimizer_step)
        self.family, self.objective, self.old = family, objective, old
        self.objective_kwargs = kwargs.to_dict() if hasattr(kwargs, "to_dict") else dict(kwargs or {})
        self.guidance_scale = family.training_guidance(config)
        self.step_count = step_count

    def trainable_steps(self) -> torch.Tensor:
        """Every step of the rollout schedule: a matching objective draws its times among all of them."""
        return torch.ones(self.config.sample.num_steps, dtype=torch.bool)

    def rollout_policy(self):
        """Context in which the rollouts are sampled: the old model's weights for an objective that has one
        (DiffusionNFT samples with v_old), the policy's otherwise."""
        if self.old is None or not self.objective.needs_old_model:  # awm's old model only regularises
            return nullcontext()
        return self.old.applied(self.accelerator.unwrap_model(self.model))

    def train_epoch(self, batch, show_progress: bool = True) -> dict:
        """The update loop on this objective's loss, then the old model's update."""
        out = super().train_epoch(batch, show_progress)
        if self.old is not None:
            unwrapped = self.accelerator.unwrap_model(self.model)
            self.old.update(unwrapped, self.step_count() + out["optimizer_steps"])
            out.update(self.old.metrics(unwrapped))
        return out

    def noised(self, batch, r: torch.Tensor, step: dict, noise: torch.Tensor):
        """(x_s, target, sigma) of rows ``r``'s final latents at their ``step``, with ``noise``: the family's forward
        process (module docstring); x_s in the condition's dtype."""
        x0 = batch.next_latents[r, -1].float()  # the rollout's final latents
        if self.process == "flow":
            sigma = step["sigmas"].float()
            x_s, target = flow_forward(x0, noise, sigma)
        else:
            scheduler = self.family.pipe.scheduler
            alpha_bar = scheduler.alphas_cumprod.to(x0.device, torch.float32)[step["timesteps"].long()]
            x_s, target = ddpm_forward(x0, noise, alpha_bar, scheduler.config.prediction_type)
            sigma = (1 - alpha_bar).sqrt()
        return x_s.to(batch.cond[self.family.cond_keys[0]].dtype), target, sigma

    def train_step(self, batch, r: torch.Tensor, n: torch.Tensor) -> dict:
        """The step tensors the forward process and the denoiser read for rows ``r``: the rollout schedule's at steps
        ``n`` (``algorithm.objective_times="schedule"``), or drawn times s (flow: sigmas s, timesteps 1000 s; DDPM: the
        timestep nearest to 1000 s)."""
        step = {key: batch.steps[key][r, n] for key in self.family.step_keys}
        a = self.config.algorithm
        if a.objective_times == "schedule":
            return step
        s = draw_times(len(r), a.objective_times, float(a.objective_time_shift), device=r.device)
        scale = int(self.family.pipe.scheduler.config.num_train_timesteps)
        if self.process == "flow":
            step.update(sigmas=s, next_sigmas=torch.zeros_like(s))
            step["timesteps"] = (s * scale).to(step["timesteps"].dtype)
        else:
            step["timesteps"] = (s * scale).long().clamp(0, scale - 1).to(step["timesteps"].dtype)
        return step

    def velocity(self, model, batch, r: torch.Tensor, step: dict, x_s: torch.Tensor) -> torch.Tensor:
        """The denoiser's output (velocity, eps, v or x0) on x_s for rows ``r``, under the training guidance."""
        cond = {key: batch.cond[key][r] for key in self.family.cond_keys}
        negative = batch.negative_rows(self.family, r)  # each row's own when the record has them
        return self.family.model_output(model, x_s, step, cond, negative, self.guidance_scale)

    def chunk_loss(self, batch, chunk: Chunk, sums: dict) -> None:
        """The chunk's matching loss: every pair weighs ``chunk.weights`` (1 / the train batch's pairs), plus the KL
        term beta mean (v_theta - v_ref)^2 with the KL in the loss; backpropagated now."""
        device = self.accelerator.device
        r, n, weight = chunk.units.to(device, non_blocking=True), chunk.steps.to(device, non_blocking=True), chunk.weights
        step = self.train_step(batch, r, n)
        x_s, target, sigma = self.noised(batch, r, step, torch.randn_like(batch.next_latents[r, -1].float()))
        unwrapped = self.accelerator.unwrap_model(self.model)
        old_pred = None
        if self.old is not None:
            with torch.no_grad(), self.old.applied(unwrapped) as old_model:
                old_pred = self.velocity(old_model, batch, r, step, x_s)
        pred = self.velocity(self.model, batch, r, step, x_s)
        losses, info = self.objective(pred, target, batch.advantages[r, 0].float(), sigma, old_pred=old_pred,
                                      adv_clip_max=float(self.config.train.adv_clip_max), **self.objective_kwargs)
        policy_loss = weight * losses.sum()
        loss = policy_loss
        if self.uses_reference:
            with self.kl.timer.phase("reference"), torch.no_grad(), self.kl.reference.applied(unwrapped) as ref:
                ref_pred = self.velocity(ref, batch, r, step, x_s)
            kl = (pred.float() - ref_pred.float()).pow(2).flatten(1).mean(dim=1)
            kl_loss = weight * kl.sum()
            loss = loss + self.kl.beta * kl_loss
            sums["kl_loss"] += kl_loss.detach()
            sums["kl"] += kl_loss.detach()
        self.accelerator.backward(loss)
        sums["policy_loss"] += policy_loss.detach()
        for key, value in info.items():
            sums[key] += chunk.share * (value.detach() if isinstance(value, torch.Tensor) else value)
