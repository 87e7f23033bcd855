"""Command-line helpers for scripts/train.py.

ml_collections' config flag requires ``--config=FILE:PRESET`` before any ``--config.field=value``
override. A wandb sweep that chooses the preset as a parameter (``config``) emits its arguments
in no guaranteed order, so the preset argument is moved to the front first. A field under its former name is renamed
(run/command/renamed_fields.py).
"""

from __future__ import annotations

import re
import sys


def config_flag_first(argv: list[str], name: str = "config") -> list[str]:
    """``argv`` with the ``--NAME=VALUE`` / ``--NAME VALUE`` argument moved right after the program name.

    Overrides (``--NAME.field=value``) keep their relative order; argv without the flag is returned unchanged.
    """
    pattern = re.compile(rf"^--?{re.escape(name)}(=|$)")
    for i, arg in enumerate(argv[1:], start=1):
        if pattern.match(arg):
            take = 1 if "=" in arg or i + 1 >= len(argv) else 2
            flag = argv[i : i + take]
            return argv[:1] + flag + argv[1:i] + argv[i + take :]
    return list(argv)


def parse_flags_or_exit(argv: list[str]) -> list[str]:
    """absl's flag parsing (with ml_collections' config flag: the preset and every override), for ``app.run``'s
    ``flags_parser``: a bad command line (unknown preset or flag, an override of a field that does not exist, a value
    of the wrong type) is one usage error (run/command/cli_errors.py) instead of absl's report or ml_collections' traceback."""
    from absl import flags

    from ddpo_group.run.command.cli_errors import USAGE_ERROR, exit_with, is_main_process
    from ddpo_group.run.command.renamed_fields import translate_argv

    say = (lambda line: print(line, file=sys.stderr)) if is_main_process() else (lambda line: None)
    argv = translate_argv(argv, say)
    sys.argv[:] = argv  # ml_collections reads the overrides from sys.argv
    try:
        return flags.FLAGS(argv)
    except Exception as error:  # absl's flags.Error, and the KeyError / AttributeError of an unknown config field
        exit_with(error, USAGE_ERROR, show=is_main_process())
