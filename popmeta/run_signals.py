"""How a run answers SIGINT, SIGTERM and SIGHUP, by the phase it is in.

Ctrl-C, a scheduler's SIGTERM and a closed terminal's SIGHUP must never leave
a run directory half written: while the run trains, a signal only sets a flag
that the run loop reads between steps, so the run ends with a checkpoint of
the step it stopped at; while it starts or closes, a signal says what is kept.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any

from popmeta.learner.checkpoints import list_checkpoints
from popmeta.run_dir import RunDirectory

__all__ = ["RunInterrupted", "StopSignals"]


class RunInterrupted(KeyboardInterrupt):
    """A signal stopped the run while it was starting or closing; the message says what is kept."""


def _note(text: str) -> None:
    # From a signal handler: straight to the descriptor, as a buffered stream
    # may be in the middle of a write; a terminal that hung up takes nothing.
    with contextlib.suppress(OSError):
        os.write(2, text.encode())


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal or ssh session), by phase of the run.

    ``starting`` (until the run's config is written): the start is abandoned
    at once (``KeyboardInterrupt``), as nothing is trained yet. ``training``:
    the loop stops after the current step (a flag read between steps cannot
    be lost in the middle of a blocking Ray or XLA call), and the run ends
    with a checkpoint of that step; a second SIGINT stops at once.
    ``closing`` (the checkpoint is written): the first signal only says so,
    the next stops at once. Each phase stops at once only once, and later
    signals in it are ignored: a user who keeps pressing Ctrl-C would
    otherwise break off the stop's own cleanup and the message that says
    what was kept, or kill the process by SIGINT after the command chose its
    exit status. SIGHUP is left alone where it is ignored (``nohup``). Python
    runs signal handlers in the main thread only, so elsewhere (a run started
    from a worker thread) the process keeps its handlers.

    A handler that raises while the main thread runs a garbage-collector
    callback (JAX registers one) has its ``KeyboardInterrupt`` discarded by
    Python as unraisable: such an interrupt is not printed, and the start
    stops at :meth:`begin_training` instead.

    Leaving the block restores the previous handlers, except where
    :attr:`process_ends_with_run` is set (the ``popmeta`` command sets it):
    there, once a signal has stopped the run, the three signals stay ignored,
    as an interrupt raised after the run's own handling would break off the
    closing message or Ray's exit handler half-way.
    """

    #: The process exits once the run ends (the ``popmeta`` command, not a notebook).
    process_ends_with_run: bool = False

    def __init__(self) -> None:
        self.received: str | None = None
        self.phase = "starting"
        self.trained = False
        self._noted = False
        self._stopped_in: str | None = None  # the phase a signal stopped at once
        self._previous: dict[int, Any] = {}
        self._previous_unraisable_hook: Any = None

    def _handle(self, signum: int, frame: Any) -> None:
        del frame
        name = signal.Signals(signum).name
        if self.phase == self._stopped_in:
            return
        if self.phase == "starting":
            self.received = name
            self._stop_at_once()
        if self.phase == "training":
            if self.received is not None and signum == signal.SIGINT:
                self._stop_at_once()
            self.received = name
            return
        if self.phase == "closing" and self._noted:
            self._stop_at_once()
        if not self._noted:
            self._noted = True
            waiting = "saving its checkpoint first" if self.phase == "saving" else "closing the run"
            _note(f"\npopmeta: {name}: {waiting}; once more after that stops at once\n")

    def _stop_at_once(self) -> None:
        self._stopped_in = self.phase
        if self.phase == "starting":
            self.phase = "closing"  # what the start built is now being taken down
        raise KeyboardInterrupt

    def _unraisable(self, unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and self.received is not None:
            return  # this handler's own interrupt, raised where Python cannot raise it
        self._previous_unraisable_hook(unraisable)

    def begin_training(self) -> None:
        """Enters the training phase, unless a signal stopped the start (then raises)."""
        if self.received is not None:
            raise KeyboardInterrupt
        self.phase, self.trained = "training", True

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                if signum == signal.SIGHUP and signal.getsignal(signum) is signal.SIG_IGN:
                    continue
                self._previous[signum] = signal.signal(signum, self._handle)
            self._previous_unraisable_hook = sys.unraisablehook
            sys.unraisablehook = self._unraisable
        return self

    def __exit__(self, *exc: object) -> None:
        stopped = self.process_ends_with_run and self.received is not None
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_IGN if stopped else handler)
        if self._previous_unraisable_hook is not None:
            sys.unraisablehook = self._previous_unraisable_hook

    def interrupted_message(self, run: RunDirectory) -> str:
        """What a signal that stopped the run outside the loop leaves behind."""
        name = self.received or "SIGINT"
        if not self.trained:
            return (
                f"{name} while the run was starting: nothing was trained and nothing of "
                "this start was kept; rerun the same command to start again"
            )
        checkpoints = list_checkpoints(run.checkpoints)
        kept = (
            f"its newest checkpoint is {run.location_of(checkpoints[-1])}"
            if checkpoints
            else "it has no checkpoint yet"
        )
        return (
            f"{name} while the run was closing: {kept}; rerun the same command to resume. "
            "Ray's processes, if this run started them, stop with this process"
        )
