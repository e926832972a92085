"""FullES under the default config: whole episodes from iteration 0, unbiased for their mean loss.

The default config starts a persistent population at random inner-step
offsets. FullES is built on that same step, so these tests build it the way a
run does (``estimator.kind=full_es`` on the default config, the issue's
episode length of 20) and compare it with an episode written out here from
the task family and the learned optimizer alone: fresh task, ``opt.init``, 20
updates, mean normalized training loss.

The MLP learned optimizer's loss is not quadratic in theta, so the ES mean is
the gradient of the Gaussian-smoothed loss; with the default std of 0.01 that
differs from ``jax.grad`` by far less than the test's standard error (the
offset-episode control below shows how large a real bias is next to it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from popmeta import FullES, VectorizedLOptTruncatedStep
from popmeta.config import load_config
from popmeta.experiment import EstimatorSections, build_estimator, initial_theta

EPISODE = 20
NUM_CALLS = 256  # FullES calls, each averaging num_tasks antithetic pairs
NUM_EXACT = 2048  # episodes behind the exact-gradient mean


class _OffsetEpisodes(VectorizedLOptTruncatedStep):
    """The old FullES start: episodes begin at the population's random offsets."""

    def init_episode_state(self, theta, outer_state, key, theta_is_vector=False):
        key_init, key_offset = jax.random.split(key)
        state = super().init_episode_state(theta, outer_state, key_init, theta_is_vector)
        offsets = jax.random.randint(
            key_offset, (self.num_tasks,), 0, self.random_initial_iteration_offset, jnp.int32
        )
        return state.replace(inner_step=offsets)


@pytest.fixture(scope="module")
def default_full_es():
    config = load_config(None, ["estimator.kind=full_es", f"truncation.length={EPISODE}"])
    estimator = build_estimator(EstimatorSections.of(config))
    assert isinstance(estimator, FullES) and estimator.trunc_length == EPISODE
    step = estimator.truncated_step
    # The default config's offset is what made FullES biased; the test must see it.
    assert step.random_initial_iteration_offset >= EPISODE
    return config, estimator


def _episode_loss(step: VectorizedLOptTruncatedStep, theta, key):
    """One whole episode from iteration 0, written from the family and optimizer alone."""
    family, lopt = step.task_family, step.learned_opt
    key_task, key_params, key_steps = jax.random.split(key, 3)
    task = family.task_fn(family.sample(key_task))
    opt = lopt.opt_fn(theta, is_training=True)
    state = opt.init(task.init(key_params), num_steps=EPISODE)

    def body(state, key):
        key_data, key_loss = jax.random.split(key)
        loss, grad = jax.value_and_grad(task.loss)(
            opt.get_params(state), key_loss, family.sample_batch(key_data)
        )
        return opt.update(state, grad, loss=loss), task.normalizer(loss)

    _, losses = jax.lax.scan(body, state, jax.random.split(key_steps, EPISODE))
    return jnp.mean(losses)


def _flat(tree) -> np.ndarray:
    leaves = jax.tree.leaves(tree)
    return np.concatenate([np.asarray(x, np.float64).reshape(x.shape[0], -1) for x in leaves], 1)


def _full_es_samples(estimator, theta, seed):
    keys = jax.random.split(jax.random.key(seed), NUM_CALLS)
    run = jax.jit(jax.vmap(lambda k: estimator.estimate(theta, (), k), in_axes=0))
    out, metrics = run(keys)
    return _flat(out.grad), metrics


@pytest.fixture(scope="module")
def exact(default_full_es):
    """Per-episode ``jax.grad`` of the mean loss, two independent halves."""
    _, estimator = default_full_es
    step = estimator.truncated_step
    theta = initial_theta(EstimatorSections.of(default_full_es[0]))
    grad = jax.jit(jax.vmap(jax.grad(lambda th, k: _episode_loss(step, th, k)), in_axes=(None, 0)))
    keys = jax.random.split(jax.random.key(100), 2 * NUM_EXACT)
    grads = _flat(grad(theta, keys))
    return grads[:NUM_EXACT], grads[NUM_EXACT:]


def _z(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample z statistic of the means of ``a`` and ``b``."""
    se = np.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
    return float((a.mean() - b.mean()) / se)


def test_full_es_episodes_start_at_iteration_zero_and_never_reset(default_full_es):
    config, estimator = default_full_es
    theta = initial_theta(EstimatorSections.of(config))
    start = estimator.truncated_step.init_episode_state(theta, None, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(start.inner_step), 0)
    np.testing.assert_array_equal(np.asarray(start.inner_opt_state.iteration), 0)
    _, metrics = jax.jit(estimator.estimate)(theta, (), jax.random.key(1))
    num_tasks = config.estimator.num_tasks
    # Every episode is one whole trajectory: it ends on its last step, never inside.
    assert int(metrics["num_done"]) == num_tasks
    assert int(metrics["valid_steps"]) == num_tasks * EPISODE


def test_full_es_default_config_is_unbiased_for_the_episode_mean_loss(default_full_es, exact):
    config, estimator = default_full_es
    theta = initial_theta(EstimatorSections.of(config))
    direction_half, reference_half = exact
    # The direction comes from episodes the comparison does not use.
    direction = direction_half.mean(axis=0)
    direction /= np.linalg.norm(direction)
    reference = reference_half @ direction

    samples, _ = _full_es_samples(estimator, theta, seed=0)
    z = _z(samples @ direction, reference)
    assert abs(z) < 3.0, f"FullES along the exact gradient: z = {z:.2f}"
    # A direction orthogonal to the gradient sees no signal in either.
    other = np.random.default_rng(0).normal(size=direction.shape)
    other -= (other @ direction) * direction
    other /= np.linalg.norm(other)
    z_other = _z(samples @ other, reference_half @ other)
    assert abs(z_other) < 3.0, f"FullES across the exact gradient: z = {z_other:.2f}"

    # The control: episodes started at the population's offsets (FullES's old
    # start) estimate another objective's gradient, and the test sees it.
    cfg = config.estimator
    offset_step = _OffsetEpisodes(
        estimator.truncated_step.task_family,
        estimator.truncated_step.learned_opt,
        estimator.truncated_step.trunc_sched,
        num_tasks=cfg.num_tasks,
        random_initial_iteration_offset=cfg.random_initial_iteration_offset,
    )
    biased, metrics = _full_es_samples(FullES(offset_step, EPISODE, std=cfg.std), theta, seed=0)
    # resets inside the episodes (a reset step is not a valid step)
    assert int(metrics["valid_steps"].sum()) < NUM_CALLS * cfg.num_tasks * EPISODE
    z_biased = _z(biased @ direction, reference)
    assert abs(z_biased) > 6.0, f"the offset episodes' bias went unseen: z = {z_biased:.2f}"
