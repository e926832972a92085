"""A linear inner system with quadratic loss: the exact oracle for estimator tests.

s_t = A s_{t-1} + B theta + c,  loss_t = 1/2 ||s_t - y||^2, reset to s_0 every
``length`` steps (the step after ``is_done`` reports ``loss=0, mask=False``).
The state is affine in theta, so the loss is quadratic in it and
1/2 [L(theta+eps) - L(theta-eps)] is exactly linear in the perturbation eps.
An antithetic-pair estimate (that difference times the noise behind it, over
2 std^2) is then a quadratic form in Gaussian noise, whose mean and covariance
follow from Isserlis' theorem (:func:`closed_form`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from popmeta import TruncatedStep, TruncatedUnrollOut


class LinearState(NamedTuple):
    s: jax.Array
    iteration: jax.Array
    pending_reset: jax.Array


class LinearQuadraticStep(TruncatedStep):
    """Deterministic given theta: keys are ignored, so every seed sees the same system."""

    def __init__(self, dim_theta=5, dim_state=3, length=5, initial_iteration=0, seed=0):
        rng = np.random.default_rng(seed)
        q, _ = np.linalg.qr(rng.normal(size=(dim_state, dim_state)))
        self.a = jnp.asarray(0.8 * q, jnp.float32)
        self.b = jnp.asarray(
            rng.normal(size=(dim_state, dim_theta)) / np.sqrt(dim_theta), jnp.float32
        )
        self.c = jnp.asarray(rng.normal(size=dim_state), jnp.float32)
        self.y = jnp.asarray(rng.normal(size=dim_state), jnp.float32)
        self.s0 = jnp.asarray(rng.normal(size=dim_state), jnp.float32)
        self.length = length
        self.initial_iteration = initial_iteration
        self.dim_theta = dim_theta

    def init_step_state(self, theta, outer_state, key, theta_is_vector=False):
        return LinearState(
            self.s0, jnp.asarray(self.initial_iteration, jnp.int32), jnp.asarray(False)
        )

    def unroll_step(self, theta, state, key, data, outer_state, theta_is_vector=False):
        s_next = self.a @ state.s + self.b @ theta + self.c
        iteration = state.iteration + 1
        loss = 0.5 * jnp.sum((s_next - self.y) ** 2)
        reset = state.pending_reset
        is_done = jnp.logical_and(~reset, iteration >= self.length)
        new_state = LinearState(
            s=jnp.where(reset, self.s0, s_next),
            iteration=jnp.where(reset, 0, iteration),
            pending_reset=is_done,
        )
        out = TruncatedUnrollOut(
            loss=jnp.where(reset, 0.0, loss),
            is_done=is_done,
            task_param=jnp.zeros(()),
            iteration=new_state.iteration,
            mask=~reset,
        )
        return new_state, out


class WindowOracle(NamedTuple):
    """Exact derivatives of every window's loss, split by trajectory part.

    ``jac[p][j, k]`` is dL_{j,p} / d theta_k (theta_k: the copy used in window k),
    p = 0 for steps of the trajectory running when window j began, 1 for
    trajectories that began inside it. ``start_window[p][j]`` is the window in
    which that part's trajectory began (-1: the initial trajectory).
    """

    jac: np.ndarray  # [2, J, J, d]
    start_window: np.ndarray  # [2, J]

    @property
    def true_grad(self) -> np.ndarray:  # G_j = sum_k dL_j/d theta_k, [J, d]
        return self.jac.sum(axis=(0, 2))


def window_oracle(step: LinearQuadraticStep, theta: jax.Array, num_windows: int, trunc_length: int):
    """Backprop through the unroll with one copy of theta per window."""
    num_steps = num_windows * trunc_length

    def run(thetas):
        state = step.init_step_state(theta, None, None)
        outs = []
        for t in range(num_steps):
            state, out = step.unroll_step(thetas[t // trunc_length], state, None, None, None)
            outs.append(out)
        return outs

    outs = run(jnp.stack([theta] * num_windows))
    is_done = np.array([bool(o.is_done) for o in outs])
    mask = np.array([bool(o.mask) for o in outs], np.float32)

    # Which steps belong to the trajectory running when their window began, and
    # in which window each trajectory began; mirrors the is_done convention.
    in_first = np.zeros(num_steps, bool)
    start_window = np.full((2, num_windows), -1)
    trajectory_start = -1
    for j in range(num_windows):
        starts_with_reset = j > 0 and is_done[j * trunc_length - 1]
        first = not starts_with_reset
        if starts_with_reset:
            trajectory_start = j
        start_window[0, j] = trajectory_start
        for t in range(j * trunc_length, (j + 1) * trunc_length):
            in_first[t] = first
            if is_done[t]:
                first = False
                trajectory_start = j
        start_window[1, j] = j

    def window_losses(thetas):
        losses = jnp.stack([o.loss for o in run(thetas)])
        per_part = []
        for part_mask in (in_first, ~in_first):
            weights = jnp.asarray(mask * part_mask).reshape(num_windows, trunc_length)
            denom = np.maximum(mask.reshape(num_windows, trunc_length).sum(axis=1), 1.0)
            per_part.append(
                (losses.reshape(num_windows, trunc_length) * weights).sum(axis=1) / denom
            )
        return jnp.stack(per_part)  # [2, J]

    jac = jax.jacobian(window_losses)(jnp.stack([theta] * num_windows))  # [2, J, J, d]
    return WindowOracle(np.asarray(jac, np.float64), start_window)


def gaussian_product_moments(parts: list[tuple[np.ndarray, np.ndarray]]):
    """Mean and covariance of sum_p (a_p . z) W_p z for z ~ N(0, I) (Isserlis)."""
    mean = sum(w @ a for a, w in parts)
    cov = 0.0
    for a_p, w_p in parts:
        for a_q, w_q in parts:
            cov = cov + (a_p @ a_q) * (w_p @ w_q.T) + np.outer(w_p @ a_q, w_q @ a_p)
    return mean, cov


def closed_form(oracle: WindowOracle, estimator: str, window: int):
    """Exact mean and covariance of one antithetic-pair estimate for ``window``.

    Noise variables are indexed by window (block k+1 holds window k's draw;
    block 0 holds the noise NRES draws at initialisation).
    """
    num_windows, dim = oracle.jac.shape[1], oracle.jac.shape[-1]
    num_blocks = num_windows + 1

    def block(k):
        w = np.zeros((dim, num_blocks * dim))
        w[:, (k + 1) * dim : (k + 2) * dim] = np.eye(dim)
        return w

    parts = []
    for p in range(2):
        g = oracle.jac[p, window]  # [J, d]
        if not np.any(g):
            continue
        start = oracle.start_window[p, window]
        if estimator == "pes":
            a = np.concatenate([np.zeros(dim)] + [g[k] for k in range(num_windows)])
            w = sum(block(k) for k in range(max(start, 0), window + 1))
        elif estimator == "nres":
            w = block(start)
            a = w.T @ g.sum(axis=0)
        else:
            raise ValueError(estimator)
        parts.append((a, w))
    return gaussian_product_moments(parts)
