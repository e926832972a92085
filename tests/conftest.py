"""Shared fixtures: one embedded Ray instance for the whole test session.

Ray reads some settings at import time, so the loopback environment is set
here, before any test module imports ``ray``; subprocesses (the CLI tests)
inherit it. Every Ray process of the suite binds and talks to 127.0.0.1 only.

``ray_session`` starts the embedded instance on first use (about 5 s and
460 MB) and stops it at the end of the session. A module that needs its own
multi-node ``ray.cluster_utils.Cluster`` requests ``no_session_ray``, which
stops the session instance (if it is up) for that module and starts it again
afterwards.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile

import pytest

from popmeta.population.ray_runtime import EMBEDDED_ENV, apply_loopback_env, quiet_fork

apply_loopback_env()
# The actors' niceness as popmeta's embedded instance has it (docs/ray.md).
os.environ.update(EMBEDDED_ENV)
# A RAY_ADDRESS from the caller's shell would make "embedded" runs join a cluster.
os.environ.pop("RAY_ADDRESS", None)
# Tuned baselines are cached per session, not in the user's ~/.cache.
os.environ["POPMETA_CACHE_DIR"] = tempfile.mkdtemp(prefix="pm-cache-")
atexit.register(shutil.rmtree, os.environ["POPMETA_CACHE_DIR"], True)

# This process compiles into the persistent cache the actors use (by default,
# or the one JAX_COMPILATION_CACHE_DIR names): the many tests that rebuild the
# same functions (a resumed run, the tiny problems shared by many tests) load
# them instead of compiling them again. A hit is the executable a compile
# would make, so no result changes. Imported after the loopback environment
# is set: it imports Ray.
from popmeta.actors.actor import use_compilation_cache  # noqa: E402

use_compilation_cache()

#: Logical CPUs of the session instance: a few more than this 2-core machine
#: has, so that tests with 3 one-CPU actors are scheduled at once.
SESSION_NUM_CPUS = 4
SESSION_OBJECT_STORE_BYTES = 256 * 2**20


class LocalRay:
    """The session's embedded Ray: started on first use, paused around Cluster modules."""

    def __init__(self) -> None:
        self._temp_dir: str | None = None
        self.starts = 0
        self.up = False

    def ensure(self) -> None:
        """Starts the embedded instance unless Ray is already initialised."""
        import ray

        if ray.is_initialized():
            return
        if self._temp_dir is None:
            # Short on purpose: Ray puts Unix sockets under it (~107-byte limit).
            self._temp_dir = tempfile.mkdtemp(prefix="pm-ray-")
        # address="local": a bare ray.init() could join a leftover cluster.
        with quiet_fork():
            ray.init(
                address="local",
                num_cpus=SESSION_NUM_CPUS,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.WARNING,
                object_store_memory=SESSION_OBJECT_STORE_BYTES,
                _temp_dir=self._temp_dir,
            )
        self.starts += 1
        self.up = True

    def stop(self) -> None:
        import ray

        if self.up and ray.is_initialized():
            ray.shutdown()
        self.up = False

    def cleanup(self) -> None:
        self.stop()
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None


_LOCAL_RAY = LocalRay()


@pytest.fixture(scope="session")
def ray_session():
    """The session's embedded Ray instance, up; one instance shared by all tests."""
    _LOCAL_RAY.ensure()
    yield _LOCAL_RAY
    _LOCAL_RAY.cleanup()


@pytest.fixture(scope="module")
def no_session_ray():
    """No Ray in this process until the module starts its own (e.g. a ``Cluster``).

    Stops the session instance if it is up and starts it again after the
    module, so later ``ray_session`` users find it running.
    """
    import ray

    was_up = _LOCAL_RAY.up
    _LOCAL_RAY.stop()
    yield
    if ray.is_initialized():
        ray.shutdown()
    if was_up:
        _LOCAL_RAY.ensure()
