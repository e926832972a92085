"""The Ray population: estimator actors on any node, fed by the learner.

Theta crosses to the actors once per version: one ``ray.put`` whose ObjectRef
every actor call for that version receives (``num_puts`` counts them).
Estimates come back by value.

* ``mode: sync`` -- each :meth:`RayPopulation.gather` asks every live actor for
  one estimate of this version and returns them in actor-rank order, so a run
  with a fixed seed is deterministic (and bitwise equal to the local engine).
* ``mode: async`` -- every actor keeps ``calls_in_flight`` calls queued, so it
  never idles waiting for theta, and no actor waits for another. The learner
  takes estimates in completion order (``ray.wait``); when a call finishes its
  actor is resubmitted at once with the newest theta. ``gather`` returns once
  ``batch_size`` estimates were accepted; one computed on version v is
  accepted at learner version u only if ``u - v <= max_staleness``, otherwise
  it is dropped and counted (per actor in ``dropped_stale_per_actor``).

A dead actor (``ActorDiedError``, or no estimate within ``call_timeout_s``)
is replaced by a fresh one of the same rank and the next ``restart`` number:
new keys, so its inner problems restart at new random offsets. Its in-flight
estimates are lost and the run goes on; after ``max_actor_restarts``
replacements the population gives up with a RuntimeError.
``ActorUnavailableError`` is transient: the call is retried.

Placement. Actors declare ``num_cpus``, ``num_gpus`` and custom ``resources``.
With ``one_actor_per_node_with: R`` there is one actor on every alive node
carrying resource R, held there by node affinity. With ``pin_cpus`` on
CPU-only actors (no GPUs, no custom resources, not one per node), actors that
share a node get distinct cores, round-robin over that node's CPU count; on a
multi-node cluster a placement group reserves the actors' resources first so
that each actor's node is known before it starts.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import time
from typing import Any, NamedTuple

import numpy as np
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

from popmeta.actors.actor import EstimatorActor
from popmeta.config import Config
from popmeta.estimate import Estimate
from popmeta.population.base import Gathered
from popmeta.population.ray_runtime import RayHandle, start_ray

__all__ = ["ActorStats", "RayPopulation"]

log = logging.getLogger("popmeta")

#: Pause before retrying a call that failed with ActorUnavailableError.
_UNAVAILABLE_BACKOFF_S = 0.05


class ActorStats(NamedTuple):
    """Bookkeeping of one actor rank over the run (all its restarts together).

    Attributes:
      rank: the actor's rank.
      restart: restart number of the actor now serving the rank (0: never replaced).
      estimates: estimates this rank delivered (accepted or dropped).
      dropped_stale: estimates of this rank dropped for exceeding ``max_staleness``.
      node_id: node of the actor now serving the rank (None until it reported).
      pid: its process id (None until it reported).
      pinned_cores: cores it is pinned to, or None.
    """

    rank: int
    restart: int
    estimates: int
    dropped_stale: int
    node_id: str | None
    pid: int | None
    pinned_cores: list[int] | None


class _Call(NamedTuple):
    rank: int
    restart: int
    version: int


@dataclasses.dataclass
class _Slot:
    """One actor rank: the actor now serving it and its bookkeeping."""

    rank: int
    restart: int
    handle: Any
    info_ref: Any
    node_id: str | None = None  # target node (one per node) or bundle node
    bundle: int | None = None
    pin: tuple[int, ...] | None = None
    info: dict[str, Any] | None = None
    in_flight: int = 0
    # The actor is declared lost if it delivers nothing for call_timeout_s
    # after this time (its last estimate, or the moment it got work while idle).
    last_progress: float = 0.0
    # Set on an ActorUnavailableError: retries do not extend the deadline.
    unavailable_since: float | None = None
    estimates: int = 0
    dropped_stale: int = 0


class RayPopulation:
    """``population.num_actors`` estimator actors (or one per node) on Ray.

    Uses the Ray instance already initialised in this process, or starts one
    with :func:`~popmeta.population.ray_runtime.start_ray` from
    ``population.address`` (and stops it again in :meth:`close`).

    Args:
      config: the run's config; ``config.population`` says how many actors,
        where, and in which mode.

    Attributes:
      num_puts: ``ray.put`` calls of theta so far (one per theta version).
      num_restarts: actors replaced so far.
      dropped_stale_per_actor: rank -> estimates dropped for staleness.
    """

    def __init__(self, config: Config):
        self.config = config
        self._pc = config.population
        if any(name in ("CPU", "GPU") for name in self._pc.resources):
            raise ValueError(
                "population.resources: declare CPUs and GPUs with population.num_cpus / "
                "population.num_gpus, not as custom resources"
            )
        self.num_puts = 0
        self.num_restarts = 0
        self.dropped_stale_per_actor: dict[int, int] = {}
        self._slots: dict[int, _Slot] = {}
        self._inflight: dict[Any, _Call] = {}  # ObjectRef -> call, in submission order
        self._theta_ref: Any = None
        self._theta_version: int | None = None
        self._restarted = 0  # replacements not yet reported in a Gathered
        self._pg: PlacementGroup | None = None
        self._closed = False
        # If no Ray is running yet, the embedded instance gets enough logical
        # CPUs for every actor (pinning spreads them over the real cores).
        needed = math.ceil(self._pc.num_actors * self._pc.num_cpus)
        self._runtime: RayHandle = start_ray(
            self._pc.address, num_cpus=max(os.cpu_count() or 1, needed)
        )
        try:
            self._start_actors()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ spawning

    def _actor_options(self) -> dict[str, Any]:
        pc = self._pc
        return {
            "num_cpus": pc.num_cpus,
            "num_gpus": pc.num_gpus,
            "resources": dict(pc.resources),
            "runtime_env": {"env_vars": dict(pc.env)} if pc.env else None,
            # Ray never restarts actors behind our back: a dead actor is
            # replaced by a new rank restart with new keys (see _replace).
            "max_restarts": 0,
            "max_task_retries": 0,
        }

    def _request(self) -> dict[str, float]:
        """Resources one actor asks for, in node-resource names."""
        pc = self._pc
        request = {"CPU": pc.num_cpus, "GPU": pc.num_gpus, **pc.resources}
        return {name: amount for name, amount in request.items() if amount > 0}

    def _pins_cpus(self) -> bool:
        pc = self._pc
        # Only CPU-only actors: accelerator hosts (GPUs, TPUs or other custom
        # resources) and whole-node actors need all of their node's cores.
        return (
            pc.pin_cpus
            and pc.num_gpus == 0
            and not pc.resources
            and pc.one_actor_per_node_with is None
        )

    def _pin_slots(self, index_on_node: int, node_cpus: float) -> tuple[int, ...]:
        per_actor = max(1, int(self._pc.num_cpus))
        cpus = max(1, int(node_cpus))
        return tuple((index_on_node * per_actor + j) % cpus for j in range(per_actor))

    def _plan(self) -> list[_Slot]:
        """Ranks with their node, bundle and core slots, before any actor starts."""
        pc = self._pc
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        resource = pc.one_actor_per_node_with
        if resource is not None:
            carriers = [n for n in nodes if n["Resources"].get(resource, 0) > 0]
            if not carriers:
                raise RuntimeError(
                    f"population.one_actor_per_node_with={resource!r}: no alive Ray node "
                    f"carries resource {resource!r}; cluster resources: "
                    f"{ray.cluster_resources()}"
                )
            return [
                _Slot(rank, 0, None, None, node_id=n["NodeID"]) for rank, n in enumerate(carriers)
            ]
        plans = [_Slot(rank, 0, None, None) for rank in range(pc.num_actors)]
        if not self._pins_cpus():
            return plans
        if len(nodes) == 1:
            for plan in plans:
                plan.pin = self._pin_slots(plan.rank, nodes[0]["Resources"].get("CPU", 1))
            return plans
        # Several nodes: reserve the actors' resources first, so each actor's
        # node (and hence a free core on it) is known before it starts.
        bundle = self._request()
        if not bundle:
            return plans  # nothing to reserve; Ray places the actors anywhere
        self._pg = placement_group([dict(bundle) for _ in plans], strategy="PACK")
        try:
            ray.get(self._pg.ready(), timeout=pc.call_timeout_s)
        except GetTimeoutError:
            raise RuntimeError(
                f"cannot place {len(plans)} actors of {bundle} within "
                f"population.call_timeout_s={pc.call_timeout_s}s; cluster resources: "
                f"{ray.cluster_resources()}"
            ) from None
        for plan in plans:
            plan.bundle = plan.rank
        self._assign_bundle_pins(plans)
        return plans

    def _assign_bundle_pins(self, plans: list[_Slot]) -> None:
        """Distinct cores for the bundles that share a node, in bundle order."""
        if self._pg is None:
            return
        table = placement_group_table(self._pg).get("bundles_to_node_id", {})
        cpus = {n["NodeID"]: n["Resources"].get("CPU", 1) for n in ray.nodes() if n.get("Alive")}
        seen: dict[str, int] = {}
        for plan in sorted(plans, key=lambda p: p.bundle if p.bundle is not None else -1):
            node = table.get(plan.bundle)
            if node is None or plan.bundle is None:
                continue  # bundle being rescheduled: keep the previous cores
            plan.node_id = node
            plan.pin = self._pin_slots(seen.get(node, 0), cpus.get(node, 1))
            seen[node] = seen.get(node, 0) + 1

    def _spawn(self, slot: _Slot) -> None:
        """Starts the actor for ``slot`` (rank, restart, node, bundle, cores)."""
        options = self._actor_options()
        if self._pc.one_actor_per_node_with is not None:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                slot.node_id, soft=False
            )
        elif slot.bundle is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self._pg, placement_group_bundle_index=slot.bundle
            )
        slot.handle = EstimatorActor.options(**options).remote(
            self.config, slot.rank, slot.restart, slot.pin
        )
        # Queued before any compute call, so it runs first; read lazily.
        slot.info_ref = slot.handle.info.remote()
        slot.info = None
        slot.in_flight = 0
        slot.last_progress = time.monotonic()
        slot.unavailable_since = None

    def _capacity(self) -> int:
        """How many actors the alive nodes could host at once (ignoring current load)."""
        request = self._request()
        total = 0
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            have = node["Resources"]
            if not request:
                return sys.maxsize
            total += int(min(have.get(name, 0) / amount for name, amount in request.items()))
        return total

    def _start_actors(self) -> None:
        pc = self._pc
        capacity = self._capacity()
        if pc.one_actor_per_node_with is None and capacity < pc.num_actors:
            # Not fatal: an autoscaler may add nodes. But say so now, not after the timeout.
            log.warning(
                "the Ray cluster can host %d of %d actors needing %s each (cluster resources: "
                "%s); the others wait up to population.call_timeout_s=%ss for resources",
                capacity,
                pc.num_actors,
                self._request(),
                ray.cluster_resources(),
                pc.call_timeout_s,
            )
        for slot in self._plan():
            self._spawn(slot)
            self._slots[slot.rank] = slot
            self.dropped_stale_per_actor[slot.rank] = 0
        refs = [slot.info_ref for slot in self._slots.values()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=pc.call_timeout_s)
        ready_set = set(ready)
        for slot in self._slots.values():
            if slot.info_ref not in ready_set:
                raise RuntimeError(
                    f"actor {slot.rank} did not start within population.call_timeout_s="
                    f"{pc.call_timeout_s}s; each actor needs {self._request()}, the cluster "
                    f"has {ray.cluster_resources()} in all"
                )
            try:
                slot.info = ray.get(slot.info_ref, timeout=pc.call_timeout_s)
            except RayActorError as err:
                raise RuntimeError(f"actor {slot.rank} failed to start: {err}") from err
        first = self._slots[min(self._slots)].info
        assert first is not None
        self._steps_per_estimate = int(first["steps_per_estimate"])

    # ------------------------------------------------------------------ Population

    @property
    def num_live(self) -> int:
        """Actors serving a rank now (replacements included)."""
        return len(self._slots)

    @property
    def steps_per_estimate(self) -> int:
        """Inner steps behind one estimate (every task, antithetic member and truncation)."""
        return self._steps_per_estimate

    def gather(self, theta: Any, version: int) -> Gathered:
        """Estimates for the update that produces version ``version + 1``.

        Args:
          theta: theta of version ``version`` as host numpy arrays.
          version: the learner's version.

        Returns:
          Sync mode: one estimate per live actor, in rank order. Async mode:
          ``batch_size`` accepted estimates in completion order, their
          staleness, the estimates dropped as too stale, and the actors
          replaced meanwhile.
        """
        if self._closed:
            raise RuntimeError("gather() on a closed RayPopulation")
        self._put_theta(theta, version)
        gathered = (
            self._gather_sync(version) if self._pc.mode == "sync" else self._gather_async(version)
        )
        # Replacements since the last gather (trajectory_phases() may replace too).
        self._restarted = 0
        return gathered

    def trajectory_phases(self) -> list[np.ndarray]:
        """Every live actor's task phases (iteration / length), in rank order.

        An actor that turns out to be dead is replaced and left out.
        """
        refs = {rank: slot.handle.trajectory_phases.remote() for rank, slot in self._slots.items()}
        phases = []
        for rank, ref in sorted(refs.items()):
            slot = self._slots.get(rank)
            try:
                phases.append(np.asarray(ray.get(ref, timeout=self._pc.call_timeout_s)))
            except (GetTimeoutError, RayActorError) as err:
                if slot is not None and not isinstance(err, ActorUnavailableError):
                    self._replace(slot, f"trajectory_phases() failed: {err!r}")
        return phases

    @property
    def actors(self) -> list[Any]:
        """The live actors' handles, in rank order."""
        return [slot.handle for slot in self._ordered_slots()]

    def actor_info(self) -> list[dict[str, Any]]:
        """Each live actor's :meth:`EstimatorActor.info`, in rank order."""
        return [info for slot in self._ordered_slots() if (info := self._info(slot)) is not None]

    @property
    def per_actor(self) -> list[ActorStats]:
        """Per-rank bookkeeping: restarts, estimates, drops, placement."""
        stats = []
        for slot in self._ordered_slots():
            info = self._info(slot, timeout=0.0) or {}
            stats.append(
                ActorStats(
                    slot.rank,
                    slot.restart,
                    slot.estimates,
                    slot.dropped_stale,
                    info.get("node_id"),
                    info.get("pid"),
                    info.get("pinned_cores"),
                )
            )
        return stats

    def close(self) -> None:
        """Kills the actors and releases their reservations (idempotent).

        Stops the Ray instance too, if this population started it.
        """
        if self._closed:
            return
        self._closed = True
        self._inflight.clear()
        self._theta_ref = None
        if ray.is_initialized():
            for slot in self._slots.values():
                if slot.handle is not None:
                    try:
                        ray.kill(slot.handle, no_restart=True)
                    except Exception as err:  # already gone: nothing to release
                        log.debug("killing actor %d: %r", slot.rank, err)
            if self._pg is not None:
                try:
                    remove_placement_group(self._pg)
                except Exception as err:
                    log.debug("removing the placement group: %r", err)
        self._slots.clear()
        self._pg = None
        self._runtime.shutdown()

    def __enter__(self) -> RayPopulation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _ordered_slots(self) -> list[_Slot]:
        return [self._slots[rank] for rank in sorted(self._slots)]

    def _info(self, slot: _Slot, timeout: float | None = None) -> dict[str, Any] | None:
        if slot.info is None:
            wait = self._pc.call_timeout_s if timeout is None else timeout
            ready, _ = ray.wait([slot.info_ref], timeout=wait)
            if not ready:
                return None
            try:
                slot.info = ray.get(slot.info_ref, timeout=self._pc.call_timeout_s)
            except RayActorError:
                return None
        return slot.info

    def _put_theta(self, theta: Any, version: int) -> None:
        # One put per version: repeated gathers of one version (a round whose
        # estimates were all unusable) reuse the ref.
        if self._theta_version != version or self._theta_ref is None:
            self._theta_ref = ray.put(theta)
            self._theta_version = version
            self.num_puts += 1

    def _submit(self, slot: _Slot) -> None:
        assert self._theta_version is not None
        ref = slot.handle.compute.remote(self._theta_ref, self._theta_version)
        if slot.in_flight == 0 and slot.unavailable_since is None:
            slot.last_progress = time.monotonic()
        slot.in_flight += 1
        self._inflight[ref] = _Call(slot.rank, slot.restart, self._theta_version)

    def _deadline(self, slot: _Slot) -> float:
        start = slot.last_progress if slot.unavailable_since is None else slot.unavailable_since
        return start + self._pc.call_timeout_s

    def _wait_one(self) -> tuple[_Call, Estimate] | None:
        """Waits for the next finished call; None if it brought no estimate.

        Dead and timed-out actors are replaced on the way; the caller then
        resubmits to whichever actors need work.
        """
        if not self._inflight:
            return None
        busy = [slot for slot in self._slots.values() if slot.in_flight > 0]
        now = time.monotonic()
        timeout = min((self._deadline(s) for s in busy), default=now + self._pc.call_timeout_s)
        ready, _ = ray.wait(list(self._inflight), num_returns=1, timeout=max(0.0, timeout - now))
        if not ready:
            now = time.monotonic()
            for slot in busy:
                if self._slots.get(slot.rank) is slot and now >= self._deadline(slot):
                    self._replace(
                        slot,
                        f"no estimate within population.call_timeout_s={self._pc.call_timeout_s}s",
                    )
            return None
        ref = ready[0]
        call = self._inflight.pop(ref)
        slot = self._slots.get(call.rank)
        if slot is None or slot.restart != call.restart:
            return None  # a late reply of a replaced actor: its rank has moved on
        slot.in_flight -= 1
        try:
            estimate = ray.get(ref, timeout=self._pc.call_timeout_s)
        except ActorUnavailableError as err:
            # Transient (e.g. a network blip): retried, but the deadline stands.
            if slot.unavailable_since is None:
                slot.unavailable_since = time.monotonic()
            log.debug("actor %d unavailable, retrying: %r", slot.rank, err)
            time.sleep(_UNAVAILABLE_BACKOFF_S)
            return None
        except RayActorError as err:
            self._replace(slot, repr(err))
            return None
        slot.last_progress = time.monotonic()
        slot.unavailable_since = None
        slot.estimates += 1
        return call, estimate

    def _replace(self, slot: _Slot, reason: str) -> None:
        """Replaces the actor serving ``slot`` by a fresh one with ``restart + 1``.

        With ``one_actor_per_node_with``, the replacement goes to the same node
        if it is alive, else to a carrier node without an actor; if there is
        none, the rank is retired and the population goes on without it.
        """
        pc = self._pc
        # Its in-flight estimates are lost.
        for ref in [
            r for r, c in self._inflight.items() if (c.rank, c.restart) == (slot.rank, slot.restart)
        ]:
            del self._inflight[ref]
        try:
            ray.kill(slot.handle, no_restart=True)
        except Exception as err:  # already dead
            log.debug("killing lost actor %d: %r", slot.rank, err)
        if pc.one_actor_per_node_with is not None and not self._move_to_live_carrier(slot):
            del self._slots[slot.rank]
            log.warning(
                "actor %d was lost with its node %s (%s) and no other node carrying %r is "
                "free; going on with %d actor(s)",
                slot.rank,
                slot.node_id,
                reason,
                pc.one_actor_per_node_with,
                len(self._slots),
            )
            if not self._slots:
                raise RuntimeError(
                    f"every node carrying {pc.one_actor_per_node_with!r} is gone: no actor left"
                )
            return
        if self.num_restarts >= pc.max_actor_restarts:
            raise RuntimeError(
                f"actor {slot.rank} (restart {slot.restart}) was lost ({reason}) after "
                f"{self.num_restarts} actor replacement(s) in this run; "
                f"population.max_actor_restarts={pc.max_actor_restarts}: giving up"
            )
        old_restart = slot.restart
        if slot.bundle is not None:
            # The bundle may have moved with a lost node: recompute the cores.
            self._assign_bundle_pins(list(self._slots.values()))
        self.num_restarts += 1
        self._restarted += 1
        slot.restart = old_restart + 1
        self._spawn(slot)
        log.warning(
            "actor %d (restart %d) was lost: %s; replaced it with restart %d, its inner "
            "problems restart at new offsets (%d/%d replacements)",
            slot.rank,
            old_restart,
            reason,
            slot.restart,
            self.num_restarts,
            pc.max_actor_restarts,
        )

    def _move_to_live_carrier(self, slot: _Slot) -> bool:
        """Keeps ``slot`` on its node if alive, else moves it to a free carrier node."""
        resource = self._pc.one_actor_per_node_with
        carriers = [
            n["NodeID"]
            for n in ray.nodes()
            if n.get("Alive") and n["Resources"].get(resource, 0) > 0
        ]
        if slot.node_id in carriers:
            return True
        taken = {other.node_id for other in self._slots.values() if other is not slot}
        free = [node for node in carriers if node not in taken]
        if not free:
            return False
        slot.node_id = free[0]
        return True

    def _gather_sync(self, version: int) -> Gathered:
        results: dict[int, Estimate] = {}
        dropped = 0

        def feed() -> None:
            # An actor without a result and without work gets this version:
            # at the start, after a replacement, after a transient error, or
            # after a leftover of an interrupted earlier gather came back.
            for slot in list(self._slots.values()):
                if slot.rank not in results and slot.in_flight == 0:
                    self._submit(slot)

        feed()
        while any(rank not in results for rank in self._slots):
            got = self._wait_one()
            if got is not None:
                call, estimate = got
                if call.version == version and call.rank not in results:
                    results[call.rank] = estimate
                else:
                    # A leftover of an interrupted earlier gather: too stale for sync.
                    dropped += 1
                    self._count_stale(call.rank)
            feed()
        estimates = [results[rank] for rank in sorted(results) if rank in self._slots]
        return Gathered(estimates, [0] * len(estimates), dropped, self._restarted)

    def _count_stale(self, rank: int) -> None:
        if rank in self._slots:
            self._slots[rank].dropped_stale += 1
        self.dropped_stale_per_actor[rank] = self.dropped_stale_per_actor.get(rank, 0) + 1

    def _top_up(self) -> None:
        for slot in list(self._slots.values()):
            while slot.in_flight < self._pc.calls_in_flight:
                self._submit(slot)

    def _gather_async(self, version: int) -> Gathered:
        accepted: list[Estimate] = []
        staleness: list[int] = []
        dropped = 0
        self._top_up()
        while len(accepted) < self._pc.batch_size:
            got = self._wait_one()
            # The finished actor goes straight back to work on the newest theta.
            self._top_up()
            if got is None:
                continue
            call, estimate = got
            stale = version - call.version
            if stale > self._pc.max_staleness:
                dropped += 1
                self._count_stale(call.rank)
                continue
            accepted.append(estimate)
            staleness.append(stale)
        return Gathered(accepted, staleness, dropped, self._restarted)
