"""XLA flags for CPU: small inner loops as one compiled kernel, and the device count.

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

:func:`with_host_devices` and :func:`use_host_devices` set how many CPU
devices JAX starts with (``population.cpu_devices``), over which a worker
splits its tasks: on a CPU, XLA runs the operations of one device's program
one after another and spreads only some of them over the cores, so a
compute-bound estimate runs faster as one program per core (docs/performance.md,
"Tasks split over CPU devices").
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from types import MappingProxyType

__all__ = [
    "CPU_FLAGS",
    "HOST_DEVICE_COUNT_FLAG",
    "SMALL_LOOP_BYTES",
    "use_host_devices",
    "use_xla_cpu_flags",
    "with_host_devices",
    "without_host_devices",
]

# About three times the bytes of the largest loop measured to gain from it (a
# PES truncation of MLPLOpt on 8 ten-dimensional quadratics: 0.2-0.4 MB); the
# image-MLP truncation of the bench reads far more and keeps its threaded dots.
SMALL_LOOP_BYTES = 1 << 20

OPT_OUT_VARIABLE = "POPMETA_XLA_FLAGS"

#: The XLA flag that sets how many CPU devices JAX starts with.
HOST_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


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


def _host_device_count(xla_flags: str) -> int | None:
    """The CPU device count ``xla_flags`` (an ``XLA_FLAGS`` value) sets, or None if it sets none.

    Raises:
      ValueError: if it sets one that is not a whole number.
    """
    count = None
    for flag in xla_flags.split():
        name, _, value = flag.partition("=")
        if name == HOST_DEVICE_COUNT_FLAG:
            try:
                count = int(value)
            except ValueError:
                raise ValueError(f"XLA_FLAGS: {flag!r} is not a whole number of devices") from None
    return count


def with_host_devices(xla_flags: str, count: int) -> str:
    """``xla_flags`` (an ``XLA_FLAGS`` value) with JAX starting ``count`` CPU devices.

    Unchanged when it already sets ``count``.

    Raises:
      ValueError: if it already sets another count.
    """
    current = _host_device_count(xla_flags)
    if current == count:
        return xla_flags
    if current is not None:
        raise ValueError(
            f"XLA_FLAGS sets {HOST_DEVICE_COUNT_FLAG}={current}, and population.cpu_devices is "
            f"{count}; remove the flag or set population.cpu_devices: {current}"
        )
    return " ".join(filter(None, [xla_flags, f"{HOST_DEVICE_COUNT_FLAG}={count}"]))


def without_host_devices(xla_flags: str) -> str:
    """``xla_flags`` (an ``XLA_FLAGS`` value) without a CPU device count, every other flag kept."""
    kept = [f for f in xla_flags.split() if f.partition("=")[0] != HOST_DEVICE_COUNT_FLAG]
    return " ".join(kept)


def use_host_devices(count: int) -> None:
    """Makes JAX start this process with ``count`` CPU devices, or checks that it did.

    Raises:
      ValueError: if ``XLA_FLAGS`` sets another count, or if JAX already
        started in this process with another number of CPU devices (it reads
        ``XLA_FLAGS`` once, when it starts).
    """
    if not _backends_started():
        os.environ["XLA_FLAGS"] = with_host_devices(os.environ.get("XLA_FLAGS", ""), count)
        return
    import jax

    started = len(jax.devices("cpu"))
    if started != count:
        raise ValueError(
            f"population.cpu_devices is {count}, but JAX already started in this process with "
            f"{started} CPU device(s), and sets their number only when it starts: run "
            f"`popmeta train`, or set XLA_FLAGS={HOST_DEVICE_COUNT_FLAG}={count} before "
            "starting Python"
        )
