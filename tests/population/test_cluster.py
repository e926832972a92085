"""Resources and multi-host placement on a real multi-node Ray cluster.

``ray.cluster_utils.Cluster`` runs a head and several worker nodes (each its
own raylet and object store) on this machine, all on 127.0.0.1, with fast
health checks so that a removed node is noticed in about a second. The
session's embedded instance is stopped for this module (``no_session_ray``):
one process can only be connected to one Ray cluster.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from popmeta.accelerator_memory import PREALLOCATE
from popmeta.experiment import learner_start
from popmeta.learner.learner import Learner
from popmeta.population.ray_population import RayPopulation
from tests.population import CALL_TIMEOUT_S, population_of, quiet_fork, run_updates, tiny_config

pytestmark = pytest.mark.timeout(300)

#: Health checks every 0.5 s, 3 misses: a removed node's actors fail with
#: ActorDiedError in about 1.5 s (Ray's defaults take about 15 s).
FAST_HEALTH_CHECKS = {
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 3,
    "health_check_timeout_ms": 500,
    "health_check_initial_delay_ms": 0,
}
NODE_STORE_BYTES = 80 * 2**20


class Nodes:
    """The module's cluster and its named worker nodes."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.by_name: dict[str, object] = {}

    def add(self, name: str, num_cpus: int, resources: dict[str, float], num_gpus: int = 0) -> str:
        with quiet_fork():
            node = self.cluster.add_node(
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                resources=resources,
                object_store_memory=NODE_STORE_BYTES,
            )
        self.cluster.wait_for_nodes(timeout=60)
        self.by_name[name] = node
        return node.node_id

    def id(self, name: str) -> str:
        return self.by_name[name].node_id

    def remove(self, name: str) -> None:
        self.cluster.remove_node(self.by_name.pop(name))


@pytest.fixture(scope="module")
def nodes(no_session_ray):
    """Head (1 CPU) + a TPU node (TPU: 4) + an accel_b node (accel_b: 1), joined by the driver."""
    temp_dir = tempfile.mkdtemp(prefix="pm-cl-")  # short: Ray puts Unix sockets under it
    # Ray's temp root for every node and the Cluster's address file (<root>/ray/...).
    env = pytest.MonkeyPatch()
    env.setenv("RAY_TMPDIR", temp_dir)
    # Nodes started as `ray start` starts them: workers at Ray's default niceness.
    env.delenv("RAY_worker_niceness", raising=False)
    # Set in this environment, it would reach every node's workers as if popmeta set it.
    env.delenv(PREALLOCATE, raising=False)
    cluster = Cluster()
    try:
        with quiet_fork():
            # The first node added is the head.
            cluster.add_node(
                num_cpus=1,
                include_dashboard=False,
                object_store_memory=NODE_STORE_BYTES,
                _system_config=FAST_HEALTH_CHECKS,
            )
        named = Nodes(cluster)
        named.add("tpu_a", 2, {"TPU": 4})
        named.add("accel_b", 1, {"accel_b": 1})
        ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.WARNING)
        yield named
    finally:
        ray.shutdown()
        cluster.shutdown()
        env.undo()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _nodes_of(population: RayPopulation) -> list[str]:
    return [info.node_id for info in population.describe_actors()]


def test_cluster_is_on_loopback(nodes):
    assert {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} == {"127.0.0.1"}


def test_actors_needing_tpus_land_only_on_the_tpu_node(nodes):
    config = tiny_config(num_actors=2, resources={"TPU": 1}, mode="sync")
    with population_of(config) as population:
        assert _nodes_of(population) == [nodes.id("tpu_a")] * 2
        rounds = []
        run_updates(config, population, 2, rounds.append)
        assert [[e.worker for e in g.estimates] for g in rounds] == [[0, 1], [0, 1]]


def test_an_actor_needing_a_custom_resource_lands_on_its_node(nodes):
    config = tiny_config(num_actors=1, resources={"accel_b": 1}, num_cpus=0.5)
    with population_of(config) as population:
        assert _nodes_of(population) == [nodes.id("accel_b")]
        assert len(population.gather(Learner.of(learner_start(config)).theta(), 0).estimates) == 1


def _environment_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.decode().split("=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return dict(pairs)


def test_actors_sharing_a_gpu_allocate_its_memory_as_needed(nodes):
    """Two actors of half a GPU share one chip: each starts with JAX's preallocation off
    (with its default, the second would find a quarter of the chip left), unless
    ``population.env`` sets it. The node declares a GPU; JAX computes on its CPU here."""
    nodes.add("gpu_c", 1, {}, num_gpus=1)
    try:
        for env, expected in [({}, "false"), ({PREALLOCATE: "true"}, "true")]:
            config = tiny_config(num_actors=2, num_gpus=0.5, num_cpus=0.5, mode="sync", env=env)
            with population_of(config) as population:
                infos = population.describe_actors()
                assert [info.node_id for info in infos] == [nodes.id("gpu_c")] * 2
                assert [_environment_of(info.pid).get(PREALLOCATE) for info in infos] == [
                    expected
                ] * 2
                theta = Learner.of(learner_start(config)).theta()
                assert len(population.gather(theta, 0).estimates) == 2
    finally:
        nodes.remove("gpu_c")


@pytest.mark.parametrize("how", ["--address", "RAY_ADDRESS"])
def test_cli_joins_a_running_cluster_and_leaves_it_running(nodes, tmp_path, how):
    """`popmeta train --address ...` (or RAY_ADDRESS) runs its actors on the cluster.

    The actor asks for a resource only the cluster's accel_b node has: had the
    command started an embedded instance instead, it would never be scheduled.
    """
    address = nodes.cluster.address
    args = [
        sys.executable,
        "-m",
        "popmeta.cli",
        "train",
        "--set",
        "task.kind=fixed_dim_quadratic",
        "--set",
        "task.dim=4",
        "--set",
        "learned_optimizer.kind=learnable_sgdm",
        "--set",
        "truncation.length=20",
        "--set",
        "estimator.num_tasks=2",
        "--set",
        "estimator.trunc_length=5",
        "--set",
        "eval.after_training=false",
        "--set",
        "train.num_steps=5",
        "--set",
        "train.log_every=1",
        "--set",
        "population.num_actors=1",
        "--set",
        "population.num_cpus=0.5",
        "--set",
        "population.resources={accel_b: 1}",
        "--set",
        f"population.call_timeout_s={CALL_TIMEOUT_S}",
    ]
    env = dict(os.environ)
    if how == "--address":
        args += ["--address", address]
        env.pop("RAY_ADDRESS", None)
    else:
        env["RAY_ADDRESS"] = address
    alive_before = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    result = subprocess.run(
        args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr
    assert "step 5/5" in result.stderr and "(step 5)" in result.stdout
    assert sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]) == alive_before
    # A cluster started with Ray's defaults runs workers at nice 15: the run says so.
    assert "the actors run at nice 15" in result.stdout and "RAY_worker_niceness=0" in result.stdout


def test_pinned_cpu_actors_get_distinct_cores_on_each_node(nodes):
    # CPU-only actors on several nodes: a placement group fixes each actor's
    # node before it starts, then actors sharing a node get distinct cores.
    config = tiny_config(num_actors=3, mode="sync", pin_cpus=True)
    with population_of(config) as population:
        info = population.describe_actors()
        run_updates(config, population, 1)
    assert all(i.threads_pinned for i in info)
    by_node: dict[str, list[tuple[int, ...]]] = {}
    for i in info:
        by_node.setdefault(i.node_id, []).append(tuple(i.pinned_cores))
    for cores in by_node.values():
        assert len(set(cores)) == len(cores), by_node


def test_one_actor_per_tpu_node_and_a_lost_tpu_node(nodes, caplog):
    caplog.set_level(logging.WARNING, logger="popmeta")
    nodes.add("tpu_b", 2, {"TPU": 4})
    config = tiny_config(
        one_actor_per_node_with="TPU",
        resources={"TPU": 4},
        mode="async",
        batch_size=2,
    )
    with population_of(config) as population:
        assert population.num_live == 2
        assert sorted(_nodes_of(population)) == sorted([nodes.id("tpu_a"), nodes.id("tpu_b")])
        learner = Learner.of(learner_start(config))

        def update():
            gathered = population.gather(learner.theta(), learner.version)
            learner.update(gathered.estimates)
            return gathered

        for _ in range(3):
            assert len(update().estimates) == 2
        # A TPU host goes away: no other TPU node is free, so the run goes on
        # with the actor that is left.
        nodes.remove("tpu_b")
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while population.num_live == 2:
            assert time.monotonic() < deadline, "the lost node was never noticed"
            assert len(update().estimates) == 2
        assert len(update().estimates) == 2
        assert _nodes_of(population) == [nodes.id("tpu_a")]
    assert "lost with its node" in caplog.text


@pytest.mark.parametrize("compiled_graph", [False, True], ids=["actor-calls", "compiled-graph"])
def test_actor_of_a_lost_node_is_replaced_on_another_node(nodes, caplog, compiled_graph):
    caplog.set_level(logging.WARNING, logger="popmeta")
    nodes.add(f"tpu_{compiled_graph}", 2, {"TPU": 4})
    config = tiny_config(
        num_actors=1, resources={"TPU": 1}, mode="sync", compiled_graph=compiled_graph
    )
    with population_of(config) as population:
        theta = run_updates(config, population, 1)
        (lost,) = _nodes_of(population)
        # Two TPU nodes are up: the actor's, and the one it moves to.
        tpu_nodes = [name for name in nodes.by_name if name.startswith("tpu")]
        assert len(tpu_nodes) == 2
        name = next(n for n in tpu_nodes if nodes.id(n) == lost)
        survivor = next(nodes.id(n) for n in tpu_nodes if n != name)
        nodes.remove(name)
        gathered = population.gather(theta, 1)
        assert gathered.restarted == 1 and len(gathered.estimates) == 1
        assert _nodes_of(population) == [survivor]
        assert population.describe_actors()[0].restart == 1
    assert "replaced it with restart 1" in caplog.text
