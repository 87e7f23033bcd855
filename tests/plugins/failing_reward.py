"""A test reward that raises on a chosen call, so a test can see how a run reports a failure after some epochs.

``brightness``: the mean pixel value of each image. With ``FAIL_REWARD_AT=k`` in the environment, the k-th call
(0-based, counted in this process) raises ValueError naming the call.
"""

import os
import threading


def make():
    calls = {"n": 0}
    lock = threading.Lock()
    fail_at = int(os.environ.get("FAIL_REWARD_AT", "-1"))

    def brightness(images, prompts, metadata):
        with lock:
            index = calls["n"]
            calls["n"] += 1
        if index == fail_at:
            raise ValueError(f"the scoring service refused call {index}")
        return images.double().mean(dim=(1, 2, 3)), {}

    return brightness
