"""Hand-designed optimizers whose hyperparameters are meta-learned.

Theta is an unconstrained, smooth reparameterisation of the hyperparameters
(``log_lr``, ``logit_one_minus_<decay>``, ``log_epsilon``), so that ES
perturbations and gradient steps can never produce an invalid optimizer. At
its initial theta each optimizer is numerically the corresponding baseline
of :mod:`popmeta.core.optimizers` (``LearnableSGDM(0.1).opt_fn(theta)``
behaves like ``SGDM(0.1, 0.9)``). Why this parameterisation:
docs/learned-optimizers.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from popmeta.core.learned_optimizers.base import LearnedOptimizer, MetaParams
from popmeta.core.optimizers import SGD, SGDM, Adam, Optimizer

__all__ = ["LearnableAdam", "LearnableSGD", "LearnableSGDM"]


# Initial thetas are kept as numpy scalars so that a LearnedOptimizer holds no
# device arrays and pickles cleanly across processes.


def _log(x: float, name: str) -> np.ndarray:
    if not x > 0:
        raise ValueError(f"{name} must be > 0; got {x}.")
    return np.asarray(np.log(x), np.float32)


def _logit_one_minus(decay: float, name: str) -> np.ndarray:
    if not 0 < decay < 1:
        raise ValueError(f"{name} must be in (0, 1); got {decay}.")
    # Computed in float64 on the host so the float32 theta is the closest to exact.
    one_minus = 1.0 - float(decay)
    return np.asarray(np.log(one_minus) - np.log1p(-one_minus), np.float32)


def _decay(theta_entry: jax.Array) -> jax.Array:
    return 1.0 - jax.nn.sigmoid(theta_entry)


class _LearnedHyperparameters(LearnedOptimizer):
    """A baseline whose theta is its reparameterised hyperparameters, starting at ``_initial_theta``."""

    _initial_theta: dict[str, np.ndarray]

    def init(self, key: jax.Array) -> MetaParams:
        del key
        return {k: jnp.asarray(v) for k, v in self._initial_theta.items()}


class LearnableSGD(_LearnedHyperparameters):
    """SGD with a learned learning rate; theta = ``{"log_lr"}``."""

    def __init__(self, initial_lr: float = 1e-3):
        self.initial_lr = initial_lr
        self._initial_theta = {"log_lr": _log(initial_lr, "initial_lr")}

    def opt_fn(self, theta: MetaParams, is_training: bool = False) -> Optimizer:
        del is_training
        return SGD(jnp.exp(theta["log_lr"]))


class LearnableSGDM(_LearnedHyperparameters):
    """SGD with momentum; theta = ``{"log_lr", "logit_one_minus_momentum"}``."""

    def __init__(self, initial_lr: float = 1e-3, initial_momentum: float = 0.9):
        self.initial_lr = initial_lr
        self.initial_momentum = initial_momentum
        self._initial_theta = {
            "log_lr": _log(initial_lr, "initial_lr"),
            "logit_one_minus_momentum": _logit_one_minus(initial_momentum, "initial_momentum"),
        }

    def opt_fn(self, theta: MetaParams, is_training: bool = False) -> Optimizer:
        del is_training
        return SGDM(jnp.exp(theta["log_lr"]), _decay(theta["logit_one_minus_momentum"]))


class LearnableAdam(_LearnedHyperparameters):
    """Adam; theta = ``{"log_lr", "logit_one_minus_beta1", "logit_one_minus_beta2", "log_epsilon"}``."""

    def __init__(
        self,
        initial_lr: float = 1e-3,
        initial_beta1: float = 0.9,
        initial_beta2: float = 0.999,
        initial_epsilon: float = 1e-8,
    ):
        self.initial_lr = initial_lr
        self.initial_beta1 = initial_beta1
        self.initial_beta2 = initial_beta2
        self.initial_epsilon = initial_epsilon
        self._initial_theta = {
            "log_lr": _log(initial_lr, "initial_lr"),
            "logit_one_minus_beta1": _logit_one_minus(initial_beta1, "initial_beta1"),
            "logit_one_minus_beta2": _logit_one_minus(initial_beta2, "initial_beta2"),
            "log_epsilon": _log(initial_epsilon, "initial_epsilon"),
        }

    def opt_fn(self, theta: MetaParams, is_training: bool = False) -> Optimizer:
        del is_training
        return Adam(
            jnp.exp(theta["log_lr"]),
            beta1=_decay(theta["logit_one_minus_beta1"]),
            beta2=_decay(theta["logit_one_minus_beta2"]),
            epsilon=jnp.exp(theta["log_epsilon"]),
        )
