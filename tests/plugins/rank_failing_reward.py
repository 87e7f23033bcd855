"""A test reward that fails on one process only, so a test can see every process of a launch stop with the error.

``brightness``: the mean pixel value of each image. On the process whose accelerate process index is
``FAIL_REWARD_RANK`` (default 1), the ``FAIL_REWARD_AT``-th call (0-based, counted in that process) raises ValueError
(``FAIL_REWARD_MODE=raise``, the default), returns NaN for every image (``nan``: the reward check then rejects it on
that process) or sleeps ``FAIL_REWARD_SECONDS`` (``hang``; 600 by default). Other processes and calls score normally.
"""

import os
import threading
import time

from accelerate import PartialState


def make():
    calls = {"n": 0}
    lock = threading.Lock()
    fail_at = int(os.environ.get("FAIL_REWARD_AT", "-1"))
    rank = int(os.environ.get("FAIL_REWARD_RANK", "1"))
    mode = os.environ.get("FAIL_REWARD_MODE", "raise")

    def brightness(images, prompts, metadata):
        with lock:
            index = calls["n"]
            calls["n"] += 1
        rewards = images.double().mean(dim=(1, 2, 3))
        if index == fail_at and PartialState().process_index == rank:
            if mode == "hang":
                time.sleep(float(os.environ.get("FAIL_REWARD_SECONDS", "600")))
            if mode == "nan":
                return rewards * float("nan"), {}
            raise ValueError(f"the scoring service refused call {index} on process {rank}")
        return rewards, {}

    return brightness
