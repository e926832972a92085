"""docs/tutorial.md runs as written and shows what its prose says.

Every ```python block of the tutorial is executed in order in one namespace,
like the cells of a notebook; a failing block is reported by its number and
the line of the tutorial it starts on. The tutorial's ```yaml config is loaded
with popmeta's own config loader. The checks afterwards hold the tutorial to
its claims: spread-out offsets, theta-shaped estimates, unbiased PES / NRES
against a biased truncated ES, and a meta-loss that really falls.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest

import popmeta as pm

TUTORIAL = Path(__file__).resolve().parents[1] / "docs" / "tutorial.md"
FENCE = re.compile(r"^```([A-Za-z]*)\n(.*?)^```\s*$", re.DOTALL | re.MULTILINE)


class Block(NamedTuple):
    """One fenced code block: its language, its code and the line its code starts on."""

    language: str
    code: str
    line: int


def code_blocks(text: str) -> list[Block]:
    """Every fenced block of a markdown text, in order."""
    return [
        Block(m.group(1), m.group(2), text.count("\n", 0, m.start(2)) + 1)
        for m in FENCE.finditer(text)
    ]


def run_python_blocks(text: str, source: str) -> dict[str, Any]:
    """Executes the ```python blocks of ``text`` in one namespace and returns it.

    Raises:
      AssertionError: naming the block (1-based, among the python blocks), the
        line of ``source`` it starts on and the traceback, if a block fails.
    """
    namespace: dict[str, Any] = {"__name__": "__tutorial__"}
    blocks = [b for b in code_blocks(text) if b.language == "python"]
    for number, block in enumerate(blocks, start=1):
        # Leading newlines put the block's code at its own line numbers in tracebacks.
        code = compile("\n" * (block.line - 1) + block.code, source, "exec")
        try:
            exec(code, namespace)
        except Exception:
            raise AssertionError(
                f"python block {number} of {len(blocks)} ({source}, line {block.line}) "
                f"failed:\n{traceback.format_exc()}"
            ) from None
    return namespace


def run_doc_in(path: Path, cwd: Path) -> dict[str, Any]:
    """The python blocks of the markdown page ``path``, run with ``cwd`` as the directory."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        return run_python_blocks(path.read_text(encoding="utf-8"), str(path))


@pytest.fixture(scope="module")
def tutorial() -> dict[str, Any]:
    return run_python_blocks(TUTORIAL.read_text(encoding="utf-8"), str(TUTORIAL))


def test_a_failing_block_is_named_by_number_and_line():
    text = "# doc\n\n```python\nx = 1\n```\n\ntext\n\n```python\ny = x + undefined_name\n```\n"
    with pytest.raises(AssertionError) as failure:
        run_python_blocks(text, "doc.md")
    message = str(failure.value)
    assert "python block 2 of 2 (doc.md, line 10)" in message
    assert "NameError" in message and "undefined_name" in message


def test_blocks_share_one_namespace_and_other_languages_are_not_run():
    text = "```python\nx = 2\n```\n```bash\nexit 1\n```\n```python\ny = x * 3\n```\n"
    namespace = run_python_blocks(text, "doc.md")
    assert namespace["y"] == 6


def test_the_tutorial_has_only_python_yaml_and_bash_blocks():
    blocks = code_blocks(TUTORIAL.read_text(encoding="utf-8"))
    assert {b.language for b in blocks} == {"python", "yaml", "bash"}
    assert sum(b.language == "python" for b in blocks) >= 8


def test_the_truncation_schedules_end_trajectories_as_described(tutorial):
    assert tutorial["constant_lengths"] == [5, 5, 5, 5]
    lengths = tutorial["log_uniform_lengths"]
    assert all(2 <= n <= 50 for n in lengths)
    assert len(set(lengths)) > 5


def test_the_custom_step_resets_after_is_done_and_pes_wants_a_larger_step(tutorial):
    grad = tutorial["descent_out"].grad
    assert jax.tree.structure(grad) == jax.tree.structure(tutorial["descent_theta"])
    assert float(grad["log_lr"]) < 0


def test_random_offsets_spread_inner_step_and_the_first_resets(tutorial):
    offsets = tutorial["offsets"]
    length = tutorial["trajectory_length"]
    assert len(set(offsets.tolist())) > 1
    assert offsets.min() >= 0 and offsets.max() < length
    # A task that starts at offset k ends its first trajectory after length - k steps.
    np.testing.assert_array_equal(tutorial["first_done"], length - offsets)


def test_the_estimates_are_theta_shaped_and_pes_nres_agree_against_truncated_es(tutorial):
    theta = tutorial["theta"]
    pes_grad = tutorial["pes_out"].grad
    assert jax.tree.structure(pes_grad) == jax.tree.structure(theta)
    assert jax.tree.map(np.shape, pes_grad) == jax.tree.map(np.shape, theta)
    means = tutorial["mean_grads"]
    pes, nres, truncated = means["PES"], means["NRES"], means["truncated ES"]
    assert pes < 0 and nres < 0
    assert abs(pes - nres) < 0.3 * abs(pes)
    # Truncated ES's short-horizon bias: a fraction of the whole-trajectory gradient.
    assert abs(truncated) < 0.5 * min(abs(pes), abs(nres))


def test_meta_training_lowers_the_meta_loss_and_raises_the_learning_rate(tutorial):
    losses = np.asarray(tutorial["meta_losses"])
    assert losses.shape == (300,) and np.all(np.isfinite(losses))
    assert losses[-50:].mean() < 0.5 * losses[:50].mean()
    learned_lr = float(np.exp(tutorial["trained_theta"]["log_lr"]))
    assert tutorial["lopt"].initial_lr * 10 < learned_lr < 1.0


def test_the_trained_optimizer_beats_its_untrained_self_on_fresh_tasks(tutorial):
    assert tutorial["learned_curve"].mean() < 0.5 * tutorial["untrained_curve"].mean()
    (report,) = tutorial["reports"]
    learned = report.scores["learned"].mean_train_loss.mean()
    untrained = report.scores["untrained"].mean_train_loss.mean()
    assert learned < 0.5 * untrained
    assert {c.baseline for c in report.comparisons} == {"adam", "adam_cosine", "sgdm", "sgd"}


def test_the_yaml_config_is_the_experiment_the_python_blocks_ran(tutorial, tmp_path):
    (yaml_block,) = [b for b in code_blocks(TUTORIAL.read_text()) if b.language == "yaml"]
    path = tmp_path / "tutorial.yaml"
    path.write_text(yaml_block.code, encoding="utf-8")
    config = pm.load_config(path)
    ran = tutorial["config"]
    for section in ("name", "task", "learned_optimizer", "truncation", "estimator"):
        assert getattr(config, section) == getattr(ran, section), section
    assert config.outer_optimizer == ran.outer_optimizer
    assert config.train.num_steps == len(tutorial["meta_losses"])
