"""The unrolled Threefry lowering: JAX's random bits exactly, and no loop on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.random import threefry_2x32

import popmeta as pm
from popmeta.core.threefry import threefry2x32_hash

# Known-answer vectors of Threefry-2x32-20 from the Random123 distribution
# (kat_vectors): (key, counter) -> output.
KNOWN_ANSWERS = [
    ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
]

# Draws whose bits the test compares with a process that never imported popmeta.
_DRAWS = """
import json, jax, numpy as np
key = jax.random.key(1234)
keys = jax.random.split(key, 3)
out = {
    "normal": jax.jit(lambda k: jax.random.normal(k, (4, 33)))(key),
    "uniform": jax.random.uniform(jax.random.fold_in(key, 9), (17,)),
    "randint": jax.random.randint(keys[1], (50,), 0, 1000),
    "split": jax.random.key_data(jax.random.split(keys[2], 5)),
    "bits": jax.random.bits(keys[0], (7, 3)),
    "vmapped": jax.vmap(lambda k: jax.random.normal(k, (3,)))(keys),
}
print(json.dumps({k: np.asarray(v).view(np.uint32).tolist() for k, v in out.items()}))
"""


@pytest.mark.parametrize(("key", "count", "expected"), KNOWN_ANSWERS)
def test_hash_matches_the_threefry_known_answers(key, count, expected):
    words = [jnp.uint32(w) for w in (*key, *count)]
    assert tuple(int(w) for w in threefry2x32_hash(*words)) == expected
    # ... and JAX's primitive, lowered through it, gives the same.
    out = jax.jit(threefry_2x32)(jnp.asarray(key, jnp.uint32), jnp.asarray(count, jnp.uint32))
    assert tuple(int(w) for w in out) == expected


def test_random_draws_are_bit_identical_to_jax_without_popmeta():
    # Without this process's XLA_FLAGS, which its ``import popmeta`` extended.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}

    def draws(code: str) -> dict:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
        )
        return json.loads(proc.stdout.strip().splitlines()[-1])

    plain = draws(_DRAWS)
    with_popmeta = draws("import popmeta\n" + _DRAWS)
    assert with_popmeta == plain
    # The same draws in this process (popmeta imported) agree too.
    assert (
        np.asarray(jax.random.normal(jax.random.key(1234), (4, 33))).view(np.uint32).tolist()
        == plain["normal"]
    )


def test_a_random_draw_compiles_without_a_loop_on_cpu():
    def compiled_draw() -> str:
        draw = jax.jit(lambda k: jax.random.normal(k, (8, 8)))
        return draw.lower(jax.random.key(0)).compile().as_text()

    # ``import popmeta`` alone did it; calling it again changes nothing.
    assert " while(" not in compiled_draw()
    pm.use_unrolled_threefry_on_cpu()
    assert " while(" not in compiled_draw()
