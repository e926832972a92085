"""A supervisor for a set of Ray actors: spawning, calls, deadlines, replacement.

:class:`ActorSupervisor` owns one actor per rank and knows nothing about what
the actors compute: callers submit calls with a tag of their choosing and get
:class:`Reply` records (rank, tag, value) back in completion order.

* Spawning follows a :class:`~popmeta.population.placement.PlacementPlan`
  (node affinity, a ``PACK`` placement group reserved before any actor
  starts, or Ray's default), with ``max_restarts=0`` and ``max_task_retries=0``:
  Ray never restarts an actor or re-runs a call behind the supervisor's back.
* Each actor has an ``info() -> dict`` method, queued right after its
  constructor (so it runs first); :meth:`ActorSupervisor.describe` reports it.
* An actor with calls in flight that delivers nothing for ``call_timeout_s``
  (from its last reply, or from when it got work while idle) is lost.
* ``ActorUnavailableError`` is transient (e.g. a network blip): that call is
  lost but the actor is kept, and the caller resubmits as after any call that
  brought nothing; the deadline runs on from the first such error, so an actor
  that stays unavailable is replaced in the end. Any other ``RayActorError``
  (``ActorDiedError``: its process or node is gone) is final.
* A lost actor is killed and a new one takes its rank with ``restart + 1``;
  its calls in flight are lost and late replies of the old actor are never
  returned. The loss after ``max_actor_restarts`` replacements raises
  ``RuntimeError``. With one actor per node the replacement stays on its node
  if that is alive, else goes to an alive carrier node without an actor; if
  there is none the rank is retired and the others go on.
* :meth:`ActorSupervisor.close` kills every actor and removes the placement
  group; it never stops Ray.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from popmeta.config import PopulationConfig
from popmeta.population.placement import (
    ActorPlacement,
    NodeSnapshot,
    assign_bundle_pins,
    capacity,
    plan_placement,
    replacement_node,
)

__all__ = ["ActorArgs", "ActorSupervisor", "Reply"]

log = logging.getLogger("popmeta")

#: Pause after an ActorUnavailableError, so that the caller's retry does not hammer a blip.
UNAVAILABLE_BACKOFF_S = 0.05

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

    @property
    def rank(self) -> int:
        return self.placement.rank

    def deadline(self, timeout_s: float) -> float:
        start = self.last_progress if self.unavailable_since is None else self.unavailable_since
        return start + timeout_s


def _nodes() -> list[NodeSnapshot]:
    return [NodeSnapshot.from_ray(node) for node in ray.nodes()]


class ActorSupervisor:
    """Starts one actor per planned rank and supervises its calls.

    The constructor returns once every actor has answered ``info()``.

    Args:
      actor_class: a ``@ray.remote`` class with an ``info() -> dict`` method.
      actor_args: constructor arguments for (rank, restart, core slots).
      population: resources, placement, ``call_timeout_s`` and
        ``max_actor_restarts`` of the actors.

    Raises:
      RuntimeError: an actor failed to start, or could not be scheduled within
        ``call_timeout_s``; the actors already started are killed.
    """

    def __init__(self, actor_class: Any, actor_args: ActorArgs, population: PopulationConfig):
        self._actor_class = actor_class
        self._actor_args = actor_args
        self._pc = population
        self._actors: dict[int, _Actor] = {}
        self._calls: dict[Any, _Call] = {}  # ObjectRef -> call, in submission order
        self._pg: PlacementGroup | None = None
        self._strategy = "default"
        self._num_restarts = 0
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
    def num_restarts(self) -> int:
        """Actors replaced so far."""
        return self._num_restarts

    def in_flight(self, rank: int) -> int:
        """Calls submitted to ``rank``'s current actor and not yet returned."""
        return self._actors[rank].in_flight

    def submit(self, rank: int, tag: Any, method: str, *args: Any) -> None:
        """Calls ``method(*args)`` on ``rank``'s actor; its reply will carry ``tag``."""
        actor = self._actors[rank]
        ref = getattr(actor.handle, method).remote(*args)
        if actor.in_flight == 0 and actor.unavailable_since is None:
            # An idle actor's deadline starts when it gets work.
            actor.last_progress = time.monotonic()
        actor.in_flight += 1
        self._calls[ref] = _Call(rank, actor.restart, tag)

    def next_reply(self) -> Reply | None:
        """Waits for the next call to finish.

        Returns:
          Its reply; or None if the call brought nothing (its actor was lost
          and replaced, or was unavailable), if an actor passed its deadline
          and was replaced, or if no call is in flight. The caller then
          resubmits to whichever ranks need work.

        Raises:
          RuntimeError: an actor was lost beyond ``max_actor_restarts``, or
            the last rank of a one-per-node population was retired.
        """
        if not self._calls:
            return None
        timeout_s = self._pc.call_timeout_s
        busy = [actor for actor in self._actors.values() if actor.in_flight > 0]
        now = time.monotonic()
        until = min((a.deadline(timeout_s) for a in busy), default=now + timeout_s)
        ready, _ = ray.wait(list(self._calls), num_returns=1, timeout=max(0.0, until - now))
        if not ready:
            now = time.monotonic()
            for actor in busy:
                if self._actors.get(actor.rank) is actor and now >= actor.deadline(timeout_s):
                    self._replace(actor, f"no reply within population.call_timeout_s={timeout_s}s")
            return None
        ref = ready[0]
        call = self._calls.pop(ref)
        actor = self._actors.get(call.rank)
        if actor is None or actor.restart != call.restart:
            return None  # a late reply of a replaced actor: its rank has moved on
        actor.in_flight -= 1
        try:
            value = ray.get(ref, timeout=timeout_s)
        except ActorUnavailableError as err:  # a RayActorError too: caught first
            if actor.unavailable_since is None:
                actor.unavailable_since = time.monotonic()
            log.debug("actor %d unavailable, its call is lost: %r", actor.rank, err)
            time.sleep(UNAVAILABLE_BACKOFF_S)
            return None
        except RayActorError as err:
            self._replace(actor, repr(err))
            return None
        actor.last_progress = time.monotonic()
        actor.unavailable_since = None
        return Reply(call.rank, call.tag, value)

    def describe(self) -> list[dict[str, Any]]:
        """Each live actor's ``info()``, in rank order.

        Waits up to ``call_timeout_s`` for a replacement that has not answered
        yet; an actor that fails to answer is left out.
        """
        infos = (self._info(self._actors[rank]) for rank in self.ranks)
        return [info for info in infos if info is not None]

    def close(self) -> None:
        """Kills every actor and removes the placement group (idempotent); Ray keeps running."""
        if self._closed:
            return
        self._closed = True
        self._calls.clear()
        if ray.is_initialized():
            for actor in self._actors.values():
                self._kill(actor)
            if self._pg is not None:
                # Failing means Ray already dropped it: nothing left to release.
                with contextlib.suppress(Exception):
                    remove_placement_group(self._pg)
        self._actors.clear()
        self._pg = None

    # ------------------------------------------------------------------ start

    def _start(self) -> None:
        pc = self._pc
        nodes = _nodes()
        plan = plan_placement(pc, nodes)
        fits = capacity(nodes, plan.request)
        if pc.one_actor_per_node_with is None and fits < pc.num_actors:
            # Not fatal: an autoscaler may add nodes. But say so now, not after the timeout.
            log.warning(
                "the Ray cluster can host %d of %d actors needing %s each (cluster resources: "
                "%s); the others wait up to population.call_timeout_s=%ss for resources",
                fits,
                pc.num_actors,
                dict(plan.request),
                ray.cluster_resources(),
                pc.call_timeout_s,
            )
        self._strategy = plan.strategy
        placements = list(plan.actors)
        if plan.bundles:
            self._pg = placement_group([dict(b) for b in plan.bundles], strategy="PACK")
            try:
                ray.get(self._pg.ready(), timeout=pc.call_timeout_s)
            except GetTimeoutError:
                raise RuntimeError(
                    f"cannot place {len(placements)} actors of {dict(plan.request)} within "
                    f"population.call_timeout_s={pc.call_timeout_s}s; cluster resources: "
                    f"{ray.cluster_resources()}"
                ) from None
            placements = self._with_bundle_nodes(placements)
        for placement in placements:
            actor = _Actor(placement, restart=0)
            self._spawn(actor)
            self._actors[placement.rank] = actor
        self._await_started(plan.request)

    def _await_started(self, request: Any) -> None:
        pc = self._pc
        refs = [actor.info_ref for actor in self._actors.values()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=pc.call_timeout_s)
        ready_set = set(ready)
        for actor in self._actors.values():
            if actor.info_ref not in ready_set:
                raise RuntimeError(
                    f"actor {actor.rank} did not start within population.call_timeout_s="
                    f"{pc.call_timeout_s}s; each actor needs {dict(request)}, the cluster "
                    f"has {ray.cluster_resources()} in all"
                )
            try:
                actor.info = ray.get(actor.info_ref, timeout=pc.call_timeout_s)
            except RayActorError as err:
                raise RuntimeError(f"actor {actor.rank} failed to start: {err}") from err

    def _with_bundle_nodes(self, placements: list[ActorPlacement]) -> list[ActorPlacement]:
        assert self._pg is not None
        table = placement_group_table(self._pg).get("bundles_to_node_id", {})
        return assign_bundle_pins(placements, table, _nodes(), self._pc.num_cpus)

    def _spawn(self, actor: _Actor) -> None:
        pc = self._pc
        placement = actor.placement
        options: dict[str, Any] = {
            "num_cpus": pc.num_cpus,
            "num_gpus": pc.num_gpus,
            "resources": dict(pc.resources),
            "runtime_env": {"env_vars": dict(pc.env)} if pc.env else None,
            "max_restarts": 0,
            "max_task_retries": 0,
        }
        if self._strategy == "node_affinity":
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                placement.node_id, soft=False
            )
        elif self._strategy == "placement_group" and placement.bundle is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self._pg, placement_group_bundle_index=placement.bundle
            )
        args = self._actor_args(placement.rank, actor.restart, placement.pin)
        actor.handle = self._actor_class.options(**options).remote(*args)
        actor.info_ref = actor.handle.info.remote()
        actor.info = None
        actor.in_flight = 0
        actor.last_progress = time.monotonic()
        actor.unavailable_since = None

    def _info(self, actor: _Actor) -> dict[str, Any] | None:
        if actor.info is None:
            timeout_s = self._pc.call_timeout_s
            ready, _ = ray.wait([actor.info_ref], timeout=timeout_s)
            if not ready:
                return None
            try:
                actor.info = ray.get(actor.info_ref, timeout=timeout_s)
            except RayActorError:
                return None
        return actor.info

    # ------------------------------------------------------------------ loss

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
        self._kill(actor)
        resource = pc.one_actor_per_node_with
        if resource is not None:
            node = replacement_node(
                resource,
                actor.placement.node_id,
                [a.placement.node_id for a in self._actors.values() if a is not actor],
                _nodes(),
            )
            if node is None:
                self._retire(actor, reason)
                return
            actor.placement = dataclasses.replace(actor.placement, node_id=node)
        if self._num_restarts >= pc.max_actor_restarts:
            raise RuntimeError(
                f"actor {actor.rank} (restart {actor.restart}) was lost ({reason}) after "
                f"{self._num_restarts} actor replacement(s) in this run; "
                f"population.max_actor_restarts={pc.max_actor_restarts}: giving up"
            )
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
            "actor %d (restart %d) was lost: %s; replaced it with restart %d (%d/%d replacements)",
            actor.rank,
            old_restart,
            reason,
            actor.restart,
            self._num_restarts,
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
            raise RuntimeError(
                f"every node carrying {self._pc.one_actor_per_node_with!r} is gone: no actor left"
            )
