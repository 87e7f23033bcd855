"""Weighted combinations of reward functions.

    reward_fn = {"jpeg_compressibility": 1.0, "shapes_alignment": 2.0}
    R_i = sum_k w_k * r_k(image_i)

The combined function's info holds every component's unweighted reward under the component's
label (the trainer logs it as ``reward_info/<label>``) and each component's own info under
``<label>/<key>``. Factory keyword arguments are given per component::

    reward_fn_kwargs = {"aesthetic": {"clip_model_path": "...", "head_path": "..."}}

A combination with a groupwise component (rewards/base.py: ``is_groupwise``) is groupwise itself: it is called once
per prompt group, and its other components score that group's images as a batch.
"""

from __future__ import annotations

import ast
import numbers
from collections.abc import Mapping

import torch

from ddpo_group.rewards.base import (GROUPWISE_ATTRIBUTE, IMAGE_FEATURES_ATTRIBUTE, RewardFn, check_rewards,
                                     get_reward_factory, image_features_of, is_groupwise)


def _as_dict(value):
    return value.to_dict() if hasattr(value, "to_dict") else value


def parse_reward_spec(spec) -> dict[str, float]:
    """``{component: weight}`` of a reward spec.

    Accepted: a name / "module:factory" path / entry point (weight 1), a mapping name -> weight
    (dict or ConfigDict), or that mapping written as a JSON / Python literal string, as the
    command line gives it: ``--config.reward_fn='{"jpeg_compressibility": 1.0, "shapes_alignment": 2.0}'``.
    """
    if isinstance(spec, str):
        text = spec.strip()
        if not text.startswith("{"):
            if not text:
                raise ValueError("reward_fn is empty; give a reward name or {name: weight, ...}")
            return {text: 1.0}
        try:
            spec = ast.literal_eval(text)  # a JSON object of names and numbers is also a Python literal
        except (ValueError, SyntaxError) as error:
            raise ValueError(f"reward_fn={text!r} is not a valid {{name: weight}} literal ({error})") from None
    spec = _as_dict(spec)
    if not isinstance(spec, Mapping) or not spec:
        raise ValueError(f"reward_fn={spec!r} must be a reward name or a non-empty mapping {{name: weight}}")
    weights = {}
    for name, weight in spec.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"reward_fn: component name {name!r} must be a non-empty string")
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise ValueError(f"reward_fn: weight of {name!r} is {weight!r}; expected a number")
        weights[name] = float(weight)
    return weights


def component_label(name: str) -> str:
    """Log label of a component: its name, or the attribute part of a "module:factory" path."""
    return name.rpartition(":")[2] if ":" in name else name


def split_kwargs(components: dict[str, float], kwargs) -> dict[str, dict]:
    """Each component's factory kwargs: ``kwargs[name]`` (a mapping) per component.

    With a single component, flat kwargs (not nested under its name) go to it, as for a plain name.
    """
    kwargs = dict(_as_dict(kwargs) or {})
    names = list(components)
    if len(names) == 1 and not isinstance(kwargs.get(names[0]), Mapping):
        return {names[0]: kwargs}
    unknown = [key for key in kwargs if key not in components]
    if unknown:
        raise ValueError(
            f"reward_fn_kwargs keys {unknown} are not components of reward_fn {names}; with several rewards, "
            "give each component's arguments under its name: reward_fn_kwargs = {name: {...}}"
        )
    out = {}
    for name in names:
        value = _as_dict(kwargs.get(name, {}))
        if not isinstance(value, Mapping):
            raise ValueError(f"reward_fn_kwargs[{name!r}] = {value!r} must be a mapping of keyword arguments")
        out[name] = dict(value)
    return out


def make_reward_components(spec, kwargs=None) -> list[tuple[str, float, RewardFn]]:
    """(label, weight, fn) of each component of ``spec``; every factory is called once here."""
    components = parse_reward_spec(spec)
    per_component = split_kwargs(components, kwargs)
    labels = [component_label(name) for name in components]
    if len(set(labels)) < len(labels):  # two paths ending in the same function name: keep the full names
        labels = list(components)
    return [
        (label, weight, get_reward_factory(name)(**per_component[name]))
        for label, (name, weight) in zip(labels, components.items())
    ]


def make_combined_reward(spec, kwargs=None) -> RewardFn:
    """``fn`` returning sum_k w_k r_k (float64), with each component's reward and info in ``info``."""
    parts = make_reward_components(spec, kwargs)

    def combined(images, prompts, metadata):
        total = torch.zeros(len(prompts), dtype=torch.float64)
        info = {}
        for label, weight, fn in parts:
            rewards, component_info = fn(images, prompts, metadata)
            rewards = check_rewards(rewards, len(prompts), label)
            total += weight * rewards
            info[label] = rewards
            for key, value in (component_info or {}).items():
                info[f"{label}/{key}"] = value
        return total, info

    combined.components = [(label, weight) for label, weight, _ in parts]
    setattr(combined, GROUPWISE_ATTRIBUTE, any(is_groupwise(fn) for _, _, fn in parts))
    encoders = [image_features_of(fn) for _, _, fn in parts if image_features_of(fn) is not None]
    if encoders:  # the first component's image encoder
        setattr(combined, IMAGE_FEATURES_ATTRIBUTE, encoders[0])
    return combined
