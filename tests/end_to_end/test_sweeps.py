"""Every parameter value of every sweeps/*.yaml, turned into a command line by wandb's own agent code,
applies to the config through ml_collections' config flag (the path scripts/train.py uses) and validates."""

import importlib.util
import itertools
import math
from pathlib import Path

import pytest
import yaml
from absl import flags
from ml_collections import config_flags

from ddpo_group.algorithms import ADV_ESTIMATOR_REGISTRY, AGG_ALIASES, AGG_MODES, POLICY_LOSS_REGISTRY
from ddpo_group.run.command.cli import config_flag_first
from ddpo_group.run.config_checks import validate_config

ROOT = Path(__file__).resolve().parents[2]
SWEEPS = sorted((ROOT / "sweeps").glob("*.yaml"))
DISTRIBUTIONS = {"uniform", "log_uniform_values", "int_uniform", "q_uniform", "q_log_uniform_values", "normal"}


def defined_presets() -> set:
    spec = importlib.util.spec_from_file_location("config_base_for_sweeps", ROOT / "config" / "base.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from config.recipes import RECIPES  # what get_config of the file loaded by path reads too

    return set(module.PRESETS) | set(RECIPES)


def values_of(name: str, spec: dict) -> list:
    """The values a sweep parameter can take that a test can reach: all listed values, or min and max."""
    if "value" in spec:
        return [spec["value"]]
    if "values" in spec:
        assert spec["values"], f"{name}: empty values"
        return list(spec["values"])
    assert spec.get("distribution") in DISTRIBUTIONS, f"{name}: unknown distribution {spec.get('distribution')!r}"
    for bound in ("min", "max"):  # YAML reads 1e-4 (no dot) as a string: bayes would fail on it
        assert isinstance(spec[bound], (int, float)) and not isinstance(spec[bound], bool), f"{name}.{bound}={spec[bound]!r}"
    assert spec["min"] < spec["max"], name
    return [spec["min"], spec["max"]]


def agent_argv(sweep: dict, params: dict) -> list[str]:
    """The command wandb's agent runs for these parameter values (its own macro expansion)."""
    from wandb.sdk.launch.sweeps.utils import create_sweep_command_args

    macros = create_sweep_command_args({"args": {k: {"value": v} for k, v in params.items()}})
    macros.update(env=["/usr/bin/env"], interpreter=["python"], program=[sweep["program"]])
    argv = []
    for part in sweep["command"]:
        part = str(part)
        argv += macros[part[2:-1]] if part.startswith("${") and part.endswith("}") else [part]
    return argv


def parse_like_train_py(argv: list[str]):
    """scripts/train.py's parsing: preset argument first, then ml_collections' config flag."""
    argv = config_flag_first(argv)
    flag_values = flags.FlagValues()
    handle = config_flags.DEFINE_config_file("config", None, flag_values=flag_values, sys_argv=argv)
    flag_values(argv)
    return handle.value


def lookup(config, dotted: str):
    for part in dotted.split("."):
        config = config[part]
    return config


def check_algorithm_names(config):
    a = config.algorithm
    assert a.adv_estimator in ADV_ESTIMATOR_REGISTRY, a.adv_estimator
    assert a.policy_loss in POLICY_LOSS_REGISTRY, a.policy_loss
    assert a.loss_agg_mode in AGG_MODES or a.loss_agg_mode in AGG_ALIASES, a.loss_agg_mode
    validate_config(config)


def test_there_are_sweeps():
    assert {p.name for p in SWEEPS} >= {"group_ppo_threshold_lr.yaml", "beta_reference_mixup.yaml", "algorithm_comparison.yaml"}


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_every_sweep_parameter_applies_and_validates(path, monkeypatch):
    sweep = yaml.safe_load(path.read_text())
    assert sweep["program"] == "scripts/train.py" and (ROOT / sweep["program"]).is_file()
    assert sweep["method"] in ("grid", "random", "bayes")
    assert sweep["metric"]["name"] == "reward_mean"  # logged every epoch by the trainer
    command = [str(c) for c in sweep["command"]]
    assert "${program}" in command and ("${args}" in command or "${args_no_hyphens}" in command)
    params = sweep["parameters"]
    assert all(name == "config" or name.startswith("config.") for name in params), list(params)
    assert ("config" in params) != ("--config" in command), "the preset comes from the command or from a parameter"

    monkeypatch.chdir(ROOT)  # wandb agent runs from the repository root
    presets = defined_presets()
    grid = {name: values_of(name, spec) for name, spec in params.items()}
    combos = list(itertools.product(*grid.values()))
    assert len(combos) <= 500
    checked = 0
    for combo in combos:
        values = dict(zip(grid, combo))
        argv = agent_argv(sweep, values)
        assert argv[:3] == ["/usr/bin/env", "python", "scripts/train.py"]
        preset_arg = values.get("config") or command[command.index("--config") + 1]
        preset = preset_arg.rpartition(":")[2]
        assert preset_arg.startswith("config/base.py:"), preset_arg
        assert preset in presets, f"{path.name} selects preset {preset!r}, which config/base.py does not define"
        config = parse_like_train_py(argv[2:])
        for name, value in values.items():
            if name == "config":
                assert config.preset == preset
                continue
            applied = lookup(config, name[len("config."):])
            if isinstance(value, float):
                assert math.isclose(applied, value, rel_tol=1e-12), (name, applied, value)
            else:
                assert applied == value and type(applied) is type(value), (name, applied, value)
        validate_config(config)
        check_algorithm_names(config)
        checked += 1
    assert checked == len(combos)


def test_config_flag_first_moves_only_the_preset():
    argv = ["train.py", "--config.seed=1", "--config=config/base.py:ddpo", "--config.kl.beta=0.1"]
    assert config_flag_first(argv) == ["train.py", "--config=config/base.py:ddpo", "--config.seed=1", "--config.kl.beta=0.1"]
    argv = ["train.py", "--config.seed=1", "--config", "config/base.py:ddpo"]
    assert config_flag_first(argv) == ["train.py", "--config", "config/base.py:ddpo", "--config.seed=1"]
    assert config_flag_first(["train.py", "--config.seed=1"]) == ["train.py", "--config.seed=1"]


def test_out_of_order_preset_still_applies_overrides(monkeypatch):
    monkeypatch.chdir(ROOT)
    config = parse_like_train_py(["scripts/train.py", "--config.seed=7", "--config.kl.beta=0.04",
                                  "--config=config/base.py:ddpo"])
    assert config.seed == 7 and config.kl.beta == 0.04


def test_weighted_reward_override_through_the_cli(monkeypatch):
    monkeypatch.chdir(ROOT)
    config = parse_like_train_py(["train.py", "--config=config/base.py:ddpo",
                                  '--config.reward_fn={"jpeg_compressibility": 1.0, "shapes_alignment": 2.0}',
                                  '--config.reward_fn_kwargs={"shapes_alignment": {}}'])
    assert config.reward_fn == {"jpeg_compressibility": 1.0, "shapes_alignment": 2.0}
    assert config.reward_fn_kwargs.to_dict() == {"shapes_alignment": {}}
    config = parse_like_train_py(["train.py", "--config=config/base.py:ddpo", "--config.reward_fn=my_pkg.rewards:make"])
    assert config.reward_fn == "my_pkg.rewards:make"
