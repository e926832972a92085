"""docs/extending.md runs as written and does what its prose says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from popmeta.config import config_from_dict
from popmeta.registry import LEARNED_OPTIMIZERS, TASK_FAMILIES
from tests.test_tutorial import code_blocks, run_doc_in

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


@pytest.fixture(scope="module")
def doc(tmp_path_factory) -> dict[str, Any]:
    """The namespace after every python block, run in a fresh directory."""
    try:
        yield run_doc_in(DOC, tmp_path_factory.mktemp("extending"))
    finally:
        for registry, name in (
            (TASK_FAMILIES, "noisy_targets"),
            (LEARNED_OPTIMIZERS, "LogLrSGD"),
        ):
            registry._kinds.pop(name, None)
            registry._by_users.discard(name)


def test_the_page_has_python_blocks_and_a_yaml_config_naming_kinds_by_import_path():
    blocks = code_blocks(DOC.read_text())
    assert {b.language for b in blocks} == {"python", "yaml"}
    (yaml_block,) = [b for b in blocks if b.language == "yaml"]
    assert "my_kinds:noisy_targets" in yaml_block.code and "my_kinds:LogLrSGD" in yaml_block.code


def test_the_registered_kinds_have_the_fields_of_their_signatures(doc):
    assert doc["task"].options == {"dim": 3, "noise": 0.1}
    assert doc["type_error"].startswith("task.dim: expected int, got 'three'")
    fields = [f.signature() for f in LEARNED_OPTIMIZERS.resolve("LogLrSGD").fields]
    assert fields == ["initial_lr: float = 0.05"]


def test_the_run_trains_the_users_kinds_from_python(doc):
    result = doc["result"]
    assert result.final_step == 20 and result.checkpoint is not None
    assert 0.0 < doc["trained_lr"] != pytest.approx(0.05, rel=1e-6)
    assert (
        config_from_dict({"task": {"kind": "noisy_targets"}}).task.resolved.build
        is doc["noisy_targets"]
    )
