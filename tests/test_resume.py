"""Exact resume: a sync run stopped anywhere and resumed ends bitwise equal to one never stopped.

Every run here is real: the training loop with the local engine or real Ray
actors, real SIGINTs delivered to this process, and one real ``popmeta train``
subprocess killed with SIGKILL. The runs are stopped by a SIGINT sent during
the gather of a chosen version, so they end with the checkpoint that Ctrl-C
writes (and without the final evaluation, which resuming does not touch).
"""

from __future__ import annotations

import dataclasses
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
import pytest

from popmeta.actors.worker import EstimatorWorker, exported_state_template
from popmeta.config import Config, PopulationConfig, config_to_yaml
from popmeta.experiment import EstimatorSections, WorkerSpec, initial_theta, learner_start
from popmeta.learner.checkpoint_file import load_checkpoint
from popmeta.learner.checkpoint_layout import (
    RunCheckpoint,
    load_run_checkpoint,
    read_run_metadata,
)
from popmeta.learner.checkpoints import list_checkpoints, save_checkpoint
from popmeta.learner.learner import Learner
from popmeta.population.local import LocalPopulation
from popmeta.population.ray_population import RayPopulation
from popmeta.run_loop import train
from tests.local_run import local_config
from tests.population import CALL_TIMEOUT_S, local_population_of, population_of, tree_bytes
from tests.processes import env_with_compilation_cache

pytestmark = pytest.mark.timeout(300)

#: Learner steps of every run; stops land on steps that are not multiples of
#: ``train.checkpoint_every`` (2).
NUM_STEPS = 5
#: PES keeps accumulators; trajectories of 10 steps in truncations of 5 end
#: and restart within the run, so resets cross the stops too.
PES = {"kind": "pes"}


def _config(run_dir: Path, name: str, **sections: dict[str, Any]) -> Config:
    sections["train"] = {"num_steps": NUM_STEPS, "checkpoint_every": 2, **sections.get("train", {})}
    sections["estimator"] = {**PES, **sections.get("estimator", {})}
    return local_config(run_dir, name, **sections)


class _Interrupting:
    """A population that sends this process a real SIGINT while gathering one version.

    The run's SIGINT handler then stops it after that step, as Ctrl-C does.
    """

    def __init__(self, population: Any, at_version: int):
        self._population = population
        self._at_version = at_version

    def gather(self, theta: Any, version: int) -> Any:
        if version == self._at_version:
            os.kill(os.getpid(), signal.SIGINT)
        return self._population.gather(theta, version)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._population, name)


def _stopping(make: Any, at_version: int) -> Any:
    return lambda population, worker: _Interrupting(make(population, worker), at_version)


def _final(config: Config) -> RunCheckpoint:
    """The run's newest checkpoint, learner and worker states."""
    path = list_checkpoints(Path(config.run_dir) / config.name / "checkpoints")[-1]
    learner = Learner.of(learner_start(config)).checkpoint_tree()
    return load_run_checkpoint(path, learner, exported_state_template(WorkerSpec.of(config)))


def _train(config: Config, factory: Any) -> str:
    out = io.StringIO()
    train(config, factory, stream=out)
    return out.getvalue()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> RunCheckpoint:
    """The final checkpoint of a local run of ``NUM_STEPS`` steps, never stopped before."""
    config = _config(tmp_path_factory.mktemp("reference"), "reference")
    # Stopped during its last step: the same checkpoint, without the evaluation.
    _train(config, _stopping(LocalPopulation, NUM_STEPS - 1))
    final = _final(config)
    assert final.metadata.step == NUM_STEPS
    assert final.metadata.worker_ranks == (0, 1)
    return final


def _assert_bitwise_equal(a: RunCheckpoint, b: RunCheckpoint) -> None:
    assert a.metadata.step == b.metadata.step
    assert list(a.workers) == list(b.workers) == [0, 1]
    for name, section in a.learner._asdict().items():
        assert tree_bytes(section) == tree_bytes(getattr(b.learner, name)), name
    for rank, state in a.workers.items():
        assert tree_bytes(state) == tree_bytes(b.workers[rank]), rank


# ---------------------------------------------------------------------- worker


def test_a_worker_continues_bit_for_bit_from_an_exported_state(tmp_path):
    config = _config(tmp_path, "worker")
    theta = jax.tree_util.tree_map(np.asarray, initial_theta(EstimatorSections.of(config)))
    original = EstimatorWorker(WorkerSpec.of(config), rank=1)
    assert original.export_state() is None  # nothing to save before the first estimate
    original.compute(theta, 0)
    original.compute(theta, 1)
    saved = original.export_state()
    # A repeat of version 1 uses a key of its own: the repeat count is in the state.
    expected = [original.compute(theta, 1), original.compute(theta, 2)]

    resumed = EstimatorWorker(WorkerSpec.of(config), rank=1)
    resumed.load_state(saved)
    assert tree_bytes(resumed.export_state()) == tree_bytes(saved)
    got = [resumed.compute(theta, 1), resumed.compute(theta, 2)]
    for want, have in zip(expected, got, strict=True):
        assert tree_bytes(have.grad) == tree_bytes(want.grad)
        assert (have.mean_loss, have.weight) == (want.mean_loss, want.weight)
        assert np.array_equal(have.phases, want.phases)

    # Without the state the same calls give other estimates: the state matters.
    fresh = EstimatorWorker(WorkerSpec.of(config), rank=1)
    assert tree_bytes(fresh.compute(theta, 1).grad) != tree_bytes(expected[0].grad)


def test_a_state_that_does_not_fit_is_refused_naming_the_entry(tmp_path):
    config = _config(tmp_path, "worker")
    theta = jax.tree_util.tree_map(np.asarray, initial_theta(EstimatorSections.of(config)))
    worker = EstimatorWorker(WorkerSpec.of(config), rank=0)
    worker.compute(theta, 0)
    before = worker.export_state()
    other = _config(tmp_path, "other", estimator={"num_tasks": 4})
    bigger = EstimatorWorker(WorkerSpec.of(other), rank=0)
    bigger.compute(theta, 0)
    with pytest.raises(
        ValueError, match=r"params: expected float32\[2, 2, 3\] .*found float32\[2, 4, 3\]"
    ):
        worker.load_state(bigger.export_state())
    nres = EstimatorWorker(
        WorkerSpec.of(_config(tmp_path, "nres", estimator={"kind": "nres"})), rank=0
    )
    nres.compute(theta, 0)
    with pytest.raises(ValueError, match=r"worker state entry .*\.accumulator.* is missing"):
        worker.load_state(nres.export_state())
    assert tree_bytes(worker.export_state()) == tree_bytes(before)  # left as it was


def test_a_gather_interrupted_half_way_exports_no_states(tmp_path):
    population = local_population_of(_config(tmp_path, "half"))
    theta = jax.tree_util.tree_map(np.asarray, initial_theta(population.workers[0].spec.sections))
    population.gather(theta, 0)
    assert sorted(population.export_worker_states()) == [0, 1]

    def interrupted(theta: Any, version: int) -> Any:
        raise KeyboardInterrupt

    population.workers[1].compute = interrupted
    with pytest.raises(KeyboardInterrupt):
        population.gather(theta, 1)
    # Rank 0 is a call ahead of rank 1: no consistent set of states to save.
    assert population.export_worker_states() == {}


def test_readers_of_the_learner_alone_leave_the_optional_workers_section_out(tmp_path):
    tree = {"theta": np.arange(3.0), "workers": {"0": {"acc": np.ones((2, 3), np.float32)}}}
    path = save_checkpoint(tmp_path, 1, tree, optional=("workers",))
    assert set(load_checkpoint(path, {"theta": np.zeros(3)}).tree) == {"theta"}
    # A reader that asks for the section gets it as strictly as the rest.
    full = load_checkpoint(path, tree).tree
    assert np.array_equal(full["workers"]["0"]["acc"], tree["workers"]["0"]["acc"])
    wrong = {**tree, "workers": {"0": {"acc": np.ones((2, 4), np.float32)}}}
    with pytest.raises(ValueError, match=r"\['workers'\]\['0'\]\['acc'\]: expected \(2, 4\)"):
        load_checkpoint(path, wrong)
    # Only sections saved as optional may be left out.
    plain = save_checkpoint(tmp_path / "plain", 1, tree)
    with pytest.raises(ValueError, match=r"has key \['workers'\]\['0'\]\['acc'\] that is not"):
        load_checkpoint(plain, {"theta": np.zeros(3)})
    with pytest.raises(ValueError, match="optional sections"):
        save_checkpoint(tmp_path, 2, tree, optional=("missing",))


# ---------------------------------------------------------------------- local engine


def test_local_run_stopped_at_a_non_multiple_step_resumes_bitwise(tmp_path, reference):
    config = _config(tmp_path, "stopped")
    # SIGINT during the gather of version 2: the run stops after step 3.
    first = _train(config, _stopping(LocalPopulation, 2))
    assert "interrupted (SIGINT) at step 3:" in first and "ckpt_00000003.npz is saved" in first
    stopped = _final(config).metadata
    assert (stopped.step, stopped.worker_ranks) == (3, (0, 1))

    resumed = _train(config, _stopping(LocalPopulation, NUM_STEPS - 1))
    assert "resumed from" in resumed and "ckpt_00000003.npz at step 3" in resumed
    assert "worker states restored: rank(s) [0, 1]" in resumed
    _assert_bitwise_equal(_final(config), reference)


def test_second_ctrl_c_mid_round_keeps_the_checkpoint_of_the_round_boundary(tmp_path, reference):
    config = _config(tmp_path, "twice")

    def factory(population_config: PopulationConfig, worker: WorkerSpec) -> LocalPopulation:
        population = LocalPopulation(population_config, worker)
        compute = population.workers[1].compute

        def compute_or_stop(theta: Any, version: int) -> Any:
            if version == 4:  # after rank 0's call: a second Ctrl-C, straight through
                raise KeyboardInterrupt
            return compute(theta, version)

        population.workers[1].compute = compute_or_stop
        return population

    _train(config, factory)
    kept = _final(config).metadata
    # Step 4 was checkpointed at its boundary (checkpoint_every=2), with the
    # workers; the interrupted round did not overwrite it.
    assert (kept.step, kept.worker_ranks) == (4, (0, 1))
    _train(config, _stopping(LocalPopulation, NUM_STEPS - 1))
    _assert_bitwise_equal(_final(config), reference)


def test_checkpoints_without_worker_states_still_resume(tmp_path, reference):
    config = _config(tmp_path, "old")
    _train(config, _stopping(LocalPopulation, 2))
    # Rewrite the newest checkpoint as checkpoints were before worker states:
    # the learner's tree only, no optional section, no worker_ranks.
    path = list_checkpoints(tmp_path / "old" / "checkpoints")[-1]
    learner_only = load_run_checkpoint(path, Learner.of(learner_start(config)).checkpoint_tree())
    step = learner_only.metadata.step
    save_checkpoint(path.parent, step, learner_only.learner._asdict(), metadata={})
    out = _train(config, _stopping(LocalPopulation, NUM_STEPS - 1))
    assert "at step 3" in out and "worker states restored" not in out
    final = _final(config)
    assert final.metadata.step == NUM_STEPS
    # The workers started afresh, so theta went elsewhere: what the states are for.
    assert tree_bytes(final.learner.theta) != tree_bytes(reference.learner.theta)


def test_a_run_with_a_decaying_meta_learning_rate_resumes_bitwise(tmp_path):
    decaying = {"learning_rate": 0.01, "lr_decay": "cosine", "lr_decay_to": 0.1}
    straight = _config(tmp_path, "straight", outer_optimizer=decaying)
    _train(straight, _stopping(LocalPopulation, NUM_STEPS - 1))
    stopped = _config(tmp_path, "stopped", outer_optimizer=decaying)
    _train(stopped, _stopping(LocalPopulation, 2))
    assert "resumed from" in _train(stopped, _stopping(LocalPopulation, NUM_STEPS - 1))
    resumed, never_stopped = _final(stopped), _final(straight)
    _assert_bitwise_equal(resumed, never_stopped)
    # The decay's update count is saved with the optimizer state, and it decayed theta's steps.
    opt_state = resumed.learner.opt_state
    counts = [int(s.count) for s in opt_state if isinstance(s, optax.ScaleByScheduleState)]
    assert counts == [NUM_STEPS]
    constant = _config(tmp_path, "constant", outer_optimizer={"learning_rate": 0.01})
    _train(constant, _stopping(LocalPopulation, NUM_STEPS - 1))
    assert tree_bytes(_final(constant).learner.theta) != tree_bytes(never_stopped.learner.theta)


def test_a_take_over_with_another_estimator_starts_the_workers_afresh(tmp_path):
    config = _config(tmp_path, "take")
    _train(config, _stopping(LocalPopulation, 2))
    path = list_checkpoints(tmp_path / "take" / "checkpoints")[-1]
    other = _config(tmp_path, "take", estimator={"kind": "nres"})
    out = io.StringIO()
    train(other, _stopping(LocalPopulation, 3), stream=out, from_checkpoint=path)
    text = out.getvalue()
    assert "do not fit this config" in text and "every worker starts afresh" in text
    assert _final(other).metadata.step == 4


# ---------------------------------------------------------------------- Ray engine


def _ray_config(run_dir: Path, name: str, **population: Any) -> Config:
    settings = {"engine": "ray", "num_actors": 2, "call_timeout_s": CALL_TIMEOUT_S, **population}
    return _config(run_dir, name, population=settings)


def test_ray_sync_run_stopped_at_a_non_multiple_step_resumes_bitwise(
    ray_session, tmp_path, reference
):
    config = _ray_config(tmp_path, "ray")
    _train(config, _stopping(RayPopulation, 2))
    assert _final(config).metadata.step == 3
    # Fresh actor processes continue from the saved states.
    resumed = _train(config, _stopping(RayPopulation, NUM_STEPS - 1))
    assert "worker states restored: rank(s) [0, 1]" in resumed
    # Sync Ray is bitwise equal to the local engine, so to the local reference.
    _assert_bitwise_equal(_final(config), reference)


def test_a_run_started_on_the_local_engine_continues_on_ray_bitwise(
    ray_session, tmp_path, reference
):
    local = _config(tmp_path, "moved")
    _train(local, _stopping(LocalPopulation, 2))
    on_ray = _ray_config(tmp_path, "moved")
    resumed = _train(on_ray, _stopping(RayPopulation, NUM_STEPS - 1))
    assert "ckpt_00000003.npz at step 3" in resumed
    assert "worker states restored: rank(s) [0, 1]" in resumed
    _assert_bitwise_equal(_final(on_ray), reference)


def test_ray_async_actors_take_their_saved_states_where_they_fit(ray_session, tmp_path):
    config = _ray_config(tmp_path, "async", mode="async", batch_size=2, calls_in_flight=2)
    theta = jax.tree_util.tree_map(np.asarray, initial_theta(EstimatorSections.of(config)))
    with population_of(config) as population:
        for version in range(3):
            population.gather(theta, version)
        # Calls are still queued: each state is the one they leave behind.
        saved = population.export_worker_states()
    assert sorted(saved) == [0, 1]
    # The actor that answered first in the last gather was given version 2 at once.
    assert max(int(state.last_version) for state in saved.values()) == 2

    wrong = saved[1]._replace(key=np.zeros(5, np.uint32))
    with population_of(config) as population:
        outcome = population.load_worker_states({0: saved[0], 1: wrong, 7: saved[0]})
        assert outcome.restored == (0,)
        assert list(outcome.fresh) == [1] and ".key: expected uint32[2]" in outcome.fresh[1]
        assert outcome.unused == (7,)
        again = population.export_worker_states()
    assert tree_bytes(again[0]) == tree_bytes(saved[0])
    assert 1 not in again  # fresh, and it has not computed yet


# ---------------------------------------------------------------------- SIGKILL


def test_driver_killed_after_a_checkpoint_resumes_bitwise(tmp_path):
    """A real ``popmeta train`` killed with SIGKILL; the rerun ends like a run never killed."""
    steps = 200
    config = local_config(
        tmp_path,
        "killed",
        estimator=PES,
        train={"num_steps": steps, "checkpoint_every": 3, "log_every": 1000},
    )
    config_file = tmp_path / "killed.yaml"
    config_file.write_text(config_to_yaml(config))
    command = [sys.executable, "-m", "popmeta.cli", "train", str(config_file)]
    checkpoints = tmp_path / "killed" / "checkpoints"
    with subprocess.Popen(
        command,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env_with_compilation_cache(),
    ) as driver:
        deadline = time.monotonic() + 180
        while not list_checkpoints(checkpoints) and driver.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.02)
        driver.send_signal(signal.SIGKILL)
        driver.communicate(timeout=60)
    assert driver.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    killed_at = list_checkpoints(checkpoints)[-1]
    assert read_run_metadata(killed_at).step < steps

    rerun = subprocess.run(
        command,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env=env_with_compilation_cache(),
    )
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"resumed from {killed_at}" in rerun.stdout
    assert "worker states restored: rank(s) [0, 1]" in rerun.stdout

    never_killed = dataclasses.replace(config, name="never")
    _train(never_killed, _stopping(LocalPopulation, steps - 1))
    a, b = _final(config), _final(never_killed)
    assert a.metadata.step == steps
    _assert_bitwise_equal(a, b)
