"""docs/using-a-learned-optimizer.md runs as written and does what its prose says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from popmeta.export import FORMAT
from popmeta.learner.checkpoint_file import read_checkpoint_metadata
from tests.test_tutorial import code_blocks, run_doc_in

DOC = Path(__file__).resolve().parents[1] / "docs" / "using-a-learned-optimizer.md"


@pytest.fixture(scope="module")
def doc(tmp_path_factory) -> dict[str, Any]:
    """The namespace after every python block, run in a fresh directory."""
    cwd = tmp_path_factory.mktemp("doc")
    namespace = run_doc_in(DOC, cwd)
    namespace["cwd"] = cwd
    return namespace


def test_the_page_runs_python_and_shows_the_shell_commands():
    assert {b.language for b in code_blocks(DOC.read_text())} == {"python", "bash"}


def test_the_exported_file_is_self_describing(doc):
    header = read_checkpoint_metadata(doc["cwd"] / "my_optimizer.npz")
    assert header["format"] == FORMAT
    assert header["learned_optimizer"]["kind"] == "mlp_adam"
    assert doc["result"].final_step == 6


def test_the_plain_optax_loop_trains_the_model(doc):
    losses = np.asarray(doc["losses"])
    assert losses.shape == (100,) and np.all(np.isfinite(losses))
    assert losses[-1] < 0.75 * losses[0]


def test_the_composed_transformation_keeps_training(doc):
    assert np.isfinite(float(doc["loss"]))
    assert doc["same"] is not None
