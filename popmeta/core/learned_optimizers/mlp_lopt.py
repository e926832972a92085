"""MLPLOpt: a small per-parameter MLP learned optimizer.

Follows ``learned_optimization.learned_optimizers.mlp_lopt.MLPLOpt``: the same
tiny MLP is applied elementwise to every parameter of every tensor, reading
features of that parameter's optimisation history (gradient, parameter,
momentums, second moment, Adam-like ratios, each normalised over its tensor,
and shared time features) and emitting a ``(direction, magnitude)`` pair:

    step = direction * exp(magnitude * magnitude_multiplier) * step_multiplier
    p   <- p - step

Its 19 inputs are not learned_optimization's 19, so a learned_optimization
theta cannot be loaded here. The features in order, and every difference
from learned_optimization's MLPLOpt: docs/learned-optimizers.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from popmeta.core import tree_utils
from popmeta.core.learned_optimizers.base import LearnedOptimizer, MetaParams, OptimizerOfTheta
from popmeta.core.learned_optimizers.features import (
    DEFAULT_DECAYS,
    advanced_fields,
    checked_mlp_dtype,
    num_per_parameter_features,
    per_parameter_mlp,
    per_parameter_mlp_init,
    short_time_features,
    start_fields,
    update_accumulators,
)
from popmeta.core.optimizers import Optimizer

__all__ = ["MLPLOpt", "MLPLOptState"]

Params = Any

DEFAULT_TIMESCALES: tuple[float, ...] = (1, 3, 10, 30, 100, 300, 1000, 3000, 10000)


class MLPLOptState(NamedTuple):
    """State of the optimizer produced by :class:`MLPLOpt`.

    Attributes:
      params: Current parameters.
      momentums: Params-shaped pytree; each leaf has a trailing axis of size
        ``len(decays)`` holding the gradient EMAs.
      rms: Params-shaped pytree of squared-gradient EMAs.
      iteration: Number of updates applied so far (int32 scalar).
    """

    params: Params
    momentums: Params
    rms: Params
    iteration: jax.Array

    replace = tree_utils.replace


class _MLPLOptOptimizer(OptimizerOfTheta):
    _lopt: MLPLOpt

    def init(
        self, params: Params, num_steps: int | jax.Array | None = None, key: jax.Array | None = None
    ) -> MLPLOptState:
        del num_steps, key
        return MLPLOptState(**start_fields(params, len(self._lopt.decays)))

    def step(
        self,
        state: MLPLOptState,
        grad: Params,
        loss: jax.Array | None = None,
        key: jax.Array | None = None,
    ) -> tuple[Params, MLPLOptState]:
        del loss, key
        lopt = self._lopt
        momentums, rms, iteration = update_accumulators(lopt, state, grad)
        time_features = short_time_features(iteration, lopt.timescales)

        directions, magnitudes = per_parameter_mlp(
            self._theta,
            state.params,
            grad,
            momentums,
            rms,
            time_features,
            lopt.epsilon,
            mlp_dtype=lopt.mlp_dtype,
        )

        def tensor_update(p: jax.Array, direction: jax.Array, magnitude: jax.Array) -> jax.Array:
            step = direction * jnp.exp(magnitude * lopt.magnitude_multiplier) * lopt.step_multiplier
            return -step.astype(p.dtype)

        updates = jax.tree.map(tensor_update, state.params, directions, magnitudes)
        return updates, state._replace(**advanced_fields(state, updates, momentums, rms))


class MLPLOpt(LearnedOptimizer):
    """Per-parameter MLP learned optimizer (see the module docstring).

    Theta is ``{"linear_i": {"w": [fan_in, fan_out], "b": [fan_out]}}`` for
    ``hidden_layers`` hidden layers of ``hidden_size`` relu units and a 2-unit
    output layer: 1762 float32 numbers with the defaults.
    """

    def __init__(
        self,
        step_multiplier: float = 0.001,
        magnitude_multiplier: float = 0.001,
        hidden_size: int = 32,
        hidden_layers: int = 2,
        decays: Sequence[float] = DEFAULT_DECAYS,
        rms_decay: float = 0.999,
        timescales: Sequence[float] = DEFAULT_TIMESCALES,
        epsilon: float = 1e-8,
        mlp_dtype: str = "float32",
        output_init_scale: float = 1e-3,
    ):
        """Builds the learned optimizer.

        Args:
          step_multiplier: Scale of every step; with a unit-size direction the
            optimizer moves each parameter by about this much.
          magnitude_multiplier: Scale of the log-magnitude output.
          hidden_size: Width of each hidden layer.
          hidden_layers: Number of hidden layers.
          decays: Momentum EMA decays, one feature (and one Adam-like ratio
            feature) each.
          rms_decay: Decay of the squared-gradient EMA.
          timescales: Iteration timescales of the tanh time features.
          epsilon: Added to the squared-gradient EMA before ``rsqrt``.
          mlp_dtype: what the MLP's layers multiply in: ``float32``, or
            ``bfloat16`` (float32 sums; features, theta and state stay float32).
          output_init_scale: Multiplies the output layer's initial weights so an
            untrained theta is close to "do nothing" and meta-training starts
            from a stable inner run.
        """
        self.step_multiplier = step_multiplier
        self.magnitude_multiplier = magnitude_multiplier
        self.hidden_size = hidden_size
        self.hidden_layers = hidden_layers
        self.decays = tuple(float(d) for d in decays)
        self.rms_decay = float(rms_decay)
        self.timescales = tuple(float(t) for t in timescales)
        self.epsilon = float(epsilon)
        self.mlp_dtype = checked_mlp_dtype(mlp_dtype)
        self.output_init_scale = output_init_scale

    @property
    def num_features(self) -> int:
        """Width of the MLP input (19 with the defaults)."""
        return num_per_parameter_features(len(self.decays)) + len(self.timescales)

    def init(self, key: jax.Array) -> MetaParams:
        return per_parameter_mlp_init(
            key, self.num_features, self.hidden_size, self.hidden_layers, self.output_init_scale
        )

    def opt_fn(self, theta: MetaParams, is_training: bool = False) -> Optimizer:
        del is_training
        return _MLPLOptOptimizer(self, theta)
