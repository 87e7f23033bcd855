"""Every default lives in config/base.py: package code reads ``config.section.field`` and never restates a default
with ``.get("field", default)`` or ``getattr(x, "field", default)``."""

import ast
from pathlib import Path

from config.base import base

PACKAGE = Path(__file__).resolve().parents[2] / "ddpo_group"


def leaf_names(config, prefix=""):
    for key, value in config.items():
        if hasattr(value, "items") and len(value):
            yield from leaf_names(value, f"{prefix}{key}.")
        else:
            yield key


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
    names = {"eval_num_seeds", "ema_decay"}
    source = ("a = config.get('eval_num_seeds', 2)\nb = getattr(t, 'ema_decay', 0.9)\nc = config.eval_num_seeds\n"
              "d = state.get('ema_decay', 0.5)\ne = metrics.get('other', 1)\n")
    assert [line for line, _ in restated_defaults(source, names)] == [1, 2]


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
