"""A run's checkpoints: which one a run resumes from, and which are written.

A run's checkpoint is one file with the learner and, in its optional section
``workers``, every worker's exported state by rank (its layout is
:mod:`popmeta.learner.checkpoint_layout`). A run resumes from its newest
checkpoint whose every section reads back intact: damaged newer files are
moved aside, kept for repair and out of the way of keep-last-K. When every
checkpoint is damaged the start is refused and nothing is touched. A
checkpoint is never written with a non-finite value: non-finite worker states
leave the workers out, and a non-finite learner (theta or its optimizer
state) is not written at all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import jax
import numpy as np

from popmeta.actors.records import WorkerState
from popmeta.learner.checkpoint_file import CheckpointCorruptedError
from popmeta.learner.checkpoint_layout import (
    RunCheckpoint,
    load_run_checkpoint,
    save_run_checkpoint,
)
from popmeta.learner.checkpoints import checkpoint_path, list_checkpoints
from popmeta.learner.learner import Learner
from popmeta.run_dir import RunDirectory, RunDirectoryError

__all__ = ["RunCheckpoints", "all_finite"]

log = logging.getLogger("popmeta")


def all_finite(tree: Any) -> bool:
    """Whether every floating-point leaf of ``tree`` is finite (keys and integers always are)."""
    for leaf in jax.tree_util.tree_leaves(tree):
        if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key):
            continue
        array = np.asarray(leaf)
        if np.issubdtype(array.dtype, np.inexact) and not np.isfinite(array).all():
            return False
    return True


class RunCheckpoints:
    """The checkpoints of one run directory, as one start of the run reads and writes them.

    Args:
      run: the claimed run directory.
      worker_template: makes the template of a worker's exported state
        (:func:`~popmeta.actors.worker.exported_state_template`), traced only
        when a checkpoint with worker states is read.
      keep: how many checkpoints to keep (``train.keep_checkpoints``).
      config: the run's config as a dict, written with each checkpoint (for
        ``popmeta eval`` and ``popmeta export``).
      module_dirs: where the config's kinds of the user's were found.
      learned_optimizer: the configured kind, named when a checkpoint does not fit it.
      stream: where resume messages go.
    """

    def __init__(
        self,
        run: RunDirectory,
        worker_template: Callable[[], Any],
        *,
        keep: int,
        config: Mapping[str, Any],
        module_dirs: Sequence[str],
        learned_optimizer: str,
        stream: TextIO,
    ):
        self.run = run
        self.worker_template = worker_template
        self.keep = keep
        self.config = dict(config)
        self.module_dirs = list(module_dirs)
        self.learned_optimizer = learned_optimizer
        self.stream = stream
        self.saved_step: int | None = None

    # ------------------------------------------------------------------ resume

    def restore(self, learner: Learner, from_checkpoint: Path | None) -> dict[int, WorkerState]:
        """Restores ``learner`` from ``from_checkpoint``, else from the newest intact checkpoint.

        Returns:
          The worker states saved with it, by rank: empty when it has none,
          when they do not fit this config (a take-over that changed the
          estimator or the tasks) or are not finite; those workers start afresh.

        Raises:
          RunDirectoryError: ``from_checkpoint`` is missing or damaged, a
            checkpoint does not fit the learned optimizer, or every checkpoint
            of the run is damaged (then they are all left in place).
        """
        candidates = (
            [from_checkpoint]
            if from_checkpoint is not None
            else list(reversed(list_checkpoints(self.run.checkpoints)))
        )
        damaged: list[tuple[Path, CheckpointCorruptedError]] = []
        for path in candidates:
            try:
                restored = self._load(learner, path)
            except FileNotFoundError as err:
                if from_checkpoint is not None:
                    raise RunDirectoryError(f"--from-checkpoint {path}: {err}") from None
                continue  # removed between listing and reading
            except CheckpointCorruptedError as err:
                if from_checkpoint is not None:
                    raise RunDirectoryError(f"--from-checkpoint {path}: {err}") from None
                damaged.append((path, err))
                continue
            if damaged:
                self._move_aside(damaged, restored[0].path)
            checkpoint, states = restored
            learner.restore(checkpoint.learner)
            print(f"resumed from {checkpoint.path} at step {learner.version}", file=self.stream)
            return states
        if damaged:
            raise RunDirectoryError(self._all_damaged(damaged))
        return {}

    def _load(self, learner: Learner, path: Path) -> tuple[RunCheckpoint, dict[int, WorkerState]]:
        """The learner part of ``path`` and its worker states; any damage raises.

        Raises:
          CheckpointCorruptedError: any section of the file is damaged.
          RunDirectoryError: the learner part does not fit this config.
        """
        try:
            learner_part = load_run_checkpoint(path, learner.checkpoint_tree())
        except CheckpointCorruptedError:
            raise
        except ValueError as err:
            raise RunDirectoryError(
                f"{err}. The checkpoint does not fit learned_optimizer.kind="
                f"{self.learned_optimizer!r} as configured; start a new run with "
                "--set name=NEW"
            ) from None
        return learner_part, self._worker_states(learner, learner_part)

    def _worker_states(
        self, learner: Learner, learner_part: RunCheckpoint
    ) -> dict[int, WorkerState]:
        if not learner_part.metadata.worker_ranks:
            return {}
        template = self.worker_template()
        path = learner_part.path
        try:
            states = load_run_checkpoint(path, learner.checkpoint_tree(), template).workers
        except CheckpointCorruptedError:
            raise
        except ValueError as err:
            print(
                f"the worker states in {path} do not fit this config ({err}); "
                "every worker starts afresh",
                file=self.stream,
            )
            return {}
        if not all_finite(states):
            # Written before popmeta refused non-finite states (a diverged run).
            print(
                f"the worker states in {path} are not finite; every worker starts afresh",
                file=self.stream,
            )
            return {}
        return states

    def _move_aside(self, damaged: list[tuple[Path, Exception]], used: Path) -> None:
        aside = self.run.path / f"checkpoints-damaged-{time.strftime('%Y%m%d-%H%M%S')}"
        for path, err in damaged:
            log.warning("skipped damaged checkpoint %s (%s)", path, err)
        self.run.move_aside([path for path, _ in damaged], aside)
        print(
            f"{len(damaged)} newer checkpoint(s) are damaged and were moved to {aside}; "
            f"resuming from {used.name}",
            file=self.stream,
        )

    def _all_damaged(self, damaged: list[tuple[Path, Exception]]) -> str:
        listing = "; ".join(f"{path.name}: {err}" for path, err in damaged)
        return (
            f"every checkpoint of {self.run.location} is damaged ({listing}). Nothing was "
            f"changed: they are kept in {self.run.location_of(self.run.checkpoints)}. To go "
            "on, restore an intact copy of one there and rerun the same command; take the run "
            "over from a checkpoint elsewhere with --from-checkpoint CKPT; or start afresh "
            "under another name with --set name=NEW"
        )

    # ------------------------------------------------------------------ write

    def save(
        self, learner: Learner, export_worker_states: Callable[[], Mapping[int, WorkerState]]
    ) -> None:
        """Writes the checkpoint of ``learner``'s step, with the workers' states if they are usable.

        Nothing is written when this start already saved this step, when the
        learner holds a non-finite value (the newest checkpoint stays the
        newest good one), or when the workers have no states to give (a
        round stopped half-way) and the step's checkpoint exists (written at
        its boundary, with them).

        Args:
          learner: the learner now.
          export_worker_states: the workers' exported states by rank; if it
            raises, the checkpoint is written without them.

        Raises:
          OSError: the file could not be written (the previous ones are intact).
        """
        step = learner.version
        if self.saved_step == step:
            return
        learner_part = learner.checkpoint_tree()
        if not all_finite(learner_part):
            log.warning("step %d: theta or its optimizer state is not finite; no checkpoint", step)
            return
        try:
            states = dict(export_worker_states())
        except Exception as err:  # whatever the workers did, the learner's checkpoint is written
            log.warning("the worker states are not saved in this checkpoint: %r", err)
            states = {}
        if states and not all_finite(states):
            log.warning("step %d: some worker states are not finite; saved without them", step)
            states = {}
        if not states and checkpoint_path(self.run.checkpoints, step).exists():
            return
        save_run_checkpoint(
            self.run.checkpoints,
            learner_part,
            states,
            self.config,
            self.module_dirs,
            keep=self.keep,
        )
        self.saved_step = step
        self.run.sync()

    def newest(self) -> Path | None:
        """The newest checkpoint on disk (every one this module writes is finite)."""
        checkpoints = list_checkpoints(self.run.checkpoints)
        return checkpoints[-1] if checkpoints else None
