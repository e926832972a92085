"""Real processes for tests: a child ``popmeta``'s environment; a run's actors under /proc.

Ray renames an actor's process ``ray::EstimatorActor.__init__`` while its
constructor runs and ``ray::EstimatorActor`` afterwards; the processes are
children of the raylet, a child of the driver that started Ray. Linux only.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

__all__ = ["STARTING_ACTOR", "ActorKiller", "descendants", "env_with_compilation_cache"]

STARTING_ACTOR = "ray::EstimatorActor.__init__"


def env_with_compilation_cache() -> dict[str, str]:
    """This environment, plus this process's persistent compilation cache for a child ``popmeta``.

    The child's driver then loads what earlier runs of the suite compiled (its
    actors use that cache anyway: it is their default).
    """
    import jax

    return {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


def _parent_and_title(pid: str) -> tuple[int, str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, UnicodeDecodeError):
        return None
    # The command name (2nd field) may hold spaces and parentheses: split after its last ')'.
    return int(stat[stat.rindex(")") + 2 :].split()[1]), title.strip()


def descendants(root: int) -> dict[int, str]:
    """Pid -> title of every process below ``root``."""
    table = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit() and (entry := _parent_and_title(pid)) is not None:
            table[int(pid)] = entry
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, title) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = title
                frontier.append(pid)
    return found


class ActorKiller(threading.Thread):
    """SIGKILLs the first ``count`` processes below ``root`` whose title starts with ``title``.

    Used as a context manager: started on entry, stopped on exit; ``killed``
    lists the pids it killed.
    """

    def __init__(self, root: int, title: str = STARTING_ACTOR, count: int = 1):
        super().__init__(daemon=True)
        self.root, self.title, self.count = root, title, count
        self.killed: list[int] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while len(self.killed) < self.count and not self._stop_event.is_set():
            for pid, title in descendants(self.root).items():
                if title.startswith(self.title) and pid not in self.killed:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                    self.killed.append(pid)
                    break
            time.sleep(0.02)

    def __enter__(self) -> ActorKiller:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop_event.set()
        self.join(timeout=5)
