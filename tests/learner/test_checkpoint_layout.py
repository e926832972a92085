"""A run's checkpoint as typed records, stored under the keys popmeta has always written."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from popmeta.actors.records import WorkerState
from popmeta.learner.checkpoint_layout import (
    LearnerCheckpoint,
    RunMetadata,
    load_run_checkpoint,
    read_run_metadata,
    save_run_checkpoint,
)
from popmeta.learner.checkpoints import save_checkpoint
from tests.population import tree_bytes


def _learner(step: int = 3) -> LearnerCheckpoint:
    theta = {"w": np.arange(4, dtype=np.float32)}
    return LearnerCheckpoint(
        step=np.int32(step),
        theta=theta,
        opt_state=({"mu": theta},),
        rng=np.array([0, 7], np.uint32),
    )


def _worker(version: int) -> WorkerState:
    return WorkerState(
        key=np.array([1, version], np.uint32),
        last_version=np.int64(version),
        repeats=np.int64(0),
        state={"acc": np.full((2, 4), version, np.float32)},
    )


def _template(record):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), record)


def test_records_are_stored_under_the_dict_keys_of_older_checkpoints(tmp_path):
    workers = {0: _worker(2), 1: _worker(3)}
    path = save_run_checkpoint(tmp_path, _learner(), workers, {"name": "x"}, ["/m"], keep=None)
    assert path.name == "ckpt_00000003.npz"
    with np.load(path) as archive:
        keys = set(archive.files) - {"__metadata__"}
    assert keys == {
        "['step']",
        "['theta']['w']",
        "['opt_state'][0]['mu']['w']",
        "['rng']",
        *(
            f"['workers']['{rank}']{entry}"
            for rank in "01"
            for entry in ("['key']", "['last_version']", "['repeats']", "['state']['acc']")
        ),
    }
    assert read_run_metadata(path) == RunMetadata(3, {"name": "x"}, ("/m",), (0, 1))


def test_a_run_checkpoint_comes_back_as_the_records_it_was_saved_from(tmp_path):
    learner, workers = _learner(), {0: _worker(2), 1: _worker(3)}
    path = save_run_checkpoint(tmp_path, learner, workers, {}, [], keep=None)
    restored = load_run_checkpoint(path, _template(learner), _template(workers[0]))
    assert isinstance(restored.learner, LearnerCheckpoint)
    assert tree_bytes(restored.learner) == tree_bytes(learner)
    assert list(restored.workers) == [0, 1]
    assert all(isinstance(state, WorkerState) for state in restored.workers.values())
    assert tree_bytes(restored.workers) == tree_bytes(workers)
    # Without a worker template the section is left out, unread.
    assert load_run_checkpoint(path, _template(learner)).workers == {}
    with pytest.raises(ValueError, match=r"\['workers'\]\['0'\]\['state'\]\['acc'\]"):
        wider = _worker(0)._replace(state={"acc": np.zeros((2, 5), np.float32)})
        load_run_checkpoint(path, _template(learner), _template(wider))


def test_a_checkpoint_without_metadata_or_workers_reads_with_the_defaults(tmp_path):
    # As checkpoints were before the workers' states: the learner's keys alone.
    path = save_checkpoint(tmp_path, 3, _learner()._asdict(), metadata={})
    assert read_run_metadata(path) == RunMetadata(step=3)
    restored = load_run_checkpoint(path, _template(_learner()), _template(_worker(0)))
    assert restored.workers == {} and restored.metadata.config is None
    assert tree_bytes(restored.learner) == tree_bytes(_learner())
