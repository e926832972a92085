"""Estimators tested statistically against the exact gradients of a linear-quadratic unroll.

Each estimator is vmapped over many seeds (one antithetic pair per seed) and
walked through consecutive truncations; the sample mean and covariance per
truncation window are compared with the exact gradient and with the closed-form
covariance of one antithetic pair (``linear_system.closed_form``: the loss is
quadratic in theta, so the estimate is a quadratic form in the Gaussian noise).
The walks are the expensive part; each is computed once per module
(``persistent_walks``) and shared by the tests that check it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from popmeta import (
    FullES,
    NoiseReuseES,
    TruncatedES,
    TruncatedGrad,
    TruncatedPES,
    VectorizedTruncatedStep,
)
from tests.core.linear_system import LinearQuadraticStep, closed_form, window_oracle

NUM_SEEDS = 4000
NUM_WINDOWS = 6
TRUNC_LENGTH = 3
STD = 0.3
# length 5: trajectories end mid-truncation and restart inside it;
# length 6: a trajectory ends on a truncation's last step and restarts with the next.
LENGTHS = [5, 6]


def _theta(dim=5):
    return jnp.asarray(np.random.default_rng(1).normal(size=dim), jnp.float32)


def _walk_windows(estimator, theta, num_windows, seed=0):
    """Per-window estimates, shape [J, seeds, d], from ``NUM_SEEDS`` independent workers."""
    keys = jax.random.split(jax.random.key(seed), NUM_SEEDS)
    init = jax.jit(jax.vmap(estimator.init_worker_state, in_axes=(None, 0)))
    step = jax.jit(jax.vmap(estimator.estimate, in_axes=(None, 0, 0)))
    state = init(theta, keys)
    grads = []
    for j in range(num_windows):
        window_keys = jax.vmap(lambda k, j=j: jax.random.fold_in(k, j + 1))(keys)
        out, _ = step(theta, state, window_keys)
        state = out.state
        grads.append(np.asarray(out.grad, np.float64))
    return np.stack(grads)


def _assert_unbiased(samples, expected, label):
    mean = samples.mean(axis=0)
    stderr = samples.std(axis=0, ddof=1) / np.sqrt(len(samples))
    z = np.abs(mean - expected) / stderr
    assert np.all(z < 3.0), f"{label}: mean {mean} vs exact {expected}, |z| = {z}"


@pytest.fixture(scope="module", params=LENGTHS, ids=lambda n: f"length{n}")
def system(request):
    step = LinearQuadraticStep(length=request.param)
    theta = _theta()
    oracle = window_oracle(step, theta, NUM_WINDOWS, TRUNC_LENGTH)
    return step, theta, oracle


@pytest.fixture(scope="module")
def persistent_walks(system):
    """``walk(kind)``: the PES or NRES per-window estimates on ``system``, each walked once."""
    step, theta, _ = system
    vec = VectorizedTruncatedStep(step, 1)
    classes = {"pes": TruncatedPES, "nres": NoiseReuseES}
    walks: dict[str, np.ndarray] = {}

    def walk(kind: str) -> np.ndarray:
        if kind not in walks:
            estimator = classes[kind](vec, trunc_length=TRUNC_LENGTH, std=STD)
            walks[kind] = _walk_windows(estimator, theta, NUM_WINDOWS)
        return walks[kind]

    return walk


@pytest.mark.parametrize("kind", ["pes", "nres"])
def test_closed_form_mean_is_the_true_gradient(system, kind):
    _, _, oracle = system
    for j in range(NUM_WINDOWS):
        mean, _ = closed_form(oracle, kind, j)
        np.testing.assert_allclose(
            mean, oracle.true_grad[j], rtol=1e-6, atol=1e-9, err_msg=f"{kind} window {j}"
        )


@pytest.mark.parametrize("kind", ["pes", "nres"])
def test_persistent_estimators_unbiased(system, persistent_walks, kind):
    _, _, oracle = system
    grads = persistent_walks(kind)
    for j in range(NUM_WINDOWS):
        _assert_unbiased(grads[j], oracle.true_grad[j], f"{kind} window {j}")


@pytest.mark.parametrize("kind", ["pes", "nres"])
def test_persistent_estimators_have_the_closed_form_variance(system, persistent_walks, kind):
    _, _, oracle = system
    grads = persistent_walks(kind)
    for j in range(NUM_WINDOWS):
        _, cov = closed_form(oracle, kind, j)
        measured = np.trace(np.cov(grads[j].T))
        predicted = np.trace(cov)
        assert measured == pytest.approx(predicted, rel=0.15), f"{kind} window {j}"


def test_nres_variance_never_above_pes(system, persistent_walks):
    _, _, oracle = system
    pes = persistent_walks("pes")
    nres = persistent_walks("nres")
    ratios = []
    for j in range(NUM_WINDOWS):
        pes_trace = np.trace(closed_form(oracle, "pes", j)[1])
        nres_trace = np.trace(closed_form(oracle, "nres", j)[1])
        assert nres_trace <= pes_trace * (1 + 1e-9)
        # measured, with a margin for the sampling error of two independent estimates
        assert np.trace(np.cov(nres[j].T)) <= 1.1 * np.trace(np.cov(pes[j].T)), j
        ratios.append(pes_trace / nres_trace)
    # PES pays for its accumulated history once a trajectory spans several windows.
    widest = int(np.argmax(ratios))
    assert ratios[widest] > 1.2
    measured = np.trace(np.cov(pes[widest].T)) / np.trace(np.cov(nres[widest].T))
    assert measured == pytest.approx(ratios[widest], rel=0.2)


def test_full_es_unbiased_for_whole_episode_gradient(system):
    step, theta, _ = system
    episode = NUM_WINDOWS * TRUNC_LENGTH
    vec = VectorizedTruncatedStep(step, 1)
    grads = _walk_windows(FullES(vec, episode, std=STD), theta, 1)[0]

    def episode_loss(theta):
        state = step.init_step_state(theta, None, None)
        total, count = 0.0, 0.0
        for _ in range(episode):
            state, out = step.unroll_step(theta, state, None, None, None)
            total, count = total + out.loss * out.mask, count + out.mask
        return total / count

    exact = np.asarray(jax.grad(episode_loss)(theta), np.float64)
    _assert_unbiased(grads, exact, "full_es")
    dim = exact.size
    predicted = (dim + 1) * exact @ exact
    assert np.trace(np.cov(grads.T)) == pytest.approx(predicted, rel=0.15)


class NoResetWalks(NamedTuple):
    """Truncated ES and truncated backprop walked on a system that never resets."""

    true_grad: np.ndarray  # [J, d]: dL_j/dtheta through every window
    own_window: np.ndarray  # [J, d]: dL_j/dtheta_j, the window's own theta only
    truncated_es: np.ndarray  # [J, seeds, d]
    truncated_grad: np.ndarray  # [J, seeds, d]


@pytest.fixture(scope="module")
def no_reset_walks() -> NoResetWalks:
    step = LinearQuadraticStep(length=100)  # no reset: the state carries theta's influence
    theta = _theta()
    oracle = window_oracle(step, theta, NUM_WINDOWS, TRUNC_LENGTH)
    vec = VectorizedTruncatedStep(step, 1)
    return NoResetWalks(
        true_grad=oracle.true_grad,
        own_window=np.stack([oracle.jac[0, j, j] for j in range(NUM_WINDOWS)]),
        truncated_es=_walk_windows(TruncatedES(vec, TRUNC_LENGTH, STD), theta, NUM_WINDOWS),
        truncated_grad=_walk_windows(TruncatedGrad(vec, TRUNC_LENGTH), theta, NUM_WINDOWS),
    )


def test_truncation_bias_is_large_on_the_no_reset_system(no_reset_walks):
    """The earlier windows' influence, which truncated estimators miss, is not negligible."""
    walks = no_reset_walks
    for j in range(1, NUM_WINDOWS):
        bias = walks.true_grad[j] - walks.own_window[j]
        assert np.linalg.norm(bias) > 0.3 * np.linalg.norm(walks.true_grad[j]), j


def test_truncated_grad_is_the_own_window_gradient(no_reset_walks):
    walks = no_reset_walks
    for j in range(1, NUM_WINDOWS):
        np.testing.assert_allclose(
            walks.truncated_grad[j, 0], walks.own_window[j], rtol=1e-4, atol=1e-5, err_msg=j
        )


def test_truncated_es_is_unbiased_for_the_own_window_gradient_only(no_reset_walks):
    """Truncated ES estimates only dL_j/dtheta_j, missing earlier windows' influence."""
    walks = no_reset_walks
    for j in range(1, NUM_WINDOWS):
        tes = walks.truncated_es[j]
        _assert_unbiased(tes, walks.own_window[j], f"truncated_es window {j}")
        stderr = tes.std(axis=0, ddof=1) / np.sqrt(NUM_SEEDS)
        assert np.max(np.abs(tes.mean(axis=0) - walks.true_grad[j]) / stderr) > 10, j


@pytest.mark.parametrize("cls", [TruncatedPES, NoiseReuseES, TruncatedES])
def test_sign_and_clip_of_delta_loss(cls):
    step = LinearQuadraticStep(length=100)
    vec = VectorizedTruncatedStep(step, 1)
    theta = _theta()
    key = jax.random.key(3)

    def first_estimate(**options):
        estimator = cls(vec, TRUNC_LENGTH, STD, **options)
        out, metrics = estimator.estimate(theta, estimator.init_worker_state(theta, key), key)
        return np.asarray(out.grad), float(metrics["abs_delta_loss"])

    plain, abs_delta = first_estimate()
    assert abs_delta > 0.05
    signed, _ = first_estimate(sign_delta_loss_scalar=0.5)
    np.testing.assert_allclose(signed, plain * 0.5 / abs_delta, rtol=1e-4)
    unclipped, _ = first_estimate(clip_loss_diff=10 * abs_delta)
    np.testing.assert_allclose(unclipped, plain, rtol=1e-6)
    clipped, _ = first_estimate(clip_loss_diff=abs_delta / 4)
    np.testing.assert_allclose(clipped, plain / 4, rtol=1e-4)
