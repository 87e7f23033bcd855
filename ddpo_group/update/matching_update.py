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

from collections import defaultdict
from contextlib import nullcontext

import torch

from ddpo_group.algorithms.objectives import ddpm_forward, draw_times, flow_forward
from ddpo_group.errors import ConfigError
from ddpo_group.sampling.trajectories import recorded_negative
from ddpo_group.update.policy_update import PolicyUpdater


def forward_process(family) -> str:
    """The family's forward process: "flow" when its steps record sigmas, "ddpm" when its scheduler has
    alphas_cumprod."""
    if "sigmas" in family.step_keys:
        return "flow"
    if hasattr(family.pipe.scheduler, "alphas_cumprod"):
        return "ddpm"
    raise ConfigError(f"the {family.name!r} family has neither flow sigmas nor DDPM alphas_cumprod: no forward process "
                      "for a matching objective")


class MatchingUpdater(PolicyUpdater):
    """``train.num_inner_epochs`` passes of a matching objective over an epoch's final samples (module docstring).

    ``objective``: an ObjectiveSpec of kind "matching"; ``old`` (update/old_model.OldModel) when it needs one;
    ``step_count()``: the optimizer steps taken before this epoch (the old model's decay schedule reads it).
    """

    def __init__(self, config, accelerator, model, optimizer, trainable_params, family, objective, kl=None, old=None,
                 pairs_per_forward=None, after_optimizer_step=None, step_count=lambda: 0, scorer=None):
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
        super().__init__(config, accelerator, model, optimizer, trainable_params, scorer, kl=kl,
                         pairs_per_forward=pairs_per_forward, after_optimizer_step=after_optimizer_step)
        self.family, self.objective, self.old = family, objective, old
        kwargs = config.algorithm.objective_kwargs
        self.objective_kwargs = kwargs.to_dict() if hasattr(kwargs, "to_dict") else dict(kwargs or {})
        self.guidance_scale = family.training_guidance(config)
        self.step_count = step_count

    @property
    def uses_reference(self) -> bool:
        return self.kl is not None and self.kl.beta > 0

    def trainable_steps(self) -> torch.Tensor:
        """Every step of the rollout schedule: a matching objective draws its times among all of them."""
        return torch.ones(self.config.sample.num_steps, dtype=torch.bool)

    def rollout_policy(self):
        """Context in which the rollouts are sampled: the old model's weights for an objective that has one
        (DiffusionNFT samples with v_old), the policy's otherwise."""
        if self.old is None or not self.objective.needs_old_model:  # awm's old model only regularises
            return nullcontext()
        return self.old.applied(self.accelerator.unwrap_model(self.model))

    def train_epoch(self, batch: dict, show_progress: bool = True) -> dict:
        """The policy update (PolicyUpdater.train_epoch's loop on this objective's loss), then the old model's
        update."""
        out = super().train_epoch(batch, show_progress)
        if self.old is not None:
            unwrapped = self.accelerator.unwrap_model(self.model)
            self.old.update(unwrapped, self.step_count() + out["optimizer_steps"])
            out.update(self.old.metrics(unwrapped))
        return out

    def accumulate_gradients(self, batch: dict, rows: torch.Tensor, step_mask: torch.Tensor,
                             pairs_per_forward: int | None = None) -> dict:
        """Backpropagate one train batch's matching loss (module docstring), chunk by chunk of (sample, time) pairs:
        every pair weighs 1 / (the batch's pairs). Returns detached metrics."""
        device = rows.device
        pair_rows, pair_steps = step_mask.nonzero(as_tuple=True)
        weight = 1.0 / max(int(pair_rows.numel()), 1)
        if pair_rows.numel() == 0:  # every row padded: one zero-weight pair keeps the processes' backward calls in step
            pair_rows = pair_steps = torch.zeros(1, dtype=torch.long, device=step_mask.device)
            weight = 0.0
        pair_rows, pair_steps = pair_rows.to(device, non_blocking=True), pair_steps.to(device, non_blocking=True)
        size = pairs_per_forward or self.chunk_size(batch)
        chunks = torch.split(torch.arange(pair_rows.numel(), device=device), size)
        sums = defaultdict(float)
        for k, chunk in enumerate(chunks):
            r, n = rows[pair_rows[chunk]], pair_steps[chunk]
            sync = nullcontext() if k == len(chunks) - 1 else self.accelerator.no_sync(self.model)
            with sync, self.accelerator.autocast():
                self._backward_pairs(batch, r, n, weight, len(chunk) * weight, sums)
        return dict(sums)

    def noised(self, batch: dict, r: torch.Tensor, step: dict, noise: torch.Tensor):
        """(x_s, target, sigma) of rows ``r``'s final latents at their ``step``, with ``noise``: the family's forward
        process (module docstring); x_s in the condition's dtype."""
        x0 = batch["next_latents"][r, -1].float()  # the rollout's final latents
        if self.process == "flow":
            sigma = step["sigmas"].float()
            x_s, target = flow_forward(x0, noise, sigma)
        else:
            scheduler = self.family.pipe.scheduler
            alpha_bar = scheduler.alphas_cumprod.to(x0.device, torch.float32)[step["timesteps"].long()]
            x_s, target = ddpm_forward(x0, noise, alpha_bar, scheduler.config.prediction_type)
            sigma = (1 - alpha_bar).sqrt()
        return x_s.to(batch[self.family.cond_keys[0]].dtype), target, sigma

    def train_step(self, batch: dict, r: torch.Tensor, n: torch.Tensor) -> dict:
        """The step tensors the forward process and the denoiser read for rows ``r``: the rollout schedule's at steps
        ``n`` (``algorithm.objective_times="schedule"``), or drawn times s (flow: sigmas s, timesteps 1000 s; DDPM: the
        timestep nearest to 1000 s)."""
        step = {key: batch[key][r, n] for key in self.family.step_keys}
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

    def velocity(self, model, batch: dict, r: torch.Tensor, step: dict, x_s: torch.Tensor) -> torch.Tensor:
        """The denoiser's output (velocity, eps, v or x0) on x_s for rows ``r``, under the training guidance."""
        cond = {key: batch[key][r] for key in self.family.cond_keys}
        negative = recorded_negative(self.family, batch, r)  # each row's own when the record has them
        return self.family.model_output(model, x_s, step, cond, negative, self.guidance_scale)

    def _backward_pairs(self, batch: dict, r: torch.Tensor, n: torch.Tensor, weight: float, share: float,
                        sums) -> None:
        step = self.train_step(batch, r, n)
        x_s, target, sigma = self.noised(batch, r, step, torch.randn_like(batch["next_latents"][r, -1].float()))
        unwrapped = self.accelerator.unwrap_model(self.model)
        old_pred = None
        if self.old is not None:
            with torch.no_grad(), self.old.applied(unwrapped) as old_model:
                old_pred = self.velocity(old_model, batch, r, step, x_s)
        pred = self.velocity(self.model, batch, r, step, x_s)
        losses, info = self.objective(pred, target, batch["advantages"][r, 0].float(), sigma, old_pred=old_pred,
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
            sums[key] += share * (value.detach() if isinstance(value, torch.Tensor) else value)
