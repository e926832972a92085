"""Starting Ray for a run: an embedded local instance by default, or joining a cluster.

``start_ray(None)`` (and no ``RAY_ADDRESS`` in the environment) starts an
embedded single-node instance that lives as long as the run: every Ray
process binds and talks to 127.0.0.1 only, there is no dashboard, no usage
reporting, no auth token written to ``~/.ray`` and no Ray log lines on the
user's terminal. ``start_ray("auto")`` (or ``RAY_ADDRESS``) joins an existing
cluster, which is how ``ray submit`` / ``ray job submit`` runs work. If Ray is
already initialised in this process, that instance is reused and left
running. This module is the one owner of Ray's lifetime in a run: the run
loop opens it with :func:`start_ray_for` before it builds a
:class:`~popmeta.population.ray_population.RayPopulation` and shuts it down
after the population is closed. The Ray facts behind it: docs/ray.md.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from popmeta.config import PopulationConfig

__all__ = [
    "EMBEDDED_ENV",
    "LOOPBACK_ENV",
    "RayHandle",
    "apply_loopback_env",
    "quiet_fork",
    "route_raylet_messages_to_logging",
    "start_ray",
    "start_ray_for",
]

#: Environment that keeps an embedded Ray on loopback and quiet.
#: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes Ray take 127.0.0.1 as the node
#: address (``--node-ip-address`` alone is silently overridden); Ray would
#: otherwise enable token auth and write ``~/.ray/auth_token`` (docs/ray.md).
LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}

#: Environment of an embedded instance's processes, besides :data:`LOOPBACK_ENV`.
#: Ray starts its workers at nice 15 (``worker_niceness``), below every
#: ordinary process: on a machine busy with anything else the actors then get
#: a few percent of a core each and the run crawls, while the local engine, at
#: nice 0 in the driver, keeps its share. An embedded instance's actors run at
#: nice 0 instead (a value the caller set stands). Ray reads it from the
#: environment, which its processes inherit at ``ray.init``; ``_system_config``
#: would do the same but makes ``ray.init`` print a warning.
EMBEDDED_ENV = {"RAY_worker_niceness": "0"}


def apply_loopback_env() -> None:
    """Puts :data:`LOOPBACK_ENV` into ``os.environ`` (inherited by every Ray process).

    Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` once, when ``ray`` is first
    imported. If it was imported before this call, the constant it derived is
    corrected as well, so the driver also picks 127.0.0.1 as its node address.
    """
    os.environ.update(LOOPBACK_ENV)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and getattr(constants, "ENABLE_RAY_CLUSTER", False):
        constants.ENABLE_RAY_CLUSTER = False


class RayHandle:
    """The Ray instance a run uses; a context manager.

    Attributes:
      address: the GCS address of the instance.
      started: True if :func:`start_ray` started an embedded instance, which
        :meth:`shutdown` then stops. Joined clusters and instances that were
        already running are never shut down by this handle.
      joined: True if it joined an existing cluster by address.
    """

    def __init__(self, address: str, started: bool, joined: bool):
        self.address = address
        self.started = started
        self.joined = joined
        self._closed = False

    def shutdown(self) -> None:
        """Stops the embedded instance this handle started (idempotent); otherwise does nothing."""
        if self._closed:
            return
        self._closed = True
        if self.started:
            import ray

            if ray.is_initialized():
                ray.shutdown()

    def __enter__(self) -> RayHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        kind = "embedded" if self.started else ("joined" if self.joined else "reused")
        return f"RayHandle({kind}, address={self.address!r})"


def start_ray(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    temp_dir: str | None = None,
    object_store_memory: int | None = None,
    runtime_env: dict[str, Any] | None = None,
) -> RayHandle:
    """Initialises Ray for a run, or reuses the instance already initialised.

    Args:
      address: ``None`` or ``"local"`` for an embedded instance (``None`` defers
        to ``RAY_ADDRESS`` when that is set), ``"auto"`` or ``"host:port"`` to
        join a running cluster.
      num_cpus: logical CPUs of the embedded instance (default: detected).
        Ignored when joining a cluster.
      temp_dir: root of the embedded instance's session files (default Ray's).
        Keep it short: Ray puts Unix sockets under it.
      object_store_memory: object store size of the embedded instance, bytes.
      runtime_env: the job's runtime environment (local ``working_dir`` and
        ``py_modules`` are uploaded from here: Ray takes local paths at the
        job level only). Not applied to an instance already initialised,
        which keeps its own (a warning says so).

    Returns:
      A :class:`RayHandle`; ``shutdown()`` (or leaving the ``with`` block)
      stops the instance only if this call started it.
    """
    # Everything Ray-specific is imported here, after the environment is set:
    # Ray reads some of these variables at import time.
    if address is None:
        address = os.environ.get("RAY_ADDRESS") or None
    embedded = address is None or address == "local"
    if embedded:
        apply_loopback_env()
        for name, value in EMBEDDED_ENV.items():
            os.environ.setdefault(name, value)
    else:
        # A joined cluster decides its own network and auth settings; only
        # usage reporting is turned off unless the user asked for it.
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    import ray

    if ray.is_initialized():
        if runtime_env:
            logging.getLogger("popmeta").warning(
                "Ray was initialised before this run: its runtime environment %s is not "
                "applied; pass it to ray.init(runtime_env=...) yourself",
                runtime_env,
            )
        return RayHandle(_gcs_address(), started=False, joined=False)
    route_raylet_messages_to_logging()

    common: dict[str, Any] = {
        "log_to_driver": False,
        "logging_level": logging.WARNING,
    }
    if runtime_env:
        common["runtime_env"] = runtime_env
    if embedded:
        # address="local" (never a bare ray.init()): a bare init also reads
        # RAY_ADDRESS and a leftover current-cluster file of a crashed run,
        # and would then hang trying to reach a dead cluster.
        with quiet_fork(), _keeping_sigterm():
            ray.init(
                address="local",
                num_cpus=num_cpus,
                object_store_memory=object_store_memory,
                include_dashboard=False,
                _temp_dir=temp_dir,
                **common,
            )
        return RayHandle(_gcs_address(), started=True, joined=False)
    with _keeping_sigterm():
        ray.init(address=address, **common)
    return RayHandle(_gcs_address(), started=False, joined=True)


@contextlib.contextmanager
def _keeping_sigterm() -> Iterator[None]:
    """Keeps the process's SIGTERM handler across ``ray.init``.

    ``ray.init`` replaces it with one that exits at once (``sys.exit(15)``),
    which would take a run's SIGTERM (a scheduler's preemption notice) away
    from the run loop that saves a checkpoint on it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def start_ray_for(
    population: PopulationConfig, runtime_env: dict[str, Any] | None = None
) -> RayHandle:
    """:func:`start_ray` for a run's population: joins ``population.address``, or
    starts an embedded instance with enough logical CPUs for every actor.

    Logical CPUs are a scheduling budget, not cores: an embedded instance on a
    machine with fewer cores than ``num_actors * num_cpus`` still schedules
    every actor (pinning then spreads them over the real cores).

    Args:
      population: the run's population section.
      runtime_env: the job's runtime environment (see :func:`start_ray`).
    """
    needed = math.ceil(population.num_actors * population.num_cpus)
    return start_ray(
        population.address, num_cpus=max(os.cpu_count() or 1, needed), runtime_env=runtime_env
    )


_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
_RAYLET_LOG = logging.getLogger("popmeta.ray")


def route_raylet_messages_to_logging() -> None:
    """Sends the errors Ray's raylet publishes to the driver to the ``popmeta.ray`` logger.

    Ray's driver prints each of them (an actor's death is a colour-coded
    paragraph starting "(raylet) A worker died or was killed") to stdout from
    a thread of its own, ``ray._private.worker.listen_error_messages``,
    whatever ``log_to_driver`` says. popmeta reports every actor loss itself
    (the supervisor's "actor N ... was lost" warning), so these messages go
    to a DEBUG logger, without colour codes, instead of the user's terminal.
    That thread looks ``print_to_stdstream`` up as a module global at each
    message, so replacing it there is enough; other streams pass through.
    Idempotent.
    """
    import ray._private.worker as ray_worker

    original = ray_worker.print_to_stdstream
    if getattr(original, "_popmeta_routed", False):
        return

    def print_to_stdstream(data: dict, ignore_prefix: bool) -> None:
        if data.get("pid") != "raylet":
            original(data, ignore_prefix)
            return
        for line in data.get("lines", []):
            _RAYLET_LOG.debug("%s", _ANSI_ESCAPE.sub("", str(line)))

    print_to_stdstream._popmeta_routed = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = print_to_stdstream


@contextlib.contextmanager
def quiet_fork() -> Iterator[None]:
    """Silences Python's warning about forking while JAX runs threads, for Ray's start.

    Ray starts its processes with fork + exec: the child replaces itself at
    once, so threads of the parent (JAX's, if the caller already ran JAX)
    cannot deadlock it; the warning would only be noise on the terminal.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning
        )
        yield


def _gcs_address() -> str:
    import ray

    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:  # an older/odd context without the attribute: the address is cosmetic
        return "unknown"
