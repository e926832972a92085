"""Where a run's files live: local paths or storage URIs (fsspec), whole-file uploads,
the staging mirror of a remote run directory and its lock (docs/storage.md)."""

from popmeta.storage.locations import StorageError, is_remote, join, local_path, parent
from popmeta.storage.lock import LOCK_HEARTBEAT_S, LOCK_NAME, LOCK_STALE_AFTER_S, RemoteLock
from popmeta.storage.mirror import Mirror, local_output_dir
from popmeta.storage.remote_dir import EXTRAS, OBJECT_STORES, RemoteDir, download, local_file

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
