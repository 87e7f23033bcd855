"""A test reward whose process dies on a chosen call, so a test can see a reward server killed in the middle of a run.

``brightness``: the mean pixel value of each image. With ``DIE_REWARD_AT=k`` in the environment, the k-th call
(0-based, counted in this process) kills its own process with SIGKILL while the request is open: served by
``python -m ddpo_group.rewards.http_server``, the server is gone mid-request, as after a crash or an OOM kill.
"""

import os
import signal
import threading


def make():
    calls = {"n": 0}
    lock = threading.Lock()
    die_at = int(os.environ.get("DIE_REWARD_AT", "-1"))

    def brightness(images, prompts, metadata):
        with lock:
            index = calls["n"]
            calls["n"] += 1
        if index == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return images.double().mean(dim=(1, 2, 3)), {}

    return brightness
