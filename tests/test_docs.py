"""The README and docs/ stay true to the files they are written from: the CSV, the tree, each other."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


def _script(relative: str) -> ModuleType:
    """A script under docs/, imported by path (docs/ is no package)."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_results_table_is_the_one_its_csv_renders():
    readme_table = _script("docs/results/readme_table.py")
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = list(readme_table.BLOCK.finditer(readme))
    assert len(blocks) == 1, "the README shows exactly one results table"
    assert blocks[0].group(0) == readme_table.render_block(blocks[0]["csv"]), (
        "the README's results table differs from its CSV: run python docs/results/readme_table.py"
    )


def test_the_results_table_has_a_row_for_every_setting_and_metric_of_its_csv():
    readme_table = _script("docs/results/readme_table.py")
    csv_name = "docs/results/generalist-pilot-4d27c45.csv"
    rows = readme_table._read_rows(REPO / csv_name)
    learned = [r for r in rows if r["optimizer"] == "learned"]
    table = [
        line
        for line in readme_table.render_block(csv_name).splitlines()
        if line.startswith("| ") and not line.startswith("| setting")
    ]
    assert len(table) == len(learned)
    verdicts = sum(line.count(" WIN") + line.count(" TIE") + line.count(" LOSS") for line in table)
    assert verdicts == sum(1 for r in rows if r["verdict"])


def test_the_results_table_refuses_a_csv_that_popmeta_eval_did_not_write(tmp_path):
    readme_table = _script("docs/results/readme_table.py")
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    (tmp_path / "other.json").write_text('{"commit": "x", "commands": [], "note": ""}')
    with pytest.raises(ValueError, match="not a popmeta eval CSV"):
        readme_table.render_block("other.csv", root=tmp_path)


def test_rerunning_the_results_script_on_a_stale_readme_restores_the_table(tmp_path):
    readme_table = _script("docs/results/readme_table.py")
    shutil.copytree(REPO / "docs" / "results", tmp_path / "docs" / "results")
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    stale = readme.replace("| final test loss |", "| final test loss (edited) |", 1)
    (tmp_path / "README.md").write_text(stale, encoding="utf-8")
    assert readme_table.main(["--readme", str(tmp_path / "README.md"), "--check"]) == 1
    assert readme_table.main(["--readme", str(tmp_path / "README.md")]) == 0
    assert (tmp_path / "README.md").read_text(encoding="utf-8") == readme


def test_the_layout_page_lists_every_module_and_nothing_else():
    layout = _script("docs/layout.py")
    assert (REPO / "docs" / "layout.md").read_text(encoding="utf-8") == layout.render(), (
        "docs/layout.md differs from the tree: run python docs/layout.py"
    )
    listed = set(re.findall(r"^\| `([^`]+)` \|", layout.render().split("## popmeta/")[1], re.M))
    package = REPO / "popmeta"
    assert listed == {layout.module_name(p, package) for p in package.rglob("*.py")}


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize(
    "page", ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in REPO.glob("docs/*.md"))]
)
def test_every_relative_link_points_at_a_file_and_heading_that_exist(page):
    path = REPO / page
    for link in _links(path):
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        assert file.exists(), f"{page}: {link} names a missing file"
        if anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", file.read_text(encoding="utf-8"), re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
            assert anchor in slugs, f"{page}: {link} names a missing heading"


def test_the_readme_stays_short():
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 250
