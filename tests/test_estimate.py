"""Aggregation: weighted by valid samples, non-finite estimates counted and never applied."""

from __future__ import annotations

import numpy as np

from popmeta.estimate import Estimate, aggregate


def _estimate(grad, weight=1.0, loss=1.0, worker=0):
    return Estimate({"w": np.asarray(grad, np.float32)}, loss, weight, 0, worker, {})


def test_weighted_by_number_of_valid_samples():
    agg = aggregate([_estimate([1.0, 0.0], weight=3, loss=2.0), _estimate([0.0, 1.0], weight=1)])
    np.testing.assert_allclose(agg.grad["w"], [0.75, 0.25])
    assert agg.mean_loss == 1.75 and agg.num_used == 2 and agg.total_weight == 4


def test_non_finite_estimates_are_rejected_and_counted():
    agg = aggregate(
        [
            _estimate([np.nan, 0.0]),
            _estimate([1.0, 1.0], loss=np.inf),
            _estimate([2.0, 4.0]),
        ]
    )
    np.testing.assert_allclose(agg.grad["w"], [2.0, 4.0])
    assert agg.num_rejected_nonfinite == 2 and agg.num_used == 1


def test_nothing_usable_gives_no_gradient():
    agg = aggregate([_estimate([np.nan, 1.0]), _estimate([1.0, 1.0], weight=0)])
    assert agg.grad is None and agg.num_used == 0 and agg.num_rejected_nonfinite == 1
