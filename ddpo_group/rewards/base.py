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
        return factory(**kwargs)

    return build


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
