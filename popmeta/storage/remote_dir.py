"""Where a run's files live: a local directory, or a storage URI that fsspec knows.

A location without a scheme (``runs``, ``/data/runs``) or with ``file://`` is
a local directory and needs nothing beyond the standard library. Any other
``scheme://`` (``s3://bucket/runs``, ``gs://bucket/runs``, ``hdfs://...``, or
any filesystem fsspec or, through fsspec, pyarrow knows) is remote and goes
through `fsspec <https://filesystem-spec.readthedocs.io>`_, imported only
then. S3 needs the ``s3`` extra (``pip install 'popmeta[s3]'``, which brings
``s3fs``), Google Cloud Storage the ``gcs`` extra (``gcsfs``); a missing one is
reported naming the extra.

Endpoint and credentials come from the standard environment of each client,
never from the run's config (which is recorded next to the checkpoints):
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_PROFILE`` /
``AWS_ENDPOINT_URL`` (an S3-compatible server such as MinIO) for S3,
``GOOGLE_APPLICATION_CREDENTIALS`` or the VM's service account for GCS, and
fsspec's own ``FSSPEC_<PROTOCOL>_<OPTION>`` variables (e.g.
``FSSPEC_S3_ENDPOINT_URL``) for any other storage option.

Atomicity. A remote file is always written whole from a complete local file,
so a reader sees the old file or the new one, never a part:

* on object stores (S3, GCS, Azure; :data:`OBJECT_STORES`) a single PUT of the
  whole object, which the store makes visible only once it is complete;
* on every other filesystem an upload to a temporary name beside the target
  (``.<name>.partial-<random>``) followed by a move onto the target.

Downloads go to a temporary local file that is moved into place once complete.

:class:`Mirror` keeps a local staging directory in step with a remote one;
:class:`RemoteLock` is the lock of a remote run directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "EXTRAS",
    "LOCK_HEARTBEAT_S",
    "LOCK_NAME",
    "LOCK_STALE_AFTER_S",
    "OBJECT_STORES",
    "Mirror",
    "RemoteDir",
    "RemoteLock",
    "StorageError",
    "download",
    "is_remote",
    "join",
    "local_file",
    "local_output_dir",
    "local_path",
    "parent",
]

log = logging.getLogger("popmeta")

#: Name of a run directory's lock: the remote lock object (and the local flock file).
LOCK_NAME = ".lock"
#: Seconds between heartbeats of a remote lock.
LOCK_HEARTBEAT_S = 30.0
#: Age of the last heartbeat after which a remote lock is taken over.
LOCK_STALE_AFTER_S = 180.0
#: Schemes whose single PUT of a whole object is atomic: no temporary name is needed.
OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
#: The popmeta extra that brings the fsspec implementation of a scheme.
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
_LOCAL_SCHEMES = ("file", "local")


class StorageError(OSError):
    """A remote location cannot be used or reached; the message names it and what to do."""


def _scheme(location: str | os.PathLike[str]) -> str | None:
    text = os.fspath(location)
    scheme, sep, _ = text.partition("://")
    return scheme.lower() if sep and scheme.replace("+", "").isalnum() else None


def is_remote(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` is a storage URI rather than a local path."""
    scheme = _scheme(location)
    return scheme is not None and scheme not in _LOCAL_SCHEMES


def local_path(location: str | os.PathLike[str]) -> Path:
    """The local path of a non-remote location (``file://`` stripped)."""
    text = os.fspath(location)
    return Path(text.partition("://")[2]) if _scheme(text) in _LOCAL_SCHEMES else Path(text)


def join(location: str | os.PathLike[str], *parts: str) -> str:
    """``location/part/...``; URIs always join with ``/``."""
    if is_remote(location):
        return posixpath.join(os.fspath(location).rstrip("/"), *parts)
    return str(local_path(location).joinpath(*parts))


def parent(location: str | os.PathLike[str]) -> str:
    """The directory that holds ``location``."""
    if is_remote(location):
        scheme, _, rest = os.fspath(location).rstrip("/").partition("://")
        return f"{scheme}://{posixpath.dirname(rest)}"
    return str(local_path(location).parent)


def _filesystem(uri: str) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) of ``uri``, or a StorageError naming the extra."""
    scheme = _scheme(uri) or ""
    extra = EXTRAS.get(scheme)
    how = (
        f"install popmeta with the {extra} extra: pip install 'popmeta[{extra}]'"
        if extra
        else f"install fsspec and the fsspec implementation of {scheme}://"
    )
    try:
        import fsspec
    except ImportError:
        raise StorageError(f"{uri}: remote storage needs fsspec; {how}") from None
    try:
        return fsspec.core.url_to_fs(uri)
    except ImportError as err:
        raise StorageError(f"{uri}: {how} ({err})") from None
    except ValueError as err:
        raise StorageError(f"{uri}: fsspec does not know this storage ({err})") from None


class RemoteDir:
    """A directory on an fsspec filesystem, read and written one whole file at a time.

    Args:
      uri: the directory, e.g. ``s3://bucket/runs/quickstart``.
    """

    def __init__(self, uri: str):
        self.uri = uri.rstrip("/")
        self.fs, self._root = _filesystem(self.uri)
        self.atomic_put = (_scheme(self.uri) or "") in OBJECT_STORES

    def url(self, rel: str = "") -> str:
        """The URI of ``rel`` (a ``/``-separated path inside this directory)."""
        return f"{self.uri}/{rel}" if rel else self.uri

    def _path(self, rel: str) -> str:
        return f"{self._root}/{rel}" if rel else self._root

    def check_reachable(self) -> None:
        """Raises StorageError unless the bucket (or top directory) exists and answers."""
        top = self._root.split("/", 1)[0]
        try:
            found = self.fs.exists(top)
        except Exception as err:  # the client's own errors: network, auth, ...
            raise StorageError(f"{self.uri}: cannot reach {top} ({err})") from None
        if not found:
            raise StorageError(
                f"{self.uri}: {top} does not exist or is not visible with these credentials; "
                f"create it first"
            )

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self._path(rel))

    def files(self, rel_dir: str = "") -> list[str]:
        """Names of the files directly inside ``rel_dir`` (empty when it does not exist)."""
        try:
            entries = self.fs.ls(self._path(rel_dir), detail=True, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e["name"]) for e in entries if e["type"] == "file")

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self._path(rel))

    def write_bytes(self, rel: str, data: bytes, exclusive: bool = False) -> None:
        """Writes ``data`` whole; ``exclusive`` fails with FileExistsError if ``rel`` exists.

        Exclusive creation uses the store's conditional write (S3 ``If-None-Match``)
        where the filesystem implements mode ``"xb"``; elsewhere it is an
        existence check followed by the write, which two writers can race.
        """
        if exclusive:
            try:
                with self.fs.open(self._path(rel), "xb") as handle:
                    handle.write(data)
                return
            except (NotImplementedError, ValueError):
                if self.exists(rel):
                    raise FileExistsError(self.url(rel)) from None
        with tempfile.NamedTemporaryFile(prefix="popmeta-put-") as handle:
            handle.write(data)
            handle.flush()
            self.upload(Path(handle.name), rel)

    def upload(self, source: Path, rel: str) -> None:
        """Puts the complete local file ``source`` at ``rel``, atomically (module docstring)."""
        target = self._path(rel)
        if self.atomic_put:
            self.fs.put_file(str(source), target)
            return
        folder, name = posixpath.split(target)
        partial = posixpath.join(folder, f".{name}.partial-{uuid.uuid4().hex[:8]}")
        self.fs.makedirs(folder, exist_ok=True)
        try:
            self.fs.put_file(str(source), partial)
            self.fs.mv(partial, target)
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm_file(partial)
            raise

    def download(self, rel: str, target: Path) -> Path:
        """Copies ``rel`` to the local file ``target``, which appears only once complete."""
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.partial-{uuid.uuid4().hex[:8]}")
        try:
            self.fs.get_file(self._path(rel), str(partial))
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        return target

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(rel))


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


class Mirror:
    """A local staging directory whose files are copied to a remote directory.

    The run writes to ``local`` as it would to a local run directory;
    :meth:`sync` then uploads every file that is new or changed since the
    last sync (each whole and atomically), and removes remotely the files it
    once uploaded or downloaded that are gone locally (checkpoints pruned to
    the newest K, checkpoints moved aside by a take-over). Remote files it
    never saw (older event files, ``eval/``) are left alone. Uploads come
    before removals, so the remote directory never holds fewer checkpoints
    than it needs. Names starting with ``.`` (temporary files, locks) are
    never uploaded.

    Args:
      local: the staging directory.
      remote: the directory it mirrors.
      first: a file that each sync uploads before any other (a run's recorded
        config: its files are never visible without its identity).
    """

    def __init__(self, local: Path, remote: RemoteDir, first: str | None = None):
        self.local = local
        self.remote = remote
        self.first = first
        self._synced: dict[str, tuple[int, int]] = {}

    def pull(self, rel: str) -> bool:
        """Downloads ``rel`` into the staging directory; False when it does not exist remotely."""
        try:
            target = self.remote.download(rel, self.local / rel)
        except FileNotFoundError:
            return False
        self._synced[rel] = _stamp(target)
        return True

    def pull_dir(self, rel_dir: str, suffix: str = "") -> list[str]:
        """Downloads the files directly in ``rel_dir`` whose names end with ``suffix``."""
        pulled = []
        for name in self.remote.files(rel_dir):
            rel = posixpath.join(rel_dir, name)
            if not name.startswith(".") and name.endswith(suffix) and self.pull(rel):
                pulled.append(rel)
        return pulled

    def _local_files(self) -> dict[str, Path]:
        found = {}
        for path in self.local.rglob("*"):
            rel = path.relative_to(self.local)
            if path.is_file() and not any(part.startswith(".") for part in rel.parts):
                found[rel.as_posix()] = path
        return found

    def sync(self) -> int:
        """Uploads what changed and removes what was deleted; returns the files uploaded.

        Raises:
          StorageError: an upload or removal failed; the files it did not
            reach are tried again by the next sync.
        """
        current = self._local_files()
        uploaded = 0
        for rel in sorted(current, key=lambda r: (r != self.first, r)):
            stamp = _stamp(current[rel])
            if self._synced.get(rel) == stamp:
                continue
            try:
                self.remote.upload(current[rel], rel)
            except Exception as err:
                raise StorageError(f"uploading {self.remote.url(rel)} failed: {err}") from err
            self._synced[rel] = stamp
            uploaded += 1
        for rel in sorted(set(self._synced) - set(current)):
            try:
                self.remote.remove(rel)
            except Exception as err:
                raise StorageError(f"removing {self.remote.url(rel)} failed: {err}") from err
            del self._synced[rel]
        return uploaded


class RemoteLock:
    """The lock of a remote run directory: an object naming its owner, with a heartbeat.

    Object stores have no ``flock``, and a run whose head node is lost never
    releases its lock. So the lock is a small JSON object (``owner``,
    ``token``, ``heartbeat``: the owner's wall-clock time) that the owner
    rewrites every ``heartbeat_s`` seconds from a background thread, and
    deletes when the run ends. Policy:

    * a start finds no lock object: it creates one with an exclusive
      (conditional) write, so of two simultaneous starts one wins;
    * a lock whose heartbeat is at most ``stale_after_s`` old belongs to a
      live run: the start is refused, naming the owner;
    * an older one belongs to a run that died (its node was lost, it was
      killed): it is taken over;
    * an owner whose heartbeat finds another token in the lock has lost it
      (its heartbeats stopped for longer than ``stale_after_s`` and another
      start took over): :attr:`lost` says so, and the run stops writing.

    Clocks of the hosts sharing a run directory are assumed to agree to well
    within ``stale_after_s`` (NTP does this easily).

    Args:
      remote: the run directory.
      rel: the lock object's name inside it.
      heartbeat_s: seconds between heartbeats.
      stale_after_s: age of the last heartbeat after which a lock is taken over.
    """

    def __init__(
        self,
        remote: RemoteDir,
        rel: str = LOCK_NAME,
        heartbeat_s: float = LOCK_HEARTBEAT_S,
        stale_after_s: float = LOCK_STALE_AFTER_S,
    ):
        self.remote = remote
        self.rel = rel
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.token = uuid.uuid4().hex
        self.owner = f"pid {os.getpid()} on {socket.gethostname()}"
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> bytes:
        return json.dumps(
            {"owner": self.owner, "token": self.token, "heartbeat": time.time()}
        ).encode()

    def _read(self) -> dict[str, Any] | None:
        try:
            record = json.loads(self.remote.read_bytes(self.rel))
        except FileNotFoundError:
            return None
        except ValueError:
            # Unreadable: treat as a lock of unknown age that was never refreshed.
            return {"owner": "an unreadable lock", "token": "", "heartbeat": 0.0}
        return record if isinstance(record, dict) else {"heartbeat": 0.0}

    def acquire(self) -> None:
        """Takes the lock (or a stale one over) and starts the heartbeat.

        Raises:
          StorageError: a live run holds the lock.
        """
        for _ in range(3):
            try:
                self.remote.write_bytes(self.rel, self._record(), exclusive=True)
                break
            except FileExistsError:
                pass
            holder = self._read()
            if holder is None:
                continue  # released between our write and our read: try again
            age = time.time() - float(holder.get("heartbeat", 0.0))
            if age <= self.stale_after_s:
                raise StorageError(
                    f"{self.remote.uri} is in use by a live run ({holder.get('owner')}, last "
                    f"heartbeat {max(age, 0.0):.0f} s ago); wait for it to end, or start this "
                    f"one with --set name=NEW. A lock whose heartbeat is older than "
                    f"{self.stale_after_s:.0f} s is taken over."
                )
            log.warning(
                "taking over the lock of %s from %s (last heartbeat %.0f s ago)",
                self.remote.uri,
                holder.get("owner"),
                age,
            )
            self.remote.remove(self.rel)
        else:
            raise StorageError(f"{self.remote.url(self.rel)}: could not create the lock")
        self._thread = threading.Thread(
            target=self._beat, name="popmeta-lock-heartbeat", daemon=True
        )
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                holder = self._read()
                if holder is not None and holder.get("token") != self.token:
                    self.lost = str(holder.get("owner"))
                    log.error("the lock of %s was taken over by %s", self.remote.uri, self.lost)
                    return
                self.remote.write_bytes(self.rel, self._record())
            except Exception as err:  # a missed heartbeat is retried; staleness takes minutes
                log.warning("heartbeat of the lock of %s failed: %s", self.remote.uri, err)

    def release(self) -> None:
        """Stops the heartbeat and deletes the lock if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with contextlib.suppress(Exception):
            holder = self._read()
            if holder is not None and holder.get("token") == self.token:
                self.remote.remove(self.rel)


def download(uri: str, target: Path) -> Path:
    """Downloads the remote file ``uri`` to ``target`` (whole, then renamed into place).

    Raises:
      FileNotFoundError: no file at ``uri``.
      StorageError: the storage cannot be used.
    """
    try:
        return RemoteDir(parent(uri)).download(posixpath.basename(uri.rstrip("/")), target)
    except FileNotFoundError:
        raise FileNotFoundError(f"{uri}: no such file") from None


@contextlib.contextmanager
def local_file(location: str | os.PathLike[str]) -> Iterator[Path]:
    """A local copy of the file at ``location`` (the file itself when it is local).

    Raises:
      FileNotFoundError: no file at ``location``.
      StorageError: the storage cannot be used.
    """
    if not is_remote(location):
        yield local_path(location)
        return
    uri = os.fspath(location)
    with tempfile.TemporaryDirectory(prefix="popmeta-get-") as folder:
        yield download(uri, Path(folder) / posixpath.basename(uri.rstrip("/")))


@contextlib.contextmanager
def local_output_dir(location: str | os.PathLike[str]) -> Iterator[Path]:
    """A local directory whose files end up at ``location``.

    A local location is created and used directly. For a remote one the body
    writes to a temporary directory whose files are uploaded (each whole) when
    the body succeeds.
    """
    if not is_remote(location):
        path = local_path(location)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    remote = RemoteDir(os.fspath(location))
    folder = Path(tempfile.mkdtemp(prefix="popmeta-out-"))
    try:
        yield folder
        Mirror(folder, remote).sync()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
