"""The ways a run stops on purpose, each with a message that says what happened and what to do next."""

from __future__ import annotations

import signal


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the fields and what is allowed."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed (incomplete, changed on disk, pickled, or not this run's); the message
    names the file and what to do instead."""


class NonFiniteLossError(FloatingPointError):
    """A loss (policy, KL or critic) became NaN or infinite; raised before the optimizer step it would feed.

    ``optimizer_steps`` counts the policy optimizer steps already taken in the epoch, so the trainer
    can name the global step that failed (None: the critic's update, after the epoch's policy steps).
    """

    def __init__(self, message: str, optimizer_steps: int | None = 0):
        super().__init__(message)
        self.optimizer_steps = optimizer_steps


class TrainingInterrupted(Exception):
    """Ctrl-C (SIGINT) or SIGTERM stopped the run; ``exit_code`` is the shell convention 128 + signal number.

    ``immediate``: a second signal asked to stop at once (the command line exits without waiting for
    worker threads such as a hung reward call).
    """

    def __init__(self, signum: int, message: str, immediate: bool = False):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + int(signum)
        self.immediate = immediate


class GuardStopped(TrainingInterrupted):
    """The guard stopped the run (guard.on_alarm="stop", run/guard.py): a checkpoint is written, the exit is clean (0)."""

    def __init__(self, message: str):
        super().__init__(0, message)
        self.exit_code = 0


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class EpochAbandoned(Exception):
    """A stop signal arrived while the epoch was still sampling: the epoch is dropped before any update."""
