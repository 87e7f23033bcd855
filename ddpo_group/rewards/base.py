"""What a reward is: the registry of reward factories (``@register_reward``), the lookup of a factory by name, plugin
path or entry point, and the check of a reward function's output. The package's modules and combinations build on
it (ddpo_group/rewards/__init__.py describes the contract).
"""

from __future__ import annotations

import inspect
from typing import Callable

import numpy as np
import torch

from ddpo_group.registry import Registry

RewardFn = Callable[[torch.Tensor, list, list], tuple]
REWARD_ENTRY_POINT_GROUP = "ddpo_group.rewards"
REWARD_REGISTRY = Registry("reward_fn", entry_point_group=REWARD_ENTRY_POINT_GROUP)
register_reward = REWARD_REGISTRY.register


class RewardUnavailable(RuntimeError):
    """The reward could not be computed for a reason outside the images (its server down, silent or failing, its
    token refused): scoring the images one at a time would only repeat the failure and its waits."""


def get_reward_factory(name: str) -> Callable[..., RewardFn]:
    """The factory named by ``name``: registered name, "module:factory" path or ``ddpo_group.rewards`` entry point.

    The factory is wrapped so that wrong arguments (``reward_fn_kwargs``) give a TypeError naming the reward.
    """
    factory = REWARD_REGISTRY.resolve(name)

    def build(**kwargs) -> RewardFn:
        try:
            signature = inspect.signature(factory)
            if "images" in signature.parameters and "images" not in kwargs:
                raise ValueError(
                    f"reward_fn {name!r} is a reward function fn(images, prompts, metadata); reward_fn names its "
                    "factory, a function that takes the reward_fn_kwargs and returns the reward function:\n"
                    f"    def make_{getattr(factory, '__name__', 'reward')}(**kwargs):\n"
                    "        return lambda images, prompts, metadata: (rewards, info)\n"
                    "(docs/rewards.md)")
            signature.bind(**kwargs)
        except TypeError as error:
            raise TypeError(f"reward_fn {name!r} does not accept reward_fn_kwargs {kwargs}: {error}") from None
        except ValueError as error:
            if str(error).startswith("reward_fn "):
                raise
            pass  # no introspectable signature: let the call decide
        return scores_frames(factory(**kwargs), name)

    return build


# ----------------------------------------------------------------------------- groupwise rewards
GROUPWISE_ATTRIBUTE = "groupwise"  # set True on a reward function called once per prompt group


def is_groupwise(reward_fn) -> bool:
    """Whether ``reward_fn`` scores a prompt group's images together (its factory set ``fn.groupwise = True``): it is
    called once per group, with the group's G images, prompts and metadata, and returns G rewards that may depend on
    each other (a win rate, a rank). Any other reward function scores each image on its own, in batches of any
    composition."""
    return bool(getattr(reward_fn, GROUPWISE_ATTRIBUTE, False))


POINTWISE_SCORE_ATTRIBUTE = "pointwise_score"  # a groupwise reward's info entry of each image's own score


def pointwise_score(reward_fn) -> str | None:
    """The info entry in which a groupwise reward gives each image's own score (a win rate under a reward judge, a
    rank: the judge's ``score``), which rises as training works where the reward's mean over a group cannot (a win
    rate's is 1/2 whatever the images); None for a pointwise reward, or a groupwise one without such a score (a VLM
    judge's win rate)."""
    return getattr(reward_fn, POINTWISE_SCORE_ATTRIBUTE, None) if is_groupwise(reward_fn) else None


def rising_measure(reward_fn) -> str | None:
    """The evaluation metric that training on ``reward_fn`` raises (run/guard.py): eval/reward_mean, a groupwise
    reward's pointwise score (eval/reward_info/<entry>), or None when a groupwise reward declares none."""
    if not is_groupwise(reward_fn):
        return "eval/reward_mean"
    score = pointwise_score(reward_fn)
    return f"eval/reward_info/{score}" if score else None


IMAGE_FEATURES_ATTRIBUTE = "image_features"  # images [B, 3, H, W] -> [B, d]: a reward's own image encoder (CLIP's)


def image_features_of(reward_fn):
    """The image encoder a reward function carries (``fn.image_features``: a CLIP model it loaded, which
    run/reporting/image_stats.py's diversity reuses), or None."""
    return getattr(reward_fn, IMAGE_FEATURES_ATTRIBUTE, None)


# ----------------------------------------------------------------------------- videos (the video families, e.g. Wan)
VIDEO_ATTRIBUTE = "takes_videos"  # set True on a reward function that scores whole videos [B, F, 3, H, W]


def scores_frames(reward_fn: RewardFn, name: str) -> RewardFn:
    """``reward_fn`` as it scores videos: a video family's ``decode`` gives frames [B, F, 3, H, W]. A reward function
    with ``takes_videos = True`` (an attribute its factory sets) receives them as they are; any other is an image
    reward and receives the frames flattened [B * F, 3, H, W], each prompt and metadata repeated F times, and its
    per-frame rewards (and per-frame tensors of its info) are averaged per video. Images [B, 3, H, W] pass through."""
    takes_videos = bool(getattr(reward_fn, VIDEO_ATTRIBUTE, False))

    def scored(images, prompts, metadata):
        dims = getattr(images, "ndim", None)
        if takes_videos and dims == 4:
            raise ValueError(f"reward function {name!r} takes videos [B, F, 3, H, W] ({VIDEO_ATTRIBUTE}=True); "
                             f"this model makes images of shape {tuple(images.shape)}")
        if takes_videos or dims != 5:
            return reward_fn(images, prompts, metadata)
        if is_groupwise(reward_fn):  # its group would be the frames of several videos
            raise ValueError(f"reward function {name!r} is groupwise ({GROUPWISE_ATTRIBUTE}=True) and scores images; "
                             f"on a video model it must score whole videos ({VIDEO_ATTRIBUTE}=True)")
        b, f = images.shape[:2]
        rewards, info = reward_fn(images.flatten(0, 1), [p for p in prompts for _ in range(f)],
                                  [m for m in metadata for _ in range(f)])
        rewards = check_rewards(rewards, b * f, name).view(b, f).mean(1)
        return rewards, {key: per_video_mean(value, b, f) for key, value in (info or {}).items()}

    scored.__dict__.update(reward_fn.__dict__)
    scored.__wrapped__ = reward_fn
    return scored


def per_video_mean(value, videos: int, frames: int):
    """An info entry of B * F per-frame numbers -> its mean per video [B]; anything else as it is."""
    if isinstance(value, (list, tuple, np.ndarray)) and len(value) == videos * frames:
        try:
            value = torch.as_tensor(np.asarray(value, dtype=np.float64))
        except (TypeError, ValueError):
            return value
    if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == videos * frames:
        return value.double().reshape(videos, frames, *value.shape[1:]).mean(1)
    return value


def check_rewards(rewards, batch_size: int, name: str) -> torch.Tensor:
    """The reward function's output as a float64 tensor [B]; a clear error for a wrong type, shape or value."""
    if isinstance(rewards, (list, tuple)):
        rewards = np.asarray(rewards)
    if isinstance(rewards, np.ndarray):
        if not np.issubdtype(rewards.dtype, np.number):
            raise TypeError(f"reward function {name!r} returned an array of dtype {rewards.dtype}; expected numbers")
        rewards = torch.from_numpy(rewards)
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(
            f"reward function {name!r} returned {type(rewards).__name__}; expected a tensor, array or list of {batch_size} numbers"
        )
    rewards = rewards.detach().to("cpu", torch.float64)
    if rewards.ndim != 1 or rewards.shape[0] != batch_size:
        raise ValueError(
            f"reward function {name!r} returned shape {tuple(rewards.shape)} for {batch_size} images; expected ({batch_size},)"
        )
    bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"reward function {name!r} returned non-finite rewards at indices {bad}: {rewards[bad].tolist()}"
        )
    return rewards
