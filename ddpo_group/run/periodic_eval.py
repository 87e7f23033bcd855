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
    eval_heldout/reward_mean, reward_std       the held-out rewards (``eval_reward_fn``) of the deterministic images,
    eval_heldout/<name>, reward_info/<key>     each one's mean, their info's entries: scored, never trained on
    eval/diversity, eval/image/*, eval/drift/* how alike each prompt's images are, the images' look and its move from
                                               the evaluation before training (run/reporting/image_stats.py)

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
from ddpo_group.prompts import draw_prompts
from ddpo_group.rewards import is_groupwise, pointwise_score
from ddpo_group.rewards.combine import component_label
from ddpo_group.run.reporting.audio_stats import AUDIO_STATISTICS, audio_metrics
from ddpo_group.run.reporting.image_stats import (PIXELS, STATISTICS, as_images, diversity, drift, image_spreads,
                                                   image_statistics, pixel_features)
from ddpo_group.sampling.trajectories import SamplingOptions, rows_of, sample_trajectories

PROMPT_GROUP = "prompt/"  # eval/prompt/<prompt>: a prompt's mean reward in an evaluation's metrics

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
    heldout: torch.Tensor | None = None  # the held-out rewards (eval_reward_fn) of the same rows, or None
    # a family with audio (LTX-2): the grid's rows' waveforms [rows, channels, samples] (main process), else None
    audio: torch.Tensor | None = None
    audio_sample_rate: int = 0
    # a groupwise reward (rewards/base.py): each row's pointwise score (its declared info entry), None when it declares
    # none; training raises that where a win rate's mean over a group is 1/2 whatever the images
    groupwise: bool = False
    pointwise: torch.Tensor | None = None

    @property
    def trained(self) -> torch.Tensor | None:
        """[N * M] what training raises on each row: its reward, or a groupwise reward's pointwise score (None when it
        declares none: nothing per image then says whether the run learned)."""
        return self.pointwise if self.groupwise else self.rewards


class PeriodicEvaluation:
    """The fixed evaluation of a run (module docstring). ``run(epoch)`` on every process at the same epochs."""

    def __init__(self, config, accelerator, family, reward_scorer, gather, heldout_scorer=None,
                 image_features=None, num_seeds: int | None = None, first_noise: int = 0):
        """``reward_scorer`` (rollout/reward_scorer.py) scores a batch of images: the sampling's own, so a
        batch size halved after an out-of-memory error holds for both. ``gather(tensor)`` concatenates a per-process
        tensor over the processes in process order (ddpo_group/distributed.py's ProcessShards.gather).
        ``heldout_scorer``: a RewardScorer of the held-out rewards (eval_reward_fn); ``image_features``: images
        [N, 3, H, W] -> [N, d] unit vectors for eval/diversity (a CLIP image encoder), None: the pixel feature.
        ``num_seeds``: the initial noises per prompt (None: eval_num_seeds), noises ``first_noise`` .. ``first_noise``
        + num_seeds - 1 (run/fresh_evaluation.py's are ones no evaluation during training uses)."""
        self.config, self.accelerator, self.family, self.reward_scorer, self.gather = (
            config, accelerator, family, reward_scorer, gather)
        self.heldout_scorer, self.image_features = heldout_scorer, image_features
        self.start: dict | None = None  # eval/image/* before training (eval/drift/*'s origin)
        self.audio_start: dict | None = None  # eval/audio/* before training (eval/drift/audio/*'s origin)
        self.freq, self.num_epochs = int(config.eval_freq), int(config.num_epochs)
        self.prompts, self.metadata = eval_prompts(config)
        self.num_seeds = int(config.eval_num_seeds if num_seeds is None else num_seeds)
        self.first_noise = int(first_noise)
        self.group_by = config.eval_group_by
        if self.group_by:
            missing = [p for p, m in zip(self.prompts, self.metadata) if self.group_by not in m]
            if missing:
                keys = sorted({k for m in self.metadata for k in m})
                raise ConfigError(f"eval_group_by={self.group_by!r}: the metadata of evaluation prompt {missing[0]!r} "
                                  f"has no such key; the prompt function's metadata keys are {keys} ('' groups by "
                                  "prompt)")
        # a call per prompt's M images: each process evaluates whole prompts
        self.groupwise = any(getattr(scorer, "groupwise", False) for scorer in (reward_scorer, heldout_scorer))
        self._cond = None  # the prompts' condition, encoded at the first evaluation

    @classmethod
    def from_config(cls, config, accelerator, family, reward_scorer, gather, **kwargs) -> "PeriodicEvaluation":
        """The run's evaluation: its held-out rewards (eval_reward_fn) and eval/diversity's image features
        (eval_diversity_features: a named CLIP model, else a reward's own CLIP image encoder, else the pixels);
        ``kwargs``: num_seeds, first_noise (``__init__``)."""
        from ddpo_group.rewards import image_features_of, make_reward_fn
        from ddpo_group.rollout.reward_scorer import RewardScorer

        heldout = None
        if config.eval_reward_fn:
            heldout_kwargs = config.eval_reward_fn_kwargs.to_dict()
            heldout = RewardScorer(make_reward_fn(config.eval_reward_fn, **heldout_kwargs), config.eval_reward_fn)
        chosen = config.eval_diversity_features
        if chosen == PIXELS:
            features = None
        elif chosen:
            from ddpo_group.rewards.clip_pair import ClipPair

            features = ClipPair(chosen, None, "eval_diversity_features", model_argument="eval_diversity_features",
                                processor_argument="eval_diversity_features").image_embeddings
        else:
            fns = [heldout.reward_fn] if heldout is not None else []
            features = next((image_features_of(fn) for fn in fns + [reward_scorer.reward_fn]
                             if image_features_of(fn) is not None), None)
        return cls(config, accelerator, family, reward_scorer, gather, heldout, features, **kwargs)

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
        first = self.first_noise
        noises = {j: torch.randn(shape, generator=torch.Generator().manual_seed(noise_seed(self.config.seed, first + j)))
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
                scorers = [self.reward_scorer] + ([self.heldout_scorer] if self.heldout_scorer is not None else [])
                scored, images, audio = self.sample_and_score(deterministic, False, scorers)
                stochastic = None
                if self.config.eval_train_sampler:  # the training sampler's noise levels, no log-probs
                    sampler = replace(deterministic, num_steps=sample.num_steps,
                                      noise_levels=tuple(self.family.noise_levels(sample)))
                    stochastic = self.sample_and_score(sampler, True, [self.reward_scorer])[0][0]
                looks = self.image_metrics(images, epoch)
                if audio is not None:  # a family with audio: its statistics and drift (run/reporting/audio_stats.py)
                    sounds, statistics = audio_metrics(audio, self.audio_start)
                    self.audio_start = statistics if epoch < 0 or self.audio_start is None else self.audio_start
                    looks.update(sounds)
        finally:
            model.train(training)
            self.family.schedule(sample.num_steps, self.accelerator.device)  # the training sampler's timesteps
        rewards, parts, labels = scored[0]
        score = pointwise_score(self.reward_scorer.reward_fn)
        metrics = self.metrics("eval", *scored[0], pointwise=score)
        if self.heldout_scorer is not None:
            metrics.update(self.metrics("eval_heldout", *scored[1], groups=False))
            components = getattr(self.heldout_scorer.reward_fn, "components", None)
            for label, _ in components or []:  # a combination's: each component's mean
                metrics[f"eval_heldout/{label}"] = metrics.pop(f"eval_heldout/reward_info/{label}")
            if not components:  # one reward: its mean under its name too
                metrics[f"eval_heldout/{component_label(str(self.heldout_scorer.reward_name))}"] = \
                    metrics["eval_heldout/reward_mean"]
        if stochastic is not None:
            metrics.update(self.metrics("eval_stochastic", *stochastic))
        metrics["eval/num_images"] = self.num_rows
        metrics.update(looks)
        main = self.accelerator.is_main_process
        grid = self.grid(images, rewards) if main else None
        heard = audio[: self.grid_rows] if main and audio is not None else None
        return EvalResult(metrics, grid, rewards, scored[1][0] if self.heldout_scorer is not None else None, heard,
                          self.family.audio_sample_rate if heard is not None else 0,
                          groupwise=is_groupwise(self.reward_scorer.reward_fn),
                          pointwise=parts[:, labels.index(score)] if score in labels else None)

    def image_metrics(self, images: torch.Tensor, epoch: int) -> dict:
        """eval/diversity, eval/image/* and eval/drift/* of the deterministic images (run/reporting/image_stats.py); the ones
        before training are eval/drift/*'s origin."""
        statistics = image_statistics(images)
        if epoch < 0 or self.start is None:
            self.start = statistics
        if self.image_features is not None and images.ndim == 4:
            features = self.image_features(as_images(images).to(self.accelerator.device)).float().cpu()
        else:
            features = pixel_features(images)
        return {"eval/diversity": diversity(features, self.num_seeds, cosine=self.image_features is not None),
                **{f"eval/image/{name}": value for name, value in statistics.items()},
                **{f"eval/image_spread/{name}": value for name, value in image_spreads(images).items()},
                **drift(statistics, self.start)}

    def restore(self, records: list[dict]) -> None:
        """A resumed run: eval/drift/*'s origin from its evaluation before training (eval.jsonl's epoch -1)."""
        before = [r for r in records if r.get("epoch") == -1 and f"eval/image/{STATISTICS[0]}" in r]
        if before:
            self.start = {name: before[0][f"eval/image/{name}"] for name in STATISTICS}
            if f"eval/audio/{AUDIO_STATISTICS[0]}" in before[0]:
                self.audio_start = {name: before[0][f"eval/audio/{name}"] for name in AUDIO_STATISTICS}

    def sample_and_score(self, options: SamplingOptions, stochastic: bool, scorers: list):
        """([(rewards [R] float64, components [R, C] float64, their labels) of each of ``scorers``], images [R, 3, H, W]
        uint8, audio [R, channels, samples] or None) of every row sampled with ``options`` (``stochastic``: the step
        noise of each row from its own generator), gathered; components: the reward info's per-image entries every
        batch has."""
        family = self.family
        if self._cond is None:
            self._cond = family.condition(self.prompts, self.metadata)
        rows = self.my_rows()
        device = self.accelerator.device
        noise = self.initial_noise(rows)
        scored = [([], []) for _ in scorers]  # (rewards, infos) of each scorer
        images, sampled, heard, sounds = [], [], [], []  # heard: a groupwise scorer's rows' metadata, with their audio
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
            if self.groupwise:  # a groupwise scorer scores below, each prompt's M images together
                sampled.append(traj.images)
                heard += traj.reward_metadata([dict(self.metadata[i]) for i in prompt_index])
            for scorer, (rewards, infos) in zip(scorers, scored):
                if not getattr(scorer, "groupwise", False):
                    values, info = scorer(traj.images, [self.prompts[i] for i in prompt_index],
                                          traj.reward_metadata([dict(self.metadata[i]) for i in prompt_index]))
                    rewards.append(values)
                    infos.append(per_image(info, len(chunk)))
            images.append((traj.images.float().clamp(0, 1) * 255).round().to(torch.uint8).cpu())
            if traj.audio is not None:
                sounds.append(traj.audio.float().cpu())
        prompt_index = [r // self.num_seeds for r in rows]
        for scorer, (rewards, infos) in zip(scorers, scored):
            if getattr(scorer, "groupwise", False):  # groups by position: the padding (copies of the last row) is whole groups of its own
                values, info = scorer(torch.cat(sampled), [self.prompts[i] for i in prompt_index], heard,
                                      groups=[k // self.num_seeds for k in range(len(rows))])
                rewards.append(values)
                infos.append(per_image(info, len(rows)))
        n, out = self.num_rows, []
        for rewards, infos in scored:
            # the entries every batch has (a reward returns the same keys on every process: they are gathered together)
            labels = sorted(set.intersection(*(set(info) for info in infos)))
            parts = torch.stack([torch.cat([info[key] for info in infos]) for key in labels], 1) if labels \
                else torch.zeros(len(rows), 0, dtype=torch.float64)
            out.append((self.gather(torch.cat(rewards).double())[:n], self.gather(parts)[:n], labels))
        audio = self.gather(torch.cat(sounds))[:n] if sounds else None
        return out, self.gather(torch.cat(images))[:n], audio

    def metrics(self, prefix: str, rewards: torch.Tensor, components: torch.Tensor, labels: list,
                groups: bool = True, pointwise: str | None = None) -> dict:
        """Mean and std of the rewards, each component's mean, and (``groups``) the mean of each prompt group (module
        docstring); the rewards' mean on each half of the images (select_half/, report_half/: the guard chooses the
        best evaluation on one and reports it on the other), and so the ``pointwise`` component's (a groupwise
        reward's declared score), with its std."""
        out = {f"{prefix}/reward_mean": float(rewards.mean()),
               f"{prefix}/reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0}
        for k, label in enumerate(labels):
            out[f"{prefix}/reward_info/{label}"] = float(components[:, k].mean())
        select = self.selection_half(len(rewards))
        report = ~select if bool((~select).any()) else select  # one image: both halves are it
        out[f"{prefix}/select_half/reward_mean"] = float(rewards[select].mean())
        out[f"{prefix}/report_half/reward_mean"] = float(rewards[report].mean())
        if pointwise in labels:
            values = components[:, labels.index(pointwise)]
            out[f"{prefix}/reward_info/{pointwise}_std"] = float(values.std()) if len(values) > 1 else 0.0
            out[f"{prefix}/select_half/reward_info/{pointwise}"] = float(values[select].mean())
            out[f"{prefix}/report_half/reward_info/{pointwise}"] = float(values[report].mean())
        if not groups:
            return out
        values_of: dict[str, list[float]] = {}
        for r, value in enumerate(rewards.tolist()):
            values_of.setdefault(self.group_of(r // self.num_seeds), []).append(value)
        for name, values in values_of.items():
            out[f"{prefix}/{name}"] = sum(values) / len(values)
        return out

    def selection_half(self, rows: int) -> torch.Tensor:
        """[rows] bool: the images the best evaluation is chosen on, each prompt's even initial noises (every other
        prompt when it has one noise); the others report it (run/guard.py)."""
        index = torch.arange(rows)
        return (index % self.num_seeds) % 2 == 0 if self.num_seeds > 1 else (index // self.num_seeds) % 2 == 0

    def group_of(self, prompt_index: int) -> str:
        if self.group_by:
            return f"{self.group_by}/{self.metadata[prompt_index][self.group_by]}"
        return f"{PROMPT_GROUP}{self.prompts[prompt_index]}"

    @property
    def grid_rows(self) -> int:
        """The rows the grid shows: the first GRID_PROMPTS prompts' M images each."""
        return min(len(self.prompts), GRID_PROMPTS) * self.num_seeds

    def grid(self, images: torch.Tensor, rewards: torch.Tensor):
        """The first GRID_PROMPTS prompts, one row each: their M images captioned with the reward and the prompt."""
        from ddpo_group.run.reporting.image_grid import image_grid

        n = self.grid_rows
        captions = [f"{self.prompts[r // self.num_seeds]}\nreward {float(rewards[r]):.3f}" for r in range(n)]
        columns = self.num_seeds if self.num_seeds > 1 else 4  # a prompt's images side by side
        return image_grid(images[:n].float() / 255, captions, columns=columns)
