"""Meta-testing learned optimizers on held-out task samples."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from popmeta.config import Config, config_from_dict
from popmeta.core.evaluation import training_curves
from popmeta.core.optimizers import SGD, SGDM, Adam, Optimizer
from popmeta.experiment import build_learned_optimizer, build_task_family, initial_theta
from popmeta.learner.checkpoints import load_checkpoint, read_checkpoint_metadata
from popmeta.learner.learner import Learner
from popmeta.summaries import Summaries

__all__ = [
    "BASELINES",
    "EvalResult",
    "evaluate_checkpoint",
    "evaluate_thetas",
    "load_theta",
    "tuned_baselines",
]

#: Hand-designed baselines and the learning rates they are tuned over.
BASELINES: dict[str, Callable[[float], Optimizer]] = {
    "adam": lambda lr: Adam(lr),
    "sgdm": lambda lr: SGDM(lr, 0.9),
    "sgd": lambda lr: SGD(lr),
}
LEARNING_RATES = tuple(float(x) for x in np.logspace(-4, 0, 9))


class EvalResult(NamedTuple):
    """Mean over held-out tasks of the inner training curve."""

    mean_train_loss: float  # averaged over the whole curve: speed and final quality
    final_eval_loss: float  # held-out split after the last step
    train_curve: np.ndarray  # [num_steps]


def _curves(config: Config, optimizer_of: Callable[[Any], Optimizer]):
    """``evaluate(args, seed)``: mean curves of ``optimizer_of(args)`` on tasks from ``seed``.

    One compilation serves every ``args`` (theta, or a learning rate) and seed.
    """
    family = build_task_family(config.task)

    @jax.jit
    def run(args, key):
        return training_curves(
            family, optimizer_of(args), key, config.eval.num_tasks, config.eval.num_steps
        )

    def evaluate(args, seed: int) -> EvalResult:
        result = run(args, jax.random.key(seed))
        train = np.asarray(result.train_loss)
        final = np.asarray(result.eval_loss)[:, -1]
        # A diverged run counts as infinitely bad, never as a NaN that compares false.
        mean = float(train.mean()) if np.all(np.isfinite(train)) else float("inf")
        return EvalResult(mean, float(final.mean()), train.mean(axis=0))

    return evaluate


def evaluate_thetas(config: Config, thetas: dict[str, Any]) -> dict[str, EvalResult]:
    """Trains ``eval.num_tasks`` held-out tasks for ``eval.num_steps`` steps with each theta.

    Every theta sees the same tasks, initialisations and batches (keys from ``eval.seed``).
    """
    lopt = build_learned_optimizer(config.learned_optimizer)
    evaluate = _curves(config, lopt.opt_fn)
    return {name: evaluate(theta, config.eval.seed) for name, theta in thetas.items()}


def tuned_baselines(
    config: Config, names: Sequence[str] = tuple(BASELINES)
) -> dict[str, tuple[float, EvalResult]]:
    """Each baseline at its best learning rate: tuned on other tasks, then evaluated.

    Tuning uses tasks from ``eval.seed + 1`` so the reported curve is not the
    one the learning rate was picked on.
    """
    results = {}
    for name in names:
        evaluate = _curves(config, BASELINES[name])
        scores = [
            evaluate(np.float32(lr), config.eval.seed + 1).mean_train_loss for lr in LEARNING_RATES
        ]
        best = LEARNING_RATES[int(np.argmin(scores))]
        results[name] = (best, evaluate(np.float32(best), config.eval.seed))
    return results


def load_theta(checkpoint: str | Path) -> tuple[Config, Any]:
    """The config and theta stored in a training checkpoint."""
    metadata = read_checkpoint_metadata(checkpoint)
    if "config" not in metadata:
        raise ValueError(f"{checkpoint}: no config in the checkpoint's metadata")
    config = config_from_dict(metadata["config"], source=str(checkpoint))
    restored = load_checkpoint(checkpoint, Learner(config).checkpoint_tree())
    return config, restored.tree["theta"]


def evaluate_checkpoint(
    checkpoint: str | Path, out_dir: str | Path | None = None
) -> dict[str, EvalResult]:
    """Learned optimizer (trained and untrained) against tuned baselines.

    Writes per-step curves to TensorBoard and a PNG under ``out_dir``
    (default: ``eval/`` beside the checkpoints directory).
    """
    checkpoint = Path(checkpoint)
    config, theta = load_theta(checkpoint)
    results = evaluate_thetas(config, {"learned": theta, "untrained": initial_theta(config)})
    for name, (lr, result) in tuned_baselines(config).items():
        results[f"{name} (lr {lr:.2g})"] = result

    out_dir = Path(out_dir) if out_dir else checkpoint.parent.parent / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, result in results.items():
        summaries = Summaries(out_dir / name.split(" ")[0])
        for step, loss in enumerate(result.train_curve):
            summaries.scalars(step, {"eval/train_loss": float(loss)})
        summaries.close()
    _plot(results, out_dir / "curves.png", f"{config.task.family}: {checkpoint.name}")
    return results


def _plot(results: dict[str, EvalResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, result in results.items():
        ax.plot(result.train_curve, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("inner step")
    ax.set_ylabel("training loss (mean over held-out tasks)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
