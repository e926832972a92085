"""Where the population's actors run: a pure plan from a snapshot of the cluster's nodes.

Nothing here talks to Ray. The caller turns ``ray.nodes()`` into
:class:`NodeSnapshot` records (:meth:`NodeSnapshot.from_ray`) and the functions
below decide, from those and the run's
:class:`~popmeta.config.PopulationConfig`: the ranks and, with
``one_actor_per_node_with: R``, one target node per alive node carrying R;
whether CPUs are pinned and which core slots each actor gets (distinct slots
for actors that share a node); the resources one actor requests and how many
such actors the cluster holds; the placement-group bundles a pinned
multi-node population reserves; and the node that hosts a replacement in a
one-per-node population. Pinning applies to CPU-only actors only:
accelerator hosts and whole-node actors need all of their node's cores. Core
slots are positions among the cores an actor process may use, not core ids.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from popmeta.config import PopulationConfig

__all__ = [
    "ActorPlacement",
    "NodeSnapshot",
    "PlacementError",
    "PlacementPlan",
    "actor_request",
    "assign_bundle_pins",
    "capacity",
    "capacity_shortfall",
    "pin_slots",
    "pins_cpus",
    "plan_placement",
    "replacement_node",
    "total_resources",
]


class PlacementError(RuntimeError):
    """The cluster cannot host the population as configured."""


@dataclasses.dataclass(frozen=True)
class NodeSnapshot:
    """One Ray node as the plan sees it.

    Attributes:
      node_id: the node's id.
      alive: whether the node is alive.
      resources: the node's total resources (``CPU``, ``GPU``, custom ones).
    """

    node_id: str
    alive: bool
    resources: Mapping[str, float]

    @classmethod
    def from_ray(cls, node: Mapping[str, Any]) -> NodeSnapshot:
        """Reads one entry of ``ray.nodes()`` (keys ``NodeID``, ``Alive``, ``Resources``)."""
        return cls(
            node_id=str(node["NodeID"]),
            alive=bool(node.get("Alive", False)),
            resources=dict(node.get("Resources") or {}),
        )


@dataclasses.dataclass(frozen=True)
class ActorPlacement:
    """Where one actor rank runs.

    Attributes:
      rank: the actor's rank.
      node_id: the node it must run on (one actor per node), or the node of its
        bundle once known; None: wherever Ray schedules it.
      bundle: its placement-group bundle index, or None without a placement group.
      pin: core slots to pin the actor to, or None to leave affinity alone.
    """

    rank: int
    node_id: str | None = None
    bundle: int | None = None
    pin: tuple[int, ...] | None = None


#: How actors are scheduled: anywhere Ray likes, on their ``node_id`` by hard
#: node affinity, or into their placement-group ``bundle``.
Strategy = Literal["default", "node_affinity", "placement_group"]


@dataclasses.dataclass(frozen=True)
class PlacementPlan:
    """The population's placement before any actor starts.

    Attributes:
      actors: one placement per rank, in rank order (ranks 0..n-1).
      strategy: how the actors are scheduled (see :data:`Strategy`).
      request: resources one actor asks for, in node-resource names.
      bundles: placement-group bundles to reserve (``PACK``) before spawning;
        empty unless ``strategy == "placement_group"``. Bundle i is rank i's.
    """

    actors: tuple[ActorPlacement, ...]
    strategy: Strategy
    request: Mapping[str, float]
    bundles: tuple[Mapping[str, float], ...] = ()


def actor_request(population: PopulationConfig) -> dict[str, float]:
    """Resources one actor asks for, in node-resource names (zero amounts left out)."""
    request = {"CPU": population.num_cpus, "GPU": population.num_gpus, **population.resources}
    return {name: amount for name, amount in request.items() if amount > 0}


def pins_cpus(population: PopulationConfig) -> bool:
    """Whether actors are pinned to cores: ``pin_cpus`` on CPU-only, not-per-node actors."""
    return (
        population.pin_cpus
        and population.num_gpus == 0
        and not population.resources
        and population.one_actor_per_node_with is None
    )


def pin_slots(index_on_node: int, node_cpus: float, cpus_per_actor: float) -> tuple[int, ...]:
    """Core slots of the ``index_on_node``-th actor on a node with ``node_cpus`` CPUs.

    Each actor takes ``max(1, int(cpus_per_actor))`` consecutive slots; slots
    wrap around the node's CPU count, so a node asked to host more actors than
    it has cores shares cores rather than failing.
    """
    per_actor = max(1, int(cpus_per_actor))
    cpus = max(1, int(node_cpus))
    return tuple((index_on_node * per_actor + j) % cpus for j in range(per_actor))


def capacity(nodes: Iterable[NodeSnapshot], request: Mapping[str, float]) -> int:
    """How many actors of ``request`` the alive nodes could host at once (ignoring load).

    An empty request fits anywhere: ``sys.maxsize``.
    """
    if not request:
        return sys.maxsize
    return sum(
        int(min(node.resources.get(name, 0) / amount for name, amount in request.items()))
        for node in nodes
        if node.alive
    )


def capacity_shortfall(
    population: PopulationConfig, nodes: Sequence[NodeSnapshot], request: Mapping[str, float]
) -> str | None:
    """A warning if the alive nodes cannot host ``num_actors`` actors of ``request`` at once.

    None when they can, and for one-actor-per-node populations (sized by the
    nodes themselves).
    """
    fits = capacity(nodes, request)
    if population.one_actor_per_node_with is not None or fits >= population.num_actors:
        return None
    return (
        f"the Ray cluster can host {fits} of {population.num_actors} actors needing "
        f"{dict(request)} each (cluster resources: {total_resources(nodes)}); the others wait "
        f"up to population.call_timeout_s={population.call_timeout_s}s for resources"
    )


def total_resources(nodes: Iterable[NodeSnapshot]) -> dict[str, float]:
    """The alive nodes' resources summed, for error messages."""
    total: dict[str, float] = {}
    for node in nodes:
        if node.alive:
            for name, amount in node.resources.items():
                total[name] = total.get(name, 0.0) + amount
    return total


def _carriers(nodes: Iterable[NodeSnapshot], resource: str) -> list[str]:
    return [n.node_id for n in nodes if n.alive and n.resources.get(resource, 0) > 0]


def plan_placement(population: PopulationConfig, nodes: Sequence[NodeSnapshot]) -> PlacementPlan:
    """The ranks, their nodes, bundles and core slots, before any actor starts.

    Args:
      population: the run's population config.
      nodes: the cluster's nodes (dead ones are ignored).

    Returns:
      The plan. With ``strategy == "placement_group"`` the actors' nodes and
      pins are still unknown: reserve ``bundles``, then complete the plan with
      :func:`assign_bundle_pins`.

    Raises:
      PlacementError: ``one_actor_per_node_with`` names a resource no alive node carries.
    """
    request = actor_request(population)
    alive = [n for n in nodes if n.alive]
    resource = population.one_actor_per_node_with
    if resource is not None:
        carriers = _carriers(alive, resource)
        if not carriers:
            raise PlacementError(
                f"population.one_actor_per_node_with={resource!r}: no alive Ray node "
                f"carries resource {resource!r}; cluster resources: {total_resources(alive)}"
            )
        actors = tuple(ActorPlacement(rank, node_id=n) for rank, n in enumerate(carriers))
        return PlacementPlan(actors, "node_affinity", request)
    ranks = range(population.num_actors)
    anywhere = PlacementPlan(tuple(ActorPlacement(r) for r in ranks), "default", request)
    if not pins_cpus(population):
        return anywhere
    if len(alive) == 1:
        # One node: every actor lands there, so its slots are known now.
        cpus = alive[0].resources.get("CPU", 1)
        actors = tuple(
            ActorPlacement(r, pin=pin_slots(r, cpus, population.num_cpus)) for r in ranks
        )
        return PlacementPlan(actors, "default", request)
    if not request:
        # Zero-CPU actors: nothing to reserve, so their nodes stay unknown; unpinned.
        return anywhere
    # Several nodes: the resources are reserved first, so that each actor's node
    # (and hence a free core on it) is known before the actor starts.
    actors = tuple(ActorPlacement(r, bundle=r) for r in ranks)
    bundles = tuple(dict(request) for _ in ranks)
    return PlacementPlan(actors, "placement_group", request, bundles)


def assign_bundle_pins(
    actors: Sequence[ActorPlacement],
    bundle_nodes: Mapping[int, str],
    nodes: Iterable[NodeSnapshot],
    cpus_per_actor: float,
) -> list[ActorPlacement]:
    """Each bundle's node, and distinct core slots for the bundles that share a node.

    Slots go to bundles in bundle order, round-robin over their node's CPU
    count. An actor without a bundle, or whose bundle has no node in
    ``bundle_nodes`` (being rescheduled after its node was lost), keeps its
    previous node and pin and takes no slot.

    Args:
      actors: the placements to complete (any order).
      bundle_nodes: bundle index -> node id, as the placement group reports it.
      nodes: the cluster's nodes, for their CPU counts.
      cpus_per_actor: CPUs each actor declares.

    Returns:
      The placements in the order given, with node and pin filled in.
    """
    cpus = {n.node_id: n.resources.get("CPU", 1) for n in nodes if n.alive}
    seen: dict[str, int] = {}
    done: dict[int, ActorPlacement] = {}
    with_bundle = [a for a in actors if a.bundle is not None]
    for actor in sorted(with_bundle, key=lambda a: a.bundle if a.bundle is not None else -1):
        node = bundle_nodes.get(actor.bundle) if actor.bundle is not None else None
        if node is None:
            continue
        index = seen.get(node, 0)
        seen[node] = index + 1
        pin = pin_slots(index, cpus.get(node, 1), cpus_per_actor)
        done[actor.rank] = dataclasses.replace(actor, node_id=node, pin=pin)
    return [done.get(a.rank, a) for a in actors]


def replacement_node(
    resource: str,
    current: str | None,
    taken: Iterable[str | None],
    nodes: Iterable[NodeSnapshot],
) -> str | None:
    """The node for the replacement of a lost one-per-node actor.

    Args:
      resource: ``one_actor_per_node_with``.
      current: the lost actor's node.
      taken: the nodes of the other live actors.
      nodes: the cluster's nodes.

    Returns:
      ``current`` if it is still an alive carrier of ``resource`` (the actor
      died, not its node); else the first alive carrier without an actor; None
      if there is none (the rank is then retired).
    """
    carriers = _carriers(nodes, resource)
    if current in carriers:
        return current
    busy = set(taken)
    return next((node for node in carriers if node not in busy), None)
