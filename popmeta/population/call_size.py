"""``estimator.truncations_per_call: auto``: calls sized by what the population measures.

Every worker call costs its compute plus what the engine adds to any call,
however small: for the Ray engine a round trip through Ray, theta in and the
estimate out. A truncation of a small problem computes in less than that, so
one per call leaves the workers waiting on Ray. At the start of a run the
population times rounds of throwaway estimates on its own workers (nothing of
the run changes): one truncation first, then the sizes a linear model of the
rounds timed so far asks for, each size timed before it is chosen. A call gets
the smallest timed size whose per-call cost is at most :data:`OVERHEAD_SHARE`
of its compute (so one actor does at least 80% of what the same worker does
in the driver), never a size that was not timed, and never one whose compute
would pass :data:`MAX_AUTO_CALL_S`. More truncations per call mean fewer, less
noisy learner updates per inner step (docs/population.md).
"""

from __future__ import annotations

import math
import statistics
from typing import Any, NamedTuple, Protocol

__all__ = [
    "MAX_AUTO_CALL_S",
    "MAX_SIZES",
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
#: The most sizes timed; each costs a compile and the rounds above.
MAX_SIZES = 5


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
      cost: the line through the sizes timed; None where the workers could
        not time a call (a truncated step that pulls host batches).
      chosen: the chosen size's own timed round; None with ``cost``.
    """

    truncations_per_call: int
    cost: CallCost | None
    chosen: RoundCost | None = None

    def describe(self) -> str:
        """One line for the run's output."""
        n = self.truncations_per_call
        if self.cost is None or self.chosen is None:
            return (
                f"estimator.truncations_per_call: auto -> {n} (the workers' truncated step "
                "pulls host batches: a timed call would consume them)"
            )
        chosen = self.chosen
        return (
            f"estimator.truncations_per_call: auto -> {n} (a truncation computes in "
            f"{self.cost.truncation_s * 1e3:.3g} ms; a call of {n} computed in "
            f"{chosen.compute_s * 1e3:.3g} ms and cost {chosen.overhead_s * 1e3:.3g} ms more, "
            f"{chosen.overhead_s / chosen.compute_s:.0%} of its compute). Set it to {n} to "
            "make the same choice in another run"
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


def _fits(cost: RoundCost) -> bool:
    return cost.overhead_s <= OVERHEAD_SHARE * cost.compute_s


def _model(timed: dict[int, RoundCost]) -> CallCost:
    """A line through the smallest and the largest timed sizes.

    Where the two computes do not rise with the size (timing noise), a
    truncation is taken to cost the largest size's whole compute over its
    truncations: an upper bound, so the next size comes out smaller, never
    absurdly large.
    """
    small, large = min(timed), max(timed)
    overhead_s = max(cost.overhead_s for cost in timed.values())
    upper = timed[large].compute_s / large
    rise = (
        (timed[large].compute_s - timed[small].compute_s) / (large - small) if large > small else 0
    )
    truncation_s = rise if rise > 0 else upper
    return CallCost(
        truncation_s, max(timed[small].compute_s - small * truncation_s, 0.0), overhead_s
    )


def _next_size(timed: dict[int, RoundCost], model: CallCost) -> int:
    """The size the model asks for, at least twice the largest timed one and at most
    as many as fit :data:`MAX_AUTO_CALL_S` were all of that size's compute per
    truncation; the largest timed size where none is larger."""
    largest = max(timed)
    fitting = math.floor(largest * MAX_AUTO_CALL_S / max(timed[largest].compute_s, 1e-9))
    return max(largest, min(max(truncations_for(model), 2 * largest), fitting))


def size_calls(population: TimedPopulation, theta: Any) -> CallSize:
    """Times throwaway rounds on ``population``'s workers and sizes their calls.

    Rounds of one truncation come first; while the largest timed size does not
    fit the rule, the next is the one a line through the timed sizes asks for
    (at most :data:`MAX_SIZES` sizes). The call gets the smallest timed size
    that fits, else the largest timed.

    Args:
      population: the run's population, its workers ready.
      theta: the learner's theta, as the workers receive it.
    """
    timed: dict[int, RoundCost] = {}
    size = 1
    while size not in timed and len(timed) < MAX_SIZES:
        cost = _timed(population, theta, size)
        if cost is None:
            break
        timed[size] = cost
        if _fits(cost):
            break
        size = _next_size(timed, _model(timed))
    if not timed:
        return CallSize(1, None)
    fitting = [n for n, cost in timed.items() if _fits(cost)]
    chosen = min(fitting) if fitting else max(timed)
    return CallSize(chosen, _model(timed), timed[chosen])
