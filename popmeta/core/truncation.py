"""Truncation schedules: how long each inner trajectory runs before it resets.

A schedule's state carries the trajectory ``length``; ``next_state`` reports
``is_done = step >= length`` and, for schedules with random lengths, draws the
next trajectory's length once the current one is done. Everything is pure and
jittable so that the schedule can run inside the unroll's ``lax.scan``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from popmeta.core import tree_utils

__all__ = [
    "ConstantTruncationSchedule",
    "LogUniformLengthSchedule",
    "NeverEndingTruncationSchedule",
    "TruncationSchedule",
    "TruncationState",
]


class TruncationState(NamedTuple):
    """Length of the trajectory currently running (int32 scalar)."""

    length: jax.Array

    replace = tree_utils.replace


class TruncationSchedule:
    """Decides when an inner trajectory ends."""

    def init(self, key: jax.Array, outer_state: Any = None) -> TruncationState:
        raise NotImplementedError

    def next_state(
        self,
        state: TruncationState,
        step: jax.Array,
        key: jax.Array,
        outer_state: Any = None,
    ) -> tuple[TruncationState, jax.Array]:
        """Returns the state for the next step and whether ``step`` ends the trajectory."""
        raise NotImplementedError


class ConstantTruncationSchedule(TruncationSchedule):
    """Every trajectory runs exactly ``total_length`` inner steps."""

    def __init__(self, total_length: int):
        if total_length < 1:
            raise ValueError(f"total_length must be >= 1, got {total_length}")
        self.total_length = int(total_length)
        self.max_length = self.total_length

    def init(self, key, outer_state=None):
        del key, outer_state
        return TruncationState(length=jnp.asarray(self.total_length, jnp.int32))

    def next_state(self, state, step, key, outer_state=None):
        del key, outer_state
        return state, step >= state.length


class LogUniformLengthSchedule(TruncationSchedule):
    """Lengths drawn log-uniformly from ``[min_length, max_length]``, redrawn when done."""

    def __init__(self, min_length: int, max_length: int):
        if not 1 <= min_length <= max_length:
            raise ValueError(
                f"need 1 <= min_length <= max_length, got min_length={min_length}, "
                f"max_length={max_length}"
            )
        self.min_length = int(min_length)
        self.max_length = int(max_length)

    def _sample_length(self, key: jax.Array) -> jax.Array:
        log_length = jax.random.uniform(
            key, (), minval=jnp.log(self.min_length), maxval=jnp.log(self.max_length + 1)
        )
        length = jnp.floor(jnp.exp(log_length)).astype(jnp.int32)
        return jnp.clip(length, self.min_length, self.max_length)

    def init(self, key, outer_state=None):
        del outer_state
        return TruncationState(length=self._sample_length(key))

    def next_state(self, state, step, key, outer_state=None):
        del outer_state
        is_done = step >= state.length
        length = jnp.where(is_done, self._sample_length(key), state.length)
        return TruncationState(length=length), is_done


class NeverEndingTruncationSchedule(TruncationSchedule):
    """Trajectories never end (online meta-learning of a single long run)."""

    max_length = None

    def init(self, key, outer_state=None):
        del key, outer_state
        return TruncationState(length=jnp.asarray(jnp.iinfo(jnp.int32).max, jnp.int32))

    def next_state(self, state, step, key, outer_state=None):
        del key, outer_state
        return state, jnp.zeros_like(step, dtype=bool)
