"""EstimatorWorker: keys, several truncations per call, and task sharding over local devices.

The sharding tests run in a subprocess with ``XLA_FLAGS`` forcing four host
devices, since the flag only takes effect before JAX initialises; the
subprocess runs :func:`check_sharded_matches_single_device` from this module.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from popmeta.actors.worker import EstimatorWorker, worker_key
from popmeta.config import config_from_dict
from popmeta.experiment import build_estimator, build_learned_optimizer

REPO = Path(__file__).resolve().parents[2]
NUM_DEVICES = 4


def _config(kind="pes", num_tasks=4, truncations_per_call=1, shard_tasks=True, **estimator):
    return config_from_dict(
        {
            "seed": 3,
            "task": {"family": "fixed_dim_quadratic_data", "dim": 4},
            "learned_optimizer": {"kind": "learnable_sgdm"},
            # Trajectories of 12 steps, truncations of 5 and offsets over the whole
            # trajectory: every task ends and restarts within a few calls.
            "truncation": {"schedule": "constant", "length": 12},
            "estimator": {
                "kind": kind,
                "trunc_length": 5,
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
    worker = EstimatorWorker(_config(shard_tasks=True), rank=0)
    assert worker.sharding is None
    assert worker.num_devices == 1
    assert worker.num_tasks == 4
    assert worker.trajectory_phases().shape == (0,)


def test_steps_per_estimate_counts_truncations_per_call():
    assert EstimatorWorker(_config(), 0).steps_per_estimate == 2 * 4 * 5
    assert EstimatorWorker(_config(truncations_per_call=3), 0).steps_per_estimate == 2 * 4 * 5 * 3
    tes = EstimatorWorker(_config("truncated_es", truncations_per_call=2), 0)
    assert tes.steps_per_estimate == 3 * 4 * 5 * 2


def test_one_truncation_per_call_is_the_estimator_called_directly():
    config = _config()
    worker = EstimatorWorker(config, rank=1)
    estimator = build_estimator(config)
    root = worker_key(config.seed, 1)
    theta = _theta(config)
    state = estimator.init_worker_state(theta, root)
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
    assert worker.trajectory_phases().shape == (4,)


def test_several_truncations_per_call_are_one_estimate_many_call():
    config = _config("nres", truncations_per_call=3)
    worker = EstimatorWorker(config, rank=0)
    estimator = build_estimator(config)
    root = worker_key(config.seed, 0)
    theta = _theta(config)
    state = estimator.init_worker_state(theta, root)
    num_done = 0.0
    for version in range(2):
        estimate = worker.compute(theta, version)
        out, metrics = estimator.compute_gradient_estimates(
            theta, state, jax.random.fold_in(root, version + 1), 3
        )
        state = out.state
        for a, b in zip(jax.tree_util.tree_leaves(estimate.grad), _leaves(out.grad), strict=True):
            np.testing.assert_array_equal(a, b)
        assert estimate.weight == float(out.weight) == 3 * 4  # every task valid in every truncation
        assert estimate.mean_loss == float(out.mean_loss)
        assert set(estimate.metrics) == {*metrics, "compute_time_s"}
        num_done += estimate.metrics["num_done"]
    assert num_done >= 4  # 30 steps per task on trajectories of 12
    assert worker.estimator.jitted_estimate_many(3)._cache_size() == 1


def test_every_call_gets_a_distinct_key_even_on_the_same_version():
    config = _config()
    worker = EstimatorWorker(config, rank=0)
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


# -- sharding over local devices (subprocess with forced host devices) ------------------


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


def check_sharded_matches_single_device(kind: str, truncations_per_call: int) -> None:
    """Runs in a process that sees ``NUM_DEVICES`` devices; raises on any mismatch."""
    devices = jax.local_devices()
    assert len(devices) == NUM_DEVICES, devices
    num_tasks = 2 * NUM_DEVICES
    sharded = EstimatorWorker(_config(kind, num_tasks, truncations_per_call), rank=2)
    single = EstimatorWorker(
        _config(kind, num_tasks, truncations_per_call, shard_tasks=False), rank=2
    )
    assert sharded.sharding is not None and sharded.num_devices == NUM_DEVICES
    assert single.sharding is None and single.num_devices == 1
    assert sharded.steps_per_estimate == single.steps_per_estimate

    theta = _theta(_config(kind))
    num_done = 0.0
    previous = []
    for version in range(4):
        a = sharded.compute(theta, version)
        b = single.compute(theta, version)
        assert all(leaf.is_deleted() for leaf in previous), "the sharded state was not donated"
        for x, y in zip(
            jax.tree_util.tree_leaves(a.grad), jax.tree_util.tree_leaves(b.grad), strict=True
        ):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7, err_msg=f"grad v{version}")
        np.testing.assert_allclose(a.mean_loss, b.mean_loss, rtol=1e-5)
        assert a.weight == b.weight
        assert set(a.metrics) == set(b.metrics)
        for name in a.metrics:
            if name != "compute_time_s":
                np.testing.assert_allclose(a.metrics[name], b.metrics[name], rtol=1e-5)
        np.testing.assert_allclose(sharded.trajectory_phases(), single.trajectory_phases())
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
        EstimatorWorker(_config(num_tasks=6), rank=0)
    # Without sharding any num_tasks works.
    worker = EstimatorWorker(_config(num_tasks=6, shard_tasks=False), rank=0)
    assert worker.sharding is None


def _run_with_forced_devices(call: str) -> None:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={NUM_DEVICES}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    code = f"import tests.actors.test_worker as t; t.{call}"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, f"{call} failed:\n{result.stdout}\n{result.stderr[-6000:]}"


@pytest.mark.parametrize(
    "kind,truncations_per_call",
    [
        ("pes", 1),
        ("pes", 3),
        ("nres", 2),
        ("truncated_es", 1),
        ("truncated_grad", 2),
        ("full_es", 1),
    ],
)
def test_sharded_worker_matches_single_device_worker(kind, truncations_per_call):
    _run_with_forced_devices(
        f"check_sharded_matches_single_device({kind!r}, {truncations_per_call})"
    )


def test_num_tasks_not_divisible_by_device_count_is_refused():
    _run_with_forced_devices("check_indivisible_num_tasks_is_refused()")
