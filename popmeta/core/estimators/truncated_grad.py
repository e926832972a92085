"""Truncated backpropagation through the unroll (a biased first-order baseline)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from popmeta.core.estimators.base import GradientEstimator, family_loss_metrics, task_mean
from popmeta.core.estimators.estimator_out import EstimatorOut
from popmeta.core.truncated_step import TruncatedStep

__all__ = ["TruncatedGrad", "TruncatedGradWorkerState"]


class TruncatedGradWorkerState(NamedTuple):
    unroll_state: Any


class TruncatedGrad(GradientEstimator):
    """``jax.grad`` of one truncation's meta-loss, the starting state held fixed.

    Ignores theta's influence on the state the truncation starts from, so it is
    biased whenever that influence matters, and can be unstable over long
    truncations (exploding inner-loop gradients).
    """

    num_members = 1

    def __init__(self, truncated_step: TruncatedStep, trunc_length: int = 10):
        self.truncated_step = truncated_step
        self.trunc_length = int(trunc_length)

    def init_worker_state(self, theta, key, outer_state=None):
        return TruncatedGradWorkerState(
            self.truncated_step.init_step_state(theta, outer_state, key)
        )

    def estimate(self, theta, state, key, data=None, outer_state=None):
        keys = jax.random.split(key, self.trunc_length)

        def truncation_loss(theta):
            def body(unroll_state, xs):
                step_key, step_data = xs
                unroll_state, out = self.truncated_step.unroll_step(
                    theta, unroll_state, step_key, step_data, outer_state
                )
                return unroll_state, (out.loss, out.mask, out.is_done)

            start = jax.lax.stop_gradient(state.unroll_state)
            end, (losses, mask, is_done) = jax.lax.scan(
                body, start, (keys, data), length=self.trunc_length
            )
            mask = mask.astype(jnp.float32)
            count = mask.sum(axis=0)
            per_task_loss = (losses * mask).sum(axis=0) / jnp.maximum(count, 1.0)
            valid = count > 0
            return task_mean(per_task_loss, valid), (end, valid, is_done, per_task_loss)

        (mean_loss, (end, valid, is_done, per_task_loss)), grad = jax.value_and_grad(
            truncation_loss, has_aux=True
        )(theta)
        metrics = {"mean_loss": mean_loss, "num_done": is_done.sum(), "valid_tasks": valid.sum()}
        metrics |= family_loss_metrics(self.truncated_step, per_task_loss, valid)
        return (
            EstimatorOut(grad, mean_loss, valid.sum(), TruncatedGradWorkerState(end)),
            metrics,
        )
