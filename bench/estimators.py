"""Estimator throughput: inner-steps/s, peak memory and achieved GFLOP/s, side by side.

Run: ``python bench/estimators.py [--seconds 5] [--configs a,b,c,d] [--compare-with DIR]``;
``--configs c,c-bf16-mlp,c-bf16,e,e-bf16-mlp,e-bf16`` sets float32 against bfloat16
(the learned optimizer's MLP, then the task's products too) on (c) and on a
larger MLP, (e). Any configuration with ``-split`` added (``c-split``) runs
with one CPU device per core of this process and its tasks split over them,
as ``population.cpu_devices`` does; with ``-fused`` added (``b-fused``) the
estimates and the learner's steps run as the local engine's fused rounds
(``population.updates_per_call: 16``, popmeta/population/fused.py): calls
of 16 rounds, each call's records copied to the host as the run loop takes
them.

Each configuration runs in its own subprocess (so its peak RSS is its own):
the estimator's jitted truncation plus the learner's jitted, donating outer
Adam step, timed after compilation and warm-up in rounds of one second, of
which the median is reported (a shared machine's hiccups land in a few
rounds, not in the figure). Inner steps count every task and every
antithetic member. It prints absolute numbers, and the achieved GFLOP/s as a
share of the dense matmul peak measured in the same run (the bfloat16 peak
for the bfloat16 configurations).

``--compare-with DIR`` names another checkout of popmeta (e.g. ``git worktree
add /tmp/before <commit>``): each configuration then runs alternately from
that tree and from this one, ``--repeats`` times each, and the ratio printed
is of the two medians measured side by side in this run.

``--peer DIR`` names a learned_optimization checkout instead (the folder
holding its ``learned_optimization`` package) and ``--peer-python`` the
interpreter of its environment: (a) to (e) then run alternately in
learned_optimization (``bench/learned_optimization_peer.py``, its
``SingleMachineGradientLearner`` on the same work) and in this tree, and the
ratio is again of two medians measured side by side in this run. Those are
the only ratios this script prints; docs/performance.md has what they read.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from work import (
    EPISODE_LENGTH,
    IMAGE_MLPS,
    NAMESAKES,
    NUM_TASKS,
    STD,
    TRUNCATION_LENGTH,
    median_rate,
)

CONFIGS = {
    "a": "PES + LearnableSGDM, quadratic(10)",
    "b": "PES + MLPLOpt, quadratic(10)",
    "c": "PES + MLPLOpt, digits image MLP",
    "d": "FullES(50) + LearnableSGDM, quadratic(10)",
    "c-bf16-mlp": "(c), MLPLOpt's MLP in bfloat16",
    "c-bf16": "(c), MLP and task in bfloat16",
    "e": "PES + MLPLOpt, 64-256-256-10 MLP, batch 512",
    "e-bf16-mlp": "(e), MLPLOpt's MLP in bfloat16",
    "e-bf16": "(e), MLP and task in bfloat16",
}


def _image_task(name: str):
    """The image MLP of an image configuration: (c)'s 64-32-10 or (e)'s 64-256-256-10."""
    import popmeta as pm
    from popmeta.core.tasks import load_digits_8x8

    task_dtype = "bfloat16" if name.endswith("-bf16") else "float32"
    hidden, batch = IMAGE_MLPS[name[0]]
    return pm.ImageMLPTask.from_arrays(
        *load_digits_8x8(), hidden_sizes=hidden, batch_size=batch, compute_dtype=task_dtype
    )


def build_config(name: str, num_tasks: int = NUM_TASKS):
    """The learned optimizer and gradient estimator of configuration ``name`` (see CONFIGS)."""
    import popmeta as pm

    mlp_dtype = "bfloat16" if "-bf16" in name else "float32"
    lopt = pm.LearnableSGDM() if name in ("a", "d") else pm.MLPLOpt(mlp_dtype=mlp_dtype)
    if name[0] in "ce":
        family = pm.single_task_to_family(_image_task(name))
    else:
        family = pm.FixedDimQuadraticFamilyData(10)
    step = pm.VectorizedLOptTruncatedStep(
        family,
        lopt,
        pm.ConstantTruncationSchedule(EPISODE_LENGTH),
        num_tasks=num_tasks,
        random_initial_iteration_offset=0 if name == "d" else EPISODE_LENGTH,
    )
    if name == "d":
        estimator = pm.FullES(step, pm.ConstantTruncationSchedule(EPISODE_LENGTH), std=STD)
    else:
        estimator = pm.TruncatedPES(step, trunc_length=TRUNCATION_LENGTH, std=STD)
    return lopt, estimator


def inner_steps_per_estimate(estimator) -> int:
    """Inner steps behind one estimate: every task, antithetic member and step of the truncation."""
    return estimator.num_members * estimator.truncated_step.num_tasks * estimator.trunc_length


def flops_per_inner_step(name: str, lopt) -> float | None:
    """Matmul FLOPs one inner step of the image task executes (elementwise ops ignored).

    The task's forward and backward passes, and the learned optimizer's MLP on
    every parameter. Its shared time features enter the first layer once per
    tensor, not once per parameter, so the first layer counts only the
    per-parameter features: the work done, not the work the formula names.
    """
    if name[0] not in "ce":
        return None
    import jax

    task = _image_task(name)
    params = task.init(jax.random.key(0))
    layers = [x.shape for x in jax.tree_util.tree_leaves(params) if x.ndim == 2]
    batch = task.batch_size
    task_flops = 3 * 2 * batch * sum(i * o for i, o in layers)  # forward + backward
    num_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    widths = (
        lopt.num_features - len(lopt.timescales),
        *[lopt.hidden_size] * lopt.hidden_layers,
        2,
    )
    lopt_flops = num_params * 2 * sum(i * o for i, o in itertools.pairwise(widths))
    return float(task_flops + lopt_flops)


def run_one(name: str, seconds: float, num_tasks: int = NUM_TASKS) -> dict:
    import jax
    import optax

    from popmeta.core.estimators import make_runner
    from popmeta.learner.train_state import TrainState

    base = base_config(name)  # the same configuration, its tasks split or its rounds fused
    lopt, estimator = build_config(base, num_tasks)
    # A worker's runner; ``-split`` shards the tasks over the local devices, as a
    # worker does when it sees several.
    runner = make_runner(estimator, jax.local_devices() if SPLIT in name else None)
    theta = lopt.init(jax.random.key(0))
    train_state = TrainState.initial_state(theta, optax.adam(1e-3), jax.random.key(1))
    worker = runner.init_worker_state(train_state.params, jax.random.key(2))
    rate = fused_rate if name.endswith(FUSED) else unfused_rate
    estimates_per_s, temp_mb = rate(runner, train_state, worker, seconds)
    return {
        "config": name,
        "estimates_per_s": estimates_per_s,
        "inner_steps_per_s": estimates_per_s * inner_steps_per_estimate(estimator),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "xla_temp_mb": temp_mb,
        "devices": runner.num_devices,
        "flops_per_inner_step": flops_per_inner_step(base, lopt),
        # What XLA compiled with (``import popmeta`` may add flags: popmeta.xla_flags).
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def _temp_mb(lowered) -> float:
    """XLA's temporary memory of a lowered program, in MiB (per device where it is split)."""
    memory = lowered.compile().memory_analysis()
    return getattr(memory, "temp_size_in_bytes", 0) / 2**20 if memory else float("nan")


def unfused_rate(runner, train_state, worker_state, seconds: float) -> tuple[float, float]:
    """Estimates per second of the runner's estimate and the learner's step, and the estimate's temporary MiB."""
    import jax
    import numpy as np

    from popmeta.learner.train_state import build_apply_estimates_fn

    apply = build_apply_estimates_fn(donate_params_and_state=True)
    # Weights passed explicitly: a tree from before they were optional runs this script too.
    one_estimate = np.ones(1, np.float32)
    temp_mb = _temp_mb(
        runner.jitted_estimate(1).lower(
            train_state.params, worker_state, jax.random.key(0), None, None
        )
    )
    # Each call's key comes from one jitted fold_in, as a worker derives it: an
    # eager jax.random.key(i) costs several dispatches (0.1-0.2 ms on 2 cores).
    root_key, call_key = jax.random.key(0), jax.jit(jax.random.fold_in)
    learner_device = jax.devices()[0]

    def one(i):
        nonlocal worker_state, train_state
        out, _ = runner.compute_gradient_estimate(
            train_state.params, worker_state, call_key(root_key, i)
        )
        worker_state = out.state
        grad = out.grad
        if runner.num_devices > 1:  # split: the learner's device gets the estimate
            grad = jax.device_put(grad, learner_device)
        train_state, _, _ = apply(train_state, [grad], one_estimate)

    for i in range(3):
        one(i)
    jax.block_until_ready(train_state.params)
    count = itertools.count()

    def five() -> int:  # then wait: at most five estimates dispatched ahead
        for _ in range(5):
            one(next(count))
        jax.block_until_ready(train_state.params)
        return 5

    return median_rate(five, lambda: None, seconds), temp_mb


def fused_rate(runner, train_state, worker_state, seconds: float) -> tuple[float, float]:
    """Estimates per second of the local engine's fused rounds, ``FUSED_ROUNDS`` per call, and the program's temporary MiB."""
    import jax
    import numpy as np

    from popmeta.actors.worker import FusionCarry
    from popmeta.population.fused import placed_rounds_fn

    states = (worker_state,)
    program, replicated = placed_rounds_fn([runner], [1], FUSED_ROUNDS, states)
    counters = (FusionCarry(None, jax.random.key(2), np.int32(-1), np.int32(0)),)
    if replicated is not None:
        train_state, counters = jax.device_put((train_state, counters), replicated)
    rounds = np.int32(FUSED_ROUNDS)
    temp_mb = _temp_mb(program.lower(train_state, states, counters, rounds))

    def call() -> int:
        nonlocal train_state, states, counters
        train_state, states, counters, records = program(train_state, states, counters, rounds)
        jax.device_get(records)  # the host's copy, as FusedRounds.run takes it
        return FUSED_ROUNDS

    call()
    return median_rate(call, lambda: None, seconds), temp_mb


def matmul_peak_gflops(n: int = 1024, seconds: float = 2.0, dtype: str = "float32") -> float:
    """This machine's dense matmul rate through XLA: float32, or bfloat16 summed in float32."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    matmul = jax.jit(lambda a: jnp.matmul(a, a, preferred_element_type=jnp.float32))
    matmul(a).block_until_ready()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        matmul(a).block_until_ready()
        count += 1
    return count * 2 * n**3 / (time.perf_counter() - start) / 1e9


SPLIT = "-split"
FUSED = "-fused"
#: Rounds per call of a ``-fused`` configuration (``population.updates_per_call``).
FUSED_ROUNDS = 16


def base_config(name: str) -> str:
    """The configuration of CONFIGS that ``name`` runs, its ``-split`` or ``-fused`` taken off."""
    return name.removesuffix(FUSED).removesuffix(SPLIT)


def describe(name: str) -> str:
    """What configuration ``name`` (``-split`` or ``-fused`` allowed) measures; SystemExit if unknown."""
    base = base_config(name)
    if base not in CONFIGS or name not in (base, base + SPLIT, base + FUSED, base + SPLIT + FUSED):
        raise SystemExit(
            f"--configs: unknown configuration {name!r}; known: {','.join(CONFIGS)}, "
            f"each also with {SPLIT}, {FUSED} or {SPLIT}{FUSED}"
        )
    description = CONFIGS[base]
    if SPLIT in name:
        description += ", tasks split over CPU devices"
    if name.endswith(FUSED):
        description += f", {FUSED_ROUNDS} fused rounds per call"
    return description


def host_devices_per_process() -> int:
    """CPU devices a ``-split`` configuration runs on: one per core this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


PEER_SCRIPT = Path(__file__).with_name("learned_optimization_peer.py")


def peer_config(name: str) -> str:
    """learned_optimization's namesake of configuration ``name``: its base, of (a) to (e)."""
    base = base_config(name)
    if base not in NAMESAKES:
        raise SystemExit(
            f"--configs: ({name}) has no learned_optimization namesake; --peer runs a to e "
            f"(each also with {SPLIT} or {FUSED} on popmeta's side)"
        )
    return base


def add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    """``--peer``, ``--peer-python`` and ``--peer-data``, for every bench that runs the peer."""
    parser.add_argument(
        "--peer", type=Path, help="a learned_optimization checkout to run side by side"
    )
    parser.add_argument(
        "--peer-python", default=sys.executable, help="the interpreter of --peer's environment"
    )
    parser.add_argument(
        "--peer-data",
        choices=("host", "device"),
        default="host",
        help="(c)'s batches in learned_optimization: its host iterators, or sampled on device",
    )


def check_peer(peer: Path) -> None:
    """SystemExit unless ``peer`` holds a learned_optimization package."""
    if not (peer / "learned_optimization").is_dir():
        raise SystemExit(f"--peer {peer}: no learned_optimization package in it")


def popmeta_xla_flags() -> str:
    """The ``XLA_FLAGS`` a process of this tree runs with once it imports popmeta.

    Asked of a subprocess: importing popmeta here would put this tree's flags
    into every child's environment.
    """
    command = [sys.executable, "-c", "import os, popmeta; print(os.environ.get('XLA_FLAGS', ''))"]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


def run_peer(
    name: str,
    seconds: float,
    peer: Path,
    python: str,
    data: str,
    num_tasks: int,
    xla_flags: str | None = None,
) -> dict:
    """learned_optimization's side of configuration ``name``, in the peer's interpreter.

    ``xla_flags``, if given, replaces the environment's ``XLA_FLAGS`` in that process.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(peer), env.get("PYTHONPATH")]))
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    command = [python, str(PEER_SCRIPT), "--one", peer_config(name), "--data", data]
    return _measured_by(
        [*command, "--seconds", str(seconds), "--tasks", str(num_tasks)],
        env,
        f"learned_optimization's ({name}) from {peer}",
    )


def _measured_by(command: list[str], env: dict[str, str], what: str) -> dict:
    """The JSON line a measuring subprocess prints last; SystemExit naming ``what`` if it fails."""
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run_config(name: str, seconds: float, tree: Path | None, num_tasks: int = NUM_TASKS) -> dict:
    """One configuration in a fresh interpreter, importing popmeta from ``tree`` if given."""
    env = dict(os.environ)
    if SPLIT in name:
        # XLA reads the device count once, when JAX starts in the subprocess. Not
        # popmeta.xla_flags.with_host_devices: importing popmeta here would add this
        # tree's flags to every child's XLA_FLAGS, the other tree's too.
        count = f"--xla_force_host_platform_device_count={host_devices_per_process()}"
        env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"), count]))
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    command = [sys.executable, __file__, "--one", name]
    return _measured_by(
        [*command, "--seconds", str(seconds), "--tasks", str(num_tasks)],
        env,
        f"config ({name}) from {tree or 'this tree'}",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--configs", default="a,b,c,d")
    parser.add_argument(
        "--tasks", type=int, default=NUM_TASKS, help="inner problems per estimate (all configs)"
    )
    parser.add_argument(
        "--compare-with", type=Path, help="another popmeta checkout to run side by side"
    )
    add_peer_arguments(parser)
    parser.add_argument(
        "--peer-xla-flags",
        choices=("its-own", "popmeta"),
        default="its-own",
        help="learned_optimization with the environment's XLA_FLAGS, or with popmeta's",
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs per side with --compare-with or --peer"
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.seconds, args.tasks)))
        return
    if args.compare_with is not None and args.peer is not None:
        raise SystemExit("--compare-with and --peer: give one of them")
    if args.compare_with is not None and not (args.compare_with / "popmeta").is_dir():
        raise SystemExit(f"--compare-with {args.compare_with}: no popmeta package in it")
    if args.peer is not None:
        check_peer(args.peer)
        for name in args.configs.split(","):
            peer_config(name)
    peer_flags = popmeta_xla_flags() if args.peer_xla_flags == "popmeta" else None

    def run_other(name: str) -> dict:
        if args.peer is not None:
            return run_peer(
                name,
                args.seconds,
                args.peer,
                args.peer_python,
                args.peer_data,
                args.tasks,
                peer_flags,
            )
        return _run_config(name, args.seconds, args.compare_with, args.tasks)

    import jax

    peaks = {dtype: matmul_peak_gflops(dtype=dtype) for dtype in ("float32", "bfloat16")}
    print(
        f"device: {jax.devices()[0].device_kind}, dense matmul peak (1024x1024): float32 "
        f"{peaks['float32']:.1f} GFLOP/s, bfloat16 (float32 sums) {peaks['bfloat16']:.1f} GFLOP/s"
    )
    names = args.configs.split(",")
    labels = {name: f"({name}) {describe(name)}" for name in names}
    width = max(map(len, labels.values()))
    header = f"{'config':<{width}} {'inner-steps/s':>13} {'peak RSS MB':>11} {'XLA temp MB':>11} {'GFLOP/s':>8} {'of peak':>7}"
    if args.peer is not None:
        header += f" {'learned_opt.':>13} {'ratio':>6}"
    elif args.compare_with is not None:
        header += f" {'other tree':>13} {'ratio':>6}"
    print(header)
    flags_seen: dict[tuple[str, str], list[str]] = {}  # (tree, XLA_FLAGS) -> configurations
    for name in names:
        if args.compare_with is None and args.peer is None:
            r = _run_config(name, args.seconds, None, args.tasks)
            other = None
            flags_seen.setdefault(("this tree", r["xla_flags"]), []).append(name)
        else:
            runs, others = [], []
            for _ in range(args.repeats):
                others.append(run_other(name))
                runs.append(_run_config(name, args.seconds, None, args.tasks))
            r = runs[0] | {
                "inner_steps_per_s": statistics.median(x["inner_steps_per_s"] for x in runs),
                "peak_rss_mb": max(x["peak_rss_mb"] for x in runs),
            }
            other = statistics.median(x["inner_steps_per_s"] for x in others)
            flags_seen.setdefault(("this tree", runs[0]["xla_flags"]), []).append(name)
            other_side = "the other tree" if args.peer is None else "learned_optimization"
            flags_seen.setdefault((other_side, others[0]["xla_flags"]), []).append(name)
        flops = r["flops_per_inner_step"]
        achieved = None if flops is None else r["inner_steps_per_s"] * flops / 1e9
        gflops = "-" if achieved is None else f"{achieved:.1f}"
        peak = peaks["bfloat16" if "-bf16" in name else "float32"]
        share = "-" if achieved is None else f"{100 * achieved / peak:.0f}%"
        line = (
            f"{labels[name]:<{width}} {r['inner_steps_per_s']:>13,.0f} "
            f"{r['peak_rss_mb']:>11.0f} {r['xla_temp_mb']:>11.2f} {gflops:>8} {share:>7}"
        )
        if other is not None:
            line += f" {other:>13,.0f} {r['inner_steps_per_s'] / other:>5.2f}x"
        print(line, flush=True)
    for (tree, flags), names in flags_seen.items():
        print(f"XLA_FLAGS in {tree}'s runs of {','.join(names)}: {flags or '(none)'}")


if __name__ == "__main__":
    main()
