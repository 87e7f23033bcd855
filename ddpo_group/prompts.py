"""Prompt functions, looked up by name or plugin, and the sampler that draws an epoch's prompts.

Contract (DDPO's): ``fn(rng=random.Random, **kwargs) -> (prompt, metadata)``, one prompt per call.
``config.prompt_fn`` is a registered name, a ``"package.module:function"`` (or
``"/path/file.py:function"``) path, or an entry point of group ``ddpo_group.prompts``
(see :mod:`ddpo_group.registry`); ``config.prompt_fn_kwargs`` are passed on every call.
"""

from __future__ import annotations

import random
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Callable

from ddpo_group.registry import Registry

PROMPT_ENTRY_POINT_GROUP = "ddpo_group.prompts"
PROMPT_REGISTRY = Registry("prompt_fn", entry_point_group=PROMPT_ENTRY_POINT_GROUP)
register_prompt_fn = PROMPT_REGISTRY.register


def get_prompt_fn(name: str) -> Callable:
    """The prompt function named by ``name``: registered name, "module:function" path or entry point."""
    return PROMPT_REGISTRY.resolve(name)


def _asset_lines(filename: str) -> list[str]:
    text = resources.files("ddpo_group").joinpath("assets", filename).read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]


@register_prompt_fn("simple_animals")
def simple_animals(rng: random.Random | None = None):
    """One of DDPO's simple animal names, e.g. "cat"."""
    return (rng or random).choice(_asset_lines("simple_animals.txt")), {}


@register_prompt_fn("tiny_shapes")
def tiny_shapes(rng: random.Random | None = None, held_out: bool = False, shapes=None):
    """"a {color} {shape} on a {background} background" for the embedded model (held-out pairs on request;
    ``shapes``, e.g. "circle,square", keeps those shapes only)."""
    from ddpo_group.models.shapes_data import tiny_shapes as draw

    return draw(held_out=held_out, rng=rng, shapes=shapes)


@lru_cache(maxsize=16)
def _file_lines(path: str, mtime: float) -> tuple[str, ...]:
    lines = tuple(line.strip() for line in Path(path).read_text().splitlines() if line.strip())
    if not lines:
        raise ValueError(f"prompt_fn from_file: {path!r} holds no prompt (one prompt per non-empty line)")
    return lines


@register_prompt_fn("from_file")
def from_file(rng: random.Random | None = None, path: str = ""):
    """A uniformly drawn line of the text file ``path`` (one prompt per line; blank lines skipped)."""
    if not path:
        raise ValueError("prompt_fn from_file needs prompt_fn_kwargs.path: a text file with one prompt per line")
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"prompt_fn from_file: path={path!r} does not exist")
    return (rng or random).choice(_file_lines(str(file.resolve()), file.stat().st_mtime)), {}


class PromptSampler:
    """Draws prompts with its own random generator, so its position can be checkpointed."""

    def __init__(self, name: str, kwargs: dict | None = None, seed: int = 0):
        self.name = name
        self.fn = get_prompt_fn(name)
        self.kwargs = dict(kwargs or {})
        self.rng = random.Random(seed)

    def sample(self, n: int) -> tuple[list[str], list[dict]]:
        pairs = [self._call(self.rng) for _ in range(n)]
        if not pairs:
            return [], []
        prompts, metadata = zip(*pairs)
        return list(prompts), list(metadata)

    def probe(self) -> None:
        """Call the prompt function once with a throwaway generator (the sampler's position is unchanged): a
        broken or empty prompt function fails at start, before any model loads."""
        self._call(random.Random(0))

    def _call(self, rng: random.Random) -> tuple[str, dict]:
        """One (prompt, metadata) pair from the prompt function, checked; errors name the function."""
        try:
            pair = self.fn(rng=rng, **self.kwargs)
        except Exception as error:  # the same exception type, its message prefixed with the function's name
            message = f"prompt function {self.name!r} raised {type(error).__name__}: {error}"
            try:
                renamed = type(error)(message)
            except Exception:
                renamed = RuntimeError(message)
            raise renamed from error
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(
                f"prompt function {self.name!r} returned {pair!r}; expected a (prompt, metadata) pair such as "
                "('a cat', {})"
            )
        prompt, metadata = pair
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"prompt function {self.name!r} returned {prompt!r}; expected a non-empty string")
        if not isinstance(metadata, dict):
            raise TypeError(f"prompt function {self.name!r} returned metadata {metadata!r}; expected a dict")
        return prompt, metadata

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


@register_prompt_fn("ocr")
def ocr(rng: random.Random | None = None):
    """A text-rendering caption with its text in double quotes, e.g. 'a red stop sign that says "STOP"'
    (a text asset); metadata["text"] is the quoted text, the target of the ``ocr`` reward."""
    from ddpo_group.rewards.ocr import quoted_text

    prompt = (rng or random).choice(_asset_lines("text_rendering.txt"))
    return prompt, {"text": quoted_text(prompt)}
