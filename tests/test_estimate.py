"""Aggregation: which estimates a round uses, weighted by valid samples; non-finite ones counted."""

from __future__ import annotations

import numpy as np

from popmeta.estimate import Estimate, aggregate


def _estimate(grad, weight=1.0, loss=1.0, worker=0, metrics=None):
    return Estimate({"w": np.asarray(grad, np.float32)}, loss, weight, 0, worker, metrics or {})


def test_weighted_by_number_of_valid_samples():
    estimates = [_estimate([1.0, 0.0], weight=3, loss=2.0), _estimate([0.0, 1.0], weight=1)]
    agg = aggregate(estimates)
    # The gradients are handed on as they came, not copied or summed here.
    assert agg.grads[0] is estimates[0].grad and agg.grads[1] is estimates[1].grad
    np.testing.assert_allclose(agg.weights, [0.75, 0.25])
    assert agg.weights.dtype == np.float32
    assert agg.mean_loss == 1.75 and agg.num_used == 2 and agg.total_weight == 4


def test_non_finite_losses_are_rejected_and_gradients_only_read_when_asked():
    estimates = [
        _estimate([np.nan, 0.0], worker=0),
        _estimate([1.0, 1.0], loss=np.inf, worker=1),
        _estimate([2.0, 4.0], worker=2),
        _estimate([np.inf, 1.0], weight=2, worker=3),
    ]
    unchecked = aggregate(estimates)
    assert unchecked.num_rejected_nonfinite == 1 and unchecked.num_used == 3
    np.testing.assert_allclose(unchecked.weights, [0.25, 0.25, 0.5])

    checked = aggregate(estimates, check_grads=True)
    assert checked.num_rejected_nonfinite == 3 and checked.num_used == 1
    assert checked.grads[0] is estimates[2].grad
    np.testing.assert_allclose(checked.weights, [1.0])
    assert checked.total_weight == 1 and checked.mean_loss == 1.0


def test_nothing_usable_gives_no_gradients():
    estimates = [_estimate([np.nan, 1.0]), _estimate([1.0, 1.0], weight=0)]
    agg = aggregate(estimates, check_grads=True)
    assert agg.grads == () and agg.weights.shape == (0,)
    assert agg.num_used == 0 and agg.num_rejected_nonfinite == 1 and np.isnan(agg.mean_loss)


def test_family_losses_are_weighted_means():
    agg = aggregate(
        [
            _estimate([0.0], weight=3, metrics={"meta_loss_by_family/a": 1.0}),
            _estimate([0.0], weight=1, metrics={"meta_loss_by_family/a": 5.0, "other": 7.0}),
        ]
    )
    assert dict(agg.family_losses) == {"a": 2.0}
