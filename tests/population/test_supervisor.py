"""The actor supervisor with a trivial actor (no JAX): tags, readiness, deadlines, replacement,
start failures, crash loops, close."""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from typing import Any

import pytest
import ray

from popmeta.actors.records import ActorInfo
from popmeta.config import PopulationConfig
from popmeta.population.deadlines import MIN_TIMED_CALLS
from popmeta.population.lifecycle import ActorStartError, PopulationLostError
from popmeta.population.supervisor import ActorSupervisor, Reply
from tests.population import CALL_TIMEOUT_S, stand_in_info

pytestmark = pytest.mark.timeout(2 * CALL_TIMEOUT_S)

#: The deadline of a silent call, set as ``min_call_timeout_s`` with a factor so
#: small that it stands whatever the actors' starts measured. Apart from the
#: start deadline (``call_timeout_s``, :data:`CALL_TIMEOUT_S`): a stand-in
#: actor imports this module, and with it JAX, which on a loaded machine takes
#: longer than a deadline a test may wait for.
TIMEOUT_S = 8.0
#: How long a test waits for a replacement to start.
STARTS_WITHIN_S = CALL_TIMEOUT_S


@ray.remote
class Sleeper:
    """Answers after sleeping; reports who it is. Its start takes ``start_s``, then
    ``outcome`` happens: ``"fail"`` raises, ``"die"`` kills the process (SIGKILL)."""

    def __init__(self, rank: int, restart: int, start_s: float = 0.0, outcome: str = "start"):
        time.sleep(start_s)
        if outcome == "fail":
            raise ValueError(f"actor {rank} restart {restart} cannot start")
        if outcome == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        self.rank = rank
        self.restart = restart

    def info(self) -> ActorInfo:
        return stand_in_info(self.rank, self.restart)

    def run(self, seconds: float, value: Any) -> tuple[int, int, Any]:
        time.sleep(seconds)
        return self.rank, self.restart, value


def supervisor(
    starts: dict[int, tuple[float, str]] | None = None,
    compiled_method: str | None = None,
    ranks: set[int] | None = None,
    **fields: Any,
) -> ActorSupervisor:
    """Sleepers; ``starts`` maps a restart number to (start seconds, outcome) for the
    actors of ``ranks`` (default: every rank)."""
    population = PopulationConfig(
        **{
            "num_actors": 2,
            "num_cpus": 0.5,
            "pin_cpus": False,
            "call_timeout_s": CALL_TIMEOUT_S,
            "min_call_timeout_s": TIMEOUT_S,
            "call_timeout_factor": 0.01,
        }
        | fields
    )
    starts = starts or {}

    def args(rank: int, restart: int, pin: Any) -> tuple[Any, ...]:
        if ranks is not None and rank not in ranks:
            return rank, restart
        return rank, restart, *starts.get(restart, (0.0, "start"))

    return ActorSupervisor(Sleeper, args, population, compiled_method)


def test_replies_carry_their_tags_in_completion_order(ray_session):
    sup = supervisor()
    try:
        assert sup.ranks == [0, 1] and sup.num_restarts == 0
        assert [(i.rank, i.restart) for i in sup.describe()] == [(0, 0), (1, 0)]
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
        assert [(i.rank, i.restart) for i in sup.describe()] == [(0, 1)]
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
        deadline = time.monotonic() + STARTS_WITHIN_S
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
        os.kill(sup.describe()[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + STARTS_WITHIN_S
        with pytest.raises(PopulationLostError, match="max_actor_restarts=0: giving up"):
            while time.monotonic() < deadline:
                # Resubmitted as a caller does after a call that brought nothing.
                if sup.in_flight(0) == 0:
                    sup.submit(0, "doomed", "run", 0.0, None)
                assert sup.next_reply() is None
    finally:
        sup.close()


def test_a_replacement_is_ready_once_it_has_started_and_only_then(ray_session):
    # Restart 1 dies in its constructor, restart 2 takes 2 s to start.
    sup = supervisor({1: (0.0, "die"), 2: (2.0, "start")}, max_actor_restarts=3)
    try:
        assert sup.ready_ranks == [0, 1]
        # A call that cannot reply before the kill (one of 0 s sometimes did: a stale reply).
        sup.submit(0, "x", "run", 60.0, None)
        os.kill(sup.describe()[0].pid, signal.SIGKILL)
        # The call is lost with its actor; the replacement that died starting is replaced too.
        deadline = time.monotonic() + STARTS_WITHIN_S
        while sup.num_restarts < 2:
            assert time.monotonic() < deadline
            assert sup.next_reply() is None
        assert sup.num_lost_calls == 1
        assert sup.ranks == [0, 1] and sup.ready_ranks == [1]
        # Nothing is in flight: next_reply waits for the starting actor, and
        # returns None when it is ready.
        start = time.monotonic()
        while sup.ready_ranks != [0, 1]:
            assert time.monotonic() - start < STARTS_WITHIN_S
            assert sup.next_reply() is None
        assert time.monotonic() - start > 0.5
        assert [(i.rank, i.restart) for i in sup.describe()] == [(0, 2), (1, 0)]
        sup.submit(0, "y", "run", 0.0, "z")
        assert sup.next_reply() == Reply(0, "y", (0, 2, "z"))
        assert sup.num_restarts == 2 and sup.num_lost_calls == 1
    finally:
        sup.close()


def test_close_kills_the_actors_and_leaves_ray_running(ray_session):
    sup = supervisor()
    pids = [i.pid for i in sup.describe()]
    sup.close()
    sup.close()  # idempotent
    assert ray.is_initialized()
    deadline = time.monotonic() + 3 * TIMEOUT_S
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        for pid in list(alive):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                alive.discard(pid)
        time.sleep(0.1)
    assert not alive, f"actor processes {alive} outlived close()"


def test_an_actor_killed_while_starting_is_replaced_and_counted(ray_session):
    # Rank 1's first actor dies in its constructor, as on a node lost while it compiles.
    sup = supervisor({0: (0.0, "die")}, ranks={1}, max_actor_restarts=1)
    try:
        assert sup.ready_ranks == [0, 1]
        assert [(i.rank, i.restart) for i in sup.describe()] == [(0, 0), (1, 1)]
        assert sup.num_restarts == 1
        sup.submit(1, "after", "run", 0.0, "ok")
        assert sup.next_reply() == Reply(1, "after", (1, 1, "ok"))
    finally:
        sup.close()


def test_a_constructor_that_raises_stops_at_once_naming_the_actor_and_the_cause(ray_session):
    with pytest.raises(ActorStartError) as info:
        supervisor({0: (0.0, "fail")}, ranks={1}, max_actor_restarts=5)
    err = info.value
    assert (err.rank, err.restart) == (1, 0)
    assert err.cause == "ValueError: actor 1 restart 0 cannot start"
    assert "raise ValueError" in err.details and "\x1b[" not in err.details
    # A replacement whose constructor raises stops the run too: no retry loop.
    sup = supervisor({1: (0.0, "fail")}, max_actor_restarts=5)
    try:
        os.kill(sup.describe()[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + STARTS_WITHIN_S
        with pytest.raises(ActorStartError, match=r"actor 0 \(restart 1\) could not start"):
            while time.monotonic() < deadline:
                if 0 in sup.ready_ranks and sup.in_flight(0) == 0:
                    sup.submit(0, "probe", "run", 0.0, None)  # finds the dead actor
                sup.next_reply()
        assert sup.num_restarts == 1
    finally:
        sup.close()


def test_a_rank_that_keeps_dying_while_starting_is_a_crash_loop(ray_session):
    # Every actor of rank 0 dies in its constructor.
    starts = {restart: (0.0, "die") for restart in range(5)}
    with pytest.raises(PopulationLostError, match=r"replaced 2 time\(s\) in a row"):
        supervisor(starts, ranks={0}, max_actor_restarts=2)


def test_losses_with_replies_in_between_never_add_up_to_a_crash_loop(ray_session):
    sup = supervisor(num_actors=1, max_actor_restarts=1)
    try:
        for restart in range(3):
            os.kill(sup.describe()[0].pid, signal.SIGKILL)
            deadline = time.monotonic() + STARTS_WITHIN_S
            reply = None
            while reply is None:
                assert time.monotonic() < deadline
                if sup.ready_ranks and sup.in_flight(0) == 0:
                    sup.submit(0, restart, "run", 0.0, None)
                reply = sup.next_reply()
            assert reply.value[1] == restart + 1  # the replacement answered
        assert sup.num_restarts == 3
    finally:
        sup.close()


def test_a_stopped_actor_is_warned_about_and_replaced_after_its_measured_call_time(
    ray_session, caplog
):
    caplog.set_level(logging.WARNING, logger="popmeta")
    # Deadlines from the measured calls: 10 x 0.05 s, at least 1 s, at most CALL_TIMEOUT_S.
    sup = supervisor(min_call_timeout_s=1.0, call_timeout_factor=10.0)
    try:
        # No call timed yet: 10 times the slowest start (spawn to ready) stands in.
        slowest_start = sup.timeout_for() / 10
        assert 0.1 <= slowest_start <= CALL_TIMEOUT_S / 10
        assert sup.timeout_for(actor_is_ready=False) == CALL_TIMEOUT_S
        longest_round = 0.0
        for round_number in range(MIN_TIMED_CALLS):
            started = time.monotonic()
            for rank in (0, 1):
                sup.submit(rank, round_number, "run", 0.05, None)
            assert {sup.next_reply().rank, sup.next_reply().rank} == {0, 1}
            longest_round = max(longest_round, time.monotonic() - started)
        # 1 s on an idle machine (10 x 0.05 s is below the floor); a loaded one
        # measures longer calls, never longer than the rounds the test saw.
        timeout = sup.timeout_for()
        assert 1.0 <= timeout <= max(1.0, 10 * longest_round), (timeout, longest_round)
        stopped = sup.describe()[1].pid
        os.kill(stopped, signal.SIGSTOP)  # a hung node: alive, silent
        try:
            for rank in (0, 1):
                sup.submit(rank, "last", "run", 0.05, None)
            start = time.monotonic()
            assert sup.next_reply().rank == 0
            assert sup.next_reply() is None  # rank 1 was replaced
            waited = time.monotonic() - start
        finally:
            os.kill(stopped, signal.SIGCONT)
        assert 1.0 <= waited < timeout + 10.0, (waited, timeout)
        assert sup.num_restarts == 1 and sup.num_lost_calls == 1
        assert "actor 1 (restart 0, pid" in caplog.text and "has not replied for" in caplog.text
        assert re.search(
            r"no reply within [\d.]+s \(population\.call_timeout_factor=10", caplog.text
        )
    finally:
        sup.close()
