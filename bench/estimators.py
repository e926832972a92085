"""Estimator throughput: inner-steps/s, peak memory and achieved GFLOP/s, side by side.

Run: ``python bench/estimators.py [--seconds 5] [--configs a,b,c,d]``

Each configuration runs in its own subprocess (so its peak RSS is its own):
the estimator's jitted truncation plus the learner's jitted, donating outer
Adam step, timed over ``--seconds`` after compilation and warm-up. Inner steps
count every task and every antithetic member. It prints absolute numbers
only, and the achieved GFLOP/s as a share of the dense matmul peak measured
in the same run: a ratio against another system counts only when both ran
side by side, which this script does not do (the README's reference table
says how that comparison was made).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

CONFIGS = {
    "a": "PES + LearnableSGDM, quadratic(10)",
    "b": "PES + MLPLOpt, quadratic(10)",
    "c": "PES + MLPLOpt, digits image MLP",
    "d": "FullES(50) + LearnableSGDM, quadratic(10)",
}


def _build(name: str):
    import popmeta as pm

    lopt = pm.LearnableSGDM() if name in ("a", "d") else pm.MLPLOpt()
    if name == "c":
        family = pm.single_task_to_family(pm.ImageMLP_Digits8_Relu32())
    else:
        family = pm.FixedDimQuadraticFamilyData(10)
    step = pm.VectorizedLOptTruncatedStep(
        family,
        lopt,
        pm.ConstantTruncationSchedule(50),
        num_tasks=8,
        random_initial_iteration_offset=0 if name == "d" else 50,
    )
    if name == "d":
        estimator = pm.FullES(step, pm.ConstantTruncationSchedule(50), std=0.01)
    else:
        estimator = pm.TruncatedPES(step, trunc_length=10, std=0.01)
    return lopt, estimator


def _flops_per_inner_step(name: str, theta) -> float | None:
    """Analytic matmul FLOPs of one inner step of the image task (elementwise ops ignored)."""
    if name != "c":
        return None
    import jax

    import popmeta as pm

    task = pm.ImageMLP_Digits8_Relu32()
    params = task.init(jax.random.key(0))
    layers = [x.shape for x in jax.tree_util.tree_leaves(params) if x.ndim == 2]
    batch = 128
    task_flops = 3 * 2 * batch * sum(i * o for i, o in layers)  # forward + backward
    num_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    lopt_layers = [x.shape for x in jax.tree_util.tree_leaves(theta) if x.ndim == 2]
    lopt_flops = num_params * 2 * sum(i * o for i, o in lopt_layers)
    return float(task_flops + lopt_flops)


def run_one(name: str, seconds: float) -> dict:
    import jax
    import optax

    from popmeta.learner.train_state import TrainState, build_apply_estimate_fn

    lopt, estimator = _build(name)
    theta = lopt.init(jax.random.key(0))
    flops_per_step = _flops_per_inner_step(name, theta)
    train_state = TrainState.initial_state(theta, optax.adam(1e-3), jax.random.key(1))
    apply = build_apply_estimate_fn(donate_params_and_state=True)
    worker = estimator.init_worker_state(train_state.params, jax.random.key(2))

    lowered = jax.jit(estimator.estimate).lower(train_state.params, worker, jax.random.key(0))
    memory = lowered.compile().memory_analysis()
    temp_mb = getattr(memory, "temp_size_in_bytes", 0) / 2**20 if memory else float("nan")

    def one(i):
        nonlocal worker, train_state
        out, _ = estimator.compute_gradient_estimate(train_state.params, worker, jax.random.key(i))
        worker = out.state
        train_state, _ = apply(train_state, out.grad)

    for i in range(3):
        one(i)
    jax.block_until_ready(train_state.params)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            one(count)
            count += 1
        jax.block_until_ready(train_state.params)
    elapsed = time.perf_counter() - start
    steps_per_estimate = (
        estimator.num_members * estimator.truncated_step.num_tasks * (estimator.trunc_length)
    )
    steps_per_s = count * steps_per_estimate / elapsed
    return {
        "config": name,
        "estimates_per_s": count / elapsed,
        "inner_steps_per_s": steps_per_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "xla_temp_mb": temp_mb,
        "gflops": None if flops_per_step is None else steps_per_s * flops_per_step / 1e9,
    }


def matmul_peak_gflops(n: int = 1024, seconds: float = 2.0) -> float:
    """This machine's dense float32 matmul rate through XLA."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    matmul = jax.jit(lambda a: a @ a)
    matmul(a).block_until_ready()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        matmul(a).block_until_ready()
        count += 1
    return count * 2 * n**3 / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--configs", default="a,b,c,d")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.seconds)))
        return

    import jax

    peak = matmul_peak_gflops()
    print(f"device: {jax.devices()[0].device_kind}, dense float32 matmul peak {peak:.1f} GFLOP/s")
    header = f"{'config':<44} {'inner-steps/s':>13} {'peak RSS MB':>11} {'XLA temp MB':>11} {'GFLOP/s':>8} {'of peak':>7}"
    print(header)
    for name in args.configs.split(","):
        proc = subprocess.run(
            [sys.executable, __file__, "--one", name, "--seconds", str(args.seconds)],
            capture_output=True,
            text=True,
            check=True,
        )
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        gflops = "-" if r["gflops"] is None else f"{r['gflops']:.1f}"
        share = "-" if r["gflops"] is None else f"{100 * r['gflops'] / peak:.0f}%"
        print(
            f"({name}) {CONFIGS[name]:<40} {r['inner_steps_per_s']:>13,.0f} "
            f"{r['peak_rss_mb']:>11.0f} {r['xla_temp_mb']:>11.2f} {gflops:>8} {share:>7}"
        )


if __name__ == "__main__":
    main()
