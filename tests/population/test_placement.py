"""The placement plan, without Ray: ranks, nodes, pins, capacity and replacement nodes."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from popmeta.config import PopulationConfig
from popmeta.population.placement import (
    ActorPlacement,
    NodeSnapshot,
    PlacementError,
    actor_request,
    assign_bundle_pins,
    capacity,
    pin_slots,
    pins_cpus,
    plan_placement,
    replacement_node,
    total_resources,
)


def node(node_id: str, alive: bool = True, **resources: float) -> NodeSnapshot:
    return NodeSnapshot(node_id, alive, resources)


def population(**fields: Any) -> PopulationConfig:
    return PopulationConfig(**{"num_actors": 2, **fields})


# ---------------------------------------------------------------------- snapshot


def test_snapshot_reads_a_ray_nodes_entry():
    entry = {"NodeID": "abc", "Alive": True, "Resources": {"CPU": 4.0, "TPU": 4.0}, "x": 1}
    assert NodeSnapshot.from_ray(entry) == NodeSnapshot("abc", True, {"CPU": 4.0, "TPU": 4.0})
    dead = NodeSnapshot.from_ray({"NodeID": "d", "Alive": False, "Resources": {}})
    assert not dead.alive and dead.resources == {}


def test_placement_module_does_not_import_ray():
    code = "import popmeta.population.placement, sys; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------- request & pinning


@pytest.mark.parametrize(
    ("fields", "request_"),
    [
        ({}, {"CPU": 1.0}),
        ({"num_cpus": 0.5, "num_gpus": 1.0}, {"CPU": 0.5, "GPU": 1.0}),
        ({"num_cpus": 0.0, "resources": {"TPU": 4.0, "zero": 0.0}}, {"TPU": 4.0}),
        ({"num_cpus": 0.0}, {}),
    ],
)
def test_actor_request_names_node_resources_and_leaves_zeros_out(fields, request_):
    assert actor_request(population(**fields)) == request_


@pytest.mark.parametrize(
    ("fields", "pinned"),
    [
        ({}, True),
        ({"pin_cpus": False}, False),
        ({"num_gpus": 1.0}, False),
        ({"resources": {"TPU": 1.0}}, False),
        ({"one_actor_per_node_with": "TPU"}, False),
    ],
)
def test_only_cpu_only_actors_not_one_per_node_are_pinned(fields, pinned):
    assert pins_cpus(population(**fields)) is pinned


@pytest.mark.parametrize(
    ("index", "node_cpus", "per_actor", "slots"),
    [
        (0, 4, 1, (0,)),
        (3, 4, 1, (3,)),
        (4, 4, 1, (0,)),  # more actors than cores: wraps around
        (5, 4, 1, (1,)),
        (1, 8, 2, (2, 3)),
        (1, 3, 2, (2, 0)),  # an actor's slots wrap too
        (2, 4, 0.5, (2,)),  # fractional CPUs still take one slot
        (1, 0, 1, (0,)),  # a node reporting no CPUs counts as one
    ],
)
def test_pin_slots_are_round_robin_over_the_node_cpus(index, node_cpus, per_actor, slots):
    assert pin_slots(index, node_cpus, per_actor) == slots


# ---------------------------------------------------------------------- capacity


def test_capacity_counts_what_every_alive_node_can_host():
    nodes = [node("a", CPU=4, TPU=4), node("b", CPU=2), node("c", alive=False, CPU=64)]
    assert capacity(nodes, {"CPU": 1.0}) == 6
    assert capacity(nodes, {"CPU": 1.5}) == 3
    assert capacity(nodes, {"CPU": 1.0, "TPU": 1.0}) == 4
    assert capacity(nodes, {"no_such_accelerator": 1.0}) == 0
    assert capacity(nodes, {}) == sys.maxsize
    assert capacity([], {"CPU": 1.0}) == 0


def test_total_resources_sums_alive_nodes_only():
    nodes = [node("a", CPU=4, TPU=4), node("b", CPU=2), node("c", alive=False, CPU=64)]
    assert total_resources(nodes) == {"CPU": 6, "TPU": 4}


# ---------------------------------------------------------------------- plans


def test_one_node_pins_each_actor_to_its_own_cores_without_reserving():
    plan = plan_placement(population(num_actors=3), [node("a", CPU=4)])
    assert plan.strategy == "default" and plan.bundles == ()
    assert plan.actors == (
        ActorPlacement(0, pin=(0,)),
        ActorPlacement(1, pin=(1,)),
        ActorPlacement(2, pin=(2,)),
    )
    assert plan.request == {"CPU": 1.0}


def test_one_node_pins_wrap_around_its_cpus():
    plan = plan_placement(population(num_actors=5, num_cpus=2.0), [node("a", CPU=4)])
    assert [a.pin for a in plan.actors] == [(0, 1), (2, 3), (0, 1), (2, 3), (0, 1)]


def test_dead_nodes_do_not_count_as_nodes():
    nodes = [node("dead", alive=False, CPU=8), node("a", CPU=2)]
    plan = plan_placement(population(num_actors=2), nodes)
    assert plan.strategy == "default" and [a.pin for a in plan.actors] == [(0,), (1,)]


@pytest.mark.parametrize(
    "fields", [{"pin_cpus": False}, {"num_gpus": 1.0}, {"resources": {"accel": 1.0}}]
)
def test_unpinned_actors_go_anywhere(fields):
    for nodes in ([node("a", CPU=4)], [node("a", CPU=4), node("b", CPU=4)]):
        plan = plan_placement(population(num_actors=3, **fields), nodes)
        assert plan.strategy == "default" and plan.bundles == ()
        assert plan.actors == tuple(ActorPlacement(r) for r in range(3))


def test_zero_cpu_actors_are_pinned_on_one_node_but_not_reserved_on_several():
    one = plan_placement(population(num_cpus=0.0), [node("a", CPU=2)])
    assert [a.pin for a in one.actors] == [(0,), (1,)]
    several = plan_placement(population(num_cpus=0.0), [node("a", CPU=2), node("b", CPU=2)])
    assert several.strategy == "default" and several.bundles == ()
    assert all(a.pin is None for a in several.actors)


def test_pinned_actors_on_several_nodes_reserve_one_bundle_each():
    plan = plan_placement(population(num_actors=3), [node("a", CPU=2), node("b", CPU=2)])
    assert plan.strategy == "placement_group"
    assert plan.bundles == ({"CPU": 1.0},) * 3
    assert plan.actors == tuple(ActorPlacement(r, bundle=r) for r in range(3))


def test_one_actor_per_carrier_node_in_snapshot_order():
    nodes = [
        node("head", CPU=1),
        node("tpu_a", CPU=2, TPU=4),
        node("tpu_dead", alive=False, CPU=2, TPU=4),
        node("tpu_b", CPU=2, TPU=4),
    ]
    config = population(num_actors=5, one_actor_per_node_with="TPU", resources={"TPU": 4.0})
    plan = plan_placement(config, nodes)
    assert plan.strategy == "node_affinity" and plan.bundles == ()
    assert plan.actors == (ActorPlacement(0, node_id="tpu_a"), ActorPlacement(1, node_id="tpu_b"))
    assert plan.request == {"CPU": 1.0, "TPU": 4.0}


def test_one_actor_per_node_without_a_carrier_fails_clearly():
    nodes = [node("head", CPU=1), node("tpu_dead", alive=False, TPU=4)]
    with pytest.raises(PlacementError, match="no alive Ray node carries resource 'TPU'"):
        plan_placement(population(one_actor_per_node_with="TPU"), nodes)
    assert issubclass(PlacementError, RuntimeError)


# ---------------------------------------------------------------------- bundles


def test_bundles_sharing_a_node_get_distinct_cores_in_bundle_order():
    nodes = [node("a", CPU=2), node("b", CPU=4)]
    actors = [ActorPlacement(r, bundle=r) for r in range(4)]
    done = assign_bundle_pins(actors, {0: "a", 1: "b", 2: "a", 3: "a"}, nodes, 1.0)
    assert done == [
        ActorPlacement(0, node_id="a", bundle=0, pin=(0,)),
        ActorPlacement(1, node_id="b", bundle=1, pin=(0,)),
        ActorPlacement(2, node_id="a", bundle=2, pin=(1,)),
        ActorPlacement(3, node_id="a", bundle=3, pin=(0,)),  # a has 2 CPUs: wraps
    ]


def test_bundle_pins_follow_bundle_order_not_the_order_given():
    nodes = [node("a", CPU=4)]
    actors = [ActorPlacement(1, bundle=1), ActorPlacement(0, bundle=0)]
    done = assign_bundle_pins(actors, {0: "a", 1: "a"}, nodes, 2.0)
    assert [(a.rank, a.pin) for a in done] == [(1, (2, 3)), (0, (0, 1))]


def test_a_bundle_being_rescheduled_keeps_its_previous_node_and_cores():
    nodes = [node("a", CPU=4), node("gone", alive=False, CPU=4)]
    actors = [
        ActorPlacement(0, node_id="gone", bundle=0, pin=(0,)),
        ActorPlacement(1, node_id="a", bundle=1, pin=(0,)),
        ActorPlacement(2),  # no bundle: untouched
    ]
    done = assign_bundle_pins(actors, {1: "a"}, nodes, 1.0)
    assert done == [actors[0], ActorPlacement(1, node_id="a", bundle=1, pin=(0,)), actors[2]]


def test_a_bundle_on_a_node_missing_from_the_snapshot_counts_one_cpu():
    done = assign_bundle_pins(
        [ActorPlacement(0, bundle=0), ActorPlacement(1, bundle=1)], {0: "x", 1: "x"}, [], 1.0
    )
    assert [a.pin for a in done] == [(0,), (0,)]


# ---------------------------------------------------------------------- replacement


def test_a_replacement_stays_on_its_node_while_that_node_is_alive():
    nodes = [node("a", TPU=4), node("b", TPU=4), node("c", TPU=4)]
    assert replacement_node("TPU", "a", ["b"], nodes) == "a"


def test_a_replacement_moves_to_the_first_free_alive_carrier():
    nodes = [node("a", alive=False, TPU=4), node("b", TPU=4), node("c", CPU=8), node("d", TPU=4)]
    assert replacement_node("TPU", "a", ["b"], nodes) == "d"
    assert replacement_node("TPU", "a", [], nodes) == "b"
    assert replacement_node("TPU", None, ["b"], nodes) == "d"


def test_no_free_carrier_means_no_replacement():
    nodes = [node("a", alive=False, TPU=4), node("b", TPU=4), node("c", CPU=8)]
    assert replacement_node("TPU", "a", ["b"], nodes) is None
    assert replacement_node("TPU", "a", [], []) is None
