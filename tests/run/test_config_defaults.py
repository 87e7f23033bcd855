"""Every default lives in config/base.py: package code reads ``config.section.field`` and never restates a default
with ``.get("field", default)`` or ``getattr(x, "field", default)``, and an algorithm function declares no default
for a parameter the trainer fills from the config."""

import ast
import inspect
from pathlib import Path

from config.base import base

PACKAGE = Path(__file__).resolve().parents[2] / "ddpo_group"


def leaf_names(config, prefix=""):
    """Every field's name, alone and dotted ("clip_range", "train.clip_range": a flattened config's key)."""
    for key, value in config.items():
        if hasattr(value, "items") and len(value):
            yield from leaf_names(value, f"{prefix}{key}.")
        else:
            yield key
            yield prefix + key


def restated_defaults(source: str, names: set) -> list:
    """(line, call) of every ``x.get("name", default)`` / ``getattr(x, "name", default)`` naming a config field."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "get" and len(node.args) == 2:
            if ast.unparse(func.value) == "state":  # a checkpoint's state dict, not a config
                continue
            key = node.args[0]
        elif isinstance(func, ast.Name) and func.id == "getattr" and len(node.args) == 3:
            key = node.args[1]
        else:
            continue
        if isinstance(key, ast.Constant) and key.value in names:
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_scan_finds_a_restated_default():
    names = {"eval_num_seeds", "ema_decay", "train.ema_decay"}
    source = ("a = config.get('eval_num_seeds', 2)\nb = getattr(t, 'ema_decay', 0.9)\nc = config.eval_num_seeds\n"
              "d = state.get('ema_decay', 0.5)\ne = metrics.get('other', 1)\nf = flat.get('train.ema_decay', 0.9)\n")
    assert [line for line, _ in restated_defaults(source, names)] == [1, 2, 6]


def test_package_code_restates_no_default():
    names = set(leaf_names(base()))
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line}: {call}"
                 for path in sorted(PACKAGE.rglob("*.py"))
                 for line, call in restated_defaults(path.read_text(), names)]
    assert not offenders, "defaults restated outside config/base.py:\n" + "\n".join(offenders)


def test_the_configuration_reference_is_generated_from_base_py():
    """docs/configuration.md is what scripts/config_reference.py makes of config/base.py: every field with its comment
    (the script refuses a field without one) and its default."""
    import subprocess
    import sys

    root = PACKAGE.parent
    out = subprocess.run([sys.executable, "scripts/config_reference.py", "--check"], cwd=root, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    text = (root / "docs" / "configuration.md").read_text()
    for field in ("kl.beta", "group_ppo.max_segment_steps", "sample.sde_window_size", "eval_num_seeds"):
        assert f"| `{field}` |" in text
    assert "| `train.epsilon` | `train.clip_range` |" in text  # the former names


def defaulted(fn, keywords: set) -> list:
    """The ``keywords`` of ``fn`` that have a default (each must be one of its parameters)."""
    import inspect

    parameters = inspect.signature(fn).parameters
    missing = keywords - set(parameters)
    assert not missing, f"{fn.__qualname__} has no parameter {sorted(missing)}"
    return sorted(k for k in keywords if parameters[k].default is not inspect.Parameter.empty)


def config_driven_parameters():
    """(function, the keywords the trainer fills from the config) of every algorithm function it calls so: each
    registered estimator's declared ``params``, each policy loss's aggregation and trust-region bounds (PolicyUpdater), the
    GROUP_PPO advantages' settings (group_ppo_advantage), DDPO's stat tracker (Trainer.build_algorithm)."""
    from ddpo_group.algorithms import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY, get_adv_estimator, get_policy_loss
    from ddpo_group.algorithms.group_ppo import group_ppo_from_values
    from ddpo_group.algorithms.stat_tracker import PerPromptStatTracker

    for name in ADV_ESTIMATOR_REGISTRY:
        spec = get_adv_estimator(name)
        yield spec.fn, set(spec.params)
    for name in POLICY_LOSS_REGISTRY:
        spec = get_policy_loss(name)  # the trust region's bounds it names (policy_losses.BOUNDS), as the update gives
        bounds = set(spec.bounds) & set(inspect.signature(spec.fn).parameters)  # (all of them to a **kwargs loss)
        yield spec.fn, bounds if spec.per_step else {"loss_agg_mode"} | bounds
    yield group_ppo_from_values, {"tau", "max_segment_steps", "numerical_floor", "gae_lambda", "norm_adv_by_std"}
    yield PerPromptStatTracker.__init__, {"buffer_size", "min_count"}


def test_no_algorithm_function_restates_a_config_default():
    def plugin(inputs, *, gamma: float = 1.0, gae_lambda: float, **_):
        return inputs

    assert defaulted(plugin, {"gamma", "gae_lambda"}) == ["gamma"]  # the scan finds one
    found = [(fn.__qualname__, defaulted(fn, keywords)) for fn, keywords in config_driven_parameters()]
    assert len(found) >= 15
    offenders = [(name, keywords) for name, keywords in found if keywords]
    assert not offenders, f"config-driven parameters with a default of their own: {offenders}"
