"""AdamMLPLOpt: Adam, rescaled and corrected per parameter by a learned MLP that knows the horizon.

A per-parameter MLP learned optimizer, like
:class:`~popmeta.core.learned_optimizers.MLPLOpt`, built on Adam's step
rather than from nothing:

    a    = m_hat / (sqrt(v_hat) + epsilon)          (Adam's direction, bias-corrected)
    d, s = MLP(features)                            (per parameter)
    p   <- p - exp(log_lr) * exp(s) * (a + d)

The output layer starts at zero, so an untrained theta *is* Adam, and
meta-training only has to find what beats Adam. Besides MLPLOpt's features
the MLP reads *horizon* features (the fraction of the planned run done), so
a schedule learned at one horizon stretches to another and no input leaves
its training range at a longer one. The features, and why: docs/learned-optimizers.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from popmeta.core import tree_utils
from popmeta.core.learned_optimizers.base import LearnedOptimizer, MetaParams, OptimizerOfTheta
from popmeta.core.learned_optimizers.features import (
    DEFAULT_DECAYS,
    HORIZON_CENTERS,
    SHORT_TIMESCALES,
    adam_and_mlp,
    advanced_fields,
    beta1_index,
    checked_mlp_dtype,
    checked_num_steps,
    num_per_parameter_features,
    num_time_and_horizon_features,
    per_parameter_mlp_init,
    start_fields,
    time_and_horizon_features,
    update_accumulators,
)
from popmeta.core.optimizers import Optimizer

__all__ = ["AdamMLPLOpt", "AdamMLPLOptState"]

Params = Any


class AdamMLPLOptState(NamedTuple):
    """State of the optimizer produced by :class:`AdamMLPLOpt`.

    Attributes:
      params: Current parameters.
      momentums: Params-shaped pytree; each leaf has a trailing axis of size
        ``len(decays)`` holding the gradient EMAs.
      rms: Params-shaped pytree of squared-gradient EMAs.
      iteration: Number of updates applied so far (int32 scalar).
      num_steps: Planned length of the inner run (float32 scalar), the
        denominator of the horizon features.
    """

    params: Params
    momentums: Params
    rms: Params
    iteration: jax.Array
    num_steps: jax.Array

    replace = tree_utils.replace


class _AdamMLPLOptOptimizer(OptimizerOfTheta):
    _lopt: AdamMLPLOpt

    def init(
        self, params: Params, num_steps: int | jax.Array | None = None, key: jax.Array | None = None
    ) -> AdamMLPLOptState:
        del key
        return AdamMLPLOptState(
            **start_fields(params, len(self._lopt.decays)),
            num_steps=checked_num_steps(self._lopt.name, num_steps),
        )

    def step(
        self,
        state: AdamMLPLOptState,
        grad: Params,
        loss: jax.Array | None = None,
        key: jax.Array | None = None,
    ) -> tuple[Params, AdamMLPLOptState]:
        del loss, key
        lopt = self._lopt
        momentums, rms, iteration = update_accumulators(lopt, state, grad)
        shared = lopt.shared_features(iteration, state.num_steps)
        lr = jnp.exp(self._theta["log_lr"])
        directions, corrections, log_scales = adam_and_mlp(
            lopt, self._theta["mlp"], state.params, grad, momentums, rms, iteration, shared
        )

        def tensor_update(
            p: jax.Array, adam_direction: jax.Array, correction: jax.Array, log_scale: jax.Array
        ) -> jax.Array:
            step = lr * jnp.exp(log_scale) * (adam_direction + correction)
            return -step.astype(p.dtype)

        updates = jax.tree.map(tensor_update, state.params, directions, corrections, log_scales)
        return updates, state._replace(**advanced_fields(state, updates, momentums, rms))


class AdamMLPLOpt(LearnedOptimizer):
    """Adam with a learned per-parameter rescaling and correction (see the module docstring).

    Theta is ``{"log_lr": scalar, "mlp": {"linear_i": {"w", "b"}}}``: the
    nominal learning rate and an MLP of ``hidden_layers`` hidden layers of
    ``hidden_size`` relu units whose 2-unit output layer starts at zero.
    """

    needs_num_steps = True

    def __init__(
        self,
        initial_lr: float = 1e-2,
        beta1: float = 0.9,
        hidden_size: int = 32,
        hidden_layers: int = 2,
        decays: Sequence[float] = DEFAULT_DECAYS,
        rms_decay: float = 0.999,
        timescales: Sequence[float] = SHORT_TIMESCALES,
        horizon_centers: Sequence[float] = HORIZON_CENTERS,
        epsilon: float = 1e-8,
        mlp_dtype: str = "float32",
    ):
        """Builds the learned optimizer.

        Args:
          initial_lr: Nominal learning rate of the untrained optimizer (Adam's).
          beta1: Adam's first-moment decay; must be one of ``decays``.
          hidden_size: Width of each hidden layer.
          hidden_layers: Number of hidden layers.
          decays: Momentum EMA decays, one feature (and one ratio feature) each.
          rms_decay: Decay of the squared-gradient EMA (Adam's beta2).
          timescales: Iteration timescales of the short time features.
          horizon_centers: Fractions of the run where a ``tanh`` horizon feature
            switches sign.
          epsilon: Adam's epsilon, also added before ``rsqrt`` in the features.
          mlp_dtype: what the MLP's layers multiply in: ``float32``, or
            ``bfloat16`` (float32 sums; features, theta and state stay float32).
        """
        if not initial_lr > 0:
            raise ValueError(f"initial_lr must be > 0, got {initial_lr!r}")
        self.decays = tuple(float(d) for d in decays)
        self.initial_lr = float(initial_lr)
        self.beta1 = float(beta1)
        self.beta1_index = beta1_index(beta1, self.decays)
        self.hidden_size = hidden_size
        self.hidden_layers = hidden_layers
        self.rms_decay = float(rms_decay)
        self.timescales = tuple(float(t) for t in timescales)
        self.horizon_centers = tuple(float(c) for c in horizon_centers)
        self.epsilon = float(epsilon)
        self.mlp_dtype = checked_mlp_dtype(mlp_dtype)

    @property
    def num_features(self) -> int:
        """Width of the MLP input (18 with the defaults)."""
        shared = num_time_and_horizon_features(len(self.timescales), len(self.horizon_centers))
        return num_per_parameter_features(len(self.decays)) + shared

    def shared_features(self, iteration: jax.Array, num_steps: jax.Array) -> jax.Array:
        """The time and horizon features every parameter reads at ``iteration``."""
        return time_and_horizon_features(
            iteration, num_steps, self.timescales, self.horizon_centers
        )

    def init(self, key: jax.Array) -> MetaParams:
        return {
            "log_lr": jnp.asarray(np.log(self.initial_lr), jnp.float32),
            "mlp": per_parameter_mlp_init(
                key, self.num_features, self.hidden_size, self.hidden_layers, output_init_scale=0.0
            ),
        }

    def opt_fn(self, theta: MetaParams, is_training: bool = False) -> Optimizer:
        del is_training
        return _AdamMLPLOptOptimizer(self, theta)
