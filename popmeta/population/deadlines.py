"""How long a busy actor may stay silent: deadlines sized from the calls the population measured.

A fixed timeout is either too short for a slow task or far too long to notice
a hung actor on a fast one, so the deadline follows the population's own
recent reply intervals. Plain numbers in, seconds out: nothing here knows of
Ray or of what the actors compute.
"""

from __future__ import annotations

import collections

__all__ = ["MIN_TIMED_CALLS", "TIMED_CALLS", "CallDeadlines"]

#: Reply intervals the call deadlines are sized from: the population's last ones.
TIMED_CALLS = 64
#: Timed replies before deadlines follow them; until then they follow the actors' starts.
MIN_TIMED_CALLS = 8


class CallDeadlines:
    """The measured reply intervals and actor starts, and the deadline they give.

    Args:
      call_timeout_s: the longest wait: for an actor's start, and for any call.
      min_call_timeout_s: the shortest wait for a call once calls are timed.
      call_timeout_factor: a call may take this many times the slowest measured one.
    """

    def __init__(
        self, call_timeout_s: float, min_call_timeout_s: float, call_timeout_factor: float
    ):
        self.call_timeout_s = call_timeout_s
        self.min_call_timeout_s = min_call_timeout_s
        self.call_timeout_factor = call_timeout_factor
        self._call_seconds: collections.deque[float] = collections.deque(maxlen=TIMED_CALLS)
        self._slowest_start: float | None = None

    def started(self, seconds: float) -> None:
        """An actor took ``seconds`` from its spawn to ready."""
        self._slowest_start = max(seconds, self._slowest_start or 0.0)

    def replied(self, seconds: float) -> None:
        """A reply came ``seconds`` after its call's start (or its actor's previous reply)."""
        self._call_seconds.append(seconds)

    @property
    def slowest_call(self) -> float:
        """The slowest of the timed reply intervals (0 before the first)."""
        return max(self._call_seconds, default=0.0)

    def timeout_for(self, actor_is_ready: bool = True) -> float:
        """How long a busy actor may stay silent before it is lost.

        ``call_timeout_factor`` times the slowest of the last
        :data:`TIMED_CALLS` reply intervals, at least ``min_call_timeout_s``
        and at most ``call_timeout_s``. Before :data:`MIN_TIMED_CALLS`
        replies the slowest actor start (spawn to ready, which ran one
        estimate and compiled it) stands in for the calls. For an actor that
        is still starting, ``call_timeout_s``.
        """
        if len(self._call_seconds) >= MIN_TIMED_CALLS:
            slowest = self.slowest_call
        elif self._slowest_start is not None:
            slowest = self._slowest_start
        else:
            return self.call_timeout_s
        if not actor_is_ready:
            return self.call_timeout_s
        sized = max(self.min_call_timeout_s, self.call_timeout_factor * slowest)
        return min(self.call_timeout_s, sized)
