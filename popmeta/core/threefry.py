"""JAX's Threefry-2x32 hash with its rounds unrolled on CPU: the same bits, fewer XLA ops.

Every ``jax.random`` draw of the default (threefry) key is one or more calls of
the Threefry-2x32 hash (Salmon et al., "Parallel random numbers: as easy as
1, 2, 3", SC 2011; 20 rounds). On GPU and TPU, JAX emits its 20 rounds
unrolled; on CPU it emits them as a 5-iteration ``while`` loop, which XLA's
CPU runtime runs as many separate small operations per iteration. In an ES
estimate most draws are small, so on CPU this overhead is a large part of a
truncation (measured in docs/performance.md, "Why it is fast").

:func:`use_unrolled_threefry_on_cpu` makes JAX emit the unrolled hash on CPU
too. The hash is a pure function of its inputs, so every random number is
bit-for-bit what JAX gives without it (a test checks this against JAX in a
process where it was never called); only the compiled program changes.
``import popmeta`` calls it.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.extend.random import threefry2x32_p
from jax.interpreters import mlir

__all__ = ["threefry2x32_hash", "use_unrolled_threefry_on_cpu"]

# The Threefry-2x32 rotation constants: rounds 4i..4i+3 rotate by the first
# row when i is even and by the second when i is odd.
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
# The key-schedule parity constant of Threefish/Threefry.
_PARITY = np.uint32(0x1BD11BDA)


def _rotate_left(x: jax.Array, bits: int) -> jax.Array:
    # On uint32, ``>>`` is a logical shift.
    return (x << np.uint32(bits)) | (x >> np.uint32(32 - bits))


def threefry2x32_hash(
    key1: jax.Array, key2: jax.Array, count1: jax.Array, count2: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32 with 20 rounds, unrolled: the bits of ``jax.extend.random.threefry_2x32``.

    Args:
      key1, key2: The two uint32 words of the key, broadcastable to the counts.
      count1, count2: The two uint32 words of the counter, one element per output.

    Returns:
      The two uint32 output words.
    """
    schedule = (key1, key2, key1 ^ key2 ^ _PARITY)
    x1, x2 = count1 + schedule[0], count2 + schedule[1]
    for injection in range(1, 6):
        for bits in _ROTATIONS[(injection - 1) % 2]:
            x1 = x1 + x2
            x2 = _rotate_left(x2, bits) ^ x1
        x1 = x1 + schedule[injection % 3]
        x2 = x2 + schedule[(injection + 1) % 3] + np.uint32(injection)
    return x1, x2


def use_unrolled_threefry_on_cpu() -> None:
    """Makes JAX lower ``threefry2x32`` on CPU to :func:`threefry2x32_hash`, unrolled.

    Affects every computation compiled afterwards in this process (popmeta's
    and any other), never the numbers it computes. Calling it again is
    harmless. What it saves is measured in docs/performance.md.
    """
    mlir.register_lowering(
        threefry2x32_p,
        mlir.lower_fun(threefry2x32_hash, multiple_results=True),
        platform="cpu",
    )
