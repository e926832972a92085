"""The Optimizer protocol and hand-designed baselines built on optax.

An :class:`Optimizer` is a pure object: ``init`` builds a state, ``update``
returns the next state, ``get_params`` reads the parameters back, and ``step``
returns the next state with the change it made to the parameters (what an
optax transformation of the optimizer returns as its updates). Every state,
learned optimizers included, is a ``NamedTuple`` with at least ``params`` and
``iteration`` (an int32 scalar array: the number of updates applied, which
optimizers with time features read). States also have ``replace(**fields)``,
the spelling of learned_optimization's dataclass states, as well as
NamedTuple's ``_replace``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from popmeta.core import tree_utils

__all__ = [
    "SGD",
    "SGDM",
    "Adam",
    "OptaxOptimizer",
    "OptaxState",
    "Optimizer",
]

Params = Any
OptState = Any


class Optimizer:
    """Protocol of inner optimizers (hand-designed or produced by a learned one).

    Implement ``init`` and either ``step`` or ``update``: each has a default
    made from the other. An optimizer that implements ``step`` has its
    parameters moved by ``optax.apply_updates(params, updates)``, so an optax
    loop that applies the same updates follows it bit for bit; from ``update``
    alone the updates are ``new - old`` parameters, equal up to rounding.
    """

    def init(
        self, params: Params, num_steps: int | jax.Array | None = None, key: jax.Array | None = None
    ) -> OptState:
        """Builds the state for ``params``.

        Args:
          params: Initial parameters (pytree).
          num_steps: Planned length of the inner run, for optimizers that use it.
          key: PRNG key, for stochastic optimizers.
        """
        raise NotImplementedError

    def update(
        self,
        state: OptState,
        grad: Params,
        loss: jax.Array | None = None,
        key: jax.Array | None = None,
    ) -> OptState:
        """Applies one step; returns the new state with ``iteration + 1``.

        Args:
          state: Current state.
          grad: Gradient of the loss w.r.t. ``get_params(state)``.
          loss: Loss at the current parameters, for optimizers that use it.
          key: PRNG key, for stochastic optimizers.
        """
        if type(self).step is Optimizer.step:
            raise NotImplementedError(f"{type(self).__name__} implements neither step nor update")
        return self.step(state, grad, loss, key)[1]

    def step(
        self,
        state: OptState,
        grad: Params,
        loss: jax.Array | None = None,
        key: jax.Array | None = None,
    ) -> tuple[Params, OptState]:
        """One step as ``(updates, next_state)``: ``next_state`` holds ``params + updates``.

        Arguments as for :meth:`update`.
        """
        if type(self).update is Optimizer.update:
            raise NotImplementedError(f"{type(self).__name__} implements neither step nor update")
        following = self.update(state, grad, loss, key)
        updates = jax.tree.map(jnp.subtract, self.get_params(following), self.get_params(state))
        return updates, following

    def get_params(self, state: OptState) -> Params:
        """Returns the parameters held in ``state``."""
        return state.params

    @property
    def name(self) -> str:
        return type(self).__name__


class OptaxState(NamedTuple):
    """State of :class:`OptaxOptimizer`.

    Attributes:
      params: Current parameters.
      optax_state: The wrapped transformation's state.
      iteration: Number of updates applied so far (int32 scalar).
    """

    params: Params
    optax_state: optax.OptState
    iteration: jax.Array

    replace = tree_utils.replace


class OptaxOptimizer(Optimizer):
    """Adapts an ``optax.GradientTransformation`` to :class:`Optimizer`.

    The loss passed to ``update`` is forwarded as optax's ``value`` extra
    argument, so transformations such as ``optax.contrib.reduce_on_plateau``
    work unchanged.
    """

    def __init__(self, opt: optax.GradientTransformation):
        self.opt = optax.with_extra_args_support(opt)

    def init(
        self, params: Params, num_steps: int | jax.Array | None = None, key: jax.Array | None = None
    ) -> OptaxState:
        del num_steps, key
        return OptaxState(
            params=params,
            optax_state=self.opt.init(params),
            iteration=jnp.asarray(0, jnp.int32),
        )

    def step(
        self,
        state: OptaxState,
        grad: Params,
        loss: jax.Array | None = None,
        key: jax.Array | None = None,
    ) -> tuple[Params, OptaxState]:
        del key
        extra = {} if loss is None else {"value": loss}
        updates, optax_state = self.opt.update(grad, state.optax_state, state.params, **extra)
        following = OptaxState(
            params=optax.apply_updates(state.params, updates),
            optax_state=optax_state,
            iteration=state.iteration + 1,
        )
        return updates, following


class SGD(OptaxOptimizer):
    """Plain SGD: ``p -= lr * g``."""

    def __init__(self, learning_rate: float | jax.Array = 0.01):
        self.learning_rate = learning_rate
        super().__init__(optax.sgd(learning_rate))


class SGDM(OptaxOptimizer):
    """SGD with heavy-ball momentum (optax convention: ``m = g + mu * m``; ``p -= lr * m``)."""

    def __init__(self, learning_rate: float | jax.Array = 0.01, momentum: float | jax.Array = 0.9):
        self.learning_rate = learning_rate
        self.momentum = momentum
        super().__init__(optax.sgd(learning_rate, momentum=momentum))


class Adam(OptaxOptimizer):
    """Adam with bias correction (``optax.adam``)."""

    def __init__(
        self,
        learning_rate: float | jax.Array = 1e-3,
        beta1: float | jax.Array = 0.9,
        beta2: float | jax.Array = 0.999,
        epsilon: float | jax.Array = 1e-8,
    ):
        self.learning_rate = learning_rate
        self.beta1 = beta1
        self.beta2 = beta2
        self.epsilon = epsilon
        super().__init__(optax.adam(learning_rate, b1=beta1, b2=beta2, eps=epsilon))
