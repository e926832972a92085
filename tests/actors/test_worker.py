"""EstimatorWorker: keys, several truncations per call, phases, and sharding over devices.

The sharding checks need several devices, which ``XLA_FLAGS`` can force on the
host only before JAX initialises. So one subprocess with four forced host
devices runs every such check selected in this session
(:func:`run_forced_device_checks`), started with the module so that it runs
while the in-process tests do, and reports each check's outcome as JSON; each
test then passes or fails on its own check.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest

from popmeta.actors.worker import EstimatorWorker, call_key, worker_key
from popmeta.config import config_from_dict
from popmeta.core.estimators import (
    EstimateRunner,
    ShardedRunner,
    SingleDeviceRunner,
    make_runner,
)
from popmeta.experiment import (
    EstimatorSections,
    WorkerSpec,
    build_estimator,
    build_learned_optimizer,
)

REPO = Path(__file__).resolve().parents[2]
NUM_DEVICES = 4
#: The first forced-device test also waits for the subprocess behind all of them (its fixture).
FORCED_DEVICE_TIMEOUT_S = 600


#: The learned optimizer and task of each problem a sharded worker is checked on:
#: (c)'s shape in bench/estimators.py, made small, beside the quadratic.
PROBLEMS = {
    "quadratic": ({"kind": "learnable_sgdm"}, {"kind": "fixed_dim_quadratic_data", "dim": 4}),
    "image_mlp": (
        {"kind": "mlp"},
        {"kind": "image_mlp_digits", "width": 8, "depth": 1, "batch_size": 16},
    ),
}


def _config(
    kind="pes",
    num_tasks=4,
    truncations_per_call=1,
    shard_tasks=True,
    problem="quadratic",
    **estimator,
):
    learned_optimizer, task = PROBLEMS[problem]
    return config_from_dict(
        {
            "seed": 3,
            "task": task,
            "learned_optimizer": learned_optimizer,
            # Trajectories of 12 steps, truncations of 5 and offsets over the whole
            # trajectory: every task ends and restarts within a few calls.
            "truncation": {"kind": "constant", "length": 12},
            "estimator": {
                "kind": kind,
                # full_es unrolls whole trajectories: it has no truncation length.
                **({} if kind == "full_es" else {"trunc_length": 5}),
                "num_tasks": num_tasks,
                "random_initial_iteration_offset": 12,
                "truncations_per_call": truncations_per_call,
                **estimator,
            },
            "population": {"engine": "local", "shard_tasks": shard_tasks},
        }
    )


def _theta(config):
    return build_learned_optimizer(config.learned_optimizer).init(jax.random.key(0))


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def test_single_device_worker_runs_unsharded():
    assert len(jax.local_devices()) == 1  # the in-process tests see the default device
    worker = EstimatorWorker(WorkerSpec.of(_config(shard_tasks=True)), rank=0)
    assert isinstance(worker.runner, SingleDeviceRunner)
    assert isinstance(worker.runner, EstimateRunner)
    # The estimator's own runner: shared with estimator.compute_gradient_estimate.
    assert worker.runner.estimator is worker.estimator
    assert worker.num_devices == 1
    assert worker.num_tasks == 4


def test_make_runner_shards_only_over_several_devices():
    estimator = build_estimator(EstimatorSections.of(_config()))
    for devices in (None, jax.local_devices()):
        runner = make_runner(estimator, devices)
        assert isinstance(runner, SingleDeviceRunner) and runner.estimator is estimator
    with pytest.raises(ValueError, match="at least one device"):
        ShardedRunner(estimator, [])
    # A one-device mesh is allowed (it commits the state to that device).
    one_device = ShardedRunner(estimator, jax.local_devices())
    assert isinstance(one_device, EstimateRunner) and one_device.num_devices == 1


def test_steps_per_estimate_counts_truncations_per_call():
    assert EstimatorWorker(WorkerSpec.of(_config()), 0).steps_per_estimate == 2 * 4 * 5
    assert (
        EstimatorWorker(WorkerSpec.of(_config(truncations_per_call=3)), 0).steps_per_estimate
        == 2 * 4 * 5 * 3
    )
    tes = EstimatorWorker(WorkerSpec.of(_config("truncated_es", truncations_per_call=2)), 0)
    assert tes.steps_per_estimate == 3 * 4 * 5 * 2


def test_one_truncation_per_call_is_the_estimator_called_directly():
    config = _config()
    worker = EstimatorWorker(WorkerSpec.of(config), rank=1)
    estimator = build_estimator(EstimatorSections.of(config))
    root = worker_key(config.seed, 1)
    theta = _theta(config)
    state = estimator.init_worker_state(theta, root)
    phases = []
    for version in range(3):
        estimate = worker.compute(theta, version)
        out, metrics = estimator.compute_gradient_estimate(
            theta, state, jax.random.fold_in(root, version + 1)
        )
        state = out.state
        for a, b in zip(jax.tree_util.tree_leaves(estimate.grad), _leaves(out.grad), strict=True):
            np.testing.assert_array_equal(a, b)
        assert estimate.mean_loss == float(out.mean_loss)
        assert estimate.weight == float(out.weight)
        assert (estimate.version, estimate.worker) == (version, 1)
        assert estimate.metrics["compute_time_s"] > 0
        assert estimate.metrics["num_done"] == float(metrics["num_done"])
        # The phases travel with the estimate: each task's, after the call.
        expected_phases = estimator.truncated_step.trajectory_phase(estimator.unroll_state(state))
        assert estimate.phases.shape == (4,) and estimate.phases.dtype == np.float32
        np.testing.assert_array_equal(estimate.phases, np.asarray(expected_phases, np.float32))
        phases.append(estimate.phases)
    # Trajectories of 12 steps, 5 steps per call: the phases move between calls.
    assert not np.array_equal(phases[0], phases[1])
    assert all(np.all((p >= 0) & (p <= 1)) for p in phases)
    assert worker._phases._cache_size() == 1  # one compiled function for every call


def test_several_truncations_per_call_are_one_estimate_many_call():
    config = _config("nres", truncations_per_call=3)
    worker = EstimatorWorker(WorkerSpec.of(config), rank=0)
    estimator = build_estimator(EstimatorSections.of(config))
    root = worker_key(config.seed, 0)
    theta = _theta(config)
    state = estimator.init_worker_state(theta, root)
    num_done = 0.0
    for version in range(2):
        estimate = worker.compute(theta, version)
        out, metrics = estimator.compute_gradient_estimate(
            theta, state, jax.random.fold_in(root, version + 1), num_truncations=3
        )
        state = out.state
        for a, b in zip(jax.tree_util.tree_leaves(estimate.grad), _leaves(out.grad), strict=True):
            np.testing.assert_array_equal(a, b)
        assert estimate.weight == float(out.weight) == 3 * 4  # every task valid in every truncation
        assert estimate.mean_loss == float(out.mean_loss)
        assert set(estimate.metrics) == {*metrics, "compute_time_s"}
        num_done += estimate.metrics["num_done"]
    assert num_done >= 4  # 30 steps per task on trajectories of 12
    assert estimate.phases.shape == (4,)
    assert worker.runner.jitted_estimate(3)._cache_size() == 1


def test_every_call_gets_a_distinct_key_even_on_the_same_version():
    config = _config()
    worker = EstimatorWorker(WorkerSpec.of(config), rank=0)
    root = worker_key(config.seed, 0)
    versions = [0, 0, 0, 1, 2, 2]
    keys = [np.asarray(jax.random.key_data(worker._call_key(v))) for v in versions]
    assert len({tuple(k) for k in keys}) == len(keys)
    for first_of_version in (0, 3, 4):
        version = versions[first_of_version]
        np.testing.assert_array_equal(
            keys[first_of_version], jax.random.key_data(jax.random.fold_in(root, version + 1))
        )
    # Repeat keys never coincide with the keys of a call's later truncations.
    first = jax.random.fold_in(root, 1)
    repeat = jax.random.fold_in(jax.random.fold_in(first, 0), 1)
    np.testing.assert_array_equal(keys[1], jax.random.key_data(repeat))
    assert tuple(keys[1]) != tuple(np.asarray(jax.random.key_data(jax.random.fold_in(first, 1))))

    # Two calls on one version (async mode) draw different noise and data.
    theta = _theta(config)
    first_call, second_call = worker.compute(theta, 0), worker.compute(theta, 0)
    assert not all(
        np.allclose(a, b)
        for a, b in zip(
            jax.tree_util.tree_leaves(first_call.grad),
            jax.tree_util.tree_leaves(second_call.grad),
            strict=True,
        )
    )


# -- sharding over local devices (one subprocess with forced host devices) ---------------


def _assert_sharded(worker, state, num_devices):
    estimator = worker.estimator
    axes = jax.tree_util.tree_leaves(estimator.state_task_axes(state))
    leaves = jax.tree_util.tree_leaves(state)
    assert len(axes) == len(leaves)
    for axis, leaf in zip(axes, leaves, strict=True):
        sharding = leaf.sharding
        assert isinstance(sharding, jax.sharding.NamedSharding), sharding
        assert len(sharding.device_set) == num_devices
        assert sharding.spec[axis] == "tasks", (sharding.spec, axis, leaf.shape)
        shards = leaf.addressable_shards
        assert len(shards) == num_devices
        assert {s.device for s in shards} == set(jax.local_devices())
        for shard in shards:
            assert shard.data.shape[axis] == leaf.shape[axis] // num_devices


def check_sharded_matches_single_device(
    kind: str, truncations_per_call: int, problem: str = "quadratic"
) -> None:
    """Runs in a process that sees ``NUM_DEVICES`` devices; raises on any mismatch."""
    devices = jax.local_devices()
    assert len(devices) == NUM_DEVICES, devices
    num_tasks = 2 * NUM_DEVICES
    sharded = EstimatorWorker(
        WorkerSpec.of(_config(kind, num_tasks, truncations_per_call, problem=problem)), rank=2
    )
    single = EstimatorWorker(
        WorkerSpec.of(
            _config(kind, num_tasks, truncations_per_call, shard_tasks=False, problem=problem)
        ),
        rank=2,
    )
    assert isinstance(sharded.runner, ShardedRunner) and sharded.num_devices == NUM_DEVICES
    assert isinstance(single.runner, SingleDeviceRunner) and single.num_devices == 1
    assert sharded.steps_per_estimate == single.steps_per_estimate

    theta = _theta(_config(kind, problem=problem))
    num_done = 0.0
    previous = []
    for version in range(4):
        a = sharded.compute(theta, version)
        b = single.compute(theta, version)
        assert all(leaf.is_deleted() for leaf in previous), "the sharded state was not donated"
        for x, y in zip(
            jax.tree_util.tree_leaves(a.grad), jax.tree_util.tree_leaves(b.grad), strict=True
        ):
            # Antithetic differences of float32 losses of about 10 (resolution
            # ~1e-6), computed in another order across devices, over 2 std^2.
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5, err_msg=f"grad v{version}")
        np.testing.assert_allclose(a.mean_loss, b.mean_loss, rtol=1e-5)
        assert a.weight == b.weight
        assert set(a.metrics) == set(b.metrics)
        for name in a.metrics:
            if name != "compute_time_s":
                np.testing.assert_allclose(
                    a.metrics[name], b.metrics[name], rtol=1e-5, atol=1e-6, err_msg=name
                )
        if kind == "full_es":  # fresh episodes on every call: no trajectories to report
            assert a.phases is None and b.phases is None
        else:
            assert a.phases.shape == (num_tasks,) and a.phases.dtype == np.float32
            np.testing.assert_allclose(a.phases, b.phases)
        num_done += b.metrics.get("num_done", 0.0)
        _assert_sharded(sharded, sharded._state, NUM_DEVICES)
        previous = jax.tree_util.tree_leaves(sharded._state)
        # Move theta the way a learner would, identically for both workers.
        theta = jax.tree_util.tree_map(lambda t, g: t - 0.05 * g, theta, b.grad)
    if kind != "full_es":
        assert num_done >= num_tasks, "every task should end a trajectory during the calls"


def check_indivisible_num_tasks_is_refused() -> None:
    assert len(jax.local_devices()) == NUM_DEVICES
    with pytest.raises(ValueError, match=r"estimator\.num_tasks \(6\).*local devices \(4"):
        EstimatorWorker(WorkerSpec.of(_config(num_tasks=6)), rank=0)
    with pytest.raises(ValueError, match=r"num_tasks \(6\).*devices \(4\)"):
        make_runner(
            build_estimator(EstimatorSections.of(_config(num_tasks=6))), jax.local_devices()
        )
    # Without sharding any num_tasks works.
    worker = EstimatorWorker(WorkerSpec.of(_config(num_tasks=6, shard_tasks=False)), rank=0)
    assert isinstance(worker.runner, SingleDeviceRunner)


SHARDED_CASES = [
    ("pes", 1, "quadratic"),
    ("pes", 3, "quadratic"),
    ("nres", 2, "quadratic"),
    ("truncated_es", 1, "quadratic"),
    ("truncated_grad", 2, "quadratic"),
    ("full_es", 1, "quadratic"),
    ("pes", 1, "image_mlp"),
]


def _case_id(kind: str, truncations_per_call: int, problem: str) -> str:
    return f"{kind}-{truncations_per_call}" + ("" if problem == "quadratic" else f"-{problem}")


#: Every check that needs the forced devices, by name.
FORCED_DEVICE_CHECKS: dict[str, Callable[[], None]] = {
    **{
        f"sharded[{_case_id(*case)}]": functools.partial(check_sharded_matches_single_device, *case)
        for case in SHARDED_CASES
    },
    "indivisible": check_indivisible_num_tasks_is_refused,
}


def run_forced_device_checks(names: list[str]) -> dict[str, str | None]:
    """Runs the named checks in this process; per check, None if it passed, else its traceback."""
    results: dict[str, str | None] = {}
    for name in names:
        try:
            FORCED_DEVICE_CHECKS[name]()
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    return results


def _check_of(item: pytest.Item) -> str | None:
    """The forced-device check a test of this module reports, or None."""
    if item.originalname == "test_sharded_worker_matches_single_device_worker":
        return f"sharded[{item.callspec.id}]"
    if item.originalname == "test_num_tasks_not_divisible_by_device_count_is_refused":
        return "indivisible"
    return None


class ForcedDeviceRun:
    """The subprocess that runs the named forced-device checks, started at once.

    Its output goes to files next to ``out`` (pipes could fill up and block it
    while the in-process tests run).
    """

    def __init__(self, names: list[str], out: Path):
        env = dict(os.environ)
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={NUM_DEVICES}"
        ).strip()
        env["JAX_PLATFORMS"] = "cpu"
        code = (
            "import json, sys; import tests.actors.test_worker as t; "
            "json.dump(t.run_forced_device_checks(sys.argv[2:]), open(sys.argv[1], 'w'))"
        )
        self.out = out
        self.log = out.with_suffix(".log")
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code, str(out), *names],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def results(self, timeout: float) -> dict[str, str | None]:
        """Waits for the subprocess and returns each check's outcome (None: passed)."""
        try:
            returncode = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        assert returncode == 0, f"checks crashed:\n{self.log.read_text()[-6000:]}"
        return json.loads(self.out.read_text())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module", autouse=True)
def forced_device_run(request, tmp_path_factory):
    """Starts the forced-device checks of the tests selected in this session, if any.

    One subprocess runs them all (each would otherwise pay for its own JAX
    start-up), in the background while this module's in-process tests run.
    """
    names = sorted(
        {
            name
            for item in request.session.items
            if item.module is request.module and (name := _check_of(item)) is not None
        }
    )
    if not names:
        yield None
        return
    run = ForcedDeviceRun(names, tmp_path_factory.mktemp("forced_devices") / "results.json")
    yield run
    run.stop()


@pytest.fixture(scope="module")
def forced_device_results(forced_device_run: ForcedDeviceRun) -> dict[str, str | None]:
    """Outcomes of the forced-device checks, by name; None for a check that passed."""
    return forced_device_run.results(timeout=FORCED_DEVICE_TIMEOUT_S - 30)


def _assert_check_passed(results: dict[str, str | None], name: str) -> None:
    assert name in results, f"{name} was not run"
    failure = results[name]
    if failure is not None:
        pytest.fail(f"{name} failed in the forced-device subprocess:\n{failure}", pytrace=False)


@pytest.mark.timeout(FORCED_DEVICE_TIMEOUT_S)
@pytest.mark.parametrize("case", SHARDED_CASES, ids=[_case_id(*case) for case in SHARDED_CASES])
def test_sharded_worker_matches_single_device_worker(forced_device_results, case):
    _assert_check_passed(forced_device_results, f"sharded[{_case_id(*case)}]")


@pytest.mark.timeout(FORCED_DEVICE_TIMEOUT_S)
def test_num_tasks_not_divisible_by_device_count_is_refused(forced_device_results):
    _assert_check_passed(forced_device_results, "indivisible")


def test_the_traced_call_key_gives_the_keys_the_worker_gives():
    config = _config()
    worker = EstimatorWorker(WorkerSpec.of(config), rank=1)
    root = worker_key(config.seed, 1)
    traced = jax.jit(call_key)
    last, repeats = np.int32(-1), np.int32(0)
    for version in [0, 0, 0, 1, 2, 2, 5]:
        expected = worker._call_key(version)
        key, repeats = traced(root, np.int32(version), last, repeats)
        last = np.int32(version)
        np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(expected))
        assert int(repeats) == worker._repeats
