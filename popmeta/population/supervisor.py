"""A supervisor for a set of Ray actors: spawning, readiness, calls, deadlines, replacement.

:class:`ActorSupervisor` owns one actor per rank and knows nothing about what
the actors compute: callers submit calls with a tag of their choosing and get
:class:`Reply` records (rank, tag, value) back in completion order. An actor
is *ready* once its ``info()``, queued right after its constructor, has
answered. An actor that dies (killed, its node lost), while starting or at
work, or that stays silent past its deadline, is replaced; a constructor that
raises stops everything (:class:`ActorStartError`), since a new actor would
raise again; a rank replaced ``max_actor_restarts`` times in a row without a
reply (a crash loop) stops everything too (:class:`PopulationLostError`).
Deadlines follow the measured call times (:meth:`ActorSupervisor.timeout_for`);
the rules, and what Ray does on failures, are in ``docs/ray.md``.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import ray
import ray.util
from ray.dag import InputNode, MultiOutputNode
from ray.exceptions import (
    ActorUnavailableError,
    GetTimeoutError,
    RayActorError,
    RayChannelError,
    RayChannelTimeoutError,
    RayError,
    RayTaskError,
)
from ray.util import scheduling_strategies as strategies
from ray.util.placement_group import PlacementGroup

from popmeta.config import PopulationConfig
from popmeta.population import placement as plans
from popmeta.population.placement import ActorPlacement, NodeSnapshot

__all__ = ["ActorArgs", "ActorStartError", "ActorSupervisor", "PopulationLostError", "Reply"]

log = logging.getLogger("popmeta")

#: Pause after an ActorUnavailableError, so that the caller's retry does not hammer a blip.
UNAVAILABLE_BACKOFF_S = 0.05

#: Reply intervals the call deadlines are sized from: the population's last ones.
TIMED_CALLS = 64
#: Timed replies before deadlines follow them; until then they follow the actors' starts.
MIN_TIMED_CALLS = 8

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


class ActorStartError(RuntimeError):
    """An actor's constructor (or its ``info()``) raised: another actor would raise again.

    Attributes:
      rank: the actor's rank.
      restart: its restart number.
      cause: the exception's last line, e.g. ``ModuleNotFoundError: No module named 'x'``.
      details: the actor's whole traceback, as Ray reported it.
    """

    def __init__(self, rank: int, restart: int, cause: str, details: str):
        self.rank, self.restart, self.cause, self.details = rank, restart, cause, details
        super().__init__(f"actor {rank} (restart {restart}) could not start: {cause}")


class PopulationLostError(RuntimeError):
    """The actors cannot be kept up: not placed in time, a crash loop, or no node left."""


def _start_failure(actor_rank: int, restart: int, err: BaseException) -> ActorStartError | None:
    """The :class:`ActorStartError` behind ``err`` from an actor's ``info()``, or None (a death).

    An actor whose build failed may say so from ``info()``: Ray raises a
    :class:`RayTaskError` whose cause's message is taken as the whole cause.
    A constructor that raised makes Ray report the actor dead with
    ``actor_init_failed`` and the traceback as text, whose last line names it.
    """
    if isinstance(err, RayTaskError):
        details = _ANSI_ESCAPE.sub("", str(err))
        cause = err.cause if isinstance(err.cause, BaseException) else err
        return ActorStartError(actor_rank, restart, str(cause) or type(cause).__name__, details)
    if isinstance(err, RayActorError) and err.actor_init_failed:
        details = _ANSI_ESCAPE.sub("", str(err))
        lines = [line.strip() for line in details.splitlines() if line.strip()]
        return ActorStartError(actor_rank, restart, lines[-1] if lines else details, details)
    return None


#: Builds an actor's constructor arguments from its rank, restart number and
#: core slots (None: unpinned).
ActorArgs = Callable[[int, int, tuple[int, ...] | None], Sequence[Any]]


class Reply(NamedTuple):
    """A call's result: the ``rank`` that answered, the call's ``tag``, the returned ``value``."""

    rank: int
    tag: Any
    value: Any


class _Call(NamedTuple):
    rank: int
    restart: int
    tag: Any


@dataclasses.dataclass
class _Actor:
    """The actor now serving one rank, and its call bookkeeping."""

    placement: ActorPlacement
    restart: int
    handle: Any = None
    info_ref: Any = None
    info: dict[str, Any] | None = None
    in_flight: int = 0
    last_progress: float = 0.0
    unavailable_since: float | None = None
    spawned_at: float = 0.0
    # Replacements of this rank since its last reply: a crash loop once it
    # reaches max_actor_restarts.
    losses_in_a_row: int = 0
    warned: bool = False

    @property
    def rank(self) -> int:
        return self.placement.rank

    @property
    def ready(self) -> bool:
        return self.info is not None

    @property
    def silent_since(self) -> float:
        return self.last_progress if self.unavailable_since is None else self.unavailable_since


def _nodes() -> list[NodeSnapshot]:
    return [NodeSnapshot.from_ray(node) for node in ray.nodes()]


class ActorSupervisor:
    """Starts one actor per planned rank and supervises its calls.

    The constructor returns once every rank's actor has answered ``info()``;
    an actor that dies while starting is replaced meanwhile.

    Args:
      actor_class: a ``@ray.remote`` class with an ``info() -> dict`` method.
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
    The actors already started are killed.
    """

    def __init__(
        self,
        actor_class: Any,
        actor_args: ActorArgs,
        population: PopulationConfig,
        compiled_method: str | None = None,
        runtime_env: dict[str, Any] | None = None,
    ):
        self._actor_class = actor_class
        self._actor_args = actor_args
        self._pc = population
        self._compiled_method = compiled_method
        self._runtime_env = runtime_env
        self._graph: Any = None
        self._graph_members: tuple[tuple[int, int], ...] = ()  # (rank, restart) of each
        self._actors: dict[int, _Actor] = {}
        self._calls: dict[Any, _Call] = {}  # ObjectRef -> call, in submission order
        self._pg: PlacementGroup | None = None
        self._strategy = "default"
        self._num_restarts = 0
        self._num_lost_calls = 0
        self._call_seconds: collections.deque[float] = collections.deque(maxlen=TIMED_CALLS)
        self._slowest_start: float | None = None  # spawn to ready, seconds
        self._closed = False
        try:
            self._start()
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
        return self._compiled_method

    @property
    def num_restarts(self) -> int:
        """Actors replaced so far."""
        return self._num_restarts

    @property
    def num_lost_calls(self) -> int:
        """Calls lost so far because their actor was lost with them in flight."""
        return self._num_lost_calls

    def timeout_for(self, actor_is_ready: bool = True) -> float:
        """How long a busy actor may stay silent before it is lost.

        ``call_timeout_factor`` times the slowest of the population's last
        :data:`TIMED_CALLS` reply intervals (the time from a call's start, or
        the actor's previous reply, to its reply), at least
        ``min_call_timeout_s`` and at most ``call_timeout_s``. Before
        :data:`MIN_TIMED_CALLS` replies the slowest actor start (spawn to
        ready, which ran one estimate and compiled it) stands in for the
        calls. For an actor that is still starting, ``call_timeout_s``.
        """
        pc = self._pc
        if len(self._call_seconds) >= MIN_TIMED_CALLS:
            slowest = max(self._call_seconds)
        elif self._slowest_start is not None:
            slowest = self._slowest_start
        else:
            return pc.call_timeout_s
        if not actor_is_ready:
            return pc.call_timeout_s
        return min(pc.call_timeout_s, max(pc.min_call_timeout_s, pc.call_timeout_factor * slowest))

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
            if self._actors.get(actor.rank) is actor and not self._info(actor, wait=False):
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
        while True:
            starting = {a.info_ref: a for a in self._actors.values() if not a.ready}
            if not self._calls and not starting:
                return None
            watched = [a for a in self._actors.values() if a.in_flight > 0 or not a.ready]
            now = time.monotonic()
            # Wake for the first deadline, or for the first warning due before it.
            alarms = [self._deadline(a) for a in watched]
            alarms += [self._warn_at(a) for a in watched if a.ready and not a.warned]
            until = min(alarms, default=now + self._pc.call_timeout_s)
            refs = [*self._calls, *starting]
            ready, _ = ray.wait(refs, num_returns=1, timeout=max(0.0, until - now))
            if ready:
                break
            serving = [(a.rank, a.restart) for a in watched]
            for actor in watched:
                self._warn_if_silent(actor)
                self._replace_if_overdue(actor)
            if serving != [(a.rank, a.restart) for a in watched if a.rank in self._actors]:
                return None  # an actor was replaced (or its rank retired)
        ref = ready[0]
        if ref in starting:
            self._info(starting[ref], wait=False)
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
            self._replace(actor, repr(err))
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

        Args:
          method: the actor method.
          args: rank -> the call's arguments.

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
        ``call_timeout_s`` from the execution's start. A failure tears the
        graph down and leaves every member without a reply out; the graph's
        error does not say which member failed (every reply of the execution
        raises it). So after an actor's death the members are left to the
        caller's tagged calls, which find and replace the dead one; after the
        wait ran out every member without a reply is lost and replaced (a
        hung actor would also keep the graph's teardown waiting for ever).
        An exception raised by the method itself propagates, as from a
        tagged call.

        Args are passed by value through the graph's shared-memory channels
        (an ObjectRef would reach the method unresolved).

        Returns:
          rank -> returned value, for the ranks that answered: a copy, which
          does not hold on to the channel it came through.
        """
        assert self._compiled_method is not None, "no compiled_method was given"
        actors = [
            actor
            for rank in ranks
            if (actor := self._actors.get(rank)) and actor.ready and not actor.in_flight
        ]
        if not actors:
            return {}
        members = tuple((actor.rank, actor.restart) for actor in actors)
        timeout_s = self.timeout_for()
        deadline = time.monotonic() + timeout_s
        values: dict[int, Any] = {}
        try:
            if members != self._graph_members:
                self._teardown_graph()
                self._graph = self._compile([actor.handle for actor in actors], len(args))
                self._graph_members = members
            started = time.monotonic()
            for actor in actors:
                actor.last_progress, actor.warned = started, False
            refs = self._graph.execute(*args)
            for actor, ref in zip(actors, refs, strict=True):
                value = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                # A numpy array read from a channel is a view of the channel's
                # buffer, which Ray releases when the view is freed; a view that
                # outlives the graph (XLA, given it as an argument, frees it
                # later) makes that release touch a torn-down channel, which
                # crashed the driver (SIGSEGV in PlasmaObjectHeader). A copy
                # owns its memory.
                values[actor.rank] = copy.deepcopy(value)
                self._progressed(actor, timed=True)
        except (RayActorError, RayChannelError) as err:
            # RayTaskError (the method raised) is neither, and propagates.
            if not isinstance(err, RayChannelTimeoutError):
                log.info("compiled graph failed (%r); its members are called anew", err)
                self._teardown_graph()
                return values
            silent = [actor for actor in actors if actor.rank not in values]
            for actor in silent:
                self._kill(actor)  # first: the teardown waits for every member's graph thread
            self._teardown_graph()
            self._num_lost_calls += len(silent)
            for actor in silent:
                self._replace(
                    actor,
                    f"no reply through the compiled graph within {timeout_s:.3g}s "
                    "(the graph does not say which member hung: each is replaced)",
                )
        return values

    def describe(self) -> list[dict[str, Any]]:
        """Each live actor's ``info()``, in rank order.

        Waits up to ``call_timeout_s`` for a replacement that has not answered
        yet; an actor that fails to answer is left out (and replaced).
        """
        # .get: an actor lost while starting may retire its rank meanwhile.
        infos = (self._info(a, wait=True) for r in self.ranks if (a := self._actors.get(r)))
        return [info for info in infos if info is not None]

    def close(self) -> None:
        """Kills every actor and removes the placement group (idempotent); Ray keeps running."""
        if self._closed:
            return
        self._closed = True
        self._calls.clear()
        if ray.is_initialized():
            # Before the kills: a graph over live actors shuts down cleanly.
            self._teardown_graph()
            for actor in self._actors.values():
                self._kill(actor)
            if self._pg is not None:
                # Failing means Ray already dropped it: nothing left to release.
                with contextlib.suppress(Exception):
                    ray.util.remove_placement_group(self._pg)
        self._actors.clear()
        self._pg = None

    # ------------------------------------------------------------------ start

    def _start(self) -> None:
        pc = self._pc
        nodes = _nodes()
        plan = plans.plan_placement(pc, nodes)
        shortfall = plans.capacity_shortfall(pc, nodes, plan.request)
        if shortfall is not None:
            # Not fatal: an autoscaler may add nodes. But say so now, not after the timeout.
            log.warning("%s", shortfall)
        self._strategy = plan.strategy
        placements = list(plan.actors)
        if plan.bundles:
            self._pg = ray.util.placement_group([dict(b) for b in plan.bundles], strategy="PACK")
            try:
                ray.get(self._pg.ready(), timeout=pc.call_timeout_s)
            except GetTimeoutError:
                raise PopulationLostError(
                    f"cannot place {len(placements)} actors of {dict(plan.request)} within "
                    f"population.call_timeout_s={pc.call_timeout_s}s; cluster resources: "
                    f"{ray.cluster_resources()}"
                ) from None
            placements = self._with_bundle_nodes(placements)
        for placement in placements:
            actor = _Actor(placement, restart=0)
            self._spawn(actor)
            self._actors[placement.rank] = actor
        # They start side by side, within one call_timeout_s for all of them.
        refs = [actor.info_ref for actor in self._actors.values()]
        ray.wait(refs, num_returns=len(refs), timeout=pc.call_timeout_s)
        for actor in list(self._actors.values()):
            self._info(actor, wait=False, first=True)
        # Replacements of actors that died while starting (a lost node, a kill).
        while len(self.ready_ranks) < len(self._actors):
            self.next_reply()

    def _with_bundle_nodes(self, placements: list[ActorPlacement]) -> list[ActorPlacement]:
        assert self._pg is not None
        table = ray.util.placement_group_table(self._pg).get("bundles_to_node_id", {})
        return plans.assign_bundle_pins(placements, table, _nodes(), self._pc.num_cpus)

    def _spawn(self, actor: _Actor) -> None:
        pc = self._pc
        placement = actor.placement
        options: dict[str, Any] = {
            "num_cpus": pc.num_cpus,
            "num_gpus": pc.num_gpus,
            "resources": dict(pc.resources),
            "runtime_env": self._runtime_env or None,
            "max_restarts": 0,
            "max_task_retries": 0,
        }
        if self._strategy == "node_affinity":
            options["scheduling_strategy"] = strategies.NodeAffinitySchedulingStrategy(
                placement.node_id, soft=False
            )
        elif self._strategy == "placement_group" and placement.bundle is not None:
            options["scheduling_strategy"] = strategies.PlacementGroupSchedulingStrategy(
                self._pg, placement_group_bundle_index=placement.bundle
            )
        args = self._actor_args(placement.rank, actor.restart, placement.pin)
        actor.handle = self._actor_class.options(**options).remote(*args)
        actor.info_ref = actor.handle.info.remote()
        actor.info = None
        actor.in_flight = 0
        actor.last_progress = actor.spawned_at = time.monotonic()
        actor.unavailable_since = None

    def _info(self, actor: _Actor, wait: bool, first: bool = False) -> dict[str, Any] | None:
        """The actor's ``info()``, which makes it ready; None if it has not answered.

        An actor that died while starting is replaced; one whose constructor
        or ``info()`` raised raises :class:`ActorStartError`. At the
        population's start (``first``) not answering within ``call_timeout_s``
        raises :class:`PopulationLostError`: the cluster lacks what it needs.
        """
        if actor.info is None:
            timeout_s = self._pc.call_timeout_s
            ready, _ = ray.wait([actor.info_ref], timeout=timeout_s if wait else 0)
            if not ready and first:
                raise PopulationLostError(
                    f"actor {actor.rank} did not start within population.call_timeout_s="
                    f"{timeout_s}s; each actor needs {plans.actor_request(self._pc)}, the "
                    f"cluster has {ray.cluster_resources()} in all"
                )
            if not ready:
                return None
            try:
                info = ray.get(actor.info_ref, timeout=timeout_s)
            except (RayActorError, RayTaskError) as err:
                failure = _start_failure(actor.rank, actor.restart, err)
                if failure is not None:
                    raise failure from None
                self._replace(actor, f"lost while starting: {err!r}")
                return None
            actor.info = info
            actor.last_progress = time.monotonic()
            took = actor.last_progress - actor.spawned_at
            self._slowest_start = max(took, self._slowest_start or 0.0)
            if actor.restart:  # a replacement: how long its rank had no actor at work
                log.info("actor %d (restart %d) ready in %.1fs", actor.rank, actor.restart, took)
        return actor.info

    # ------------------------------------------------------------------ loss

    def _compile(self, handles: Sequence[Any], num_args: int) -> Any:
        with InputNode() as inputs:
            args = [inputs[i] for i in range(num_args)]
            outputs = [getattr(handle, self._compiled_method).bind(*args) for handle in handles]
            node = MultiOutputNode(outputs)
        return node.experimental_compile()

    def _teardown_graph(self) -> None:
        graph, self._graph, self._graph_members = self._graph, None, ()
        if graph is not None:
            # Failing means the graph is already shut down: nothing left to release.
            with contextlib.suppress(Exception):
                graph.teardown()

    def _progressed(self, actor: _Actor, timed: bool) -> None:
        """``actor`` answered now; ``timed``: the interval since its last progress was one call."""
        now = time.monotonic()
        if timed:
            self._call_seconds.append(now - actor.last_progress)
        actor.last_progress, actor.unavailable_since = now, None
        actor.losses_in_a_row, actor.warned = 0, False

    def _deadline(self, actor: _Actor) -> float:
        return actor.silent_since + self.timeout_for(actor.ready)

    def _warn_at(self, actor: _Actor) -> float:
        return actor.silent_since + self.timeout_for(actor.ready) / 2

    def _warn_if_silent(self, actor: _Actor) -> None:
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
                max(self._call_seconds, default=0.0),
                self.timeout_for(),
            )

    def _replace_if_overdue(self, actor: _Actor) -> None:
        """Replaces ``actor`` if it still serves its rank and is past its deadline."""
        if self._actors.get(actor.rank) is actor and time.monotonic() >= self._deadline(actor):
            timeout_s = self.timeout_for(actor.ready)
            if actor.ready:
                self._replace(
                    actor,
                    f"no reply within {timeout_s:.3g}s (population.call_timeout_factor="
                    f"{self._pc.call_timeout_factor:g} times the slowest recent call, at least "
                    f"min_call_timeout_s={self._pc.min_call_timeout_s:g}s, at most "
                    f"call_timeout_s={self._pc.call_timeout_s:g}s)",
                )
            else:
                self._replace(actor, f"no start within population.call_timeout_s={timeout_s:g}s")

    def _kill(self, actor: _Actor) -> None:
        # Failing means the actor is already gone: nothing left to release.
        with contextlib.suppress(Exception):
            if actor.handle is not None:
                ray.kill(actor.handle, no_restart=True)

    def _replace(self, actor: _Actor, reason: str) -> None:
        """Replaces ``actor`` by a fresh one of its rank with ``restart + 1`` (or retires it)."""
        pc = self._pc
        # Its calls in flight are lost: their late replies must not count.
        lost = (actor.rank, actor.restart)
        for ref in [r for r, call in self._calls.items() if (call.rank, call.restart) == lost]:
            del self._calls[ref]
            self._num_lost_calls += 1
        self._kill(actor)
        resource = pc.one_actor_per_node_with
        if resource is not None:
            node = plans.replacement_node(
                resource,
                actor.placement.node_id,
                [a.placement.node_id for a in self._actors.values() if a is not actor],
                _nodes(),
            )
            if node is None:
                self._retire(actor, reason)
                return
            actor.placement = dataclasses.replace(actor.placement, node_id=node)
        if actor.losses_in_a_row >= pc.max_actor_restarts:
            raise PopulationLostError(
                f"actor {actor.rank} (restart {actor.restart}) was lost ({reason}); its rank "
                f"was replaced {actor.losses_in_a_row} time(s) in a row without a reply, and "
                f"population.max_actor_restarts={pc.max_actor_restarts}: giving up. A rank "
                "that keeps dying points at its node (memory, a crashing library) or at "
                "the config; see the actors' logs in Ray's session directory "
                "(/tmp/ray/session_latest/logs on each node)"
            )
        actor.losses_in_a_row += 1
        if actor.placement.bundle is not None:
            # The bundle may have moved with a lost node: recompute node and cores.
            live = list(self._actors.values())
            for other, placement in zip(
                live, self._with_bundle_nodes([a.placement for a in live]), strict=True
            ):
                other.placement = placement
        old_restart = actor.restart
        self._num_restarts += 1
        actor.restart = old_restart + 1
        self._spawn(actor)
        log.warning(
            "actor %d (restart %d) was lost: %s; replaced it with restart %d (%d in this run, "
            "%d/%d in a row for this rank)",
            actor.rank,
            old_restart,
            reason,
            actor.restart,
            self._num_restarts,
            actor.losses_in_a_row,
            pc.max_actor_restarts,
        )

    def _retire(self, actor: _Actor, reason: str) -> None:
        del self._actors[actor.rank]
        log.warning(
            "actor %d was lost with its node %s (%s) and no other node carrying %r is "
            "free; going on with %d actor(s)",
            actor.rank,
            actor.placement.node_id,
            reason,
            self._pc.one_actor_per_node_with,
            len(self._actors),
        )
        if not self._actors:
            raise PopulationLostError(
                f"every node carrying {self._pc.one_actor_per_node_with!r} is gone: no actor left"
            )
