"""A local staging directory kept in step with a remote one, and output written through one.

A run on a storage URI writes to a local staging directory exactly as a local
run would; :class:`Mirror` uploads each new or changed file whole and
removes remotely what was deleted locally, so the remote directory follows
the run without the run knowing.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from popmeta.storage.locations import StorageError, is_remote, local_path
from popmeta.storage.remote_dir import RemoteDir

__all__ = ["Mirror", "local_output_dir"]


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
