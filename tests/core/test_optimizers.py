"""Tests for the Optimizer protocol and the optax-backed baselines."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from popmeta.core.optimizers import SGD, SGDM, Adam, OptaxOptimizer, OptaxState, Optimizer


def _params():
    return {"w": jnp.array([[1.0, -2.0], [0.5, 3.0]]), "b": jnp.array([0.3, -0.7])}


def _loss(params):
    # Anisotropic so that momentum / Adam trajectories differ from SGD.
    return jnp.sum(jnp.array([[1.0, 4.0], [0.2, 2.0]]) * params["w"] ** 2) + jnp.sum(
        jnp.sin(params["b"])
    )


@pytest.mark.parametrize(
    ("ours", "reference"),
    [
        (SGD(0.05), optax.sgd(0.05)),
        (SGDM(0.05, 0.8), optax.sgd(0.05, momentum=0.8)),
        (
            Adam(0.1, beta1=0.8, beta2=0.99, epsilon=1e-6),
            optax.adam(0.1, b1=0.8, b2=0.99, eps=1e-6),
        ),
        (SGD(), optax.sgd(0.01)),
        (SGDM(), optax.sgd(0.01, momentum=0.9)),
        (Adam(), optax.adam(1e-3)),
    ],
)
def test_baselines_match_optax(ours: Optimizer, reference: optax.GradientTransformation):
    params = _params()
    state = ours.init(params)
    ref_params, ref_state = params, reference.init(params)
    update = jax.jit(ours.update)
    for _ in range(6):
        loss, grad = jax.value_and_grad(_loss)(ours.get_params(state))
        state = update(state, grad, loss=loss)
        ref_grad = jax.grad(_loss)(ref_params)
        updates, ref_state = reference.update(ref_grad, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        ours.get_params(state),
        ref_params,
    )
    # Sanity: something actually moved.
    assert not np.allclose(ours.get_params(state)["w"], params["w"])


def test_state_contract_and_iteration():
    opt = SGDM(0.1)
    state = opt.init(_params(), num_steps=10, key=jax.random.PRNGKey(0))
    assert isinstance(state, OptaxState) and isinstance(state, tuple)
    assert state.iteration.dtype == jnp.int32 and state.iteration.shape == ()
    assert int(state.iteration) == 0
    grad = jax.grad(_loss)(state.params)
    state = jax.jit(opt.update)(state, grad, key=jax.random.PRNGKey(1))
    assert int(state.iteration) == 1 and state.iteration.dtype == jnp.int32
    # The truncated step sets random initial iterations this way.
    state = state._replace(iteration=jnp.asarray(41, jnp.int32))
    assert int(opt.update(state, grad).iteration) == 42
    assert opt.get_params(state) is state.params


def test_vmap_over_states_and_traced_hyperparameters():
    @jax.jit
    @jax.vmap
    def run(lr, x0):
        opt = SGD(lr)  # lr is a tracer
        state = opt.init(x0)
        for _ in range(3):
            state = opt.update(state, 2.0 * opt.get_params(state))
        return state

    lrs = jnp.array([0.0, 0.1, 0.25])
    x0 = jnp.ones((3, 2))
    state = run(lrs, x0)
    expected = (1.0 - 2.0 * lrs) ** 3
    np.testing.assert_allclose(state.params, np.broadcast_to(expected[:, None], (3, 2)), rtol=1e-6)
    np.testing.assert_array_equal(state.iteration, [3, 3, 3])


def test_loss_is_forwarded_as_optax_value():
    # reduce_on_plateau only sees the loss through optax's `value` extra arg:
    # a loss that never improves must shrink the step.
    opt = OptaxOptimizer(
        optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(factor=0.5, patience=1))
    )
    state = opt.init(jnp.zeros(1))
    update = jax.jit(opt.update)
    moves = []
    for _ in range(6):
        before = opt.get_params(state)
        state = update(state, jnp.ones(1), loss=jnp.float32(1.0))
        moves.append(float(jnp.abs(opt.get_params(state) - before)[0]))
    assert moves[0] == pytest.approx(1.0)
    assert moves[-1] < 0.5
    # Plain transformations accept (and ignore) the loss.
    sgd = SGD(0.1)
    s = sgd.update(sgd.init(jnp.ones(1)), jnp.ones(1), loss=jnp.float32(3.0))
    np.testing.assert_allclose(s.params, [0.9])
