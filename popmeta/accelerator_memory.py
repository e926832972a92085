"""How a run's processes share an accelerator chip's memory.

JAX's GPU backend takes 75% of a chip's memory when its first computation
runs (``XLA_PYTHON_CLIENT_PREALLOCATE``, JAX's "GPU memory allocation"
page). A run's processes share chips: the learner, in the ``popmeta``
process, computes on the head node's first GPU beside any actor placed
there, and actors declaring ``population.num_gpus`` below 1 share one chip
among themselves. With JAX's default the second process to start finds a
quarter of the chip left and fails. So the ``popmeta`` command, and every
actor that holds a fraction of a chip, allocate memory as they go instead;
an actor holding whole chips keeps JAX's default. A value the user set
(in the environment, or for the actors in ``population.env``) is kept.
Nothing changes on CPU.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

__all__ = ["PREALLOCATE", "actor_env_vars", "allocate_as_needed"]

#: JAX's switch between preallocating a share of the chip and growing as needed.
PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"


def allocate_as_needed(environ: MutableMapping[str, str] | None = None) -> None:
    """Turns JAX's preallocation off in this process unless the user chose; call before JAX runs."""
    (os.environ if environ is None else environ).setdefault(PREALLOCATE, "false")


def actor_env_vars(num_gpus: float, env: Mapping[str, str]) -> dict[str, str]:
    """The environment variables of an actor declaring ``num_gpus``, ``env`` being the user's.

    An actor holding a fraction of a chip allocates as needed; ``env`` wins.
    """
    shared = {PREALLOCATE: "false"} if 0 < num_gpus < 1 else {}
    return shared | dict(env)
