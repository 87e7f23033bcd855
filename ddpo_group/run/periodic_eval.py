"""Evaluation during training: a fixed set of prompts x fixed initial noise, sampled every ``eval_freq`` epochs.

The epoch means of the training rewards mostly measure which prompts were drawn that epoch; this evaluation holds
everything but the weights fixed, so its change is the training's:

* prompts: ``eval_num_prompts`` distinct prompts drawn once from the training prompt function by a generator of their
  own, seeded by ``seed`` + EVAL_SEED_OFFSET (the training prompt sampler's stream is untouched; a prompt set with
  fewer distinct prompts gives those), or every distinct line of ``eval_prompt_file``;
* noise: ``eval_num_seeds`` initial noises x_0 per prompt; noise j (the same for every prompt)
  is ``torch.randn`` of a CPU generator seeded by ``noise_seed(seed, j)``, so every evaluation starts from the same
  x_0 on any device and process count;
* sampler: the deterministic one (noise level 0 on every step) with ``sample.eval_num_steps`` steps (0:
  ``sample.num_steps``); with ``eval_train_sampler`` also the training sampler (its noise level, SDE window and
  ``sample.num_steps``), whose step noise of row r comes from a generator seeded by ``step_seed(seed, r)``, fresh at
  every evaluation.

Rows are prompt-major (row r = prompt r // M, noise r % M, M = eval_num_seeds). Each process samples its slice of the
rows (padded to equal slices with copies of the last row, so every process makes the same denoiser forwards, as FSDP
needs) and the rewards and images are gathered in row order. A groupwise reward (rewards/base.py's ``is_groupwise``)
scores each prompt's M images together, once they are all sampled: each process then takes whole prompts, and its
padding is whole groups of copies of the last row. Metrics:

    eval/reward_mean, eval/reward_std          over the N x M images (std with ddof 1)
    eval/reward_info/<key>                     the mean of each per-image entry of the reward's info (a combination's
                                               components, shapes_alignment's shape_correct, ...), as reward_info/*
    eval/prompt/<prompt>                       the mean over a prompt's M images (per prompt group), or with
    eval/<key>/<value>                         ``eval_group_by=key``: over the prompts whose metadata[key] is value
    eval_stochastic/...                        the same with the training sampler (``eval_train_sampler``)

No training randomness is used: sampling draws only from the evaluation's own generators, and the global random
states (torch CPU and CUDA, numpy, random) are saved before and restored after, in case a reward function draws from
them; the denoiser's train/eval mode and the scheduler's timesteps are restored too. A resumed run therefore
evaluates and trains exactly as an uninterrupted one.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ddpo_group.errors import ConfigError
from ddpo_group.sampling.trajectories import SamplingOptions, rows_of, sample_trajectories

EVAL_SEED_OFFSET = 7_919  # the prompt draw's seed is seed + this: apart from the training prompt sampler (seed)
GRID_PROMPTS = 16  # prompts shown in the evaluation grid (each with its M images)


def noise_seed(seed: int, j: int) -> int:
    """The seed of the evaluation's j-th initial noise."""
    return ((seed + EVAL_SEED_OFFSET) * 1_000_003 + j) % 2**63


def step_seed(seed: int, row: int) -> int:
    """The seed of the step noise of row ``row`` under the training sampler (apart from the initial noises' seeds)."""
    return ((seed + EVAL_SEED_OFFSET) * 1_000_003 + 2**40 + row) % 2**63


@contextmanager
def preserved_rng_states():
    """Restore the global random states (torch CPU and every CUDA device, numpy, random) after the block."""
    torch_state, numpy_state, python_state = torch.get_rng_state(), np.random.get_state(), random.getstate()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        np.random.set_state(numpy_state)
        random.setstate(python_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


def eval_prompts(config) -> tuple[list[str], list[dict]]:
    """The fixed prompts (module docstring) and their metadata."""
    path = config.eval_prompt_file
    if path:
        file = Path(path).expanduser()
        lines = [line.strip() for line in file.read_text().splitlines() if line.strip()] if file.is_file() else []
        if not lines:
            raise ConfigError(f"eval_prompt_file={path!r} is not a file holding prompts (one prompt per line)")
        lines = list(dict.fromkeys(lines))
        return lines, [{} for _ in lines]
    from ddpo_group.run.evaluation import draw_prompts

    prompts, metadata = draw_prompts(config.prompt_fn, config.prompt_fn_kwargs.to_dict(), int(config.eval_num_prompts),
                                     config.seed + EVAL_SEED_OFFSET)
    first = {prompt: i for i, prompt in reversed(list(enumerate(prompts)))}  # draw_prompts cycles a small set: once
    keep = sorted(first.values())
    return [prompts[i] for i in keep], [metadata[i] for i in keep]


def per_image(info: dict, batch: int) -> dict[str, torch.Tensor]:
    """The numeric entries of a reward's info with one value per image, as float64 CPU tensors [batch]."""
    out = {}
    for key, value in info.items():
        try:
            tensor = torch.as_tensor(value.detach().cpu() if isinstance(value, torch.Tensor) else value)
        except (TypeError, ValueError, RuntimeError):
            continue
        if tensor.ndim == 1 and len(tensor) == batch and not tensor.is_complex():
            out[str(key)] = tensor.double()
    return out


@dataclass
class EvalResult:
    metrics: dict  # eval/* (and eval_stochastic/*) numbers
    grid: object | None  # a PIL image of the deterministic images (main process), or None
    rewards: torch.Tensor  # [N * M] float64, row order, deterministic sampler


class PeriodicEvaluation:
    """The fixed evaluation of a run (module docstring). ``run(epoch)`` on every process at the same epochs."""

    def __init__(self, config, accelerator, family, reward_scorer, gather):
        """``reward_scorer`` (rollout/collect.py's RewardScorer) scores a batch of images: the sampling's own, so a
        batch size halved after an out-of-memory error holds for both. ``gather(tensor)`` concatenates a per-process
        tensor over the processes in process order (ddpo_group/distributed.py's ProcessShards.gather)."""
        self.config, self.accelerator, self.family, self.reward_scorer, self.gather = (
            config, accelerator, family, reward_scorer, gather)
        self.freq, self.num_epochs = int(config.eval_freq), int(config.num_epochs)
        self.prompts, self.metadata = eval_prompts(config)
        self.num_seeds = int(config.eval_num_seeds)
        self.group_by = config.eval_group_by
        if self.group_by:
            missing = [p for p, m in zip(self.prompts, self.metadata) if self.group_by not in m]
            if missing:
                keys = sorted({k for m in self.metadata for k in m})
                raise ConfigError(f"eval_group_by={self.group_by!r}: the metadata of evaluation prompt {missing[0]!r} "
                                  f"has no such key; the prompt function's metadata keys are {keys} ('' groups by "
                                  "prompt)")
        self.labels: list[str] = []  # the reward info's per-image entries (set by each sampling)
        self.groupwise = bool(getattr(reward_scorer, "groupwise", False))  # a call per prompt's M images
        self._cond = None  # the prompts' condition, encoded at the first evaluation

    @property
    def num_rows(self) -> int:
        return len(self.prompts) * self.num_seeds

    def due(self, epoch: int) -> bool:
        """After epoch ``epoch``: every ``eval_freq`` epochs and after the last one."""
        return self.freq > 0 and ((epoch + 1) % self.freq == 0 or epoch == self.num_epochs - 1)

    def my_rows(self) -> list[int]:
        """This process's rows: a contiguous slice of ceil(rows / processes), padded with the last row; for a
        groupwise reward, of ceil(prompts / processes) whole prompts' rows."""
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        unit = self.num_seeds if self.groupwise else 1
        per = -(-self.num_rows // (world * unit)) * unit
        rows = list(range(rank * per, min((rank + 1) * per, self.num_rows)))
        return rows + [self.num_rows - 1] * (per - len(rows))

    def initial_noise(self, rows: list[int]) -> torch.Tensor:
        shape = self.family.latent_shape()
        noises = {j: torch.randn(shape, generator=torch.Generator().manual_seed(noise_seed(self.config.seed, j)))
                  for j in {r % self.num_seeds for r in rows}}
        return torch.stack([noises[r % self.num_seeds] for r in rows])

    @torch.no_grad()
    def run(self, epoch: int) -> EvalResult:
        """Sample and score the fixed set (on every process, gathered); the metrics, the grid and the rewards."""
        model = self.family.model
        training = model.training
        sample = self.config.sample
        model.eval()
        try:
            with preserved_rng_states(), self.accelerator.autocast():
                deterministic = SamplingOptions.deterministic(sample, sample.eval_num_steps)
                rewards, components, images = self.sample_and_score(deterministic, stochastic=False)
                stochastic = None
                if self.config.eval_train_sampler:  # the training sampler's noise levels, no log-probs
                    sampler = replace(deterministic, num_steps=sample.num_steps,
                                      noise_levels=tuple(self.family.noise_levels(sample)))
                    stochastic = self.sample_and_score(sampler, stochastic=True)[:2]
        finally:
            model.train(training)
            self.family.schedule(sample.num_steps, self.accelerator.device)  # the training sampler's timesteps
        metrics = self.metrics("eval", rewards, components)
        if stochastic is not None:
            metrics.update(self.metrics("eval_stochastic", *stochastic))
        metrics["eval/num_images"] = self.num_rows
        grid = self.grid(images, rewards) if self.accelerator.is_main_process else None
        return EvalResult(metrics, grid, rewards)

    def sample_and_score(self, options: SamplingOptions, stochastic: bool):
        """(rewards [R] float64, components [R, C] float64, images [R, 3, H, W] uint8) of every row sampled with
        ``options`` (``stochastic``: the step noise of each row from its own generator), gathered."""
        family = self.family
        if self._cond is None:
            self._cond = family.condition(self.prompts, self.metadata)
        rows = self.my_rows()
        device = self.accelerator.device
        noise = self.initial_noise(rows)
        rewards, infos, images, sampled = [], [], [], []
        for start in range(0, len(rows), options.batch_size):
            chunk = rows[start : start + options.batch_size]
            prompt_index = [r // self.num_seeds for r in chunk]
            generators = None
            if stochastic:
                generators = [torch.Generator(device=device).manual_seed(step_seed(self.config.seed, r)) for r in chunk]
            traj = sample_trajectories(
                family, family.model, rows_of(self._cond, torch.tensor(prompt_index, device=device)),
                family.negative_for([self.metadata[i] for i in prompt_index]), options, generator=generators,
                initial_noise=noise[start : start + len(chunk)].to(device),
            )
            if self.groupwise:  # scored below, each prompt's M images together
                sampled.append(traj.images)
            else:
                values, info = self.reward_scorer(traj.images, [self.prompts[i] for i in prompt_index],
                                                  [dict(self.metadata[i]) for i in prompt_index])
                rewards.append(values)
                infos.append(per_image(info, len(chunk)))
            images.append((traj.images.float().clamp(0, 1) * 255).round().to(torch.uint8).cpu())
        if self.groupwise:  # groups by position: the padding (copies of the last row) is whole groups of its own
            prompt_index = [r // self.num_seeds for r in rows]
            values, info = self.reward_scorer(torch.cat(sampled), [self.prompts[i] for i in prompt_index],
                                              [dict(self.metadata[i]) for i in prompt_index],
                                              groups=[k // self.num_seeds for k in range(len(rows))])
            rewards.append(values)
            infos.append(per_image(info, len(rows)))
        # the entries every batch has (a reward returns the same keys on every process: they are gathered together)
        self.labels = sorted(set.intersection(*(set(info) for info in infos)))
        parts = torch.stack([torch.cat([info[key] for info in infos]) for key in self.labels], 1) if self.labels \
            else torch.zeros(len(rows), 0, dtype=torch.float64)
        n = self.num_rows
        gathered = self.gather(torch.cat(rewards).double())[:n]
        return gathered, self.gather(parts)[:n], self.gather(torch.cat(images))[:n]

    def metrics(self, prefix: str, rewards: torch.Tensor, components: torch.Tensor) -> dict:
        """Mean and std of the rewards, each component's mean, and the mean of each prompt group (module docstring)."""
        out = {f"{prefix}/reward_mean": float(rewards.mean()),
               f"{prefix}/reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0}
        for k, label in enumerate(self.labels):
            out[f"{prefix}/reward_info/{label}"] = float(components[:, k].mean())
        groups: dict[str, list[float]] = {}
        for r, value in enumerate(rewards.tolist()):
            groups.setdefault(self.group_of(r // self.num_seeds), []).append(value)
        for name, values in groups.items():
            out[f"{prefix}/{name}"] = sum(values) / len(values)
        return out

    def group_of(self, prompt_index: int) -> str:
        if self.group_by:
            return f"{self.group_by}/{self.metadata[prompt_index][self.group_by]}"
        return f"prompt/{self.prompts[prompt_index]}"

    def grid(self, images: torch.Tensor, rewards: torch.Tensor):
        """The first GRID_PROMPTS prompts, one row each: their M images captioned with the reward and the prompt."""
        from ddpo_group.run.image_grid import image_grid

        n = min(len(self.prompts), GRID_PROMPTS) * self.num_seeds
        captions = [f"{self.prompts[r // self.num_seeds]}\nreward {float(rewards[r]):.3f}" for r in range(n)]
        columns = self.num_seeds if self.num_seeds > 1 else 4  # a prompt's images side by side
        return image_grid(images[:n].float() / 255, captions, columns=columns)
