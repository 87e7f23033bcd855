"""What the documentation promises about the code: one trajectory index convention (x_0 the initial noise, x_T the
final latent: sampling/__init__.py) in every docstring, comment and page; every module of the package on the map
(docs/architecture.md's layout) and nothing on the map that is gone; every design note in docs/index.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import ddpo_group

ROOT = Path(ddpo_group.__file__).resolve().parents[1]
PACKAGE = ROOT / "ddpo_group"

# x_T next to a word of the initial noise, in a line that does not also name the final latent (a line stating the
# convention, "x_0 the initial noise .. x_T the final latent", names both)
INITIAL = re.compile(r"initial|N\(0, ?I\)|noise|drawn|\bdraw\b|init_noise_sigma", re.IGNORECASE)
X_T = re.compile(r"\bx_T\b")


def initial_noise_called_x_T(text: str) -> list[int]:
    """The numbers of the lines of ``text`` that call the initial noise x_T."""
    return [number for number, line in enumerate(text.splitlines(), 1)
            if X_T.search(line) and INITIAL.search(line) and "final" not in line.lower()]


def test_the_check_sees_the_initial_noise_called_x_T():
    assert initial_noise_called_x_T("    latents     [B, 4, H/8, W/8], x_T = N(0, I) (the pipeline's draw)") == [1]
    assert initial_noise_called_x_T('"""The initial noise x_T of a batch."""') == [1]
    assert initial_noise_called_x_T("x_0 the initial noise .. x_T the final latent") == []
    assert initial_noise_called_x_T("V(x_T) = R, the reward of the decoded image") == []


def test_no_text_calls_the_initial_noise_x_T():
    files = [p for folder in ("ddpo_group", "config", "scripts", "bench", "tests", "docs") for p in
             (ROOT / folder).rglob("*") if p.suffix in (".py", ".md") and p.resolve() != Path(__file__).resolve()]
    files.append(ROOT / "README.md")
    found = [f"{path.relative_to(ROOT)}:{n}" for path in files for n in initial_noise_called_x_T(path.read_text())]
    assert not found, "the initial noise is x_0 (sampling/__init__.py), not x_T: " + ", ".join(found)


def architecture_map() -> set[str]:
    """The paths (relative to ddpo_group/) that docs/architecture.md's layout names: a folder line ``name/`` opens a
    level two spaces deeper, a module line starts with its file name; descriptions continue in a deeper column."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    stack, names = [], set()
    for line in block.splitlines()[1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent % 2 or indent > 8:  # a description's continuation
            continue
        first = line.split()[0]
        depth = indent // 2 - 1  # ddpo_group/ itself is depth -1
        if depth < 0:
            continue
        del stack[depth:]
        if first.endswith("/"):
            stack.append(first.rstrip("/"))
            names.add("/".join(stack) + "/")
        elif first.endswith(".py"):
            names.add("/".join(stack + [first]))
    return names


def test_the_map_names_every_module_and_only_modules_that_exist():
    mapped = architecture_map()
    modules = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    folders = {p.parent.relative_to(PACKAGE).as_posix() + "/" for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE}
    assert modules - mapped == set(), f"modules missing from docs/architecture.md's layout: {sorted(modules - mapped)}"
    assert folders - mapped == set(), f"packages missing from docs/architecture.md's layout: {sorted(folders - mapped)}"
    gone = {name for name in mapped if not (PACKAGE / name).exists()}
    assert gone == set(), f"docs/architecture.md names modules that do not exist: {sorted(gone)}"


@pytest.mark.parametrize("note", sorted(p.name for p in (ROOT / "docs" / "design").glob("*.md")))
def test_the_index_lists_every_design_note(note):
    assert note in (ROOT / "docs" / "index.md").read_text(), f"docs/index.md does not list docs/design/{note}"
