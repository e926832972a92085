"""Checkpoint size and save / load time for a theta of 1e6 float32s.

Three checkpoints, each written with the real
:func:`~popmeta.learner.checkpoint_layout.save_run_checkpoint` (temporary
file, fsync, rename) and read back with
:func:`~popmeta.learner.checkpoint_layout.load_run_checkpoint`:

* ``learner``: what :meth:`popmeta.learner.learner.Learner.checkpoint_tree`
  holds: step, theta, the optax Adam state (mu and nu: two more copies of
  theta) and the learner's key;
* ``+ workers A x T``: the learner plus the exported states of A workers with
  T tasks each, shaped as PES worker states are: a theta-shaped noise
  accumulator per task (NRES keeps the same amount of noise), two antithetic
  inner states per task (an inner MLP of ``--inner-params`` float32s with
  SGDM momentum), per-task counters, and the worker's key and call counters.

The numbers scale with bytes: the accumulators dominate as soon as T tasks
per worker make ``A * T`` theta copies. Timings are wall-clock medians of
``--repeats`` rounds on the directory given (default: a temporary directory).

Usage: python bench/checkpoint.py [--theta 1000000] [--dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import optax

from popmeta.actors.records import WorkerState
from popmeta.learner.checkpoint_layout import (
    LearnerCheckpoint,
    load_run_checkpoint,
    save_run_checkpoint,
)


def learner_part(theta_size: int) -> LearnerCheckpoint:
    """The learner's part of a checkpoint with Adam's state, as the learner saves it."""
    theta = {"w": np.random.default_rng(0).standard_normal(theta_size).astype(np.float32)}
    opt_state = optax.adam(1e-3).init(theta)
    return LearnerCheckpoint(
        step=np.int32(1000),
        theta=theta,
        opt_state=jax.tree_util.tree_map(np.asarray, opt_state),
        rng=np.asarray(jax.random.key_data(jax.random.key(0))),
    )


def worker_state(theta_size: int, num_tasks: int, inner_params: int) -> WorkerState:
    """An exported worker state shaped like a PES worker's (see the module's docstring)."""
    rng = np.random.default_rng(1)

    def floats(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    member = {
        "params": floats(2, num_tasks, inner_params),
        "momentum": floats(2, num_tasks, inner_params),
        "iteration": np.zeros((2, num_tasks), np.int32),
        "length": np.zeros((2, num_tasks), np.int32),
        "is_done": np.zeros((2, num_tasks), bool),
    }
    return WorkerState(
        key=np.zeros(2, np.uint32),
        last_version=np.int64(999),
        repeats=np.int64(0),
        state={
            "member_states": member,
            "accumulator": {"w": floats(num_tasks, theta_size)},
            "starts_with_reset": np.zeros(num_tasks, bool),
        },
    )


def measure(
    directory: Path, learner: LearnerCheckpoint, workers: dict[int, WorkerState], repeats: int
) -> tuple[int, float, float, float]:
    """File size in bytes and median seconds to save, load whole, and load the learner only.

    The learner-only load is what ``popmeta eval`` reads: the optional workers
    section is neither read nor checked.
    """
    worker = next(iter(workers.values()), None)
    saves, loads, learner_loads = [], [], []
    for step in range(repeats):
        start = time.perf_counter()
        path = save_run_checkpoint(
            directory, learner._replace(step=np.int32(step)), workers, {}, [], keep=1
        )
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        load_run_checkpoint(path, learner, worker)
        loads.append(time.perf_counter() - start)
        start = time.perf_counter()
        load_run_checkpoint(path, learner)
        learner_loads.append(time.perf_counter() - start)
    medians = (statistics.median(x) for x in (saves, loads, learner_loads))
    return (path.stat().st_size, *medians)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--theta", type=int, default=1_000_000, help="float32s in theta")
    parser.add_argument("--inner-params", type=int, default=10_000, help="per inner problem")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write")
    args = parser.parse_args()

    learner = learner_part(args.theta)
    cases: list[tuple[str, dict[int, WorkerState]]] = [("learner (theta + Adam)", {})]
    for actors, tasks in ((2, 4), (4, 8)):
        state = worker_state(args.theta, tasks, args.inner_params)
        cases.append((f"+ workers {actors} x {tasks} tasks", dict.fromkeys(range(actors), state)))

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        print(f"theta: {args.theta:,} float32; inner problems: {args.inner_params:,} params")
        print(f"{'checkpoint':<28} {'size MB':>9} {'save s':>8} {'load s':>8} {'learner s':>9}")
        for index, (name, workers) in enumerate(cases):
            # A directory each: keep=1 would otherwise drop a case's file for an older step.
            size, save_s, load_s, learner_s = measure(
                Path(tmp) / str(index), learner, workers, args.repeats
            )
            print(f"{name:<28} {size / 1e6:>9.1f} {save_s:>8.3f} {load_s:>8.3f} {learner_s:>9.3f}")


if __name__ == "__main__":
    main()
