"""The local engine's fused rounds: several learner updates in one XLA program.

With ``population.updates_per_call: K`` the local engine compiles up to K
rounds into one ``lax.fori_loop``, the loop written as purejaxrl writes a
whole training loop: in each round every worker's estimate on the current
theta, the choice and weighting of the estimates, and the learner's optax
step. A round computes what an unfused round does: the same keys
(:func:`popmeta.actors.worker.call_key`), estimates, finite-estimate rule
and weights (:func:`popmeta.estimate.aggregate`) and step
(:func:`~popmeta.learner.train_state.build_apply_estimates_fn`); only the
rounding may differ, as XLA fuses across them. What it saves is the host's
part of a round, one dispatch and one transfer per call instead of several
per update, which on a small problem is most of a round's time
(docs/performance.md, "Fused rounds").

The run loop replays each round's record (:meth:`FusedCall.rounds`) into its
summaries and progress line, and asks for no more rounds than the steps to
its next summary, checkpoint or periodic evaluation, so each of them sees
theta and the workers' states exactly at its step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from popmeta.actors.worker import EstimatorWorker, FusionCarry, call_key
from popmeta.core.estimators import (
    EstimateRunner,
    GradientEstimator,
    ShardedRunner,
    estimate_fn,
)
from popmeta.estimate import Estimate, aggregate
from popmeta.learner.learner import Learner, Update
from popmeta.learner.train_state import TrainState, build_apply_estimates_fn
from popmeta.population.base import Gathered

__all__ = ["FusedCall", "FusedRounds", "build_rounds_fn", "placed_rounds_fn"]


class FusedCall(NamedTuple):
    """What one call of the fused program did, as host values.

    Attributes:
      records: per round (the leading axis), each worker's ``loss``,
        ``weight``, ``finite`` and estimator ``metrics`` (``[rounds, workers]``),
        and the learner's ``norms``, ``applied`` and the theta ``version`` the
        round's estimates were computed on (``[rounds]``).
      phases: each worker's task phases after the call (None where the
        estimator has none).
      seconds: the call's wall time, shared equally among its estimates.
    """

    records: dict[str, Any]
    phases: list[np.ndarray | None]
    seconds: float

    def rounds(self) -> Iterator[tuple[Gathered, Update]]:
        """Each round as the unfused loop sees it: the gathered estimates and the learner's update.

        The estimates carry no gradient (it never left the program). An
        estimate with a non-finite loss or gradient is left out and counted,
        as :meth:`Learner.update` leaves it out; ``norms`` is None where the
        round took no step.
        """
        records = self.records
        num_rounds, num_workers = records["loss"].shape
        compute_time = self.seconds / (num_rounds * num_workers)
        for i in range(num_rounds):
            version = int(records["version"][i])
            estimates, finite = [], records["finite"][i]
            for rank in range(num_workers):
                metrics = {
                    name: float(values[i, rank]) for name, values in records["metrics"].items()
                }
                metrics["compute_time_s"] = compute_time
                phases = self.phases[rank] if i == num_rounds - 1 else None
                loss, weight = float(records["loss"][i, rank]), float(records["weight"][i, rank])
                estimates.append(Estimate(None, loss, weight, version, rank, metrics, phases))
            usable = [e for e, ok in zip(estimates, finite, strict=True) if ok]
            agg = aggregate(usable)._replace(num_rejected_nonfinite=int((~finite).sum()))
            norms = None
            if records["applied"][i]:
                norms = {name: float(values[i]) for name, values in records["norms"].items()}
            yield Gathered(estimates, [0] * num_workers, {}), Update(agg, norms)


class FusedRounds:
    """The local engine's workers and the learner's step, compiled as one program of rounds.

    Args:
      workers: the local engine's workers, in rank order.
      learner: the run's learner: each call starts from its state and hands it the state after.
      max_rounds: K, the most rounds one call runs (the length of its records).

    A worker whose tasks are split over the local devices keeps them split:
    the program is compiled with its runner's shardings, theta and the
    learner's state replicated over the same devices.

    Raises:
      ValueError: a worker's truncated step pulls host batches, which needs
        the host between rounds.
    """

    def __init__(self, workers: Sequence[EstimatorWorker], learner: Learner, max_rounds: int):
        for worker in workers:
            if not worker.can_throw_away:
                raise ValueError(
                    f"population.updates_per_call ({max_rounds}) needs the task's data on the "
                    "device, and this task pulls host batches between truncations: set "
                    "population.updates_per_call: 1"
                )
        self.workers, self.learner, self.max_rounds = list(workers), learner, max_rounds
        self._program: Callable[..., Any] | None = None
        # Where the learner's state and the counters go: the mesh of split tasks, or as they are.
        self._replicated: Any = None

    def run(self, num_rounds: int) -> FusedCall:
        """Runs ``num_rounds`` rounds (at most ``max_rounds``) as one call.

        Raises:
          ValueError: ``num_rounds`` is not between 1 and ``max_rounds``.
        """
        if not 1 <= num_rounds <= self.max_rounds:
            raise ValueError(f"num_rounds must be in [1, {self.max_rounds}], got {num_rounds}")
        start = time.perf_counter()
        carries = [worker.hand_over(self.learner.theta) for worker in self.workers]
        states = tuple(carry.state for carry in carries)
        counters = tuple(carry._replace(state=None) for carry in carries)
        if self._program is None:
            self._program, self._replicated = placed_rounds_fn(
                [worker.runner for worker in self.workers],
                [worker.truncations_per_call for worker in self.workers],
                self.max_rounds,
                states,
            )
        train_state = self.learner.state
        if self._replicated is not None:
            train_state, counters = jax.device_put((train_state, counters), self._replicated)
        train_state, states, counters, records = self._program(
            train_state, states, counters, np.int32(num_rounds)
        )
        # Waits for the call. A second Ctrl-C meanwhile leaves the learner at
        # the call's start and the workers without states, as a round stopped
        # half-way leaves them: the checkpoint of that step keeps its own.
        records = jax.device_get(records)
        self.learner.adopt(train_state)
        phases = [
            worker.take_back(counter._replace(state=state))
            for worker, state, counter in zip(self.workers, states, counters, strict=True)
        ]
        records = jax.tree_util.tree_map(lambda r: r[:num_rounds], records)
        return FusedCall(records, phases, time.perf_counter() - start)


def placed_rounds_fn(
    runners: Sequence[EstimateRunner],
    truncations_per_call: Sequence[int],
    max_rounds: int,
    states: tuple[Any, ...],
) -> tuple[Callable[..., Any], Any]:
    """:func:`build_rounds_fn` for the workers' runners, placed where they run.

    Where a runner splits its tasks over devices, the program keeps each
    worker's state as ``states`` lie and replicates everything else over
    that runner's devices.

    Returns:
      ``(program, replicated)``: ``replicated`` is the sharding the learner's
      state and the counters must have (put them there before each call), or
      None where every runner runs on one device.
    """
    estimators = [runner.estimator for runner in runners]
    split = [runner for runner in runners if isinstance(runner, ShardedRunner)]
    if not split:
        return build_rounds_fn(estimators, truncations_per_call, max_rounds), None
    replicated = split[0].replicated
    state_shardings = tuple(
        jax.tree_util.tree_map(lambda leaf: leaf.sharding, state) for state in states
    )
    shardings = (replicated, state_shardings)
    return build_rounds_fn(estimators, truncations_per_call, max_rounds, shardings), replicated


def build_rounds_fn(
    estimators: Sequence[GradientEstimator],
    truncations_per_call: Sequence[int],
    max_rounds: int,
    shardings: tuple[Any, tuple[Any, ...]] | None = None,
) -> Callable[..., tuple[TrainState, tuple[Any, ...], tuple[FusionCarry, ...], dict[str, Any]]]:
    """The fused program: ``(train_state, states, counters, num_rounds) -> (same, records)``.

    Jitted, the workers' states donated; the train state is not, so that a
    call stopped before it returns leaves the learner where it was. ``counters``
    holds each worker's :class:`FusionCarry` without its state (``state=None``);
    ``num_rounds`` (at most ``max_rounds``) is an argument, not a constant, so
    calls of any length up to K share one compiled program. Round ``i``'s
    record is at index ``i`` of every leaf of ``records`` (the rest are zeros).

    Args:
      estimators: each worker's estimator, in rank order.
      truncations_per_call: each worker's truncations per estimate.
      max_rounds: K.
      shardings: ``(replicated, state_shardings)`` where the workers' tasks are
        split over devices: the sharding of everything but the workers'
        states, and each state's (a pytree of shardings per worker); None
        where they run on one device.
    """
    estimate_fns = [
        estimate_fn(estimator, k)
        for estimator, k in zip(estimators, truncations_per_call, strict=True)
    ]
    apply = build_apply_estimates_fn(jit=False)

    def one_round(train_state, states, counters):
        return _round(estimate_fns, apply, train_state, states, counters)

    def rounds(train_state, states, counters, num_rounds):
        carry = (train_state, states, counters)
        record_shapes = jax.eval_shape(lambda c: one_round(*c)[1], carry)
        records = jax.tree_util.tree_map(
            lambda s: jnp.zeros((max_rounds, *s.shape), s.dtype), record_shapes
        )

        def body(i, loop):
            carry, records = loop
            carry, record = one_round(*carry)
            records = jax.tree_util.tree_map(lambda r, x: r.at[i].set(x), records, record)
            return carry, records

        (train_state, states, counters), records = jax.lax.fori_loop(
            0, num_rounds, body, (carry, records)
        )
        return train_state, states, counters, records

    if shardings is None:
        return jax.jit(rounds, donate_argnums=(1,))
    replicated, state_shardings = shardings
    placement = (replicated, state_shardings, replicated, replicated)
    return jax.jit(rounds, in_shardings=placement, out_shardings=placement, donate_argnums=(1,))


def _round(
    estimate_fns: Sequence[Callable[..., Any]],
    apply: Callable[..., Any],
    train_state: TrainState,
    states: tuple[Any, ...],
    counters: tuple[FusionCarry, ...],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """One round: every worker's estimate on theta, then the learner's step with the usable ones."""
    version = train_state.step.astype(jnp.int32)
    outs, metrics, new_states, new_counters = [], [], [], []
    for estimate, state, counter in zip(estimate_fns, states, counters, strict=True):
        key, repeats = call_key(counter.key, version, counter.last_version, counter.repeats)
        out, out_metrics = estimate(train_state.params, state, key)
        outs.append(out)
        metrics.append(out_metrics)
        new_states.append(out.state)
        new_counters.append(counter._replace(last_version=version, repeats=repeats))
    finite = jnp.stack([_is_finite(out) for out in outs])
    weights = jnp.stack([jnp.asarray(out.weight, jnp.float32) for out in outs])
    usable = finite & (weights > 0)
    used = jnp.where(usable, weights, 0.0)
    # No usable estimate: 0 / 0, and the step refuses the non-finite sum, as
    # it refuses one in an unfused round.
    grads = [
        jax.tree_util.tree_map(lambda g, ok=ok: jnp.where(ok, g, jnp.zeros_like(g)), out.grad)
        for out, ok in zip(outs, usable, strict=True)
    ]
    train_state, norms, applied = apply(train_state, grads, used / used.sum())
    record = {
        "loss": jnp.stack([jnp.asarray(out.mean_loss, jnp.float32) for out in outs]),
        "weight": weights,
        "finite": finite,
        "metrics": {
            name: jnp.stack([jnp.asarray(m[name], jnp.float32) for m in metrics])
            for name in metrics[0]
        },
        "norms": norms,
        "applied": applied,
        "version": version,
    }
    return (train_state, tuple(new_states), tuple(new_counters)), record


def _is_finite(out: Any) -> jax.Array:
    """Whether an estimate's loss and every element of its gradient are finite."""
    leaves = [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree_util.tree_leaves(out.grad)]
    return jnp.all(jnp.stack([jnp.isfinite(out.mean_loss), *leaves]))
