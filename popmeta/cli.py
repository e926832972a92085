"""The ``popmeta`` command line: ``train``, ``validate``, ``eval`` and ``kinds``."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import sys

from popmeta.config import ConfigError, config_to_yaml, load_config

__all__ = ["main"]


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
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("popmeta")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


def _train(config, from_checkpoint: str | None) -> int:
    from popmeta.run_dir import RunDirectoryError
    from popmeta.train import DivergedError, train

    pop = config.population
    print(
        f"popmeta: training {config.name!r}: {config.estimator.kind} + "
        f"{config.learned_optimizer.kind} on {config.task.family}, "
        f"{pop.num_actors} {pop.mode} worker(s) on the {pop.engine} engine, "
        f"{config.train.num_steps} steps"
    )
    try:
        result = train(config, from_checkpoint=from_checkpoint)
    except (ConfigError, RunDirectoryError) as err:
        print(f"popmeta: {err}", file=sys.stderr)
        return 2
    except DivergedError as err:
        print(f"popmeta: {err}", file=sys.stderr)
        return 1
    if result.already_finished:
        return 0
    print(f"\nrun directory: {result.run_dir} (TensorBoard: tensorboard --logdir {result.run_dir})")
    print(
        f"meta-loss: {result.meta_loss_start:.4f} at start -> {result.meta_loss_end:.4f} at end "
        f"(step {result.final_step})"
    )
    if result.evaluation:
        ev = config.eval
        print(f"evaluation on {ev.num_tasks} held-out tasks, {ev.num_steps} inner steps each:")
        print(f"  {'theta':<10} {'mean train loss':>16} {'final test loss':>16}")
        for name, r in result.evaluation.items():
            print(f"  {name:<10} {r.mean_train_loss:>16.4f} {r.final_eval_loss:>16.4f}")
        trained, untrained = result.evaluation["trained"], result.evaluation["untrained"]
        ratio = untrained.mean_train_loss / max(trained.mean_train_loss, 1e-12)
        print(f"  the trained learned optimizer reaches {ratio:.2f}x lower mean training loss")
    return 130 if result.interrupted else 0


def _eval(checkpoint: str, out: str | None) -> int:
    from popmeta.evaluate import evaluate_checkpoint

    try:
        results = evaluate_checkpoint(checkpoint, out)
    except (OSError, ValueError) as err:
        print(f"popmeta: {err}", file=sys.stderr)
        return 2
    print(f"{'optimizer':<22} {'mean train loss':>16} {'final test loss':>16}")
    for name, r in sorted(results.items(), key=lambda kv: kv[1].mean_train_loss):
        print(f"{name:<22} {r.mean_train_loss:>16.4f} {r.final_eval_loss:>16.4f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("popmeta").setLevel(logging.INFO)
    if args.command == "eval":
        return _eval(args.checkpoint, args.out)
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
