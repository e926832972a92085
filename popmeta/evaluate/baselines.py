"""Hand-designed baselines, each tuned per setting on tasks the learned optimizer is not tested on.

Adam, Adam with cosine decay to zero over the setting's horizon, SGD with
momentum 0.9 and SGD, each at the learning rate of the grid (4 points per
decade over [1e-5, 1]) with the lowest mean training loss on *tuning* tasks
(``eval.tuning_tasks`` of them, drawn from ``eval.seed + 1``), then run on the
*test* tasks (``eval.seed``).
``coarse_to_fine`` tuning runs one rate per decade, then the six grid rates
around the best of those.

A tuned baseline's test scores depend only on the setting (its task section
and number of steps), the task counts, the seed, the grid and the machine
(XLA compiles for the device and, on CPU, for the host's instruction set, so
one evaluation gives other rounding on another CPU model), so they are
cached on disk (``$POPMETA_CACHE_DIR``, by default ``~/.cache/popmeta``):
evaluating a second checkpoint runs only the learned optimizer. ``popmeta
select`` runs the tuned baselines on its validation tasks too, cached beside.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from popmeta.config import TaskConfig
from popmeta.core.evaluation import training_curves
from popmeta.core.optimizers import SGD, SGDM, Adam, OptaxOptimizer, Optimizer
from popmeta.core.tasks import TaskFamily
from popmeta.evaluate.statistics import TaskScores, mean_train_losses, scores_of

__all__ = [
    "BASELINES",
    "LEARNING_RATES",
    "BaselineCache",
    "TunedBaseline",
    "scores_at",
    "tune_baseline",
    "tuning_seed",
]

#: Hand-designed baselines: ``make(learning_rate, num_steps)``.
BASELINES: dict[str, Callable[[Any, int], Optimizer]] = {
    "adam": lambda lr, num_steps: Adam(lr),
    "adam_cosine": lambda lr, num_steps: OptaxOptimizer(
        optax.adam(optax.cosine_decay_schedule(lr, num_steps))
    ),
    "sgdm": lambda lr, num_steps: SGDM(lr, 0.9),
    "sgd": lambda lr, num_steps: SGD(lr),
}
#: The tuning grid: 4 points per decade over [1e-5, 1].
LEARNING_RATES = np.logspace(-5, 0, 21).astype(np.float32)
_COARSE_STRIDE = 4
#: Bump when what a cached entry holds, or how it is computed, changes.
_CACHE_FORMAT = 1


def _fine_indices(best_coarse: int, size: int) -> np.ndarray:
    """The six grid indices around ``best_coarse`` (clipped at the grid's ends)."""
    around = [best_coarse + d for d in (-3, -2, -1, 1, 2, 3)]
    return np.clip(np.asarray(around), 0, size - 1)


def tuning_seed(seed: int) -> int:
    """The seed of the tuning tasks when the test tasks are drawn from ``seed``."""
    return seed + 1


class TunedBaseline(NamedTuple):
    """A baseline's chosen learning rate and its scores on the test tasks."""

    learning_rate: float
    scores: TaskScores


def tune_baseline(
    family: TaskFamily,
    make: Callable[[Any, int], Optimizer],
    num_tasks: int,
    num_steps: int,
    seed: int,
    tuning: str,
    tuning_tasks: int | None = None,
) -> TunedBaseline:
    """Chooses ``make``'s learning rate on ``tuning_tasks`` tuning tasks (default
    ``num_tasks``); scores it on ``num_tasks`` test tasks."""

    def run(lr, key, count):
        return training_curves(family, make(lr, num_steps), key, count, num_steps)

    # Tuning reads only the training curves: nothing else is copied to the host.
    count = num_tasks if tuning_tasks is None else tuning_tasks
    tune = jax.jit(jax.vmap(lambda lr, key: run(lr, key, count).train_loss, in_axes=(0, None)))
    tune_key = jax.random.key(tuning_seed(seed))

    def tuning_losses(indices: np.ndarray) -> np.ndarray:
        return mean_train_losses(tune(LEARNING_RATES[indices], tune_key)).mean(axis=-1)

    if tuning == "full":
        best = int(np.argmin(tuning_losses(np.arange(LEARNING_RATES.size))))
    elif tuning == "coarse_to_fine":
        coarse = np.arange(0, LEARNING_RATES.size, _COARSE_STRIDE)
        losses = dict(zip(coarse.tolist(), tuning_losses(coarse).tolist(), strict=True))
        fine = _fine_indices(min(losses, key=losses.__getitem__), LEARNING_RATES.size)
        losses.update(zip(fine.tolist(), tuning_losses(fine).tolist(), strict=True))
        # Ties go to the smaller rate, as argmin's do (a diverged rate scores inf, never NaN).
        best = min(sorted(losses), key=losses.__getitem__)
    else:
        raise ValueError(f"tuning must be 'full' or 'coarse_to_fine', got {tuning!r}")
    lr = LEARNING_RATES[best]
    return TunedBaseline(float(lr), scores_at(family, make, lr, num_steps, seed, num_tasks))


def scores_at(
    family: TaskFamily,
    make: Callable[[Any, int], Optimizer],
    learning_rate: float,
    num_steps: int,
    seed: int,
    num_tasks: int,
) -> TaskScores:
    """``make`` at ``learning_rate`` on ``num_tasks`` tasks drawn from ``seed``."""

    def run(lr, key):
        return training_curves(family, make(lr, num_steps), key, num_tasks, num_steps)

    lr = np.float32(learning_rate)  # a traced argument, as in tuning: the same program
    return scores_of(jax.jit(run)(lr, jax.random.key(seed)))


@functools.cache
def _machine_description() -> dict[str, str]:
    """What the rounding of a jitted run depends on beyond the code and its inputs.

    The backend and its device kind, and the host CPU: on CPU, XLA compiles for
    the host's instruction set (two x86 CPU models, same code and tasks, gave
    conv-net baselines that differ by up to 10%; docs/generalist.md). Where
    ``/proc/cpuinfo`` names the model (x86 Linux), the CPU is that name and a
    digest of its feature flags; elsewhere ``platform``'s processor and machine.
    """
    device = jax.devices()[0]
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:  # one block per core, all alike: the first one's fields
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    if "model name" in fields:
        flags = hashlib.sha256(fields.get("flags", "").encode()).hexdigest()[:12]
        cpu = f"{fields['model name']} flags {flags}"
    else:
        cpu = f"{platform.processor()} {platform.machine()}"
    return {"backend": device.platform, "device_kind": device.device_kind, "cpu": cpu}


def _default_cache_dir() -> Path:
    if "POPMETA_CACHE_DIR" in os.environ:
        return Path(os.environ["POPMETA_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "popmeta"


class BaselineCache:
    """Tuned baselines on disk, one ``.npz`` per (setting, baseline, task counts, seed, grid, tuning,
    machine), and one per other set of tasks a tuned baseline is scored on (``scored_on``).

    A cache that cannot be read or written is skipped: the baseline is
    simply tuned again.

    An entry is found by the task section's kind and fields and by the
    machine (backend, device kind and CPU model), so a cache folder shared by
    several machine kinds serves each its own curves. A task kind of your own
    whose code changed under the same name needs ``refresh``.

    Args:
      folder: where the entries live; None: ``$POPMETA_CACHE_DIR`` or ``~/.cache/popmeta``,
        under ``baselines/``.
      refresh: tune every baseline again (and overwrite its entry).
    """

    def __init__(self, folder: str | Path | None = None, refresh: bool = False):
        self.folder = Path(folder) if folder is not None else _default_cache_dir() / "baselines"
        self.refresh = refresh

    def _path(
        self,
        task: TaskConfig,
        baseline: str,
        num_steps: int,
        num_tasks: int,
        seed: int,
        tuning: str,
        tuning_tasks: int | None,
        scored_on: tuple[int, int] | None = None,
    ) -> Path:
        described: dict[str, Any] = {
            "format": _CACHE_FORMAT,
            "jax": jax.__version__,
            "machine": _machine_description(),
            "task": {"kind": task.kind, "fields": dict(task.options)},
            "baseline": baseline,
            "num_steps": num_steps,
            "num_tasks": num_tasks,
            "seed": seed,
            "grid": LEARNING_RATES.tolist(),
            "tuning": tuning,
            "tuning_tasks": num_tasks if tuning_tasks is None else tuning_tasks,
        }
        if scored_on is not None:
            described["scored_on"] = {"seed": scored_on[0], "num_tasks": scored_on[1]}
        digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:24]
        return self.folder / f"{baseline}-{digest}.npz"

    def tuned(
        self,
        family: TaskFamily,
        task: TaskConfig,
        baseline: str,
        num_tasks: int,
        num_steps: int,
        seed: int,
        tuning: str,
        tuning_tasks: int | None = None,
        scored_on: tuple[int, int] | None = None,
    ) -> TunedBaseline:
        """The cached tuned baseline, or a newly tuned one (then cached).

        Args:
          scored_on: (seed, count): score the tuned learning rate on ``count`` tasks
            drawn from ``seed`` instead of the test tasks (an entry of its own).
        """
        path = self._path(
            task, baseline, num_steps, num_tasks, seed, tuning, tuning_tasks, scored_on
        )
        cached = None if self.refresh else self._read(path)
        if cached is not None:
            return cached
        if scored_on is None:
            tuned = tune_baseline(
                family, BASELINES[baseline], num_tasks, num_steps, seed, tuning, tuning_tasks
            )
        else:
            test = self.tuned(
                family, task, baseline, num_tasks, num_steps, seed, tuning, tuning_tasks
            )
            lr = test.learning_rate
            tuned = TunedBaseline(
                lr, scores_at(family, BASELINES[baseline], lr, num_steps, *scored_on)
            )
        self._write(path, tuned)
        return tuned

    @staticmethod
    def _read(path: Path) -> TunedBaseline | None:
        try:
            with np.load(path) as data:
                arrays = {name: data[name] for name in data.files}
        except (OSError, ValueError, KeyError):
            return None
        fields = {name: arrays.get(name) for name in TaskScores._fields}
        if any(fields[name] is None for name in ("mean_train_loss", "train_curve", "test_curve")):
            return None
        return TunedBaseline(float(arrays["learning_rate"]), TaskScores(**fields))

    def _write(self, path: Path, tuned: TunedBaseline) -> None:
        arrays = {k: v for k, v in tuned.scores._asdict().items() if v is not None}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".npz", delete=False) as f:
                np.savez(f, learning_rate=np.float64(tuned.learning_rate), **arrays)
            os.replace(f.name, path)
        except OSError:
            pass  # a cache that cannot be written only costs the next evaluation its time
