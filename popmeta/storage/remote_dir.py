"""A remote directory read and written one whole file at a time, through fsspec.

Any ``scheme://`` that fsspec (or, through it, pyarrow) knows is reached
here, fsspec imported only then; a missing implementation is reported naming
the popmeta extra that brings it. A remote file is always written whole from
a complete local file, so a reader sees the old file or the new one, never a
part; downloads land under a temporary name and are renamed into place.
Credentials, endpoints and how atomicity is had on each kind of store are in
docs/storage.md.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from popmeta.storage.locations import StorageError, is_remote, local_path, parent, scheme_of

__all__ = ["EXTRAS", "OBJECT_STORES", "RemoteDir", "download", "local_file"]

#: Schemes whose single PUT of a whole object is atomic: no temporary name is needed.
OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
#: The popmeta extra that brings the fsspec implementation of a scheme.
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


def _filesystem(uri: str) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) of ``uri``, or a StorageError naming the extra."""
    scheme = scheme_of(uri) or ""
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
        self.atomic_put = (scheme_of(self.uri) or "") in OBJECT_STORES

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
        """Puts the complete local file ``source`` at ``rel``, atomically (docs/storage.md)."""
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
