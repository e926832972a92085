"""What a run's checkpoint holds, as typed records, and the keys they have on disk.

A run's checkpoint (one file of :mod:`popmeta.learner.checkpoint_file`) holds
the learner (:class:`LearnerCheckpoint`), in its optional section ``workers``
each worker's exported state by rank (a record such as
:class:`~popmeta.actors.records.WorkerState`), and in its header the run's
recorded config, where its user modules were found and the ranks saved
(:class:`RunMetadata`). No other module knows these keys.

A record is stored as a dict of its fields, under exactly the keys popmeta
wrote before these records existed (``['theta']['w']``, never ``.theta['w']``),
so every checkpoint written since reads unchanged, with no table of old keys
to keep; tests resume runs written by older popmeta (``tests/data/run_of_*``).
Renaming a field therefore needs a translation of its old key here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from popmeta.learner.checkpoint_file import PathLike, load_checkpoint, read_checkpoint_metadata
from popmeta.learner.checkpoints import save_checkpoint

__all__ = [
    "WORKERS",
    "LearnerCheckpoint",
    "RunCheckpoint",
    "RunMetadata",
    "load_run_checkpoint",
    "read_run_metadata",
    "save_run_checkpoint",
]

#: The checkpoint section with the workers' exported states, by rank: optional,
#: so readers that need only the learner (evaluation) leave it out unread.
WORKERS = "workers"


class LearnerCheckpoint(NamedTuple):
    """The learner's part of a run's checkpoint.

    Attributes:
      step: the learner's step (theta's version), an int32 scalar.
      theta: the meta-parameters.
      opt_state: the outer optimizer's state.
      rng: the learner's root key, as raw key data (``jax.random.key_data``).
    """

    step: Any
    theta: Any
    opt_state: Any
    rng: Any


class RunMetadata(NamedTuple):
    """What a run's checkpoint says of itself, read from its header alone.

    Attributes:
      step: the learner step it was saved at.
      config: the run's config as ``popmeta.config.config_to_dict`` wrote it;
        None in a file written without one.
      module_dirs: the directories the config's user modules were found in.
      worker_ranks: the ranks whose states the ``workers`` section holds, in
        order; empty when it has none.
    """

    step: int
    config: dict[str, Any] | None = None
    module_dirs: tuple[str, ...] = ()
    worker_ranks: tuple[int, ...] = ()

    @classmethod
    def from_header(cls, header: Mapping[str, Any]) -> RunMetadata:
        """From what :func:`~popmeta.learner.checkpoint_file.read_checkpoint_metadata` gives.

        Entries a file lacks (older checkpoints have no ``worker_ranks``)
        keep their defaults.
        """
        config = header.get("config")
        return cls(
            step=int(header["step"]),
            config=config if isinstance(config, dict) else None,
            module_dirs=tuple(header.get("module_dirs", ())),
            worker_ranks=tuple(int(rank) for rank in header.get("worker_ranks", ())),
        )


class RunCheckpoint(NamedTuple):
    """A run's checkpoint, restored.

    Attributes:
      path: the file it was read from.
      metadata: its header.
      learner: the learner's part.
      workers: rank -> that worker's restored record; empty when the
        ``workers`` section was left out or the file has none.
    """

    path: Path
    metadata: RunMetadata
    learner: LearnerCheckpoint
    workers: dict[int, Any]


def save_run_checkpoint(
    directory: PathLike,
    learner: LearnerCheckpoint,
    workers: Mapping[int, Any],
    config: Mapping[str, Any],
    module_dirs: Sequence[str],
    keep: int | None,
) -> Path:
    """Atomically writes the checkpoint of ``learner``'s step in ``directory``.

    Args:
      directory: the run's checkpoints directory.
      learner: the learner's part.
      workers: each worker's exported state (a NamedTuple) by rank; none
        leaves the ``workers`` section out.
      config: the run's config as ``popmeta.config.config_to_dict`` gives it.
      module_dirs: where the config's user modules were found.
      keep: keep only the newest ``keep`` checkpoints (None keeps all).

    Returns:
      The path written.

    Raises:
      OSError: the file could not be written (the previous ones are intact).
    """
    tree: dict[str, Any] = learner._asdict()
    if workers:
        tree[WORKERS] = {str(rank): state._asdict() for rank, state in workers.items()}
    metadata = {
        "config": dict(config),
        "module_dirs": list(module_dirs),
        "worker_ranks": sorted(workers),
    }
    optional = (WORKERS,) if workers else ()
    return save_checkpoint(directory, int(learner.step), tree, keep, metadata, optional)


def read_run_metadata(path: PathLike) -> RunMetadata:
    """The header of the run checkpoint ``path``; no array is read.

    Raises:
      FileNotFoundError: there is no such file.
      CheckpointCorruptedError: the file or its header is damaged.
    """
    return RunMetadata.from_header(read_checkpoint_metadata(path))


def load_run_checkpoint(
    path: PathLike, learner: LearnerCheckpoint, worker: Any = None
) -> RunCheckpoint:
    """Restores a run's checkpoint into the structure of ``learner`` (and of ``worker``).

    Args:
      path: the checkpoint file.
      learner: a template of the learner's part (its values are ignored),
        e.g. :meth:`popmeta.learner.learner.Learner.checkpoint_tree`.
      worker: a template of one worker's state (a NamedTuple), e.g.
        :func:`popmeta.actors.worker.exported_state_template`, into which every
        saved rank is restored; None leaves the ``workers`` section out, unread.

    Returns:
      The restored :class:`RunCheckpoint`; its worker records have the type of
      ``worker``.

    Raises:
      FileNotFoundError: there is no such file.
      CheckpointCorruptedError: a section read is damaged.
      ValueError: a section read does not fit its template (the message names
        the key and the file).
    """
    target: dict[str, Any] = learner._asdict()
    if worker is not None:
        ranks = read_run_metadata(path).worker_ranks
        if ranks:
            target[WORKERS] = {str(rank): worker._asdict() for rank in ranks}
    restored = load_checkpoint(path, target)
    tree = restored.tree
    workers = {int(rank): type(worker)(**state) for rank, state in tree.pop(WORKERS, {}).items()}
    return RunCheckpoint(
        path=restored.path,
        metadata=RunMetadata.from_header({**restored.metadata, "step": restored.step}),
        learner=LearnerCheckpoint(**tree),
        workers=workers,
    )
