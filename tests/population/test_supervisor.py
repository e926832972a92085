"""The actor supervisor with a trivial actor (no JAX): tags, readiness, deadlines, replacement,
close."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import ray

from popmeta.config import PopulationConfig
from popmeta.population.supervisor import ActorSupervisor, Reply

pytestmark = pytest.mark.timeout(120)

#: Long enough for a bare actor process to start on a busy machine.
TIMEOUT_S = 8.0


@ray.remote
class Sleeper:
    """Answers after sleeping; reports who it is. Its start takes ``start_s``, or fails."""

    def __init__(self, rank: int, restart: int, start_s: float = 0.0, fail: bool = False):
        time.sleep(start_s)
        if fail:
            raise ValueError(f"actor {rank} restart {restart} cannot start")
        self.rank = rank
        self.restart = restart

    def info(self) -> dict[str, Any]:
        return {"rank": self.rank, "restart": self.restart, "pid": os.getpid()}

    def run(self, seconds: float, value: Any) -> tuple[int, int, Any]:
        time.sleep(seconds)
        return self.rank, self.restart, value


def supervisor(
    starts: dict[int, tuple[float, bool]] | None = None,
    compiled_method: str | None = None,
    **fields: Any,
) -> ActorSupervisor:
    """Sleepers; ``starts`` maps a restart number to (start seconds, fails) for its actors."""
    population = PopulationConfig(
        **{"num_actors": 2, "num_cpus": 0.5, "pin_cpus": False, "call_timeout_s": TIMEOUT_S}
        | fields
    )
    starts = starts or {}

    def args(rank: int, restart: int, pin: Any) -> tuple[Any, ...]:
        return rank, restart, *starts.get(restart, (0.0, False))

    return ActorSupervisor(Sleeper, args, population, compiled_method)


def test_replies_carry_their_tags_in_completion_order(ray_session):
    sup = supervisor()
    try:
        assert sup.ranks == [0, 1] and sup.num_restarts == 0
        assert [(i["rank"], i["restart"]) for i in sup.describe()] == [(0, 0), (1, 0)]
        sup.submit(0, "slow", "run", 1.0, "a")
        sup.submit(1, "fast", "run", 0.0, "b")
        assert (sup.in_flight(0), sup.in_flight(1)) == (1, 1)
        assert sup.next_reply() == Reply(1, "fast", (1, 0, "b"))
        assert sup.next_reply() == Reply(0, "slow", (0, 0, "a"))
        assert (sup.in_flight(0), sup.in_flight(1)) == (0, 0)
        assert sup.next_reply() is None  # nothing in flight
    finally:
        sup.close()


def test_an_actor_past_its_deadline_is_replaced_and_its_calls_are_lost(ray_session):
    sup = supervisor(num_actors=1, max_actor_restarts=1)
    try:
        sup.submit(0, "stuck", "run", 10 * TIMEOUT_S, None)
        start = time.monotonic()
        assert sup.next_reply() is None
        assert TIMEOUT_S <= time.monotonic() - start < 3 * TIMEOUT_S
        assert sup.num_restarts == 1 and sup.ranks == [0] and sup.in_flight(0) == 0
        assert [(i["rank"], i["restart"]) for i in sup.describe()] == [(0, 1)]
        # The replacement works; the stuck call never comes back.
        sup.submit(0, "fresh", "run", 0.0, "c")
        assert sup.next_reply() == Reply(0, "fresh", (0, 1, "c"))
        assert sup.next_reply() is None
    finally:
        sup.close()


def test_compiled_calls_reach_the_members_and_a_silent_round_replaces_them(ray_session):
    sup = supervisor(compiled_method="run", max_actor_restarts=2)
    try:
        assert sup.call_compiled([0, 1], 0.0, "a") == {0: (0, 0, "a"), 1: (1, 0, "a")}
        # Other members: the graph is built anew for them.
        assert sup.call_compiled([1], 0.0, "b") == {1: (1, 0, "b")}
        start = time.monotonic()
        assert sup.call_compiled([0, 1], 10 * TIMEOUT_S, "stuck") == {}
        assert TIMEOUT_S <= time.monotonic() - start < 3 * TIMEOUT_S
        # The graph cannot say who hung: every silent member is lost and replaced.
        assert (sup.num_restarts, sup.num_lost_calls) == (2, 2)
        deadline = time.monotonic() + 3 * TIMEOUT_S
        while sup.ready_ranks != [0, 1]:
            assert time.monotonic() < deadline, "the replacements never became ready"
            sup.check_starting()
            time.sleep(0.05)
        assert sup.call_compiled([0, 1], 0.0, "c") == {0: (0, 1, "c"), 1: (1, 1, "c")}
    finally:
        sup.close()


def test_a_loss_beyond_max_actor_restarts_raises(ray_session):
    sup = supervisor(num_actors=1, max_actor_restarts=0)
    try:
        os.kill(sup.describe()[0]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 3 * TIMEOUT_S
        with pytest.raises(RuntimeError, match="max_actor_restarts=0: giving up"):
            while time.monotonic() < deadline:
                # Resubmitted as a caller does after a call that brought nothing.
                if sup.in_flight(0) == 0:
                    sup.submit(0, "doomed", "run", 0.0, None)
                assert sup.next_reply() is None
    finally:
        sup.close()


def test_a_replacement_is_ready_once_it_has_started_and_only_then(ray_session):
    # Restart 1 fails in its constructor, restart 2 takes 2 s to start.
    sup = supervisor({1: (0.0, True), 2: (2.0, False)}, max_actor_restarts=3)
    try:
        assert sup.ready_ranks == [0, 1]
        sup.submit(0, "x", "run", 0.0, None)
        os.kill(sup.describe()[0]["pid"], signal.SIGKILL)
        # The call is lost with its actor; the failed start is replaced too.
        deadline = time.monotonic() + 3 * TIMEOUT_S
        while sup.num_restarts < 2:
            assert time.monotonic() < deadline
            assert sup.next_reply() is None
        assert sup.num_lost_calls == 1
        assert sup.ranks == [0, 1] and sup.ready_ranks == [1]
        # Nothing is in flight: next_reply waits for the starting actor, and
        # returns None when it is ready.
        start = time.monotonic()
        while sup.ready_ranks != [0, 1]:
            assert time.monotonic() - start < 3 * TIMEOUT_S
            assert sup.next_reply() is None
        assert time.monotonic() - start > 0.5
        assert [(i["rank"], i["restart"]) for i in sup.describe()] == [(0, 2), (1, 0)]
        sup.submit(0, "y", "run", 0.0, "z")
        assert sup.next_reply() == Reply(0, "y", (0, 2, "z"))
        assert sup.num_restarts == 2 and sup.num_lost_calls == 1
    finally:
        sup.close()


def test_close_kills_the_actors_and_leaves_ray_running(ray_session):
    sup = supervisor()
    pids = [i["pid"] for i in sup.describe()]
    sup.close()
    sup.close()  # idempotent
    assert ray.is_initialized()
    deadline = time.monotonic() + TIMEOUT_S
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        for pid in list(alive):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                alive.discard(pid)
        time.sleep(0.1)
    assert not alive, f"actor processes {alive} outlived close()"
