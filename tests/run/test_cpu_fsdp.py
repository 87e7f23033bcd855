"""An FSDP launch whose processes run on the CPU: FSDP2 shards there too (the whole run: tests/run/test_scale_out.py);
what needs a GPU is refused, naming the field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from ddpo_group.errors import ConfigError
from ddpo_group.run.processes.cpu_fsdp import enable_fsdp_on_cpu, launch_shards

CPU_PROCESSES = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU)


def test_without_an_fsdp_launch_nothing_changes(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert enable_fsdp_on_cpu(CPU_PROCESSES, "no") is False
    assert [launch_shards(n, on_gpu) for n in (1, 2) for on_gpu in (False, True)] == [False] * 4


def test_an_fsdp_launch_shards_unless_it_is_one_process_on_the_cpu(monkeypatch):
    """What a resume checks a checkpoint against (run/persistence/resume_check.py): one CPU process has no process group, and
    accelerate keeps its model whole."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert [launch_shards(n, on_gpu) for n in (1, 2) for on_gpu in (False, True)] == [False, True, True, True]


@pytest.mark.parametrize("variables, message", [
    ({"FSDP_VERSION": "1"}, "fsdp_version=1 on the CPU: only FSDP2"),
    ({"FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true"}, "fsdp_offload_params=true moves weights"),
    ({"FSDP_VERSION": "2", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}, "fsdp_cpu_ram_efficient_loading=true moves"),
])
def test_what_needs_a_gpu_is_refused_naming_the_field(monkeypatch, variables, message):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        enable_fsdp_on_cpu(CPU_PROCESSES, "no")
