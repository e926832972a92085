"""Where one jitted gradient estimate spends its time, by XLA operation and by part.

Run: ``python bench/profile_estimate.py [--config c] [--estimates 20] [--top 15]``
(configurations as in ``bench/estimators.py``). Time it only on a quiet
machine: it prints ``uptime`` before and after.

It times the estimate the way a worker calls it (the runner's jitted,
donating estimate), then records ``--estimates`` more under
``jax.profiler.trace`` and reads the trace's XLA operations back. Each
operation is attributed to a part of the inner step by the named scope its
HLO instruction was traced under (popmeta's core names them):
``task_loss_and_grad``, the learned optimizer's ``per_parameter_features``
and ``per_parameter_mlp``, the rest of ``learned_optimizer_update``
(accumulators, applying the step), and everything else (the estimator's
bookkeeping, resets, data sampling). XLA fuses across scopes; a fusion
counts in the part of its root instruction, so the parts are close, not
exact. Operation times are per estimate; the profiler adds a little to each
operation, so their sum runs somewhat above the untraced wall time.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from estimators import CONFIGS, build_config, inner_steps_per_estimate

#: Named scopes of popmeta's core, innermost first: an instruction belongs to the first found.
PARTS = (
    "per_parameter_mlp",
    "per_parameter_features",
    "learned_optimizer_update",
    "task_loss_and_grad",
)
OTHER = "other (estimator, resets, data)"

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) .*?op_name=\"([^\"]*)\"")


def part_of(op_name: str) -> str:
    """The part of the inner step an HLO instruction's ``op_name`` metadata names.

    A scope appears in it as a path element or, under a vmap, inside one:
    ``vmap(vmap(task_loss_and_grad))/jvp()/dot_general``.
    """
    words = set(re.findall(r"\w+", op_name))
    return next((part for part in PARTS if part in words), OTHER)


def instruction_parts(hlo_text: str) -> dict[str, tuple[str, str]]:
    """``{instruction name: (part, result shape)}`` for a compiled module's HLO text."""
    found = {}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            name, shape, op_name = match.groups()
            found[name] = (part_of(op_name), shape)
    return found


def traced_operation_us(trace_dir: Path) -> collections.Counter:
    """Microseconds per XLA operation name in the Perfetto trace written under ``trace_dir``."""
    (path,) = trace_dir.glob("**/*.trace.json.gz")
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    totals: collections.Counter = collections.Counter()
    for event in events:
        name = event.get("name", "")
        if event.get("ph") == "X" and re.fullmatch(r"[\w.\-]+", name):
            totals[name] += event["dur"]
    return totals


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="c", choices=sorted(CONFIGS))
    parser.add_argument("--estimates", type=int, default=20)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    print(uptime())

    import jax

    lopt, estimator = build_config(args.config)
    theta = lopt.init(jax.random.key(0))
    state = estimator.init_worker_state(theta, jax.random.key(2))
    # The runner's jitted, donating estimate: what a worker's call runs, compiled once.
    compiled = estimator.runner.jitted_estimate(1).lower(theta, state, jax.random.key(0)).compile()
    parts = instruction_parts(compiled.as_text())

    def run(count: int) -> float:
        nonlocal state
        start = time.perf_counter()
        for i in range(count):
            out, _ = compiled(theta, state, jax.random.key(i))
            state = out.state
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / count

    run(3)
    wall = statistics.median(run(5) for _ in range(5))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            run(args.estimates)
        per_op = traced_operation_us(Path(trace_dir))

    known = {name: us / args.estimates / 1e3 for name, us in per_op.items() if name in parts}
    total = sum(known.values())
    inner_steps = inner_steps_per_estimate(estimator)
    print(
        f"({args.config}) {CONFIGS[args.config]}: {wall * 1e3:.2f} ms per estimate untraced "
        f"({inner_steps / wall:,.0f} inner-steps/s); XLA operations traced: {total:.2f} ms "
        f"per estimate, {len(known)} distinct"
    )
    by_part: collections.Counter = collections.Counter()
    for name, ms in known.items():
        by_part[parts[name][0]] += ms
    width = max(map(len, (*PARTS, OTHER)))
    print(f"\n{'part':<{width}} {'ms/estimate':>11} {'share':>6}")
    for part, ms in by_part.most_common():
        print(f"{part:<{width}} {ms:>11.2f} {100 * ms / total:>5.0f}%")
    print(f"\n{'operation':<30} {'part':<{width}} {'ms/estimate':>11} {'share':>6}  result")
    for name, ms in sorted(known.items(), key=lambda kv: -kv[1])[: args.top]:
        part, shape = parts[name]
        print(f"{name:<30} {part:<{width}} {ms:>11.3f} {100 * ms / total:>5.1f}%  {shape}")
    print(uptime())


if __name__ == "__main__":
    main()
