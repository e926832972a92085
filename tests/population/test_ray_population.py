"""The Ray population on one embedded Ray instance: real actors, tiny problems.

Sync runs are deterministic (bitwise, and equal to the local engine); async
runs fill every update with ``batch_size`` estimates within the staleness
bound; theta is put once per version; the population's inner problems are
spread over their trajectories; a killed actor is replaced and the run goes on.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import ray

from popmeta.actors.actor import default_compilation_cache_dir
from popmeta.actors.records import ActorInfo
from popmeta.experiment import EstimatorSections, initial_theta, learner_start
from popmeta.learner.checkpoint_layout import load_run_checkpoint
from popmeta.learner.learner import Learner
from popmeta.population import ray_population as ray_population_module
from popmeta.population.engines import describe_placement
from popmeta.population.lifecycle import ActorStartError, PopulationLostError
from popmeta.population.ray_population import RayPopulation
from popmeta.population.ray_runtime import start_ray
from popmeta.population.supervisor import ActorSupervisor
from popmeta.run_loop import train
from popmeta.xla_flags import HOST_DEVICE_COUNT_FLAG
from tests.events import read_scalars
from tests.population import (
    CALL_TIMEOUT_S,
    local_population_of,
    population_of,
    run_updates,
    tiny_config,
    tree_bytes,
)
from tests.processes import ActorKiller

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------- sync


@pytest.fixture(scope="module")
def sync_runs(ray_session, tmp_path_factory):
    """Theta after 4 sync updates from two Ray runs and the local engine, same seed."""
    steps = 4
    run_dir = tmp_path_factory.mktemp("sync")
    config = tiny_config(mode="sync", run_dir=str(run_dir), num_steps=steps)
    # Run 1: the real training loop, with the Ray population as its factory.
    result = train(config, RayPopulation, stream=io.StringIO())
    assert result.final_step == steps
    restored = load_run_checkpoint(
        result.checkpoint, Learner.of(learner_start(config)).checkpoint_tree()
    )
    # Run 2: a fresh population (fresh actor processes), the same updates.
    with population_of(config) as population:
        info = population.describe_actors()
        ray_rounds = []
        theta_ray = run_updates(config, population, steps, ray_rounds.append)
    # The in-process engine, same config.
    local = local_population_of(config)
    local_info = local.describe_actors()
    local_rounds = []
    theta_local = run_updates(config, local, steps, local_rounds.append)
    return {
        "config": config,
        "train": restored.learner.theta,
        "ray": theta_ray,
        "local": theta_local,
        "info": info,
        "ray_rounds": ray_rounds,
        "local_rounds": local_rounds,
        "local_info": local_info,
    }


def test_sync_runs_with_the_same_seed_are_bitwise_equal(sync_runs):
    assert tree_bytes(sync_runs["train"]) == tree_bytes(sync_runs["ray"])
    # ... and they did train: theta moved away from its initial value.
    assert tree_bytes(sync_runs["ray"]) != tree_bytes(
        initial_theta(EstimatorSections.of(sync_runs["config"]))
    )


def test_sync_ray_run_is_bitwise_equal_to_the_local_engine(sync_runs):
    assert tree_bytes(sync_runs["ray"]) == tree_bytes(sync_runs["local"])


def test_sync_rounds_have_one_fresh_estimate_per_rank_and_nothing_dropped(sync_runs):
    for rounds in (sync_runs["ray_rounds"], sync_runs["local_rounds"]):
        assert [[e.worker for e in g.estimates] for g in rounds] == [[0, 1]] * len(rounds)
        assert [g.staleness for g in rounds] == [[0, 0]] * len(rounds)
        outcome = [
            (dict(g.dropped_stale), g.restarted, g.missing, g.lost_in_flight) for g in rounds
        ]
        assert outcome == [({}, 0, (), 0)] * len(rounds)


def test_sync_rounds_through_a_compiled_graph_equal_the_local_engine(sync_runs, monkeypatch):
    config = sync_runs["config"]
    compiled = dataclasses.replace(
        config, population=dataclasses.replace(config.population, compiled_graph=True)
    )
    # Every estimate comes through the graph: no round falls back to actor calls.
    actor_calls, submit = [], ActorSupervisor.submit

    def counting_submit(self, *args):
        actor_calls.append(args)
        return submit(self, *args)

    monkeypatch.setattr(ActorSupervisor, "submit", counting_submit)
    rounds = []
    with population_of(compiled) as population:
        theta = run_updates(compiled, population, len(sync_runs["local_rounds"]), rounds.append)
        assert actor_calls == []
        # Ordinary calls still reach the actors between graph executions.
        assert sorted(population.export_worker_states()) == [0, 1]
    assert tree_bytes(theta) == tree_bytes(sync_runs["local"])
    assert [[e.worker for e in g.estimates] for g in rounds] == [[0, 1]] * len(rounds)
    assert {(g.missing, g.restarted, g.lost_in_flight) for g in rounds} == {((), 0, 0)}
    # Each estimate owns its arrays: a view of a channel's buffer, freed after
    # the graph's teardown (XLA frees its arguments late), crashed the driver.
    arrays = [
        leaf
        for g in rounds
        for e in g.estimates
        for leaf in jax.tree_util.tree_leaves((e.grad, e.phases))
        if isinstance(leaf, np.ndarray)
    ]
    assert arrays and all(a.flags.owndata for a in arrays)


def test_local_population_describes_its_workers_in_this_process(sync_runs):
    info = sync_runs["local_info"]
    assert [i.rank for i in info] == [0, 1]
    assert all(i.restart == 0 and i.node_id == "local" for i in info)
    assert all(i.pid == os.getpid() and i.pinned_cores is None for i in info)


def test_cpu_actors_on_one_node_are_pinned_to_distinct_cores(sync_runs):
    info = sync_runs["info"]
    assert [i.rank for i in info] == [0, 1]
    assert all(i.restart == 0 and i.pid != os.getpid() for i in info)
    assert len({i.node_id for i in info}) == 1
    cores = [tuple(i.pinned_cores) for i in info]
    assert len(set(cores)) == 2, cores
    # Every thread of each actor (XLA's pool included) runs on its cores only.
    assert all(i.threads_pinned for i in info)
    assert all(i.jax_local_device_count == 1 for i in info)


# ---------------------------------------------------------------------- async


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_async_updates_use_batch_size_estimates_within_the_staleness_bound(
    ray_session, max_staleness, caplog
):
    steps, batch_size = 8, 3
    config = tiny_config(
        mode="async", batch_size=batch_size, max_staleness=max_staleness, calls_in_flight=2
    )
    rounds = []
    with caplog.at_level(logging.WARNING, logger="popmeta"), population_of(config) as population:
        run_updates(config, population, steps, rounds.append)
    # 2 actors x 2 calls in flight / batch 3: arrivals 1.3 versions late, beyond either bound.
    assert f"beyond max_staleness {max_staleness}" in caplog.text

    assert [len(g.estimates) for g in rounds] == [batch_size] * steps
    assert [len(g.staleness) for g in rounds] == [batch_size] * steps
    staleness = [s for g in rounds for s in g.staleness]
    # Beyond the bound only what the starvation guard accepted (a rank that
    # had nothing accepted for 16 updates: rare here, but a loaded machine can
    # hold one actor back that long).
    late = sum(sum(g.accepted_late.values()) for g in rounds)
    assert all(s >= 0 for s in staleness)
    assert sum(s > max_staleness for s in staleness) == late
    # Drops are reported per rank and round; ranks without drops are absent.
    assert all(set(g.dropped_stale) <= {0, 1} for g in rounds)
    assert all(n > 0 for g in rounds for n in g.dropped_stale.values())
    dropped = sum(sum(g.dropped_stale.values()) for g in rounds)
    # After each update every actor still holds calls on the previous theta
    # (it was resubmitted at once), so the first of them to finish in the
    # next round is one version old: dropped at bound 0, accepted at bound 1.
    if max_staleness == 0:
        assert dropped >= steps - 1
    else:
        assert 1 in staleness


# ---------------------------------------------------------------------- broadcast


@pytest.mark.parametrize(("num_actors", "mode"), [(1, "sync"), (3, "async")])
def test_theta_is_put_once_per_version_or_goes_inline(ray_session, monkeypatch, num_actors, mode):
    real_put = ray.put
    puts = []

    def counting_put(value, *args, **kwargs):
        puts.append(value)
        return real_put(value, *args, **kwargs)

    monkeypatch.setattr(ray, "put", counting_put)
    inline_limit = ray_population_module.INLINE_THETA_BYTES
    # As if theta were larger than the inline limit: it goes through the object store.
    monkeypatch.setattr(ray_population_module, "INLINE_THETA_BYTES", 0)
    steps = 5
    config = tiny_config(num_actors=num_actors, mode=mode, batch_size=num_actors)
    with population_of(config) as population:
        theta = run_updates(config, population, steps)
        assert len(puts) == steps
        # A second round on one version (as after a round without usable
        # estimates) reuses that version's ref.
        population.gather(theta, steps)
        population.gather(theta, steps)
        assert len(puts) == steps + 1
        # Within the limit (the default for this theta) it rides inside each call.
        monkeypatch.setattr(ray_population_module, "INLINE_THETA_BYTES", inline_limit)
        assert sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(theta)) <= inline_limit
        versions = set()
        for _ in range(4):  # async: queued calls on older versions come back first
            versions |= {e.version for e in population.gather(theta, steps + 1).estimates}
        assert steps + 1 in versions
        assert len(puts) == steps + 1


# ---------------------------------------------------------------------- decorrelation


def ks_statistic_uniform(samples: np.ndarray) -> float:
    """Kolmogorov-Smirnov distance between the samples' empirical CDF and U[0, 1]."""
    x = np.sort(np.clip(np.asarray(samples, np.float64), 0.0, 1.0))
    n = len(x)
    i = np.arange(1, n + 1)
    return float(max(np.max(i / n - x), np.max(x - (i - 1) / n)))


def test_population_tasks_are_spread_uniformly_over_their_trajectories(ray_session):
    num_actors, num_tasks = 3, 16
    config = tiny_config(num_actors=num_actors, num_tasks=num_tasks, mode="sync")
    rounds = []
    with population_of(config) as population:
        # 10 updates x 5 steps: every task has finished a 20-step trajectory
        # and restarted, so what is left is the effect of the random offsets.
        run_updates(config, population, 10, rounds.append)
    # Each estimate carries its actor's task phases after the call (sync: rank order).
    last = rounds[-1].estimates
    assert [e.worker for e in last] == list(range(num_actors))
    assert all(e.phases is not None for e in last), "the worker does not fill Estimate.phases"
    phases = [np.asarray(e.phases) for e in last]
    assert [p.shape for p in phases] == [(num_tasks,)] * num_actors
    pooled = np.concatenate(phases)
    # Threshold: with n = 48 independent uniform phases, the KS statistic
    # exceeds 1.95 / sqrt(n) = 0.28 with probability 0.1%; phases live on the
    # grid {0, 1/20, ..., 1}, which adds at most 1/20. Tasks in lockstep (no
    # offsets) would all share one phase p, giving max(p, 1 - p) >= 0.5.
    threshold = 1.95 / np.sqrt(len(pooled)) + 1 / 20
    assert ks_statistic_uniform(np.full(len(pooled), 0.5)) >= 0.5 > threshold
    assert ks_statistic_uniform(pooled) < threshold, np.sort(pooled)
    # Actors are not copies of one another (each rank has its own keys).
    assert len({p.tobytes() for p in phases}) == num_actors


# ---------------------------------------------------------------------- failures


def kill_actor_process(info: ActorInfo) -> None:
    """Kills an actor's process as a crash would (SIGKILL), found by its pid."""
    os.kill(info.pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("mode", "compiled_graph"),
    [("sync", False), ("async", False), ("sync", True)],
    ids=["sync", "async", "sync-compiled-graph"],
)
def test_killed_actor_is_replaced_and_the_run_goes_on(ray_session, caplog, mode, compiled_graph):
    caplog.set_level(logging.WARNING, logger="popmeta")
    config = tiny_config(
        mode=mode, batch_size=2, max_actor_restarts=1, compiled_graph=compiled_graph
    )
    with population_of(config) as population:
        learner = Learner.of(learner_start(config))

        def update():
            gathered = population.gather(learner.theta(), learner.version)
            learner.update(gathered.estimates)
            return gathered

        update()
        before = population.describe_actors()
        kill_actor_process(before[0])

        # Async rounds may finish on the other actor before the death shows.
        restarted, deadline = 0, time.monotonic() + CALL_TIMEOUT_S
        while restarted == 0:
            assert time.monotonic() < deadline, "the killed actor was never replaced"
            gathered = update()
            restarted += gathered.restarted
            if mode == "async":
                assert len(gathered.estimates) == 2 and gathered.missing == ()
        assert restarted == 1 and gathered.lost_in_flight >= 1
        if mode == "sync":
            # The round that lost rank 0 completed with rank 1's estimate alone.
            assert [e.worker for e in gathered.estimates] == [1] and gathered.missing == (0,)
        assert population.num_live == 2
        assert "replaced it with restart 1" in caplog.text

        # Rounds go on while the replacement starts; once ready it is back in
        # them (sync: every round), and nothing else is replaced.
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while mode == "sync" and update().missing:
            assert time.monotonic() < deadline, "the replacement never joined a round"
        after = population.describe_actors()
        assert [(i.rank, i.restart) for i in after] == [(0, 1), (1, 0)]
        assert after[0].pid != before[0].pid and after[1].pid == before[1].pid
        ranks = set()
        for _ in range(4):
            gathered = update()
            assert len(gathered.estimates) == 2 and gathered.restarted == 0
            ranks.update(e.worker for e in gathered.estimates)
        if mode == "sync":
            assert ranks == {0, 1}


def test_replacements_start_compiled_from_the_persistent_cache(ray_session, tmp_path):
    cache = tmp_path / "jax-cache"
    config = tiny_config(
        num_actors=1, max_actor_restarts=1, env={"JAX_COMPILATION_CACHE_DIR": str(cache)}
    )
    with population_of(config) as population:
        (cold,) = population.describe_actors()
        # The estimate was compiled (and cached) before the actor said it was ready.
        assert cold.compilation_cache_dir == str(cache)
        assert cold.compilation_cache_misses > 0 and cold.compilation_cache_hits == 0
        assert any(cache.iterdir())
        kill_actor_process(cold)
        # The round waits for the replacement: no other actor is left.
        gathered = population.gather(Learner.of(learner_start(config)).theta(), 0)
        assert gathered.restarted == 1 and len(gathered.estimates) == 1
        (warm,) = population.describe_actors()
        assert warm.restart == 1
        # Everything the cold actor compiled, the replacement loaded.
        assert warm.compilation_cache_hits >= cold.compilation_cache_misses
        assert warm.compilation_cache_misses == 0


def test_actors_use_a_per_user_compilation_cache_by_default(sync_runs):
    # The sync runs' actors: population.env names no cache.
    assert "JAX_COMPILATION_CACHE_DIR" not in sync_runs["config"].population.env
    for info in sync_runs["info"]:
        assert info.compilation_cache_dir == default_compilation_cache_dir()
        assert str(os.getuid()) in info.compilation_cache_dir


def test_population_gives_up_when_a_rank_keeps_dying(ray_session):
    # XLA aborts on a flag it does not know: every actor dies while it starts.
    config = tiny_config(num_actors=1, max_actor_restarts=1, env={"XLA_FLAGS": "--no_such_flag"})
    with pytest.raises(PopulationLostError, match=r"replaced 1 time\(s\) in a row"):
        population_of(config)


def test_a_run_whose_actor_dies_while_starting_replaces_it_and_counts_the_loss(
    ray_session, tmp_path
):
    config = dataclasses.replace(
        tiny_config(run_dir=str(tmp_path), num_steps=6, max_actor_restarts=1),
        train=dataclasses.replace(tiny_config().train, num_steps=6, summary_every=1),
    )
    # The first actor seen in its constructor is killed, as on a node lost while it compiles.
    with ActorKiller(os.getpid()) as killer:
        result = train(config, RayPopulation, stream=io.StringIO())
    assert len(killer.killed) == 1
    assert result.final_step == 6
    scalars = read_scalars(tmp_path / "test")
    assert scalars["actor_restarts"][-1] == (6, 1.0)
    assert scalars["live_actors"][-1] == (6, 2.0)


def test_population_env_reaches_the_actors_and_init_errors_surface(ray_session):
    # XLA reads XLA_FLAGS when the actor process starts: 2 host devices, over
    # which the worker shards its tasks.
    two_devices = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    config = tiny_config(num_actors=1, num_tasks=4, env=two_devices)
    with population_of(config) as population:
        (info,) = population.describe_actors()
        assert info.jax_local_device_count == 2 and info.num_devices == 2
        assert len(population.gather(Learner.of(learner_start(config)).theta(), 0).estimates) == 1
    # 3 tasks cannot be split over 2 devices: the actor's __init__ raises,
    # and the population says which actor failed and why, at once.
    config = tiny_config(num_actors=1, num_tasks=3, env=two_devices)
    with pytest.raises(
        ActorStartError, match=r"actor 0 \(restart 0\) could not start: ValueError: .*multiple of"
    ) as info:
        population_of(config)
    assert f"(on host {socket.gethostname()}, node " in str(info.value)


def test_cpu_devices_start_each_actor_with_that_many_devices_its_tasks_split_over(
    ray_session, monkeypatch
):
    # XLA reads the count when the actor process starts; the worker splits its 4 tasks.
    # A device count in the driver's own XLA_FLAGS is the driver's: the actors take cpu_devices.
    driver_flags = f"{os.environ.get('XLA_FLAGS', '')} {HOST_DEVICE_COUNT_FLAG}=3"
    monkeypatch.setenv("XLA_FLAGS", driver_flags)
    config = tiny_config(num_actors=1, num_tasks=4, cpu_devices=2)
    with population_of(config) as population:
        (info,) = population.describe_actors()
        assert info.jax_local_device_count == 2 and info.num_devices == 2
        assert describe_placement(config.population, [info]).endswith("tasks split over 2 devices")
        assert len(population.gather(Learner.of(learner_start(config)).theta(), 0).estimates) == 1


def test_one_actor_per_node_without_a_carrier_fails_clearly(ray_session):
    config = tiny_config(one_actor_per_node_with="TPU")
    with pytest.raises(RuntimeError, match="no alive Ray node carries resource 'TPU'"):
        population_of(config)


# ---------------------------------------------------------------------- runtime


def test_start_ray_reuses_an_initialised_instance(ray_session):
    handle = start_ray(None)
    assert not handle.started
    handle.shutdown()
    assert ray.is_initialized()


def test_population_without_ray_fails_clearly(monkeypatch):
    # As if no Ray were initialised in this process (the session's instance may be up).
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"start_ray_for\(population\)"):
        population_of(tiny_config(num_actors=1))


def test_start_ray_for_hosts_a_population_on_a_quiet_loopback_instance():
    # A separate process: this one already hosts the session instance.
    script = textwrap.dedent(
        """
        import ray
        from popmeta.population.ray_runtime import start_ray_for
        from tests.population import population_of, run_updates, tiny_config

        config = tiny_config(num_actors=1)
        with start_ray_for(config.population) as runtime:
            assert runtime.started
            population = population_of(config)
            addresses = sorted({n["NodeManagerAddress"] for n in ray.nodes()})
            # Ray's default worker niceness (15) would put the actors below any busy process.
            assert [i.niceness for i in population.describe_actors()] == [0]
            run_updates(config, population, 1)
            population.close()
            # Closing the population leaves Ray to its owner.
            up_after_close = ray.is_initialized()
        print("ADDRESSES", addresses, "UP", up_after_close, ray.is_initialized())
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # Short: Ray puts Unix sockets under it (pytest's tmp_path is too long).
    temp_dir = tempfile.mkdtemp(prefix="pm-ray-")
    env["RAY_TMPDIR"] = temp_dir
    try:
        out = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=REPO,
        )
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert out.returncode == 0, out.stderr
    assert "ADDRESSES ['127.0.0.1'] UP True False" in out.stdout
    # No Ray log lines on the user's terminal.
    assert "ray" not in out.stderr.lower(), out.stderr


def test_actors_no_node_can_host_fail_clearly_after_the_call_timeout(ray_session, caplog):
    caplog.set_level(logging.WARNING, logger="popmeta")
    config = tiny_config(num_actors=1, resources={"no_such_accelerator": 1}, call_timeout_s=2.0)
    with pytest.raises(RuntimeError, match=r"did not start within population\.call_timeout_s"):
        population_of(config)
    # Said at once, not only after the timeout.
    assert "can host 0 of 1 actors" in caplog.text
