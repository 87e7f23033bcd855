"""The reward calls of the rollouts and the evaluations: RewardScorer calls a reward function on batches of images and
checks what it returns; a groupwise reward once per prompt group (PendingGroups holds a group's images until all of
them are sampled); a raising reward is called again image by image to name the images it fails on."""

from __future__ import annotations

import torch

from ddpo_group.rewards import RewardUnavailable, check_rewards, is_groupwise

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


def failing_images(reward_fn, images, prompts: list[str], metadata: list[dict]) -> str:
    """Which images of the batch the reward function raises on when called on one image at a time."""
    count = len(prompts)
    checked = min(count, MAX_ISOLATION_CALLS)
    bad = []
    for i in range(checked):
        try:
            reward_fn(images[i : i + 1], prompts[i : i + 1], metadata[i : i + 1])
        except Exception:
            bad.append(i)
    scope = f"of the first {checked} of {count} images" if checked < count else f"of the batch of {count} images"
    if not bad:
        return f"it raised on the whole batch {scope} but on no single image"
    return f"it raised on batch indices {bad} {scope}, prompts {[prompts[i] for i in bad]}"


class PendingGroups:
    """The sampled images of prompt groups not yet complete, for a groupwise reward: ``add(images, metadata)`` takes
    the next sampling batch (its rows' metadata as the rewards receive it: with their audio) and returns (images,
    metadata, rows) of the groups it completes (None when it completes none); the last batch completes every group."""

    def __init__(self, groups: list | None):
        if groups is None:
            raise ValueError("a groupwise reward needs each sample's prompt group (RolloutSampler.sample's groups)")
        self.groups, self.start, self.images = list(groups), 0, None  # rows [start, start + len(images)) held
        self.metadata: list[dict] = []

    def add(self, images: torch.Tensor, metadata: list[dict]):
        self.images = images if self.images is None else torch.cat([self.images, images])
        self.metadata += list(metadata)
        stop = self.start + len(self.images)
        end = stop  # rows [start, end) hold whole groups: the group of row stop - 1 may go on in the next batch
        if stop < len(self.groups):
            while end > self.start and self.groups[end - 1] == self.groups[stop]:
                end -= 1
        if end == self.start:
            return None
        done, self.images = self.images[: end - self.start], self.images[end - self.start :]
        heard, self.metadata = self.metadata[: end - self.start], self.metadata[end - self.start :]
        rows, self.start = slice(self.start, end), end
        return done, heard, rows


def merge_infos(infos: list[dict]) -> dict:
    merged = {}
    for key in infos[0]:
        values = [info[key] for info in infos if key in info]
        if all(isinstance(v, torch.Tensor) and v.ndim >= 1 for v in values):
            merged[key] = torch.cat([v.detach().cpu() for v in values])
    return merged
