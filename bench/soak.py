"""Soak: the Ray population under actor losses, sync and async, for a fixed time.

Run: ``python bench/soak.py [--minutes 2] [--kill-every 5] [--mode sync|async|both]
[--actors N] [--config configs/quickstart.yaml] [--set key=value ...]``

``--runs N`` instead starts N whole ``popmeta train`` processes per mode, one
after another, each for ``--steps`` steps, and kills a random actor of the
run every ``--kill-every`` seconds from its launch on, the first as soon as
an actor is in its constructor (a kill during the population's start). Every
run must finish with exit status 0; it prints, per run, the exit status, the
wall time, the kills (of starting actors among them) and the counts the run
wrote to TensorBoard (actor restarts, estimates missing from sync rounds,
lost in flight, dropped as stale, accepted late, live actors at the end):
``python bench/soak.py --runs 10 --kill-every 6 --mode both --actors 3``.

Runs the real learner loop (gather, aggregate, jitted update) on an embedded
Ray instance while a timer thread kills a random estimator actor with SIGKILL
every ``--kill-every`` seconds, ready or still starting (a kill interval
shorter than a replacement's start kills replacements before they deliver
anything). Each mode stops by itself after ``--minutes`` and prints:

* updates applied, and estimates accepted;
* estimates dropped by cause: stale (async, beyond ``max_staleness``),
  missing from sync rounds (a rank without an estimate in a round: its actor
  was lost during it or was still starting), lost in flight (calls of an actor
  that died with them); and estimates accepted late by the starvation guard;
* kills (of actors still starting among them), replacements, and how long
  replacements took from spawn to ready;
* the longest learner stall (longest time between consecutive updates), the
  median time between updates, the stall after each kill (longest time
  between updates within ``--kill-every`` seconds after it) and the update
  rate while a replacement starts: the cost of one actor loss;
* whether theta stayed finite;
* memory: the resident set size (RSS) of the driver (learner) and of the
  actors (largest live actor), sampled every 10 s; the samples one minute in
  (after compilation and the first checkpoints of caches) and at the end, and
  the largest. ``--kill-every 0`` kills nothing, for a run whose memory should
  stay flat: ``python bench/soak.py --minutes 10 --kill-every 0 --mode sync``.

``--startup`` instead measures a replacement's time to first estimate: one
sync actor is killed three times in each of three setups, JAX's persistent
compilation cache off (every replacement compiles), on in a fresh directory,
and on in its default directory (every replacement loads the compilations of
the first actor).

Actor processes are found under /proc (children of this driver's raylet named
``ray::EstimatorActor``), so the timer thread never touches the population,
which is not thread-safe, and also finds replacements that have not reported
their pid yet. Linux only.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import numpy as np

from popmeta.config import Config, load_config
from popmeta.experiment import WorkerSpec, learner_start
from popmeta.learner.learner import Learner
from popmeta.population.ray_population import RayPopulation
from popmeta.population.ray_runtime import start_ray_for

REPO = Path(__file__).resolve().parents[1]
ACTOR_TITLE = "ray::EstimatorActor"


# ---------------------------------------------------------------------- processes


def _stat(pid: str) -> tuple[int, str] | None:
    """(parent pid, command line) of a process, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return None
    # The command name (2nd field) may hold spaces and parentheses: split after its last ')'.
    ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
    return ppid, cmdline.decode(errors="replace").strip()


def _processes() -> dict[int, tuple[int, str]]:
    found = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit() and (entry := _stat(pid)) is not None:
            found[int(pid)] = entry
    return found


def actor_processes(driver: int | None = None) -> dict[int, str]:
    """Pid -> title of a driver's estimator actor processes (ready or starting).

    The driver (this process by default) started the raylet, and the raylet
    starts the actor processes, which Ray renames ``ray::EstimatorActor``
    (``...EstimatorActor.__init__`` while the constructor runs).
    """
    processes = _processes()
    me = os.getpid() if driver is None else driver
    raylets = {pid for pid, (ppid, cmd) in processes.items() if ppid == me and "raylet" in cmd}
    return {
        pid: cmd
        for pid, (ppid, cmd) in processes.items()
        if ppid in raylets and cmd.startswith(ACTOR_TITLE)
    }


def rss_mb(pid: int | str = "self") -> float:
    """Resident set size of a process in MiB (0 if it has gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    kib = next((line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return int(kib) / 1024


class MemorySamples:
    """RSS of the driver and of the largest live actor, sampled at most every ``every_s``."""

    def __init__(self, start: float, every_s: float = 10.0):
        self.start = start
        self.every_s = every_s
        self.samples: list[tuple[float, float, float]] = []  # (seconds in, driver, actor)

    def maybe_sample(self) -> None:
        now = time.monotonic()
        if self.samples and now - self.start - self.samples[-1][0] < self.every_s:
            return
        actors = [rss_mb(pid) for pid in actor_processes()]
        self.samples.append((now - self.start, rss_mb(), max(actors, default=0.0)))

    def report(self) -> None:
        if not self.samples:
            return
        first = next((s for s in self.samples if s[0] >= 60), self.samples[0])
        last = self.samples[-1]
        for label, i in (("driver", 1), ("largest actor", 2)):
            print(
                f"  RSS {label:<29} {first[i]:,.0f} MB at {first[0] / 60:.1f} min, "
                f"{last[i]:,.0f} MB at {last[0] / 60:.1f} min "
                f"(max {max(s[i] for s in self.samples):,.0f} MB)"
            )


class Killer(threading.Thread):
    """Kills a random actor process every ``every_s`` seconds until stopped or ``until``.

    Args:
      every_s: seconds between kills.
      until: ``time.monotonic()`` after which it kills no more.
      seed: seed of the choice of victims.
      driver: whose actors (default: this process's).
      first_while_starting: the first kill as soon as an actor is in its
        constructor, then every ``every_s`` seconds.
    """

    def __init__(
        self,
        every_s: float,
        until: float,
        seed: int = 0,
        driver: int | None = None,
        first_while_starting: bool = False,
    ):
        super().__init__(daemon=True)
        self.every_s = every_s
        self.until = until
        self.random = random.Random(seed)
        self.driver = driver
        self.first_while_starting = first_while_starting
        self.stop = threading.Event()
        self.kills: list[tuple[float, bool]] = []  # (time.monotonic(), the actor was starting)

    def _kill(self, actors: dict[int, str]) -> None:
        pid = self.random.choice(sorted(actors))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.kills.append((time.monotonic(), "__init__" in actors[pid]))

    def run(self) -> None:
        if self.first_while_starting:
            while not self.stop.wait(0.05) and time.monotonic() < self.until:
                starting = {
                    pid: title
                    for pid, title in actor_processes(self.driver).items()
                    if "__init__" in title
                }
                if starting:
                    self._kill(starting)
                    break
        # Stops by itself at ``until`` as well: kills faster than replacements
        # start can leave no actor ready, and the learner waits for one.
        while not self.stop.wait(self.every_s) and time.monotonic() < self.until:
            actors = actor_processes(self.driver)
            if actors:
                self._kill(actors)


class ReadyTimes(logging.Handler):
    """Collects the supervisor's spawn-to-ready times of replacements."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seconds: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "ready in %.1fs" in str(record.msg) and record.args:
            self.seconds.append(float(record.args[-1]))  # type: ignore[index]


# ---------------------------------------------------------------------- soak


def soak_config(args: argparse.Namespace, mode: str) -> Config:
    overrides = [
        f"population.mode={mode}",
        f"population.num_actors={args.actors}",
        "population.max_actor_restarts=1000000",
        "train.num_steps=100000000",
        *args.set,
    ]
    return load_config(args.config, overrides)


def theta_is_finite(theta) -> bool:
    return all(np.all(np.isfinite(leaf)) for leaf in jax.tree_util.tree_leaves(theta))


def soak(args: argparse.Namespace, mode: str) -> bool:
    """One mode's soak; prints its report and returns whether theta stayed finite."""
    config = soak_config(args, mode)
    pc = config.population
    settings = f"mode={mode} actors={pc.num_actors} minutes={args.minutes:g}"
    if mode == "async":
        settings += f" batch_size={pc.batch_size} max_staleness={pc.max_staleness}"
    print(f"\nsoak: {settings} kill_every={args.kill_every:g}s config={args.config}", flush=True)
    ready_times = ReadyTimes()
    logger = logging.getLogger("popmeta")
    logger.addHandler(ready_times)
    logger.setLevel(logging.INFO)
    learner = Learner.of(learner_start(config))
    counts = dict.fromkeys(
        ["accepted", "stale", "missing", "lost", "late", "restarts", "empty_rounds"], 0
    )
    update_times: list[float] = []
    finite = True
    with start_ray_for(pc), RayPopulation(config.population, WorkerSpec.of(config)) as population:
        # Warm-up: compile the learner's update before the clock starts.
        gathered = population.gather(learner.theta(), learner.version)
        learner.update(gathered.estimates)
        start = time.monotonic()
        end = start + 60 * args.minutes
        killer = Killer(args.kill_every, end, seed=args.seed)
        memory = MemorySamples(start)
        update_times.append(start)
        if args.kill_every > 0:
            killer.start()
        try:
            while time.monotonic() < end:
                memory.maybe_sample()
                gathered = population.gather(learner.theta(), learner.version)
                counts["accepted"] += len(gathered.estimates)
                counts["stale"] += sum(gathered.dropped_stale.values())
                counts["missing"] += len(gathered.missing)
                counts["lost"] += gathered.lost_in_flight
                counts["late"] += sum(gathered.accepted_late.values())
                counts["restarts"] += gathered.restarted
                if learner.update(gathered.estimates).norms is None:
                    counts["empty_rounds"] += 1
                    continue
                update_times.append(time.monotonic())
                if learner.version % 1000 == 0 and not theta_is_finite(learner.theta()):
                    finite = False
                    break
            memory.maybe_sample()
        finally:
            killer.stop.set()
            if killer.is_alive():
                killer.join()
            logger.removeHandler(ready_times)
    finite = finite and theta_is_finite(learner.theta())
    report(counts, update_times, killer.kills, ready_times.seconds, args.kill_every, finite)
    memory.report()
    return finite


def report(
    counts: dict[str, int],
    update_times: list[float],
    kills: list[tuple[float, bool]],
    ready_s: list[float],
    kill_every: float,
    finite: bool,
) -> None:
    """Prints one mode's numbers (see the module's docstring)."""
    times = np.asarray(update_times)
    gaps = np.diff(times)
    elapsed = times[-1] - times[0]
    updates = len(gaps)
    longest = int(np.argmax(gaps)) if updates else 0
    print(f"  updates applied                   {updates:,} ({updates / elapsed:,.0f}/s)")
    print(f"  estimates accepted                {counts['accepted']:,}")
    print(f"  dropped: stale                    {counts['stale']:,}")
    print(f"  dropped: missing from sync rounds {counts['missing']:,}")
    print(f"  dropped: lost in flight           {counts['lost']:,}")
    print(f"  accepted late (starving ranks)    {counts['late']:,}")
    print(f"  rounds without an estimate        {counts['empty_rounds']:,}")
    starting = sum(was_starting for _, was_starting in kills)
    print(f"  kills                             {len(kills):,} ({starting} of starting actors)")
    print(f"  restarts                          {counts['restarts']:,}")
    if ready_s:
        print(
            f"  replacement spawn -> ready        median {statistics.median(ready_s):.2f} s, "
            f"max {max(ready_s):.2f} s ({len(ready_s)} replacements ready)"
        )
    if updates:
        print(
            f"  longest learner stall             {gaps[longest]:.3f} s "
            f"(at {times[longest] - times[0]:.1f} s); median gap {np.median(gaps) * 1e3:.2f} ms"
        )
    after = []
    for at, _ in kills:
        window = (times[1:] > at) & (times[:-1] < at + kill_every)
        if window.any():
            after.append(float(gaps[window].max()))
    if after:
        print(
            f"  stall after a kill                median {statistics.median(after):.3f} s, "
            f"max {max(after):.3f} s (longest gap within {kill_every:g} s of each kill)"
        )
    # The throughput while a replacement starts: updates in the (median) time
    # from a kill to its replacement being ready, against the whole run's rate.
    window = min(statistics.median(ready_s) if ready_s else kill_every, kill_every)
    rates = [
        np.count_nonzero((times > at) & (times <= at + window)) / window
        for at, _ in kills
        if at + window <= times[-1]
    ]
    if rates and updates:
        print(
            f"  updates/s while replacing         median {statistics.median(rates):,.0f}/s "
            f"(first {window:.1f} s after each kill) vs {updates / elapsed:,.0f}/s overall"
        )
    print(f"  theta finite                      {'yes' if finite else 'NO'}", flush=True)


# ---------------------------------------------------------------------- whole runs

#: TensorBoard counts a run reports at its last step, and their labels.
RUN_COUNTS = {
    "actor_restarts": "restarts",
    "missing_estimates": "missing",
    "lost_in_flight": "lost",
    "dropped_stale": "stale",
    "accepted_late": "late",
    "live_actors": "live",
}


def last_scalars(run_dir: Path) -> dict[str, float]:
    """The last value of each scalar the run wrote to TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: events.Scalars(tag)[-1].value for tag in events.Tags()["scalars"]}


def one_run(args: argparse.Namespace, mode: str, index: int, root: str) -> dict[str, float]:
    """One ``popmeta train`` whose actors are killed; its exit status, time and counts."""
    name = f"soak-{mode}-{index}"
    command = [
        sys.executable,
        "-m",
        "popmeta.cli",
        "train",
        args.config,
        *("--set", f"name={name}", "--set", f"run_dir={root}"),
        *("--set", f"population.mode={mode}", "--set", f"population.num_actors={args.actors}"),
        *("--set", f"train.num_steps={args.steps}", "--set", "eval.after_training=false"),
        *[item for override in args.set for item in ("--set", override)],
    ]
    start = time.monotonic()
    log_path = Path(root) / f"{name}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        killer = Killer(
            args.kill_every,
            start + 3600,
            seed=args.seed + index,
            driver=process.pid,
            first_while_starting=True,
        )
        killer.start()
        try:
            status = process.wait(timeout=3600)
        finally:
            killer.stop.set()
            killer.join()
    result = {"status": status, "seconds": time.monotonic() - start}
    result["kills"] = len(killer.kills)
    result["starting"] = sum(starting for _, starting in killer.kills)
    counts = last_scalars(Path(root) / name) if status == 0 else {}
    result.update({label: counts.get(tag, float("nan")) for tag, label in RUN_COUNTS.items()})
    if status != 0:
        print(log_path.read_text()[-2000:], flush=True)
    return result


def cli_runs(args: argparse.Namespace, mode: str) -> bool:
    """``--runs`` whole runs of one mode; prints a line per run; True if every run finished."""
    print(
        f"\nsoak runs: popmeta train, mode={mode} actors={args.actors} steps={args.steps} "
        f"kill_every={args.kill_every:g}s (the first while an actor starts) "
        f"config={args.config}",
        flush=True,
    )
    columns = ["status", "seconds", "kills", "starting", *RUN_COUNTS.values()]
    print("  run  " + "  ".join(f"{c:>8}" for c in columns), flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="popmeta-soak-runs-") as root:
        for index in range(args.runs):
            result = one_run(args, mode, index, root)
            results.append(result)
            cells = "  ".join(f"{result[c]:>8.0f}" for c in columns)
            print(f"  {index:>3}  {cells}", flush=True)
    finished = sum(r["status"] == 0 for r in results)
    kills = sum(r["kills"] for r in results)
    restarts = sum(r["restarts"] for r in results if r["status"] == 0)
    print(
        f"  finished {finished}/{len(results)}; kills {kills} "
        f"({sum(r['starting'] for r in results)} of starting actors); "
        f"restarts in TensorBoard {restarts:.0f}",
        flush=True,
    )
    return finished == len(results)


# ---------------------------------------------------------------------- startup


def time_to_first_estimate(config: Config, kills: int) -> list[float]:
    """Seconds from SIGKILL of the only actor to the first estimate of its replacement."""
    learner = Learner.of(learner_start(config))
    seconds = []
    with RayPopulation(config.population, WorkerSpec.of(config)) as population:
        population.gather(learner.theta(), learner.version)
        for version in range(1, kills + 1):
            (info,) = population.describe_actors()
            start = time.monotonic()
            os.kill(info.pid, signal.SIGKILL)
            # Sync with one actor: the round waits for the replacement's estimate.
            gathered = population.gather(learner.theta(), version)
            seconds.append(time.monotonic() - start)
            assert gathered.restarted == 1 and len(gathered.estimates) == 1
    return seconds


def startup(args: argparse.Namespace) -> None:
    """Prints a replacement's time to first estimate with the compilation cache off and on."""
    base = ["population.mode=sync", "population.num_actors=1", *args.set]
    print(f"\nreplacement start: 1 sync actor, config={args.config}", flush=True)
    with tempfile.TemporaryDirectory(prefix="popmeta-soak-cache-") as cache:
        runs = {
            "cache off": "population.env={JAX_ENABLE_COMPILATION_CACHE: 'false'}",
            "cache on, fresh dir": f"population.env={{JAX_COMPILATION_CACHE_DIR: '{cache}'}}",
            "default cache": "population.env={}",
        }
        configs = {label: load_config(args.config, [*base, env]) for label, env in runs.items()}
        with start_ray_for(configs["cache off"].population):
            for label, config in configs.items():
                seconds = time_to_first_estimate(config, kills=3)
                text = ", ".join(f"{s:.2f}" for s in seconds)
                print(f"  kill -> replacement's first estimate, {label:<20} {text} s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument(
        "--kill-every", type=float, default=5.0, help="seconds between kills (0: none)"
    )
    parser.add_argument("--mode", choices=["sync", "async", "both"], default="both")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--config", default=str(REPO / "configs" / "quickstart.yaml"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--seed", type=int, default=0, help="seed of the choice of victims")
    parser.add_argument(
        "--startup", action="store_true", help="measure replacement start, cache off vs on"
    )
    parser.add_argument(
        "--runs", type=int, default=0, help="whole `popmeta train` runs per mode instead"
    )
    parser.add_argument("--steps", type=int, default=3000, help="steps of each of --runs")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Each replacement logs a warning: keep the report readable.
    logging.getLogger("popmeta").propagate = False
    logging.getLogger("popmeta").addHandler(logging.NullHandler())
    if args.startup:
        startup(args)
        return 0
    modes = ["sync", "async"] if args.mode == "both" else [args.mode]
    if args.runs:
        return 0 if all([cli_runs(args, mode) for mode in modes]) else 1
    results = [soak(args, mode) for mode in modes]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
