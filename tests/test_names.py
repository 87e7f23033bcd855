"""One meaning per name. Under the trajectory convention (ddpo_group/sampling/__init__.py) x_0 is the initial noise and
x_T the final latent: the clean latent a forward process noises is x_clean and the denoiser's prediction of it
clean_hat, never "x0"; a config section is read under its own name, never a letter (``t`` is a timestep)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from ml_collections import ConfigDict

from config.base import base

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = {name for name, value in base().items() if isinstance(value, ConfigDict)}  # train, sample, kl, ...
# the places a reader meets the names: the package, the commands, the configs, the benchmarks and the docs
FOLDERS = ("ddpo_group", "scripts", "config", "bench", "docs")
SOURCES = sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md"))
SOURCES.append(ROOT / "README.md")
X0 = re.compile(r"(?<![A-Za-z_])x0(?![0-9])|_x0\b|\bx0_")
# where a former spelling must stand: the value accepted for one release, and the table of former names generated from it
FORMER_SPELLINGS = {ROOT / "ddpo_group" / "run" / "command" / "renamed_fields.py": {"latent_x0"},
                    ROOT / "docs" / "configuration.md": {"latent_x0"}}


def x0_names(text: str, allowed: set[str] = frozenset()) -> list[str]:
    """The lines of ``text`` that call something x0 (x0, x0_hat, pred_x0, latent_x0, ...), but for ``allowed`` words."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        words = {m.group(0) for m in re.finditer(r"\w*x0\w*", line)} - allowed
        if any(X0.search(word) for word in words):
            found.append(f"{number}: {line.strip()}")
    return found


def test_the_scan_finds_each_way_of_calling_the_clean_latent_x0():
    for line in ["x0 = batch.next_latents[:, -1]", "pred_x0 [B, T, ...]", "x0_hat(x_n)", 'critic.input="latent_x0"',
                 "x_s = (1 - s) x0 + s eps"]:
        assert x0_names(line), line
    for line in ["x_0 is the initial noise", "x_clean = batch.next_latents[:, -1]", "clean_hat(x_n)", "0x01", "x01"]:
        assert not x0_names(line), line


def test_no_latent_is_called_x0():
    found = [f"{path.relative_to(ROOT)}:{line}" for path in SOURCES
             for line in x0_names(path.read_text(), FORMER_SPELLINGS.get(path, set()))]
    assert not found, "a latent called x0 (x_0 is the initial noise here):\n" + "\n".join(found)


def letter_aliases(tree: ast.AST) -> list[str]:
    """Assignments of one of the run config's sections (``config.train``, ``self.config.sample``) to a one-letter
    name."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        targets = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
        for target, value in zip(targets, values):
            section = isinstance(value, ast.Attribute) and value.attr in SECTIONS and (
                (isinstance(value.value, ast.Name) and value.value.id == "config")
                or (isinstance(value.value, ast.Attribute) and value.value.attr == "config"))
            if section and isinstance(target, ast.Name) and len(target.id) == 1:
                found.append(f"{node.lineno}: {target.id} = ...config.{value.attr}")
    return found


def test_the_alias_scan_finds_a_letter_for_a_section():
    assert letter_aliases(ast.parse("s, t = config.sample, config.train\nt = self.config.train"))
    assert not letter_aliases(ast.parse("train = self.config.train\nt = batch.times['timesteps']\n"
                                        "p = self.transformer.config.patch_size"))


def test_no_config_section_goes_by_a_letter():
    found = [f"{path.relative_to(ROOT)}:{line}" for path in SOURCES if path.suffix == ".py"
             for line in letter_aliases(ast.parse(path.read_text()))]
    assert not found, "a config section read under a letter:\n" + "\n".join(found)
