"""Population overhead: the Ray engine against the single-process engine, side by side.

Run: ``python bench/population.py [--seconds 8]``

1. Inner-steps/s of the single-process engine and of the Ray engine with one
   actor on the same work, for the estimator benchmark's configurations (c)
   (PES + MLPLOpt on the digits MLP, ~0.1 s per estimate) and (a) (PES +
   LearnableSGDM on a quadratic, ~1 ms per estimate: less than one Ray round
   trip, so the Ray engine amortises it with several truncations per call and
   pipelined async calls), with sync rounds as actor calls and through a
   Ray compiled graph (``population.compiled_graph``). Each row also gives
   the Ray engine's extra time per estimate (with one sync actor: per round),
   and the part starts with Ray's own floor on this machine: a round trip to
   an actor method that does nothing, as an actor call and through a
   compiled graph, with the same small arguments and reply.
2. Weak scaling: 2 actors against 1 on this 2-core machine, cores pinned; for
   (c), the matmul GFLOP/s the actors achieve together and their share of
   this machine's float32 matmul peak (as ``bench/estimators.py`` counts them).
   With ``--peer DIR`` (a learned_optimization checkout; ``--peer-python``
   its environment's interpreter), learned_optimization's single process runs
   the same work before the 1-actor run and after the 2-actor run
   (``bench/learned_optimization_peer.py``), and the row adds the median of
   those two and the 2 actors' ratio to it.
3. The learner's capacity: updates/s and estimates/s it absorbs for theta of
   1e3, 1e5 and 1e6 floats when estimates arrive instantly (aggregation, the
   jitted donating Adam step, the host copy of theta and its one ``ray.put``).
4. ``estimator.truncations_per_call: auto`` on the quickstart and the
   tutorial's config, as ``popmeta train`` runs them (2 actors, sync): the
   number it chooses, then the Ray engine against the local engine at that
   number, alternating. ``--burners N`` runs it beside N busy processes (a
   loaded machine).
5. The local engine's fused rounds (``population.updates_per_call``, one
   worker): inner-steps/s unfused and with 16 rounds per call, alternating,
   on (a), (b) and (c), each fused call's records replayed as the run loop
   replays them.

Every rate is measured after compilation and warm-up, over the whole learner
loop (gather, aggregate, update).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import jax
import numpy as np
import ray
from estimators import (
    add_peer_arguments,
    build_config,
    check_peer,
    flops_per_inner_step,
    matmul_peak_gflops,
    run_peer,
)
from work import EPISODE_LENGTH, NUM_TASKS, TRUNCATION_LENGTH

from popmeta.config import load_config
from popmeta.estimate import Estimate, aggregate
from popmeta.experiment import WorkerSpec, learner_start
from popmeta.learner.learner import Learner
from popmeta.learner.train_state import (
    TrainState,
    build_apply_estimates_fn,
    make_outer_optimizer,
)
from popmeta.population.call_size import size_calls
from popmeta.population.local import LocalPopulation
from popmeta.population.ray_population import RayPopulation, theta_argument
from popmeta.population.ray_runtime import start_ray

#: Each configuration's task and learned optimizer, as bench/estimators.py builds them.
KINDS = {
    "c": ("image_mlp_digits", "mlp"),
    "b": ("fixed_dim_quadratic_data", "mlp"),
    "a": ("fixed_dim_quadratic_data", "learnable_sgdm"),
}
#: The PES work every configuration shares, the estimator bench's too.
PES_WORK = [
    f"estimator.num_tasks={NUM_TASKS}",
    f"estimator.trunc_length={TRUNCATION_LENGTH}",
    f"truncation.length={EPISODE_LENGTH}",
    f"estimator.random_initial_iteration_offset={EPISODE_LENGTH}",
]
WORK = {
    name: [f"task.kind={task}", f"learned_optimizer.kind={lopt}", *PES_WORK]
    for name, (task, lopt) in KINDS.items()
}


def _config(work: str, *extra: str):
    return load_config(
        None, [*WORK[work], "estimator.truncations_per_call=1", "population.pin_cpus=true", *extra]
    )


def inner_steps_per_s(config, population_cls, seconds: float) -> tuple[float, int]:
    """Learner-loop throughput: gather, aggregate, update, for ``seconds`` after warm-up.

    Returns:
      Inner steps per second, and the inner steps of one estimate.
    """
    learner = Learner.of(learner_start(config))
    population = population_cls(config.population, WorkerSpec.of(config))
    try:
        for _ in range(3):
            learner.update(population.gather(learner.theta(), learner.version).estimates)
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            gathered = population.gather(learner.theta(), learner.version)
            learner.update(gathered.estimates)
            count += len(gathered.estimates)
        elapsed = time.perf_counter() - start
        return count * population.steps_per_estimate / elapsed, population.steps_per_estimate
    finally:
        population.close()


def fused_inner_steps_per_s(config, rounds: int, seconds: float) -> float:
    """Inner steps/s of the local engine's fused rounds, ``rounds`` per call, records replayed."""
    learner = Learner.of(learner_start(config))
    population = LocalPopulation(config.population, WorkerSpec.of(config))
    try:
        fused = population.fused_rounds(learner, rounds)
        for _ in range(2):
            list(fused.run(rounds).rounds())
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            count += sum(len(gathered.estimates) for gathered, _ in fused.run(rounds).rounds())
        elapsed = time.perf_counter() - start
        return count * population.steps_per_estimate / elapsed
    finally:
        population.close()


def learner_capacity(size: int, batch_size: int, seconds: float) -> tuple[float, float]:
    """Updates/s and estimates/s of the learner alone, for a theta of ``size`` floats.

    The estimates wait in Ray's object store, as actors leave them; each
    update gets them (zero-copy numpy views) and does what ``Learner.update``
    does: weighs them, and sums them and takes the outer step (clip + Adam,
    the learner's default chain) in one jitted, donating call; it then copies
    theta to the host and prepares it for the actors as the population does
    (one ``ray.put``, or nothing for a theta small enough to go inline).
    """
    tx = make_outer_optimizer("adam", 1e-3)
    state = TrainState.initial_state({"w": jax.numpy.zeros(size)}, tx, jax.random.key(0))
    step = build_apply_estimates_fn(donate_params_and_state=True)
    rng = np.random.default_rng(0)
    refs = [
        ray.put(Estimate({"w": rng.normal(size=size).astype(np.float32)}, 1.0, 8.0, 0, i, {}))
        for i in range(batch_size)
    ]

    def update():
        nonlocal state
        agg = aggregate(ray.get(refs))
        state, _, applied = step(state, agg.grads, agg.weights)
        if not applied:
            raise SystemExit("learner capacity: the step refused finite estimates")
        theta_argument(jax.tree_util.tree_map(np.asarray, state.params))

    for _ in range(3):
        update()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        update()
        count += 1
    rate = count / (time.perf_counter() - start)
    return rate, rate * batch_size


@ray.remote(num_cpus=0)
class _Idle:
    """An actor that does no work: the round trips to it are Ray's floor."""

    def reply(self, theta: dict, version: int) -> dict:
        return {"grad": np.zeros_like(theta["w"]), "version": version}


def ray_floor_ms(seconds: float) -> tuple[float, float]:
    """Milliseconds per round trip to :class:`_Idle`: as an actor call, through a compiled graph."""
    from ray.dag import InputNode, MultiOutputNode

    actor = _Idle.remote()
    theta = {"w": np.zeros(2, np.float32)}

    def per_round(call) -> float:
        for version in range(20):
            call(version)
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            call(count)
            count += 1
        return (time.perf_counter() - start) / count * 1e3

    try:
        actor_call = per_round(lambda v: ray.get(actor.reply.remote(theta, v)))
        with InputNode() as inputs:
            graph = MultiOutputNode([actor.reply.bind(inputs[0], inputs[1])])
        compiled = graph.experimental_compile()
        try:
            graph_call = per_round(lambda v: ray.get(compiled.execute(theta, v)))
        finally:
            compiled.teardown()
        return actor_call, graph_call
    finally:
        ray.kill(actor)


def engines(sec: float, k: int) -> None:
    """Part 1: the single-process engine against the Ray engine with one worker."""
    # (c) is real compute: the lone actor gets both cores, like the driver's XLA
    # in the single-process engine. (a) is tiny ops that a second XLA thread
    # does not speed up: the actor is pinned to one core and the learner,
    # driver and raylet keep the other.
    both = "population.num_cpus=2"
    compiled = "population.compiled_graph=true"
    trunc_k = f"estimator.truncations_per_call={k}"
    trunc_2, trunc_4 = "estimator.truncations_per_call=2", "estimator.truncations_per_call=4"
    pipelined = ["population.mode=async", "population.calls_in_flight=2"]
    rows = [
        ("c", "(c) PES + MLPLOpt, digits MLP: sync", [], [both], None),
        ("c", "(c) same, sync, compiled graph", [], [both, compiled], None),
        ("c", "(c) same, sync, 2 truncations per call", [trunc_2], [both], None),
        (
            "c",
            "(c) same, async pipelined, 2 truncations per call",
            [trunc_2],
            [both, *pipelined],
            0.9,
        ),
        ("a", "(a) PES + LearnableSGDM, quadratic: sync, 1 truncation per call", [], [], 0.8),
        ("a", "(a) same, sync, 1 truncation per call, compiled graph", [], [compiled], 0.8),
        ("a", "(a) same, async pipelined, 4 truncations per call", [trunc_4], pipelined, 0.9),
        ("a", f"(a) same, sync, {k} truncations per call", [trunc_k], [], None),
        ("a", f"(a) same, async pipelined, {k} truncations per call", [trunc_k], pipelined, 0.9),
    ]
    actor_call, graph_call = ray_floor_ms(min(sec, 3.0))
    print("1. single-process engine vs Ray engine, 1 worker, same work (inner-steps/s)")
    print(
        f"   Ray's floor here: {actor_call:.2f} ms per round trip to an idle actor "
        f"as an actor call, {graph_call:.2f} ms through a compiled graph"
    )
    print(
        f"   {'work':<62} {'single':>10} {'ray':>10} {'ratio':>6} {'target':>6} {'extra ms/est':>12}"
    )
    for work, label, work_options, ray_options, target in rows:
        one_worker = [*work_options, "population.num_actors=1"]
        single, steps = inner_steps_per_s(_config(work, *one_worker), LocalPopulation, sec)
        ray_cfg = _config(work, *one_worker, *ray_options)
        distributed, _ = inner_steps_per_s(ray_cfg, RayPopulation, sec)
        tgt = "-" if target is None else f"{target:.1f}x"
        extra_ms = (steps / distributed - steps / single) * 1e3
        print(
            f"   {label:<62} {single:>10,.0f} {distributed:>10,.0f} "
            f"{distributed / single:>5.2f}x {tgt:>6} {extra_ms:>12.2f}"
        )


def weak_scaling(sec: float, k: int, peer: Callable[[str], dict] | None = None) -> None:
    """Part 2: 2 actors against 1, async, cores pinned; beside learned_optimization's if ``peer``."""
    rows = [
        ("(c) PES + MLPLOpt, digits MLP, async", "c", []),
        (
            f"(b) PES + MLPLOpt, quadratic, async, {k} trunc/call",
            "b",
            [f"estimator.truncations_per_call={k}"],
        ),
        (
            f"(a) PES + LearnableSGDM, quadratic, async, {k} trunc/call",
            "a",
            [f"estimator.truncations_per_call={k}"],
        ),
    ]
    peak = matmul_peak_gflops()
    print("\n2. weak scaling on this 2-core machine, Ray engine, cores pinned (inner-steps/s)")
    print(f"   float32 matmul peak (1024x1024): {peak:.1f} GFLOP/s")
    header = f"   {'work':<58} {'1 actor':>10} {'2 actors':>10} {'ratio':>6} {'GFLOP/s':>8} {'of peak':>7}"
    print(header + (f" {'learned_opt.':>13} {'2 actors / it':>13}" if peer else ""))
    for label, work, extra in rows:
        # learned_optimization updates theta once per truncation in every row;
        # the truncations per call of (b) and (a) batch popmeta's calls and updates.
        peer_rates = [] if peer is None else [peer(work)["inner_steps_per_s"]]
        rates = []
        for n in (1, 2):
            cfg = _config(
                work,
                *extra,
                "population.mode=async",
                f"population.num_actors={n}",
                f"population.batch_size={n}",
            )
            rates.append(inner_steps_per_s(cfg, RayPopulation, sec)[0])
        if peer is not None:
            peer_rates.append(peer(work)["inner_steps_per_s"])
        flops = flops_per_inner_step(work, build_config(work)[0])
        achieved = "-" if flops is None else f"{rates[1] * flops / 1e9:.1f}"
        share = "-" if flops is None else f"{100 * rates[1] * flops / 1e9 / peak:.0f}%"
        line = (
            f"   {label:<62} {rates[0]:>10,.0f} {rates[1]:>10,.0f} {rates[1] / rates[0]:>5.2f}x "
            f"{achieved:>8} {share:>7}"
        )
        if peer_rates:
            other = statistics.median(peer_rates)
            line += f" {other:>13,.0f} {rates[1] / other:>12.2f}x"
        print(line, flush=True)


def capacity(sec: float) -> None:
    """Part 3: the learner alone, estimates waiting in the object store."""
    print("\n3. learner capacity, estimates waiting in the object store")
    print(f"   {'theta floats':>12} {'per update':>10} {'updates/s':>10} {'estimates/s':>12}")
    for size in (1_000, 100_000, 1_000_000):
        for batch in (4, 16):
            updates, estimates = learner_capacity(size, batch, sec / 2)
            print(f"   {size:>12,} {batch:>10} {updates:>10,.1f} {estimates:>12,.1f}")


REPO = Path(__file__).resolve().parents[1]


def _tutorial_config_file(folder: str) -> str:
    """The tutorial's ``tutorial.yaml``, as docs/tutorial.md gives it, written to ``folder``."""
    text = (REPO / "docs" / "tutorial.md").read_text(encoding="utf-8")
    blocks = [b.split("```", 1)[0] for b in text.split("```yaml\n")[1:]]
    (block,) = [b for b in blocks if b.startswith("name: tutorial")]
    path = os.path.join(folder, "tutorial.yaml")
    Path(path).write_text(block, encoding="utf-8")
    return path


@contextlib.contextmanager
def _burners(count: int):
    """``count`` processes that keep a core busy each, for as long as the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def auto_sized(sec: float, folder: str, burners: int) -> None:
    """Part 4: the number ``auto`` chooses, and both engines at it."""
    configs = {
        "quickstart": str(REPO / "configs" / "quickstart.yaml"),
        "tutorial": _tutorial_config_file(folder),
    }
    load = f"beside {burners} busy processes" if burners else "idle"
    print(f"\n4. truncations_per_call: auto, 2 actors, sync, {load} (inner-steps/s)")
    print(f"   {'config':<11} {'chosen':>7} {'local':>12} {'ray':>12} {'ratio':>6}  measured")
    with _burners(burners):
        for name, path in configs.items():
            config = load_config(path)
            learner = Learner.of(learner_start(config))
            with RayPopulation(config.population, WorkerSpec.of(config)) as population:
                size = size_calls(population, learner.theta())
            cost = size.cost
            measured = (
                "-"
                if cost is None
                else f"{cost.truncation_s * 1e3:.3g} ms/truncation, {cost.overhead_s * 1e3:.3g} "
                "ms more per call"
            )
            chosen = load_config(
                path, [f"estimator.truncations_per_call={size.truncations_per_call}"]
            )
            rates: dict[str, list[float]] = {"local": [], "ray": []}
            for _ in range(2):  # alternating
                rates["local"].append(inner_steps_per_s(chosen, LocalPopulation, sec)[0])
                rates["ray"].append(inner_steps_per_s(chosen, RayPopulation, sec)[0])
            local, ray_rate = (float(np.median(rates[k])) for k in ("local", "ray"))
            print(
                f"   {name:<11} {size.truncations_per_call:>7} {local:>12,.0f} {ray_rate:>12,.0f} "
                f"{ray_rate / local:>5.2f}x  {measured}"
            )


FUSED_ROUNDS = 16


def fused_rounds(sec: float) -> None:
    """Part 5: the local engine unfused against ``updates_per_call: 16``, one worker."""
    print(f"\n5. the local engine's fused rounds, 1 worker, {FUSED_ROUNDS} rounds per call")
    print(f"   {'work':<6} {'unfused':>12} {'fused':>12} {'ratio':>6}")
    for work in ("a", "b", "c"):
        config = _config(work, "population.engine=local", "population.num_actors=1")
        unfused, fused = [], []
        for _ in range(2):  # alternating
            unfused.append(inner_steps_per_s(config, LocalPopulation, sec)[0])
            fused.append(fused_inner_steps_per_s(config, FUSED_ROUNDS, sec))
        before, after = statistics.median(unfused), statistics.median(fused)
        print(f"   ({work}){'':<3} {before:>12,.0f} {after:>12,.0f} {after / before:>5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--truncations-per-call", type=int, default=64)
    parser.add_argument("--parts", default="1,2,3,4,5", help="which of the parts above to run")
    parser.add_argument("--burners", type=int, default=0, help="busy processes beside part 4")
    add_peer_arguments(parser)  # for part 2
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    peer = None
    if args.peer is not None:
        check_peer(args.peer)

        def peer(work: str) -> dict:
            return run_peer(
                work, args.seconds, args.peer, args.peer_python, args.peer_data, NUM_TASKS
            )

    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    with (
        tempfile.TemporaryDirectory(prefix="pm-bench-") as tmp,
        start_ray(None, num_cpus=2, temp_dir=tmp, object_store_memory=512 * 2**20),
    ):
        if "1" in parts:
            engines(args.seconds, args.truncations_per_call)
        if "2" in parts:
            weak_scaling(args.seconds, args.truncations_per_call, peer)
        if "3" in parts:
            capacity(args.seconds)
        if "4" in parts:
            auto_sized(args.seconds, tmp, args.burners)
        if "5" in parts:
            fused_rounds(args.seconds)
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
