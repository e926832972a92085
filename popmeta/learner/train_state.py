"""The learner's state and its jitted optax step: pure, pytrees in and out, no Ray, no I/O.

:func:`build_apply_estimates_fn` is the learner's step: it averages, checks
and applies a round of gradient estimates (one or many, as they come out of
the object store) in one XLA program. It can donate the incoming state's
buffers and take shardings for the state, so XLA keeps theta and the
optimizer state laid out as requested across steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from popmeta.registry import OUTER_OPTIMIZERS

__all__ = ["TrainState", "build_apply_estimates_fn", "make_outer_optimizer"]

PyTree = Any
Metrics = dict[str, jax.Array]
ApplyEstimatesFn = Callable[..., tuple["TrainState", Metrics, jax.Array]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything the learner needs to take the next optimizer step.

    A pytree: ``step``, ``root_rng``, ``params`` and ``opt_state`` are data
    (traced under ``jax.jit``, donated, sharded);
    ``tx`` is static metadata, so it is part of the treedef and the jit cache
    key rather than an argument.

    Attributes:
      step: int32 scalar array, the number of updates applied so far.
      root_rng: PRNG key (typed ``jax.random.key`` or raw uint32). Step ``t``
        uses ``jax.random.fold_in(root_rng, t)``, so randomness is a pure
        function of (root_rng, step) and survives checkpoint/resume exactly.
      params: the parameters being trained (theta for meta-training).
      opt_state: the optax state of ``tx`` for ``params``.
      tx: the optax gradient transformation (static).
    """

    step: jax.Array
    root_rng: jax.Array
    params: PyTree
    opt_state: optax.OptState
    tx: optax.GradientTransformation = dataclasses.field(metadata={"static": True})

    @classmethod
    def initial_state(
        cls,
        params: PyTree,
        tx: optax.GradientTransformation,
        rng: jax.Array,
    ) -> TrainState:
        """Builds the state at step 0 with ``opt_state = tx.init(params)``.

        Args:
          params: initial parameters.
          tx: optax transformation used for every step.
          rng: root PRNG key of the run.

        Returns:
          A new ``TrainState``. Note that ``params`` is stored as given: if a
          step later donates the state, the caller's arrays are donated too.
        """
        return cls(
            step=jnp.zeros((), jnp.int32),
            root_rng=rng,
            params=params,
            opt_state=tx.init(params),
            tx=tx,
        )

    def replace(self, **changes: Any) -> TrainState:
        """Returns a copy with the given fields replaced."""
        return dataclasses.replace(self, **changes)

    def step_rng(self) -> jax.Array:
        """The PRNG key for the current step: ``fold_in(root_rng, step)``."""
        return jax.random.fold_in(self.root_rng, self.step)

    def apply_gradients(self, grads: PyTree) -> TrainState:
        """Applies one optimizer update with ``grads`` (an estimate) and increments ``step``."""
        return _apply_updates(self, grads)[0]


def _apply_updates(state: TrainState, grads: PyTree) -> tuple[TrainState, PyTree]:
    """One optax update; also returns the updates so callers can log their norm."""
    updates, new_opt_state = state.tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    new_state = state.replace(step=state.step + 1, params=new_params, opt_state=new_opt_state)
    return new_state, updates


def _norm_metrics(grads: PyTree, updates: PyTree, new_params: PyTree) -> Metrics:
    return {
        "grad_norm": optax.tree.norm(grads),
        "update_norm": optax.tree.norm(updates),
        "param_norm": optax.tree.norm(new_params),
    }


def _params_shardings(
    train_state_shardings: TrainState | jax.sharding.Sharding,
) -> PyTree | jax.sharding.Sharding:
    """The shardings of ``params`` within a state's shardings (a gradient is laid out alike)."""
    if isinstance(train_state_shardings, TrainState):
        return train_state_shardings.params
    return train_state_shardings


def _maybe_jit(
    fn: Callable[..., Any],
    *,
    jit: bool,
    donate: bool,
    in_shardings: tuple[Any, Any] | None,
    out_shardings: tuple[Any, Any] | None,
) -> Callable[..., Any]:
    if not jit:
        return fn
    kwargs: dict[str, Any] = {}
    if donate:
        # Only the state (argument 0) is donated: it is dead after the step,
        # while the estimates may still be referenced by the caller.
        kwargs["donate_argnums"] = (0,)
    if in_shardings is not None:
        kwargs["in_shardings"] = in_shardings
    if out_shardings is not None:
        kwargs["out_shardings"] = out_shardings
    return jax.jit(fn, **kwargs)


def _weighted_sum(grads: Sequence[PyTree], weights: jax.Array | None) -> PyTree:
    """``sum_i weights[i] * grads[i]``, added in list order; the mean when ``weights`` is None."""
    if weights is None:
        weights = jnp.full(len(grads), 1.0 / len(grads), jnp.float32)

    def leaf_sum(*leaves: jax.Array) -> jax.Array:
        total = weights[0] * leaves[0]
        for weight, leaf in zip(weights[1:], leaves[1:], strict=True):
            total = total + weight * leaf
        return total

    return jax.tree.map(leaf_sum, *grads)


def _applied_or_unchanged(
    applied: jax.Array, candidate: TrainState, state: TrainState
) -> TrainState:
    """``candidate`` where ``applied``, else ``state`` (its step, params and optimizer state)."""

    def pick(new: PyTree, old: PyTree) -> PyTree:
        return jax.tree.map(lambda n, o: jnp.where(applied, n, o), new, old)

    return state.replace(
        step=pick(candidate.step, state.step),
        params=pick(candidate.params, state.params),
        opt_state=pick(candidate.opt_state, state.opt_state),
    )


def _jit_per_estimate_count(
    step: ApplyEstimatesFn, donate: bool, train_state_shardings: TrainState | jax.sharding.Sharding
) -> ApplyEstimatesFn:
    """``step`` jitted with shardings, once for each number of estimates.

    jit's ``in_shardings`` follow the arguments' structure, which includes
    the number of estimates; every estimate is laid out like ``params``.
    """
    grad_shardings = _params_shardings(train_state_shardings)
    steps_by_count: dict[int, Callable[..., Any]] = {}

    def sharded_step(
        state: TrainState, grads: Sequence[PyTree], weights: Any = None
    ) -> tuple[TrainState, Metrics, jax.Array]:
        grads = tuple(grads)
        if len(grads) not in steps_by_count:
            steps_by_count[len(grads)] = _maybe_jit(
                step,
                jit=True,
                donate=donate,
                in_shardings=(train_state_shardings, (grad_shardings,) * len(grads), None),
                out_shardings=(train_state_shardings, None, None),
            )
        return steps_by_count[len(grads)](state, grads, weights)

    return sharded_step


def build_apply_estimates_fn(
    jit: bool = True,
    donate_params_and_state: bool = False,
    train_state_shardings: TrainState | jax.sharding.Sharding | None = None,
) -> ApplyEstimatesFn:
    """Builds ``step(train_state, grads, weights=None) -> (new_train_state, metrics, applied)``.

    The learner's update for one round of estimates, in one XLA program: the
    weighted sum ``sum_i weights[i] * grads[i]`` (in list order), a check that
    its global norm is finite, and the optax update with that sum as the
    gradient. ``applied`` is False when the norm is not finite, i.e. when any
    element of the sum is not (a NaN or an infinity in any estimate of
    positive weight leaves one there), or when its squares overflow float32
    (a gradient no optimizer can use either). The returned state then equals
    the one passed in (its ``step`` too), so such a round never reaches theta,
    and the caller can find the estimate at fault and call again without it.

    ``grads`` may be the host numpy arrays that ``ray.get`` returns: a jitted
    call reads aligned host arrays where they lie on CPU (no copy), and the
    sum is never written out on its own. The program is compiled once per
    number of estimates; ``weights`` (a float vector, e.g. normalised to sum
    to 1; None: the plain mean) is an argument, not a constant. One estimate,
    ``step(state, [grad])``, is one optax step with ``grad``.

    Args:
      jit: whether to wrap the step in ``jax.jit`` (False: the raw function,
        to embed in a larger jitted program).
      donate_params_and_state: donate the incoming ``TrainState``; the passed
        state must not be used after the call, nor any array that shares its
        buffers (``TrainState.initial_state`` does not copy). Estimates are
        never donated.
      train_state_shardings: a ``TrainState``-shaped pytree of shardings, or
        one sharding for every leaf, for the state in and out; every estimate
        is given the shardings of ``params``.

    Returns:
      The step function. Metrics: ``grad_norm`` of the weighted sum (before
      any clipping in ``tx``), ``update_norm`` and ``param_norm`` of the
      update it would make (not finite when ``applied`` is False).
    """

    def step(
        state: TrainState, grads: Sequence[PyTree], weights: jax.Array | None = None
    ) -> tuple[TrainState, Metrics, jax.Array]:
        grad = _weighted_sum(grads, weights)
        candidate, updates = _apply_updates(state, grad)
        metrics = _norm_metrics(grad, updates, candidate.params)
        # The norm the metrics (and clipping) compute anyway is finite only if
        # every element of the sum is; a separate check would read it again.
        applied = jnp.isfinite(metrics["grad_norm"])
        return _applied_or_unchanged(applied, candidate, state), metrics, applied

    if train_state_shardings is None or not jit:
        return _maybe_jit(
            step,
            jit=jit,
            donate=donate_params_and_state,
            in_shardings=None,
            out_shardings=None,
        )
    return _jit_per_estimate_count(step, donate_params_and_state, train_state_shardings)


def make_outer_optimizer(
    transforms: str | Sequence[optax.GradientTransformation],
    clip_grad_norm: float | None = 3.0,
    **fields: Any,
) -> optax.GradientTransformation:
    """Builds the meta (outer) optimizer as one flat optax chain.

    The chain is ``clip_by_global_norm(clip_grad_norm)`` (omitted when
    ``clip_grad_norm`` is None) followed by the optimizer's transformations,
    so clipping acts on the raw estimate, before any weight decay or moment
    accumulation. One flat chain: a checkpoint keys the optimizer state by
    its place in it.

    Args:
      transforms: the optimizer's transformations, or the name of an outer
        optimizer kind (``"adam"``, ``"adamw"``, ``"sgd"``, ``"sgdm"``) built
        with ``fields``.
      clip_grad_norm: max global norm of the incoming gradient, or None.
      **fields: the kind's fields, e.g. ``learning_rate=0.01``.

    Returns:
      The optax transformation.

    Raises:
      ValueError: for an unknown kind, a field it lacks or out of range, or a
        non-positive clip norm.
    """
    if clip_grad_norm is not None and clip_grad_norm <= 0:
        raise ValueError(f"clip_grad_norm must be > 0 or None, got {clip_grad_norm}")
    if isinstance(transforms, str):
        built = OUTER_OPTIMIZERS.resolve(transforms).call(**fields)
        transforms = built if isinstance(built, list) else [built]
    clip = [] if clip_grad_norm is None else [optax.clip_by_global_norm(clip_grad_norm)]
    return optax.chain(*clip, *transforms)
