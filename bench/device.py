"""The accelerator check's measurements (``bench/device.sh`` installs, then runs this).

Prints, for the machine's first accelerator chip (or CPU, where there is none):
its dense matmul peak in float32 (at JAX's default matmul precision, which
the configurations use and which a GPU may run on TF32 tensor cores; and at
the highest precision, for comparison) and in bfloat16 with float32 sums; a
2-actor ``popmeta train configs/digits_mlp.yaml`` of ``--steps`` steps on Ray
(both actors on the one chip) and the estimates/s it logged; then the
inner-steps/s of bench/estimators.py's configurations (c) and (e), float32
and bfloat16, each with the share of that peak it reaches, at each
``--tasks`` count of inner problems per estimate (by default 8 on CPU, the
CPU figures' population, and 256 on an accelerator, which 8 leaves mostly
idle). Numbers only; a part that fails prints why and the others still run.

    python bench/device.py [--seconds 5] [--steps 500] [--configs c,c-bf16,e,e-bf16] [--tasks 8,256]

``tests/test_device_check.py`` runs it on CPU, on forced host devices.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

from estimators import CONFIGS, NUM_TASKS, _run_config, matmul_peak_gflops  # noqa: E402

#: The side of the square matrices the peak is measured on: large enough to
#: fill a GPU, still seconds on a CPU.
PEAK_SIZE = {"cpu": 1024}
DEFAULT_PEAK_SIZE = 8192
#: Inner problems per estimate unless ``--tasks`` is given: the CPU figures' on CPU,
#: enough to keep an accelerator busy elsewhere.
DEFAULT_TASKS = {"cpu": NUM_TASKS}
ACCELERATOR_TASKS = 256


def chips() -> tuple[str, int, str]:
    """The platform, how many chips JAX sees, and the first one's kind."""
    import jax

    devices = jax.devices()
    return devices[0].platform, len(devices), devices[0].device_kind


def print_estimator_rows(
    configs: list[str], seconds: float, peaks: dict[str, float], task_counts: list[int]
) -> None:
    """One line per configuration and task count: inner-steps/s on one chip, GFLOP/s, share of peak."""
    for num_tasks, name in itertools.product(task_counts, configs):
        label = f"({name}) {CONFIGS[name]}, {num_tasks} tasks"
        try:
            result = _run_config(name, seconds, None, num_tasks)
        except SystemExit as failure:  # _run_config's way of saying the subprocess failed
            print(f"  {label}: failed, {str(failure)[-1500:]}", flush=True)
            continue
        rate, flops = result["inner_steps_per_s"], result["flops_per_inner_step"]
        peak = peaks["bfloat16" if "-bf16" in name else "float32"]
        achieved = rate * flops / 1e9 if flops else float("nan")
        print(
            f"  {label:<60} {rate:>14,.0f} inner-steps/s per chip  "
            f"{achieved:>9.1f} GFLOP/s  {100 * achieved / peak:>4.0f}% of peak  "
            f"peak RSS {result['peak_rss_mb']:,.0f} MB  XLA temp {result['xla_temp_mb']:.1f} MB",
            flush=True,
        )


def _task_counts(text: str) -> list[int]:
    """``--tasks``: positive integers separated by commas."""
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(
            f"expected positive integers separated by commas, e.g. 8,256; got {text!r}"
        )
    return counts


def _config_names(text: str) -> list[str]:
    """``--configs``: names of bench/estimators.py's configurations, separated by commas."""
    names = text.split(",")
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown {unknown}; the configurations: {sorted(CONFIGS)}"
        )
    return names


def train_run(steps: int, platform: str, timeout_s: float) -> str:
    """A 2-actor ``popmeta train configs/digits_mlp.yaml`` of ``steps`` steps; its last rate."""
    overrides = [
        f"train.num_steps={steps}",
        f"train.log_every={max(1, steps // 5)}",
        f"train.checkpoint_every={steps}",
        "eval.after_training=false",
        "population.num_actors=2",
    ]
    if platform == "gpu":
        overrides.append("population.num_gpus=0.5")  # both actors on the one chip
    with tempfile.TemporaryDirectory(prefix="pm-device-") as run_dir:
        command = [sys.executable, "-m", "popmeta.cli", "train", "configs/digits_mlp.yaml"]
        for override in [*overrides, f"run_dir={run_dir}", "name=device-check"]:
            command += ["--set", override]
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired as stopped:
            output = f"{stopped.stdout or ''}{stopped.stderr or ''}"
            return f"  popmeta train stopped after {timeout_s:.0f} s:\n{output[-3000:]}"
        seconds = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        return f"  popmeta train failed (exit {proc.returncode}):\n{output[-3000:]}"
    progress = [line.strip() for line in output.splitlines() if "est/s=" in line]
    last = progress[-1] if progress else "(no progress line)"
    rate = re.search(r"est/s=([0-9.]+)", last)
    return (
        f"  popmeta train configs/digits_mlp.yaml, 2 actors, {steps} steps: "
        f"{rate[1] if rate else '?'} estimates/s at the last progress line, "
        f"{seconds:.0f} s launch to exit\n    {last}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument(
        "--configs", type=_config_names, default="c,c-bf16-mlp,c-bf16,e,e-bf16-mlp,e-bf16"
    )
    parser.add_argument(
        "--tasks", type=_task_counts, help="inner problems per estimate, e.g. 8,256"
    )
    parser.add_argument("--train-timeout", type=float, default=300.0, help="seconds")
    args = parser.parse_args(argv)
    platform, count, kind = chips()
    import jax

    size = PEAK_SIZE.get(platform, DEFAULT_PEAK_SIZE)
    peaks = {d: matmul_peak_gflops(size, dtype=d) for d in ("float32", "bfloat16")}
    with jax.default_matmul_precision("highest"):
        highest = matmul_peak_gflops(size, dtype="float32")
    print(time.strftime("%Y-%m-%d %H:%M:%S %Z"), flush=True)
    print(
        f"{platform}: {count} chip(s), {kind}; jax {jax.__version__}; "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; "
        f"default matmul precision {jax.config.jax_default_matmul_precision or 'default'}"
    )
    print(
        f"  dense matmul peak ({size}x{size}): float32 {peaks['float32']:,.1f} GFLOP/s "
        f"({highest:,.1f} at the highest precision), "
        f"bfloat16 with float32 sums {peaks['bfloat16']:,.1f} GFLOP/s",
        flush=True,
    )
    # The run first: it is the check's only multi-process part, the likeliest to fail.
    print(train_run(args.steps, platform, args.train_timeout), flush=True)
    task_counts = args.tasks or [DEFAULT_TASKS.get(platform, ACCELERATOR_TASKS)]
    print_estimator_rows(args.configs, args.seconds, peaks, task_counts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
