"""run/process_failures.release_process_group: a run that stops with an error destroys its process group itself (an
atexit-time destruction can abort the process with exit -6 after its message), and is a no-op without one."""

from __future__ import annotations

import torch.distributed as dist

from ddpo_group.run.process_failures import release_process_group
from launch_helpers import free_port


def test_release_destroys_the_default_group_and_is_a_no_op_after_it():
    release_process_group()  # no group: nothing to do, no error
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert dist.is_initialized()
        release_process_group()
        assert not dist.is_initialized()
        release_process_group()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
