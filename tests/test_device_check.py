"""The accelerator check's Python part (bench/device.py), run on CPU on forced host devices.

``bench/device.sh`` only installs and calls it, so what a GPU machine would
run is this, short: every configuration it measures prints a rate and a share
of the measured peak, and the 2-actor ``popmeta train`` ends with a rate.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(600)


def test_the_device_check_measures_every_configuration_and_a_two_actor_run():
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(
        filter(None, [env.get("XLA_FLAGS"), "--xla_force_host_platform_device_count=2"])
    )
    env["JAX_PLATFORMS"] = "cpu"
    configs, task_counts = ["c", "c-bf16"], [4, 8]
    command = [sys.executable, "bench/device.py", "--seconds", "0.3", "--steps", "20"]
    proc = subprocess.run(
        [*command, "--configs", ",".join(configs), "--tasks", ",".join(map(str, task_counts))],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "cpu: 2 chip(s)" in out
    assert re.search(
        r"float32 [\d,.]+ GFLOP/s \([\d,.]+ at the highest precision\), "
        r"bfloat16 with float32 sums [\d,.]+ GFLOP/s",
        out,
    )
    for name in configs:
        lines = [line for line in out.splitlines() if line.strip().startswith(f"({name}) ")]
        assert [int(re.search(r", (\d+) tasks ", line)[1]) for line in lines] == task_counts
        for line in lines:
            rate = float(re.search(r"([\d,]+) inner-steps/s per chip", line)[1].replace(",", ""))
            share = float(re.search(r"(\d+)% of peak", line)[1])
            assert rate > 0 and share > 0, line
    run = re.search(r"2 actors, 20 steps: ([\d.]+) estimates/s", out)
    assert run and float(run[1]) > 0, out


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--tasks", "8,x", "positive integers"),
        ("--tasks", "0", "positive integers"),
        ("--configs", "c,z", "unknown ['z']"),
    ],
)
def test_a_bad_flag_is_refused_before_any_measurement(flag, value, named):
    proc = subprocess.run(
        [sys.executable, "bench/device.py", flag, value],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"argument {flag}" in proc.stderr and named in proc.stderr, proc.stderr
    assert "GFLOP/s" not in proc.stdout  # nothing was measured
