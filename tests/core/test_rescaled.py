"""RescaledFamily: the same problems at random parameter scales."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from popmeta.core.evaluation import training_curves
from popmeta.core.optimizers import Adam
from popmeta.core.tasks import (
    Conv_Digits8,
    CurvedQuadraticFamily,
    ImageMLP_Digits8_Relu32,
    RescaledFamily,
    ScaleRange,
    single_task_to_family,
)

WIDE = ScaleRange(0.01, 100.0)
FAMILIES = {
    "quadratic": CurvedQuadraticFamily(6),
    "image_mlp": single_task_to_family(ImageMLP_Digits8_Relu32()),
    "conv": single_task_to_family(Conv_Digits8()),
}


def _task_and_params(family, seed: int):
    key_task, key_init = jax.random.split(jax.random.key(seed))
    task = family.task_fn(family.sample(key_task))
    return task, task.init(key_init)


def _original_and_rescaled(family, rescaled, seed: int):
    """One rescaled task and start, and the original task and start under them."""
    key_task, key_init = jax.random.split(jax.random.key(seed))
    task_params = rescaled.sample(key_task)
    original = family.task_fn(task_params.inner)
    wrapped = rescaled.task_fn(task_params)
    return original, original.init(key_init), wrapped, wrapped.init(key_init)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_rescaled_start_has_the_original_loss_and_gradients_scale_by_s(name: str):
    family = FAMILIES[name]
    rescaled = RescaledFamily(family, per_tensor=WIDE, overall=ScaleRange(0.1, 10.0))
    batch = family.sample_batch(jax.random.key(5), "train")
    for seed in range(3):
        original, p0, wrapped, q0 = _original_and_rescaled(family, rescaled, seed)
        key = jax.random.key(9)
        np.testing.assert_allclose(
            wrapped.loss(q0, key, batch), original.loss(p0, key, batch), rtol=2e-6
        )
        scales = wrapped.scales(q0)
        s = np.array(jax.tree.leaves(scales))
        assert np.all((s >= 0.01 * 0.1 * 0.999) & (s <= 100.0 * 10.0 * 1.001))
        if len(s) > 1:
            assert len(np.unique(s)) == len(s), "each tensor draws its own factor"
        grad_q = jax.grad(wrapped.loss)(q0, key, batch)
        grad_p = jax.grad(original.loss)(wrapped.original(q0), key, batch)
        for gq, gp, scale in zip(jax.tree.leaves(grad_q), jax.tree.leaves(grad_p), s, strict=True):
            np.testing.assert_allclose(gq, scale * gp, rtol=1e-4, atol=1e-6 * scale)


def test_tasks_draw_different_scales_and_no_rescaling_changes_nothing():
    family = FAMILIES["image_mlp"]
    rescaled = RescaledFamily(family, per_tensor=WIDE)
    first, second = (
        np.array(jax.tree.leaves(task.scales(q)))
        for task, q in map(lambda seed: _task_and_params(rescaled, seed), (0, 1))
    )
    assert not np.allclose(first, second)

    _, p, _, q = _original_and_rescaled(family, RescaledFamily(family), 0)
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(p), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_rescaled_family_trains_under_jit_and_vmap():
    family = FAMILIES["image_mlp"]
    rescaled = RescaledFamily(family, per_tensor=ScaleRange(0.1, 10.0))
    run = jax.jit(lambda fam_key: training_curves(rescaled, Adam(1e-2), fam_key, 3, 20))
    curves = run(jax.random.key(0))
    assert curves.train_loss.shape == (3, 20)
    assert bool(jnp.all(jnp.isfinite(curves.train_loss)))
    assert float(curves.train_loss[:, -5:].mean()) < float(curves.train_loss[:, 0].mean())
    assert curves.final_accuracy.shape == (3,)


def test_bad_ranges_are_refused():
    with pytest.raises(ValueError, match="per_tensor"):
        RescaledFamily(FAMILIES["quadratic"], per_tensor=ScaleRange(2.0, 1.0))
    with pytest.raises(ValueError, match="overall"):
        RescaledFamily(FAMILIES["quadratic"], overall=ScaleRange(0.0, 1.0))
