"""Several truncations per call: ``estimate_many`` against sequential ``estimate`` calls.

Compilations dominate the cost here, so the learned-optimizer estimator of each
kind, its initial state and its jitted ``estimate`` are built once per module
(the ``start`` fixture) and the K-truncation results once per kind
(``k_truncations``), shared by the tests that check them.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import popmeta as pm
from popmeta.core.estimators import truncation_keys
from popmeta.core.estimators.truncations import check_num_truncations
from tests.core.linear_system import LinearQuadraticStep

KINDS = ["pes", "nres", "truncated_es", "truncated_grad", "full_es"]
TRUNC_LENGTH = 5
# Under popmeta's XLA flags (popmeta.xla_flags) small loops compile to one CPU
# kernel each, and K truncations in one scan make a different kernel from one
# truncation alone: their float32 losses round differently, and the PES
# estimate's antithetic differences carry that into the gradient's fifth digit
# (up to 2.2e-5 relative on these linear systems; within 1e-5 without the flags).
LOOP_GRAD_RTOL = 1e-4


def _estimator(kind, step=None, num_tasks=4):
    step = step or pm.VectorizedLOptTruncatedStep(
        pm.FixedDimQuadraticFamilyData(6),
        pm.LearnableSGDM(),
        pm.ConstantTruncationSchedule(12),
        num_tasks=num_tasks,
        # Offsets over the whole trajectory: tasks end and restart inside truncations.
        random_initial_iteration_offset=12,
    )
    match kind:
        case "pes":
            return pm.TruncatedPES(step, TRUNC_LENGTH, std=0.01)
        case "nres":
            return pm.NoiseReuseES(step, TRUNC_LENGTH, std=0.01)
        case "truncated_es":
            return pm.TruncatedES(step, TRUNC_LENGTH, std=0.01)
        case "truncated_grad":
            return pm.TruncatedGrad(step, TRUNC_LENGTH)
        case "full_es":
            return pm.FullES(step, 8, std=0.01)
    raise ValueError(kind)


def _theta(estimator):
    learned_opt = getattr(estimator.truncated_step, "learned_opt", None)
    if learned_opt is None:
        return jnp.asarray(np.random.default_rng(1).normal(size=5), jnp.float32)
    return learned_opt.init(jax.random.key(0))


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _copy(tree):
    # The jitted calls donate the state; each path gets its own copy.
    return jax.tree_util.tree_map(jnp.copy, tree)


class Start(NamedTuple):
    """A learned-optimizer estimator, its theta and initial state, and its jitted ``estimate``."""

    estimator: pm.GradientEstimator
    theta: Any
    state: Any  # never donated: callers pass copies
    estimate: Any  # jax.jit(estimator.estimate), state not donated


@pytest.fixture(scope="module", params=KINDS, ids=KINDS)
def start(request) -> Start:
    """One estimator per kind for the module, so that its tests share compilations."""
    estimator = _estimator(request.param)
    theta = _theta(estimator)
    state = estimator.init_worker_state(theta, jax.random.key(1))
    return Start(estimator, theta, state, jax.jit(estimator.estimate))


def test_one_truncation_is_bitwise_the_single_estimate(start):
    estimator, theta, state, estimate = start
    key = jax.random.key(7)
    single = estimate(theta, _copy(state), key)
    many = jax.jit(lambda t, s, k: estimator.estimate_many(t, s, k, 1))(theta, _copy(state), key)
    assert jax.tree_util.tree_structure(single) == jax.tree_util.tree_structure(many)
    for a, b in zip(_leaves(single), _leaves(many), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("start", ["pes"], indirect=True)
def test_one_truncation_through_the_runner_is_bitwise_the_single_estimate(start):
    estimator, theta, state, estimate = start
    key = jax.random.key(7)
    single = estimate(theta, _copy(state), key)
    driven = estimator.compute_gradient_estimate(theta, _copy(state), key, num_truncations=1)
    for a, b in zip(_leaves(single), _leaves(driven), strict=True):
        np.testing.assert_array_equal(a, b)


class Combined(NamedTuple):
    """K estimates combined by hand, as ``estimate_many`` should combine them."""

    grad: Any
    mean_loss: float
    weight: float
    state: Any
    metrics: dict[str, np.ndarray]
    weights: np.ndarray  # of each truncation


def _sequential(estimate, theta, state, key, num_truncations, data=None) -> Combined:
    """K separate jitted ``estimate`` calls with the derived keys, combined by hand."""
    outs, metrics = [], []
    for k, truncation_key in enumerate(truncation_keys(key, num_truncations)):
        truncation_data = None if data is None else data[k]
        out, m = estimate(theta, state, truncation_key, truncation_data)
        state = out.state
        outs.append(out)
        metrics.append(m)
    weights = np.array([float(o.weight) for o in outs])
    total = weights.sum()
    grad = jax.tree_util.tree_map(
        lambda *gs: (
            sum(w * np.asarray(g, np.float64) for w, g in zip(weights, gs, strict=True)) / total
        ),
        *[o.grad for o in outs],
    )
    mean_loss = sum(w * float(o.mean_loss) for w, o in zip(weights, outs, strict=True)) / total
    combined = {}
    for name, value in metrics[0].items():
        values = [np.asarray(m[name], np.float64) for m in metrics]
        if jnp.issubdtype(value.dtype, jnp.integer) or value.dtype == bool:
            combined[name] = sum(values)
        else:
            combined[name] = sum(w * v for w, v in zip(weights, values, strict=True)) / total
    return Combined(grad, mean_loss, total, state, combined, weights)


class KTruncations(NamedTuple):
    expected: Combined  # K sequential calls
    out: pm.EstimatorOut  # one K-truncation call
    metrics: dict[str, jax.Array]


@pytest.fixture(scope="module")
def k_truncations(start) -> KTruncations:
    """Three truncations as three calls and as one call, computed once per kind."""
    estimator, theta, state, estimate = start
    num_truncations = 3
    key = jax.random.key(11)
    expected = _sequential(estimate, theta, _copy(state), key, num_truncations)
    out, metrics = estimator.compute_gradient_estimate(
        theta, _copy(state), key, num_truncations=num_truncations
    )
    return KTruncations(expected, out, metrics)


def test_k_truncations_equal_k_sequential_calls(k_truncations):
    expected, out, _ = k_truncations
    for a, b in zip(_leaves(out.grad), jax.tree_util.tree_leaves(expected.grad), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert float(out.mean_loss) == pytest.approx(expected.mean_loss, rel=1e-5)
    assert float(out.weight) == expected.weight


def test_k_truncation_metrics_equal_those_of_k_sequential_calls(k_truncations):
    expected, out, metrics = k_truncations
    assert set(metrics) == set(expected.metrics)
    for name, value in expected.metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-5, err_msg=name)
    assert float(metrics["mean_loss"]) == pytest.approx(float(out.mean_loss), rel=1e-6)


def test_k_truncations_end_in_the_state_of_k_sequential_calls(k_truncations):
    expected, out, _ = k_truncations
    for a, b in zip(_leaves(out.state), _leaves(expected.state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["pes", "truncated_grad"])
def test_truncations_are_weighted_by_their_valid_tasks(kind):
    # Trajectories of one step and truncations of one step: every other
    # truncation is a reset step only, with no valid step and weight zero.
    estimator = _estimator(kind, pm.VectorizedTruncatedStep(LinearQuadraticStep(length=1), 2))
    estimator.trunc_length = 1
    theta = _theta(estimator)
    state = estimator.init_worker_state(theta, jax.random.key(1))
    key = jax.random.key(4)
    expected = _sequential(jax.jit(estimator.estimate), theta, _copy(state), key, 3)
    np.testing.assert_array_equal(expected.weights, [2, 0, 2])
    out, _ = estimator.estimate_many(theta, state, key, 3)
    assert float(out.weight) == expected.weight == 4
    np.testing.assert_allclose(out.grad, expected.grad, rtol=LOOP_GRAD_RTOL)
    assert float(out.mean_loss) == pytest.approx(expected.mean_loss, rel=1e-6)
    assert expected.mean_loss > 0


@pytest.mark.parametrize("start", ["pes"], indirect=True)
def test_counts_are_summed_and_keep_an_integer_dtype(start):
    estimator, theta, state, _ = start
    out, metrics = estimator.estimate_many(theta, state, jax.random.key(2), 4)
    assert jnp.issubdtype(metrics["num_done"].dtype, jnp.integer)
    assert jnp.issubdtype(out.weight.dtype, jnp.integer)
    assert int(metrics["valid_steps"]) <= 4 * TRUNC_LENGTH * 4
    assert int(metrics["num_done"]) >= 4  # 20 steps per task on trajectories of 12


def test_truncation_keys():
    key = jax.random.key(3)
    keys = truncation_keys(key, 4)
    assert keys.shape == (4,)
    data = jax.random.key_data(keys)
    np.testing.assert_array_equal(data[0], jax.random.key_data(key))
    for k in range(1, 4):
        np.testing.assert_array_equal(data[k], jax.random.key_data(jax.random.fold_in(key, k)))
    assert len({tuple(d) for d in np.asarray(data)}) == 4
    # Raw uint32 keys work too.
    raw = truncation_keys(jax.random.PRNGKey(3), 2)
    assert raw.shape == (2, 2)
    with pytest.raises(ValueError, match="num_truncations"):
        truncation_keys(key, 0)


def test_num_truncations_must_be_a_positive_int():
    assert check_num_truncations(3) == 3
    assert type(check_num_truncations(np.int64(2))) is int
    for bad in (True, 1.5, "2"):
        with pytest.raises(TypeError, match="num_truncations"):
            check_num_truncations(bad)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="num_truncations"):
            check_num_truncations(bad)


def test_k_truncations_are_one_scan_with_no_host_callbacks():
    estimator = _estimator("pes")
    theta = _theta(estimator)
    state = estimator.init_worker_state(theta, jax.random.key(1))
    jaxpr = jax.make_jaxpr(lambda t, s, k: estimator.estimate_many(t, s, k, 6))(
        theta, state, jax.random.key(2)
    ).jaxpr
    top_scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert [e.params["length"] for e in top_scans] == [6]
    inner = [e for e in top_scans[0].params["jaxpr"].jaxpr.eqns if e.primitive.name == "scan"]
    assert [e.params["length"] for e in inner] == [TRUNC_LENGTH]
    text = str(jaxpr)
    assert "callback" not in text


def test_state_is_donated_and_each_k_compiles_once():
    estimator = _estimator("nres")
    theta = _theta(estimator)
    state = estimator.init_worker_state(theta, jax.random.key(1))
    for i in range(3):
        old = [x for x in jax.tree_util.tree_leaves(state) if isinstance(x, jax.Array)]
        out, _ = estimator.compute_gradient_estimate(
            theta, state, jax.random.key(i), num_truncations=4
        )
        state = out.state
        assert all(leaf.is_deleted() for leaf in old)
    assert estimator.runner.jitted_estimate(4)._cache_size() == 1
    assert estimator.runner.jitted_estimate(4) is estimator.runner.jitted_estimate(4)


class NeverValid(LinearQuadraticStep):
    """Every step is masked out: every truncation has weight zero."""

    def unroll_step(self, theta, state, key, data, outer_state, theta_is_vector=False):
        state, out = super().unroll_step(theta, state, key, data, outer_state)
        return state, out._replace(mask=jnp.zeros_like(out.mask))


def test_all_zero_weights_give_zero_means_not_nan():
    estimator = pm.TruncatedPES(pm.VectorizedTruncatedStep(NeverValid(), 2), TRUNC_LENGTH, 0.1)
    theta = _theta(estimator)
    state = estimator.init_worker_state(theta, jax.random.key(1))
    out, metrics = estimator.estimate_many(theta, state, jax.random.key(2), 3)
    assert int(out.weight) == 0
    np.testing.assert_array_equal(out.grad, np.zeros_like(theta))
    assert float(out.mean_loss) == 0.0
    assert all(np.isfinite(float(v)) for v in metrics.values())


class HostDataStep(LinearQuadraticStep):
    """Adds host data (a per-step offset of the state) drawn from a counter."""

    counter = itertools.count()

    def unroll_step(self, theta, state, key, data, outer_state, theta_is_vector=False):
        state = state._replace(s=state.s + data)
        return super().unroll_step(theta, state, key, None, outer_state)

    def get_batch(self, steps=None):
        i = next(HostDataStep.counter)
        rng = np.random.default_rng(i)
        return (0.1 * rng.normal(size=(steps, 3))).astype(np.float32)


@pytest.mark.parametrize("kind", ["pes", "truncated_grad"])
def test_host_data_falls_back_to_one_call_per_truncation(kind):
    num_truncations = 3
    step = pm.VectorizedTruncatedStep(HostDataStep(length=4), 2)
    estimator = _estimator(kind, step)
    theta = _theta(estimator)
    state = estimator.init_worker_state(theta, jax.random.key(1))
    key = jax.random.key(5)

    HostDataStep.counter = itertools.count()
    batches = [step.get_batch(TRUNC_LENGTH) for _ in range(num_truncations)]
    expected = _sequential(
        jax.jit(estimator.estimate), theta, _copy(state), key, num_truncations, batches
    )
    stacked = jax.jit(lambda t, s, k, d: estimator.estimate_many(t, s, k, num_truncations, d))(
        theta, _copy(state), key, np.stack(batches)
    )

    HostDataStep.counter = itertools.count()
    out, _ = estimator.compute_gradient_estimate(theta, state, key, num_truncations=num_truncations)
    # One batch per truncation (the vectorized step asks each of its 2 tasks).
    assert next(HostDataStep.counter) == 2 * num_truncations
    for result in (out, stacked[0]):
        np.testing.assert_allclose(result.grad, expected.grad, rtol=LOOP_GRAD_RTOL, atol=1e-6)
        assert float(result.mean_loss) == pytest.approx(expected.mean_loss, rel=1e-5)
        assert float(result.weight) == expected.weight
        for a, b in zip(_leaves(result.state), _leaves(expected.state), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_state_task_axes():
    for kind in KINDS:
        estimator = _estimator(kind, num_tasks=4)
        theta = _theta(estimator)
        state = jax.eval_shape(estimator.init_worker_state, theta, jax.random.key(0))
        axes = estimator.state_task_axes(state)
        assert jax.tree_util.tree_structure(axes) == jax.tree_util.tree_structure(state)
        for axis, leaf in zip(
            jax.tree_util.tree_leaves(axes), jax.tree_util.tree_leaves(state), strict=True
        ):
            assert leaf.shape[axis] == 4, (kind, axis, leaf.shape)
    pes = _estimator("pes")
    state = pes.init_worker_state(_theta(pes), jax.random.key(0))
    axes = pes.state_task_axes(state)
    assert set(jax.tree_util.tree_leaves(axes.member_states)) == {1}
    assert set(jax.tree_util.tree_leaves(axes.accumulator)) == {0}
    assert axes.starts_with_reset == 0
    assert _estimator("full_es").state_task_axes(()) == ()
