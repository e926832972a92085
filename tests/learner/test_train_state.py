"""Tests for popmeta.learner.train_state."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from popmeta.learner.train_state import (
    TrainState,
    build_apply_estimates_fn,
    make_outer_optimizer,
)
from popmeta.registry.outer_optimizers import outer_lr_decay


def _linreg_loss(params, batch):
    pred = batch["x"] @ params["w"] + params["b"]
    return jnp.mean((pred - batch["y"]) ** 2)


def _linreg_data():
    x = jax.random.normal(jax.random.key(0), (64, 3))
    w_true = jnp.array([1.0, -2.0, 0.5])
    return {"x": x, "y": x @ w_true + 0.3}, w_true


def _params():
    return {"w": jnp.zeros(3), "b": jnp.zeros(())}


def test_train_state_is_pytree_with_static_tx():
    tx = optax.sgd(0.1)
    state = TrainState.initial_state(_params(), tx, jax.random.key(0))
    assert state.step.dtype == jnp.int32 and int(state.step) == 0
    leaves = jax.tree.leaves(state)
    # step, rng, 2 params; sgd without momentum has no array state.
    assert len(leaves) == 4
    assert all(leaf is not tx for leaf in leaves)
    rebuilt = jax.tree.unflatten(jax.tree.structure(state), leaves)
    assert rebuilt.tx is tx


def test_exact_gradients_as_estimates_train_a_linear_regression():
    batch, w_true = _linreg_data()
    tx = make_outer_optimizer("adam", None, learning_rate=0.1)
    state = TrainState.initial_state(_params(), tx, jax.random.key(0))
    step = build_apply_estimates_fn()
    loss_and_grad = jax.jit(jax.value_and_grad(_linreg_loss))
    first_loss, _ = loss_and_grad(state.params, batch)
    for _ in range(300):
        loss, grad = loss_and_grad(state.params, batch)
        state, metrics, applied = step(state, [grad])
        assert bool(applied)
    assert float(loss) < 1e-3 * float(first_loss)
    np.testing.assert_allclose(state.params["w"], w_true, atol=1e-2)
    np.testing.assert_allclose(state.params["b"], 0.3, atol=1e-2)
    assert int(state.step) == 300
    assert {"grad_norm", "update_norm", "param_norm"} == set(metrics)


def test_step_rng_is_fold_in_of_root_rng_and_step():
    root = jax.random.key(42)
    state = TrainState.initial_state({"w": jnp.zeros(2)}, optax.sgd(0.1), root)
    step = build_apply_estimates_fn()
    for t in range(3):
        expected = jax.random.fold_in(root, t)
        assert jax.random.key_data(state.step_rng()).tolist() == (
            jax.random.key_data(expected).tolist()
        )
        state, _, _ = step(state, [{"w": jnp.ones(2)}])


@pytest.mark.parametrize("donate", [True, False])
def test_donation_deletes_old_buffers(donate):
    tx = make_outer_optimizer("adam", 3.0, learning_rate=0.1)
    old = TrainState.initial_state(_params(), tx, jax.random.key(0))
    step = build_apply_estimates_fn(donate_params_and_state=donate)
    grad = {"w": jnp.ones(3), "b": jnp.ones(())}
    new, _, _ = step(old, [grad])
    assert old.params["w"].is_deleted() is donate
    assert old.opt_state[1][0].mu["w"].is_deleted() is donate
    assert not new.params["w"].is_deleted()
    # The estimates are never donated.
    assert not grad["w"].is_deleted()


def test_one_estimate_is_one_hand_applied_adam_step():
    params = {"w": jnp.array([1.0, -1.0, 2.0]), "b": jnp.array(0.5)}
    grads = [
        {"w": jnp.array([0.1, 0.2, -0.3]), "b": jnp.array(1.0)},
        {"w": jnp.array([-0.5, 0.0, 0.4]), "b": jnp.array(-2.0)},
    ]
    tx = make_outer_optimizer("adam", None, learning_rate=0.01)
    state = TrainState.initial_state(params, tx, jax.random.key(0))
    apply = build_apply_estimates_fn()

    ref_tx = optax.adam(0.01)
    ref_params, ref_opt = params, ref_tx.init(params)
    for g in grads:
        state, metrics, _ = apply(state, [g])
        updates, ref_opt = ref_tx.update(g, ref_opt, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
        np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(g), rtol=1e-6)
        np.testing.assert_allclose(metrics["update_norm"], optax.tree.norm(updates), rtol=1e-6)
        np.testing.assert_allclose(metrics["param_norm"], optax.tree.norm(ref_params), rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), state.params, ref_params)
    assert int(state.step) == 2
    # The non-jitted path computes the same thing.
    unjitted = build_apply_estimates_fn(jit=False)
    s0 = TrainState.initial_state(params, tx, jax.random.key(0))
    s1, _, _ = unjitted(s0, [grads[0]])
    s1_ref = TrainState.initial_state(params, tx, jax.random.key(0)).apply_gradients(grads[0])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), s1.params, s1_ref.params)


def test_clipping_by_global_norm_clips():
    params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
    big = {"a": jnp.array([30.0, 0.0]), "b": jnp.array([0.0, 40.0])}  # global norm 50
    tx = make_outer_optimizer("sgd", 5.0, learning_rate=1.0)
    state = TrainState.initial_state(params, tx, jax.random.key(0))
    new, metrics, _ = build_apply_estimates_fn()(state, [big])
    assert float(metrics["grad_norm"]) == pytest.approx(50.0)
    assert float(metrics["update_norm"]) == pytest.approx(5.0, rel=1e-5)
    # Direction is kept: sgd step = -clipped grad.
    np.testing.assert_allclose(new.params["a"], [-3.0, 0.0], rtol=1e-5)
    np.testing.assert_allclose(new.params["b"], [0.0, -4.0], rtol=1e-5)

    # Below the threshold nothing changes.
    small = {"a": jnp.array([0.3, 0.0]), "b": jnp.array([0.0, 0.4])}
    _, metrics, _ = build_apply_estimates_fn()(state, [small])
    assert float(metrics["update_norm"]) == pytest.approx(0.5, rel=1e-5)


def _host_estimates(weights, seed=3):
    rng = np.random.default_rng(seed)
    return [
        {"a": rng.normal(size=1000).astype(np.float32), "b": rng.normal(size=3).astype(np.float32)}
        for _ in weights
    ]


def test_apply_estimates_takes_the_weighted_mean_of_host_arrays():
    weights = np.asarray([2, 1, 2, 2, 1, 3], np.float32) / 11
    grads = _host_estimates(weights)
    originals = [jax.tree.map(np.copy, g) for g in grads]
    params = {"a": jnp.zeros(1000), "b": jnp.ones(3)}
    # Plain SGD with rate 1 and no clipping: the step is the mean itself.
    tx = make_outer_optimizer("sgd", None, learning_rate=1.0)
    state = TrainState.initial_state(params, tx, jax.random.key(0))
    step = build_apply_estimates_fn(donate_params_and_state=True)
    new, metrics, applied = step(state, grads, weights)

    assert bool(applied) and int(new.step) == 1
    mean = {
        k: sum(w * g[k].astype(np.float64) for w, g in zip(weights, grads, strict=True))
        for k in "ab"
    }
    np.testing.assert_allclose(new.params["a"], -mean["a"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new.params["b"], 1.0 - mean["b"], rtol=1e-5, atol=1e-6)
    norm = np.sqrt(sum(np.sum(m**2) for m in mean.values()))
    np.testing.assert_allclose(metrics["grad_norm"], norm, rtol=1e-5)
    np.testing.assert_allclose(metrics["update_norm"], norm, rtol=1e-5)
    # The estimates are read, never written; the state was donated.
    for g, o in zip(grads, originals, strict=True):
        jax.tree.map(np.testing.assert_array_equal, g, o)
    assert state.params["a"].is_deleted()


def test_apply_estimates_equals_one_step_with_the_mean():
    weights = np.asarray([0.5, 0.25, 0.25], np.float32)
    grads = _host_estimates(weights, seed=4)
    mean = jax.tree.map(
        lambda *leaves: sum(w * x for w, x in zip(weights, leaves, strict=True)), *grads
    )
    tx = make_outer_optimizer("adam", 3.0, learning_rate=0.01)
    params = {"a": jnp.linspace(-1, 1, 1000), "b": jnp.zeros(3)}
    fused = TrainState.initial_state(params, tx, jax.random.key(0))
    separate = TrainState.initial_state(params, tx, jax.random.key(0))
    step = build_apply_estimates_fn()
    for _ in range(3):
        fused, fused_metrics, _ = step(fused, grads, weights)
        separate, separate_metrics, _ = step(separate, [mean])
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        (fused.params, fused.opt_state, fused_metrics),
        (separate.params, separate.opt_state, separate_metrics),
    )
    # One program per number of estimates, whatever the weights.
    step(fused, grads, np.asarray([0.2, 0.3, 0.5], np.float32))
    assert step._cache_size() == 2  # 3 estimates, and the 1 above
    step(fused, grads[:2], np.asarray([0.5, 0.5], np.float32))
    assert step._cache_size() == 3


@pytest.mark.parametrize("bad", [np.nan, np.inf, 1e30])
def test_apply_estimates_leaves_the_state_alone_when_the_mean_is_not_usable(bad):
    weights = np.asarray([0.5, 0.5], np.float32)
    grads = _host_estimates(weights, seed=5)
    # NaN or inf in one estimate; or finite values whose squares overflow float32.
    grads[1]["a"][7] = bad
    tx = make_outer_optimizer("adam", 3.0, learning_rate=0.01)
    params = {"a": jnp.linspace(-1, 1, 1000), "b": jnp.zeros(3)}
    state = TrainState.initial_state(params, tx, jax.random.key(0))
    state, _, _ = build_apply_estimates_fn()(state, grads[:1], weights[:1] * 2)

    def numbers(s):
        return jax.tree.map(np.array, (s.step, s.params, s.opt_state))

    before = numbers(state)
    step = build_apply_estimates_fn(donate_params_and_state=True)
    new, metrics, applied = step(state, grads, weights)
    assert not bool(applied) and not np.isfinite(metrics["grad_norm"])
    jax.tree.map(np.testing.assert_array_equal, numbers(new), before)


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd", "sgdm"])
def test_make_outer_optimizer_names(name):
    tx = make_outer_optimizer(name, 3.0, learning_rate=0.1, weight_decay=0.01)
    params = {"w": jnp.ones(2)}
    updates, _ = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
    assert np.all(np.asarray(updates["w"]) < 0)


def test_make_outer_optimizer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rmsprop"):
        make_outer_optimizer("rmsprop", 3.0, learning_rate=0.1)
    with pytest.raises(ValueError, match="clip_grad_norm"):
        make_outer_optimizer("adam", 0.0, learning_rate=0.1)
    with pytest.raises(ValueError, match="weight_decay"):
        make_outer_optimizer("adam", 3.0, learning_rate=0.1, weight_decay=-1.0)


# The sharding check needs several devices, which XLA only fakes on CPU if the
# flag is set before jax initialises: hence a fresh interpreter.
_SHARDING_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from popmeta.learner.train_state import (
        TrainState, build_apply_estimates_fn, make_outer_optimizer)

    assert jax.device_count() == 4, jax.devices()
    mesh = jax.make_mesh((4,), ("x",))
    row = NamedSharding(mesh, P("x"))
    rep = NamedSharding(mesh, P())

    tx = make_outer_optimizer("adam", 3.0, learning_rate=0.1)

    def fresh_state():
        # Separate buffers per run: device_put may alias its source, and the
        # sharded run donates.
        params = {"w": jnp.zeros(8), "b": jnp.zeros(())}
        return TrainState.initial_state(params, tx, jax.random.key(1))

    state = fresh_state()
    # Shard every vector of length 8 (params, adam moments) over the mesh.
    state_sh = jax.tree.map(lambda a: row if a.shape == (8,) else rep, state)

    s_sh = jax.device_put(state, state_sh)
    s_pl = fresh_state()
    # The learner's step, on host estimates as they come from the object store.
    estimates = [{"w": np.full(8, v, np.float32), "b": np.float32(v)} for v in (1.0, -3.0)]
    weights = np.asarray([0.25, 0.75], np.float32)
    estimates_sharded = build_apply_estimates_fn(
        donate_params_and_state=True, train_state_shardings=state_sh)
    estimates_plain = build_apply_estimates_fn()
    for _ in range(2):
        s_sh, m_sh, applied_sh = estimates_sharded(s_sh, estimates, weights)
        s_pl, m_pl, applied_pl = estimates_plain(s_pl, estimates, weights)
        assert bool(applied_sh) and bool(applied_pl)
    # One estimate, a round of one, with no weights.
    g = {"w": jnp.ones(8), "b": jnp.ones(())}
    s_sh, _, _ = estimates_sharded(s_sh, [g])
    s_pl, _, _ = estimates_plain(s_pl, [g])

    w_sh = s_sh.params["w"].sharding
    assert isinstance(w_sh, NamedSharding) and w_sh.spec == P("x"), w_sh
    assert w_sh.mesh.shape == {"x": 4}, w_sh.mesh
    assert s_sh.opt_state[1][0].mu["w"].sharding.spec == P("x")
    assert len(s_sh.params["w"].addressable_shards) == 4
    np.testing.assert_allclose(s_sh.params["w"], s_pl.params["w"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s_sh.params["b"], s_pl.params["b"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m_sh["grad_norm"], m_pl["grad_norm"], rtol=1e-5)
    print("SHARDING_OK", tuple(w_sh.spec), len(s_sh.params["w"].addressable_shards))
    """
)


def test_sharded_step_on_forced_host_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, "-c", _SHARDING_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SHARDING_OK ('x',) 4" in result.stdout


@pytest.mark.parametrize(
    ("kind", "factor"),
    [
        ("cosine", lambda k, n, a: a + (1 - a) * 0.5 * (1 + np.cos(np.pi * min(k, n) / n))),
        ("linear", lambda k, n, a: 1 - (1 - a) * min(k, n) / n),
    ],
)
def test_an_outer_lr_decay_scales_each_adam_step_by_its_schedule(kind, factor):
    num_steps, final = 6, 0.1
    decayed = optax.chain(optax.adam(0.01), *outer_lr_decay(kind, num_steps, final))
    plain = optax.adam(0.01)
    params = {"w": jnp.ones(3)}
    states = decayed.init(params), plain.init(params)
    for k in range(num_steps + 3):
        grad = {"w": jnp.array([1.0, -2.0, 0.5]) * (k + 1)}
        (mine, decayed_state), (theirs, plain_state) = (
            tx.update(grad, state) for tx, state in zip((decayed, plain), states, strict=True)
        )
        states = decayed_state, plain_state
        np.testing.assert_allclose(
            mine["w"], factor(k, num_steps, final) * theirs["w"], rtol=1e-6, atol=0
        )
    # From update num_steps on, the steps stay at final_fraction of Adam's.
    np.testing.assert_allclose(mine["w"] / theirs["w"], final, rtol=1e-6)


def test_an_outer_lr_decay_from_a_start_fraction_holds_the_rate_until_then():
    num_steps, final, start = 8, 0.2, 0.5
    (decay,) = outer_lr_decay("cosine", num_steps, final, start)
    state = decay.init({"w": jnp.zeros(1)})
    factors = []
    for _ in range(num_steps + 2):
        step, state = decay.update({"w": jnp.ones(1)}, state)
        factors.append(float(step["w"][0]))
    # Updates 0-4 at the full rate, then a cosine over the last four to `final`.
    expected = [1.0] * 4 + [
        final + (1 - final) * 0.5 * (1 + np.cos(np.pi * min(k, 4) / 4)) for k in range(6)
    ]
    np.testing.assert_allclose(factors, expected, rtol=1e-6)


def test_a_constant_outer_lr_adds_nothing_and_bad_decays_are_refused():
    assert outer_lr_decay("constant", 10) == []
    with pytest.raises(ValueError, match=r"one of .*'cosine'"):
        outer_lr_decay("exponential", 10)
    with pytest.raises(ValueError, match=r"final_fraction must be in \[0, 1\]"):
        outer_lr_decay("cosine", 10, 1.5)
    with pytest.raises(ValueError, match=r"start_fraction must be in \[0, 1\)"):
        outer_lr_decay("cosine", 10, 0.1, 1.0)
    with pytest.raises(ValueError, match="num_steps must be > 0"):
        outer_lr_decay("linear", 0)
