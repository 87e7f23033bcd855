"""Reward functions: registry, plugin lookup and weighted combinations.

Contract: a factory ``make(**kwargs)`` loads whatever it needs once and returns
``fn(images, prompts, metadata) -> (rewards, info)``, where ``images`` is a float tensor
[B, 3, H, W] in [0, 1], ``prompts`` a list of B strings, ``metadata`` a list of B dicts,
``rewards`` B numbers and ``info`` a dict of extra per-sample values to log.

Videos (a video family such as Wan decodes frames [B, F, 3, H, W]): a reward function is an image reward
unless it has the attribute ``takes_videos = True`` (set by its factory: ``fn.takes_videos = True``). An image
reward receives the frames flattened, [B * F, 3, H, W], prompts and metadata repeated per frame, and its
per-frame rewards are averaged per video; a video reward receives [B, F, 3, H, W] (``rewards/base.py``'s
``scores_frames``; tests/plugins/video_reward.py is an example).

Groupwise rewards: a reward function with the attribute ``groupwise = True`` (``fn.groupwise = True``) is called
once per prompt group, with the group's G images, prompts and metadata, and returns G rewards that may depend on
each other (``pairwise.py``: a win rate under a pairwise judge, a rank). The trainer then gives each process whole
groups and scores each group where it was sampled (rollout/reward_scorer.py).

A factory is found by registered name, by ``"package.module:factory"`` (or
``"/path/file.py:factory"``), or as an entry point of group ``ddpo_group.rewards``
(see :mod:`ddpo_group.registry`). ``config.reward_fn`` is one such name, or a weighted
combination ``{"name": weight, ...}`` (see :mod:`ddpo_group.rewards.combine`).
"""

from __future__ import annotations

from ddpo_group.registry import import_submodules
from ddpo_group.rewards.base import (  # noqa: F401  (the package's interface)
    REWARD_ENTRY_POINT_GROUP, REWARD_REGISTRY, RewardFn, RewardUnavailable, check_rewards, get_reward_factory,
    image_features_of, is_groupwise, pointwise_score, register_reward, rising_measure,
)


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


# every module of the package, each registering its rewards (``@register_reward``): adding a reward is one file here.
# Their models and engines load only when a factory is built, so importing them needs nothing optional.
# http_server is a program (python -m ddpo_group.rewards.http_server) and registers nothing.
REWARD_MODULES = import_submodules(__name__, __path__, programs=("http_server",))
