"""Prompt functions, looked up by name, and the sampler that draws an epoch's prompts.

Contract (DDPO's): ``fn(rng=random.Random, **kwargs) -> (prompt, metadata)``, one prompt per call.
"""

from __future__ import annotations

import random
from importlib import resources
from typing import Callable

from ddpo_group.registry import Registry

PROMPT_REGISTRY = Registry("prompt_fn")
register_prompt_fn = PROMPT_REGISTRY.register


def get_prompt_fn(name: str) -> Callable:
    return PROMPT_REGISTRY.get(name)


def _asset_lines(filename: str) -> list[str]:
    text = resources.files("ddpo_group").joinpath("assets", filename).read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]


@register_prompt_fn("simple_animals")
def simple_animals(rng: random.Random | None = None):
    """One of DDPO's simple animal names, e.g. "cat"."""
    return (rng or random).choice(_asset_lines("simple_animals.txt")), {}


@register_prompt_fn("tiny_shapes")
def tiny_shapes(rng: random.Random | None = None, held_out: bool = False):
    """"a {color} {shape} on a {background} background" for the embedded model (held-out pairs on request)."""
    from ddpo_group.shapes import tiny_shapes as draw

    return draw(held_out=held_out, rng=rng)


class PromptSampler:
    """Draws prompts with its own random generator, so its position can be checkpointed."""

    def __init__(self, name: str, kwargs: dict | None = None, seed: int = 0):
        self.name = name
        self.fn = get_prompt_fn(name)
        self.kwargs = dict(kwargs or {})
        self.rng = random.Random(seed)

    def sample(self, n: int) -> tuple[list[str], list[dict]]:
        pairs = [self.fn(rng=self.rng, **self.kwargs) for _ in range(n)]
        if not pairs:
            return [], []
        prompts, metadata = zip(*pairs)
        bad = [p for p in prompts if not isinstance(p, str) or not p]
        if bad:
            raise ValueError(f"prompt function {self.name!r} returned {bad[0]!r}; expected a non-empty string")
        return list(prompts), list(metadata)

    def sample_epoch(self, num_groups: int, group_size: int) -> tuple[list[str], list[dict], list[int]]:
        """``num_groups`` prompts, each repeated ``group_size`` times, shuffled together.

        Returns (prompts, metadata, group_index) of length num_groups * group_size. Every process
        holds an identically seeded sampler, draws the same list and takes its own slice, so the
        copies of a prompt land on different processes and batches (Flow-GRPO's K-repeat sampler).
        """
        prompts, metadata = self.sample(num_groups)
        order = list(range(num_groups * group_size))
        self.rng.shuffle(order)
        groups = [i // group_size for i in order]
        return [prompts[g] for g in groups], [dict(metadata[g]) for g in groups], groups

    def state_dict(self) -> dict:
        return {"rng_state": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["rng_state"]
        self.rng.setstate((version, tuple(internal), gauss))
