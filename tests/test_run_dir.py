"""A run directory is one experiment: identity, lock, failed starts, finished runs, divergence."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import subprocess
import sys

import pytest

from popmeta.config import ConfigError, config_to_dict
from popmeta.learner.checkpoints import list_checkpoints
from popmeta.run_dir import RunDirectory, RunDirectoryError
from popmeta.run_identity import config_differences
from popmeta.run_loop import DivergedError, train
from tests.events import read_scalars
from tests.local_run import local_config, no_population

_config = local_config


def _files(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 4-step run; tests copy it before changing it."""
    root = tmp_path_factory.mktemp("runs")
    result = train(_config(root), stream=io.StringIO())
    assert result.final_step == 4 and not result.already_finished
    return root


def _copy(finished, tmp_path):
    shutil.copytree(finished / "ident", tmp_path / "ident")
    return tmp_path


def test_a_different_config_is_refused_naming_the_fields(finished, tmp_path):
    root = _copy(finished, tmp_path)
    before = {p: p.read_bytes() for p in (root / "ident").rglob("*") if p.is_file()}
    changed = _config(root, estimator={"kind": "nres"}, task={"dim": 4})
    with pytest.raises(RunDirectoryError) as info:
        train(changed, no_population, stream=io.StringIO())
    message = str(info.value)
    assert "estimator.kind: 'pes' -> 'nres'" in message and "task.dim: 3 -> 4" in message
    assert "--set name=NEW" in message and "--from-checkpoint" in message
    assert "ckpt_00000004.npz" in message
    # Nothing in the run directory was written.
    after = {p: p.read_bytes() for p in (root / "ident").rglob("*") if p.is_file()}
    assert after == before


def test_safe_fields_may_change_and_the_run_goes_on(finished, tmp_path):
    root = _copy(finished, tmp_path)
    longer = _config(root, train={"num_steps": 6, "log_every": 3}, eval={"num_tasks": 3})
    assert config_differences(_config(root), longer) == []
    result = train(longer, stream=io.StringIO())
    assert result.final_step == 6
    assert "num_steps: 6" in (root / "ident" / "config.yaml").read_text()


def test_a_finished_run_says_so_without_starting_anything(finished, tmp_path):
    root = _copy(finished, tmp_path)
    stream = io.StringIO()
    result = train(_config(root), no_population, stream=stream)
    assert result.already_finished and result.final_step == 4
    assert "already finished: step 4 of train.num_steps=4" in stream.getvalue()


def test_a_second_live_run_is_refused_and_a_stale_lock_is_taken_over(tmp_path):
    config = _config(tmp_path)
    run = RunDirectory(config.run_dir, config.name)
    with run.claim():
        with pytest.raises(RunDirectoryError, match=r"in use by a live run \(pid"):
            train(_config(tmp_path), no_population, stream=io.StringIO())
        # ... and from another process too (flock is per open file, not per process).
        code = (
            "import json, sys\n"
            "from popmeta.config import config_from_dict\n"
            "from popmeta.run_dir import RunDirectory, RunDirectoryError\n"
            "config = config_from_dict(json.loads(sys.argv[1]))\n"
            "run = RunDirectory(config.run_dir, config.name)\n"
            "try:\n    run.claim().__enter__()\nexcept RunDirectoryError as e:\n"
            "    print(e); sys.exit(3)\n"
        )
        as_json = json.dumps(config_to_dict(_config(tmp_path)))
        other = subprocess.run(
            [sys.executable, "-c", code, as_json], capture_output=True, text=True, timeout=60
        )
        assert other.returncode == 3, other.stderr
        assert "in use by a live run" in other.stdout
    # A lock file left behind by a killed run holds no lock: the next run takes it over.
    (tmp_path / "ident" / ".lock").write_text("pid 999999 on gone since long ago\n")
    result = train(_config(tmp_path), stream=io.StringIO())
    assert result.final_step == 4
    assert not (tmp_path / "ident" / ".lock").exists()


def test_a_start_that_fails_leaves_nothing_behind(tmp_path):
    missing = _config(
        tmp_path, task={"kind": "image_mlp_npz", "npz_path": str(tmp_path / "none.npz")}
    )
    with pytest.raises(ConfigError, match=r"task\.npz_path: .*none\.npz"):
        train(missing, no_population, stream=io.StringIO())
    not_npz = tmp_path / "bad.npz"
    not_npz.write_text("not a zip")
    with pytest.raises(ConfigError, match=r"task\.npz_path: .*bad\.npz"):
        train(
            dataclasses.replace(
                missing, task=dataclasses.replace(missing.task, options={"npz_path": str(not_npz)})
            ),
            no_population,
        )
    assert _files(tmp_path) == ["bad.npz"]

    def population_fails(population, worker):
        raise RuntimeError("no actor could start")

    with pytest.raises(RuntimeError, match="no actor could start"):
        train(_config(tmp_path), population_fails, stream=io.StringIO())
    assert _files(tmp_path) == ["bad.npz"]


def test_an_unwritable_run_dir_is_refused_before_anything_starts(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(RunDirectoryError, match=r"run_dir: .*file is a file"):
        train(_config(tmp_path / "file"), no_population, stream=io.StringIO())


def test_from_checkpoint_takes_the_run_over_with_a_new_config(finished, tmp_path):
    root = _copy(finished, tmp_path)
    earlier = root / "ident" / "checkpoints" / "ckpt_00000002.npz"
    changed = _config(root, outer_optimizer={"learning_rate": 0.001})
    stream = io.StringIO()
    result = train(changed, stream=stream, from_checkpoint=earlier)
    assert "resumed from" in stream.getvalue() and "at step 2" in stream.getvalue()
    assert result.final_step == 4
    assert "learning_rate: 0.001" in (root / "ident" / "config.yaml").read_text()
    (aside,) = root.glob("ident/checkpoints-after-2-*")
    assert [p.name for p in aside.iterdir()] == ["ckpt_00000004.npz"]
    # A checkpoint of another learned optimizer does not fit: a clear error.
    other = _config(root, learned_optimizer={"kind": "learnable_sgdm"})
    with pytest.raises(
        RunDirectoryError, match=r"does not fit learned_optimizer\.kind='learnable_sgdm'"
    ):
        train(other, no_population, stream=io.StringIO(), from_checkpoint=earlier)


def test_divergence_is_counted_and_says_how_to_go_on(tmp_path):
    blown = _config(
        tmp_path,
        outer_optimizer={"learning_rate": 1e6, "clip_grad_norm": None},
        train={"num_steps": 200, "checkpoint_every": 1, "keep_checkpoints": 3},
    )
    with pytest.raises(DivergedError) as info:
        train(blown, stream=io.StringIO())
    message = str(info.value)
    assert "rejected_nonfinite" in message and "--from-checkpoint" in message
    # The newest checkpoint is one written before the failing rounds, and it is named.
    checkpoints = list_checkpoints(tmp_path / "ident" / "checkpoints")
    assert f"--from-checkpoint {checkpoints[-1]}" in message
    rejected = read_scalars(tmp_path / "ident")["rejected_nonfinite"]
    assert rejected[-1][1] >= 20
