"""Writes the results tables of the README and docs/results.md from evaluation CSVs.

A block ``<!-- results-table: PATH.csv -->`` ... ``<!-- /results-table -->``
is the compact table (one row per setting: the learned optimizer's mean
training loss and final test loss with their median and worst task, each
against tuned Adam and tuned Adam + cosine); ``<!-- results-table-full:
PATH.csv -->`` ... ``<!-- /results-table-full -->`` has every metric against
every baseline. PATH.csv is a ``results.csv`` that ``popmeta eval`` wrote
(its columns are ``popmeta.evaluate.report.CSV_COLUMNS``), kept under
``docs/results/``; beside it, PATH.json names the commit that measured it,
the commands that produced it and a note on what it is (docs/results.md);
the compact table shows its ``summary`` instead where it has one.

    python docs/results/readme_table.py           # rewrite the blocks of both files
    python docs/results/readme_table.py --check   # exit 1 if a block is stale

``tests/test_docs.py`` fails when a block differs from what this script renders.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

from popmeta.evaluate.baselines import BASELINES
from popmeta.evaluate.report import ResultsTable, read_results_csv
from popmeta.evaluate.statistics import METRICS, Comparison

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
#: The files whose blocks this script writes.
DOCUMENTS = (README, REPO / "docs" / "results.md")

BLOCK = re.compile(
    r"<!-- (?P<kind>results-table(?:-full)?): (?P<csv>\S+) -->\n.*?<!-- /(?P=kind) -->", re.DOTALL
)
COMPACT_BASELINES = ("adam", "adam_cosine")
COMPACT_METRICS = ("mean_train_loss", "final_test_loss")

BASELINE_NAMES = {"adam": "Adam", "adam_cosine": "Adam + cosine", "sgdm": "SGDM", "sgd": "SGD"}
METRIC_NAMES = {
    "mean_train_loss": "mean training loss",
    "final_test_loss": "final test loss",
    "final_test_accuracy": "final test accuracy",
}


def _number(value: str | float, spec: str) -> str:
    value = float(value)
    return format(value, spec) if math.isfinite(value) else "diverged"


def _full_table(rows: list[dict[str, str]]) -> list[str]:
    """One line per setting and metric: the learned optimizer, the untrained one, each verdict."""
    table = ResultsTable.of(rows)
    columns = ["learned", "untrained", *(f"vs {BASELINE_NAMES.get(b, b)}" for b in BASELINES)]
    lines = [
        "| setting | metric | " + " | ".join(columns) + " |",
        "|---" * (2 + len(columns)) + "|",
    ]
    for setting in table.settings:
        first = True
        for metric in METRICS:
            learned = table.row(setting, "learned", metric)
            if learned is None:
                continue
            untrained = table.row(setting, "untrained", metric)
            cells = [
                f"{_number(learned['mean'], '.3g')} ± {_number(learned['ci95_half_width'], '.2g')}",
                "n/a" if untrained is None else _number(untrained["mean"], ".3g"),
            ]
            cells += [_versus(table.comparison(setting, b, metric)) for b in BASELINES]
            name = ""
            if first:
                name = (
                    f"{setting} ({learned['task_family']}, {learned['num_steps']} steps; "
                    f"unstable {learned['unstable_tasks']} of {learned['num_tasks']})"
                )
            lines.append(
                f"| {name} | {METRIC_NAMES.get(metric, metric)} | " + " | ".join(cells) + " |"
            )
            first = False
    return lines


def _versus(comparison: Comparison | None) -> str:
    """``learned - baseline ± half-width VERDICT``, or n/a where the CSV has no verdict."""
    if comparison is None:
        return "n/a"
    difference = _number(comparison.difference, "+.2g")
    half_width = _number(comparison.half_width, ".2g")
    return f"{difference} ± {half_width} {comparison.label}"


def _compact_table(rows: list[dict[str, str]]) -> list[str]:
    """One line per setting: each compact metric's learned mean (median, worst) and verdicts."""
    table = ResultsTable.of(rows)
    header = ["setting", "steps", "unstable"]
    for metric in COMPACT_METRICS:
        header += [f"{METRIC_NAMES[metric]}: mean (median, worst)"]
        header += [f"vs {BASELINE_NAMES[b]}" for b in COMPACT_BASELINES]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for setting in table.settings:
        first = table.row(setting, "learned", COMPACT_METRICS[0])
        if first is None:
            continue
        cells = [setting, first["num_steps"], f"{first['unstable_tasks']} of {first['num_tasks']}"]
        for metric in COMPACT_METRICS:
            learned = table.row(setting, "learned", metric)
            cells.append(
                f"{_number(learned['mean'], '.3g')} ({_number(learned['median'], '.3g')}, "
                f"{_number(learned['worst'], '.3g')})"
            )
            cells += [_versus(table.comparison(setting, b, metric)) for b in COMPACT_BASELINES]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


_LEGEND = {
    "results-table": (
        "Learned optimizer: mean over the test tasks, with the median and the worst task. vs a "
        "baseline (tuned per setting): learned - baseline, paired by task, mean ± 95% interval; "
        "WIN when the interval is below zero, LOSS when above, TIE otherwise. Unstable: the "
        "learned optimizer's tasks that ended above their initial test loss or diverged; a "
        "setting with any is a LOSS against every baseline."
    ),
    "results-table-full": (
        "Learned optimizer: mean ± 95% interval over the test tasks. Untrained: the same "
        "learned optimizer before meta-training. vs a baseline (each tuned per setting): "
        "learned - baseline, paired by task, mean ± 95% interval; WIN when the interval "
        "favours the learned optimizer (below zero for losses, above for accuracy), LOSS "
        "when it favours the baseline, TIE otherwise. Unstable: the learned optimizer's "
        "tasks that ended above their initial test loss or diverged."
    ),
}


def render_block(
    csv_name: str, root: Path = REPO, kind: str = "results-table", document_dir: Path | None = None
) -> str:
    """The block of ``kind`` for ``csv_name`` (relative to the repository ``root``), markers
    included, for a document in ``document_dir`` (default ``root``)."""
    csv_path = root / csv_name
    link = os.path.relpath(csv_path, document_dir or root)
    about = json.loads(csv_path.with_suffix(".json").read_text(encoding="utf-8"))
    table = _compact_table if kind == "results-table" else _full_table
    lines = [
        f"<!-- {kind}: {csv_name} -->",
        "<!-- written by `python docs/results/readme_table.py` from the CSV and its .json: "
        "edit those and rerun it, not this block -->",
        about["summary"] if kind == "results-table" and "summary" in about else about["note"],
        "",
        f"Measured at commit `{about['commit']}` ([the CSV]({link})):",
        "",
        "```bash",
        *about["commands"],
        "```",
        "",
        _LEGEND[kind],
        "",
        *table(read_results_csv(csv_path)),
        f"<!-- /{kind} -->",
    ]
    return "\n".join(lines)


def render_readme(text: str, root: Path = REPO, document_dir: Path | None = None) -> str:
    """``text`` (a document in ``document_dir``) with every results block rewritten from its CSV."""
    return BLOCK.sub(lambda m: render_block(m["csv"], root, m["kind"], document_dir or root), text)


def _repository_of(path: Path) -> Path:
    """The checkout ``path`` lies in: the nearest folder above it with ``docs/results/``."""
    for folder in path.resolve().parents:
        if (folder / "docs" / "results").is_dir():
            return folder
    raise ValueError(f"{path}: not inside a checkout with docs/results/")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, default=list(DOCUMENTS))
    parser.add_argument("--check", action="store_true", help="exit 1 if a block is stale")
    args = parser.parse_args(argv)
    stale = False
    for path in args.files:
        text = path.read_text(encoding="utf-8")
        if not BLOCK.search(text):
            print(f"{path}: no <!-- results-table: ... --> block", file=sys.stderr)
            return 1
        rendered = render_readme(text, _repository_of(path), path.resolve().parent)
        if args.check:
            if rendered != text:
                print(f"{path}: a results table is stale; run {sys.argv[0]}", file=sys.stderr)
                stale = True
        else:
            path.write_text(rendered, encoding="utf-8")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
