"""bench/profile_estimate.py: XLA operations attributed to the parts popmeta's core names."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from profile_estimate import OTHER, instruction_parts, part_of  # noqa: E402


def test_a_scope_is_found_in_a_path_and_inside_a_vmap():
    assert part_of("jit(f)/while/body/vmap(vmap(task_loss_and_grad))/jvp()/dot") == (
        "task_loss_and_grad"
    )
    # The innermost part wins: the MLP runs inside the learned optimizer's update.
    assert part_of("jit(f)/learned_optimizer_update/per_parameter_mlp/dot") == "per_parameter_mlp"
    assert part_of("jit(f)/while/body/add") == OTHER
    assert part_of("jit(f)/not_per_parameter_mlp_at_all/add") == OTHER


def test_compiled_instructions_map_to_the_scope_they_were_traced_under():
    def f(w, x):
        with jax.named_scope("per_parameter_mlp"):
            y = jnp.tanh(jax.vmap(lambda a, b: a @ b)(w, x))
        return jnp.sum(y * 2.0)

    w, x = jnp.ones((4, 16, 16)), jnp.ones((4, 16, 16))
    parts = instruction_parts(jax.jit(f).lower(w, x).compile().as_text())
    dots = [part for name, (part, _) in parts.items() if name.startswith("dot")]
    assert dots and set(dots) == {"per_parameter_mlp"}


@pytest.mark.timeout(300)
def test_the_profile_of_c_names_the_learned_optimizer_and_the_task():
    proc = subprocess.run(
        [sys.executable, "bench/profile_estimate.py", "--config", "c", "--estimates", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shares = dict(
        re.findall(r"^(per_parameter_mlp|task_loss_and_grad) +[\d.]+ +(\d+)%$", proc.stdout, re.M)
    )
    assert set(shares) == {"per_parameter_mlp", "task_loss_and_grad"}, proc.stdout
    assert all(int(s) > 0 for s in shares.values())
    assert re.search(r"inner-steps/s", proc.stdout)
