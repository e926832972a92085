"""A user's own task family and learned optimizer, meta-trained on real Ray actors, taken out as optax.

The module lives in a temporary directory that is neither installed nor on
any path when the run starts: ``popmeta train`` finds it beside the config,
and Ray's runtime environment carries it to the two actors. A kind defined in
the driver's own script travels by value instead; a module the actors cannot
import stops the run at once, naming it and the way to ship it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

import popmeta as pm
from popmeta.cli import EX_CONFIG
from popmeta.learner.checkpoints import list_checkpoints
from tests.population import CALL_TIMEOUT_S
from tests.processes import env_with_compilation_cache
from tests.user_kinds import USER_KINDS

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]

RUN = f"""
    name: mine
    task: {{kind: "my_kinds:noisy_targets", dim: 3, noise: 0.1}}
    learned_optimizer: {{kind: "my_kinds:LogLrSGD", initial_lr: 0.05}}
    truncation: {{kind: constant, length: 20}}
    estimator: {{kind: pes, trunc_length: 5, num_tasks: 4, random_initial_iteration_offset: 20}}
    outer_optimizer: {{kind: "optax:adamw", learning_rate: 0.01, weight_decay: 0.0001}}
    population: {{num_actors: 2, call_timeout_s: {CALL_TIMEOUT_S}}}
    train: {{num_steps: 40, checkpoint_every: 20, log_every: 20}}
    eval: {{num_tasks: 2, num_steps: 5, after_training: false}}
"""


def _popmeta(cwd: Path, *args: str, driver: str | None = None) -> subprocess.CompletedProcess:
    command = (
        [sys.executable, "-c", driver, *args]
        if driver
        else [
            sys.executable,
            "-m",
            "popmeta.cli",
            *args,
        ]
    )
    return subprocess.run(
        command,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
        env=env_with_compilation_cache(),
    )


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("user")
    (where / "my_kinds.py").write_text(USER_KINDS)
    (where / "run.yaml").write_text(textwrap.dedent(RUN))
    return where


def test_popmeta_train_meta_trains_a_users_kinds_on_two_actors_and_the_result_is_optax(
    user_dir, tmp_path
):
    # Run from elsewhere: the module is found beside the config, not on any path.
    trained = _popmeta(tmp_path, "train", str(user_dir / "run.yaml"))
    assert trained.returncode == 0, trained.stderr
    assert "2 actor(s) on 1 node(s)" in trained.stdout and "step 40/40" in trained.stderr
    checkpoint = list_checkpoints(tmp_path / "runs" / "mine" / "checkpoints")[-1]
    exported = _popmeta(tmp_path, "export", str(checkpoint), "mine.npz")
    assert exported.returncode == 0, exported.stderr

    # In this process the module is on no path either: the file says where it was.
    assert "my_kinds" not in sys.modules
    tx = pm.load_optimizer(tmp_path / "mine.npz")
    params = {"w": jnp.zeros(5)}
    target = jnp.arange(5.0)

    def loss_fn(p):
        return jnp.mean(jnp.square(p["w"] - target))

    @jax.jit
    def step(p, state):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, state = tx.update(grads, state, p, value=loss)
        return optax.apply_updates(p, updates), state, loss

    state = tx.init(params)
    first = float(loss_fn(params))
    for _ in range(200):
        params, state, _ = step(params, state)
    assert float(loss_fn(params)) < 0.5 * first


REGISTERED_IN_SCRIPT = """
import sys
import jax.numpy as jnp
import popmeta as pm
from popmeta.cli import main


@pm.register_task_family
def shifted(dim: int = 2, shift: float = 1.0) -> pm.TaskFamily:
    return pm.single_task_to_family(Shifted(dim, shift))


class Shifted(pm.Task):
    def __init__(self, dim, shift):
        self.dim, self.shift = dim, shift

    def init(self, key):
        return jnp.zeros(self.dim)

    def loss(self, params, key, data):
        return jnp.sum(jnp.square(params - self.shift))


sys.exit(main(sys.argv[1:]))
"""

SMALL = [
    "--set",
    "learned_optimizer.kind=learnable_sgd",
    "--set",
    "estimator.num_tasks=2",
    "--set",
    "truncation.length=10",
    "--set",
    "estimator.random_initial_iteration_offset=10",
    "--set",
    "train.num_steps=10",
    "--set",
    "eval.after_training=false",
    "--set",
    f"population.call_timeout_s={CALL_TIMEOUT_S}",
]


def test_a_kind_registered_in_the_drivers_script_reaches_the_actors_by_value(tmp_path):
    ran = _popmeta(
        tmp_path,
        "train",
        "--set",
        "task={kind: shifted, shift: 2.0}",
        *SMALL,
        driver=REGISTERED_IN_SCRIPT,
    )
    assert ran.returncode == 0, ran.stderr
    assert "2 actor(s)" in ran.stdout and "step 10/10" in ran.stderr


ON_THE_DRIVERS_PATH_ONLY = """
import sys
sys.path.insert(0, sys.argv.pop(1))  # importable here, and nowhere else
from popmeta.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_actors_that_cannot_import_a_module_stop_the_run_naming_it_and_the_fix(user_dir, tmp_path):
    config = tmp_path / "elsewhere.yaml"  # not beside the module: nothing ships it
    config.write_text((user_dir / "run.yaml").read_text())
    failed = _popmeta(
        tmp_path, str(user_dir), "train", str(config), driver=ON_THE_DRIVERS_PATH_ONLY
    )
    assert failed.returncode == EX_CONFIG, failed.stderr
    assert "Traceback" not in failed.stderr
    (paragraph,) = [line for line in failed.stderr.splitlines() if line.startswith("popmeta: ")]
    assert "ModuleNotFoundError: No module named 'my_kinds'" in paragraph
    assert "The actors cannot import 'my_kinds'" in paragraph
    assert "population.runtime_env (py_modules:" in paragraph
