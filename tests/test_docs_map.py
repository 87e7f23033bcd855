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


def reading_path() -> list[str]:
    """The files docs/architecture.md lists for one step of the main job, in order."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## One step of the main job, the files to open", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. `([^`]+)`", section, re.MULTILINE)


def call_chains(trainer, targets: set[str]) -> dict[str, list[tuple[str, str]]]:
    """{target function: the (file, function) frames from Trainer.train_epoch down to its first call inside the policy
    update (a frame named chunk_loss on the way)} over one epoch of ``trainer``."""
    import sys

    stack, found = [], {}

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            stack.append((code.co_filename, code.co_qualname))
            if code.co_name in targets and code.co_name not in found:
                chain = []
                for file, name in reversed(stack):
                    chain.append((file, name))
                    if name == "Trainer.train_epoch":
                        break
                if any(name.endswith("chunk_loss") for _, name in chain):
                    found[code.co_name] = chain[::-1]
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        trainer.train_epoch(0)
    finally:
        sys.setprofile(None)
    return found


def test_one_step_of_the_main_job_runs_through_the_files_the_map_lists(tiny_model_dir, tmp_path):
    """GROUP_PPO's epoch on a tiny model: from Trainer.train_epoch the clipped surrogate is at most 4 calls deep and
    the log-probability of the training forward's step at most 6; every package file on both paths is in
    docs/architecture.md's list of the files to open, which has at most 8."""
    from helpers.trainer_helpers import tiny_trainer

    listed = reading_path()
    assert 0 < len(listed) <= 8 and all((ROOT / path).is_file() for path in listed), listed
    trainer = tiny_trainer("group_ppo", tiny_model_dir, tmp_path, **{"sample.sde_window_size": 2})
    chains = call_chains(trainer, {"clipped_surrogate", "gaussian_log_prob"})
    trainer.rollouts.close()
    assert set(chains) == {"clipped_surrogate", "gaussian_log_prob"}
    ours = {name: [(Path(file).resolve(), function) for file, function in chain
                   if Path(file).resolve().is_relative_to(ROOT / "ddpo_group")] for name, chain in chains.items()}
    assert len(ours["clipped_surrogate"]) - 1 <= 4, ours["clipped_surrogate"]
    assert len(ours["gaussian_log_prob"]) - 1 <= 6, ours["gaussian_log_prob"]
    files = {str(file.relative_to(ROOT)) for chain in ours.values() for file, _ in chain}
    assert files <= set(listed), f"files on the path and not in the list: {sorted(files - set(listed))}"
