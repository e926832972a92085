"""Writes docs/layout.md: every module of popmeta/, with the first paragraph of its docstring.

    python docs/layout.py           # rewrite docs/layout.md from the tree
    python docs/layout.py --check   # exit 1 if docs/layout.md differs from the tree

``tests/test_docs.py`` fails when docs/layout.md lists a module that
does not exist or misses one that does, so the page follows every split and
rename. The modules are read with ``ast``, never imported.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "layout.md"

HEADER = """\
# Layout

Every module of `popmeta/`, with the first paragraph of its docstring. This page
is written by `python docs/layout.py` from the tree, and
`tests/test_docs.py` fails when it lists a module that does not exist
or misses one that does: after adding, splitting or renaming a module,
rerun the script rather than editing this page.

Imports only ever point down the layers, from `cli.py` towards `core/`;
`tests/test_layers.py` holds the layer order and fails on any import that
points up. [design.md](design.md) is the map: layers, data flow, contracts,
the learner and the Ray shell.

Beside `popmeta/`:

| path | what it is |
|---|---|
| `docs/` | design, usage, configs, faults, checkpoints, clusters, results, performance, the estimators' maths, Ray facts, the kinds a config names, the generalist |
| `configs/` | experiment YAMLs; `configs/cluster/` Ray cluster-launcher YAMLs |
| `constraints.txt` | the exact versions CI installs |
| `bench/` | benchmark scripts (numbers, never pass/fail) |
| `tests/` | pytest, mirroring the package |

## popmeta/

| module | what it is |
|---|---|
"""


def summary(path: Path) -> str:
    """The first paragraph of the module's docstring, on one line ("" when it has none)."""
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return " ".join(docstring.split("\n\n")[0].split())


def module_name(path: Path, package: Path) -> str:
    """``core/tasks/`` for a package's ``__init__.py``, ``core/tasks/conv.py`` otherwise."""
    relative = path.relative_to(package)
    if path.name == "__init__.py":
        return f"{relative.parent.as_posix()}/" if relative.parent.parts else "__init__.py"
    return relative.as_posix()


def render(root: Path = REPO) -> str:
    """The text of docs/layout.md for the tree under ``root``."""
    package = root / "popmeta"
    rows = []
    for path in sorted(package.rglob("*.py")):
        text = summary(path).replace("|", "\\|")  # a table cell's own bars
        rows.append(f"| `{module_name(path, package)}` | {text} |")
    return HEADER + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if PAGE.read_text(encoding="utf-8") != text:
            print(f"{PAGE} differs from the tree; run python docs/layout.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
