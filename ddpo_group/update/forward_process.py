"""What the matching and preference objectives share: the forward process on a rollout's final samples and the
denoiser's output at a noised sample, under the training guidance.

    flow (flow-matching families, their steps record sigmas):
        x_s = (1 - s) x_clean + s eps,                   target u = eps - x_clean
    ddpm (DDPM / DDIM families, their scheduler has alphas_cumprod):
        x_t = sqrt(ab_t) x_clean + sqrt(1 - ab_t) eps,   target: the scheduler's prediction_type (eps, v or x_clean)

x_clean is the rollout's final latent x_T; the training times are the rollout schedule's (``algorithm.objective_times=
"schedule"``) or drawn ("uniform", "logit_normal", shifted by ``algorithm.objective_time_shift``; algorithms/
objectives.py's ``draw_times``).
"""

from __future__ import annotations

import torch

from ddpo_group.algorithms.objectives import ddpm_forward, draw_times, flow_forward
from ddpo_group.errors import ConfigError
from ddpo_group.sampling.trajectories import condition_dtype


def forward_process(family) -> str:
    """The family's forward process: "flow" when its steps record sigmas, "ddpm" when its scheduler has
    alphas_cumprod."""
    if "sigmas" in family.time_keys:
        return "flow"
    if hasattr(family.pipe.scheduler, "alphas_cumprod"):
        return "ddpm"
    raise ConfigError(f"the {family.name!r} family has neither flow sigmas nor DDPM alphas_cumprod: no forward process "
                      "for a matching objective")


class ForwardProcess:
    """The forward process of ``objective`` (an ObjectiveSpec of kind "matching" or "preference") on ``family``'s
    samples, refused at start where the objective cannot train the family (module docstring)."""

    def __init__(self, config, family, objective):
        self.process = forward_process(family)
        if self.process not in objective.processes:
            raise ConfigError(f"algorithm.objective={objective.name!r} is defined on the {objective.processes} forward "
                              f"process(es); the {family.name!r} family's is {self.process!r}: use a flow-matching "
                              "model (sd3, flux, zimage, tiny-shapes-flow), another objective (awm runs on both) or "
                              "algorithm.objective='policy_gradient'")
        if family.capabilities.second_transformer:
            raise ConfigError(f"algorithm.objective={objective.name!r} trains at any time of the forward process; this "
                              f"{family.name!r} model runs some steps with a frozen module (Wan2.2-A14B's low-noise "
                              "expert), which the objective cannot train: use algorithm.objective='policy_gradient' "
                              "(it trains the high-noise expert's steps) or a one-expert model")
        self.config, self.family = config, family
        self.guidance_scale = family.training_guidance(config)
        if family.carried_keys and self.guidance_scale > family.no_guidance:
            raise ConfigError(f"algorithm.objective={objective.name!r} trains at any time of the forward process; this "
                              f"{family.name!r} model's guidance carries {list(family.carried_keys)} from each sampling "
                              "step into the next (APG's momentum), which a time off the rollout's steps has not: use "
                              "algorithm.objective='policy_gradient', or train without guidance in the training forward "
                              f"(train.cfg=False, sample.guidance_scale={family.no_guidance:g})")

    def every_step(self) -> torch.Tensor:
        """[T] bool, all True: the objective draws its times among every step of the rollout schedule."""
        return torch.ones(self.config.sample.num_steps, dtype=torch.bool)

    def noised(self, batch, r: torch.Tensor, times: dict, noise: torch.Tensor):
        """(x_s, target, sigma) of rows ``r``'s final latents at their ``step``, with ``noise``; x_s in the sampler's
        state dtype (``family.state_dtype`` of the condition's)."""
        x_clean = batch.next_latents[r, -1].float()  # the rollout's final latents
        if self.process == "flow":
            sigma = times["sigmas"].float()
            x_s, target = flow_forward(x_clean, noise, sigma)
        else:
            scheduler = self.family.pipe.scheduler
            alpha_bar = scheduler.alphas_cumprod.to(x_clean.device, torch.float32)[times["timesteps"].long()]
            x_s, target = ddpm_forward(x_clean, noise, alpha_bar, scheduler.config.prediction_type)
            sigma = (1 - alpha_bar).sqrt()
        return x_s.to(self.family.state_dtype(condition_dtype(batch.cond, self.family))), target, sigma

    def train_times(self, batch, r: torch.Tensor, n: torch.Tensor) -> dict:
        """The step tensors the forward process and the denoiser read for rows ``r``: the rollout schedule's at steps
        ``n`` (``algorithm.objective_times="schedule"``), or drawn times s (flow: sigmas s, timesteps 1000 s; DDPM: the
        timestep nearest to 1000 s)."""
        times = {key: batch.times[key][r, n] for key in self.family.time_keys}
        algorithm = self.config.algorithm
        if algorithm.objective_times == "schedule":
            return times
        s = draw_times(len(r), algorithm.objective_times, float(algorithm.objective_time_shift), device=r.device)
        scale = int(self.family.pipe.scheduler.config.num_train_timesteps)
        if self.process == "flow":
            times.update(sigmas=s, next_sigmas=torch.zeros_like(s))
            times["timesteps"] = (s * scale).to(times["timesteps"].dtype)
        else:
            times["timesteps"] = (s * scale).long().clamp(0, scale - 1).to(times["timesteps"].dtype)
        return times

    def velocity(self, model, batch, r: torch.Tensor, times: dict, x_s: torch.Tensor) -> torch.Tensor:
        """The denoiser's output (velocity, eps, v or the clean latent) on x_s for rows ``r``, under the training
        guidance."""
        cond = {key: batch.cond[key][r] for key in self.family.cond_keys}
        negative = batch.negative_rows(self.family, r)  # each row's own when the record has them
        return self.family.model_output(model, x_s, times, cond, negative, self.guidance_scale)
