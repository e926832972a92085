"""A run directory is one experiment: its recorded config, its lock, its checkpoints.

``<run_dir>/<name>/`` holds ``config.yaml`` (the resolved config the run was
started with), ``checkpoints/``, TensorBoard event files and ``eval/``. Reusing
a name must never mix two experiments, so before anything starts:

* a recorded config that differs from the new one in any field that changes
  the experiment is refused, naming the fields and the ways on (a new
  ``name``, or ``--from-checkpoint`` to take the run over from one of its
  checkpoints with the new config). Fields in :data:`SAFE_TO_CHANGE` (how long
  to train, logging and checkpoint cadence, where Ray runs, the evaluation at
  the end) may change on a resume;
* a lock (``.lock``, held with ``fcntl.flock`` for as long as the run lives)
  keeps a second live run out of the directory; the kernel releases it when
  its process dies, so a stale lock file of a killed run is simply taken over;
* a start that fails leaves the directory as it found it: the directory is
  created, and the config recorded, only once the run is about to train.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from popmeta.config import Config, config_from_dict, config_to_yaml
from popmeta.learner.checkpoints import (
    checkpoint_step,
    list_checkpoints,
    read_checkpoint_metadata,
)

__all__ = [
    "SAFE_TO_CHANGE",
    "RunDirectory",
    "RunDirectoryError",
    "config_differences",
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
    "population.call_timeout_s",
    "population.max_actor_restarts",
    "eval.",
)

CONFIG_FILE = "config.yaml"
LOCK_FILE = ".lock"


class RunDirectoryError(RuntimeError):
    """The run directory cannot host this start; the message says why and what to do."""


def _fields(config: Config) -> dict[str, Any]:
    """Every field as ``section.field`` (or ``field`` at the top) -> value, from the schema."""
    flat: dict[str, Any] = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            for inner in dataclasses.fields(value):
                flat[f"{field.name}.{inner.name}"] = getattr(value, inner.name)
        else:
            flat[field.name] = value
    return flat


def _safe(field: str) -> bool:
    return any(field == s or (s.endswith(".") and field.startswith(s)) for s in SAFE_TO_CHANGE)


def config_differences(recorded: Config, new: Config) -> list[str]:
    """``"field: old -> new"`` for each field that differs and is not safe to change."""
    old_fields, new_fields = _fields(recorded), _fields(new)
    return [
        f"{name}: {old_fields[name]!r} -> {new_fields[name]!r}"
        for name in sorted(old_fields)
        if old_fields[name] != new_fields[name] and not _safe(name)
    ]


class RunDirectory:
    """``<config.run_dir>/<config.name>``, checked and claimed for one start.

    Args:
      config: the config of the start.
    """

    def __init__(self, config: Config):
        self.config = config
        self.path = Path(config.run_dir) / config.name
        self.checkpoints = self.path / "checkpoints"

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE

    def recorded_config(self) -> Config | None:
        """The config the run was started with, or None for a new run."""
        if not self.config_file.exists():
            return None
        try:
            raw = yaml.safe_load(self.config_file.read_text(encoding="utf-8"))
            return config_from_dict(raw, source=str(self.config_file))
        except (OSError, ValueError, yaml.YAMLError) as err:
            raise RunDirectoryError(
                f"{self.config_file} cannot be read back as a popmeta config ({err}); "
                f"start a new run with --set name=NEW, or restore that file"
            ) from None

    def check_identity(self) -> None:
        """Refuses a start whose config changes what the recorded run is.

        Raises:
          RunDirectoryError: naming every differing field and the ways on.
        """
        recorded = self.recorded_config()
        if recorded is None:
            if list_checkpoints(self.checkpoints):
                raise RunDirectoryError(
                    f"{self.path} holds checkpoints but no {CONFIG_FILE}: it is not a run this "
                    f"version of popmeta can identify; start a new run with --set name=NEW"
                )
            return
        differences = config_differences(recorded, self.config)
        if differences:
            newest = list_checkpoints(self.checkpoints)
            takeover = (
                f", or take this run over from one of its checkpoints with the new config: "
                f"--from-checkpoint {newest[-1]}"
                if newest
                else ""
            )
            raise RunDirectoryError(
                f"{self.path} holds a run with another config; it differs in "
                + "; ".join(differences)
                + f". Start a new run with --set name=NEW{takeover}."
            )

    def check_writable(self) -> None:
        """Refuses a run directory that cannot be created or written, before anything starts."""
        existing = self.path
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise RunDirectoryError(
                f"run_dir: {existing} is a file, not a directory; cannot create {self.path}"
            )
        if not os.access(existing, os.W_OK | os.X_OK):
            raise RunDirectoryError(
                f"run_dir: {existing} is not writable; cannot write the run to {self.path} "
                f"(set run_dir to a writable directory)"
            )

    @contextlib.contextmanager
    def claim(self) -> Iterator[None]:
        """Creates the directory if needed and holds its lock while the run lives.

        A directory this call created is removed again if the body fails
        before :meth:`record_config`; the lock file goes with the run.

        Raises:
          RunDirectoryError: another live process holds the lock.
        """
        created = not self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        lock_path = self.path / LOCK_FILE
        handle = open(lock_path, "a+")  # noqa: SIM115 -- held for the whole run
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise RunDirectoryError(
                f"{self.path} is in use by a live run ({holder}); wait for it to end, "
                f"or start this one with --set name=NEW"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.ctime()}\n")
        handle.flush()
        self._recorded = False
        try:
            yield
        except BaseException:
            if created and not self._recorded:
                handle.close()
                shutil.rmtree(self.path, ignore_errors=True)
            raise
        finally:
            if not handle.closed:
                # Unlinked while still locked: no other start can lock this file meanwhile.
                with contextlib.suppress(OSError):
                    lock_path.unlink()
                handle.close()

    def record_config(self) -> None:
        """Writes the resolved config; the run directory is this experiment's from now on."""
        self.config_file.write_text(config_to_yaml(self.config), encoding="utf-8")
        self._recorded = True

    def take_over_from(self, checkpoint: Path) -> None:
        """Makes ``checkpoint`` the newest of this run: later ones are moved aside, not deleted.

        Args:
          checkpoint: a checkpoint file of any run whose learned optimizer has
            the shape of this config's.

        Raises:
          RunDirectoryError: the file is not a readable checkpoint.
        """
        try:
            step = checkpoint_step(checkpoint)
            read_checkpoint_metadata(checkpoint)
        except (OSError, ValueError) as err:
            raise RunDirectoryError(f"--from-checkpoint {checkpoint}: {err}") from None
        later = [p for p in list_checkpoints(self.checkpoints) if checkpoint_step(p) > step]
        if later:
            aside = self.path / f"checkpoints-after-{step}-{time.strftime('%Y%m%d-%H%M%S')}"
            aside.mkdir(parents=True)
            for path in later:
                path.rename(aside / path.name)
