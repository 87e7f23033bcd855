"""Write docs/configuration.md, the configuration reference, from config/base.py: every field, its default and the
comment that documents it there, then what each preset and recipe changes.

    python scripts/config_reference.py            # rewrite docs/configuration.md
    python scripts/config_reference.py --check    # exit 1 if docs/configuration.md is not what base.py gives
"""

import argparse
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from config import base as base_module  # noqa: E402
from config.recipes import RECIPES  # noqa: E402
from ddpo_group.run.command.renamed_fields import RENAMED, RENAMED_SECTIONS, RENAMED_VALUES  # noqa: E402

OUT = ROOT / "docs" / "configuration.md"
SECTION = re.compile(r"^\s*(\w+)\.(\w+) = (\w+) = ml_collections\.ConfigDict\(\)")  # config.train = train = ...
FIELD = re.compile(r"^\s*(\w+)\.(\w+) = ")
HEADER = re.compile(r"^#\s*-{3,}\s*(.*?)\s*(-{3,})?$")


def comments_by_line(source: str) -> dict[int, str]:
    """{line number: comment text} of every comment (tokenize: a '#' inside a string is no comment)."""
    return {tok.start[0]: tok.string.lstrip("#").strip()
            for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}


def documented_fields(source: str) -> list[tuple[str, str, str]]:
    """(group title, dotted field, documentation) in base()'s order, from its assignments and their comments."""
    lines = source.splitlines()
    comments = comments_by_line(source)
    start = next(i for i, line in enumerate(lines) if line.startswith("def base("))
    end = next(i for i, line in enumerate(lines) if i > start and line.startswith("def "))
    aliases, out, title, pending = {"config": ""}, [], "", []
    for number in range(start + 1, end):
        line = lines[number].strip()
        comment = comments.get(number + 1, "")
        if line.startswith("#"):
            header = HEADER.match(line)
            if header:
                title, pending = header.group(1), []
            elif pending or comment:
                pending.append(comment)
            continue
        section = SECTION.match(lines[number])
        if section and section.group(1) in aliases:  # a section of the config or of one of its sections
            aliases[section.group(3)] = aliases[section.group(1)] + section.group(2) + "."
        field = FIELD.match(lines[number])
        if field and field.group(1) in aliases and not section:
            block = " ".join(pending)
            doc = f"{comment} ({block})" if comment and block else comment or block
            out.append((title, aliases[field.group(1)] + field.group(2), doc))
        if not line.startswith("#") and line:
            pending = [] if field or section else pending
    return out


def value_text(value) -> str:
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    return "`" + repr(value).replace("|", "\\|") + "`"


def read(config, dotted: str):
    for part in dotted.split("."):
        config = config[part]
    return config


def flat(config, prefix=""):
    for key, value in config.items():
        if hasattr(value, "items") and len(value):
            yield from flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def reference() -> str:
    source = (ROOT / "config" / "base.py").read_text()
    base = base_module.base()
    rows = documented_fields(source)
    missing = sorted(set(dict(flat(base))) - {field for _, field, _ in rows})
    if missing:
        raise SystemExit(f"config/base.py fields without a documented assignment: {missing}")
    undocumented = [field for _, field, doc in rows if not doc]
    if undocumented:
        raise SystemExit(f"config/base.py fields without a comment: {undocumented}")
    text = ["# Configuration reference", "",
            "Every field of `config/base.py`, its default and what it does (this page is generated from the comments "
            "there by `python scripts/config_reference.py`). Set a field on the command line with "
            "`--config.SECTION.FIELD=VALUE`; a preset (`--config config/base.py:NAME`) changes the fields listed at "
            "the end.", ""]
    title = None
    for group, field, doc in rows:
        if group != title:
            title = group
            text += ["", f"## {group[0].upper() + group[1:]}", "", "| field | default | meaning |", "|---|---|---|"]
        text.append(f"| `{field}` | {value_text(read(base, field))} | {doc.replace('|', '/')} |")
    text += ["", "## Presets and recipes", "",
             "What each preset (config/base.py) and recipe (config/recipes.py), both named as `config/base.py:NAME`, "
             "sets differently from the defaults above.", "",
             "| preset | fields |", "|---|---|"]
    defaults = dict(flat(base))
    for name in list(base_module.PRESETS) + list(RECIPES):
        config = base_module.get_config(name)
        changed = [f"`{key}={value_text(value)[1:-1]}`" for key, value in flat(config)
                   if key in defaults and repr(value) != repr(defaults[key])]
        text.append(f"| `{name}` | {', '.join(changed) or '(the defaults)'} |")
    renamed = {**RENAMED, **{f"{old}.*": f"{new}.*" for old, new in RENAMED_SECTIONS.items()},
               **{f"{field}={old}": f"{field}={new}" for field, values in RENAMED_VALUES.items()
                  for old, new in values.items()}}
    text += ["", "## Former names", "",
             "Accepted on the command line, in sweep files and in a saved run's config.json for one release, with a "
             "message naming the new name.", "", "| former name | name |", "|---|---|"]
    text += [f"| `{old}` | `{new}` |" for old, new in renamed.items()]
    return "\n".join(text) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with docs/configuration.md instead of writing it")
    args = parser.parse_args()
    text = reference()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            raise SystemExit(f"{OUT.relative_to(ROOT)} is stale: run python scripts/config_reference.py")
        print(f"{OUT.relative_to(ROOT)} is up to date")
        return
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
