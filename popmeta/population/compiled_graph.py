"""One Ray compiled graph that calls the same method on a set of actors.

With ``population.compiled_graph`` a sync round reaches its actors through a
Ray compiled graph (shared-memory channels) instead of one actor call each,
which saves Ray's per-call overhead (docs/ray.md). :class:`CompiledGraph`
builds the graph over a set of actor handles, rebuilds it when the set
changes, runs it against a deadline and tears it down. It decides nothing
about the actors: after a failure the supervisor
(:mod:`popmeta.population.supervisor`) says who is replaced.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import ray
from ray.dag import InputNode, MultiOutputNode
from ray.exceptions import RayActorError, RayChannelError, RayChannelTimeoutError

__all__ = ["CompiledGraph", "GraphFailed"]


class GraphFailed(RuntimeError):
    """An execution of the graph failed; every reply it had not given is lost.

    The graph's error does not say which member failed: every reply of the
    execution raises it.

    Attributes:
      timed_out: no reply came before the deadline (a member hung, or died
        unnoticed); otherwise a member died or a channel broke.
    """

    def __init__(self, cause: BaseException):
        self.timed_out = isinstance(cause, RayChannelTimeoutError)
        super().__init__(repr(cause))


@contextlib.contextmanager
def _failures_as_graph_failed() -> Iterator[None]:
    try:
        yield
    except (RayActorError, RayChannelError) as err:
        # RayTaskError (the method raised) is neither, and propagates.
        raise GraphFailed(err) from err


class CompiledGraph:
    """A compiled graph that calls ``method`` on each member with the execution's arguments.

    Arguments pass by value through the graph's channels (an ObjectRef would
    reach the method unresolved).

    Args:
      method: the actor method the graph calls.
    """

    def __init__(self, method: str):
        self.method = method
        self._graph: Any = None
        self._members: tuple[Hashable, ...] = ()

    def build(self, members: Sequence[tuple[Hashable, Any]], num_args: int) -> None:
        """Compiles the graph over ``members``, ``(key, actor handle)`` each, unless it has them.

        Raises:
          GraphFailed: a member is gone.
        """
        keys = tuple(key for key, _ in members)
        if keys == self._members:
            return
        self.teardown()
        with _failures_as_graph_failed():
            with InputNode() as inputs:
                args = [inputs[i] for i in range(num_args)]
                node = MultiOutputNode(
                    [getattr(handle, self.method).bind(*args) for _, handle in members]
                )
            self._graph = node.experimental_compile()
        self._members = keys

    def execute(self, args: Sequence[Any], deadline: float) -> Iterator[Any]:
        """Runs the graph once; yields each member's reply, in member order, as it comes.

        Each reply is a copy that owns its memory: a numpy array read from a
        channel is a view of the channel's buffer, and a view that outlived
        the graph's teardown crashed the driver (docs/ray.md).

        Raises:
          GraphFailed: a member died, or ``deadline`` (``time.monotonic()``) passed.
        """
        with _failures_as_graph_failed():
            refs = self._graph.execute(*args)
            for ref in refs:
                value = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                yield copy.deepcopy(value)

    def teardown(self) -> None:
        """Shuts the graph down (idempotent); it waits for every member's graph thread."""
        graph, self._graph, self._members = self._graph, None, ()
        if graph is not None:
            # Failing means the graph is already shut down: nothing left to release.
            with contextlib.suppress(Exception):
                graph.teardown()
