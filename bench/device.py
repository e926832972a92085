"""The accelerator check's measurements (``bench/device.sh`` installs, then runs this).

Prints, for the machine's first accelerator chip (or CPU, where there is none):
its dense matmul peak in float32 and in bfloat16 with float32 sums; the
inner-steps/s of bench/estimators.py's configurations (c) and (e), float32
and bfloat16, each with the share of that peak it reaches; then a 2-actor
``popmeta train configs/digits_mlp.yaml`` of ``--steps`` steps on Ray (both
actors on the one chip) and the estimates/s it logged. Numbers only; nothing
passes or fails.

    python bench/device.py [--seconds 5] [--steps 500] [--configs c,c-bf16,e,e-bf16]

``tests/test_device_check.py`` runs it on CPU, on forced host devices.
"""

from __future__ import annotations

import argparse
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

from estimators import CONFIGS, _run_config, matmul_peak_gflops  # noqa: E402

#: The side of the square matrices the peak is measured on: large enough to
#: fill a GPU, still seconds on a CPU.
PEAK_SIZE = {"cpu": 1024}
DEFAULT_PEAK_SIZE = 8192


def chips() -> tuple[str, int, str]:
    """The platform, how many chips JAX sees, and the first one's kind."""
    import jax

    devices = jax.devices()
    return devices[0].platform, len(devices), devices[0].device_kind


def estimator_rows(configs: list[str], seconds: float, peaks: dict[str, float]) -> list[str]:
    """One line per configuration: inner-steps/s on one chip, GFLOP/s and share of its peak."""
    lines = []
    for name in configs:
        result = _run_config(name, seconds, None)
        rate, flops = result["inner_steps_per_s"], result["flops_per_inner_step"]
        peak = peaks["bfloat16" if "-bf16" in name else "float32"]
        achieved = rate * flops / 1e9 if flops else float("nan")
        lines.append(
            f"  {'(' + name + ') ' + CONFIGS[name]:<50} {rate:>14,.0f} inner-steps/s per chip  "
            f"{achieved:>8.1f} GFLOP/s  {100 * achieved / peak:>4.0f}% of peak  "
            f"peak RSS {result['peak_rss_mb']:,.0f} MB  XLA temp {result['xla_temp_mb']:.1f} MB"
        )
        print(lines[-1], flush=True)
    return lines


def train_run(steps: int, platform: str) -> str:
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
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        seconds = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        return f"  popmeta train failed (exit {proc.returncode}):\n{output[-3000:]}"
    rates = re.findall(r"est/s=([0-9.]+)", output)
    last = rates[-1] if rates else "?"
    return (
        f"  popmeta train configs/digits_mlp.yaml, 2 actors, {steps} steps: "
        f"{last} estimates/s at the last progress line, {seconds:.0f} s launch to exit"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--configs", default="c,c-bf16-mlp,c-bf16,e,e-bf16-mlp,e-bf16")
    args = parser.parse_args(argv)
    platform, count, kind = chips()
    size = PEAK_SIZE.get(platform, DEFAULT_PEAK_SIZE)
    peaks = {d: matmul_peak_gflops(size, dtype=d) for d in ("float32", "bfloat16")}
    print(time.strftime("%Y-%m-%d %H:%M:%S %Z"), flush=True)
    print(f"{platform}: {count} chip(s), {kind}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(
        f"  dense matmul peak ({size}x{size}): float32 {peaks['float32']:,.1f} GFLOP/s, "
        f"bfloat16 with float32 sums {peaks['bfloat16']:,.1f} GFLOP/s",
        flush=True,
    )
    estimator_rows(args.configs.split(","), args.seconds, peaks)
    print(train_run(args.steps, platform), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
