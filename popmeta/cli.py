"""The ``popmeta`` command line: ``train``, ``validate``, ``eval`` and ``kinds``."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import sys

from popmeta.config import ConfigError, config_to_yaml, load_config

__all__ = ["main"]

#: Exit status of a run stopped because a file could not be written (sysexits.h's
#: EX_IOERR): a scheduler can tell it from a bad config (2) or a divergence (1).
EX_IOERR = 74


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
    evaluate.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="eval.KEY=VALUE",
        help="change an eval field of the checkpoint's config, e.g. eval.num_tasks=64",
    )
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("popmeta")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


def _train(config, from_checkpoint: str | None) -> int:
    from popmeta.run_dir import RunDirectoryError
    from popmeta.train import DivergedError, RunWriteError, train

    pop = config.population
    print(
        f"popmeta: training {config.name!r}: {config.estimator.kind} + "
        f"{config.learned_optimizer.kind} on {config.task.family}, "
        f"{pop.num_actors} {pop.mode} worker(s) on the {pop.engine} engine, "
        f"{config.train.num_steps} steps"
    )
    try:
        result = train(config, from_checkpoint=from_checkpoint)
    except (ConfigError, RunDirectoryError, DivergedError, RunWriteError) as err:
        print(f"popmeta: {err}", file=sys.stderr)
        # A scheduler tells a bad start (2) from a divergence (1) and a write failure.
        return {DivergedError: 1, RunWriteError: EX_IOERR}.get(type(err), 2)
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
    return 130 if result.interrupted else 0


def _eval(checkpoint: str, out: str | None, overrides: list[str]) -> int:
    from popmeta.config import config_from_dict, config_to_dict
    from popmeta.evaluate import evaluate_checkpoint, format_reports

    for override in overrides:
        if not override.startswith("eval."):
            print(
                f"popmeta: eval --set {override}: only eval.* fields can change; the rest "
                "of the config is the checkpoint's own",
                file=sys.stderr,
            )
            return 2

    def with_overrides(config):
        return config_from_dict(config_to_dict(config), "the checkpoint's config", overrides)

    try:
        reports, written = evaluate_checkpoint(checkpoint, out, config_changes=with_overrides)
    except (OSError, ValueError) as err:
        print(f"popmeta: {err}", file=sys.stderr)
        return 2
    print(format_reports(reports), end="")
    print(f"curves (PNG): {written.png}")
    print(f"table (CSV):  {written.csv}")
    print(f"TensorBoard:  tensorboard --logdir {written.tensorboard}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("popmeta").setLevel(logging.INFO)
    if args.command == "eval":
        return _eval(args.checkpoint, args.out, args.overrides)
    if args.command == "kinds":
        from popmeta.registry import render_markdown

        print(render_markdown(), end="")
        return 0
    try:
        overrides = list(args.overrides)
        if getattr(args, "address", None):
            overrides.append(f"population.address={args.address}")
        config = load_config(args.config, overrides)
    except (ConfigError, OSError) as err:
        print(f"popmeta: {err}", file=sys.stderr)
        return 2
    if args.command == "validate":
        print(config_to_yaml(config), end="")
        return 0
    return _train(config, args.from_checkpoint)


if __name__ == "__main__":
    sys.exit(main())
