"""Meta-testing learned optimizers on held-out task samples."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from popmeta.config import Config
from popmeta.core.evaluation import training_curves
from popmeta.experiment import build_learned_optimizer, build_task_family

__all__ = ["EvalResult", "evaluate_thetas", "initial_theta"]


class EvalResult(NamedTuple):
    """Mean over held-out tasks of the inner training curve."""

    mean_train_loss: float  # averaged over the whole curve: speed and final quality
    final_eval_loss: float  # held-out split after the last step
    train_curve: np.ndarray  # [num_steps]


def initial_theta(config: Config) -> Any:
    """Theta as the learner initialises it (the untrained learned optimizer)."""
    key_theta, _ = jax.random.split(jax.random.key(config.seed))
    return build_learned_optimizer(config.learned_optimizer).init(key_theta)


def evaluate_thetas(config: Config, thetas: dict[str, Any]) -> dict[str, EvalResult]:
    """Trains ``eval.num_tasks`` held-out tasks for ``eval.num_steps`` steps with each theta.

    Every theta sees the same tasks, initialisations and batches (keys from ``eval.seed``).
    """
    family = build_task_family(config.task)
    lopt = build_learned_optimizer(config.learned_optimizer)

    @jax.jit
    def curves(theta):
        return training_curves(
            family,
            lopt.opt_fn(theta),
            jax.random.key(config.eval.seed),
            config.eval.num_tasks,
            config.eval.num_steps,
        )

    results = {}
    for name, theta in thetas.items():
        result = curves(theta)
        train = np.asarray(result.train_loss).mean(axis=0)
        results[name] = EvalResult(
            float(train.mean()), float(np.asarray(result.eval_loss)[:, -1].mean()), train
        )
    return results
