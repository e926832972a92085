"""Writes the README's results table from an evaluation CSV, so the table cannot drift from it.

The README marks the block with ``<!-- results-table: PATH.csv -->`` and
``<!-- /results-table -->``. PATH.csv is a ``results.csv`` that
``popmeta eval`` wrote (its columns are ``popmeta.evaluate.report.CSV_COLUMNS``),
kept under ``docs/results/``; beside it, PATH.json names the commit that
measured it, the commands that produced it and a note on what it is (see
docs/results.md). This script renders every row of the CSV into the block:

    python docs/results/readme_table.py           # rewrite the README's block
    python docs/results/readme_table.py --check   # exit 1 if the block is stale

``tests/test_docs.py`` fails when the README's block differs
from what this script renders.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from pathlib import Path

from popmeta.evaluate.baselines import BASELINES
from popmeta.evaluate.report import CSV_COLUMNS
from popmeta.evaluate.statistics import METRICS, Comparison

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

BLOCK = re.compile(r"<!-- results-table: (?P<csv>\S+) -->\n.*?<!-- /results-table -->", re.DOTALL)

BASELINE_NAMES = {"adam": "Adam", "adam_cosine": "Adam + cosine", "sgdm": "SGDM", "sgd": "SGD"}
METRIC_NAMES = {
    "mean_train_loss": "mean training loss",
    "final_test_loss": "final test loss",
    "final_test_accuracy": "final test accuracy",
}


def _number(text: str, spec: str) -> str:
    value = float(text)
    return format(value, spec) if math.isfinite(value) else "diverged"


def _read_rows(csv_path: Path) -> list[dict[str, str]]:
    with csv_path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != CSV_COLUMNS:
            raise ValueError(f"{csv_path}: not a popmeta eval CSV (columns {reader.fieldnames})")
        return list(reader)


def _table(rows: list[dict[str, str]]) -> list[str]:
    """One line per setting and metric: the learned optimizer, the untrained one, each verdict."""
    by_key = {(r["setting"], r["optimizer"], r["metric"]): r for r in rows}
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    columns = ["learned", "untrained", *(f"vs {BASELINE_NAMES.get(b, b)}" for b in BASELINES)]
    lines = [
        "| setting | metric | " + " | ".join(columns) + " |",
        "|---" * (2 + len(columns)) + "|",
    ]
    for setting in settings:
        first = True
        for metric in METRICS:
            learned = by_key.get((setting, "learned", metric))
            if learned is None:
                continue
            untrained = by_key.get((setting, "untrained", metric))
            cells = [
                f"{_number(learned['mean'], '.3g')} ± {_number(learned['ci95_half_width'], '.2g')}",
                "n/a" if untrained is None else _number(untrained["mean"], ".3g"),
            ]
            for baseline in BASELINES:
                row = by_key.get((setting, baseline, metric))
                if row is None or not row["verdict"]:
                    cells.append("n/a")
                    continue
                label = Comparison(
                    baseline,
                    metric,
                    float(row["learned_minus_optimizer"]),
                    float(row["difference_ci95_half_width"]),
                    row["verdict"],
                    int(learned["unstable_tasks"]),
                ).label
                difference = _number(row["learned_minus_optimizer"], "+.2g")
                half_width = _number(row["difference_ci95_half_width"], ".2g")
                cells.append(f"{difference} ± {half_width} {label}")
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


def render_block(csv_name: str, root: Path = REPO) -> str:
    """The README's block for ``csv_name`` (relative to ``root``), markers included."""
    csv_path = root / csv_name
    about = json.loads(csv_path.with_suffix(".json").read_text(encoding="utf-8"))
    lines = [
        f"<!-- results-table: {csv_name} -->",
        "<!-- written by `python docs/results/readme_table.py` from the CSV and its .json: "
        "edit those and rerun it, not this block -->",
        about["note"],
        "",
        f"Measured at commit `{about['commit']}` ([the CSV]({csv_name})):",
        "",
        "```bash",
        *about["commands"],
        "```",
        "",
        "Learned optimizer: mean ± 95% interval over the test tasks. Untrained: the same "
        "learned optimizer before meta-training. vs a baseline (each tuned per setting): "
        "learned - baseline, paired by task, mean ± 95% interval; WIN when the interval "
        "favours the learned optimizer (below zero for losses, above for accuracy), LOSS "
        "when it favours the baseline, TIE otherwise. Unstable: the learned optimizer's "
        "tasks that ended above their initial test loss or diverged.",
        "",
        *_table(_read_rows(csv_path)),
        "<!-- /results-table -->",
    ]
    return "\n".join(lines)


def render_readme(text: str, root: Path = REPO) -> str:
    """``text`` with every results-table block rewritten from its CSV."""
    return BLOCK.sub(lambda m: render_block(m["csv"], root), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", type=Path, default=README)
    parser.add_argument("--check", action="store_true", help="exit 1 if the README is stale")
    args = parser.parse_args(argv)
    text = args.readme.read_text(encoding="utf-8")
    if not BLOCK.search(text):
        print(f"{args.readme}: no <!-- results-table: ... --> block", file=sys.stderr)
        return 1
    rendered = render_readme(text, args.readme.resolve().parent)
    if args.check:
        if rendered != text:
            print(f"{args.readme}: the results table is stale; run {sys.argv[0]}", file=sys.stderr)
            return 1
        return 0
    args.readme.write_text(rendered, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
