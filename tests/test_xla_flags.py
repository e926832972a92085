"""popmeta's XLA flags: small loops become one CPU kernel, and the user's settings win.

Every case runs in a fresh interpreter: XLA reads ``XLA_FLAGS`` once, when JAX
starts, and this test process started long ago.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from popmeta.xla_flags import (
    CPU_FLAGS,
    HOST_DEVICE_COUNT_FLAG,
    OPT_OUT_VARIABLE,
    use_host_devices,
    use_xla_cpu_flags,
    with_host_devices,
    without_host_devices,
)

# A loop with a matrix product whose buffers (several KiB) are over XLA's
# default 1 KiB limit for compiling a loop as one kernel.
_LOOP = """
import json, os, jax, jax.numpy as jnp
{before}
def unroll(x, w):
    return jax.lax.scan(lambda x, _: (jnp.tanh(x @ w), None), x, None, length=10)[0]

x = jnp.linspace(-1.0, 1.0, 16 * 32).reshape(16, 32)
w = jnp.linspace(-0.3, 0.3, 32 * 32).reshape(32, 32)
compiled = jax.jit(unroll).lower(x, w).compile()
print(json.dumps({{
    "one_kernel": "xla_cpu_small_call" in compiled.as_text(),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "applied": applied,
    "out": compiled(x, w).tolist(),
}}))
"""


def _python(code: str, **env: str) -> dict:
    """The JSON last printed by ``code`` in a fresh interpreter, XLA flags only from ``env``.

    This process's ``XLA_FLAGS`` already holds popmeta's flags (its own
    ``import popmeta`` put them there), so the child does not inherit it.
    """
    clean = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", OPT_OUT_VARIABLE)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=clean | env
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run(before: str, **env: str) -> dict:
    return _python(_LOOP.format(before=before), **env)


@pytest.fixture(scope="module")
def without_popmeta() -> dict:
    return _run("applied = None")


def test_import_popmeta_compiles_a_small_loop_as_one_kernel(without_popmeta):
    with_popmeta = _run("import popmeta\napplied = popmeta.use_xla_cpu_flags()")
    assert not without_popmeta["one_kernel"]
    assert with_popmeta["one_kernel"]
    assert with_popmeta["applied"]
    for name, value in CPU_FLAGS.items():
        assert f"{name}={value}" in with_popmeta["xla_flags"].split()
    np.testing.assert_allclose(with_popmeta["out"], without_popmeta["out"], rtol=1e-5, atol=1e-6)


def test_a_flag_the_user_set_keeps_its_value():
    users = "--xla_backend_extra_options=xla_cpu_small_while_loop_byte_threshold=0"
    out = _run(
        "import popmeta\napplied = True", XLA_FLAGS=f"--xla_cpu_enable_fast_math=false {users}"
    )
    flags = out["xla_flags"].split()
    assert flags[:2] == ["--xla_cpu_enable_fast_math=false", users]
    assert [f for f in flags if f.startswith("--xla_backend_extra_options")] == [users]
    assert "--xla_cpu_experimental_ynn_fusion_type=-individual_dot" in flags
    assert not out["one_kernel"]  # the user's threshold of 0 bytes stands


def test_opting_out_leaves_xla_flags_alone():
    out = _run(
        "import popmeta\napplied = popmeta.use_xla_cpu_flags()",
        XLA_FLAGS="--xla_cpu_enable_fast_math=false",
        **{OPT_OUT_VARIABLE: "0"},
    )
    assert out["xla_flags"] == "--xla_cpu_enable_fast_math=false"
    assert not out["applied"]
    assert not out["one_kernel"]


def test_after_jax_started_the_environment_is_left_alone():
    out = _run(
        "jnp.zeros(1).block_until_ready()\nimport popmeta\napplied = popmeta.use_xla_cpu_flags()"
    )
    assert out["xla_flags"] == ""
    assert not out["applied"]
    assert not out["one_kernel"]


def test_in_this_started_process_nothing_changes():
    jax.numpy.zeros(1).block_until_ready()
    environ = {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}
    assert not use_xla_cpu_flags(environ)
    assert environ == {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}


_ESTIMATE = """
import json, jax, numpy as np, popmeta as pm
step = pm.VectorizedLOptTruncatedStep(
    pm.FixedDimQuadraticFamilyData(6), pm.MLPLOpt(), pm.ConstantTruncationSchedule(12),
    num_tasks=4, random_initial_iteration_offset=12,
)
estimator = pm.TruncatedPES(step, trunc_length=4, std=0.01)
lopt = step.learned_opt
theta = lopt.init(jax.random.key(0))
worker = estimator.init_worker_state(theta, jax.random.key(1))
estimate = jax.jit(estimator.compute_gradient_estimate)
grads = []
for i in range(3):
    out, _ = estimate(theta, worker, jax.random.key(10 + i))
    worker = out.state
    grads.append(np.concatenate([np.ravel(g) for g in jax.tree_util.tree_leaves(out.grad)]))
text = estimate.lower(theta, worker, jax.random.key(0)).compile().as_text()
print(json.dumps({"one_kernel": "xla_cpu_small_call" in text, "grads": np.stack(grads).tolist()}))
"""


def test_a_pes_estimate_is_the_same_as_one_kernel():
    fused, plain = _python(_ESTIMATE), _python(_ESTIMATE, **{OPT_OUT_VARIABLE: "0"})
    assert fused["one_kernel"] and not plain["one_kernel"]
    fused_grads, plain_grads = np.asarray(fused["grads"]), np.asarray(plain["grads"])
    assert np.all(np.isfinite(fused_grads)) and np.abs(plain_grads).max() > 0
    np.testing.assert_allclose(
        fused_grads, plain_grads, rtol=1e-4, atol=1e-6 * np.abs(plain_grads).max()
    )


def test_host_devices_are_added_to_the_flags_and_a_conflicting_count_is_named():
    assert with_host_devices("", 2) == f"{HOST_DEVICE_COUNT_FLAG}=2"
    assert with_host_devices("--xla_cpu_enable_fast_math=false", 3).split() == [
        "--xla_cpu_enable_fast_math=false",
        f"{HOST_DEVICE_COUNT_FLAG}=3",
    ]
    already = f"--xla_cpu_enable_fast_math=false {HOST_DEVICE_COUNT_FLAG}=2"
    assert with_host_devices(already, 2) == already
    with pytest.raises(ValueError, match=rf"XLA_FLAGS sets {HOST_DEVICE_COUNT_FLAG}=2, and "):
        with_host_devices(already, 4)
    with pytest.raises(ValueError, match="not a whole number of devices"):
        with_host_devices(f"{HOST_DEVICE_COUNT_FLAG}=two", 2)
    # The driver's own count, dropped before the actors' is added.
    assert without_host_devices(already) == "--xla_cpu_enable_fast_math=false"
    assert with_host_devices(without_host_devices(already), 4).split()[-1].endswith("=4")


def test_the_driver_starts_its_host_devices_before_jax_and_refuses_after():
    out = _python(
        "import json, jax, popmeta\n"
        "popmeta.xla_flags.use_host_devices(2)\n"
        "print(json.dumps({'devices': len(jax.devices('cpu'))}))"
    )
    assert out["devices"] == 2
    # This process started JAX long ago, with one CPU device.
    jax.numpy.zeros(1).block_until_ready()
    use_host_devices(len(jax.devices("cpu")))
    with pytest.raises(ValueError, match=r"population\.cpu_devices is 3, but JAX already started"):
        use_host_devices(3)
