"""A run's checkpoints under faults: damaged files, non-finite states, a diverging run.

The runs are real (the local engine's workers, the learner, the checkpoint
files); the damage is done to the files on disk the way a bad disk or a
killed copy would: truncated archives and a flipped byte inside one array.
"""

from __future__ import annotations

import io
import math
import shutil
import zipfile
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from popmeta.actors.worker import exported_state_template
from popmeta.config import config_to_dict
from popmeta.experiment import WorkerSpec, learner_start
from popmeta.learner.checkpoint_layout import (
    WORKERS,
    load_run_checkpoint,
    read_run_metadata,
    save_run_checkpoint,
)
from popmeta.learner.checkpoints import list_checkpoints
from popmeta.learner.learner import Learner
from popmeta.population.local import LocalPopulation
from popmeta.run_checkpoints import RunCheckpoints, all_finite
from popmeta.run_dir import RunDirectory, RunDirectoryError
from popmeta.run_loop import DivergedError, train
from tests.local_run import local_config
from tests.population import tree_bytes

pytestmark = pytest.mark.timeout(240)


def _config(root: Path, num_steps: int = 4, name: str = "ckpts", **train: Any):
    return local_config(
        root, name=name, train={"num_steps": num_steps, "checkpoint_every": 2, **train}
    )


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 4-step run with checkpoints at steps 2 and 4; tests copy it."""
    root = tmp_path_factory.mktemp("runs")
    assert train(_config(root), stream=io.StringIO()).final_step == 4
    return root


def _copy(finished: Path, tmp_path: Path) -> Path:
    shutil.copytree(finished / "ckpts", tmp_path / "ckpts")
    return tmp_path / "ckpts"


def _flip_a_byte_of(path: Path, member_prefix: str) -> str:
    """Damages the stored bytes of the first archive member whose name starts with the prefix."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.startswith(member_prefix))
    data = bytearray(path.read_bytes())
    # The local header: 30 bytes, then the name and the extra field, then the data.
    name_length = int.from_bytes(data[info.header_offset + 26 : info.header_offset + 28], "little")
    extra_length = int.from_bytes(data[info.header_offset + 28 : info.header_offset + 30], "little")
    start = info.header_offset + 30 + name_length + extra_length
    data[start + info.compress_size - 1] ^= 0xFF
    path.write_bytes(bytes(data))
    return info.filename


def test_every_checkpoint_damaged_is_a_refusal_that_touches_nothing(finished, tmp_path):
    run = _copy(finished, tmp_path)
    for path in list_checkpoints(run / "checkpoints"):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # a cut-off copy
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(RunDirectoryError) as info:
        train(_config(tmp_path, num_steps=6), stream=io.StringIO())
    message = str(info.value)
    assert f"every checkpoint of {run} is damaged" in message
    assert "ckpt_00000002.npz" in message and "ckpt_00000004.npz" in message
    assert "--from-checkpoint" in message and "--set name=NEW" in message
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_damaged_workers_section_resumes_bitwise_from_the_checkpoint_before(finished, tmp_path):
    run = _copy(finished, tmp_path)
    newest = run / "checkpoints" / "ckpt_00000004.npz"
    damaged = _flip_a_byte_of(newest, f"['{WORKERS}']")
    # A reader of the learner alone (evaluation) does not even see the damage.
    load_run_checkpoint(newest, Learner.of(learner_start(_config(tmp_path))).checkpoint_tree())

    stream = io.StringIO()
    resumed = train(_config(tmp_path, num_steps=6), stream=stream)
    text = stream.getvalue()
    assert "resumed from" in text and "ckpt_00000002.npz at step 2" in text
    assert "worker states restored: rank(s) [0, 1]" in text
    (aside,) = run.glob("checkpoints-damaged-*")
    assert [p.name for p in aside.iterdir()] == ["ckpt_00000004.npz"], damaged
    assert resumed.final_step == 6

    straight = _config(tmp_path / "straight", num_steps=6)
    train(straight, stream=io.StringIO())
    learner = Learner.of(learner_start(straight))
    ends = [
        load_run_checkpoint(root / "checkpoints" / "ckpt_00000006.npz", learner.checkpoint_tree())
        for root in (run, tmp_path / "straight" / "ckpts")
    ]
    assert tree_bytes(ends[0].learner) == tree_bytes(ends[1].learner)


def _times(tree: Any, factor: float) -> Any:
    """``tree`` with every floating-point leaf multiplied by ``factor``."""
    return jax.tree_util.tree_map(
        lambda x: x * factor if np.issubdtype(np.asarray(x).dtype, np.floating) else x, tree
    )


class Diverging(LocalPopulation):
    """The real workers; from ``version`` on, their inner problems and estimates blow up."""

    version = 7

    def gather(self, theta: Any, version: int):
        gathered = super().gather(theta, version)
        if version < self.version:
            return gathered
        for worker in self.workers:
            state = worker.export_state()
            worker.load_state(state._replace(state=_times(state.state, np.nan)))
        estimates = [e._replace(grad=_times(e.grad, np.nan)) for e in gathered.estimates]
        return gathered._replace(estimates=estimates)


def test_a_diverging_run_keeps_its_good_checkpoints_and_names_one_that_exists(tmp_path):
    config = _config(tmp_path, num_steps=20, keep_checkpoints=3)
    with pytest.raises(DivergedError) as info:
        train(config, Diverging, stream=io.StringIO())
    checkpoints = list_checkpoints(tmp_path / "ckpts" / "checkpoints")
    # No checkpoint of the diverged step 7: the three good ones stay, none evicted.
    assert [p.name for p in checkpoints] == [f"ckpt_0000000{s}.npz" for s in (2, 4, 6)]
    learner = Learner.of(learner_start(config))
    for path in checkpoints:
        assert read_run_metadata(path).worker_ranks == (0, 1)
        assert all_finite(load_run_checkpoint(path, learner.checkpoint_tree()).learner)
    assert f"--from-checkpoint {checkpoints[-1]}" in str(info.value)
    # The same command with workers that behave resumes from it and trains on.
    stream = io.StringIO()
    assert train(_config(tmp_path, num_steps=8), stream=stream).final_step == 8
    assert "ckpt_00000006.npz at step 6" in stream.getvalue()


def test_a_checkpoint_never_holds_a_non_finite_value(finished, tmp_path, caplog):
    run_path = _copy(finished, tmp_path)
    config = _config(tmp_path, num_steps=6)
    run = RunDirectory(config.run_dir, config.name)
    checkpoints = RunCheckpoints(
        run,
        lambda: exported_state_template(WorkerSpec.of(config)),
        keep=config.train.keep_checkpoints,
        config=config_to_dict(config),
        module_dirs=[],
        learned_optimizer=config.learned_optimizer.kind,
        stream=io.StringIO(),
    )
    learner = Learner.of(learner_start(config))
    good = checkpoints.restore(learner, None)  # step 4, with its worker states
    assert sorted(good) == [0, 1]

    def poisoned():
        state = good[1]
        return {**good, 1: state._replace(state=_times(state.state, math.inf))}

    learner.state = learner.state.replace(step=learner.state.step + 1)
    checkpoints.save(learner, poisoned)
    written = run_path / "checkpoints" / "ckpt_00000005.npz"
    assert read_run_metadata(written).worker_ranks == ()  # saved without the workers
    assert "some worker states are not finite" in caplog.text

    learner.state = learner.state.replace(
        step=learner.state.step + 1,
        params=_times(learner.state.params, np.nan),
    )
    checkpoints.save(learner, lambda: good)
    assert not (run_path / "checkpoints" / "ckpt_00000006.npz").exists()
    assert "theta or its optimizer state is not finite; no checkpoint" in caplog.text


def test_worker_states_saved_non_finite_by_an_older_popmeta_start_afresh(finished, tmp_path):
    run = _copy(finished, tmp_path)
    newest = run / "checkpoints" / "ckpt_00000004.npz"
    config = _config(tmp_path, num_steps=6)
    learner = Learner.of(learner_start(config))
    saved = load_run_checkpoint(
        newest, learner.checkpoint_tree(), exported_state_template(WorkerSpec.of(config))
    )
    poisoned = {
        rank: state._replace(state=_times(state.state, np.nan))
        for rank, state in saved.workers.items()
    }
    metadata = saved.metadata
    save_run_checkpoint(
        newest.parent, saved.learner, poisoned, metadata.config, metadata.module_dirs, keep=None
    )
    stream = io.StringIO()
    assert train(config, stream=stream).final_step == 6
    assert "are not finite; every worker starts afresh" in stream.getvalue()
