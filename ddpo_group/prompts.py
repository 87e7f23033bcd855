"""Prompt functions, looked up by name or plugin, and the sampler that draws an epoch's prompts.

Contract (DDPO's): ``fn(rng=random.Random, **kwargs) -> (prompt, metadata)``, one prompt per call.
``config.prompt_fn`` is a registered name, a ``"package.module:function"`` (or
``"/path/file.py:function"``) path, or an entry point of group ``ddpo_group.prompts``
(see :mod:`ddpo_group.registry`).

Keywords: a registration may declare its own default keywords, and ``config.prompt_fn_kwargs`` holds only the
user's overrides, merged on top of the chosen function's defaults:

    kwargs = {**registration defaults of config.prompt_fn, **config.prompt_fn_kwargs}

so the defaults of one prompt function never reach another: a preset that wants, say, a prompt file as its default
registers it (``register_prompt_fn("hard_shapes", defaults={"path": ...})(from_file)``) and names it in
``config.prompt_fn``, leaving ``config.prompt_fn_kwargs`` empty; ``--config.prompt_fn=simple_animals`` then runs
simple_animals with no keyword. A keyword the chosen function does not take is a ConfigError naming the function,
the keyword and the keywords it takes (run/config_checks.py, at start).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Callable

from ddpo_group.errors import ConfigError
from ddpo_group.models.source_images import NEGATIVE_PROMPT_KEY, SOURCE_IMAGE_KEY
from ddpo_group.registry import Registry, keyword_errors

PROMPT_ENTRY_POINT_GROUP = "ddpo_group.prompts"
PROMPT_REGISTRY = Registry("prompt_fn", entry_point_group=PROMPT_ENTRY_POINT_GROUP)


@dataclass(frozen=True)
class PromptFnSpec:
    """A prompt function and the default keywords of its registration; calling it applies them under the caller's."""

    fn: Callable
    name: str
    defaults: dict = field(default_factory=dict)

    def __call__(self, rng: random.Random | None = None, **kwargs):
        return self.fn(rng=rng, **{**self.defaults, **kwargs})

    def kwargs_errors(self, overrides: dict) -> list[str]:
        """A message per keyword of ``overrides`` (config.prompt_fn_kwargs) the function does not take."""
        return keyword_errors(self.fn, overrides, "prompt_fn_kwargs", f"prompt_fn {self.name!r}", skip=("rng",))

    def kwargs(self, overrides: dict | None = None) -> dict:
        """The keywords of a call: this registration's defaults, then ``overrides``; ConfigError for a wrong one."""
        overrides = dict(overrides or {})
        errors = self.kwargs_errors(overrides)
        if errors:
            raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))
        return {**self.defaults, **overrides}


def register_prompt_fn(name: str, defaults: dict | None = None) -> Callable[[Callable], Callable]:
    """Decorator registering a prompt function under ``name`` with its default keywords (the function is returned
    unchanged, so one function may be registered under several names with different defaults)."""
    def decorator(fn: Callable) -> Callable:
        spec = PromptFnSpec(fn, name, dict(defaults or {}))
        errors = spec.kwargs_errors(spec.defaults)
        if errors:
            raise ValueError(f"register_prompt_fn({name!r}): defaults the function does not take: {errors}")
        PROMPT_REGISTRY.register(name)(spec)
        return fn
    return decorator


def get_prompt_spec(name: str) -> PromptFnSpec:
    """The prompt function ``name`` names with its registration's defaults (a plugin has none)."""
    return PROMPT_REGISTRY.resolve_spec(name, PromptFnSpec, lambda fn, spec: PromptFnSpec(fn, spec))


def get_prompt_fn(name: str) -> Callable:
    """The prompt function named by ``name``: registered name (called with its registration's defaults),
    "module:function" path or entry point (the function itself)."""
    return PROMPT_REGISTRY.resolve(name)


def _asset_lines(filename: str) -> list[str]:
    text = resources.files("ddpo_group").joinpath("assets", filename).read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]


@register_prompt_fn("simple_animals")
def simple_animals(rng: random.Random | None = None):
    """One of DDPO's simple animal names, e.g. "cat"."""
    return (rng or random).choice(_asset_lines("simple_animals.txt")), {}


# tiny_shapes_hard (the default prompt set): the four captions the embedded model gets wrong most often;
# tiny_shapes_flow_hard: the same for the embedded flow-matching model
@register_prompt_fn("tiny_shapes_flow_hard", defaults={"hard": "tiny-shapes-flow"})
@register_prompt_fn("tiny_shapes_hard", defaults={"hard": True})
@register_prompt_fn("tiny_shapes")
def tiny_shapes(rng: random.Random | None = None, held_out: bool = False, shapes=None, hard: bool | str = False):
    """"a {color} {shape} on a {background} background" for the embedded models (held-out pairs on request;
    ``shapes``, e.g. "circle,square", keeps those shapes only; ``hard``: only the four captions of
    shapes_data.HARD_CAPTIONS, which the base model draws with the wrong shape about half the time, or with
    hard="tiny-shapes-flow" those of shapes_data.HARD_CAPTIONS_FLOW, which the flow model gets wrong more often)."""
    from ddpo_group.models.shapes_data import tiny_shapes as draw

    return draw(held_out=held_out, rng=rng, shapes=shapes, hard=hard)


@lru_cache(maxsize=16)
def _file_lines(path: str, mtime: float) -> tuple[str, ...]:
    lines = tuple(line.strip() for line in Path(path).read_text().splitlines() if line.strip())
    if not lines:
        raise ValueError(f"prompt_fn from_file: {path!r} holds no prompt (one prompt per non-empty line)")
    return lines


# the keys of a .jsonl row the loader reads: "prompt" (taken out of the metadata); NEGATIVE_PROMPT_KEY,
# "negative_prompt", and SOURCE_IMAGE_KEY, "image", checked and kept in the metadata (the model families read them
# there); every other key is free metadata, passed to the reward functions
JSONL_PROMPT_KEY = "prompt"


@lru_cache(maxsize=16)
def _jsonl_rows(path: str, mtime: float) -> tuple[tuple[str, dict], ...]:
    """The (prompt, metadata) rows of a .jsonl prompt file, checked; ``image`` paths made absolute (module
    docstring of ``from_file``)."""
    rows, folder = [], Path(path).parent
    for where, row in json_lines(path, "prompt_fn from_file"):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a row must be a JSON object such as {{\"prompt\": \"a cat\"}}, got "
                             f"{type(row).__name__}")
        prompt = row.pop(JSONL_PROMPT_KEY, None)
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{where}: field {JSONL_PROMPT_KEY!r} is {prompt!r}; it is required, a non-empty string")
        rows.append((prompt.strip(), checked_metadata(row, folder, where)))
    if not rows:
        raise ValueError(f"prompt_fn from_file: {path!r} holds no row (one JSON object per non-empty line)")
    return tuple(rows)


def json_lines(path, what: str, error: type[Exception] = ValueError):
    """(where, value) of each non-empty line of the .jsonl file ``path``, ``where`` naming ``what``, the file and the
    line; a line that is not JSON raises ``error`` saying where (the prompt files', sft.data_dir's metadata.jsonl)."""
    import json

    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{what}: {path}, line {number}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as failure:
            raise error(f"{where}: not valid JSON ({failure.msg} at column {failure.colno})") from None
        yield where, value


def checked_metadata(row: dict, folder: Path, where: str, error: type[Exception] = ValueError) -> dict:
    """A .jsonl row's metadata, checked in place: ``negative_prompt`` a string, ``image`` (source image paths relative
    to ``folder``) made absolute; the other keys free."""
    if NEGATIVE_PROMPT_KEY in row and not isinstance(row[NEGATIVE_PROMPT_KEY], str):
        raise error(f"{where}: field {NEGATIVE_PROMPT_KEY!r} is {row[NEGATIVE_PROMPT_KEY]!r}; it must be a string (the "
                    "row's negative prompt; leave the field out for the run's default)")
    if SOURCE_IMAGE_KEY in row:
        row[SOURCE_IMAGE_KEY] = source_image_paths(row[SOURCE_IMAGE_KEY], folder, where)
    return row


def source_image_paths(value, folder: Path, where: str) -> str | list[str]:
    """``image`` of a .jsonl row (a path relative to the file, or a list of them) as absolute paths, each checked."""
    paths = value if isinstance(value, list) else [value]
    if not paths or not all(isinstance(item, str) and item for item in paths):
        raise ValueError(f"{where}: field {SOURCE_IMAGE_KEY!r} is {value!r}; it must be a path relative to the file "
                         "or a non-empty list of them")
    resolved = []
    for item in paths:
        file = (folder / item).expanduser().resolve()
        if not file.is_file():
            raise FileNotFoundError(f"{where}: field {SOURCE_IMAGE_KEY!r}: {item!r} ({file}) does not exist")
        resolved.append(str(file))
    return resolved if isinstance(value, list) else resolved[0]


@register_prompt_fn("from_file")
def from_file(rng: random.Random | None = None, path: str = ""):
    """A uniformly drawn row of the prompt file ``path``.

    * ``.txt`` (any suffix but .jsonl): one prompt per line (blank lines skipped), metadata {}.
    * ``.jsonl``: one JSON object per line: ``prompt`` (required), ``image`` (optional: the source image of an edit,
      a path relative to the .jsonl file or a list of them; given to the model families that take images, e.g.
      flux_kontext, and to the reward functions as ``metadata["image"]``, the absolute path(s)), any other key free
      metadata for the reward functions (e.g. ``{"prompt": "...", "text": "STOP"}`` for the ocr reward), and
      ``negative_prompt`` (optional, a string: the row's negative prompt, the unconditional branch of its
      classifier-free guidance, for every family that guides with one; kept as ``metadata["negative_prompt"]``; rows
      without it get the run's: ``sample.negative_prompt``, else the family's default, models/families/base.py).
      Errors name the file, the line and the field.
    """
    if not path:
        raise ValueError("prompt_fn from_file needs prompt_fn_kwargs.path: a text file with one prompt per line "
                         "or a .jsonl file with one {\"prompt\": ...} object per line")
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"prompt_fn from_file: path={path!r} does not exist")
    if file.suffix == ".jsonl":
        prompt, metadata = (rng or random).choice(_jsonl_rows(str(file.resolve()), file.stat().st_mtime))
        return prompt, dict(metadata)
    return (rng or random).choice(_file_lines(str(file.resolve()), file.stat().st_mtime)), {}


class PromptSampler:
    """Draws prompts with its own random generator, so its position can be checkpointed."""

    def __init__(self, name: str, kwargs: dict | None = None, seed: int = 0):
        self.name = name
        spec = get_prompt_spec(name)
        self.fn = spec.fn
        self.kwargs = spec.kwargs(kwargs)  # the registration's defaults under the given ones (module docstring)
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

    def sample_epoch(self, num_groups: int, group_size: int,
                     whole_groups: bool = False) -> tuple[list[str], list[dict], list[int]]:
        """``num_groups`` prompts, each repeated ``group_size`` times.

        Returns (prompts, metadata, group_index) of length num_groups * group_size. Every process
        holds an identically seeded sampler, draws the same list and takes its own slice. By default
        all copies are shuffled together, so the copies of a prompt land on different processes and
        batches (Flow-GRPO's K-repeat sampler). With ``whole_groups`` the groups come in a shuffled
        order and each group's copies are consecutive: a slice whose start and size are multiples of
        ``group_size`` holds whole groups, whatever the number of processes.
        """
        prompts, metadata = self.sample(num_groups)
        if whole_groups:
            order = list(range(num_groups))
            self.rng.shuffle(order)
            groups = [g for g in order for _ in range(group_size)]
        else:
            order = list(range(num_groups * group_size))
            self.rng.shuffle(order)
            groups = [i // group_size for i in order]
        return [prompts[g] for g in groups], [dict(metadata[g]) for g in groups], groups

    def state_dict(self) -> dict:
        return {"rng_state": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["rng_state"]
        self.rng.setstate((version, tuple(internal), gauss))


def draw_prompts(prompt_fn: str, kwargs: dict, n: int, seed: int) -> tuple[list[str], list[dict]]:
    """``n`` prompts of ``prompt_fn`` drawn by a generator of their own seeded by ``seed`` (an evaluation's fixed
    set), distinct where the prompt function allows (at most 50 n draws), then cycled."""
    sampler = PromptSampler(prompt_fn, kwargs, seed=seed)
    prompts, metadata = [], []
    for _ in range(50 * n):
        (prompt,), (meta,) = sampler.sample(1)
        if prompt not in prompts:
            prompts.append(prompt)
            metadata.append(meta)
        if len(prompts) == n:
            break
    distinct = len(prompts)
    for k in range(n - distinct):  # fewer distinct prompts than asked: cycle through them
        prompts.append(prompts[k % distinct])
        metadata.append(metadata[k % distinct])
    return prompts, metadata


@register_prompt_fn("ocr")
def ocr(rng: random.Random | None = None):
    """A text-rendering caption with its text in double quotes, e.g. 'a red stop sign that says "STOP"'
    (a text asset); metadata["text"] is the quoted text, the target of the ``ocr`` reward."""
    from ddpo_group.rewards.ocr import quoted_text

    prompt = (rng or random).choice(_asset_lines("text_rendering.txt"))
    return prompt, {"text": quoted_text(prompt)}
