"""One process failing stops them all.

Several processes (``accelerate launch``) meet in collectives: the gathers of a round, the stop agreement, the
gradient all-reduce. When one process raises (a reward function that fails, a non-finite reward or loss, any error),
the others would wait in their next collective forever. Two mechanisms bound that wait:

* a status exchange before each of our collectives (``ProcessShards.gather``, the stop agreement): every process first
  all-reduces a failure flag (``check_peers``, ddpo_group/distributed.py). A process whose epoch raised meets the
  others there once, with flag 1 (``share_failure``, where the error leaves the epoch loop). Then every process knows
  which processes failed and why: the healthy ones raise ``ProcessFailed`` naming them and their errors, a failed one
  raises its own error. Every process stops with the same exit code (run/command/cli_errors.py: FAILURE), no checkpoint is
  written, the last complete one is kept.
* the same exchange at each step of a checkpoint's save (``settle``, run/persistence/checkpointing.py): a process whose part of
  the save failed (a full disk on any process) meets the others there with its error, so every process stops at that
  step, the unfinished checkpoint removed, instead of waiting at the save's next barrier;
* a timeout on the process group (``collective_timeout_s``, through accelerate's InitProcessGroupKwargs): a collective
  the exchange does not guard (the gradient all-reduce inside backward, torch.distributed.checkpoint's own) or a
  process that hangs ends in an error after that many seconds instead of never.

A non-finite loss needs no exchange of its own: DDP and FSDP all-reduce the gradients, so a NaN on one process makes
the gradient norm non-finite on every process, and every process raises at the same optimizer step
(update/updater.py and update/critic.py check where the gradients are synchronised).
"""

from __future__ import annotations

import datetime

from ddpo_group.distributed import ProcessFailed, ProcessLost, exchange_failures, exchange_or_lost
from ddpo_group.errors import EpochAbandoned, TrainingInterrupted

SHARED = "shared_with_peers"  # set on an error its process has already told the others of (settle)

def process_group_kwargs(config):
    """accelerate's InitProcessGroupKwargs with ``collective_timeout_s`` (the backstop above)."""
    from accelerate.utils import InitProcessGroupKwargs

    seconds = config.collective_timeout_s
    return InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=seconds))


def share_failure(accelerator, error: BaseException) -> None:
    """On a process whose epoch raised ``error``: tell the others, which wait at their next ``check_peers``.

    Not for stops every process takes together (a stop signal, the others' failure: ProcessFailed, an error ``settle``
    shared already), nor for KeyboardInterrupt / SystemExit, which reach every process of a launch alike."""
    if accelerator.num_processes == 1 or not isinstance(error, Exception):
        return
    if getattr(error, SHARED, False) or isinstance(error, (ProcessFailed, ProcessLost, TrainingInterrupted,
                                                               EpochAbandoned)):
        return
    from ddpo_group.run.command.cli_errors import describe

    try:
        exchange_failures(accelerator, describe(error))
    except Exception:  # the others are gone too (their process died): the caller raises ``error`` all the same
        pass


def settle(accelerator, error: Exception | None) -> None:
    """At a step every process reaches (a checkpoint's): tell the others whether this process's part failed, and stop
    every process there if any did: this process raises its own ``error`` (marked as shared: ``share_failure`` does
    not send it again), the others ProcessFailed naming it. Alone: raise ``error`` if any."""
    if accelerator.num_processes == 1:
        if error is not None:
            raise error
        return
    from ddpo_group.run.command.cli_errors import describe

    try:
        failures = exchange_or_lost(accelerator, None if error is None else describe(error))
    except ProcessLost:
        if error is not None:  # the others are gone: this process's own error says most
            raise error from None
        raise
    if error is not None:
        setattr(error, SHARED, True)
        raise error
    if failures:
        raise ProcessFailed(failures)


def release_process_group() -> bool:
    """Destroy the default process group, if any, before the interpreter exits (torch's shutdown rule); True if
    there was one.

    ``Accelerator.end_training`` does it after a finished run; a run that stops with an error must do it too."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        dist.destroy_process_group()
    except Exception:  # a broken group (a peer died): nothing is left to release that the exit won't
        pass
    return True


def exit_launched_process(stop: SystemExit) -> None:
    """End a process of a multi-process run that stops with ``stop`` (its message printed; SystemExit(0): a finished
    run) at once, with its code.

    Left to interpreter finalization, the threads of gloo's process group and store can abort the process after its
    message ("terminate called without an active exception", exit -6 instead of the documented code), even after
    ``destroy_process_group`` and after a run that finished, depending on which process leaves first
    (pytorch#190489). Everything this project writes is closed by then (checkpoints, metrics, the trackers finished),
    so nothing is lost by skipping it; a single process (no group, no WORLD_SIZE > 1 from the launcher) returns and
    exits as usual."""
    import os
    import sys

    released = release_process_group()
    if not (released or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        return
    code = stop.code
    if code is not None and not isinstance(code, int):  # sys.exit("message"): Python prints it and exits 1
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
