"""``estimator.truncations_per_call: auto``: calls sized by what the population measures.

Every worker call costs its compute plus what the engine adds to any call,
however small: for the Ray engine a round trip through Ray, theta in and the
estimate out, about two milliseconds on an idle 2-core machine. A truncation
of a small problem computes in less than that, so one per call leaves the
workers waiting on Ray. At the start of a run the population times rounds of
throwaway estimates on its own workers (nothing of the run changes), of one
truncation and then of enough to see what one more costs, and the call gets
the fewest truncations that make the per-call cost at most
:data:`OVERHEAD_SHARE` of its compute (so one actor does at least 80% of what
the same worker does in the driver), and at most :data:`MAX_AUTO_CALL_S` of
compute. More truncations per call mean fewer, less noisy learner updates per
inner step (docs/population.md).
"""

from __future__ import annotations

import math
import statistics
from typing import Any, NamedTuple, Protocol

__all__ = [
    "MAX_AUTO_CALL_S",
    "OVERHEAD_SHARE",
    "CallCost",
    "CallSize",
    "RoundCost",
    "size_calls",
    "truncations_for",
]

#: The per-call cost ``auto`` allows, as a share of a call's compute.
OVERHEAD_SHARE = 0.25
#: The longest compute ``auto`` gives one call, in seconds.
MAX_AUTO_CALL_S = 1.0
#: Timed rounds per size, after :data:`WARM_ROUNDS` untimed ones (a first call
#: compiles, allocates and fills caches).
TIMED_ROUNDS = 6
WARM_ROUNDS = 2


class RoundCost(NamedTuple):
    """One timed round of throwaway calls, in seconds.

    Attributes:
      compute_s: a worker's compute (the median of the round's workers).
      overhead_s: the time per call beyond compute: what the engine adds to
        every call, whatever its size.
    """

    compute_s: float
    overhead_s: float


class CallCost(NamedTuple):
    """What a call costs, in seconds: ``call_s + n * truncation_s`` of compute, then ``overhead_s``.

    Attributes:
      truncation_s: the compute of one more truncation.
      call_s: the compute of a call besides its truncations (its dispatch,
        the estimate's copy to the host).
      overhead_s: what the engine adds to every call.
    """

    truncation_s: float
    call_s: float
    overhead_s: float

    def compute_s(self, num_truncations: int) -> float:
        return self.call_s + num_truncations * self.truncation_s


class CallSize(NamedTuple):
    """What ``auto`` chose, and from what.

    Attributes:
      truncations_per_call: the number chosen.
      cost: what was measured; None where the workers could not time a call
        (a truncated step that pulls host batches).
    """

    truncations_per_call: int
    cost: CallCost | None

    def describe(self) -> str:
        """One line for the run's output."""
        n = self.truncations_per_call
        if self.cost is None:
            return (
                f"estimator.truncations_per_call: auto -> {n} (the workers' truncated step "
                "pulls host batches: a timed call would consume them)"
            )
        cost = self.cost
        share = cost.overhead_s / cost.compute_s(n)
        return (
            f"estimator.truncations_per_call: auto -> {n} (a truncation computes in "
            f"{cost.truncation_s * 1e3:.3g} ms, a call costs {cost.overhead_s * 1e3:.3g} ms "
            f"more; {n} make that {share:.0%} of a call's compute). Set it to {n} to make "
            "the same choice in another run"
        )


class TimedPopulation(Protocol):
    """What sizing needs of a population (both engines have it)."""

    def throwaway_round(self, theta: Any, num_truncations: int) -> RoundCost | None: ...


def truncations_for(cost: CallCost) -> int:
    """The fewest truncations whose compute is at least ``overhead_s`` over
    :data:`OVERHEAD_SHARE`, within :data:`MAX_AUTO_CALL_S` of compute (at least 1)."""
    if cost.truncation_s <= 0:
        return 1
    wanted = math.ceil((cost.overhead_s / OVERHEAD_SHARE - cost.call_s) / cost.truncation_s)
    longest = math.floor((MAX_AUTO_CALL_S - cost.call_s) / cost.truncation_s)
    return max(1, min(wanted, longest))


def _timed(population: TimedPopulation, theta: Any, num_truncations: int) -> RoundCost | None:
    """The medians of :data:`TIMED_ROUNDS` rounds after the warm ones; None if any is None."""
    rounds = [
        population.throwaway_round(theta, num_truncations)
        for _ in range(WARM_ROUNDS + TIMED_ROUNDS)
    ]
    if any(r is None for r in rounds):
        return None
    timed = rounds[WARM_ROUNDS:]
    return RoundCost(
        statistics.median(r.compute_s for r in timed),
        statistics.median(r.overhead_s for r in timed),
    )


def size_calls(population: TimedPopulation, theta: Any) -> CallSize:
    """Times throwaway rounds on ``population``'s workers and sizes their calls.

    Rounds of one truncation give the per-call cost; when it calls for more
    than one, rounds of as many as one truncation's whole compute would need
    tell the compute of one more truncation apart from the call's own.

    Args:
      population: the run's population, its workers ready.
      theta: the learner's theta, as the workers receive it.
    """
    one = _timed(population, theta, 1)
    if one is None:
        return CallSize(1, None)
    guess = truncations_for(CallCost(one.compute_s, 0.0, one.overhead_s))
    if guess == 1:
        return CallSize(1, CallCost(one.compute_s, 0.0, one.overhead_s))
    more = _timed(population, theta, guess)
    if more is None:
        return CallSize(1, None)
    truncation_s = max((more.compute_s - one.compute_s) / (guess - 1), 1e-9)
    cost = CallCost(
        truncation_s,
        max(one.compute_s - truncation_s, 0.0),
        max(one.overhead_s, more.overhead_s),
    )
    return CallSize(truncations_for(cost), cost)
