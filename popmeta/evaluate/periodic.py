"""The learned optimizer meta-tested in the background while it trains (``eval.every``)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from popmeta.core.evaluation import TrainingCurves
from popmeta.evaluate.statistics import TaskScores, scores_of
from popmeta.summaries import Summaries

__all__ = ["PeriodicEvaluator"]


class PeriodicEvaluator:
    """Evaluates the learned optimizer at the trained horizon in a background thread.

    The learner never waits for it: :meth:`submit` hands over a host copy of
    theta (the learner donates its buffers) only when the previous evaluation
    has been written, and skips otherwise; results are written by the
    caller's thread in :meth:`write_finished` (the event file has one writer),
    which the run loop calls before each :meth:`submit`. Only the
    learned optimizer runs here (no baselines), on the test tasks of the
    trained-horizon setting, so successive points are comparable.

    Args:
      run: trains the setting's test tasks with a theta
        (:func:`~popmeta.evaluate.runs.learned_optimizer_run` of the trained horizon).
    """

    def __init__(self, run: Callable[[Any], TrainingCurves]):
        self._run = run
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="popmeta-eval")
        # Only the caller's thread reads or replaces it; the worker thread only
        # completes the future.
        self._pending: tuple[int, Future[TaskScores]] | None = None
        self.skipped = 0

    def submit(self, step: int, theta: Any) -> bool:
        """Starts an evaluation of ``theta`` at ``step`` unless one is running or unwritten."""
        if self._pending is not None:
            self.skipped += 1
            return False
        host_theta = jax.tree.map(np.array, theta)
        self._pending = (step, self._executor.submit(lambda: scores_of(self._run(host_theta))))
        return True

    def write_finished(self, summaries: Summaries, wait: bool = False) -> None:
        """Writes the finished evaluation, if any, under ``eval/`` at its step."""
        if self._pending is None or not (wait or self._pending[1].done()):
            return
        step, future = self._pending
        self._pending = None
        scores = future.result()
        values = {
            "eval/mean_train_loss": float(np.mean(scores.mean_train_loss)),
            "eval/final_test_loss": float(np.mean(scores.final_test_loss)),
        }
        if scores.final_test_accuracy is not None:
            values["eval/final_test_accuracy"] = float(np.mean(scores.final_test_accuracy))
        summaries.scalars(step, values)

    def close(self, summaries: Summaries | None = None) -> None:
        """Waits for the running evaluation, writes it if ``summaries`` is given, and stops."""
        if summaries is not None:
            self.write_finished(summaries, wait=True)
        self._executor.shutdown(wait=True)
