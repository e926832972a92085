"""The actor supervisor with a trivial actor (no JAX): tags, deadlines, replacement, close."""

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
    """Answers after sleeping; reports who it is."""

    def __init__(self, rank: int, restart: int):
        self.rank = rank
        self.restart = restart

    def info(self) -> dict[str, Any]:
        return {"rank": self.rank, "restart": self.restart, "pid": os.getpid()}

    def run(self, seconds: float, value: Any) -> tuple[int, int, Any]:
        time.sleep(seconds)
        return self.rank, self.restart, value


def supervisor(**fields: Any) -> ActorSupervisor:
    population = PopulationConfig(
        **{"num_actors": 2, "num_cpus": 0.5, "pin_cpus": False, "call_timeout_s": TIMEOUT_S}
        | fields
    )
    return ActorSupervisor(Sleeper, lambda rank, restart, pin: (rank, restart), population)


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
