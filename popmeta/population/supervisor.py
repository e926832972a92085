"""A supervisor for a set of Ray actors: calls, deadlines, replacement of the lost.

:class:`ActorSupervisor` offers a few verbs over one actor per rank and knows
nothing of what the actors compute: callers submit calls with a tag of their
choosing and get :class:`Reply` records (rank, tag, value) back in completion
order, or call every actor at once, or call them through a Ray compiled graph
(:mod:`popmeta.population.compiled_graph`). An actor that dies, or stays
silent past its deadline (:mod:`popmeta.population.deadlines`), is replaced
by :mod:`popmeta.population.lifecycle`, which spawns, places and retires the
actors. What Ray does on failures is in ``docs/ray.md``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayError, RayTaskError

from popmeta.config import PopulationConfig
from popmeta.population.compiled_graph import CompiledGraph, GraphFailed
from popmeta.population.deadlines import CallDeadlines
from popmeta.population.lifecycle import ActorArgs, ActorLifecycle, ActorSlot

__all__ = ["ActorSupervisor", "Reply"]

log = logging.getLogger("popmeta")

#: Pause after an ActorUnavailableError, so that the caller's retry does not hammer a blip.
UNAVAILABLE_BACKOFF_S = 0.05


class Reply(NamedTuple):
    """A call's result: the ``rank`` that answered, the call's ``tag``, the returned ``value``."""

    rank: int
    tag: Any
    value: Any


class _Call(NamedTuple):
    rank: int
    restart: int
    tag: Any


class ActorSupervisor:
    """Starts one actor per planned rank and supervises its calls.

    The constructor returns once every rank's actor has answered ``info()``;
    an actor that dies while starting is replaced meanwhile.

    Args:
      actor_class: a ``@ray.remote`` class with an ``info()`` method that returns a record
        describing the actor (popmeta's actors: ``ActorInfo``), opaque here.
      actor_args: constructor arguments for (rank, restart, core slots).
      population: resources, placement, timeouts and ``max_actor_restarts``
        of the actors.
      compiled_method: the method :meth:`call_compiled` calls, if any.
      runtime_env: Ray's runtime environment of every actor; None: the job's.

    Raises:
      ActorStartError: an actor's constructor raised.
      PopulationLostError: the actors could not be placed or started within
        ``call_timeout_s``, or a rank kept dying while it started.
      PlacementError: the cluster cannot host the population as configured.
    The actors already started are killed. :meth:`next_reply` and
    :meth:`call_compiled` raise the first two too (:mod:`~popmeta.population.lifecycle`).
    """

    def __init__(
        self,
        actor_class: Any,
        actor_args: ActorArgs,
        population: PopulationConfig,
        compiled_method: str | None = None,
        runtime_env: dict[str, Any] | None = None,
    ):
        self._pc = population
        self._graph = CompiledGraph(compiled_method) if compiled_method is not None else None
        self._deadlines = CallDeadlines(
            population.call_timeout_s, population.min_call_timeout_s, population.call_timeout_factor
        )
        self._lifecycle = ActorLifecycle(
            actor_class, actor_args, population, runtime_env, self._deadlines, self._drop_calls
        )
        #: rank -> the actor serving it: the lifecycle's, which replaces and retires them.
        self._actors = self._lifecycle.slots
        self._calls: dict[Any, _Call] = {}  # ObjectRef -> call, in submission order
        self._num_lost_calls = 0
        self._closed = False
        try:
            self._lifecycle.start()
            # Replacements of actors that died while starting (a lost node, a kill).
            while len(self.ready_ranks) < len(self._actors):
                self.next_reply()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ public

    @property
    def ranks(self) -> list[int]:
        """Ranks served by a live actor, in order."""
        return sorted(self._actors)

    @property
    def ready_ranks(self) -> list[int]:
        """Ranks whose actor is ready (has answered ``info()``), in order."""
        return [rank for rank in self.ranks if self._actors[rank].ready]

    @property
    def compiled_method(self) -> str | None:
        """The method :meth:`call_compiled` calls; None: no compiled calls."""
        return None if self._graph is None else self._graph.method

    @property
    def num_restarts(self) -> int:
        """Actors replaced so far."""
        return self._lifecycle.num_restarts

    @property
    def num_lost_calls(self) -> int:
        """Calls lost so far because their actor was lost with them in flight."""
        return self._num_lost_calls

    def timeout_for(self, actor_is_ready: bool = True) -> float:
        """How long a busy actor may stay silent before it is lost (:class:`CallDeadlines`)."""
        return self._deadlines.timeout_for(actor_is_ready)

    def in_flight(self, rank: int) -> int:
        """Calls submitted to ``rank``'s current actor and not yet returned."""
        return self._actors[rank].in_flight

    def submit(self, rank: int, tag: Any, method: str, *args: Any) -> None:
        """Calls ``method(*args)`` on ``rank``'s actor; its reply will carry ``tag``.

        An actor that is not ready yet runs the call after its start; its
        deadline still runs from its spawn.
        """
        actor = self._actors[rank]
        ref = getattr(actor.handle, method).remote(*args)
        if actor.ready and actor.in_flight == 0 and actor.unavailable_since is None:
            # An idle actor's deadline starts when it gets work.
            actor.last_progress = time.monotonic()
            actor.warned = False
        actor.in_flight += 1
        self._calls[ref] = _Call(rank, actor.restart, tag)

    def check_starting(self) -> None:
        """Without waiting: starting actors that have answered ``info()`` become ready.

        One that has not started within ``call_timeout_s`` of its spawn is
        replaced. :meth:`next_reply` does this while it waits; a caller that
        gets its replies elsewhere (:meth:`call_compiled`) calls this instead.
        """
        for actor in [a for a in self._actors.values() if not a.ready]:
            # .get: replacing one actor may retire another's rank meanwhile.
            if self._actors.get(actor.rank) is actor and not self._lifecycle.read_info(
                actor, wait=False
            ):
                self._replace_if_overdue(actor)

    def next_reply(self) -> Reply | None:
        """Waits for the next call to finish, or for a starting actor to become ready.

        Returns:
          The call's reply; or None if the call brought nothing (its actor was
          lost and replaced, or was unavailable), if an actor became ready or
          was lost while starting, if an actor passed its deadline and was
          replaced, or if no call is in flight and no actor is starting. The
          caller then gives work to whichever ready ranks need it.

        Raises:
          ActorStartError: a replacement's constructor raised.
          PopulationLostError: a rank was replaced ``max_actor_restarts``
            times in a row without a reply, or the last rank of a one-per-node
            population was retired.
        """
        ref, starting = self._wait_for_event()
        if ref is None:
            return None
        if ref in starting:
            self._lifecycle.read_info(starting[ref], wait=False)
            return None
        call = self._calls.pop(ref)
        actor = self._actors.get(call.rank)
        if actor is None or actor.restart != call.restart:
            return None  # a late reply of a replaced actor: its rank has moved on
        actor.in_flight -= 1
        try:
            value = ray.get(ref, timeout=self._pc.call_timeout_s)
        except ActorUnavailableError as err:  # a RayActorError too: caught first
            self._num_lost_calls += 1
            if actor.unavailable_since is None:
                actor.unavailable_since = time.monotonic()
            log.debug("actor %d unavailable, its call is lost: %r", actor.rank, err)
            time.sleep(UNAVAILABLE_BACKOFF_S)
            return None
        except RayActorError as err:
            self._num_lost_calls += 1
            self._lifecycle.replace(actor, repr(err))
            return None
        self._progressed(actor, timed=True)
        return Reply(call.rank, call.tag, value)

    def call_each(
        self, method: str, args: Mapping[int, Sequence[Any]]
    ) -> tuple[dict[int, Any], dict[int, str]]:
        """Calls ``method(*args[rank])`` on the actor of each rank in ``args``; waits for all.

        These calls are not tagged calls: their replies never come out of
        :meth:`next_reply` and they are not counted in :meth:`in_flight`. An
        actor runs its calls in the order they were submitted, so this one
        runs after the calls already queued on it; the wait allows
        ``call_timeout_s`` for each of those and for this one. A rank without a
        ready actor, an actor that raises, dies or does not answer in time is
        left out with the reason; a lost actor is handled (replaced) by the
        next tagged call, as always.

        Returns:
          ``(rank -> returned value, rank -> why there is none)``.
        """
        timeout_s = self._pc.call_timeout_s
        refs: dict[int, Any] = {}
        failed: dict[int, str] = {}
        for rank, call_args in args.items():
            actor = self._actors.get(rank)
            if actor is None or not actor.ready:
                failed[rank] = "no ready actor serves this rank"
                continue
            refs[rank] = getattr(actor.handle, method).remote(*call_args)
        if not refs:
            return {}, failed
        ahead = max(self._actors[rank].in_flight for rank in refs)
        wait_s = timeout_s * (ahead + 1)
        done, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=wait_s)
        values: dict[int, Any] = {}
        for rank, ref in refs.items():
            if ref not in done:
                failed[rank] = f"no answer to {method}() within {wait_s:g}s"
                continue
            try:
                values[rank] = ray.get(ref, timeout=timeout_s)
            except RayTaskError as err:  # the method raised: report its own error
                failed[rank] = f"{type(err.cause).__name__}: {err.cause}"
            except RayError as err:
                failed[rank] = f"{type(err).__name__}: {err}"
            else:
                # It answered: its silence, and its next reply interval, count from now.
                self._progressed(self._actors[rank], timed=False)
        return values, failed

    def call_compiled(self, ranks: Sequence[int], *args: Any) -> dict[int, Any]:
        """Calls ``compiled_method(*args)`` on each rank's actor through the compiled graph.

        Only ready actors without tagged calls in flight take part; the graph
        is rebuilt when they differ from its members. Waits up to
        :meth:`timeout_for` from the execution's start. After a member's death
        the members without a reply are left to the caller's tagged calls,
        which find and replace the dead one; after the wait ran out every
        member without a reply is lost and replaced (a hung actor would also
        keep the graph's teardown waiting for ever). An exception raised by
        the method itself propagates, as from a tagged call.

        Returns:
          rank -> returned value (a copy), for the ranks that answered.
        """
        assert self._graph is not None, "no compiled_method was given"
        actors = [
            actor
            for rank in ranks
            if (actor := self._actors.get(rank)) and actor.ready and not actor.in_flight
        ]
        if not actors:
            return {}
        timeout_s = self.timeout_for()
        deadline = time.monotonic() + timeout_s
        values: dict[int, Any] = {}
        try:
            self._graph.build([((a.rank, a.restart), a.handle) for a in actors], len(args))
            started = time.monotonic()
            for actor in actors:
                actor.last_progress, actor.warned = started, False
            for actor, value in zip(actors, self._graph.execute(args, deadline), strict=True):
                values[actor.rank] = value
                self._progressed(actor, timed=True)
        except GraphFailed as failure:
            if not failure.timed_out:
                log.info("compiled graph failed (%s); its members are called anew", failure)
                self._graph.teardown()
                return values
            silent = [actor for actor in actors if actor.rank not in values]
            for actor in silent:
                self._lifecycle.kill(
                    actor
                )  # first: the teardown waits for every member's graph thread
            self._graph.teardown()
            self._num_lost_calls += len(silent)
            for actor in silent:
                self._lifecycle.replace(
                    actor,
                    f"no reply through the compiled graph within {timeout_s:.3g}s "
                    "(the graph does not say which member hung: each is replaced)",
                )
        return values

    def reread_info(self) -> None:
        """Asks every ready actor for its ``info()`` again, after a change to what it runs."""
        infos, _ = self.call_each("info", {rank: () for rank in self.ready_ranks})
        for rank, info in infos.items():
            self._actors[rank].info = info

    def describe(self) -> list[Any]:
        """Each live actor's ``info()``, in rank order.

        Waits up to ``call_timeout_s`` for a replacement that has not answered
        yet; an actor that fails to answer is left out (and replaced).
        """
        # .get: an actor lost while starting may retire its rank meanwhile.
        infos = (
            self._lifecycle.read_info(a, wait=True)
            for r in self.ranks
            if (a := self._actors.get(r))
        )
        return [info for info in infos if info is not None]

    def close(self) -> None:
        """Kills every actor and removes the placement group (idempotent); Ray keeps running."""
        if self._closed:
            return
        self._closed = True
        self._calls.clear()
        if self._graph is not None and ray.is_initialized():
            # Before the kills: a graph over live actors shuts down cleanly.
            self._graph.teardown()
        self._lifecycle.close()

    # ------------------------------------------------------------------ waiting

    def _wait_for_event(self) -> tuple[Any, dict[Any, ActorSlot]]:
        """Waits for a reply or a start, replacing actors past their deadline meanwhile.

        Returns:
          ``(ref, starting)``: the ref that is ready, among the calls' and the
          starting actors' ``info()`` refs (``starting``: info ref -> actor);
          ref None when nothing is in flight or starting, or an actor was
          replaced (or its rank retired) while waiting.
        """
        while True:
            starting = {a.info_ref: a for a in self._actors.values() if not a.ready}
            if not self._calls and not starting:
                return None, starting
            watched = [a for a in self._actors.values() if a.in_flight > 0 or not a.ready]
            now = time.monotonic()
            # Wake for the first deadline, or for the first warning due before it.
            alarms = [self._deadline(a) for a in watched]
            alarms += [self._warn_at(a) for a in watched if a.ready and not a.warned]
            until = min(alarms, default=now + self._pc.call_timeout_s)
            refs = [*self._calls, *starting]
            ready, _ = ray.wait(refs, num_returns=1, timeout=max(0.0, until - now))
            if ready:
                return ready[0], starting
            serving = [(a.rank, a.restart) for a in watched]
            for actor in watched:
                self._warn_if_silent(actor)
                self._replace_if_overdue(actor)
            if serving != [(a.rank, a.restart) for a in watched if a.rank in self._actors]:
                return None, starting

    def _progressed(self, actor: ActorSlot, timed: bool) -> None:
        """``actor`` answered now; ``timed``: the interval since its last progress was one call."""
        now = time.monotonic()
        if timed:
            self._deadlines.replied(now - actor.last_progress)
        actor.last_progress, actor.unavailable_since = now, None
        actor.losses_in_a_row, actor.warned = 0, False

    def _deadline(self, actor: ActorSlot) -> float:
        return actor.silent_since + self.timeout_for(actor.ready)

    def _warn_at(self, actor: ActorSlot) -> float:
        return actor.silent_since + self.timeout_for(actor.ready) / 2

    def _warn_if_silent(self, actor: ActorSlot) -> None:
        """Logs once that a busy actor is halfway to its deadline."""
        now = time.monotonic()
        if actor.ready and not actor.warned and actor.in_flight and now >= self._warn_at(actor):
            actor.warned = True
            log.warning(
                "actor %d (restart %d, pid %s) has not replied for %.1fs; the population's "
                "calls took at most %.3gs lately; it is replaced at %.1fs unless it answers",
                actor.rank,
                actor.restart,
                getattr(actor.info, "pid", "?"),
                now - actor.silent_since,
                self._deadlines.slowest_call,
                self.timeout_for(),
            )

    # ------------------------------------------------------------------ loss

    def _replace_if_overdue(self, actor: ActorSlot) -> None:
        """Replaces ``actor`` if it still serves its rank and is past its deadline."""
        if self._actors.get(actor.rank) is not actor or time.monotonic() < self._deadline(actor):
            return
        timeout_s = self.timeout_for(actor.ready)
        pc = self._pc
        if actor.ready:
            self._lifecycle.replace(
                actor,
                f"no reply within {timeout_s:.3g}s (population.call_timeout_factor="
                f"{pc.call_timeout_factor:g} times the slowest recent call, at least "
                f"min_call_timeout_s={pc.min_call_timeout_s:g}s, at most "
                f"call_timeout_s={pc.call_timeout_s:g}s)",
            )
        else:
            self._lifecycle.replace(
                actor, f"no start within population.call_timeout_s={timeout_s:g}s"
            )

    def _drop_calls(self, actor: ActorSlot) -> None:
        """``actor`` is lost: its calls in flight are lost too, and their late replies ignored."""
        lost = (actor.rank, actor.restart)
        for ref in [r for r, call in self._calls.items() if (call.rank, call.restart) == lost]:
            del self._calls[ref]
            self._num_lost_calls += 1
