"""Probes a trained learned optimizer at long horizons with its step size scaled down.

For each chosen evaluation setting of a checkpoint's config, runs the
learned optimizer with its step size multiplied by ``(T / T0) ** -alpha``
(``T`` the setting's steps, ``T0`` the trained horizon) for each ``alpha``,
and as trained with each ``--options`` set of the rule's options that no
meta-parameter stands for (``loss_guard=0.01``, ``weight_decay=0.1``), beside
tuned Adam and Adam + cosine at the learning rates ``popmeta eval`` chose for them (read from the baseline cache, tuned there if absent). It
runs on the baselines' *tuning* tasks' seed (``eval.seed + 1``), never on the
test tasks, so a scale chosen from its table is not chosen on the tasks that
judge it. Prints one markdown row per setting: mean training loss / mean
final test loss of each.

    python docs/results/probe_step_scale.py runs/generalist/checkpoints/ckpt_00006000.npz \\
        --settings "conv_digits: 10x horizon" --alphas 0 0.15 0.3 0.45 --options loss_guard=0.01

What it measured: docs/generalist.md, "The long-horizon misses are the step size"
and "A brake on a climbing loss: `loss_guard`".
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import numpy as np

from popmeta.config import config_from_dict, config_to_dict
from popmeta.core.evaluation import training_curves
from popmeta.evaluate.baselines import BASELINES, BaselineCache, tuning_seed
from popmeta.evaluate.checkpoints import checked_rule_changes, load_theta
from popmeta.evaluate.runs import learned_optimizer_run, settings_of, trained_horizon
from popmeta.evaluate.statistics import scores_of
from popmeta.experiment import build_task_family

COMPARED_BASELINES = ("adam", "adam_cosine")


def _losses(curves) -> str:
    scores = scores_of(curves)
    return f"{np.mean(scores.mean_train_loss):.4f} / {np.mean(scores.final_test_loss):.4f}"


def _curves(family, optimizer, key, num_tasks: int, num_steps: int):
    return jax.jit(lambda: training_curves(family, optimizer, key, num_tasks, num_steps))()


def _with_options(config, changes: str, theta):
    """``config`` with the learned optimizer's options ``changes`` (``k=v[,k=v]``) set."""
    overrides = [f"learned_optimizer.{change}" for change in changes.split(",")]
    changed = config_from_dict(config_to_dict(config), "--options", overrides)
    checked_rule_changes(config.learned_optimizer, changed.learned_optimizer, theta, "--options")
    return changed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--settings", nargs="+", required=True, help="setting names, as eval's")
    parser.add_argument("--alphas", nargs="+", type=float, default=[0.0, 0.15, 0.3, 0.45])
    parser.add_argument(
        "--options",
        nargs="*",
        default=[],
        help="rule options to run the checkpoint with, each k=v[,k=v], e.g. loss_guard=0.01",
    )
    parser.add_argument("--tasks", type=int, default=16, help="tuning-seed tasks per setting")
    args = parser.parse_args(argv)

    config, theta = load_theta(args.checkpoint)
    if not (isinstance(theta, dict) and "log_lr" in theta):
        parser.error(f"{args.checkpoint}: its learned optimizer has no log_lr step size to scale")
    settings = {s.name: s for s in settings_of(config)}
    unknown = [name for name in args.settings if name not in settings]
    if unknown:
        parser.error(f"--settings: no setting {unknown}; the config's are {sorted(settings)}")
    ev = config.eval
    probe = dataclasses.replace(
        config, eval=dataclasses.replace(ev, seed=tuning_seed(ev.seed), num_tasks=args.tasks)
    )
    horizon, cache = trained_horizon(config), BaselineCache()
    variants = [_with_options(probe, changes, theta) for changes in args.options]

    columns = [
        *COMPARED_BASELINES,
        *(f"learned, alpha {a:g}" for a in args.alphas),
        *(f"learned, {changes}" for changes in args.options),
    ]
    print("| setting | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name in args.settings:
        setting = settings[name]
        family = build_task_family(setting.task)
        key, steps = jax.random.key(probe.eval.seed), setting.num_steps
        cells = []
        for baseline in COMPARED_BASELINES:
            lr = cache.tuned(
                family,
                setting.task,
                baseline,
                ev.num_tasks,
                steps,
                ev.seed,
                ev.tuning,
                ev.tuning_tasks,
            ).learning_rate
            optimizer = BASELINES[baseline](lr, steps)
            cells.append(_losses(_curves(family, optimizer, key, args.tasks, steps)))
        run_learned = learned_optimizer_run(probe, setting)
        for alpha in args.alphas:
            scaled = dict(theta, log_lr=theta["log_lr"] - alpha * np.log(steps / horizon))
            cells.append(_losses(run_learned(scaled)))
        for changed in variants:
            cells.append(_losses(learned_optimizer_run(changed, setting)(theta)))
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
