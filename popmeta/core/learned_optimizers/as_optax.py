"""A learned optimizer at a fixed theta as an optax transformation.

The transformation's updates are the optimizer's own (``Optimizer.step``), so
an optax loop that applies them with ``optax.apply_updates`` follows
``lopt.opt_fn(theta)`` bit for bit when the optimizer implements ``step``
(every built-in one does); from ``update`` alone the updates are the change
of the parameters, equal up to rounding. Its state is the optimizer's state
without the parameters, which optax passes to every update. It composes with
``optax.chain`` like any other transformation: a learning-rate schedule
scales its updates (``optax.scale_by_schedule``), and decoupled weight decay
adds ``-weight_decay * params`` to them (``optax.add_decayed_weights`` with a
negative rate, since the updates already point downhill).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from popmeta.core.learned_optimizers.base import LearnedOptimizer, MetaParams

__all__ = ["LearnedOptimizerState", "as_optax"]


class LearnedOptimizerState(NamedTuple):
    """State of :func:`as_optax`'s transformation.

    Attributes:
      inner: the learned optimizer's state with ``params`` left out (None).
    """

    inner: Any


def _with_params(state: Any, params: Any) -> Any:
    return (
        state._replace(params=params)
        if hasattr(state, "_replace")
        else state.replace(params=params)
    )


def as_optax(
    lopt: LearnedOptimizer,
    theta: MetaParams,
    num_steps: int | None = None,
    key: jax.Array | None = None,
) -> optax.GradientTransformationExtraArgs:
    """The optimizer ``lopt.opt_fn(theta)`` as an optax transformation.

    Args:
      lopt: the learned optimizer.
      theta: its meta-parameters (e.g. trained ones).
      num_steps: the planned number of steps of the training run, for
        learned optimizers that read how far through it they are
        (``lopt.needs_num_steps``); required for those.
      key: for learned optimizers whose ``init`` draws random numbers.

    Returns:
      A transformation whose ``update(grads, state, params, value=loss)``
      needs ``params`` (learned optimizers read them) and, for loss-aware
      learned optimizers (``lopt.uses_loss``), the loss as ``value``, as
      optax's loss-aware transformations take it.

    Raises:
      ValueError: ``num_steps`` is missing for an optimizer that needs it.
    """
    if lopt.needs_num_steps and num_steps is None:
        raise ValueError(
            f"{lopt.name} reads how far through its run it is: give num_steps, the number of "
            "steps the training run will take"
        )
    optimizer = lopt.opt_fn(theta)

    def init(params: Any) -> LearnedOptimizerState:
        state = optimizer.init(params, num_steps=num_steps, key=key)
        return LearnedOptimizerState(_with_params(state, None))

    def update(
        updates: Any,
        state: LearnedOptimizerState,
        params: Any = None,
        *,
        value: jax.Array | None = None,
        **extra_args: Any,
    ) -> tuple[Any, LearnedOptimizerState]:
        del extra_args
        if params is None:
            raise ValueError(f"{lopt.name} reads the parameters: call update(grads, state, params)")
        if lopt.uses_loss and value is None:
            raise ValueError(
                f"{lopt.name} reads the loss: call update(grads, state, params, value=loss)"
            )
        inner = _with_params(state.inner, params)
        step, following = optimizer.step(inner, updates, loss=value)
        return step, LearnedOptimizerState(_with_params(following, None))

    return optax.GradientTransformationExtraArgs(init, update)
