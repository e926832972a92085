"""Where a run's files live: a local path, or a storage URI that fsspec knows.

A location without a scheme (``runs``, ``/data/runs``) or with ``file://`` is
a local directory and needs nothing beyond the standard library; any other
``scheme://`` is remote (:mod:`popmeta.storage.remote_dir`). These functions
tell the two apart and join paths of either, without importing fsspec.
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

__all__ = ["StorageError", "is_remote", "join", "local_path", "parent", "scheme_of"]

_LOCAL_SCHEMES = ("file", "local")


class StorageError(OSError):
    """A remote location cannot be used or reached; the message names it and what to do."""


def scheme_of(location: str | os.PathLike[str]) -> str | None:
    """The lower-case scheme of a URI (``s3``), or None for a plain path."""
    text = os.fspath(location)
    scheme, sep, _ = text.partition("://")
    return scheme.lower() if sep and scheme.replace("+", "").isalnum() else None


def is_remote(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` is a storage URI rather than a local path."""
    scheme = scheme_of(location)
    return scheme is not None and scheme not in _LOCAL_SCHEMES


def local_path(location: str | os.PathLike[str]) -> Path:
    """The local path of a non-remote location (``file://`` stripped)."""
    text = os.fspath(location)
    return Path(text.partition("://")[2]) if scheme_of(text) in _LOCAL_SCHEMES else Path(text)


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
