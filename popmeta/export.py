"""A trained learned optimizer as a file of its own, and back as an optax transformation.

``popmeta export CKPT OUT [--set learned_optimizer.KEY=VALUE]``
(:func:`export_optimizer`) writes ``OUT``: a
``.npz`` in the checkpoint format (readable with ``np.load``, no pickle) with
theta keyed by pytree path and a header holding the format and its version,
popmeta's version, the learned optimizer's ``kind`` and fields (the
``learned_optimizer`` section it was trained with, with any option changed at
export) and where it came from.
:func:`load_optimizer` reads such a file, or a training checkpoint directly,
without the run directory, and returns the optimizer as an optax
transformation (:func:`popmeta.core.learned_optimizers.as_optax`).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from popmeta.config import ConfigError, LearnedOptimizerConfig, config_from_dict
from popmeta.core.learned_optimizers import LearnedOptimizer, as_optax
from popmeta.evaluate import load_theta
from popmeta.evaluate.checkpoints import checked_rule_changes
from popmeta.experiment import build_learned_optimizer
from popmeta.learner.checkpoint_file import load_checkpoint, read_checkpoint_metadata, save_tree
from popmeta.learner.checkpoint_layout import RunMetadata

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "TrainedOptimizer",
    "export_optimizer",
    "load_optimizer",
    "read_trained_optimizer",
]

#: What the header of an exported learned optimizer says it is.
FORMAT = "popmeta-learned-optimizer"
#: The newest format this popmeta reads and the one it writes.
FORMAT_VERSION = 1


class TrainedOptimizer(NamedTuple):
    """A learned optimizer and its trained theta, read from a file.

    Attributes:
      lopt: the learned optimizer, built from its recorded kind and fields.
      theta: the trained meta-parameters (numpy arrays).
      config: the ``learned_optimizer`` section it runs with: as trained, but for
        the options in ``source["changes"]``, if any.
      source: where it came from: the run, its step and the checkpoint file, and
        ``changes``: the options set otherwise than trained, at export or load.
    """

    lopt: LearnedOptimizer
    theta: Any
    config: LearnedOptimizerConfig
    source: dict[str, Any]


def _popmeta_version() -> str:
    try:
        return importlib.metadata.version("popmeta")
    except importlib.metadata.PackageNotFoundError:  # a source tree, not installed
        return "unknown"


def _section(fields: Any, path: Path, search_path: list[str]) -> LearnedOptimizerConfig:
    try:
        config = config_from_dict(
            {"learned_optimizer": fields}, source=str(path), search_path=search_path
        )
        return config.learned_optimizer
    except ConfigError as err:
        raise ValueError(
            f"{path}: its learned optimizer is not one this popmeta can build ({err})"
        ) from None


def read_trained_optimizer(path: str | Path) -> TrainedOptimizer:
    """The learned optimizer in an exported file or in a training checkpoint.

    Raises:
      FileNotFoundError: there is no such file.
      ValueError: the file is not a popmeta learned optimizer or checkpoint,
        was written by a newer format, names a kind this popmeta lacks, or
        its theta does not fit that kind (each said in its message).
    """
    path = Path(path)
    header = read_checkpoint_metadata(path)
    if header.get("format") == FORMAT:
        version = header.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ValueError(
                f"{path} was written in format version {version} of {FORMAT}, by popmeta "
                f"{header.get('popmeta_version', '?')}; this popmeta reads versions up to "
                f"{FORMAT_VERSION}: upgrade popmeta to load it"
            )
        search_path = [*header.get("module_dirs", []), str(path.resolve().parent)]
        section = _section(header.get("learned_optimizer"), path, search_path)
        lopt = build_learned_optimizer(section)
        template = {"theta": jax.eval_shape(lopt.init, jax.random.key(0))}
        try:
            theta = load_checkpoint(path, template).tree["theta"]
        except ValueError as err:
            raise ValueError(
                f"{path}: its theta does not fit learned_optimizer.kind={section.kind!r} ({err})"
            ) from None
        return TrainedOptimizer(lopt, theta, section, dict(header.get("source", {})))
    run = RunMetadata.from_header(header)
    if run.config is None:
        raise ValueError(
            f"{path} is neither a learned optimizer exported by `popmeta export` nor a "
            "checkpoint written by `popmeta train`"
        )
    config, theta = load_theta(path)  # a training checkpoint
    source = {
        "run": config.name,
        "step": run.step,
        "checkpoint": str(path),
        "module_dirs": list(run.module_dirs),
    }
    section = config.learned_optimizer
    return TrainedOptimizer(build_learned_optimizer(section), theta, section, source)


def export_optimizer(
    checkpoint: str | Path, out: str | Path, changes: Mapping[str, Any] | None = None
) -> Path:
    """Writes the learned optimizer of a training checkpoint to the file ``out``.

    Args:
      checkpoint: a training checkpoint, or a file written by ``popmeta export``.
      out: the file to write.
      changes: options of the learned optimizer to write otherwise than it
        was trained with, as :func:`load_optimizer` takes them; the header's
        ``source`` records them under ``changes``, so the file says what it
        is and :func:`load_optimizer` needs none of them again.

    Returns:
      The path written.

    Raises:
      FileNotFoundError, ValueError: as :func:`read_trained_optimizer`, and a
        change that is no field of the kind or would change theta's shapes.
      OSError: ``out`` could not be written.
    """
    trained = _with_changes(read_trained_optimizer(checkpoint), changes, checkpoint)
    out = Path(out)
    header = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "popmeta_version": _popmeta_version(),
        "learned_optimizer": {"kind": trained.config.kind, **trained.config.options},
        "module_dirs": trained.source.get("module_dirs", []),
        "needs_num_steps": trained.lopt.needs_num_steps,
        "uses_loss": trained.lopt.uses_loss,
        "source": trained.source,
    }
    theta = jax.tree_util.tree_map(np.asarray, trained.theta)
    return save_tree(out, {"theta": theta}, int(trained.source.get("step") or 0), header)


def _with_changes(
    trained: TrainedOptimizer, changes: Mapping[str, Any] | None, path: str | Path
) -> TrainedOptimizer:
    """``trained`` with the options ``changes`` set, checked to leave theta's shapes as trained."""
    if not changes:
        return trained
    fields = {"kind": trained.config.kind, **trained.config.options, **changes}
    search_path = list(trained.source.get("module_dirs", []))
    section = _section(fields, Path(path), search_path)
    checked_rule_changes(trained.config, section, trained.theta, str(path))
    source = {**trained.source, "changes": {**trained.source.get("changes", {}), **changes}}
    return TrainedOptimizer(build_learned_optimizer(section), trained.theta, section, source)


def load_optimizer(
    path: str | Path, num_steps: int | None = None, changes: Mapping[str, Any] | None = None
) -> optax.GradientTransformationExtraArgs:
    """The trained learned optimizer in ``path`` as an optax transformation.

    Args:
      path: a file written by ``popmeta export``, or a training checkpoint.
      num_steps: the number of steps the training run will take; required
        for learned optimizers that read how far through the run they are.
      changes: options of the learned optimizer to set otherwise than it
        was trained with, where no meta-parameter stands for them (e.g.
        ``{"loss_guard": 0.01}`` for ``normalized_mlp``); one that would
        change theta's shapes is refused.

    Returns:
      A jittable transformation with a pytree state that follows
      ``lopt.opt_fn(theta)`` bit for bit; ``update(grads, state, params)``
      needs ``params``, and loss-aware optimizers the loss as ``value=``
      (see :func:`~popmeta.core.learned_optimizers.as_optax`).

    Raises:
      FileNotFoundError, ValueError: as :func:`read_trained_optimizer`, a
        missing ``num_steps`` for an optimizer that needs it, and a change
        that is no field of the kind or would change theta's shapes.
    """
    trained = _with_changes(read_trained_optimizer(path), changes, path)
    if trained.lopt.needs_num_steps and num_steps is None:
        raise ValueError(
            f"{path}: learned_optimizer.kind={trained.config.kind!r} reads how far through its "
            "run it is: give num_steps, the number of steps the training run will take, to "
            "load_optimizer(path, num_steps=...)"
        )
    return as_optax(trained.lopt, trained.theta, num_steps=num_steps)
