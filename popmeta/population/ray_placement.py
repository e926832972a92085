"""The placement plan carried out in Ray: the reserved bundles and each actor's scheduling.

:mod:`popmeta.population.placement` decides where actors go from a snapshot
of the nodes and never talks to Ray; :class:`RayPlacement` takes that plan to
Ray (a placement group, scheduling strategies) and follows the cluster as it
changes: a bundle that moved with a lost node, a replacement's node when one
actor runs per node. It knows nothing of calls or deadlines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

import ray
import ray.util
from ray.exceptions import GetTimeoutError
from ray.util import scheduling_strategies as strategies
from ray.util.placement_group import PlacementGroup

from popmeta.config import PopulationConfig
from popmeta.population import placement as plans
from popmeta.population.placement import ActorPlacement, NodeSnapshot

__all__ = ["RayPlacement"]

log = logging.getLogger("popmeta")


def _nodes() -> list[NodeSnapshot]:
    return [NodeSnapshot.from_ray(node) for node in ray.nodes()]


class RayPlacement:
    """Where each rank's actor runs, and the Ray options that put it there.

    Args:
      population: resources and placement of the actors.

    Raises:
      PlacementError: the cluster cannot host the population as configured.
    """

    def __init__(self, population: PopulationConfig):
        self._pc = population
        nodes = _nodes()
        plan = plans.plan_placement(population, nodes)
        shortfall = plans.capacity_shortfall(population, nodes, plan.request)
        if shortfall is not None:
            # Not fatal: an autoscaler may add nodes. But say so now, not after the timeout.
            log.warning("%s", shortfall)
        self.request = plan.request
        self._strategy = plan.strategy
        self._bundles = plan.bundles
        self._planned = list(plan.actors)
        self._pg: PlacementGroup | None = None

    def reserve(self, timeout_s: float) -> list[ActorPlacement] | None:
        """Reserves the plan's bundles, if any; the placement of each rank, or None on timeout."""
        if not self._bundles:
            return self._planned
        self._pg = ray.util.placement_group([dict(b) for b in self._bundles], strategy="PACK")
        try:
            ray.get(self._pg.ready(), timeout=timeout_s)
        except GetTimeoutError:
            return None
        return self.with_bundle_nodes(self._planned)

    def with_bundle_nodes(self, placements: list[ActorPlacement]) -> list[ActorPlacement]:
        """``placements`` with the node and cores of their bundles as Ray placed them now."""
        assert self._pg is not None
        table = ray.util.placement_group_table(self._pg).get("bundles_to_node_id", {})
        return plans.assign_bundle_pins(placements, table, _nodes(), self._pc.num_cpus)

    def options(self, placement: ActorPlacement) -> dict[str, Any]:
        """The resources and scheduling strategy of the actor at ``placement``, for ``.options``."""
        pc = self._pc
        options: dict[str, Any] = {
            "num_cpus": pc.num_cpus,
            "num_gpus": pc.num_gpus,
            "resources": dict(pc.resources),
        }
        if self._strategy == "node_affinity":
            options["scheduling_strategy"] = strategies.NodeAffinitySchedulingStrategy(
                placement.node_id, soft=False
            )
        elif self._strategy == "placement_group" and placement.bundle is not None:
            options["scheduling_strategy"] = strategies.PlacementGroupSchedulingStrategy(
                self._pg, placement_group_bundle_index=placement.bundle
            )
        return options

    def moved(self, lost: ActorPlacement, others: list[ActorPlacement]) -> ActorPlacement | None:
        """Where the replacement of the actor at ``lost`` goes, ``others`` being the live ones.

        With one actor per node the replacement stays on its node if that is
        alive, else goes to a free carrier node; None when there is none.
        Otherwise it takes ``lost``'s place.
        """
        resource = self._pc.one_actor_per_node_with
        if resource is None:
            return lost
        node = plans.replacement_node(
            resource, lost.node_id, [other.node_id for other in others], _nodes()
        )
        return None if node is None else dataclasses.replace(lost, node_id=node)

    def close(self) -> None:
        """Removes the placement group (idempotent)."""
        if self._pg is not None:
            # Failing means Ray already dropped it: nothing left to release.
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(self._pg)
        self._pg = None
