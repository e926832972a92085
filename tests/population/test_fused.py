"""The local engine's fused rounds take the steps unfused rounds take, with what the run loop needs."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from popmeta.actors.worker import FusionCarry
from popmeta.config import ConfigError, config_to_yaml
from popmeta.core.estimators.estimator_out import EstimatorOut
from popmeta.estimate import Estimate
from popmeta.learner.checkpoints import list_checkpoints
from popmeta.learner.learner import Learner
from popmeta.population.fused import FusedCall, build_rounds_fn
from popmeta.population.local import LocalPopulation
from popmeta.run_loop import DivergedError, train
from tests.events import read_scalars
from tests.local_run import local_config
from tests.processes import env_with_compilation_cache

pytestmark = pytest.mark.timeout(300)


def _config(run_dir, name, updates_per_call, num_steps=9, estimator=None, **sections):
    return local_config(
        run_dir,
        name,
        learned_optimizer={"kind": "mlp"},
        estimator={"kind": "pes", **(estimator or {})},
        population={"engine": "local", "num_actors": 2, "updates_per_call": updates_per_call},
        # Rounds end at 3, 4, 6, 8 and 9: calls of 3, 1, 2, 2 and 1 rounds.
        train={"num_steps": num_steps, "summary_every": 3, "checkpoint_every": 4},
        **sections,
    )


def _assert_close(a, b, rtol=2e-5):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=1e-6)


def _assert_same_checkpoint(a: Path, b: Path) -> None:
    """Every array of two checkpoint files: counters equal, floats equal up to rounding.

    Their metadata differ: it records each run's own config.
    """
    with np.load(a) as x, np.load(b) as y:
        assert sorted(x.files) == sorted(y.files)
        for name in set(x.files) - {"__metadata__"}:
            if np.issubdtype(x[name].dtype, np.floating):
                np.testing.assert_allclose(x[name], y[name], rtol=2e-5, atol=1e-6, err_msg=name)
            else:
                np.testing.assert_array_equal(x[name], y[name], err_msg=name)


def test_fused_rounds_take_the_steps_of_unfused_rounds_and_write_the_same_run(tmp_path):
    unfused = train(_config(tmp_path, "unfused", 1), stream=io.StringIO())
    out = io.StringIO()
    fused = train(_config(tmp_path, "fused", 8), stream=out)
    assert (
        "population.updates_per_call: 8, but a call ends wherever train.summary_every (3) is "
        "due, so calls run at most 3 rounds" in out.getvalue()
    )
    assert fused.final_step == unfused.final_step == 9
    # The same keys, estimates, weights and steps; XLA may round the fused program otherwise.
    _assert_close(fused.theta, unfused.theta)
    np.testing.assert_allclose(fused.meta_loss_start, unfused.meta_loss_start, rtol=1e-5)
    np.testing.assert_allclose(fused.meta_loss_end, unfused.meta_loss_end, rtol=1e-5)

    def written(run):
        return {path.name for path in list_checkpoints(run / "checkpoints")}

    assert written(tmp_path / "fused") == written(tmp_path / "unfused")
    # Theta, the outer optimizer's state and each worker's state and key counters.
    for name in written(tmp_path / "fused"):
        _assert_same_checkpoint(
            tmp_path / "fused" / "checkpoints" / name, tmp_path / "unfused" / "checkpoints" / name
        )
    fused_scalars, unfused_scalars = (
        read_scalars(tmp_path / "fused"),
        read_scalars(tmp_path / "unfused"),
    )
    for tag in ("meta_loss", "grad_norm", "theta_norm", "estimates_per_s", "rejected_nonfinite"):
        assert [step for step, _ in fused_scalars[tag]] == [3, 6, 9], tag
    for tag in ("meta_loss", "grad_norm", "theta_norm"):
        np.testing.assert_allclose(
            [v for _, v in fused_scalars[tag]], [v for _, v in unfused_scalars[tag]], rtol=1e-5
        )


def test_a_fused_run_resumes_unfused_from_its_checkpoint(tmp_path):
    reference = train(_config(tmp_path, "reference", 1), stream=io.StringIO())
    train(_config(tmp_path, "switched", 8, num_steps=6), stream=io.StringIO())
    out = io.StringIO()
    resumed = train(_config(tmp_path, "switched", 1), stream=out)
    assert "worker states restored: rank(s) [0, 1]" in out.getvalue()
    assert resumed.final_step == 9
    _assert_close(resumed.theta, reference.theta)


class _FixedEstimator:
    """An estimator whose estimates are set by the test: its state counts its calls."""

    def __init__(self, grad_of_call, weight):
        self.grad_of_call, self.weight = grad_of_call, weight

    def estimate(self, theta, state, key, data=None, outer_state=None):
        del data, outer_state
        grad = jax.tree_util.tree_map(lambda t: self.grad_of_call(state) * jnp.ones_like(t), theta)
        noise = jax.random.uniform(key)  # the key reaches the estimate
        metrics = {"noise": noise}
        return EstimatorOut(grad, 1.0 + state, self.weight, state + 1), metrics


def test_a_fused_round_leaves_non_finite_estimates_out_as_the_learner_does():
    theta = {"w": jnp.arange(3.0), "b": jnp.zeros(())}
    # Worker 0's estimate is finite except in call 2; worker 1's is NaN in
    # calls 1 and 2, so call 2 has nothing usable and takes no step.
    estimators = [
        _FixedEstimator(lambda n: jnp.where(n == 2, jnp.nan, 0.5 + n), 2.0),
        _FixedEstimator(lambda n: jnp.where((n == 1) | (n == 2), jnp.nan, -1.0), 1.0),
    ]
    optimizer = optax.adam(0.1)
    fused_learner = Learner(jax.tree_util.tree_map(jnp.copy, theta), optimizer, jax.random.key(0))
    program = build_rounds_fn(estimators, [1, 1], max_rounds=6)
    counters = tuple(
        FusionCarry(None, jax.random.key(rank), np.int32(-1), np.int32(0)) for rank in range(2)
    )
    states = (jnp.float32(0), jnp.float32(0))
    train_state, states, counters, records = program(
        fused_learner.state, states, counters, np.int32(4)
    )
    fused_learner.adopt(train_state)
    records = jax.tree_util.tree_map(lambda r: np.asarray(r[:4]), records)

    np.testing.assert_array_equal(records["applied"], [True, True, False, True])
    np.testing.assert_array_equal(records["version"], [0, 1, 2, 2])
    np.testing.assert_array_equal(records["finite"], [[1, 1], [1, 0], [0, 0], [1, 1]])
    assert int(fused_learner.state.step) == 3
    # Call 2 took no step, so call 3 repeats version 2 with a repeat key.
    assert [int(c.last_version) for c in counters] == [2, 2]
    assert [int(c.repeats) for c in counters] == [1, 1]

    # The learner's own update, given the same estimates, takes the same steps.
    learner = Learner(jax.tree_util.tree_map(jnp.copy, theta), optimizer, jax.random.key(0))
    rounds = list(FusedCall(records, [None, None], 1.0).rounds())
    for call, (gathered, update) in enumerate(rounds):
        estimates = [
            Estimate(
                jax.tree_util.tree_map(
                    lambda t, e=estimator, n=call: np.asarray(e.grad_of_call(n) * np.ones_like(t)),
                    theta,
                ),
                e.mean_loss,
                e.weight,
                e.version,
                e.worker,
                e.metrics,
            )
            for estimator, e in zip(estimators, gathered.estimates, strict=True)
        ]
        expected = learner.update(estimates)
        assert (update.norms is None) == (expected.norms is None)
        assert update.aggregate.num_used == expected.aggregate.num_used
        assert update.aggregate.num_rejected_nonfinite == expected.aggregate.num_rejected_nonfinite
        np.testing.assert_allclose(update.aggregate.mean_loss, expected.aggregate.mean_loss)
        if expected.norms is not None:
            for name, value in expected.norms.items():
                np.testing.assert_allclose(update.norms[name], value, rtol=1e-6)
    _assert_close(fused_learner.state.params, learner.state.params, rtol=1e-6)


def test_updates_per_call_is_refused_on_the_ray_engine(tmp_path):
    with pytest.raises(ConfigError, match=r"population\.updates_per_call.*engine: local"):
        local_config(tmp_path, population={"engine": "ray", "updates_per_call": 4})


SPLIT_OVER_TWO_DEVICES = ("--set", "population.cpu_devices=2", "--set", "estimator.num_tasks=4")


def test_fused_rounds_keep_tasks_split_over_cpu_devices(tmp_path):
    """``popmeta train`` with the tasks split over two CPU devices, fused and not."""
    finals = []
    for updates_per_call in (1, 8):
        name = f"split{updates_per_call}"
        config = _config(tmp_path, name, updates_per_call)
        path = tmp_path / f"{name}.yaml"
        path.write_text(config_to_yaml(config))
        subprocess.run(
            [sys.executable, "-m", "popmeta.cli", "train", str(path), *SPLIT_OVER_TWO_DEVICES],
            check=True,
            capture_output=True,
            env=env_with_compilation_cache(),
        )
        finals.append(tmp_path / name / "checkpoints" / "ckpt_00000009.npz")
    _assert_same_checkpoint(*finals)


def test_auto_takes_one_truncation_per_call_in_fused_rounds(tmp_path):
    out = io.StringIO()
    config = _config(tmp_path, "auto", 8, num_steps=3, estimator={"truncations_per_call": "auto"})
    train(config, stream=out)
    assert "estimator.truncations_per_call: auto -> 1 (fused rounds" in out.getvalue()
    assert "truncations_per_call: 1\n" in (tmp_path / "auto" / "config.yaml").read_text()


def _before_each_call(hook):
    """The local engine, fused, calling ``hook(population, learner)`` before each fused call."""

    class Hooked(LocalPopulation):
        def fused_rounds(self, learner, max_rounds):
            rounds = super().fused_rounds(learner, max_rounds)
            run = rounds.run

            def run_after_hook(num_rounds):
                hook(self, learner)
                return run(num_rounds)

            rounds.run = run_after_hook
            return rounds

    return Hooked


def _nan_states_from_step_7(population, learner):
    """The real workers, their states' floats made NaN from learner step 7 on."""
    if learner.version < 7:
        return
    for worker in population.workers:
        state = worker.export_state()
        nan = jax.tree_util.tree_map(
            lambda x: x * np.nan if np.issubdtype(x.dtype, np.floating) else x, state.state
        )
        worker.load_state(state._replace(state=nan))


def test_a_fused_run_that_diverges_stops_with_its_good_checkpoints(tmp_path):
    config = _config(tmp_path, "diverging", 4, num_steps=20)
    with pytest.raises(DivergedError, match="20 rounds in a row without a finite estimate"):
        train(config, _before_each_call(_nan_states_from_step_7), stream=io.StringIO())
    # The call from step 6 ends at the checkpoint of step 8; no step is taken after it.
    checkpoints = list_checkpoints(tmp_path / "diverging" / "checkpoints")
    assert [path.name for path in checkpoints] == ["ckpt_00000004.npz", "ckpt_00000008.npz"]


def test_a_second_ctrl_c_during_a_call_keeps_the_checkpoint_of_its_start(tmp_path, monkeypatch):
    reference = tmp_path / "reference" / "checkpoints" / "ckpt_00000009.npz"
    train(_config(tmp_path, "reference", 8), stream=io.StringIO())
    config = _config(tmp_path, "twice", 8)
    stop = {"armed": False, "done": False}
    device_get = jax.device_get

    def device_get_or_stop(tree):
        if stop["armed"]:  # the call from step 4 is running: a second Ctrl-C, straight through
            stop["armed"], stop["done"] = False, True
            raise KeyboardInterrupt
        return device_get(tree)

    def arm_at_step_4(population, learner):
        stop["armed"] = learner.version == 4 and not stop["done"]

    monkeypatch.setattr(jax, "device_get", device_get_or_stop)
    out = io.StringIO()
    assert train(config, _before_each_call(arm_at_step_4), stream=out).interrupted
    assert "interrupted (SIGINT) at step 4" in out.getvalue()
    # The learner is where the call started, and step 4's checkpoint keeps its workers.
    checkpoints = list_checkpoints(tmp_path / "twice" / "checkpoints")
    assert [path.name for path in checkpoints] == ["ckpt_00000004.npz"]
    monkeypatch.undo()
    out = io.StringIO()
    assert train(config, stream=out).final_step == 9
    assert "worker states restored: rank(s) [0, 1]" in out.getvalue()
    _assert_same_checkpoint(tmp_path / "twice" / "checkpoints" / "ckpt_00000009.npz", reference)
