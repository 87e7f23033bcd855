"""Train several runs one after another in each process of one process group: tests/models/test_family_matrix.py's
two processes over gloo, one launch for every family (the processes import torch and diffusers once).

    python tests/helpers/family_processes.py RUNS.json      (as the workers of launch_helpers.start_workers)

RUNS.json: [{"name": ..., "config": {"section.field": value, ...}}, ...], each run the grpo preset with those fields.
Each run is the Trainer's whole path but for the release of the process group in ``end_training``, which the next
run's Accelerator would have to create again at the same address: the group serves every run and is released once,
at the end."""

import json
import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(TESTS), TESTS]  # the repository (config, ddpo_group) and tests/ (helpers)

from accelerate.state import AcceleratorState, GradientState, PartialState  # noqa: E402

from config.base import get_config  # noqa: E402
from ddpo_group.run.processes.process_failures import release_process_group  # noqa: E402
from ddpo_group.run.trainer import Trainer  # noqa: E402
from helpers.processor_without_video import allow_a_processor_without_video  # noqa: E402
from helpers.trainer_helpers import set_fields, small_qwen_edit_sources  # noqa: E402


def main(path: str) -> None:
    allow_a_processor_without_video()  # as conftest.py: Qwen-Image-Edit's processor without torchvision
    small_qwen_edit_sources(setattr)  # as the matrix's in-process runs
    PartialState.destroy_process_group = lambda self, group=None: None  # the group stays for the next run
    with open(path) as f:
        runs = json.load(f)
    try:
        for run in runs:
            AcceleratorState._reset_state(reset_partial_state=True)  # a fresh Accelerator; the group is kept
            GradientState._reset_state()
            config = get_config("grpo")
            set_fields(config, run["config"])
            Trainer(config).run()
            print(f"trained {run['name']}", flush=True)
    finally:
        release_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
