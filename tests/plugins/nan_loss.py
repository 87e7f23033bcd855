"""A test policy loss that turns NaN from a chosen epoch on, so a test can see how a run reports a loss failure.

``vanilla`` (PPO-clip), except that with ``NAN_LOSS_FROM_CALL=k`` in the environment every call from the k-th on
(0-based, counted in this process) returns NaN; with ``NAN_LOSS_RANK=r`` too, only on the process whose accelerate
process index is r (a NaN on one process of several).
"""

import os

from accelerate import PartialState

from ddpo_group.algorithms import policy_loss
from ddpo_group.algorithms.policy_losses import vanilla_policy_loss

CALLS = {"n": 0}


@policy_loss(per_step=True)
def nan_after(*args, **kwargs):
    loss, metrics = vanilla_policy_loss(*args, **kwargs)
    CALLS["n"] += 1
    rank = os.environ.get("NAN_LOSS_RANK", "")
    if rank and PartialState().process_index != int(rank):
        return loss, metrics
    if CALLS["n"] - 1 >= int(os.environ.get("NAN_LOSS_FROM_CALL", "-1")) >= 0:
        loss = loss * float("nan")
    return loss, metrics
