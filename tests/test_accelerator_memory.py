"""Which processes of a run turn JAX's GPU preallocation off (popmeta.accelerator_memory).

tests/population/test_cluster.py checks that actors sharing a declared GPU start so.
"""

from __future__ import annotations

import pytest

from popmeta.accelerator_memory import PREALLOCATE, actor_env_vars, allocate_as_needed


@pytest.mark.parametrize(
    ("num_gpus", "expected"), [(0, None), (0.25, "false"), (0.5, "false"), (1, None), (2, None)]
)
def test_only_actors_holding_a_fraction_of_a_chip_allocate_as_needed(num_gpus, expected):
    assert actor_env_vars(num_gpus, {}).get(PREALLOCATE) == expected


def test_the_users_actor_environment_wins_and_is_kept():
    env = {PREALLOCATE: "true", "XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert actor_env_vars(0.5, env) == env
    assert actor_env_vars(0, {"A": "1"}) == {"A": "1"}


def test_the_command_allocates_as_needed_unless_the_user_chose():
    environ: dict[str, str] = {}
    allocate_as_needed(environ)
    assert environ == {PREALLOCATE: "false"}
    environ = {PREALLOCATE: "true"}
    allocate_as_needed(environ)
    assert environ == {PREALLOCATE: "true"}
