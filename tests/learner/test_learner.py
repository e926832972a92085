"""The learner's round: estimates averaged inside its jitted step; non-finite ones never applied."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from popmeta.config import config_from_dict
from popmeta.estimate import Estimate, aggregate
from popmeta.experiment import learner_start
from popmeta.learner.learner import Learner
from popmeta.learner.train_state import build_apply_estimates_fn

CONFIG = config_from_dict(
    {
        "name": "learner",
        "task": {"kind": "fixed_dim_quadratic", "dim": 4},
        "learned_optimizer": {"kind": "mlp"},
        "estimator": {"kind": "pes", "num_tasks": 2, "trunc_length": 5},
        "outer_optimizer": {"kind": "adam", "learning_rate": 0.01},
        "population": {"engine": "local", "num_actors": 1},
    },
    source="test",
)


def _estimates(learner: Learner, count: int, seed: int = 0) -> list[Estimate]:
    rng = np.random.default_rng(seed)
    return [
        Estimate(
            jax.tree.map(lambda t: rng.normal(size=t.shape).astype(np.float32), learner.theta()),
            mean_loss=float(i),
            weight=float(i + 1),
            version=learner.version,
            worker=i,
            metrics={},
        )
        for i in range(count)
    ]


def _bits(tree) -> list[bytes]:
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


def _spoil(estimate: Estimate, value: float) -> Estimate:
    grad = jax.tree.map(np.copy, estimate.grad)
    jax.tree_util.tree_leaves(grad)[0].flat[3] = value
    return estimate._replace(grad=grad)


@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_a_non_finite_estimate_is_left_out_and_the_rest_applied(bad):
    clean, spoiled = Learner.of(learner_start(CONFIG)), Learner.of(learner_start(CONFIG))
    estimates = _estimates(clean, 3)
    expected = clean.update([estimates[0], estimates[2]])
    got = spoiled.update([estimates[0], _spoil(estimates[1], bad), estimates[2]])

    assert got.aggregate.num_rejected_nonfinite == 1 and got.aggregate.num_used == 2
    assert got.aggregate.mean_loss == expected.aggregate.mean_loss
    assert spoiled.version == clean.version == 1
    assert _bits(spoiled.theta()) == _bits(clean.theta())
    assert got.norms == expected.norms and np.isfinite(got.norms["grad_norm"])


def test_nothing_is_applied_when_every_estimate_is_non_finite():
    learner = Learner.of(learner_start(CONFIG))
    before = _bits(learner.theta())
    update = learner.update([_spoil(e, np.nan) for e in _estimates(learner, 2)])
    assert update.norms is None and update.aggregate.num_rejected_nonfinite == 2
    assert learner.version == 0 and _bits(learner.theta()) == before
    # And the learner goes on from there.
    assert learner.update(_estimates(learner, 2)).norms is not None and learner.version == 1


def test_a_finite_sum_too_large_for_float32_is_not_applied():
    learner = Learner.of(learner_start(CONFIG))
    before = _bits(learner.theta())
    estimates = [_spoil(e, 1e30) for e in _estimates(learner, 2)]
    update = learner.update(estimates)
    assert update.norms is None and update.aggregate.num_rejected_nonfinite == 0
    assert learner.version == 0 and _bits(learner.theta()) == before


def test_a_smaller_round_is_padded_and_compiles_nothing_new():
    learner = Learner.of(learner_start(CONFIG))
    estimates = _estimates(learner, 3)
    learner.update(estimates)
    # What a round of two does, unpadded, from the same state.
    two = aggregate(estimates[:2])
    state = jax.tree.map(jnp.array, learner.state)
    expected, _, _ = build_apply_estimates_fn()(state, two.grads, two.weights)

    learner.update(estimates[:2])
    assert learner._step._cache_size() == 1  # padded to three with zeros of weight 0
    jax.tree.map(np.testing.assert_array_equal, learner.theta(), expected.params)
