"""The sampling phase of an epoch: prompts -> trajectories with log-probs -> rewards (in a thread pool).

Rewards of one batch are computed in a worker thread while the next batch samples (rollout/reward_scorer.py's
RewardScorer). Each distinct prompt is encoded once per call (a prompt's group_size copies share their text
embedding), and the critic's values of all steps are one batched forward after each trajectory batch.
"""

from __future__ import annotations

from contextlib import nullcontext

from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Callable

import torch
from tqdm.auto import tqdm

from ddpo_group.errors import EpochAbandoned
from ddpo_group.rollout.reward_scorer import PendingGroups, RewardScorer, merge_infos
from ddpo_group.rollout.tweedie import tweedie_values, with_rewards
from ddpo_group.sampling.batch import RolloutBatch
from ddpo_group.sampling.family import Family
from ddpo_group.sampling.trajectories import (SamplingOptions, Trajectories, concatenate_rows, condition_dtype,
                                             rows_of, sample_trajectories)
from ddpo_group.timing import NULL_TIMER



SAMPLING_PRECISIONS = {"": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def sampling_precision(precision: str, device: torch.device):
    """The context the rollouts' forwards run in (sample.precision): nothing more than the run's own precision (""),
    or an autocast to bf16 / fp16 over it."""
    dtype = SAMPLING_PRECISIONS[precision]
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def widened(batch, precision: str):
    """A batch sampled under sample.precision with its conditions and step means in float32, as the update in the
    run's own precision reads them (exactly: a bf16 or fp16 number is a float32 one); unchanged for "" ."""
    if SAMPLING_PRECISIONS[precision] is None:
        return batch

    def wide(tree):
        if isinstance(tree, dict):
            return {key: wide(value) for key, value in tree.items()}
        return tree.float() if isinstance(tree, torch.Tensor) and tree.is_floating_point() else tree

    return replace(batch, cond=wide(batch.cond), negative=wide(batch.negative), step_means=wide(batch.step_means),
                   clean_hat=wide(batch.clean_hat))

class TextEmbeddingCache:
    """The condition of the last ``size`` distinct prompts (with their source images, for a family that takes them:
    keyed by ``family.condition_key``), on the CPU (least recently used ones dropped), so the text encoders meet each
    prompt once. A prompt is encoded alone, so its entry does not depend on which prompts were encoded with it (an
    exact resume, which starts with an empty cache, gets the same embeddings)."""

    def __init__(self, size: int):
        self.size = size
        self.entries: OrderedDict = OrderedDict()

    def condition(self, family, prompts: list[str], metadata: list[dict] | None = None) -> dict:
        metadata = metadata if metadata is not None else [{}] * len(prompts)
        keys = [family.condition_key(prompt, meta) for prompt, meta in zip(prompts, metadata)]
        for key, prompt, meta in zip(keys, prompts, metadata):
            if key in self.entries:
                self.entries.move_to_end(key)
            else:
                self.entries[key] = {k: v.cpu() for k, v in family.condition([prompt], [meta]).items()}
                if len(self.entries) > self.size:
                    self.entries.popitem(last=False)
        return concatenate_rows([self.entries[key] for key in keys], prompts, family.device)


def encode_unique(family, prompts: list[str], cache: TextEmbeddingCache | None = None,
                  metadata: list[dict] | None = None) -> dict:
    """The condition of ``prompts`` with their ``metadata`` (row-indexed tensors), running the encoders once per
    distinct prompt (``family.condition_key``: with its source images for an editing family; once per prompt over the
    run with a ``cache``)."""
    metadata = metadata if metadata is not None else [{}] * len(prompts)
    keys = [family.condition_key(prompt, meta) for prompt, meta in zip(prompts, metadata)]
    first = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    unique_prompts, unique_metadata = [prompts[i] for i in first.values()], [metadata[i] for i in first.values()]
    cond = cache.condition(family, unique_prompts, unique_metadata) if cache is not None \
        else family.condition(unique_prompts, unique_metadata)
    if len(first) == len(prompts):
        return cond
    position = {key: i for i, key in enumerate(first)}
    rows = torch.tensor([position[key] for key in keys], device=next(iter(cond.values())).device)
    return rows_of(cond, rows)


class RolloutSampler:
    """One process's sampling phase (module docstring): its prompts in ``options.batch_size`` batches, trajectories
    with log-probs sampled with ``family`` (``SamplingOptions``: the training sampler, what to record), scored by
    ``score`` in a worker thread while the next batch samples.

    ``critic`` adds its pre-step values V(x_n, t_n, c) [B, T] (one batched forward after each trajectory batch); a
    critic that reads clean_hat(x_n) (``critic.input="latent_clean_hat"``) gets it at every step, and the record keeps
    it (RolloutBatch.clean_hat).
    ``tweedie_steps`` adds GROUP_PPO's Tweedie values [B, T] float64: the reward of each of those steps' one-step
    prediction of the clean image, the sample's reward in the other columns (rollout/tweedie.py; B x
    len(tweedie_steps) more reward queries, charged to "reward"). ``text_cache`` keeps the condition of recent prompts
    over the run. ``timer`` (a PhaseTimer) charges the time to "sampling", "critic" and "reward" (waiting for the
    reward workers once sampling is done); ``should_stop()``, asked before each batch, abandons the sampling
    (EpochAbandoned) when true.
    """

    def __init__(self, family: Family, options: SamplingOptions, score: RewardScorer, critic=None,
                 tweedie_steps: list[int] | None = None, text_cache: TextEmbeddingCache | None = None,
                 timer=NULL_TIMER, should_stop: Callable[[], bool] = lambda: False):
        self.family, self.score, self.critic, self.tweedie_steps = family, score, critic, tweedie_steps
        self.text_cache, self.timer, self.should_stop = text_cache, timer, should_stop
        critic_reads_clean_hat = critic is not None and critic.reads_clean_hat
        # clean_hat(x_n) is kept at the Tweedie steps, or at every step for a critic that reads it
        clean_hat_steps = tuple(range(options.num_steps)) if critic_reads_clean_hat else tuple(tweedie_steps or ())
        self.options = replace(options, clean_hat_steps=clean_hat_steps)
        self.tweedie_columns = None if tweedie_steps is None else [clean_hat_steps.index(n) for n in tweedie_steps]
        self.executor = ThreadPoolExecutor(max_workers=2)  # reward calls run while the next batch samples

    def sample(self, model, prompts: list[str], metadata: list[dict], generators: list | None = None,
               initial_noise: torch.Tensor | None = None, desc: str = "sampling",
               groups: list | None = None) -> RolloutBatch:
        """The batch record of ``prompts`` (sampling/batch.py). ``model``: the denoiser the steps call (the policy's,
        or the trainer's rollout policy); ``generators`` (one per sample) make each sample's noise independent of the
        batch layout; ``initial_noise`` [B, ...] gives each sample's x_0 (e.g. shared by the copies of a prompt);
        ``desc``: the progress bar's (None: no bar). ``groups``: each sample's prompt group, a group's samples
        consecutive (whole groups), which a groupwise reward needs: each group is scored once all its samples are
        drawn (a group may span two sampling batches), in the worker thread."""
        family, options, timer, size = self.family, self.options, self.timer, self.options.batch_size
        with timer.phase("sampling"):
            cond = encode_unique(family, prompts, self.text_cache, metadata)
            negative = family.negative_rows(metadata)  # None: no prompt has its own negative prompt (the family's row)
        parts, futures = [], []
        pending = PendingGroups(groups) if self.score.groupwise else None  # sampled rows not yet scored
        num_batches = len(prompts) // size
        for i in tqdm(range(num_batches), desc=desc, disable=desc is None, leave=False):
            if self.should_stop():
                for future in futures:
                    future.cancel()
                wait(futures)  # a reward call already running finishes before the caller restores and checkpoints
                raise EpochAbandoned(f"sampling stopped before batch {i} of {num_batches}")
            rows = slice(i * size, (i + 1) * size)
            with timer.phase("sampling"):
                traj = sample_trajectories(
                    family, model, rows_of(cond, rows),
                    rows_of(negative, rows) if negative is not None else family.negative_condition(), options,
                    generator=generators[rows] if generators is not None else None,
                    initial_noise=initial_noise[rows] if initial_noise is not None else None,
                )
            if self.critic is not None:  # V(x_n, t_n, c) of every pre-step latent, one batched forward
                with timer.phase("critic"):
                    clean_hat = traj.clean_hat if self.critic.reads_clean_hat else None
                    traj = replace(traj, values=self.critic.values(traj.latents[:, :-1], traj.timesteps,
                                                                   family.text_embeds(rows_of(cond, rows)), clean_hat))
            if pending is None:
                futures.append(self.executor.submit(self.score, traj.images, prompts[rows],
                                                    traj.reward_metadata(metadata[rows])))
            else:  # the groups whose samples are all drawn
                done = pending.add(traj.images, traj.reward_metadata(metadata[rows]))
                if done is not None:
                    images, heard, rows = done
                    futures.append(self.executor.submit(self.score, images, prompts[rows], heard, groups[rows]))
            tweedie = None
            if self.tweedie_steps is not None:
                with timer.phase("reward"):
                    tweedie = tweedie_values(
                        family, traj.clean_hat[:, self.tweedie_columns], self.tweedie_steps, options.num_steps,
                        lambda images, p, m: self.score(images, p, m)[0], prompts[rows], metadata[rows],
                        dtype=condition_dtype(cond, family), decode_batch_size=options.decode_batch_size)
            parts.append((traj, tweedie))
        with timer.phase("reward"):
            scored = [future.result() for future in futures]
        traj = Trajectories.concatenate([traj for traj, _ in parts])
        rewards = torch.cat([r for r, _ in scored])
        tweedie = None
        if self.tweedie_steps is not None:
            tweedie = with_rewards(torch.cat([t for _, t in parts]), rewards)
        return RolloutBatch(
            prompts=list(prompts), metadata=list(metadata), cond=cond, negative=negative,
            latents=traj.latents[:, :-1], next_latents=traj.latents[:, 1:], log_probs=traj.log_probs,
            times=traj.times, images=traj.images, rewards=rewards, reward_info=merge_infos([i for _, i in scored]),
            values=traj.values,
            clean_hat=traj.clean_hat if self.critic is not None and self.critic.reads_clean_hat else None,
            step_means=traj.means, tweedie_values=tweedie, tree_nodes=traj.shared_from,
        )

    def close(self, wait: bool = True) -> None:
        self.executor.shutdown(wait=wait, cancel_futures=not wait)


@torch.no_grad()
def greedy_rewards(family: Family, model, prompts: list[str], metadata: list[dict], keys: list[int],
                   score: RewardScorer, options: SamplingOptions, seed: int,
                   initial_noise: torch.Tensor | None = None) -> torch.Tensor:
    """ReMax's baseline: the reward [B] of one greedy sample (``options``: the deterministic sampler) per distinct
    ``keys`` entry (prompt group), sampled with ``model``.

    The greedy sample of a group starts from noise seeded by (seed, key), so every process that holds a copy of the
    group gets the same baseline; or, given ``initial_noise`` [B, ...] (rows aligned with ``keys``, equal within a
    group), from its group's x_0.
    """
    first = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    order = list(first)
    device = family.device
    rewards = {}
    for start in range(0, len(order), options.batch_size):
        chunk = order[start : start + options.batch_size]
        batch_prompts = [prompts[first[k]] for k in chunk]
        batch_metadata = [metadata[first[k]] for k in chunk]
        generators = [torch.Generator(device=device).manual_seed(int(seed) * 1_000_003 + int(k)) for k in chunk]
        traj = sample_trajectories(
            family, model, family.condition(batch_prompts, batch_metadata), family.negative_for(batch_metadata),
            options, generator=generators,
            initial_noise=torch.stack([initial_noise[first[k]] for k in chunk]) if initial_noise is not None else None,
        )
        values, _ = score(traj.images, batch_prompts, traj.reward_metadata(batch_metadata))
        rewards.update(zip(chunk, values.tolist()))
    return torch.tensor([rewards[k] for k in keys], dtype=torch.float64)
