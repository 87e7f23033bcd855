import subprocess
import sys
from pathlib import Path

import pytest

from ddpo_group.config_validation import ConfigError, validate_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from config.base import PRESETS, get_config  # noqa: E402


def test_presets_validate():
    for name in PRESETS:
        config = get_config(name)
        validate_config(config)
        assert config.preset == name


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown preset 'nope'; valid presets: .*ddpo"):
        get_config("nope")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"sample.eta": 0.0}, r"sample.eta=0.0 must be > 0"),
        ({"sample.eta": -1.0}, r"sample.eta=-1.0"),
        ({"train.timestep_fraction": 0.0}, r"train.timestep_fraction=0.0 must be in \(0, 1\]"),
        ({"train.timestep_fraction": 1.5}, r"train.timestep_fraction=1.5"),
        ({"train.batch_size": 5}, r"train.batch_size=5 must divide .* = 32"),
        ({"train.gradient_accumulation_steps": 3}, r"train.gradient_accumulation_steps=3 must divide .* = 4"),
        ({"sample.guidance_scale": 1.0}, r"train.cfg=True contradicts sample.guidance_scale=1.0"),
        ({"mixed_precision": "fp8"}, r"mixed_precision='fp8' must be one of"),
        ({"wandb.mode": "maybe"}, r"wandb.mode='maybe'"),
        ({"train.clip_range": 0.0}, r"train.clip_range=0.0 must be > 0"),
        ({"train.group_size": 5}, r"train.group_size=5 must divide the samples per epoch, .* = 32"),
    ],
)
def test_contradictions_fail_naming_the_fields(overrides, message):
    config = get_config("ddpo")
    for key, value in overrides.items():
        section, _, field = key.rpartition(".")
        target = config[section] if section else config
        target[field] = value
    with pytest.raises(ConfigError, match=message):
        validate_config(config)


def test_every_error_is_reported_at_once():
    config = get_config("ddpo")
    config.sample.eta = 0.0
    config.train.timestep_fraction = 2.0
    with pytest.raises(ConfigError) as info:
        validate_config(config)
    assert "sample.eta" in str(info.value) and "train.timestep_fraction" in str(info.value)


def test_command_line_overrides_apply():
    """The absl/ml_collections flag path that scripts/train.py uses."""
    code = (
        "import sys; from absl import flags; from ml_collections import config_flags;"
        "c = config_flags.DEFINE_config_file('config');"
        "flags.FLAGS(sys.argv);"
        "print(c.value.train.learning_rate, c.value.sample.num_steps, c.value.use_lora, c.value.pretrained.model)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, "--config=config/base.py:ddpo", "--config.train.learning_rate=1e-4",
         "--config.sample.num_steps=7", "--config.use_lora=False", "--config.pretrained.model=/some/path"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )
    assert out.stdout.split() == ["0.0001", "7", "False", "/some/path"]
