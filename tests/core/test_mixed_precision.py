"""bfloat16 where the work is: a learned optimizer's MLP, an image task's products.

``mlp_dtype: bfloat16`` (the MLP learned optimizers) and ``compute_dtype:
bfloat16`` (the image tasks) round a matrix product's inputs to bfloat16 and
sum in float32; theta, the optimizer state, parameters, gradients and the
meta-gradient stay float32. These tests state how far a step moves from the
float32 one on random inputs, and check with the exact-gradient comparison of
``test_full_es.py`` that a PES estimate through the bfloat16 MLP is still
unbiased for the trajectory's mean loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from popmeta.config import config_from_dict, load_config
from popmeta.experiment import (
    EstimatorSections,
    build_estimator,
    build_learned_optimizer,
    build_task_family,
    initial_theta,
)

#: The largest relative difference (2-norm over the whole update) a bfloat16
#: MLP step may have from the float32 one; measured up to about 0.6%.
MLP_STEP_RTOL = 2e-2
#: The same for an image task's loss and gradient.
TASK_LOSS_RTOL = 1e-2
TASK_GRAD_RTOL = 3e-2

MLP_KINDS = {
    "mlp": {"step_multiplier": 0.01},
    "mlp_adam": {"initial_lr": 0.01},
    "normalized_mlp": {"initial_lr": 0.01},
}


def _lopt(kind: str, dtype: str):
    section = {"kind": kind, **MLP_KINDS[kind], "mlp_dtype": dtype}
    return build_learned_optimizer(
        config_from_dict({"learned_optimizer": section}).learned_optimizer
    )


def _perturbed(theta, key, scale=0.5):
    """Theta with every leaf moved at random, so that no MLP output layer is zero."""
    leaves, treedef = jax.tree.flatten(theta)
    keys = jax.random.split(key, len(leaves))
    return treedef.unflatten(
        [
            x + scale * jax.random.normal(k, x.shape, x.dtype)
            for x, k in zip(leaves, keys, strict=True)
        ]
    )


def _relative(a, b) -> float:
    a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)]) for t in (a, b))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _float32(tree) -> bool:
    return all(
        x.dtype == jnp.float32
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(x.dtype, jnp.floating)
    )


@pytest.mark.parametrize("kind", sorted(MLP_KINDS))
def test_a_bfloat16_mlp_step_stays_near_the_float32_step_and_everything_else_float32(kind):
    lopts = {dtype: _lopt(kind, dtype) for dtype in ("float32", "bfloat16")}
    theta = _perturbed(lopts["float32"].init(jax.random.key(0)), jax.random.key(1))
    # A 2,410-parameter MLP's shapes and a 10-parameter one.
    for shapes in ({"w": (64, 32), "b": (32,), "w2": (32, 10), "b2": (10,)}, {"w": (10,)}):
        keys = iter(jax.random.split(jax.random.key(2), 64))
        params = {n: jax.random.normal(next(keys), s) for n, s in shapes.items()}
        states = {d: lopts[d].opt_fn(theta).init(params, num_steps=50) for d in lopts}
        for step in range(4):
            scale = 10.0 ** (step - 2)  # gradients from 0.01 to 10
            grad = {n: scale * jax.random.normal(next(keys), s) for n, s in shapes.items()}
            updates = {}
            for dtype, lopt in lopts.items():
                opt = lopt.opt_fn(theta)
                step_fn = jax.jit(lambda st, g, opt=opt: opt.step(st, g, loss=jnp.float32(1.0)))
                updates[dtype], states[dtype] = step_fn(states[dtype], grad)
            assert _float32(updates["bfloat16"]) and _float32(states["bfloat16"])
            error = _relative(updates["bfloat16"], updates["float32"])
            assert 0 < error < MLP_STEP_RTOL, (kind, shapes, step, error)
    assert _float32(theta)


@pytest.mark.parametrize(
    "task",
    [{"kind": "image_mlp_digits", "width": 64, "depth": 2}, {"kind": "conv_digits", "channels": 4}],
)
def test_a_bfloat16_image_task_stays_near_its_float32_loss_and_gradient(task):
    families = {
        d: build_task_family(config_from_dict({"task": {**task, "compute_dtype": d}}).task)
        for d in ("float32", "bfloat16")
    }
    tasks = {d: f.task_fn(f.sample(jax.random.key(0))) for d, f in families.items()}
    params = tasks["float32"].init(jax.random.key(1))
    batch = families["float32"].sample_batch(jax.random.key(2))
    out = {
        d: jax.jit(jax.value_and_grad(t.loss))(params, jax.random.key(3), batch)
        for d, t in tasks.items()
    }
    (loss32, grad32), (loss16, grad16) = out["float32"], out["bfloat16"]
    assert loss16.dtype == jnp.float32 and _float32(grad16)
    assert 0 < abs(float(loss16) - float(loss32)) < TASK_LOSS_RTOL * float(loss32)
    assert 0 < _relative(grad16, grad32) < TASK_GRAD_RTOL
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        type(tasks["float32"])(tasks["float32"].data, compute_dtype="float16")


# ---------------------------------------------------------------------- PES stays unbiased

TRAJECTORY = 20  # two truncations of 10 from the start of a trajectory
NUM_CALLS = 256
NUM_EXACT = 2048


def _pes_and_theta():
    config = load_config(
        None,
        [
            "learned_optimizer.mlp_dtype=bfloat16",
            f"truncation.length={TRAJECTORY}",
            "estimator.random_initial_iteration_offset=0",
        ],
    )
    sections = EstimatorSections.of(config)
    estimator = build_estimator(sections)
    assert estimator.truncated_step.learned_opt.mlp_dtype == "bfloat16"
    return estimator, initial_theta(sections)


def _flat(tree) -> np.ndarray:
    leaves = jax.tree.leaves(tree)
    return np.concatenate([np.asarray(x, np.float64).reshape(x.shape[0], -1) for x in leaves], 1)


def _trajectory_loss(step, theta, key):
    """One whole trajectory from iteration 0, from the family and the optimizer alone."""
    family, lopt = step.task_family, step.learned_opt
    key_task, key_params, key_steps = jax.random.split(key, 3)
    task = family.task_fn(family.sample(key_task))
    opt = lopt.opt_fn(theta, is_training=True)
    state = opt.init(task.init(key_params), num_steps=TRAJECTORY)

    def body(state, key):
        key_data, key_loss = jax.random.split(key)
        loss, grad = jax.value_and_grad(task.loss)(
            opt.get_params(state), key_loss, family.sample_batch(key_data)
        )
        return opt.update(state, grad, loss=loss), task.normalizer(loss)

    _, losses = jax.lax.scan(body, state, jax.random.split(key_steps, TRAJECTORY))
    return jnp.mean(losses)


def _z(a: np.ndarray, b: np.ndarray) -> float:
    se = np.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
    return float((a.mean() - b.mean()) / se)


def test_a_pes_estimate_through_a_bfloat16_mlp_is_unbiased_for_the_trajectory_loss():
    estimator, theta = _pes_and_theta()

    def two_truncations(key):
        key_state, key_first, key_second = jax.random.split(key, 3)
        state = estimator.init_worker_state(theta, key_state)
        first, m1 = estimator.estimate(theta, state, key_first)
        second, m2 = estimator.estimate(theta, first.state, key_second)
        grad = jax.tree.map(lambda a, b: (a + b) / 2, first.grad, second.grad)
        return grad, m1["valid_steps"] + m2["valid_steps"]

    grads, valid = jax.jit(jax.vmap(two_truncations))(
        jax.random.split(jax.random.key(0), NUM_CALLS)
    )
    # Both truncations are whole windows of one trajectory: nothing reset inside them.
    np.testing.assert_array_equal(
        np.asarray(valid), estimator.truncated_step.num_tasks * TRAJECTORY
    )
    samples = _flat(grads)

    step = estimator.truncated_step
    exact = jax.jit(
        jax.vmap(jax.grad(lambda th, k: _trajectory_loss(step, th, k)), in_axes=(None, 0))
    )(theta, jax.random.split(jax.random.key(100), 2 * NUM_EXACT))
    exact = _flat(exact)
    direction = exact[:NUM_EXACT].mean(axis=0)
    direction /= np.linalg.norm(direction)
    reference = exact[NUM_EXACT:]
    z = _z(samples @ direction, reference @ direction)
    assert abs(z) < 3.0, f"PES along the exact gradient: z = {z:.2f}"
    other = np.random.default_rng(0).normal(size=direction.shape)
    other -= (other @ direction) * direction
    other /= np.linalg.norm(other)
    z_other = _z(samples @ other, reference @ other)
    assert abs(z_other) < 3.0, f"PES across the exact gradient: z = {z_other:.2f}"
    # The signal is there to be missed: the estimate's mean is far from zero along it.
    along = samples @ direction
    assert along.mean() > 5 * along.std(ddof=1) / np.sqrt(len(along))
