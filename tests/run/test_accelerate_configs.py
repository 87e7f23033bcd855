"""The accelerate config files of config/accelerate/: every one loads with accelerate's own loader and says what its
name says; single_gpu.yaml and multi_gpu.yaml run a tiny training job (2 gloo processes for the multi-GPU one: see
tests/helpers/launch_helpers.py for why through ACCELERATE_USE_CPU and not --cpu). The FSDP files and multi_node.yaml
run whole runs with a checkpoint and an exact resume in tests/run/test_scale_out.py."""

from __future__ import annotations

import subprocess

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType

from helpers.launch_helpers import ACCELERATE_CONFIGS, ROOT, accelerate_command, launch_environment

EXPECTED = {  # file: (distributed_type, num_processes, num_machines)
    "single_gpu.yaml": (DistributedType.NO, 1, 1),
    "multi_gpu.yaml": (DistributedType.MULTI_GPU, 8, 1),
    "multi_node.yaml": (DistributedType.MULTI_GPU, 16, 2),
    "fsdp_sd3.yaml": (DistributedType.FSDP, 8, 1),
    "fsdp_flux.yaml": (DistributedType.FSDP, 8, 1),
}
FSDP_BLOCKS = {"fsdp_sd3.yaml": ["JointTransformerBlock"],
               "fsdp_flux.yaml": ["FluxTransformerBlock", "FluxSingleTransformerBlock"]}


def test_the_shipped_configs_are_the_expected_ones():
    assert sorted(p.name for p in ACCELERATE_CONFIGS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_config_loads_with_accelerates_loader(name):
    config = load_config_from_file(str(ACCELERATE_CONFIGS / name))
    kind, processes, machines = EXPECTED[name]
    assert (config.distributed_type, config.num_processes, config.num_machines) == (kind, processes, machines)
    assert config.use_cpu is False and config.mixed_precision == "no"  # the training config's mixed_precision decides
    if name == "multi_node.yaml":  # the fields a user fills in on each machine
        assert config.machine_rank == 0 and config.main_process_ip and config.main_process_port == 29500
    if name in FSDP_BLOCKS:
        fsdp = config.fsdp_config
        assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        assert fsdp["fsdp_transformer_layer_cls_to_wrap"].split(",") == FSDP_BLOCKS[name]
        assert fsdp["fsdp_reshard_after_forward"] is True and fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    else:
        assert not config.fsdp_config


def test_the_fsdp_block_classes_exist_in_diffusers():
    """accelerate stops with "Could not find the transformer layer class" when a named class is not in the model."""
    from diffusers.models.transformers import transformer_flux, transformer_sd3

    assert transformer_sd3.SD3Transformer2DModel._no_split_modules == FSDP_BLOCKS["fsdp_sd3.yaml"]
    assert transformer_flux.FluxTransformer2DModel._no_split_modules == FSDP_BLOCKS["fsdp_flux.yaml"]


@pytest.mark.slow
@pytest.mark.parametrize("name, processes", [("single_gpu.yaml", 1), ("multi_gpu.yaml", 2)])
def test_a_tiny_run_under_the_config(tiny_model_dir, tmp_path, name, processes):
    command, env = accelerate_command(processes, ACCELERATE_CONFIGS / name)
    values = {"pretrained.model": tiny_model_dir, "logdir": str(tmp_path), "run_name": "run", "num_epochs": 1,
              "prompt_fn": "simple_animals", "reward_fn": "jpeg_compressibility", "sample.num_steps": 2,
              "sample.batch_size": 4, "sample.num_batches_per_epoch": 1, "train.batch_size": 4,
              "train.group_size": 4, "per_prompt_stat_tracking.min_count": 2, "log_images_every": 0}
    command += ["scripts/train.py", "--config", "config/base.py:grpo", *[f"--config.{k}={v}" for k, v in values.items()]]
    try:
        out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env=launch_environment(**env))
    except subprocess.TimeoutExpired as error:  # where it stopped: what every process printed
        printed = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                          for x in (error.stdout, error.stderr))
        pytest.fail(f"no exit within 300 s; the output so far:\n{printed[-6000:]}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"on {processes} process(es)" in out.stdout
    assert (tmp_path / "run" / "checkpoints" / "checkpoint_00000").is_dir()
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert f'"reward_count": {4 * processes}' in metrics  # 4 images per process, gathered
