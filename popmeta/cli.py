"""The ``popmeta`` command line: ``train``, ``validate``, ``select``, ``eval``, ``compare``,
``export``, ``kinds``.

Every failure ends in one paragraph on stderr (``popmeta: ...``) and an exit
status of :data:`EXIT_STATUSES`, never in a traceback: an unexpected error's
traceback goes to a file the paragraph names. Output to a terminal or pipe
that went away (a closed ssh session) is dropped, so the run still saves its
checkpoint and exits with its own status.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import errno
import importlib.metadata
import logging
import os
import re
import shlex
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from popmeta.accelerator_memory import allocate_as_needed
from popmeta.config import Config, ConfigError, PopulationConfig, config_to_yaml, load_config

__all__ = ["EXIT_STATUSES", "console", "main"]

EX_DIVERGED = 1
EX_USAGE = 2
#: sysexits.h's EX_UNAVAILABLE: the actors could not be placed or kept up.
EX_UNAVAILABLE = 69
#: sysexits.h's EX_SOFTWARE: an unexpected error inside popmeta or a library.
EX_SOFTWARE = 70
#: sysexits.h's EX_IOERR: a file the run must keep could not be written.
EX_IOERR = 74
#: sysexits.h's EX_CONFIG: an actor could not be built on its node.
EX_CONFIG = 78
EX_INTERRUPTED = 130

#: Every exit status ``popmeta`` returns, and what it means (docs/faults.md's table).
EXIT_STATUSES = {
    0: "done (or the run had already finished)",
    EX_DIVERGED: "the run diverged: no finite estimate for 20 rounds in a row",
    EX_USAGE: "refused before anything started: a bad command line, config, data file, "
    "run directory or checkpoint, or workers that cannot fit in memory",
    EX_UNAVAILABLE: "the actors could not be placed, started or kept up (a rank replaced "
    "population.max_actor_restarts times in a row, no node left to host one)",
    EX_SOFTWARE: "an unexpected error: its traceback is in the file the message names",
    EX_IOERR: "a file could not be written (a checkpoint, the config, the evaluation's "
    "output); earlier checkpoints are intact",
    EX_CONFIG: "an actor could not be built on its node (its constructor raised)",
    EX_INTERRUPTED: "stopped by Ctrl-C, SIGTERM or SIGHUP (after a checkpoint of the step "
    "it stopped at, when it was training)",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="popmeta", description="Meta-train learned optimizers with ES-family estimates."
    )
    parser.add_argument("--version", action="version", version=f"popmeta {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    def with_config(name: str, help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help)
        sub.add_argument(
            "config",
            nargs="?",
            default=None,
            help="experiment YAML (defaults to the built-in quickstart values)",
        )
        sub.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config field, e.g. estimator.std=0.02",
        )
        return sub

    train = with_config("train", "meta-train theta and evaluate the result")
    train.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join ('auto' inside `ray submit` jobs); default: RAY_ADDRESS "
        "if set, else an embedded local Ray instance",
    )
    train.add_argument(
        "--from-checkpoint",
        default=None,
        metavar="CKPT",
        help="start from this checkpoint (e.g. an earlier one of the same run) instead of "
        "the run's newest, and let the run take the config given now",
    )
    with_config("validate", "check a config and print it fully resolved")
    commands.add_parser(
        "kinds", help="list every task family, learned optimizer, schedule and estimator"
    )
    evaluate = commands.add_parser(
        "eval", help="meta-test a checkpoint against tuned hand-designed optimizers"
    )
    evaluate.add_argument("checkpoint", help="a ckpt_*.npz file written by `popmeta train`")
    evaluate.add_argument("--out", default=None, help="output folder (default: RUN/eval)")
    _add_eval_overrides(evaluate)
    evaluate.add_argument(
        "--fresh-baselines",
        action="store_true",
        help="tune the baselines again instead of reading them from the cache "
        "($POPMETA_CACHE_DIR, default ~/.cache/popmeta)",
    )
    select = commands.add_parser(
        "select",
        help="choose a run's checkpoint on validation tasks (the baselines' tuning tasks, "
        "never the test tasks)",
    )
    select.add_argument(
        "checkpoints",
        nargs="+",
        metavar="RUN_OR_CKPT",
        help="run directories (every checkpoint each kept; several: the seeds of one config) "
        "or ckpt_*.npz files",
    )
    select.add_argument(
        "--settings",
        nargs="+",
        default=None,
        metavar="NAME",
        help="validate in these settings, named as `popmeta eval` prints them (default: every one)",
    )
    select.add_argument(
        "--tasks",
        type=int,
        default=None,
        help="validation tasks per setting (default: eval.tuning_tasks)",
    )
    select.add_argument(
        "--variant",
        dest="variants",
        action="append",
        default=[],
        metavar="'KEY=VALUE [KEY=VALUE ...]'",
        help="also validate every checkpoint with these learned-optimizer options (on top "
        "of --set), e.g. 'learned_optimizer.loss_guard_relative=0.5'; repeat for more",
    )
    select.add_argument(
        "--last",
        type=int,
        default=None,
        metavar="K",
        help="of a run directory, only its newest K checkpoints (default: every one it kept)",
    )
    select.add_argument(
        "--no-baselines",
        action="store_true",
        help="leave out the tuned Adam and Adam + cosine columns (run on the same tasks at "
        "the learning rates `popmeta eval` tunes, tuned and cached on first use)",
    )
    select.add_argument("--out", default=None, help="output folder (default: RUN/select)")
    _add_eval_overrides(select)
    side_by_side = commands.add_parser(
        "compare",
        help="set evaluations side by side: the bar's halves per setting, and the settings "
        "each gained and lost against the first",
    )
    side_by_side.add_argument(
        "evaluations",
        nargs="+",
        metavar="RESULTS_CSV",
        help="results.csv files `popmeta eval` wrote, or the folders that hold them; the "
        "first is the one the others are counted against",
    )
    export = commands.add_parser(
        "export",
        help="write a checkpoint's learned optimizer to a file popmeta.load_optimizer reads",
    )
    export.add_argument("checkpoint", help="a ckpt_*.npz file written by `popmeta train`")
    export.add_argument("out", help="the file to write, e.g. my_optimizer.npz")
    export.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="write an option of the learned optimizer that no meta-parameter stands for "
        "otherwise than trained, e.g. learned_optimizer.loss_guard=0.01",
    )
    return parser


def _add_eval_overrides(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change an eval field of the checkpoint's config, e.g. eval.num_tasks=64, or "
        "an option of its learned optimizer that no meta-parameter stands for, e.g. "
        "learned_optimizer.loss_guard=0.01 (then give --out)",
    )


def _version() -> str:
    try:
        return importlib.metadata.version("popmeta")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


def _fail(message: str, status: int) -> int:
    print(f"popmeta: {message}", file=sys.stderr)
    return status


def _report_file(text: str) -> str:
    """Writes ``text`` to a new file in the temporary directory and returns its path."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    fd, path = tempfile.mkstemp(prefix=f"popmeta-error-{stamp}-", suffix=".txt")
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(text)
    return path


def _train(config, from_checkpoint: str | None) -> int:
    from popmeta.population.lifecycle import ActorStartError, PopulationLostError
    from popmeta.population.placement import PlacementError
    from popmeta.run_dir import RunDirectoryError
    from popmeta.run_loop import DivergedError, RunWriteError, train

    pop = config.population
    print(
        f"popmeta: training {config.name!r}: {config.estimator.kind} + "
        f"{config.learned_optimizer.kind} on {config.task.kind}, "
        f"{pop.num_actors} {pop.mode} worker(s) on the {pop.engine} engine, "
        f"{config.train.num_steps} steps"
    )
    try:
        result = train(config, from_checkpoint=from_checkpoint)
    except (ConfigError, RunDirectoryError) as err:
        return _fail(str(err), EX_USAGE)
    except DivergedError as err:
        return _fail(str(err), EX_DIVERGED)
    except RunWriteError as err:
        return _fail(str(err), EX_IOERR)
    except ActorStartError as err:
        details = _report_file(err.details)
        module = re.search(r"No module named '([\w.]+)'", err.cause)
        fix = (
            f"The actors cannot import {module.group(1)!r}: ship it to them with "
            "population.runtime_env (py_modules: [path/to/the/module], or working_dir: the "
            "directory that holds it), or install it on every node"
            if module
            else "Fix the cause on that node (a data file the actors cannot find, a library "
            "that fails there; population.runtime_env sets the actors' environment)"
        )
        return _fail(
            f"{err}. The actor's constructor raised, and a new actor would raise again, so "
            f"the run stopped. {fix}, and rerun the same command: it resumes from the run's "
            f"newest checkpoint, if it has one. The actor's traceback is in {details}",
            EX_CONFIG,
        )
    except (PopulationLostError, PlacementError) as err:
        return _fail(
            f"{err}. Rerun the same command once the cluster can host the actors: it resumes "
            "from the run's newest checkpoint (a run that trained wrote one of its last step)",
            EX_UNAVAILABLE,
        )
    if result.already_finished:
        return 0
    print(f"\nrun directory: {result.run_dir} (TensorBoard: tensorboard --logdir {result.run_dir})")
    print(
        f"meta-loss: {result.meta_loss_start:.4f} at start -> {result.meta_loss_end:.4f} at end "
        f"(step {result.final_step})"
    )
    if result.evaluation:
        from popmeta.evaluate import format_reports

        print("\n" + format_reports(result.evaluation), end="")
        print(
            "`popmeta eval` on the last checkpoint adds the longer horizon and the "
            "out-of-distribution settings, a PNG and a CSV"
        )
    print(
        f"`popmeta select {result.run_dir}` chooses among the checkpoints it kept, on the "
        "baselines' tuning tasks, and warns if tuned Adam does as well there"
    )
    return EX_INTERRUPTED if result.interrupted else 0


def _eval_overrides_refused(command: str, out: str | None, overrides: list[str]) -> str | None:
    """Why ``--set`` ``overrides`` of ``eval`` or ``select`` are refused, or None."""
    for override in overrides:
        if not override.startswith(("eval.", "learned_optimizer.")):
            return (
                f"{command} --set {override}: only eval.* fields and learned-optimizer options "
                "that leave theta's shape as trained can change; the rest of the config is "
                "the checkpoint's own"
            )
        if override.startswith("learned_optimizer.") and out is None:
            return (
                f"{command} --set learned_optimizer.*: give --out too, so that the output "
                f"for the rule as trained in RUN/{command} is not overwritten by a changed one"
            )
    return None


def _with_overrides(overrides: list[str]) -> Callable[[Config], Config]:
    from popmeta.config import config_from_dict, config_to_dict

    def changed(config: Config) -> Config:
        return config_from_dict(config_to_dict(config), "the checkpoint's config", overrides)

    return changed


def _select(args: argparse.Namespace) -> int:
    from popmeta.evaluate import (
        BAR_BASELINES,
        EvalWriteError,
        format_selection,
        run_checkpoints,
        run_of,
        select_checkpoint,
        write_selection,
    )
    from popmeta.storage import join

    out, overrides = args.out, args.overrides
    refused = _eval_overrides_refused("select", out, overrides)
    if refused:
        return _fail(refused, EX_USAGE)
    variants, variant_sets = {}, {}
    for variant in args.variants:
        changes = variant.split()
        if not changes or not all(c.startswith("learned_optimizer.") for c in changes):
            return _fail(
                f"select --variant {variant!r}: expected learned_optimizer.KEY=VALUE options "
                "that leave theta's shape as trained, separated by spaces",
                EX_USAGE,
            )
        name = " ".join(c.removeprefix("learned_optimizer.") for c in changes)
        variants[name], variant_sets[name] = _with_overrides(changes), changes
    if args.last is not None and args.last < 1:
        return _fail(f"select --last {args.last}: expected at least 1 checkpoint", EX_USAGE)
    try:
        checkpoints, left_out = [], 0
        for source in args.checkpoints:
            if source.rstrip("/").endswith(".npz"):
                checkpoints.append(source)
            else:
                kept = run_checkpoints(source)
                newest = kept if args.last is None else kept[-args.last :]
                checkpoints += newest
                left_out += len(kept) - len(newest)
        homes = sorted({run_of(checkpoint) for checkpoint in checkpoints})
        if out is None and len(homes) > 1:
            return _fail(
                f"select: the checkpoints come from {len(homes)} runs ({', '.join(homes)}); "
                "give --out DIR for the selection's table",
                EX_USAGE,
            )
        out = out or join(homes[0], "select")
        selection = select_checkpoint(
            checkpoints,
            args.settings,
            args.tasks,
            _with_overrides(overrides),
            variants,
            stream=sys.stderr,
            references=() if args.no_baselines else BAR_BASELINES,
        )
        written = write_selection(selection, out)
    except EvalWriteError as err:
        return _fail(str(err), EX_IOERR)
    except (OSError, ValueError) as err:
        return _fail(str(err), EX_USAGE)
    print(format_selection(selection), end="")
    if selection.outscored_by is not None and left_out:
        # A run that fell back late may have been ahead earlier (docs/generalist.md).
        print(
            f"--last {args.last} left out {left_out} older checkpoint(s): select without "
            "--last validates them too"
        )
    print(f"table (CSV): {written}")
    chosen = selection.chosen
    sets = [*overrides, *variant_sets.get(chosen.variant, [])]
    command = ["popmeta", "eval", chosen.checkpoint, *(a for s in sets for a in ("--set", s))]
    if any(s.startswith("learned_optimizer.") for s in sets):
        command += ["--out", join(run_of(chosen.checkpoint), "eval_selected")]
    print(f"evaluate it: {shlex.join(command)}")
    return 0


def _eval(checkpoint: str, out: str | None, overrides: list[str], fresh: bool) -> int:
    from popmeta.evaluate import BaselineCache, EvalWriteError, evaluate_checkpoint, format_reports

    refused = _eval_overrides_refused("eval", out, overrides)
    if refused:
        return _fail(refused, EX_USAGE)
    try:
        reports, written = evaluate_checkpoint(
            checkpoint,
            out,
            config_changes=_with_overrides(overrides),
            baseline_cache=BaselineCache(refresh=fresh),
        )
    except EvalWriteError as err:
        return _fail(str(err), EX_IOERR)
    except (OSError, ValueError) as err:
        return _fail(str(err), EX_USAGE)
    print(format_reports(reports), end="")
    print(f"curves (PNG): {written.png}")
    print(f"table (CSV):  {written.csv}")
    print(f"TensorBoard:  tensorboard --logdir {written.tensorboard}")
    return 0


def _export(checkpoint: str, out: str, overrides: list[str]) -> int:
    import yaml

    from popmeta.export import export_optimizer, read_trained_optimizer

    changes = {}
    for override in overrides:
        key, sep, text = override.partition("=")
        name = key.strip().removeprefix("learned_optimizer.")
        if not (sep and key.strip().startswith("learned_optimizer.") and name and "." not in name):
            return _fail(
                f"export --set {override}: expected learned_optimizer.KEY=VALUE, an option of "
                "the learned optimizer that leaves theta's shape as trained, e.g. "
                "learned_optimizer.loss_guard=0.01",
                EX_USAGE,
            )
        try:
            changes[name] = yaml.safe_load(text)
        except yaml.YAMLError as err:
            return _fail(f"export --set {override}: the value is not YAML ({err})", EX_USAGE)
    try:
        written = export_optimizer(checkpoint, out, changes)
        trained = read_trained_optimizer(written)
    except (FileNotFoundError, ValueError) as err:
        return _fail(str(err), EX_USAGE)
    except OSError as err:
        return _fail(f"cannot write {out}: {err.strerror or err} (errno {err.errno})", EX_IOERR)
    horizon = (
        f"; it reads how far through a run it is: load_optimizer({str(written)!r}, num_steps=N)"
        if trained.lopt.needs_num_steps
        else ""
    )
    changed = "".join(f", {key}={value!r}" for key, value in changes.items())
    print(
        f"{written}: learned_optimizer.kind={trained.config.kind!r}{changed} from step "
        f"{trained.source.get('step')} of {trained.source.get('run')!r}; in Python, "
        f"popmeta.load_optimizer({str(written)!r}) is an optax transformation{horizon}"
    )
    return 0


def _command(args: argparse.Namespace) -> int:
    if args.command == "eval":
        return _eval(args.checkpoint, args.out, args.overrides, args.fresh_baselines)
    if args.command == "select":
        return _select(args)
    if args.command == "export":
        return _export(args.checkpoint, args.out, args.overrides)
    if args.command == "compare":
        return _compare(args.evaluations)
    if args.command == "kinds":
        from popmeta.registry import render_markdown

        print(render_markdown(), end="")
        return 0
    try:
        overrides = list(args.overrides)
        if getattr(args, "address", None):
            overrides.append(f"population.address={args.address}")
        config = load_config(args.config, overrides)
        if args.command == "validate":
            from popmeta.experiment import build_experiment

            build_experiment(config)  # what train checks before it starts anything
    except (ConfigError, OSError) as err:
        return _fail(str(err), EX_USAGE)
    if args.command == "validate":
        print(config_to_yaml(config), end="")
        _warn_of_stale_estimates(config.population)
        return 0
    return _train(config, args.from_checkpoint)


def _compare(paths: list[str]) -> int:
    from popmeta.evaluate import format_side_by_side, read_evaluation

    try:
        evaluations = [read_evaluation(path) for path in paths]
    except (ValueError, OSError) as err:
        return _fail(str(err), EX_USAGE)
    print(format_side_by_side(evaluations), end="")
    return 0


def _warn_of_stale_estimates(population: PopulationConfig) -> None:
    """What the Ray population would warn of when it starts, where its actors are counted in the config."""
    from popmeta.population.staleness import staleness_warning

    if population.engine != "ray" or population.mode != "async":
        return
    if population.one_actor_per_node_with is not None:  # counted only once the cluster is seen
        return
    warning = staleness_warning(
        population.num_actors,
        population.calls_in_flight,
        population.batch_size,
        population.max_staleness,
    )
    if warning is not None:
        print(f"popmeta: warning: {warning}", file=sys.stderr)


def _unexpected(err: Exception) -> int:
    text = "".join(traceback.format_exception(err))
    try:
        where = f"the traceback is in {_report_file(text)}"
    except OSError:
        where = "the traceback could not be written to a file"
    hint = ""
    if "RESOURCE_EXHAUSTED" in str(err) or "Out of memory" in str(err):
        hint = " XLA ran out of memory: lower estimator.num_tasks or population.num_actors."
    return _fail(
        f"unexpected error: {type(err).__name__}: {err}.{hint} This is a bug in popmeta or a "
        f"library it uses; {where}: please include it when you report it",
        EX_SOFTWARE,
    )


class _DropWhenGone:
    """A text stream whose output is dropped once its terminal or pipe is gone (EIO, EPIPE).

    The stream's descriptor is then pointed at ``/dev/null``, so later writes,
    flushes and the interpreter's own flush at exit succeed.
    """

    def __init__(self, stream: Any):
        self._stream = stream

    def _gone(self, err: OSError) -> None:
        if err.errno not in (errno.EPIPE, errno.EIO):
            raise err
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as err:
            self._gone(err)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as err:
            self._gone(err)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _output_that_survives_a_hangup() -> Iterator[None]:
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _DropWhenGone(sys.stdout), _DropWhenGone(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def main(argv: list[str] | None = None) -> int:
    with _output_that_survives_a_hangup():
        try:
            args = _parser().parse_args(argv)
            logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
            logging.getLogger("popmeta").setLevel(logging.INFO)
            return _command(args)
        except KeyboardInterrupt as err:
            return _fail(str(err) or "interrupted", EX_INTERRUPTED)
        except Exception as err:
            return _unexpected(err)


def console() -> None:
    """The ``popmeta`` command: :func:`main`, and its status as the process's exit status."""
    from popmeta.run_signals import StopSignals

    StopSignals.process_ends_with_run = True
    # Before JAX's first computation: the learner shares its chip with actors.
    # Here, not in main(): a process that calls main() keeps its own environment.
    allocate_as_needed()
    status = main()
    if status == EX_INTERRUPTED:
        _exit_interrupted()
    sys.exit(status)


def _exit_interrupted() -> NoReturn:
    """Ends the process with :data:`EX_INTERRUPTED` once its exit handlers have run.

    Ray's exit handler still stops the processes this run started: one more
    Ctrl-C must not break that off half-way, so SIGINT is ignored first. The
    process then ends through ``os._exit``, not ``sys.exit``: CPython ends a
    process by SIGINT instead of with its exit status once a KeyboardInterrupt
    has left code that an extension ran through ``PyRun_String`` (Ray's
    ``_raylet`` does), as a Ctrl-C while Ray starts can. Python offers no
    public way to run the exit handlers short of ``sys.exit``, hence
    ``atexit._run_exitfuncs``; no thread of the run is left to wait for, as
    the run closed its own.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or hung-up stream
            stream.flush()
    os._exit(EX_INTERRUPTED)


if __name__ == "__main__":
    console()
