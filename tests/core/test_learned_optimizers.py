"""Tests for learned optimizers: LearnableSGD/SGDM/Adam, MLPLOpt and AdamMLPLOpt."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from popmeta.core.learned_optimizers import (
    AdamMLPLOpt,
    AdamMLPLOptState,
    LearnableAdam,
    LearnableSGD,
    LearnableSGDM,
    LearnedOptimizer,
    MLPLOpt,
    MLPLOptState,
    features,
)
from popmeta.core.optimizers import SGD, SGDM, Adam, Optimizer
from popmeta.core.tasks import FixedDimQuadraticFamily

FAMILY = FixedDimQuadraticFamily(dim=6)


def _unroll(opt: Optimizer, task_param: jax.Array, key: jax.Array, num_steps: int):
    """Trains one quadratic for ``num_steps``; returns final params and mean loss."""
    task = FAMILY.task_fn(task_param)
    state = opt.init(task.init(key), num_steps=num_steps)
    losses = []
    for _ in range(num_steps):
        loss, grad = jax.value_and_grad(task.loss)(opt.get_params(state), key, None)
        state = opt.update(state, grad, loss=loss)
        losses.append(loss)
    return state, jnp.mean(jnp.stack(losses))


TASK_PARAM = FAMILY.sample(jax.random.PRNGKey(0))
KEY = jax.random.PRNGKey(1)


@pytest.mark.parametrize(
    ("lopt", "baseline"),
    [
        (LearnableSGD(initial_lr=0.1), SGD(0.1)),
        (LearnableSGDM(initial_lr=0.1), SGDM(0.1, 0.9)),
        (LearnableSGDM(initial_lr=0.05, initial_momentum=0.5), SGDM(0.05, 0.5)),
        (LearnableAdam(initial_lr=0.1), Adam(0.1, 0.9, 0.999, 1e-8)),
        (
            LearnableAdam(
                initial_lr=0.03, initial_beta1=0.8, initial_beta2=0.99, initial_epsilon=1e-3
            ),
            Adam(0.03, 0.8, 0.99, 1e-3),
        ),
    ],
)
def test_learnable_matches_hand_designed_at_init(lopt: LearnedOptimizer, baseline: Optimizer):
    theta = lopt.init(jax.random.PRNGKey(0))
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(theta))
    run = jax.jit(lambda th: _unroll(lopt.opt_fn(th), TASK_PARAM, KEY, 8))
    state, _ = run(theta)
    ref_state, _ = _unroll(baseline, TASK_PARAM, KEY, 8)
    np.testing.assert_allclose(state.params, ref_state.params, rtol=2e-5, atol=1e-6)
    assert int(state.iteration) == 8
    assert type(state) is type(ref_state)


def test_learnable_theta_layout():
    assert set(LearnableSGD().init(KEY)) == {"log_lr"}
    assert set(LearnableSGDM().init(KEY)) == {"log_lr", "logit_one_minus_momentum"}
    theta = LearnableAdam().init(KEY)
    assert set(theta) == {
        "log_lr",
        "logit_one_minus_beta1",
        "logit_one_minus_beta2",
        "log_epsilon",
    }
    np.testing.assert_allclose(jnp.exp(theta["log_lr"]), 1e-3, rtol=1e-6)
    np.testing.assert_allclose(1 - jax.nn.sigmoid(theta["logit_one_minus_beta2"]), 0.999, rtol=1e-7)
    # Any real theta is a valid optimizer: decays stay in (0, 1).
    opt = LearnableSGDM().opt_fn({"log_lr": jnp.float32(0.0), "logit_one_minus_momentum": 50.0})
    assert 0.0 <= float(opt.momentum) < 1.0
    with pytest.raises(ValueError, match="initial_momentum"):
        LearnableSGDM(initial_momentum=1.0)
    with pytest.raises(ValueError, match="initial_lr"):
        LearnableSGD(initial_lr=0.0)


@pytest.mark.parametrize(
    "lopt",
    [LearnableSGD(0.05), LearnableSGDM(0.05), LearnableAdam(0.05), MLPLOpt(), AdamMLPLOpt(0.05)],
    ids=["sgd", "sgdm", "adam", "mlp", "mlp_adam"],
)
def test_meta_gradient_through_unroll_is_finite(lopt: LearnedOptimizer):
    theta = lopt.init(jax.random.PRNGKey(2))

    def meta_loss(th):
        return _unroll(lopt.opt_fn(th, is_training=True), TASK_PARAM, KEY, 4)[1]

    grad = jax.jit(jax.grad(meta_loss))(theta)
    leaves = jax.tree.leaves(grad)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert any(float(jnp.max(jnp.abs(g))) > 0 for g in leaves)
    # Gradient structure mirrors theta.
    assert jax.tree.structure(grad) == jax.tree.structure(theta)


def test_learnable_sgd_meta_gradient_sign():
    # On a quadratic, a slightly larger lr lowers the mean loss of a short run.
    lopt = LearnableSGD(1e-3)
    grad = jax.grad(lambda th: _unroll(lopt.opt_fn(th), TASK_PARAM, KEY, 4)[1])(lopt.init(KEY))
    assert float(grad["log_lr"]) < 0


def test_mlp_lopt_param_count_and_layout():
    lopt = MLPLOpt()
    assert lopt.num_features == 19
    theta = lopt.init(jax.random.PRNGKey(0))
    n = sum(x.size for x in jax.tree.leaves(theta))
    assert n == 19 * 32 + 32 + 32 * 32 + 32 + 32 * 2 + 2 == 1762
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(theta))
    assert theta["linear_2"]["w"].shape == (32, 2)
    assert sum(
        x.size for x in jax.tree.leaves(MLPLOpt(hidden_size=8, hidden_layers=1).init(KEY))
    ) == (19 * 8 + 8 + 8 * 2 + 2)


def test_mlp_lopt_state_and_small_untrained_steps():
    lopt = MLPLOpt()
    theta = lopt.init(jax.random.PRNGKey(0))
    opt = lopt.opt_fn(theta)
    params = {"w": jax.random.normal(KEY, (5, 3)), "b": jnp.zeros(3), "s": jnp.float32(2.0)}
    state = opt.init(params)
    assert isinstance(state, MLPLOptState)
    assert state.momentums["w"].shape == (5, 3, 3) and state.rms["w"].shape == (5, 3)
    assert state.iteration.dtype == jnp.int32 and int(state.iteration) == 0

    grad = jax.tree.map(lambda p: jnp.ones_like(p) * 3.0, params)
    update = jax.jit(opt.update)
    for i in range(3):
        new = update(state, grad)
        assert int(new.iteration) == i + 1
        for old_p, new_p in zip(
            jax.tree.leaves(state.params), jax.tree.leaves(new.params), strict=True
        ):
            assert new_p.shape == old_p.shape
            delta = float(jnp.max(jnp.abs(new_p - old_p)))
            assert 0 < delta < 1e-2
        state = new
    np.testing.assert_allclose(state.rms["w"], (1 - 0.999**3) * 9.0, rtol=1e-4)
    np.testing.assert_allclose(
        state.momentums["w"][0, 0], 3.0 * (1 - np.array([0.5, 0.9, 0.99]) ** 3), rtol=1e-5
    )

    # Random initial iterations: the time features change the step.
    late = update(state._replace(iteration=jnp.asarray(5000, jnp.int32)), grad)
    assert int(late.iteration) == 5001
    late_step = late.params["w"] - state.params["w"]
    early_step = update(state, grad).params["w"] - state.params["w"]
    assert not np.allclose(late_step, early_step, rtol=1e-2, atol=0)


def test_mlp_lopt_steps_scale_with_step_multiplier():
    # With a full-size output layer the step is about step_multiplier per param.
    lopt = MLPLOpt(output_init_scale=1.0, step_multiplier=0.01)
    opt = lopt.opt_fn(lopt.init(jax.random.PRNGKey(3)))
    params = jax.random.normal(KEY, (50,))
    state = opt.update(opt.init(params), 2.0 * params)
    step = np.abs(np.asarray(state.params - params))
    assert 1e-4 < step.mean() < 0.1


def test_mlp_lopt_vmap_over_thetas_population():
    lopt = MLPLOpt()
    thetas = jax.vmap(lopt.init)(jax.random.split(KEY, 4))

    @jax.jit
    @jax.vmap
    def run(theta, task_param):
        return _unroll(lopt.opt_fn(theta), task_param, KEY, 3)

    task_params = jax.vmap(FAMILY.sample)(jax.random.split(KEY, 4))
    state, losses = run(thetas, task_params)
    assert state.params.shape == (4, 6) and losses.shape == (4,)
    np.testing.assert_array_equal(state.iteration, [3, 3, 3, 3])
    assert bool(jnp.all(jnp.isfinite(losses)))


def test_adam_mlp_lopt_is_adam_until_trained_and_then_is_not():
    lopt = AdamMLPLOpt(initial_lr=0.05)
    theta = lopt.init(jax.random.PRNGKey(0))
    assert lopt.num_features == theta["mlp"]["linear_0"]["w"].shape[0]
    run = jax.jit(lambda th: _unroll(lopt.opt_fn(th), TASK_PARAM, KEY, 8))
    state, _ = run(theta)
    ref_state, _ = _unroll(Adam(0.05, 0.9, 0.999, 1e-8), TASK_PARAM, KEY, 8)
    assert isinstance(state, AdamMLPLOptState)
    np.testing.assert_allclose(state.params, ref_state.params, rtol=2e-5, atol=1e-6)
    assert int(state.iteration) == 8

    # A nonzero output layer rescales and corrects the steps.
    out = theta["mlp"]["linear_2"]
    changed = {**theta, "mlp": {**theta["mlp"], "linear_2": {**out, "b": out["b"] + 0.5}}}
    changed_state, _ = run(changed)
    assert float(jnp.max(jnp.abs(changed_state.params - ref_state.params))) > 1e-3


def test_adam_mlp_lopt_horizon_features_stretch_with_the_horizon():
    lopt = AdamMLPLOpt()
    n_short = len(lopt.timescales)
    at_trained = lopt.shared_features(jnp.float32(40.0), jnp.float32(200.0))
    at_5x = lopt.shared_features(jnp.float32(200.0), jnp.float32(1000.0))
    # The same fraction of the run gives the same horizon features ...
    np.testing.assert_allclose(at_trained[n_short:], at_5x[n_short:], rtol=1e-6)
    # ... and late in a 5x run every input is still one seen late in training.
    late_trained = lopt.shared_features(jnp.float32(190.0), jnp.float32(200.0))
    late_5x = lopt.shared_features(jnp.float32(950.0), jnp.float32(1000.0))
    np.testing.assert_allclose(late_trained, late_5x, atol=1e-3)


def test_adam_mlp_lopt_refuses_a_missing_horizon_and_a_foreign_beta1():
    opt = AdamMLPLOpt().opt_fn(AdamMLPLOpt().init(KEY))
    with pytest.raises(ValueError, match="num_steps"):
        opt.init(jnp.zeros(3))
    with pytest.raises(ValueError, match="beta1"):
        AdamMLPLOpt(beta1=0.95)
    with pytest.raises(ValueError, match="initial_lr"):
        AdamMLPLOpt(initial_lr=0.0)


def _mlp_lopt_update_one_parameter_at_a_time(lopt: MLPLOpt, theta, state, grad):
    """MLPLOpt's update as its docstring states it: one input row per parameter, one MLP each.

    The plain formulation the optimizer had before its MLP ran over all
    tensors' stacked features at once; kept here to pin the fast path to the same maths.
    """
    decays = jnp.asarray(lopt.decays)
    momentums = jax.tree.map(
        lambda m, g: decays * m + (1 - decays) * g[..., None], state.momentums, grad
    )
    rms = jax.tree.map(
        lambda v, g: lopt.rms_decay * v + (1 - lopt.rms_decay) * g**2, state.rms, grad
    )
    time = jnp.tanh(state.iteration / jnp.asarray(lopt.timescales) - 1.0)

    def one_tensor(p, g, m, v):
        p, g, v = jnp.atleast_1d(p), jnp.atleast_1d(g), jnp.atleast_1d(v)  # a scalar: one element
        m = m.reshape(*p.shape, -1)
        inv = 1 / jnp.sqrt(v + lopt.epsilon)
        f = jnp.concatenate(
            [p[..., None], g[..., None], m, v[..., None], m * inv[..., None], inv[..., None]], -1
        )
        axes = tuple(range(p.ndim))
        f = f / jnp.sqrt(1e-5 + jnp.mean(f**2, axis=axes, keepdims=True))
        x = jnp.concatenate([f, jnp.broadcast_to(time, (*p.shape, time.size))], -1)
        for i in range(len(theta)):
            x = x @ theta[f"linear_{i}"]["w"] + theta[f"linear_{i}"]["b"]
            x = jax.nn.relu(x) if i < len(theta) - 1 else x
        step = x[..., 0] * jnp.exp(x[..., 1] * lopt.magnitude_multiplier) * lopt.step_multiplier
        return p - step

    params = jax.tree.map(
        lambda p, *a: one_tensor(p, *a).reshape(p.shape), state.params, grad, momentums, rms
    )
    return MLPLOptState(params, momentums, rms, state.iteration + 1)


# 41 and 206 parameters run row-major, 2,416 feature-major (features.FEATURE_MAJOR_MIN_ROWS).
@pytest.mark.parametrize("rows", [7, 40, 482])
def test_mlp_lopt_fast_path_equals_the_per_parameter_formulation(rows: int):
    lopt = MLPLOpt(output_init_scale=1.0)
    # A population of distinct thetas, as a PES unroll vmaps over (members, tasks).
    thetas = jax.vmap(lopt.init)(jax.random.split(KEY, 4))
    params = {"w": jax.random.normal(KEY, (rows, 5)), "b": jnp.zeros(5), "s": jnp.float32(0.5)}
    states = jax.vmap(lambda t: lopt.opt_fn(t).init(params))(thetas)
    fast = jax.jit(jax.vmap(lambda t, s, g: lopt.opt_fn(t).update(s, g)))
    plain = jax.jit(
        jax.vmap(lambda t, s, g: _mlp_lopt_update_one_parameter_at_a_time(lopt, t, s, g))
    )
    for i in range(5):
        leaves, treedef = jax.tree.flatten(states.params)
        keys = jax.random.split(jax.random.fold_in(KEY, i), len(leaves))
        grad = treedef.unflatten(
            [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
        )
        # Both sides step from the same state, so rounding differences do not compound.
        expected = plain(thetas, states, grad)
        states = fast(thetas, states, grad)
        for got, want in zip(jax.tree.leaves(states), jax.tree.leaves(expected), strict=True):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    assert np.abs(states.params["w"] - params["w"]).mean() > 1e-4  # the steps were not all zero


@pytest.mark.parametrize("sign_symmetric", [False, True])
def test_the_mlps_two_layouts_compute_the_same_outputs(monkeypatch, sign_symmetric: bool):
    theta = features.per_parameter_mlp_init(KEY, 10 + 3, 32, 2, output_init_scale=1.0)
    thetas = jax.vmap(lambda k: jax.tree.map(lambda t: t * (1 + jax.random.normal(k)), theta))(
        jax.random.split(KEY, 4)
    )
    keys = jax.random.split(jax.random.fold_in(KEY, 1), 5)
    params = {"w": jax.random.normal(keys[0], (300, 4)), "b": jax.random.normal(keys[1], (4,))}
    grad = jax.tree.map(lambda p: jax.random.normal(keys[2], p.shape), params)
    momentums = jax.tree.map(lambda p: jax.random.normal(keys[3], (*p.shape, 3)), params)
    rms = jax.tree.map(lambda p: jax.random.uniform(keys[4], p.shape), params)
    shared = jnp.linspace(-1.0, 1.0, 3)

    def outputs(min_rows: int):
        monkeypatch.setattr(features, "FEATURE_MAJOR_MIN_ROWS", min_rows)
        mlp = jax.jit(
            jax.vmap(
                lambda t: features.per_parameter_mlp(
                    t, params, grad, momentums, rms, shared, 1e-8, sign_symmetric=sign_symmetric
                )
            )
        )
        return mlp(thetas)

    feature_major, row_major = outputs(1), outputs(10**9)
    for output in (feature_major, row_major):  # (directions, magnitudes), params-shaped
        for tree in output:
            assert jax.tree.map(jnp.shape, tree) == jax.tree.map(lambda p: (4, *p.shape), params)
    for got, want in zip(jax.tree.leaves(feature_major), jax.tree.leaves(row_major), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The outputs are not all alike: each parameter gets its own.
    assert float(jnp.std(feature_major[0]["w"])) > 1e-3
