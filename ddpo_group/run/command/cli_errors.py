"""What scripts/train.py prints and returns when a run does not end normally: one message, no traceback.

Exit codes:

====  ===========================================================================================================
0     the run finished
1     a failure while training (a reward or loss error, or anything else raised once the epochs began)
2     a usage error: the run did not start (the command line, the config, or the model, reward or prompts it names)
130   stopped by Ctrl-C (SIGINT; 128 + 2), after the clean stop; 143: by SIGTERM (128 + 15)
====  ===========================================================================================================

The message is the last thing printed (stderr); for a failure after training started, the note names the kept
checkpoint and the resume command. ``DDPO_GROUP_TRACEBACK=1`` in the environment prints the traceback above it.
"""

from __future__ import annotations

import os
import re
import sys
import traceback

FAILURE = 1
USAGE_ERROR = 2
TRACEBACK_ENV = "DDPO_GROUP_TRACEBACK"
PREFIX = "[ddpo_group]"

# ml_collections re-raises a config file's TypeError / ValueError with the traceback as text; absl adds the flag
_WRAPPED = ("Error whilst parsing config file:", "Traceback (most recent call last)")
_FLAG_PREFIX = re.compile(r"^(flag --\S+?=\S*?): ")
# ml_collections' KeyError for an unknown field: "'name'\nDid you mean "other" instead of "name"?"
_DID_YOU_MEAN = re.compile(r"""^'(?P<key>[^']+)'\s*Did you mean "(?P<suggestion>[^"]+)" instead""", re.S)


def traceback_requested() -> bool:
    return os.environ.get(TRACEBACK_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _text(error: BaseException) -> str:
    """The message of ``error`` as written: a KeyError's argument unquoted, an exception argument unwrapped."""
    if isinstance(error, (KeyError, AttributeError)) and len(error.args) == 1:
        arg = error.args[0]
        return _text(arg) if isinstance(arg, BaseException) else str(arg)
    return str(error)


def describe(error: BaseException, argv: list[str] | None = None) -> str:
    """The one message of ``error``: the original error under ml_collections' and absl's wrappers, an unknown config
    field named by its command-line override with ml_collections' suggestion; an error with no text by its type."""
    text = _text(error)
    flag = _FLAG_PREFIX.match(text)
    if any(marker in text for marker in _WRAPPED):
        inner = error.__cause__ or error.__context__
        if inner is not None:
            message = describe(inner, argv)
            return f"{flag.group(1)}: {message}" if flag and not message.startswith("flag --") else message
    unknown = _DID_YOU_MEAN.match(text)
    if unknown:
        key, suggestion = unknown.group("key"), unknown.group("suggestion")
        return f"{_override_naming(key, argv)}the config has no field {key!r}; did you mean {suggestion!r}?"
    if isinstance(error, (KeyError, AttributeError)) and argv and _override_naming(text.strip("'"), argv):
        return f"{_override_naming(text.strip(chr(39)), argv)}the config has no field {text}"
    return text.strip() or type(error).__name__


def _override_naming(key: str, argv: list[str] | None) -> str:
    """"--config.a.key=value: " for the one command-line override whose field path holds ``key``, else ""."""
    hits = [arg for arg in argv or [] if arg.startswith("--config.") and key in arg.split("=", 1)[0].split(".")]
    return f"{hits[0]}: " if len(hits) == 1 else ""


def report(error: BaseException, note: str = "", *, show: bool = True) -> None:
    """Print ``error``'s message (after its traceback when DDPO_GROUP_TRACEBACK is set) and ``note`` to stderr.

    ``show=False`` prints nothing (a process other than the main one, for an error every process raises alike)."""
    if not show:
        return
    sys.stdout.flush()
    if traceback_requested():
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    rank = os.environ.get("RANK", "0")
    prefix = PREFIX if rank == "0" else f"{PREFIX[:-1]} rank {rank}]"  # several processes: which one failed
    lines = [f"{prefix} error: {describe(error, sys.argv)}"]
    if note:
        lines.append(f"{prefix} {note}")
    if not traceback_requested():
        lines.append(f"{prefix} (set {TRACEBACK_ENV}=1 to see the traceback)")
    print("\n".join(lines), file=sys.stderr, flush=True)


def exit_with(error: BaseException, code: int, note: str = "", *, show: bool = True) -> None:
    """``report`` then exit with ``code``."""
    report(error, note, show=show)
    sys.exit(code)


def is_main_process() -> bool:
    """Rank 0, or no launcher: the process that speaks for an error every process raises alike."""
    return os.environ.get("RANK", "0") == "0"
