"""What the processes of a run (``accelerate launch``) exchange below the run loop: the failure flag before each of
our collectives, and the gathers of a round. rollout/ and run/ both build on it.

* the status exchange: before each of our collectives (``ProcessShards.gather``, the run's stop agreement) every
  process first all-reduces a failure flag (``check_peers``). A process whose epoch raised meets the others there
  once, with flag 1 (run/processes/process_failures.py: ``share_failure``). Then every process knows which processes failed and
  why: the healthy ones raise ``ProcessFailed`` naming them and their errors, a failed one raises its own error. A
  peer that never arrives (it died, or hung past ``collective_timeout_s``) makes the exchange fail: ``ProcessLost``.
* ``ProcessShards``: the global round of samples, each process's slice of it, and the gather over the processes (in
  process order, after ``check_peers``).

torch is imported where it is used: scripts/train.py imports this module before the command line is known good.
"""

from __future__ import annotations


class ProcessFailed(RuntimeError):
    """Raised on the healthy processes when others failed; ``failures``: [(process index, error message)]."""

    def __init__(self, failures: list[tuple[int, str]]):
        self.failures = failures
        if len(failures) == 1:
            rank, text = failures[0]
            message = f"process {rank} failed: {text}"
        else:
            message = f"processes {', '.join(str(r) for r, _ in failures)} failed: " + \
                      "; ".join(f"process {r}: {text}" for r, text in failures)
        super().__init__(message + " (every process stopped)")


class ProcessLost(RuntimeError):
    """Another process never reached a collective: it died, or it hung past ``collective_timeout_s``."""


def check_peers(accelerator) -> None:
    """Before a collective, on every process: raise ProcessFailed if another process failed (a no-op alone)."""
    if accelerator.num_processes > 1:
        failures = exchange_or_lost(accelerator, None)
        if failures:
            raise ProcessFailed(failures)


def exchange_or_lost(accelerator, message: str | None) -> list[tuple[int, str]]:
    """``exchange_failures``, a peer that never arrives raised as ProcessLost."""
    try:
        return exchange_failures(accelerator, message)
    except RuntimeError as error:  # torch.distributed's errors: a timeout, a peer's closed connection
        raise ProcessLost(
            "another process did not reach this point: it died, or it hung past collective_timeout_s (raise it for "
            f"a slow reward or checkpoint); its own output says why. torch.distributed: {error}"
        ) from error


def exchange_failures(accelerator, message: str | None) -> list[tuple[int, str]]:
    """The failures of every process, [(index, message)]: one all-reduced flag; the messages only when it is set."""
    import torch  # here: scripts/train.py imports this module before the command line is known good
    import torch.distributed as dist

    flag = torch.tensor([0 if message is None else 1], dtype=torch.int64, device=accelerator.device)
    dist.all_reduce(flag)
    if int(flag) == 0:
        return []
    messages = [None] * accelerator.num_processes
    dist.all_gather_object(messages, message)
    return [(rank, text) for rank, text in enumerate(messages) if text is not None]


class ProcessShards:
    """The global round of samples and each process's slice of it."""

    def __init__(self, accelerator, local: int):
        self.accelerator = accelerator
        self.local = local  # samples per process per round

    @property
    def mine(self) -> slice:
        rank = self.accelerator.process_index
        return slice(rank * self.local, (rank + 1) * self.local)

    @property
    def total(self) -> int:
        return self.local * self.accelerator.num_processes

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate a per-process tensor over processes, in process order, on the CPU (ProcessFailed when another
        process failed instead of meeting this gather: check_peers)."""
        check_peers(self.accelerator)
        return self.accelerator.gather(tensor.contiguous().to(self.accelerator.device)).cpu()

    def local_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """This process's rows of a tensor over the gathered round, on its device as float32."""
        return tensor[self.mine].float().to(self.accelerator.device)

    def any(self, flag: bool) -> bool:
        """True when ``flag`` is true on any process (every process must take the same branch)."""
        if self.accelerator.num_processes == 1:
            return bool(flag)
        import torch

        return bool(self.gather(torch.tensor([1.0 if flag else 0.0])).max() > 0)
