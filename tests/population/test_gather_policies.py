"""The sync and async gather policies on real Ray actors that only sleep (no JAX).

Each actor's speed and start time are chosen per rank and restart, so the
tests can make a replacement that starts slowly, or one actor much slower
than the others, and watch what the policies do with them.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import ray

from popmeta.actors.records import ActorInfo
from popmeta.config import PopulationConfig
from popmeta.population.ray_population import AsyncGather, SyncGather
from popmeta.population.supervisor import ActorSupervisor
from tests.population import CALL_TIMEOUT_S, stand_in_info

pytestmark = pytest.mark.timeout(2 * CALL_TIMEOUT_S)


@ray.remote
class Timed:
    """An estimator stand-in: ``compute`` sleeps ``compute_s`` and says who answered."""

    def __init__(self, rank: int, restart: int, compute_s: float, start_s: float):
        time.sleep(start_s)  # a replacement's start: imports, compilation
        self.rank, self.restart, self.compute_s = rank, restart, compute_s

    def info(self) -> ActorInfo:
        return stand_in_info(self.rank, self.restart)

    def compute(self, theta: Any, version: int) -> tuple[int, int, int]:
        del theta
        time.sleep(self.compute_s)
        return self.rank, self.restart, version


def supervisor(compute_s: list[float], replacement_start_s: float = 0.0) -> ActorSupervisor:
    population = PopulationConfig(
        num_actors=len(compute_s),
        num_cpus=0.25,
        pin_cpus=False,
        call_timeout_s=CALL_TIMEOUT_S,
        max_actor_restarts=5,
    )

    def args(rank: int, restart: int, pin: Any) -> tuple[Any, ...]:
        return rank, restart, compute_s[rank], replacement_start_s if restart else 0.0

    return ActorSupervisor(Timed, args, population)


def kill(sup: ActorSupervisor, rank: int) -> None:
    (info,) = [i for i in sup.describe() if i.rank == rank]
    os.kill(info.pid, signal.SIGKILL)


# ---------------------------------------------------------------------- sync


def test_sync_round_completes_without_a_lost_actor_and_its_replacement_joins_once_ready(
    ray_session,
):
    sup = supervisor([0.0, 0.0], replacement_start_s=3.0)
    try:
        policy, theta = SyncGather(sup), ray.put(0)
        first = policy.gather(theta, 0)
        assert first.estimates == [(0, 0, 0), (1, 0, 0)] and first.missing == ()

        kill(sup, 0)
        lost = policy.gather(theta, 1)
        # The round lost rank 0's call with its actor and completed with rank 1.
        assert lost.estimates == [(1, 0, 1)] and lost.missing == (0,)
        assert sup.num_restarts == 1 and sup.num_lost_calls == 1
        assert sup.ranks == [0, 1] and sup.ready_ranks == [1]

        # While the replacement starts, rounds do not wait for it.
        start = time.monotonic()
        starting = policy.gather(theta, 2)
        assert time.monotonic() - start < 2.0
        assert starting.estimates == [(1, 0, 2)] and starting.missing == (0,)

        # Once ready, it is in every round again.
        version, deadline = 3, time.monotonic() + CALL_TIMEOUT_S
        while (gathered := policy.gather(theta, version)).missing:
            assert time.monotonic() < deadline, "the replacement never joined a round"
            version += 1
            time.sleep(0.02)  # rounds of sleeping actors are instant: spare the CPU
        assert gathered.estimates == [(0, 1, version), (1, 0, version)]
        assert sup.num_restarts == 1
    finally:
        sup.close()


def test_sync_round_waits_for_a_replacement_when_no_other_actor_is_left(ray_session):
    sup = supervisor([0.0], replacement_start_s=1.0)
    try:
        policy, theta = SyncGather(sup), ray.put(0)
        policy.gather(theta, 0)
        kill(sup, 0)
        # The only actor is lost: the round ends with its replacement, not empty.
        gathered = policy.gather(theta, 1)
        assert gathered.estimates == [(0, 1, 1)] and gathered.missing == ()
        assert sup.num_restarts == 1
    finally:
        sup.close()


# ---------------------------------------------------------------------- async


def slow_rank_outcome(starvation_guard: bool, replies: int = 12) -> dict[str, Any]:
    """Async updates with two fast actors and one 500x slower, until it replied ``replies`` times.

    The slow actor must stay slower than ``starving_after(3, 2)`` (16) learner
    updates per call on a loaded machine too, where every fast call takes a
    few milliseconds more than its 2 ms: with 0.3 s it did not (11 of 16
    accepted with the cores busy), with 1 s it is 60x slower even at 15 ms
    per fast call.

    Returns:
      The slow rank's replies, how many were accepted (late ones among them)
      and their staleness; its share of all replies (what it contributes) and
      of all accepted estimates (what theta sees of it).
    """
    slow = 2
    sup = supervisor([0.002, 0.002, 1.0])
    policy = AsyncGather(
        sup,
        batch_size=2,
        max_staleness=1,
        calls_in_flight=2,
        starvation_guard=starvation_guard,
    )
    theta = ray.put(0)
    accepted = dropped = late = total_accepted = total_dropped = 0
    staleness: list[int] = []
    version, deadline = 0, time.monotonic() + 60.0
    try:
        while accepted + dropped < replies:
            assert time.monotonic() < deadline, (accepted, dropped)
            gathered = policy.gather(theta, version)
            total_accepted += len(gathered.estimates)
            total_dropped += sum(gathered.dropped_stale.values())
            pairs = zip(gathered.estimates, gathered.staleness, strict=True)
            mine = [s for estimate, s in pairs if estimate[0] == slow]
            accepted += len(mine)
            staleness += mine
            dropped += gathered.dropped_stale.get(slow, 0)
            late += gathered.accepted_late.get(slow, 0)
            version += 1
    finally:
        sup.close()
    return {
        "replies": accepted + dropped,
        "accepted": accepted,
        "late": late,
        "staleness": staleness,
        "share_of_replies": (accepted + dropped) / (total_accepted + total_dropped),
        "share_of_accepted": accepted / total_accepted,
    }


def test_async_slow_actor_is_starved_without_the_guard_and_served_with_it(ray_session):
    starved = slow_rank_outcome(starvation_guard=False)
    guarded = slow_rank_outcome(starvation_guard=True)
    # Without the guard every estimate of the slow actor is too stale: its
    # tasks never reach theta (a tolerance of one for a machine that stalls
    # the fast actors for longer than a slow call).
    assert starved["accepted"] <= 1, starved
    assert starved["share_of_accepted"] < 0.2 * starved["share_of_replies"], starved
    # With it, the slow actor (slower than starving_after(3, 2) = 16 updates per
    # estimate) has its estimates used as it delivers them, each counted as
    # late and reported with its real staleness; theta sees it at least at
    # the share it contributes (the fast actors' drops go to nobody).
    assert guarded["accepted"] >= guarded["replies"] - 2, guarded
    assert guarded["late"] >= guarded["accepted"] - 1, guarded
    assert max(guarded["staleness"]) > 1, guarded
    assert guarded["share_of_accepted"] >= 0.8 * guarded["share_of_replies"], guarded
