"""Reward functions: registry, plugin lookup and weighted combinations.

Contract: a factory ``make(**kwargs)`` loads whatever it needs once and returns
``fn(images, prompts, metadata) -> (rewards, info)``, where ``images`` is a float tensor
[B, 3, H, W] in [0, 1], ``prompts`` a list of B strings, ``metadata`` a list of B dicts,
``rewards`` B numbers and ``info`` a dict of extra per-sample values to log.

A factory is found by registered name, by ``"package.module:factory"`` (or
``"/path/file.py:factory"``), or as an entry point of group ``ddpo_group.rewards``
(see :mod:`ddpo_group.registry`). ``config.reward_fn`` is one such name, or a weighted
combination ``{"name": weight, ...}`` (see :mod:`ddpo_group.rewards.combine`).
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


def get_reward_factory(name: str) -> Callable[..., RewardFn]:
    """The factory named by ``name``: registered name, "module:factory" path or ``ddpo_group.rewards`` entry point.

    The factory is wrapped so that wrong arguments (``reward_fn_kwargs``) give a TypeError naming the reward.
    """
    factory = REWARD_REGISTRY.resolve(name)

    def build(**kwargs) -> RewardFn:
        try:
            inspect.signature(factory).bind(**kwargs)
        except TypeError as error:
            raise TypeError(f"reward_fn {name!r} does not accept reward_fn_kwargs {kwargs}: {error}") from None
        except ValueError:  # no introspectable signature: let the call decide
            pass
        return factory(**kwargs)

    return build


def make_reward_fn(spec, **kwargs) -> RewardFn:
    """Build the reward function of ``spec`` (its factories load any model once).

    ``spec`` is a name / path / entry point (``kwargs`` go to its factory), or a weighted
    combination ``{"name": weight}`` (a mapping or its JSON/Python literal; ``kwargs`` are then
    given per component: ``{"name": {...}}``).
    """
    from ddpo_group.rewards.combine import make_combined_reward, parse_reward_spec, split_kwargs

    components = parse_reward_spec(spec)
    if isinstance(spec, str) and not spec.lstrip().startswith("{"):  # one factory: its info is logged as is
        (name,) = components
        return get_reward_factory(name)(**split_kwargs(components, kwargs)[name])
    return make_combined_reward(components, kwargs)


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


from ddpo_group.rewards import builtin  # noqa: E402,F401  (registers the built-in rewards)
from ddpo_group.rewards import aesthetic, http_client  # noqa: E402,F401  (models load only when built)
from ddpo_group.rewards import clipscore, hpsv2, ocr, pickscore  # noqa: E402,F401  (models and engines load only when built)
