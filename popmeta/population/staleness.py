"""How late an async population's estimates arrive, and when that wastes them.

Pure arithmetic on the population's settings, so that both the population
(when it starts) and ``popmeta validate`` (before anything starts) can tell.
"""

from __future__ import annotations

import math

__all__ = ["arrival_staleness", "staleness_warning"]


def arrival_staleness(num_ranks: int, calls_in_flight: int, batch_size: int) -> float:
    """Learner versions an async estimate's theta is behind when it arrives, in steady state.

    With equal actors, a call submitted at version v waits behind its actor's
    other ``calls_in_flight - 1`` calls, so it finishes ``calls_in_flight``
    estimate-times later, while the ``num_ranks`` actors bring the learner one
    update per ``batch_size`` estimates.
    """
    return calls_in_flight * num_ranks / batch_size


def staleness_warning(
    num_ranks: int, calls_in_flight: int, batch_size: int, max_staleness: int
) -> str | None:
    """Why many async estimates would be dropped as stale, or None when they arrive in time."""
    stale = arrival_staleness(num_ranks, calls_in_flight, batch_size)
    if stale <= max_staleness:
        return None
    remedies = [f"raise max_staleness to {math.ceil(stale)}"]
    if max_staleness > 0:
        enough = math.ceil(calls_in_flight * num_ranks / max_staleness)
        remedies.insert(0, f"raise batch_size to {enough}")
    if calls_in_flight > 1:
        remedies.append("lower calls_in_flight")
    return (
        f"population: async estimates will arrive about {stale:g} learner versions after "
        f"their theta (calls_in_flight {calls_in_flight} x {num_ranks} actors / batch_size "
        f"{batch_size}), beyond max_staleness {max_staleness}: many will be computed and "
        f"dropped as stale (the dropped_stale count). To use them, {' or '.join(remedies)} "
        "(docs/population.md)"
    )
