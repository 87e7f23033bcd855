"""The sampling phase of an epoch: prompts -> trajectories with log-probs -> rewards (in a thread pool).

Rewards of one batch are computed in a worker thread while the next batch samples. Each distinct
prompt is encoded once per call (a prompt's group_size copies share their text embedding), and the
critic's values of all steps are one batched forward after each trajectory batch.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Callable

import torch
from tqdm.auto import tqdm

from ddpo_group.errors import EpochAbandoned
from ddpo_group.rewards import RewardUnavailable, check_rewards, is_groupwise
from ddpo_group.rollout.tweedie import tweedie_values, with_rewards
from ddpo_group.sampling.batch import RolloutBatch
from ddpo_group.sampling.trajectories import (SamplingOptions, Trajectories, concatenate_rows, rows_of,
                                             sample_trajectories)
from ddpo_group.timing import NULL_TIMER


MAX_ISOLATION_CALLS = 16  # single-image reward calls made to find the images a raising reward fails on


class RewardScorer:
    """A reward function called on batches of images: (rewards [B] float64, checked; info), any error naming the
    reward function.

    When the reward function raises, it is called again on each image alone (at most MAX_ISOLATION_CALLS of them) and
    the message lists the indices and prompts it fails on; not when it raises RewardUnavailable (a reward server
    that is down), whose cause is not in the images. When it runs out of device memory (a reward model on the
    GPU), the batch is halved, for this call and every later one: ``chunk``, the images per call after such an error,
    stays for the run (the RolloutCollector owns the run's scorer; the evaluation during training shares it).

    A groupwise reward function (rewards/base.py: ``is_groupwise``) is called once per prompt group instead: a call
    gives each image's group (``groups``, a group's entries consecutive), and an error names the group's prompt; its
    groups are neither split after an out-of-memory error nor scored image by image.
    """

    def __init__(self, reward_fn, reward_name: str):
        self.reward_fn, self.reward_name = reward_fn, reward_name  # a combination's name is its {name: weight}
        self.groupwise = is_groupwise(reward_fn)
        self.chunk: int | None = None  # images per reward call after an out-of-memory error

    def __call__(self, images, prompts: list[str], metadata: list[dict],
                 groups: list | None = None) -> tuple[torch.Tensor, dict]:
        if self.groupwise:
            return self.by_group(images, prompts, metadata, groups)
        reward_fn, reward_name = self.reward_fn, self.reward_name
        chunk = self.chunk
        if chunk is not None and chunk < len(prompts):  # an earlier call ran out of device memory at a larger batch
            return self.in_parts(images, prompts, metadata, chunk)
        try:
            out = reward_fn(images, prompts, metadata)
        except torch.OutOfMemoryError:  # a reward model on the GPU: halve the batch, for this call and the later ones
            if len(prompts) == 1:
                raise
            torch.cuda.empty_cache()
            self.chunk = max(1, len(prompts) // 2)
            return self(images, prompts, metadata)
        except RewardUnavailable as error:  # not the images' fault: scoring them one by one would wait again
            raise RuntimeError(f"reward function {reward_name!r} raised {type(error).__name__}: {error}") from error
        except Exception as error:
            raise RuntimeError(
                f"reward function {reward_name!r} raised {type(error).__name__}: {error} "
                f"({failing_images(reward_fn, images, prompts, metadata)})"
            ) from error
        return self.checked(out, len(prompts))

    def checked(self, out, batch_size: int) -> tuple[torch.Tensor, dict]:
        """The reward function's output ``out`` for ``batch_size`` images as (rewards [B] float64, info)."""
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(
                f"reward function {self.reward_name!r} returned {type(out).__name__}; expected a (rewards, info) pair "
                f"with {batch_size} rewards"
            )
        rewards, info = out
        return check_rewards(rewards, batch_size, self.reward_name), info or {}

    def by_group(self, images, prompts: list[str], metadata: list[dict], groups: list | None):
        """A groupwise reward function called once per run of equal ``groups`` entries (a prompt group)."""
        if groups is None or len(groups) != len(prompts):
            raise ValueError(f"reward function {self.reward_name!r} is groupwise: it needs the prompt group of each of "
                             f"the {len(prompts)} images, got {None if groups is None else len(groups)}")
        parts = []
        for start, stop in group_runs(groups):
            try:
                out = self.reward_fn(images[start:stop], prompts[start:stop], metadata[start:stop])
            except Exception as error:
                raise RuntimeError(
                    f"reward function {self.reward_name!r} raised {type(error).__name__}: {error} (groupwise, on the "
                    f"group of {stop - start} images of prompt {prompts[start]!r})") from error
            parts.append(self.checked(out, stop - start))
        return concatenate_scores(parts)

    def in_parts(self, images, prompts: list[str], metadata: list[dict], chunk: int):
        """The scores of consecutive parts of ``chunk`` images: rewards concatenated, per-image info entries too."""
        return concatenate_scores([self(images[i : i + chunk], prompts[i : i + chunk], metadata[i : i + chunk])
                                   for i in range(0, len(prompts), chunk)])


def group_runs(groups: list) -> list[tuple[int, int]]:
    """The [start, stop) row ranges of the runs of equal consecutive ``groups`` entries; a group in two runs (its
    copies not consecutive) is an error."""
    runs, seen = [], set()
    for i, group in enumerate(groups):
        if i and group == groups[i - 1]:
            continue
        if group in seen:
            raise ValueError(f"prompt group {group!r} is not consecutive in the groups {list(groups)}: a groupwise "
                             "reward scores each group's images together")
        seen.add(group)
        runs.append(i)
    return list(zip(runs, runs[1:] + [len(groups)]))


def concatenate_scores(parts: list[tuple[torch.Tensor, dict]]) -> tuple[torch.Tensor, dict]:
    """(rewards, info) of consecutive parts of a batch: the rewards concatenated, and each info entry that holds one
    value per image in every part (a tensor) too; any other entry is the first part's."""
    info = {}
    for key, first in parts[0][1].items():
        values = [part[1].get(key) for part in parts]
        per_image = all(isinstance(value, torch.Tensor) and value.dim() > 0 and len(value) == len(rewards)
                        for value, (rewards, _) in zip(values, parts))
        info[key] = torch.cat(values) if per_image else first
    return torch.cat([rewards for rewards, _ in parts]), info


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


def failing_images(reward_fn, images, prompts: list[str], metadata: list[dict]) -> str:
    """Which images of the batch the reward function raises on when called on one image at a time."""
    n = len(prompts)
    checked = min(n, MAX_ISOLATION_CALLS)
    bad = []
    for i in range(checked):
        try:
            reward_fn(images[i : i + 1], prompts[i : i + 1], metadata[i : i + 1])
        except Exception:
            bad.append(i)
    scope = f"of the first {checked} of {n} images" if checked < n else f"of the batch of {n} images"
    if not bad:
        return f"it raised on the whole batch {scope} but on no single image"
    return f"it raised on batch indices {bad} {scope}, prompts {[prompts[i] for i in bad]}"


class RolloutSampler:
    """One process's sampling phase (module docstring): its prompts in ``options.batch_size`` batches, trajectories
    with log-probs sampled with ``family`` (``SamplingOptions``: the training sampler, what to record), scored by
    ``score`` in a worker thread while the next batch samples.

    ``critic`` adds its pre-step values V(x_n, t_n, c) [B, T] (one batched forward after each trajectory batch); a
    critic that reads x0_hat (``critic.input="latent_x0"``) gets it at every step, and the record keeps it (pred_x0).
    ``tweedie_steps`` adds GROUP_PPO's Tweedie values [B, T] float64: the reward of each of those steps' one-step
    prediction of the clean image, the sample's reward in the other columns (rollout/tweedie.py; B x
    len(tweedie_steps) more reward queries, charged to "reward"). ``text_cache`` keeps the condition of recent prompts
    over the run. ``timer`` (a PhaseTimer) charges the time to "sampling", "critic" and "reward" (waiting for the
    reward workers once sampling is done); ``should_stop()``, asked before each batch, abandons the sampling
    (EpochAbandoned) when true.
    """

    def __init__(self, family, options: SamplingOptions, score: RewardScorer, critic=None,
                 tweedie_steps: list[int] | None = None, text_cache: TextEmbeddingCache | None = None,
                 timer=NULL_TIMER, should_stop: Callable[[], bool] = lambda: False):
        self.family, self.score, self.critic, self.tweedie_steps = family, score, critic, tweedie_steps
        self.text_cache, self.timer, self.should_stop = text_cache, timer, should_stop
        critic_reads_x0 = critic is not None and critic.reads_x0
        # x0_hat(x_n) is kept at the Tweedie steps, or at every step for a critic that reads it
        x0_steps = tuple(range(options.num_steps)) if critic_reads_x0 else tuple(tweedie_steps or ())
        self.options = replace(options, record_x0=x0_steps)
        self.tweedie_columns = None if tweedie_steps is None else [x0_steps.index(n) for n in tweedie_steps]
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
                    x0 = traj.pred_x0 if self.critic.reads_x0 else None
                    traj.values = self.critic.values(traj.latents[:, :-1], traj.timesteps, cond["prompt_embeds"][rows],
                                                     x0)
            if pending is None:
                futures.append(self.executor.submit(self.score, traj.images, prompts[rows], metadata[rows]))
            else:  # the groups whose samples are all drawn
                done = pending.add(traj.images)
                if done is not None:
                    images, rows = done
                    futures.append(self.executor.submit(self.score, images, prompts[rows], metadata[rows],
                                                        groups[rows]))
            tweedie = None
            if self.tweedie_steps is not None:
                with timer.phase("reward"):
                    tweedie = tweedie_values(
                        family, traj.pred_x0[:, self.tweedie_columns], self.tweedie_steps, options.num_steps,
                        lambda images, p, m: self.score(images, p, m)[0], prompts[rows], metadata[rows],
                        dtype=next(iter(cond.values())).dtype, decode_batch_size=options.decode_batch_size)
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
            steps=traj.steps, images=traj.images, rewards=rewards, reward_info=_merge_infos([i for _, i in scored]),
            values=traj.values, pred_x0=traj.pred_x0 if self.critic is not None and self.critic.reads_x0 else None,
            step_means=traj.means, tweedie_values=tweedie, tree_nodes=traj.shared_from,
        )

    def close(self, wait: bool = True) -> None:
        self.executor.shutdown(wait=wait, cancel_futures=not wait)


class PendingGroups:
    """The sampled images of prompt groups not yet complete, for a groupwise reward: ``add(images)`` takes the next
    sampling batch and returns (images, rows) of the groups it completes (None when it completes none); the last
    batch completes every group."""

    def __init__(self, groups: list | None):
        if groups is None:
            raise ValueError("a groupwise reward needs each sample's prompt group (RolloutSampler.sample's groups)")
        self.groups, self.start, self.images = list(groups), 0, None  # rows [start, start + len(images)) held

    def add(self, images: torch.Tensor):
        self.images = images if self.images is None else torch.cat([self.images, images])
        stop = self.start + len(self.images)
        end = stop  # rows [start, end) hold whole groups: the group of row stop - 1 may go on in the next batch
        if stop < len(self.groups):
            while end > self.start and self.groups[end - 1] == self.groups[stop]:
                end -= 1
        if end == self.start:
            return None
        done, self.images = self.images[: end - self.start], self.images[end - self.start :]
        rows, self.start = slice(self.start, end), end
        return done, rows


def _merge_infos(infos: list[dict]) -> dict:
    merged = {}
    for key in infos[0]:
        values = [info[key] for info in infos if key in info]
        if all(isinstance(v, torch.Tensor) and v.ndim >= 1 for v in values):
            merged[key] = torch.cat([v.detach().cpu() for v in values])
    return merged


@torch.no_grad()
def greedy_rewards(family, model, prompts: list[str], metadata: list[dict], keys: list[int], score: RewardScorer,
                   options: SamplingOptions, seed: int, initial_noise: torch.Tensor | None = None) -> torch.Tensor:
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
        values, _ = score(traj.images, batch_prompts, batch_metadata)
        rewards.update(zip(chunk, values.tolist()))
    return torch.tensor([rewards[k] for k in keys], dtype=torch.float64)
