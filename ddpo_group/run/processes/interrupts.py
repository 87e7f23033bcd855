"""Ctrl-C (SIGINT) and SIGTERM during training.

The first signal only sets a flag, which the trainer reads at clean points: an epoch still
sampling is dropped before the next sampling batch (sampling_snapshot.py undoes what it changed),
an epoch already updating the policy is finished; then the trainer writes a checkpoint of the last
finished epoch and stops with :class:`~ddpo_group.errors.TrainingInterrupted` (exit code 128 +
signal). A second signal stops at once, without a checkpoint of the unfinished epoch (the last
complete checkpoint is untouched: checkpoints are written atomically).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager

from ddpo_group.errors import TrainingInterrupted, signal_name

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Records the first SIGINT / SIGTERM while installed; raises TrainingInterrupted on the second."""

    def __init__(self, resume_hint: str = ""):
        self.signum: int | None = None
        self.resume_hint = resume_hint
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @contextmanager
    def installed(self):
        """Handle the stop signals inside the block (main thread only; elsewhere signals keep their handlers)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        try:
            yield self
        finally:
            self._restore()

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        name = signal_name(signum)
        if self.signum is None:
            self.signum = signum
            _say(
                f"[ddpo_group] received {name}: stopping cleanly (an epoch still sampling is dropped, an epoch already "
                f"updating is finished), then writing a checkpoint (send {name} again to stop at once, without one)"
            )
            return
        self._restore()
        raise TrainingInterrupted(
            signum, f"training stopped at once by a second {name}; no checkpoint of the unfinished epoch was written. "
            f"{self.resume_hint}", immediate=True,
        )


def _say(message: str) -> None:
    """Write to stderr from a signal handler: os.write, as print() may be in the middle of a write (reentrant)."""
    try:
        os.write(sys.stderr.fileno(), (message + "\n").encode())
    except (OSError, ValueError, AttributeError):  # no usable stderr descriptor: stay silent rather than fail
        pass
