"""The README and docs/ stay true to the files they are written from: the CSV, the tree, each other."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import shutil
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from popmeta.evaluate.report import read_results_csv

REPO = Path(__file__).resolve().parents[1]


def _script(relative: str) -> ModuleType:
    """A script under docs/, imported by path (docs/ is no package)."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_results_tables_are_the_ones_their_csvs_render():
    readme_table = _script("docs/results/readme_table.py")
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = list(readme_table.BLOCK.finditer(readme))
    assert [b["kind"] for b in blocks] == ["results-table"], "the README shows one results table"
    for document in readme_table.DOCUMENTS:
        text = document.read_text(encoding="utf-8")
        assert readme_table.render_readme(text, REPO, document.parent) == text, (
            f"{document.name}'s results tables differ from their CSVs: "
            "run python docs/results/readme_table.py"
        )


def _table_lines(block: str) -> list[str]:
    return [
        line for line in block.splitlines() if line.startswith("| ") and "| setting |" not in line
    ]


def _verdicts(lines: list[str]) -> int:
    return sum(line.count(" WIN") + line.count(" TIE") + line.count(" LOSS") for line in lines)


@pytest.mark.parametrize("csv_name", sorted(p.name for p in (REPO / "docs/results").glob("*.csv")))
def test_every_row_of_a_csv_is_in_its_tables(csv_name):
    readme_table = _script("docs/results/readme_table.py")
    csv_name = f"docs/results/{csv_name}"
    rows = read_results_csv(REPO / csv_name)
    full = _table_lines(readme_table.render_block(csv_name, kind="results-table-full"))
    assert len(full) == sum(1 for r in rows if r["optimizer"] == "learned")
    assert _verdicts(full) == sum(1 for r in rows if r["verdict"])
    compact = _table_lines(readme_table.render_block(csv_name))
    settings = {r["setting"] for r in rows}
    assert len(compact) == len(settings)
    assert _verdicts(compact) == sum(
        1
        for r in rows
        if r["verdict"]
        and r["optimizer"] in readme_table.COMPACT_BASELINES
        and r["metric"] in readme_table.COMPACT_METRICS
    )
    # The median and the worst task stand beside each mean.
    for row in rows:
        if row["optimizer"] == "learned" and row["metric"] == "final_test_loss":
            worst = readme_table._number(row["worst"], ".3g")
            assert any(
                line.startswith(f"| {row['setting']} |") and worst in line for line in compact
            )


def test_the_results_tables_refuse_a_csv_that_popmeta_eval_did_not_write(tmp_path):
    readme_table = _script("docs/results/readme_table.py")
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    (tmp_path / "other.json").write_text('{"commit": "x", "commands": [], "note": ""}')
    with pytest.raises(ValueError, match=r"not a results\.csv of `popmeta eval`"):
        readme_table.render_block("other.csv", root=tmp_path)


def test_rerunning_the_results_script_on_a_stale_document_restores_its_tables(tmp_path):
    readme_table = _script("docs/results/readme_table.py")
    shutil.copytree(REPO / "docs" / "results", tmp_path / "docs" / "results")
    for document in readme_table.DOCUMENTS:
        text = document.read_text(encoding="utf-8")
        copy = tmp_path / document.relative_to(REPO)
        copy.write_text(text.replace(" LOSS", " WIN", 1), encoding="utf-8")
        assert readme_table.main([str(copy), "--check"]) == 1
        assert readme_table.main([str(copy)]) == 0
        assert copy.read_text(encoding="utf-8") == text


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


def test_the_step_scale_probe_leaves_the_trained_horizon_alone_and_scales_longer_runs(
    tmp_path, monkeypatch, capsys
):
    from popmeta.evaluate import settings_of
    from popmeta.evaluate.runs import learned_optimizer_run
    from popmeta.evaluate.statistics import scores_of
    from popmeta.run_loop import train
    from tests.local_run import local_config

    monkeypatch.setenv("POPMETA_CACHE_DIR", str(tmp_path / "cache"))
    lopt = {"kind": "normalized_mlp", "initial_lr": 0.05, "hidden_size": 4}
    evaluation = {"num_tasks": 2, "tuning_tasks": 2, "num_steps": 5, "long_horizon_factors": [2]}
    config = local_config(tmp_path, learned_optimizer=lopt, eval=evaluation)
    train(config)
    checkpoint = tmp_path / "ident" / "checkpoints" / "ckpt_00000004.npz"

    capsys.readouterr()
    probe = _script("docs/results/probe_step_scale.py")
    settings = ["--settings", "trained horizon", "2x horizon"]
    guards = ["--options", "loss_guard=1e9"]  # a brake no loss climbs far enough to pull
    probe.main([str(checkpoint), *settings, "--alphas", "0", "1", *guards, "--tasks", "3"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    trained, longer = ([cell.strip(" |") for cell in row] for row in rows)
    # At the trained horizon (T / T0 = 1) no alpha changes a step; at twice it, alpha 1 halves them.
    assert trained[3] == trained[4] and longer[3] != longer[4]
    assert longer[5] == longer[3]  # the guarded column runs the same rule on the same tasks

    # The probe runs on the tuning seed (eval.seed + 1), not on the test tasks.
    config, theta = probe.load_theta(checkpoint)
    on_tuning_seed = dataclasses.replace(
        config, eval=dataclasses.replace(config.eval, seed=config.eval.seed + 1, num_tasks=3)
    )
    scores = scores_of(learned_optimizer_run(on_tuning_seed, settings_of(config)[1])(theta))
    expected = f"{np.mean(scores.mean_train_loss):.4f} / {np.mean(scores.final_test_loss):.4f}"
    assert longer[3] == expected


def test_the_compact_table_shows_the_summary_where_the_result_has_one(tmp_path):
    readme_table = _script("docs/results/readme_table.py")
    name = "generalist-relative-0a2639c"
    shutil.copy(REPO / "docs" / "results" / f"{name}.csv", tmp_path / f"{name}.csv")
    about = {"commit": "x", "commands": [], "note": "The long note."}
    (tmp_path / f"{name}.json").write_text(json.dumps(about))
    assert "The long note." in readme_table.render_block(f"{name}.csv", root=tmp_path)
    (tmp_path / f"{name}.json").write_text(json.dumps({**about, "summary": "In short."}))
    compact = readme_table.render_block(f"{name}.csv", root=tmp_path)
    full = readme_table.render_block(f"{name}.csv", root=tmp_path, kind="results-table-full")
    assert "In short." in compact and "The long note." not in compact
    assert "The long note." in full and "In short." not in full


def test_the_averaging_probe_writes_a_checkpoint_of_the_mean_theta(tmp_path, capsys):
    import jax.numpy as jnp

    from popmeta.config import config_to_dict
    from popmeta.evaluate import load_theta
    from popmeta.experiment import learner_start
    from popmeta.learner.checkpoint_layout import save_run_checkpoint
    from popmeta.learner.learner import Learner
    from tests.local_run import local_config

    config = local_config(tmp_path, name="avg")
    start = Learner.of(learner_start(config)).checkpoint_tree()
    paths = [
        save_run_checkpoint(
            tmp_path / "checkpoints",
            start._replace(step=jnp.int32(step), theta={"log_lr": jnp.float32(log_lr)}),
            {},
            config_to_dict(config),
            [],
            keep=None,
        )
        for step, log_lr in [(1, -2.0), (2, -4.0)]
    ]
    probe = _script("docs/results/average_checkpoints.py")
    probe.main([str(tmp_path / "averaged"), "3", *map(str, paths)])
    written = tmp_path / "averaged" / "ckpt_00000003.npz"
    assert capsys.readouterr().out.strip() == str(written)
    averaged_config, theta = load_theta(written)
    assert float(theta["log_lr"]) == -3.0 and averaged_config == config


def test_the_fork_probe_lets_a_decaying_run_take_over_a_constant_rate_checkpoint(tmp_path):
    import io

    import optax

    from popmeta.experiment import learner_start
    from popmeta.learner.checkpoint_layout import load_run_checkpoint
    from popmeta.learner.learner import Learner
    from popmeta.run_dir import RunDirectoryError
    from popmeta.run_loop import train
    from tests.local_run import local_config

    train(local_config(tmp_path, name="constant"), stream=io.StringIO())
    halfway = tmp_path / "constant" / "checkpoints" / "ckpt_00000002.npz"
    decay = {"lr_decay": "cosine", "lr_decay_to": 0.1, "lr_decay_start": 0.5}
    forked = local_config(tmp_path, name="fork", outer_optimizer=decay)
    with pytest.raises(RunDirectoryError, match=r"ckpt_00000002\.npz"):
        train(forked, stream=io.StringIO(), from_checkpoint=halfway)

    _script("docs/results/fork_with_lr_decay.py").main([str(halfway), str(tmp_path / "copy")])
    out = io.StringIO()
    train(forked, stream=out, from_checkpoint=tmp_path / "copy" / "ckpt_00000002.npz")
    assert "at step 2" in out.getvalue() and "worker states restored" in out.getvalue()
    template = Learner.of(learner_start(forked)).checkpoint_tree()
    final = load_run_checkpoint(tmp_path / "fork" / "checkpoints" / "ckpt_00000004.npz", template)
    counts = [
        int(s.count) for s in final.learner.opt_state if isinstance(s, optax.ScaleByScheduleState)
    ]
    assert counts == [4]
    constant = load_run_checkpoint(
        tmp_path / "constant" / "checkpoints" / "ckpt_00000004.npz",
        Learner.of(learner_start(local_config(tmp_path, name="constant"))).checkpoint_tree(),
    )
    # The decay shortened the last update's step, so the two runs end apart.
    assert float(final.learner.theta["log_lr"]) != float(constant.learner.theta["log_lr"])
