"""Remote run directories against a real S3-compatible server (moto's, on 127.0.0.1).

The server is moto in server mode: a real HTTP endpoint that s3fs talks to
as it would to AWS (found through ``AWS_ENDPOINT_URL``, as a user's would be);
no client is mocked. The tests run ``popmeta train`` and ``popmeta eval`` on
``run_dir: s3://...`` and read what lands in the bucket back with boto3.
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
import yaml
from moto.server import ThreadedMotoServer

from popmeta.config import config_to_dict
from popmeta.evaluate import load_theta
from popmeta.run_dir import RunDirectoryError
from popmeta.run_loop import DivergedError, train
from popmeta.storage import Mirror, RemoteDir, RemoteLock, StorageError, is_remote, join, parent
from tests.local_run import local_config, no_population
from tests.processes import env_with_compilation_cache

BUCKET = "popmeta-test"
RUNS = f"s3://{BUCKET}/runs"


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 with one bucket; the environment points clients at it."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    yield client
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    server.stop()


def _keys(client, prefix: str) -> dict[str, str]:
    """Object key -> ETag under ``prefix``."""
    listing = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {item["Key"]: item["ETag"] for item in listing}


def _get(client, key: str, target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    client.download_file(BUCKET, key, str(target))
    return target


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "popmeta.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env=env_with_compilation_cache(),
    )


def test_a_run_lives_in_the_bucket_resumes_from_it_and_is_evaluated_there(s3, tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(config_to_dict(local_config(RUNS, name="cli"))))
    first = _cli("train", str(config_file), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert f"{RUNS}/cli" in first.stdout

    keys = _keys(s3, "runs/cli/")
    assert {"runs/cli/config.yaml", "runs/cli/checkpoints/ckpt_00000004.npz"} <= set(keys)
    # Nothing temporary or local reaches the bucket; the lock went with the run.
    assert not [k for k in keys if "/." in k or "partial" in k], keys
    assert not (tmp_path / "runs").exists()

    checkpoint = _get(s3, "runs/cli/checkpoints/ckpt_00000004.npz", tmp_path / "dl" / "c.npz")
    config, theta = load_theta(checkpoint)
    assert config.name == "cli" and config.run_dir == RUNS and theta
    recorded = yaml.safe_load(s3.get_object(Bucket=BUCKET, Key="runs/cli/config.yaml")["Body"])
    assert recorded["run_dir"] == RUNS

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = [k for k in keys if "events.out.tfevents" in k]
    assert events
    for key in events:
        _get(s3, key, tmp_path / "events" / Path(key).name)
    accumulator = EventAccumulator(str(tmp_path / "events"))
    accumulator.Reload()
    assert [s.step for s in accumulator.Scalars("meta_loss")] == [2, 4]

    again = _cli("train", str(config_file), "--set", "train.num_steps=6", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "at step 4" in again.stdout
    assert "runs/cli/checkpoints/ckpt_00000006.npz" in _keys(s3, "runs/cli/")

    newest = f"{RUNS}/cli/checkpoints/ckpt_00000006.npz"
    evaluated = _cli("eval", newest, cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr
    eval_keys = _keys(s3, "runs/cli/eval/")
    assert {"runs/cli/eval/curves.png", "runs/cli/eval/results.csv"} <= set(eval_keys)
    assert any("events.out.tfevents" in k for k in eval_keys)
    png = s3.get_object(Bucket=BUCKET, Key="runs/cli/eval/curves.png")["Body"].read()
    assert png.startswith(b"\x89PNG")


def test_a_different_config_is_refused_and_the_bucket_left_as_it_was(s3):
    train(local_config(RUNS, name="ident"), stream=io.StringIO())
    before = _keys(s3, "runs/ident/")
    with pytest.raises(RunDirectoryError) as info:
        train(local_config(RUNS, name="ident", estimator={"kind": "nres"}), no_population)
    message = str(info.value)
    assert f"{RUNS}/ident holds a run with another config" in message
    assert "estimator.kind: 'pes' -> 'nres'" in message
    assert f"--from-checkpoint {RUNS}/ident/checkpoints/ckpt_00000004.npz" in message
    assert _keys(s3, "runs/ident/") == before


def test_from_checkpoint_takes_a_bucket_run_over_and_moves_later_checkpoints_aside(s3):
    train(local_config(RUNS, name="take"), stream=io.StringIO())
    old_four = _keys(s3, "runs/take/checkpoints/")["runs/take/checkpoints/ckpt_00000004.npz"]
    changed = local_config(RUNS, name="take", outer_optimizer={"learning_rate": 0.001})
    stream = io.StringIO()
    earlier = f"{RUNS}/take/checkpoints/ckpt_00000002.npz"
    result = train(changed, stream=stream, from_checkpoint=earlier)
    assert result.final_step == 4 and "at step 2" in stream.getvalue()
    keys = _keys(s3, "runs/take/")
    (aside,) = [k for k in keys if k.startswith("runs/take/checkpoints-after-2-")]
    assert aside.endswith("/ckpt_00000004.npz") and keys[aside] == old_four
    assert keys["runs/take/checkpoints/ckpt_00000004.npz"] != old_four
    recorded = s3.get_object(Bucket=BUCKET, Key="runs/take/config.yaml")["Body"].read()
    assert b"learning_rate: 0.001" in recorded


def _lock(client, name: str, age_s: float) -> None:
    record = {"owner": "pid 7 on lost-head", "token": "theirs", "heartbeat": time.time() - age_s}
    client.put_object(Bucket=BUCKET, Key=f"runs/{name}/.lock", Body=json.dumps(record).encode())


def test_a_live_lock_refuses_a_start_and_a_stale_one_is_taken_over(s3):
    _lock(s3, "locked", age_s=5)
    with pytest.raises(RunDirectoryError, match=r"in use by a live run \(pid 7 on lost-head"):
        train(local_config(RUNS, name="locked"), no_population)
    assert set(_keys(s3, "runs/locked/")) == {"runs/locked/.lock"}
    # The head that held it was lost long ago: its lock is taken over.
    _lock(s3, "locked", age_s=3600)
    result = train(local_config(RUNS, name="locked"), stream=io.StringIO())
    assert result.final_step == 4
    assert "runs/locked/.lock" not in _keys(s3, "runs/locked/")


def test_a_heartbeat_notices_that_another_start_took_the_lock(s3):
    remote = RemoteDir(f"{RUNS}/beat")
    lock = RemoteLock(remote, heartbeat_s=0.05, stale_after_s=60)
    lock.acquire()
    try:
        mine = json.loads(remote.read_bytes(".lock"))
        assert mine["token"] == lock.token and lock.lost is None
        _lock(s3, "beat", age_s=0)
        deadline = time.monotonic() + 60
        while lock.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lock.lost == "pid 7 on lost-head"
    finally:
        lock.release()
    # Released by a run that no longer holds it: the new holder's lock stays.
    assert json.loads(remote.read_bytes(".lock"))["token"] == "theirs"


def test_a_run_that_fails_keeps_its_checkpoints_in_the_bucket(s3):
    blown = local_config(
        RUNS,
        name="blown",
        outer_optimizer={"learning_rate": 1e6, "clip_grad_norm": None},
        train={"num_steps": 200, "checkpoint_every": 1, "keep_checkpoints": 3},
    )
    with pytest.raises(DivergedError) as info:
        train(blown, stream=io.StringIO())
    keys = _keys(s3, "runs/blown/")
    checkpoints = sorted(k for k in keys if k.startswith("runs/blown/checkpoints/"))
    # Every checkpoint the run wrote before it diverged, the newest named as the way on.
    assert 1 <= len(checkpoints) <= 3, keys
    assert "runs/blown/.lock" not in keys
    assert f"--from-checkpoint s3://{BUCKET}/{checkpoints[-1]}" in str(info.value)


def test_a_start_that_fails_writes_nothing_to_the_bucket(s3):
    def population_fails(population, worker):
        raise RuntimeError("no actor could start")

    with pytest.raises(RuntimeError, match="no actor could start"):
        train(local_config(RUNS, name="failed"), population_fails, stream=io.StringIO())
    assert _keys(s3, "runs/failed/") == {}


def test_a_missing_bucket_or_unknown_storage_is_refused_naming_it(s3):
    with pytest.raises(RunDirectoryError, match=r"run_dir: s3://no-such-bucket/runs/x: .*create"):
        train(local_config("s3://no-such-bucket/runs", name="x"), no_population)
    with pytest.raises(RunDirectoryError, match=r"run_dir: nosuchfs://b/runs/x: fsspec does not"):
        train(local_config("nosuchfs://b/runs", name="x"), no_population)


def test_locations_local_and_remote():
    assert is_remote("s3://b/runs") and is_remote("gs://b") and not is_remote("runs")
    assert not is_remote("file:///tmp/runs") and not is_remote("/abs/runs")
    assert join("s3://b/runs/", "x", "eval") == "s3://b/runs/x/eval"
    assert parent("s3://b/runs/x/checkpoints/c.npz") == "s3://b/runs/x/checkpoints"
    assert join("file:///tmp/runs", "x") == "/tmp/runs/x"


def test_a_filesystem_without_atomic_puts_gets_whole_files_through_a_temporary_name(tmp_path):
    # fsspec's in-memory filesystem: renames exist, single puts are not atomic.
    remote = RemoteDir(f"memory://{tmp_path.name}/run")
    assert not remote.atomic_put
    local = tmp_path / "stage"
    (local / "checkpoints").mkdir(parents=True)
    (local / "checkpoints" / "ckpt_00000001.npz").write_bytes(b"one")
    (local / ".hidden").write_bytes(b"never uploaded")
    mirror = Mirror(local, remote)
    assert mirror.sync() == 1 and mirror.sync() == 0
    assert remote.files("checkpoints") == ["ckpt_00000001.npz"] and remote.files() == []
    with pytest.raises(FileNotFoundError):
        remote.upload(tmp_path / "missing", "checkpoints/ckpt_00000002.npz")
    # The failed upload left neither the target nor its temporary object behind.
    assert remote.files("checkpoints") == ["ckpt_00000001.npz"]
    (local / "checkpoints" / "ckpt_00000001.npz").unlink()
    mirror.sync()
    assert remote.files("checkpoints") == []
    with pytest.raises(StorageError, match="fsspec does not know"):
        RemoteDir("nosuchfs://x")


def test_select_chooses_among_a_bucket_runs_checkpoints_and_writes_there(s3, capsys):
    from popmeta.cli import main

    train(local_config(RUNS, name="select"), stream=io.StringIO())
    assert main(["select", f"{RUNS}/select", "--settings", "trained horizon"]) == 0
    out = capsys.readouterr().out
    assert f"chosen: {RUNS}/select/checkpoints/ckpt_0000000" in out
    body = s3.get_object(Bucket=BUCKET, Key="runs/select/select/selection.csv")["Body"]
    rows = list(csv.DictReader(io.StringIO(body.read().decode())))
    assert [(row["step"], row["baseline"]) for row in rows] == [
        ("2", ""),
        ("4", ""),
        ("", "adam"),
        ("", "adam_cosine"),
    ]
    assert sorted(row["chosen"] for row in rows) == ["False", "False", "False", "True"]
