"""A run directory's identity: the config it records, and which changes a resume may make.

Reusing a run's name must never mix two experiments: a start whose config
differs from the recorded one in any field that changes the experiment is
refused before anything starts, naming the fields and the ways on (a new
``name``, or ``--from-checkpoint`` to take the run over from one of its
checkpoints with the new config). Fields in :data:`SAFE_TO_CHANGE` (how long
to train, logging and checkpoint cadence, where Ray runs, the engine, the
evaluation at the end) may change on a resume.
"""

from __future__ import annotations

from typing import Any

import yaml

from popmeta.config import Config, config_fields, config_from_dict, config_to_yaml
from popmeta.learner.checkpoints import list_checkpoints
from popmeta.run_dir import CONFIG_FILE, RunDirectory, RunDirectoryError

__all__ = [
    "SAFE_TO_CHANGE",
    "check_identity",
    "config_differences",
    "record_config",
    "recorded_config",
    "with_recorded_call_size",
]

#: Dotted fields (or section prefixes ending in ".") that a resumed run may change.
SAFE_TO_CHANGE = (
    "run_dir",  # where the run lives, not what it is: a moved run resumes
    "train.num_steps",
    "train.log_every",
    "train.summary_every",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "population.address",
    # The local engine and sync Ray compute the same estimates bit for bit.
    "population.engine",
    # Fused rounds take the same steps; only the rounding may differ.
    "population.updates_per_call",
    "population.call_timeout_s",
    "population.call_timeout_factor",
    "population.min_call_timeout_s",
    "population.max_actor_restarts",
    "eval.",
)


def _safe(field: str) -> bool:
    return any(field == s or (s.endswith(".") and field.startswith(s)) for s in SAFE_TO_CHANGE)


def config_differences(recorded: Config, new: Config) -> list[str]:
    """``"field: old -> new"`` for each field that differs and is not safe to change."""
    old_fields, new_fields = config_fields(recorded), config_fields(new)
    missing = object()

    def shown(fields: dict[str, Any], name: str) -> str:
        return repr(fields[name]) if name in fields else "(none)"

    return [
        f"{name}: {shown(old_fields, name)} -> {shown(new_fields, name)}"
        for name in sorted(set(old_fields) | set(new_fields))
        if old_fields.get(name, missing) != new_fields.get(name, missing) and not _safe(name)
    ]


def recorded_config(run: RunDirectory) -> Config | None:
    """The config ``run`` was started with, or None for a new run."""
    if not run.config_file.exists():
        return None
    try:
        raw = yaml.safe_load(run.config_file.read_text(encoding="utf-8"))
        return config_from_dict(raw, source=str(run.config_file), recorded=True)
    except (OSError, ValueError, yaml.YAMLError) as err:
        raise RunDirectoryError(
            f"{run.config_file} cannot be read back as a popmeta config ({err}); "
            f"start a new run with --set name=NEW, or restore that file"
        ) from None


def check_identity(run: RunDirectory, config: Config) -> None:
    """Refuses a start whose ``config`` changes what ``run``'s recorded run is.

    Raises:
      RunDirectoryError: naming every differing field and the ways on.
    """
    recorded = recorded_config(run)
    if recorded is None:
        if list_checkpoints(run.checkpoints):
            raise RunDirectoryError(
                f"{run.location} holds checkpoints but no {CONFIG_FILE}: it is not a run this "
                f"version of popmeta can identify; start a new run with --set name=NEW"
            )
        return
    differences = config_differences(recorded, config)
    if differences:
        newest = list_checkpoints(run.checkpoints)
        takeover = (
            f", or take this run over from one of its checkpoints with the new config: "
            f"--from-checkpoint {run.location_of(newest[-1])}"
            if newest
            else ""
        )
        raise RunDirectoryError(
            f"{run.location} holds a run with another config; it differs in "
            + "; ".join(differences)
            + f". Start a new run with --set name=NEW{takeover}."
        )


def with_recorded_call_size(run: RunDirectory, config: Config) -> Config:
    """``config`` with ``estimator.truncations_per_call: auto`` as ``run`` recorded it.

    ``auto`` is measured once, when a run first starts, and recorded as the
    number it chose: a resume continues with that number, so it is as
    deterministic as a run with the number set. A new run, or a config that
    sets a number, is returned as it is.
    """
    if config.estimator.truncations_per_call != "auto":
        return config
    recorded = recorded_config(run)
    if recorded is None or recorded.estimator.truncations_per_call == "auto":
        return config
    return config.with_truncations_per_call(recorded.estimator.truncations_per_call)


def record_config(run: RunDirectory, config: Config) -> None:
    """Records ``config`` as ``run``'s (see :meth:`RunDirectory.record_config`)."""
    run.record_config(config_to_yaml(config))
