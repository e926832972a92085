"""One actor per rank, kept alive: spawned where the placement says, replaced when lost.

:class:`ActorLifecycle` spawns each rank's actor, makes it ready once its
``info()`` (queued right after its constructor) answers, and replaces a lost
one with the next restart number, or retires its rank when its node is gone
and no other node can take it. A constructor that raises stops everything
(:class:`ActorStartError`: a new actor would raise again), and so does a rank
replaced ``max_actor_restarts`` times in a row without a reply
(:class:`PopulationLostError`, a crash loop). Which actor is lost, from its
calls and deadlines, is the supervisor's call
(:mod:`popmeta.population.supervisor`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from popmeta.config import PopulationConfig
from popmeta.population.deadlines import CallDeadlines
from popmeta.population.placement import ActorPlacement
from popmeta.population.ray_placement import RayPlacement

__all__ = ["ActorArgs", "ActorLifecycle", "ActorSlot", "ActorStartError", "PopulationLostError"]

log = logging.getLogger("popmeta")

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")

#: Builds an actor's constructor arguments from its rank, restart number and
#: core slots (None: unpinned).
ActorArgs = Callable[[int, int, tuple[int, ...] | None], Sequence[Any]]


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

    A :class:`RayTaskError` (the build failed and ``info()`` says so) carries
    the cause; a constructor that raised leaves only its traceback as text,
    whose last line names it (docs/ray.md, Failures).
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


@dataclasses.dataclass
class ActorSlot:
    """The actor now serving one rank, and its call bookkeeping."""

    placement: ActorPlacement
    restart: int
    handle: Any = None
    info_ref: Any = None
    info: Any = None
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


class ActorLifecycle:
    """The actor of each rank: spawned, made ready, killed, replaced or retired.

    Args:
      actor_class: a ``@ray.remote`` class with an ``info()`` method that returns a record
        describing the actor (popmeta's actors: ``ActorInfo``), opaque here.
      actor_args: constructor arguments for (rank, restart, core slots).
      population: resources, placement, ``call_timeout_s`` and
        ``max_actor_restarts`` of the actors.
      runtime_env: Ray's runtime environment of every actor; None: the job's.
      deadlines: told how long each actor took to start.
      on_lost: called with an actor's slot before it is replaced or retired
        (its calls in flight are lost).
    """

    def __init__(
        self,
        actor_class: Any,
        actor_args: ActorArgs,
        population: PopulationConfig,
        runtime_env: dict[str, Any] | None,
        deadlines: CallDeadlines,
        on_lost: Callable[[ActorSlot], None],
    ):
        self._actor_class = actor_class
        self._actor_args = actor_args
        self._pc = population
        self._runtime_env = runtime_env
        self._deadlines = deadlines
        self._on_lost = on_lost
        self._placement: RayPlacement | None = None
        #: rank -> the actor now serving it.
        self.slots: dict[int, ActorSlot] = {}
        #: Actors replaced so far.
        self.num_restarts = 0

    def start(self) -> None:
        """Places and spawns every rank's actor; waits up to ``call_timeout_s`` for their starts.

        Actors that died while starting are replaced; the caller waits for
        the replacements (:meth:`read_info`).

        Raises:
          PlacementError, PopulationLostError, ActorStartError.
        """
        pc = self._pc
        self._placement = RayPlacement(pc)
        placements = self._placement.reserve(pc.call_timeout_s)
        if placements is None:
            raise PopulationLostError(
                f"cannot place {pc.num_actors} actors of {dict(self._placement.request)} within "
                f"population.call_timeout_s={pc.call_timeout_s}s; cluster resources: "
                f"{ray.cluster_resources()}"
            )
        for placement in placements:
            slot = ActorSlot(placement, restart=0)
            self._spawn(slot)
            self.slots[placement.rank] = slot
        # They start side by side, within one call_timeout_s for all of them.
        refs = [slot.info_ref for slot in self.slots.values()]
        ray.wait(refs, num_returns=len(refs), timeout=pc.call_timeout_s)
        for slot in list(self.slots.values()):
            self.read_info(slot, wait=False, first=True)

    def _spawn(self, slot: ActorSlot) -> None:
        assert self._placement is not None
        # Ray never restarts an actor or reruns a call behind the supervisor's back.
        options = self._placement.options(slot.placement) | {
            "runtime_env": self._runtime_env or None,
            "max_restarts": 0,
            "max_task_retries": 0,
        }
        args = self._actor_args(slot.rank, slot.restart, slot.placement.pin)
        slot.handle = self._actor_class.options(**options).remote(*args)
        slot.info_ref = slot.handle.info.remote()
        slot.info = None
        slot.in_flight = 0
        slot.last_progress = slot.spawned_at = time.monotonic()
        slot.unavailable_since = None

    def read_info(self, slot: ActorSlot, wait: bool, first: bool = False) -> Any:
        """The actor's ``info()``, which makes it ready; None if it has not answered.

        ``wait``: up to ``call_timeout_s``. An actor that died while starting
        is replaced; one whose constructor or ``info()`` raised raises
        :class:`ActorStartError`. At the population's start (``first``) not
        answering within ``call_timeout_s`` raises :class:`PopulationLostError`:
        the cluster lacks what it needs.
        """
        if slot.info is None:
            timeout_s = self._pc.call_timeout_s
            ready, _ = ray.wait([slot.info_ref], timeout=timeout_s if wait else 0)
            if not ready and first:
                assert self._placement is not None
                raise PopulationLostError(
                    f"actor {slot.rank} did not start within population.call_timeout_s="
                    f"{timeout_s}s; each actor needs {dict(self._placement.request)}, the "
                    f"cluster has {ray.cluster_resources()} in all"
                )
            if not ready:
                return None
            try:
                info = ray.get(slot.info_ref, timeout=timeout_s)
            except (RayActorError, RayTaskError) as err:
                failure = _start_failure(slot.rank, slot.restart, err)
                if failure is not None:
                    raise failure from None
                self.replace(slot, f"lost while starting: {err!r}")
                return None
            slot.info = info
            slot.last_progress = time.monotonic()
            took = slot.last_progress - slot.spawned_at
            self._deadlines.started(took)
            if slot.restart:  # a replacement: how long its rank had no actor at work
                log.info("actor %d (restart %d) ready in %.1fs", slot.rank, slot.restart, took)
        return slot.info

    def kill(self, slot: ActorSlot) -> None:
        """Kills the slot's actor, if it is not gone already."""
        # Failing means the actor is already gone: nothing left to release.
        with contextlib.suppress(Exception):
            if slot.handle is not None:
                ray.kill(slot.handle, no_restart=True)

    def replace(self, slot: ActorSlot, reason: str) -> None:
        """Replaces the slot's actor by a fresh one with ``restart + 1``, or retires its rank.

        Raises:
          PopulationLostError: a crash loop, or no rank left.
        """
        assert self._placement is not None
        pc = self._pc
        self._on_lost(slot)
        self.kill(slot)
        others = [s.placement for s in self.slots.values() if s is not slot]
        placement = self._placement.moved(slot.placement, others)
        if placement is None:
            self._retire(slot, reason)
            return
        slot.placement = placement
        if slot.losses_in_a_row >= pc.max_actor_restarts:
            raise PopulationLostError(
                f"actor {slot.rank} (restart {slot.restart}) was lost ({reason}); its rank "
                f"was replaced {slot.losses_in_a_row} time(s) in a row without a reply, and "
                f"population.max_actor_restarts={pc.max_actor_restarts}: giving up. A rank "
                "that keeps dying points at its node (memory, a crashing library) or at "
                "the config; see the actors' logs in Ray's session directory "
                "(/tmp/ray/session_latest/logs on each node)"
            )
        slot.losses_in_a_row += 1
        if slot.placement.bundle is not None:
            # The bundle may have moved with a lost node: recompute node and cores.
            live = list(self.slots.values())
            moved = self._placement.with_bundle_nodes([s.placement for s in live])
            for other, other_placement in zip(live, moved, strict=True):
                other.placement = other_placement
        self.num_restarts += 1
        slot.restart += 1
        self._spawn(slot)
        log.warning(
            "actor %d (restart %d) was lost: %s; replaced it with restart %d (%d in this run, "
            "%d/%d in a row for this rank)",
            slot.rank,
            slot.restart - 1,
            reason,
            slot.restart,
            self.num_restarts,
            slot.losses_in_a_row,
            pc.max_actor_restarts,
        )

    def _retire(self, slot: ActorSlot, reason: str) -> None:
        del self.slots[slot.rank]
        log.warning(
            "actor %d was lost with its node %s (%s) and no other node carrying %r is "
            "free; going on with %d actor(s)",
            slot.rank,
            slot.placement.node_id,
            reason,
            self._pc.one_actor_per_node_with,
            len(self.slots),
        )
        if not self.slots:
            raise PopulationLostError(
                f"every node carrying {self._pc.one_actor_per_node_with!r} is gone: no actor left"
            )

    def close(self) -> None:
        """Kills every actor and removes the placement group; Ray keeps running."""
        if ray.is_initialized():
            for slot in self.slots.values():
                self.kill(slot)
            if self._placement is not None:
                self._placement.close()
        self.slots.clear()
