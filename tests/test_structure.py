"""The package's structure: imports run down the layers only, no module imports itself back through others, and
adding a reward or a model family is one file (the packages import every module they hold).

Layers, bottom to top (a module may import its own layer's and lower layers' modules, never a higher layer's)::

    errors, registry, timing, distributed
    algorithms/, sampling/
    models/, rewards/, prompts, reference/
    rollout/, update/
    run/
    offline/

Every ``from ddpo_group.X import`` and ``import ddpo_group.X`` counts, those inside functions too.
"""

from __future__ import annotations

import ast
import pkgutil
import sys
from pathlib import Path

import pytest

import ddpo_group

PACKAGE = Path(ddpo_group.__file__).parent
LAYERS = [
    {"errors", "registry", "timing", "distributed"},
    {"algorithms", "sampling"},
    {"models", "rewards", "prompts", "reference"},
    {"rollout", "update"},
    {"run"},
    {"offline"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> set[str]:
    """The package's modules that module ``name`` imports (a ``from package import submodule`` names the submodule)."""
    path = MODULES[name]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "ddpo_group"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "ddpo_group":
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                found.add(submodule if submodule in MODULES else target)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports(name) for name in MODULES}


def layer(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) == 1:
        return None  # ddpo_group/__init__.py
    for index, members in enumerate(LAYERS):
        if parts[1] in members:
            return index
    raise AssertionError(f"{name} is in no layer: add ddpo_group/{parts[1]} to LAYERS (and docs/architecture.md)")


def test_every_part_of_the_package_has_a_layer():
    for name in MODULES:
        layer(name)


def test_imports_run_down_the_layers():
    upward = [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
              for a, targets in GRAPH.items() for b in sorted(targets)
              if layer(a) is not None and layer(b) is not None and layer(b) > layer(a)]
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_module_imports_itself_back():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_parts_of_a_layer_import_each_other_one_way():
    """models/ may import from rewards/ or the reverse, not both (likewise for any two parts)."""
    parts = {}
    for a, targets in GRAPH.items():
        for b in targets:
            pa, pb = a.split(".")[1:2], b.split(".")[1:2]
            if pa and pb and pa != pb:
                parts.setdefault(pa[0], set()).add(pb[0])
    cycle = find_cycle(parts)
    assert cycle is None, "parts importing each other: " + " -> ".join(cycle)


def test_the_checks_see_an_upward_import_and_a_cycle():
    graph = {"ddpo_group.sampling.x": {"ddpo_group.run.y"}, "ddpo_group.run.y": {"ddpo_group.sampling.x"}}
    assert layer("ddpo_group.run.y") > layer("ddpo_group.sampling.x")
    assert find_cycle(graph) == ["ddpo_group.run.y", "ddpo_group.sampling.x", "ddpo_group.run.y"]


# ------------------------------------------------------------------ adding a reward or a family is one file
def discovered_and_files(package):
    files = {f"{package.__name__}.{info.name}" for info in pkgutil.iter_modules(package.__path__) if not info.ispkg}
    return files


def test_the_reward_and_family_packages_import_every_module_they_hold():
    import ddpo_group.models.families as families
    import ddpo_group.rewards as rewards

    assert set(rewards.REWARD_MODULES) == discovered_and_files(rewards) - {"ddpo_group.rewards.http_server"}
    assert set(families.FAMILY_MODULES) == discovered_and_files(families)
    # every built-in reward and family is registered by a module the discovery imported
    for registry, modules in ((rewards.REWARD_REGISTRY, rewards.REWARD_MODULES),
                              (families.FAMILY_REGISTRY, families.FAMILY_MODULES)):
        defined_here = {name: registry.get(name).__module__ for name in registry.names()
                        if registry.get(name).__module__.startswith("ddpo_group.")}
        assert defined_here and set(defined_here.values()) <= set(modules), defined_here
    assert {"jpeg_compressibility", "aesthetic", "http", "clipscore", "hpsv2", "ocr", "pickscore",
            "shapes_alignment"} <= set(rewards.REWARD_REGISTRY.names())
    assert {"sd", "sdxl", "sd3", "flux"} <= set(families.FAMILY_REGISTRY.names())


@pytest.fixture
def dropped_file(tmp_path, monkeypatch):
    """Drop a module file into a package: a folder added to the package's ``__path__`` (the package's own folder is
    the installed code), then the package's discovery run again; the registries are restored afterwards."""
    added = []

    def drop(package, filename: str, source: str):
        folder = tmp_path / package.__name__
        folder.mkdir(exist_ok=True)
        (folder / filename).write_text(source)
        monkeypatch.setattr(package, "__path__", [*package.__path__, str(folder)])
        added.append(f"{package.__name__}.{filename.removesuffix('.py')}")

    yield drop
    for name in added:
        sys.modules.pop(name, None)


def test_a_reward_file_dropped_into_the_rewards_package_is_registered(dropped_file, monkeypatch):
    import ddpo_group.rewards as rewards
    from ddpo_group.registry import import_submodules

    monkeypatch.setattr(rewards.REWARD_REGISTRY, "_items", dict(rewards.REWARD_REGISTRY._items))
    dropped_file(rewards, "dropped_test_reward.py", (
        "from ddpo_group.rewards import register_reward\n\n\n"
        "@register_reward('dropped_test_reward')\n"
        "def make():\n"
        "    return lambda images, prompts, metadata: ([1.0] * len(prompts), {})\n"))
    assert "dropped_test_reward" not in rewards.REWARD_REGISTRY
    modules = import_submodules(rewards.__name__, rewards.__path__, programs=("http_server",))
    assert "ddpo_group.rewards.dropped_test_reward" in modules
    reward = rewards.make_reward_fn("dropped_test_reward")
    assert reward(None, ["a", "b"], [{}, {}]) == ([1.0, 1.0], {})


def test_a_family_file_dropped_into_the_families_package_is_registered(dropped_file, monkeypatch):
    import ddpo_group.models.families as families
    from ddpo_group.registry import import_submodules

    monkeypatch.setattr(families.FAMILY_REGISTRY, "_items", dict(families.FAMILY_REGISTRY._items))
    monkeypatch.setattr(families, "_BY_PIPELINE_CLASS", dict(families._BY_PIPELINE_CLASS))
    dropped_file(families, "dropped_test_family.py", (
        "from ddpo_group.models.families import register_family\n"
        "from ddpo_group.models.families.base import ModelFamily\n\n\n"
        "class DroppedTestPipeline:\n"
        "    pass\n\n\n"
        "@register_family('dropped_test_family', DroppedTestPipeline)\n"
        "class DroppedTestFamily(ModelFamily):\n"
        "    pass\n"))
    modules = import_submodules(families.__name__, families.__path__)
    assert "ddpo_group.models.families.dropped_test_family" in modules
    assert families.get_family("dropped_test_family").__name__ == "DroppedTestFamily"
    assert families._BY_PIPELINE_CLASS["DroppedTestPipeline"] == "dropped_test_family"
