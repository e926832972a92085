"""Aggregation: weighted by valid samples, non-finite estimates counted and never applied."""

from __future__ import annotations

import numpy as np
import pytest

from popmeta.estimate import JIT_SUM_MIN_ELEMENTS, Estimate, aggregate

# Estimates of 2 floats take the numpy sum, of JIT_SUM_MIN_ELEMENTS the jitted one.
SIZES = pytest.mark.parametrize("reps", [1, JIT_SUM_MIN_ELEMENTS // 2])


def _estimate(grad, weight=1.0, loss=1.0, worker=0, reps=1):
    return Estimate({"w": np.tile(np.asarray(grad, np.float32), reps)}, loss, weight, 0, worker, {})


@SIZES
def test_weighted_by_number_of_valid_samples(reps):
    agg = aggregate(
        [
            _estimate([1.0, 0.0], weight=3, loss=2.0, reps=reps),
            _estimate([0.0, 1.0], weight=1, reps=reps),
        ]
    )
    np.testing.assert_allclose(np.asarray(agg.grad["w"]), np.tile([0.75, 0.25], reps))
    assert agg.mean_loss == 1.75 and agg.num_used == 2 and agg.total_weight == 4


@SIZES
def test_non_finite_estimates_are_rejected_and_counted(reps):
    agg = aggregate(
        [
            _estimate([np.nan, 0.0], reps=reps),
            _estimate([1.0, 1.0], loss=np.inf, reps=reps),
            _estimate([2.0, 4.0], reps=reps),
            _estimate([np.inf, 1.0], weight=2, reps=reps),
        ]
    )
    np.testing.assert_allclose(np.asarray(agg.grad["w"]), np.tile([2.0, 4.0], reps))
    assert agg.num_rejected_nonfinite == 3 and agg.num_used == 1 and agg.total_weight == 1


def test_nothing_usable_gives_no_gradient():
    agg = aggregate([_estimate([np.nan, 1.0]), _estimate([1.0, 1.0], weight=0)])
    assert agg.grad is None and agg.num_used == 0 and agg.num_rejected_nonfinite == 1


@SIZES
def test_many_estimates_of_mixed_weights_give_the_weighted_mean(reps):
    rng = np.random.default_rng(3)
    weights = [2, 1, 2, 2, 1, 3]
    grads = [rng.normal(size=(2, 3)).astype(np.float32) for _ in weights]
    estimates = [
        Estimate({"a": np.tile(g[0], reps), "b": g[1]}, 1.0, w, 0, i, {})
        for i, (g, w) in enumerate(zip(grads, weights, strict=True))
    ]
    agg = aggregate(estimates)
    expected = sum(w * g.astype(np.float64) for w, g in zip(weights, grads, strict=True)) / 11
    np.testing.assert_allclose(np.asarray(agg.grad["a"]), np.tile(expected[0], reps), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(agg.grad["b"]), expected[1], rtol=1e-6)
    assert agg.grad["a"].dtype == np.float32 and agg.total_weight == 11
    # The estimates themselves are left as they were.
    np.testing.assert_array_equal(estimates[0].grad["b"], grads[0][1])
