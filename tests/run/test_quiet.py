"""Known-harmless third-party messages are dropped by logger and text, nothing else (ddpo_group/run/command/quiet.py)."""

from __future__ import annotations

import logging

from ddpo_group.run.command.quiet import KNOWN_HARMLESS, silence_known_noise


class Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_only_the_named_messages_of_the_named_loggers_are_dropped():
    silence_known_noise()
    silence_known_noise()  # idempotent
    for name, fragment in KNOWN_HARMLESS:
        logger, other = logging.getLogger(name), logging.getLogger("somebody.else")
        assert sum(type(f).__name__ == "_DropMessages" for f in logger.filters) == 1
        seen = Collect()
        levels = {target: target.level for target in (logger, other)}  # another test may have raised diffusers' level
        for target in (logger, other):
            target.addHandler(seen)
            target.propagate = False
            target.setLevel(logging.WARNING)
        try:
            logger.warning(f"`X` {fragment} `Y`")  # dropped
            logger.warning("something else went wrong")  # the same logger, another message: kept
            other.warning(f"`X` {fragment} `Y`")  # the same text from another logger: kept
        finally:
            for target in (logger, other):
                target.removeHandler(seen)
                target.propagate = True
                target.setLevel(levels[target])
        assert seen.messages == ["something else went wrong", f"`X` {fragment} `Y`"]
