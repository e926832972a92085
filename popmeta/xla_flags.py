"""XLA flags that let small inner loops run as one compiled CPU kernel.

XLA's CPU runtime runs a compiled program as a sequence of "thunks", one per
fused operation, and a ``lax.scan`` as a ``while`` thunk that runs its body's
thunks once per iteration. An ES truncation on a small inner problem is
then mostly launches: for a PES estimate of MLPLOpt on eight ten-dimensional
quadratics (16 members, 10 steps, about 1 ms), a profile counted about 1,070
events on XLA's threads (operations and their end markers; 82 copies of the
loop state among them), most on arrays of a few hundred floats. XLA can instead compile a whole ``while`` loop into
one function ("small call", ``SmallWhileLoopHoistingPass``), but only when the
loop touches fewer bytes than ``xla_cpu_small_while_loop_byte_threshold``
(default 1 KiB) and holds no library call: a dot that XLA hands to YNNPACK
(its default for individual dots in jaxlib 0.10) keeps the loop out.

:func:`use_xla_cpu_flags` raises the threshold to :data:`SMALL_LOOP_BYTES`
and gives individual dots back to XLA's own emitters, so a truncation on a
small problem runs as one kernel. On a 2-core bench host, side by side with
the commit before (``bench/estimators.py --compare-with``), the estimators on
the 10-dimensional quadratic ran 1.10x (PES, LearnableSGDM), 1.25x (PES,
MLPLOpt) and 1.36x (FullES) the inner steps per second; the image-MLP
configuration, whose loop reads more than a mebibyte, kept its loop and ran
as fast. Only how XLA compiles changes, not what is computed; values may differ in the
last bits where XLA fuses operations differently.

``import popmeta`` calls it. XLA reads ``XLA_FLAGS`` once, when JAX starts
its backends, so the flags apply only if nothing has run a JAX computation
before ``import popmeta``; Ray actors import popmeta before they compute, so
they get them too. A flag the user already set in ``XLA_FLAGS`` is left as
it is, and ``POPMETA_XLA_FLAGS=0`` turns all of this off.
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
