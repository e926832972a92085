"""Meta-testing a training checkpoint: its config and theta, every setting, the files."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from popmeta.config import Config, config_from_dict
from popmeta.evaluate.baselines import BaselineCache
from popmeta.evaluate.report import EvalOutput, EvalWriteError, check_output_dir, write_reports
from popmeta.evaluate.runs import SettingReport, evaluate
from popmeta.experiment import learner_start
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
    if config_changes is not None:
        config = config_changes(config)
    out = out_dir if out_dir else join(parent(parent(checkpoint)), "eval")
    check_output_dir(out)
    cache = BaselineCache() if baseline_cache is None else baseline_cache
    reports = evaluate(config, theta, stream=stream, baseline_cache=cache)
    try:
        return reports, write_reports(reports, out, f"{config.name}: {name}")
    except (OSError, StorageError) as err:
        raise EvalWriteError(f"cannot write the evaluation's output to {out}: {err}") from None
