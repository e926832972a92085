"""The lock of a remote run directory: an object naming its owner, renewed by a heartbeat.

Object stores have no ``flock``, and a run whose head node is lost never
releases its lock, so a remote run directory is locked by a small object that
its owner rewrites from a background thread and that a start takes over once
its heartbeat is stale (the policy is :class:`RemoteLock`'s docstring).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from popmeta.storage.locations import StorageError
from popmeta.storage.remote_dir import RemoteDir

__all__ = ["LOCK_HEARTBEAT_S", "LOCK_NAME", "LOCK_STALE_AFTER_S", "RemoteLock"]

log = logging.getLogger("popmeta")

#: Name of a run directory's lock: the remote lock object (and the local flock file).
LOCK_NAME = ".lock"
#: Seconds between heartbeats of a remote lock.
LOCK_HEARTBEAT_S = 30.0
#: Age of the last heartbeat after which a remote lock is taken over.
LOCK_STALE_AFTER_S = 180.0


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
