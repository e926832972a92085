"""A directory of checkpoints: one file per step, keep-last-K, the newest readable one.

``<directory>/ckpt_{step:08d}.npz`` holds the step's checkpoint in the format
of :mod:`popmeta.learner.checkpoint_file`. :func:`save_checkpoint` writes it
atomically and then keeps only the newest ``keep`` files (one writer per
directory). :func:`restore_latest` and :func:`latest_checkpoint` try the
newest file first and, if it is damaged, log a warning naming it and try the
previous one; a readable checkpoint that does not fit the target is a user
error and raises instead of falling back.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from popmeta.learner.checkpoint_file import (
    Checkpoint,
    CheckpointCorruptedError,
    PathLike,
    check_readable,
    load_checkpoint,
    save_tree,
)

__all__ = [
    "checkpoint_path",
    "checkpoint_step",
    "is_checkpoint_name",
    "latest_checkpoint",
    "list_checkpoints",
    "restore_latest",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

_CKPT_RE = re.compile(r"^ckpt_(\d+)\.npz$")

_Read = TypeVar("_Read")


def checkpoint_path(directory: PathLike, step: int) -> Path:
    """The file name used for ``step`` in ``directory``."""
    return Path(directory) / f"ckpt_{int(step):08d}.npz"


def is_checkpoint_name(name: str) -> bool:
    """Whether ``name`` is a file name :func:`checkpoint_path` writes."""
    return _CKPT_RE.match(name) is not None


def checkpoint_step(path: PathLike) -> int:
    """The learner step a checkpoint file holds, from its name ``ckpt_<step>.npz``.

    Raises:
      ValueError: the name is not one :func:`checkpoint_path` writes.
    """
    match = _CKPT_RE.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path}: expected a ckpt_<step>.npz file written by popmeta train")
    return int(match.group(1))


def list_checkpoints(directory: PathLike) -> list[Path]:
    """Checkpoint files in ``directory``, oldest (lowest step) first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [entry for entry in directory.iterdir() if is_checkpoint_name(entry.name)]
    return sorted((entry for entry in found if entry.is_file()), key=checkpoint_step)


def save_checkpoint(
    directory: PathLike,
    step: int,
    tree: Mapping[str, Any],
    keep: int | None = 3,
    metadata: Mapping[str, Any] | None = None,
    optional: tuple[str, ...] = (),
) -> Path:
    """Atomically writes ``tree`` as ``ckpt_{step:08d}.npz`` in ``directory``.

    Args:
      directory: where checkpoints live (created if missing).
      step: the step number; also the file name.
      tree: a dict-rooted pytree (e.g. ``{"params": ..., "opt_state": ...,
        "step": ..., "rng": ...}``). Leaves may be jax/numpy arrays, python
        scalars or typed PRNG keys; ``None`` and empty containers store nothing.
      keep: keep only the newest ``keep`` checkpoints after writing (None keeps
        all).
      metadata: json-able extras (resolved config, versions, ...), returned by
        :func:`~popmeta.learner.checkpoint_file.load_checkpoint` as
        ``Checkpoint.metadata``.
      optional: top-level keys of ``tree`` that readers may leave out of their
        target (e.g. the workers' states, which evaluation does not need).

    Returns:
      The path of the written file.

    Raises:
      TypeError: if ``tree`` is not a mapping or ``metadata`` is not json-able.
      ValueError: if ``keep`` < 1 or ``step`` < 0, or ``optional`` names a
        key that ``tree`` does not have.
    """
    if not isinstance(tree, Mapping):
        raise TypeError(f"checkpoint tree must be a dict, got {type(tree).__name__}")
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 or None, got {keep}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if set(optional) - set(tree):
        raise ValueError(f"optional sections {sorted(set(optional) - set(tree))} are not in tree")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, step)
    save_tree(final, tree, step, metadata, optional)
    if keep is not None:
        for old in list_checkpoints(directory)[:-keep]:
            old.unlink(missing_ok=True)
    return final


def _newest_readable(directory: PathLike, read: Callable[[Path], _Read]) -> _Read | None:
    for path in reversed(list_checkpoints(directory)):
        try:
            return read(path)
        except CheckpointCorruptedError as e:
            logger.warning("Skipping damaged checkpoint %s (%s); trying the previous one.", path, e)
        except FileNotFoundError:
            # Deleted between listing and reading (e.g. by keep-last-K).
            continue
    return None


def latest_checkpoint(directory: PathLike) -> Path | None:
    """The newest checkpoint file in ``directory`` that is readable.

    Damaged files are skipped with a logged warning naming them.

    Returns:
      Its path, or None if there is no readable checkpoint.
    """
    return _newest_readable(directory, check_readable)


def restore_latest(directory: PathLike, target: Any) -> Checkpoint | None:
    """Restores the newest readable checkpoint in ``directory`` into ``target``.

    A damaged newest checkpoint is reported with a logged warning naming the
    file and the previous one is used instead.

    Returns:
      The restored :class:`Checkpoint`, or None if there is none.

    Raises:
      ValueError: if a readable checkpoint does not match ``target``.
    """
    return _newest_readable(directory, lambda path: load_checkpoint(path, target))
