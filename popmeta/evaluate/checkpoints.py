"""Meta-testing a training checkpoint: its config and theta, every setting, the files."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import jax

from popmeta.config import Config, LearnedOptimizerConfig, config_from_dict
from popmeta.evaluate.baselines import BaselineCache
from popmeta.evaluate.report import EvalOutput, EvalWriteError, check_output_dir, write_reports
from popmeta.evaluate.runs import SettingReport, evaluate
from popmeta.experiment import build_learned_optimizer, learner_start
from popmeta.learner.checkpoint_layout import load_run_checkpoint, read_run_metadata
from popmeta.learner.learner import Learner
from popmeta.storage import StorageError, join, local_file, parent

__all__ = ["evaluate_checkpoint", "load_theta"]


def load_theta(checkpoint: str | Path) -> tuple[Config, Any]:
    """The config and theta stored in a training checkpoint."""
    metadata = read_run_metadata(checkpoint)
    if metadata.config is None:
        raise ValueError(f"{checkpoint}: no config in the checkpoint's metadata")
    config = config_from_dict(
        metadata.config,
        source=str(checkpoint),
        recorded=True,
        search_path=metadata.module_dirs,
    )
    restored = load_run_checkpoint(checkpoint, Learner.of(learner_start(config)).checkpoint_tree())
    return config, restored.learner.theta


def evaluate_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path | None = None,
    stream: TextIO | None = sys.stderr,
    config_changes: Callable[[Config], Config] | None = None,
    baseline_cache: BaselineCache | None = None,
) -> tuple[list[SettingReport], EvalOutput]:
    """Meta-tests a training checkpoint in every setting its config names.

    Args:
      checkpoint: a ``ckpt_*.npz`` file (or a storage URI of one).
      out_dir: where the PNG, CSV and TensorBoard curves go; default ``eval/``
        beside the checkpoints directory (a storage URI works too).
      stream: progress display.
      config_changes: applied to the checkpoint's config before evaluating
        (e.g. other ``eval`` settings).
      baseline_cache: where tuned baselines are looked up and kept; default
        :class:`BaselineCache` ``()`` (``~/.cache/popmeta``).

    Returns:
      The reports and where they were written.

    Raises:
      EvalWriteError: the output cannot be written (checked before evaluating).
    """
    with local_file(checkpoint) as local_checkpoint:
        config, theta = load_theta(local_checkpoint)
        name = local_checkpoint.name
    title = f"{config.name}: {name}"
    if config_changes is not None:
        changed = config_changes(config)
        rule_changes = checked_rule_changes(
            config.learned_optimizer, changed.learned_optimizer, theta, str(checkpoint)
        )
        config = changed
        if rule_changes:
            title += f" ({', '.join(rule_changes)})"
    out = out_dir if out_dir else join(parent(parent(checkpoint)), "eval")
    check_output_dir(out)
    cache = BaselineCache() if baseline_cache is None else baseline_cache
    reports = evaluate(config, theta, stream=stream, baseline_cache=cache)
    try:
        return reports, write_reports(reports, out, title)
    except (OSError, StorageError) as err:
        raise EvalWriteError(f"cannot write the evaluation's output to {out}: {err}") from None


def checked_rule_changes(
    before: LearnedOptimizerConfig, after: LearnedOptimizerConfig, theta: Any, source: str
) -> list[str]:
    """The options that ``after`` sets otherwise than ``before``, as ``field=value``.

    A checkpoint's theta is meta-trained for its rule (``before``), but an
    option that no meta-parameter stands for (``normalized_mlp``'s
    ``loss_guard``, a hand-designed brake) may change at use: what the rule
    as trained does with it. One that changes theta's shape, or another
    kind, is refused.

    Raises:
      ValueError: ``after`` has another kind, or theta's tree or shapes under
        it differ from ``theta``'s.
    """
    if after.kind != before.kind:
        raise ValueError(
            f"{source}: learned_optimizer.kind is {before.kind!r} in the checkpoint; "
            f"its theta cannot run as {after.kind!r}"
        )
    rule_changes = [
        f"learned_optimizer.{field}={after.options.get(field)!r}"
        for field in sorted({*before.options, *after.options})
        if after.options.get(field) != before.options.get(field)
    ]
    if rule_changes:
        expected = jax.eval_shape(build_learned_optimizer(after).init, jax.random.key(0))
        if _shapes(expected) != _shapes(theta):
            raise ValueError(
                f"{source}: {', '.join(rule_changes)} gives the learned optimizer meta-parameters "
                "of other shapes than the checkpoint's theta; only options that leave theta "
                "as it was trained can change at use"
            )
    return rule_changes


def _shapes(tree: Any) -> tuple[Any, list[tuple[tuple[int, ...], Any]]]:
    leaves, structure = jax.tree.flatten(tree)
    return structure, [(tuple(leaf.shape), leaf.dtype) for leaf in leaves]
