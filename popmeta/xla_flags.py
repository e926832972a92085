"""XLA flags that let small inner loops run as one compiled CPU kernel.

XLA's CPU runtime runs a ``lax.scan`` as a ``while`` thunk that launches its
body's operations one by one every iteration, so an ES truncation on a small
inner problem is mostly launches. XLA can compile a whole ``while`` loop into
one function, but only one that touches fewer bytes than
``xla_cpu_small_while_loop_byte_threshold`` (1 KiB by default) and holds no
dot handed to YNNPACK. :func:`use_xla_cpu_flags` raises the threshold to
:data:`SMALL_LOOP_BYTES` and gives individual dots back to XLA's own
emitters. Only how XLA compiles changes, not what is computed; values may
differ in the last bits. ``import popmeta`` calls it; the flags apply only if
nothing has run a JAX computation before, reach Ray's actors, never override
a flag the user set in ``XLA_FLAGS``, and ``POPMETA_XLA_FLAGS=0`` turns them
off. Measurements: docs/performance.md, "Why it is fast".
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from types import MappingProxyType

__all__ = ["CPU_FLAGS", "SMALL_LOOP_BYTES", "use_xla_cpu_flags"]

# About three times the bytes of the largest loop measured to gain from it (a
# PES truncation of MLPLOpt on 8 ten-dimensional quadratics: 0.2-0.4 MB); the
# image-MLP truncation of the bench reads far more and keeps its threaded dots.
SMALL_LOOP_BYTES = 1 << 20

OPT_OUT_VARIABLE = "POPMETA_XLA_FLAGS"


#: The flags, by name, with their values.
CPU_FLAGS: Mapping[str, str] = MappingProxyType(
    {
        "--xla_backend_extra_options": (
            f"xla_cpu_small_while_loop_byte_threshold={SMALL_LOOP_BYTES}"
        ),
        "--xla_cpu_experimental_ynn_fusion_type": "-individual_dot",
    }
)


def _backends_started() -> bool:
    # JAX offers no public query; without this one, assume they started (and
    # leave the environment alone), which is always safe.
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return True


def use_xla_cpu_flags(environ: MutableMapping[str, str] | None = None) -> bool:
    """Adds popmeta's CPU flags to ``XLA_FLAGS`` unless JAX already started.

    A flag already named in ``XLA_FLAGS`` keeps the user's value. Idempotent.

    Args:
      environ: The environment to change; ``os.environ`` by default.

    Returns:
      Whether JAX has yet to read ``XLA_FLAGS`` (so that what it now holds,
      popmeta's flags or the user's values for them, applies in this process).
    """
    environ = os.environ if environ is None else environ
    if environ.get(OPT_OUT_VARIABLE, "1") == "0" or _backends_started():
        return False
    current = environ.get("XLA_FLAGS", "").split()
    named = {flag.split("=", 1)[0] for flag in current}
    added = [f"{name}={value}" for name, value in CPU_FLAGS.items() if name not in named]
    if added:
        environ["XLA_FLAGS"] = " ".join(current + added)
    return True
