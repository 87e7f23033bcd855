"""A deterministic test reward that can hang on a chosen call, so a test can SIGKILL a run mid-epoch.

``brightness``: the mean pixel value of each image. With ``HANG_REWARD_AT=k`` in the environment,
the k-th call (0-based, counted in this process) writes ``HANG_REWARD_MARKER`` and sleeps
``HANG_REWARD_SECONDS`` (600 by default), so a test waiting for the marker knows the training
process is in the middle of an epoch.
"""

import os
import threading
import time
from pathlib import Path


def make():
    calls = {"n": 0}
    lock = threading.Lock()
    hang_at = int(os.environ.get("HANG_REWARD_AT", "-1"))
    marker = os.environ.get("HANG_REWARD_MARKER", "")
    seconds = float(os.environ.get("HANG_REWARD_SECONDS", "600"))

    def brightness(images, prompts, metadata):
        with lock:
            index = calls["n"]
            calls["n"] += 1
        if index == hang_at:
            Path(marker).write_text(f"reward call {index}\n")
            time.sleep(seconds)  # the test signals the process here
        return images.double().mean(dim=(1, 2, 3)), {}

    return brightness
