"""A run directory is one experiment: its recorded config, its lock, its checkpoints.

``<run_dir>/<name>/`` holds ``config.yaml`` (the resolved config the run was
started with), ``checkpoints/``, TensorBoard event files and ``eval/``. Reusing
a name must never mix two experiments, so before anything starts a recorded
config that differs from the new one in a field that changes the experiment
is refused (:mod:`popmeta.run_identity`); a lock (``.lock``, ``fcntl.flock``)
keeps a second live run out; and a start that fails leaves the directory as
it found it. A run directory may also be a storage URI (``s3://...``): the
run then works in a local staging directory (:attr:`RunDirectory.path`) that
mirrors the remote one, with whole-file uploads and a heartbeat lock
(docs/storage.md). Why: docs/design.md, "A run is an identity".
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import posixpath
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from popmeta.learner.checkpoints import (
    checkpoint_step,
    list_checkpoints,
)
from popmeta.storage import (
    LOCK_NAME,
    Mirror,
    RemoteDir,
    RemoteLock,
    StorageError,
    download,
    is_remote,
    join,
    local_path,
    parent,
)

__all__ = ["CONFIG_FILE", "RunDirectory", "RunDirectoryError", "RunWriteError"]

CONFIG_FILE = "config.yaml"
#: Seconds between uploads of a remote run's event files while it trains.
SYNC_EVERY_S = 30.0


log = logging.getLogger("popmeta")


class RunDirectoryError(RuntimeError):
    """The run directory cannot host this start; the message says why and what to do."""


class RunWriteError(RuntimeError):
    """A file the run must keep (a checkpoint, its config) could not be written.

    The disk is full, the run directory became read-only, or the disk failed.
    The run stopped after its current step; the checkpoints written before are
    intact (a checkpoint is renamed into place only once complete). The
    message names the file, the OS error, what to do and the checkpoint a
    rerun of the same command resumes from.
    """


def _close_quietly(handle: Any) -> None:
    # Closing flushes the lock file's text (who holds it); on a full disk that
    # fails, and must neither hide the run's own error nor keep the lock.
    with contextlib.suppress(OSError):
        handle.close()
    if not handle.closed:  # a failed flush may leave the file open: close without it
        with contextlib.suppress(OSError, ValueError):
            os.close(handle.fileno())


class RunDirectory:
    """``<run_dir>/<name>``, checked and claimed for one start.

    Args:
      run_dir: where runs live (``run_dir``: a local path or a storage URI).
      name: the run's name (``name``).
    """

    def __init__(self, run_dir: str, name: str):
        self.remote_uri: str | None = None
        if is_remote(run_dir):
            self.remote_uri = join(run_dir, name)
            # Created by claim(); a fresh name per start, so nothing stale is ever read.
            staging = f"popmeta-staging-{uuid.uuid4().hex[:12]}"
            self.path = Path(tempfile.gettempdir()) / staging / name
        else:
            self.path = local_path(run_dir) / name
        self.checkpoints = self.path / "checkpoints"
        self._mirror: Mirror | None = None
        self._lock: RemoteLock | None = None
        self._last_sync = 0.0

    @property
    def location(self) -> Path | str:
        """Where the run lives: the local directory, or the storage URI."""
        return self.remote_uri or self.path

    def write_failure(self, path: Path, err: OSError, step: int) -> RunWriteError:
        """The error that stops the run at ``step`` because ``path`` could not be written."""
        checkpoints = list_checkpoints(self.checkpoints)
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = f"Free space on the disk that holds {self.path}"
        elif err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            fix = f"Make {self.path} writable again (it is read-only or its permissions changed)"
        else:
            fix = f"Check the disk that holds {self.path}"
        resume = (
            f"then rerun the same command: it resumes from {self.location_of(checkpoints[-1])}, "
            "the newest checkpoint, which is intact."
            if checkpoints
            else "then rerun the same command; no checkpoint was written yet, so it starts afresh."
        )
        return RunWriteError(
            f"cannot write {path}: {err.strerror or err} (errno {err.errno}). The run stopped "
            f"at step {step}. {fix}, {resume}"
        )

    def location_of(self, path: Path) -> Path | str:
        """The lasting name of a file under :attr:`path` (its URI for a remote run)."""
        if self.remote_uri is None:
            return path
        return join(self.remote_uri, path.relative_to(self.path).as_posix())

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE

    def check_writable(self) -> None:
        """Refuses a run directory that cannot be created or written, before anything starts.

        For a storage URI: the storage's fsspec implementation is installed
        and its bucket (or top directory) exists and answers.
        """
        if self.remote_uri is not None:
            try:
                RemoteDir(self.remote_uri).check_reachable()
            except StorageError as err:
                raise RunDirectoryError(f"run_dir: {err}") from None
            return
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

        For a storage URI the lock is the remote lock object, the directory
        is the staging one, the recorded config and checkpoints are
        downloaded into it first, and everything is uploaded once more before
        the lock is released (see the module docstring).

        Raises:
          RunDirectoryError: another live process holds the lock, or the
            storage fails at the start or at the final upload.
        """
        if self.remote_uri is not None:
            with self._claim_remote():
                yield
            return
        created = not self.path.exists()
        lock_path = self.path / LOCK_NAME
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            handle = open(lock_path, "a+")  # noqa: SIM115 -- held for the whole run
        except OSError as err:
            if created:
                shutil.rmtree(self.path, ignore_errors=True)
            raise RunDirectoryError(
                f"cannot create the run's lock file {lock_path}: {err.strerror or err}; make "
                f"{self.path} writable (or free space on its disk), or choose another run_dir"
            ) from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            _close_quietly(handle)
            raise RunDirectoryError(
                f"{self.path} is in use by a live run ({holder}); wait for it to end, "
                f"or start this one with --set name=NEW"
            ) from None
        # Who holds the lock is only information for a refused second start: a
        # full disk must not stop the run here (its checkpoints report that).
        with contextlib.suppress(OSError):
            handle.seek(0)
            handle.truncate()
            handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.ctime()}\n")
            handle.flush()
        self._recorded = False
        try:
            yield
        except BaseException:
            if created and not self._recorded:
                _close_quietly(handle)
                shutil.rmtree(self.path, ignore_errors=True)
            raise
        finally:
            if not handle.closed:
                # Unlinked while still locked: no other start can lock this file meanwhile.
                with contextlib.suppress(OSError):
                    lock_path.unlink()
                _close_quietly(handle)

    @contextlib.contextmanager
    def _claim_remote(self) -> Iterator[None]:
        assert self.remote_uri is not None
        remote = RemoteDir(self.remote_uri)
        lock = RemoteLock(remote)
        try:
            lock.acquire()
        except StorageError as err:
            raise RunDirectoryError(str(err)) from None
        self._recorded = False
        self._lock, self._mirror = lock, Mirror(self.path, remote, first=CONFIG_FILE)
        synced = False
        try:
            try:
                self.path.mkdir(parents=True)
                self._mirror.pull(CONFIG_FILE)
                self._mirror.pull_dir("checkpoints", ".npz")
            except (OSError, StorageError) as err:
                raise RunDirectoryError(
                    f"{self.remote_uri}: cannot download the recorded run ({err})"
                ) from None
            try:
                yield
            except BaseException as err:
                # A failed run keeps what it saved (its final checkpoint above all).
                if self._recorded:
                    try:
                        self._final_sync()
                        synced = True
                    except RunDirectoryError as sync_err:
                        log.error("%s", sync_err)
                        err.add_note(str(sync_err))
                else:
                    synced = True  # nothing of this start reached the bucket
                raise
            if self._recorded:
                self._final_sync()
            synced = True
        finally:
            lock.release()
            self._lock = self._mirror = None
            if synced:
                shutil.rmtree(self.path.parent, ignore_errors=True)

    def _final_sync(self) -> None:
        try:
            self.sync(final=True)
        except (StorageError, RunDirectoryError) as err:
            raise RunDirectoryError(
                f"{err}. The run's files are kept in {self.path}; copy them to "
                f"{self.remote_uri} (e.g. with your storage's command line tool) before "
                f"resuming there"
            ) from None

    def sync(self, final: bool = False) -> None:
        """Uploads a remote run's new and changed files now; nothing for a local run.

        Args:
          final: raise when an upload fails (else it is logged and retried
            by the next sync).

        Raises:
          RunDirectoryError: another start took the lock over, so this run
            must stop writing there; or a final upload failed.
        """
        if self._mirror is None:
            return
        assert self._lock is not None
        if self._lock.lost is not None:
            raise RunDirectoryError(
                f"{self.remote_uri}: the lock was taken over by {self._lock.lost} (this run's "
                f"heartbeats had stopped for over {self._lock.stale_after_s:.0f} s); this run stopped "
                f"writing there"
            )
        self._last_sync = time.monotonic()
        try:
            self._mirror.sync()
        except StorageError as err:
            if final:
                raise
            log.warning("%s; retried at the next upload", err)

    def sync_if_due(self) -> None:
        """:meth:`sync` when :data:`SYNC_EVERY_S` seconds have passed since the last one."""
        if self._mirror is not None and time.monotonic() - self._last_sync >= SYNC_EVERY_S:
            self.sync()

    def fetch_checkpoint(self, location: str | Path) -> Path:
        """A local path of the checkpoint at ``location`` (a path, or a storage URI).

        A checkpoint of this remote run is the staged copy; any other remote
        one is downloaded into the staging directory (never uploaded back).

        Raises:
          RunDirectoryError: the file does not exist or cannot be downloaded.
        """
        if not is_remote(location):
            return local_path(location)
        uri = str(location)
        name = posixpath.basename(uri.rstrip("/"))
        if self.remote_uri is not None and parent(uri) == join(self.remote_uri, "checkpoints"):
            staged = self.checkpoints / name
            if staged.is_file():
                return staged
        try:
            return download(uri, self.path / ".incoming" / name)
        except (OSError, StorageError) as err:
            raise RunDirectoryError(f"--from-checkpoint {uri}: {err}") from None

    def record_config(self, text: str) -> None:
        """Writes the resolved config (its YAML ``text``); the directory is this run's from now on.

        Written to a temporary file and renamed into place: a write that fails
        (a full disk) leaves the previously recorded config whole.

        Raises:
          OSError: the file could not be written.
        """
        partial = self.config_file.with_name(CONFIG_FILE + ".partial")
        try:
            partial.write_text(text, encoding="utf-8")
            os.replace(partial, self.config_file)
        except OSError:
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            raise
        self._recorded = True
        self.sync()

    def take_over_from(self, checkpoint: Path) -> None:
        """Makes ``checkpoint`` the newest of this run: later ones are moved aside, not deleted.

        Args:
          checkpoint: a checkpoint file of any run whose learned optimizer has
            the shape of this config's.

        The caller has already restored from it, which read and checked it.

        Raises:
          RunDirectoryError: the file's name is not a checkpoint's.
          RunWriteError: the later checkpoints cannot be moved aside.
        """
        try:
            step = checkpoint_step(checkpoint)
        except ValueError as err:
            raise RunDirectoryError(f"--from-checkpoint {checkpoint}: {err}") from None
        later = [p for p in list_checkpoints(self.checkpoints) if checkpoint_step(p) > step]
        if later:
            aside = self.path / f"checkpoints-after-{step}-{time.strftime('%Y%m%d-%H%M%S')}"
            self.move_aside(later, aside)

    def move_aside(self, paths: list[Path], aside: Path) -> None:
        """Moves ``paths`` into the new folder ``aside`` of this run (kept, never deleted).

        Raises:
          RunWriteError: the folder cannot be made or a file cannot be moved
            (nothing was trained; the files not moved are where they were).
        """
        try:
            aside.mkdir(parents=True, exist_ok=True)
            for path in paths:
                path.rename(aside / path.name)
        except OSError as err:
            raise RunWriteError(
                f"cannot move {len(paths)} checkpoint(s) aside to {aside}: "
                f"{err.strerror or err} (errno {err.errno}). Nothing was trained; make "
                f"{self.path} writable (or free space on its disk) and rerun the same command"
            ) from None
