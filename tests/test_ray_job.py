"""``ray start --head`` + ``ray job submit -- popmeta train --address auto``, for real.

This is how docs/clusters.md's recipe runs a job, on one machine: a head
node started with the Ray CLI, ``popmeta train`` submitted through the
dashboard's job API with the Ray CLI, in the same ``bash -c "cd ... && popmeta
train CONFIG --address auto"`` form, and the run's checkpoints and TensorBoard
events found where the job was told to write them. About 20 s on 2 idle cores
(head 5 s, job 11 s, stop 3 s); about a minute when the machine is busy.

The head must not disturb other Ray instances on the machine (this session's
embedded one, other users' runs), so it is scoped, never stopped with
``ray stop`` (which stops every Ray process of the machine):

* it has its own temp dir, and free ports for everything ``ray start --head``
  would otherwise bind at a fixed default (GCS 6379, dashboard 8265, client
  server 10001, dashboard agent 52365); the rest are random;
* it runs as ``ray start --block`` in a new process session, so it is one
  process that owns the node: SIGTERM makes Ray's shutdown hook stop the
  processes it started, and the kernel kills them if that process dies;
* anything of its process group, or naming its temp dir on its command line,
  still alive afterwards is killed by pid (the last test checks that nothing
  needs to be, and that the session's own instance survives).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from popmeta.learner.checkpoints import list_checkpoints
from popmeta.population.ray_runtime import LOOPBACK_ENV
from tests.events import read_scalars
from tests.population import CALL_TIMEOUT_S
from tests.user_kinds import USER_KINDS

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
#: The Ray CLI of this interpreter (the job's Python is whatever the head's PATH finds first).
RAY_CLI = (
    [str(BIN / "ray")] if (BIN / "ray").exists() else [sys.executable, "-m", "ray.scripts.scripts"]
)
#: ``popmeta`` as the README runs it: the console script next to this interpreter.
POPMETA = (
    [str(BIN / "popmeta")] if (BIN / "popmeta").exists() else [sys.executable, "-m", "popmeta.cli"]
)
#: Longest wait for the head to serve its dashboard (5-15 s here).
HEAD_START_TIMEOUT_S = 60
#: Longest wait for the whole job, submission to exit (11-45 s here).
JOB_TIMEOUT_S = 150
#: Longest wait for the head's processes to exit after SIGTERM.
HEAD_STOP_TIMEOUT_S = 30
#: A tiny run of the quickstart config: one actor, the smallest task and learned
#: optimizer (compiled in seconds), 20 steps, checkpoints at 10 and 20.
STEPS = 20
TRAIN_OVERRIDES = [
    "name=job",
    "population.num_actors=1",
    "task.kind=fixed_dim_quadratic",
    "task.dim=4",
    "learned_optimizer.kind=learnable_sgdm",
    "estimator.num_tasks=2",
    "truncation.length=20",
    "estimator.random_initial_iteration_offset=20",
    f"train.num_steps={STEPS}",
    "train.checkpoint_every=10",
    "train.summary_every=5",
    "train.log_every=10",
    "eval.num_tasks=2",
    "eval.num_steps=5",
    f"population.call_timeout_s={CALL_TIMEOUT_S}",
]

pytestmark = pytest.mark.timeout(HEAD_START_TIMEOUT_S + JOB_TIMEOUT_S + 2 * HEAD_STOP_TIMEOUT_S)


def _free_ports(count: int) -> list[int]:
    """Ports free on loopback now; all bound at once so they are distinct."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _live_pids(*, group: int | None = None, naming: str | None = None) -> list[int]:
    """Live (not zombie) processes in process group ``group`` or whose command line
    contains ``naming``; Linux ``/proc`` (elsewhere: none)."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        state, pgrp = stat[0], int(stat[2])
        pid = int(entry.name)
        if state == "Z" or pid == os.getpid():
            continue
        if (group is not None and pgrp == group) or (naming is not None and naming in cmdline):
            pids.append(pid)
    return pids


def _is_live(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Head:
    """A Ray head node started with the CLI, stoppable without touching other instances."""

    def __init__(self, log_path: Path):
        # Short on purpose: Ray puts Unix sockets under it (~107-byte limit).
        self.temp_dir = tempfile.mkdtemp(prefix="pm-head-")
        gcs, self.dashboard_port, client, agent = _free_ports(4)
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.env.update(LOOPBACK_ENV)
        self.env.update(
            # The job's `popmeta` and `python` are the first on the head's PATH.
            PATH=f"{BIN}{os.pathsep}{self.env.get('PATH', '')}",
            # Ray's address file and anything else it writes stay in the temp dir.
            RAY_TMPDIR=self.temp_dir,
            # SIGTERM stops the node at once instead of draining it for 30 s.
            RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
        )
        command = [
            *RAY_CLI,
            "start",
            "--head",
            "--block",
            f"--port={gcs}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            f"--ray-client-server-port={client}",
            f"--dashboard-agent-listen-port={agent}",
            "--include-dashboard=true",
            "--num-cpus=2",
            "--num-gpus=0",
            f"--object-store-memory={200 * 2**20}",
            f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
        ]
        self.log_path = log_path
        self._stopped = False
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            command,
            env=self.env,
            cwd=self.temp_dir,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout_s: float) -> None:
        """Waits until the dashboard answers (the job API lives there)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"ray start exited ({self.proc.returncode}):\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.dashboard}/api/version", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"the head's dashboard did not answer in {timeout_s} s:\n{self.log()}")

    def _processes(self) -> list[int]:
        """This head's live processes: its session's process group, plus anything
        naming its private temp dir (the raylet and its workers run in sessions of
        their own, and carry the temp dir in their arguments)."""
        return _live_pids(group=self.proc.pid, naming=self.temp_dir)

    def stop(self) -> list[int]:
        """Stops this head only (idempotent); returns the pids it had to kill by force.

        SIGTERM to ``ray start --block`` runs Ray's shutdown hook, which stops
        the processes it started; a few (the dashboard's module processes) exit
        on their own a second or two after it. Whatever is still alive after
        :data:`HEAD_STOP_TIMEOUT_S` is killed by pid.
        """
        if self._stopped:
            return []
        self._stopped = True
        deadline = time.monotonic() + HEAD_STOP_TIMEOUT_S
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=HEAD_STOP_TIMEOUT_S)
        while self._processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        forced = []
        while left := self._processes():
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    forced.append(pid)
            time.sleep(0.2)
            if time.monotonic() > deadline + HEAD_STOP_TIMEOUT_S:
                break
        self.proc.wait(timeout=HEAD_STOP_TIMEOUT_S)
        self._log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return forced


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("head")
    node = Head(log_dir / "ray-start.log")
    try:
        node.wait_ready(HEAD_START_TIMEOUT_S)
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="module")
def submitted(head, tmp_path_factory):
    """One ``popmeta train`` job, submitted and awaited with ``ray job submit``."""
    run_dir = tmp_path_factory.mktemp("job") / "runs"
    train = [*POPMETA, "train", "configs/quickstart.yaml", "--address", "auto"]
    for override in [*TRAIN_OVERRIDES, f"run_dir={run_dir}"]:
        train += ["--set", override]
    # docs/clusters.md's form: one shell command line, run from the repository.
    script = f"cd {shlex.quote(str(REPO))} && {' '.join(shlex.quote(a) for a in train)}"
    submission_id = f"popmeta-test-{os.getpid()}"
    start = time.monotonic()
    result = subprocess.run(
        [
            *RAY_CLI,
            *("job", "submit", "--address", head.dashboard, "--submission-id", submission_id),
            *("--", "bash", "-c", script),
        ],
        env=head.env,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    return result, run_dir / "job", submission_id, time.monotonic() - start


def test_the_submitted_job_succeeds(head, submitted):
    result, _, submission_id, seconds = submitted
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{output}\n--- head log ---\n{head.log()}"
    assert f"step {STEPS}/{STEPS}" in output  # the job's own log, tailed by `ray job submit`
    from ray.job_submission import JobStatus, JobSubmissionClient

    # The job API's own record (an HTTP client: no Ray instance in this process).
    status = JobSubmissionClient(head.dashboard).get_job_status(submission_id)
    assert status == JobStatus.SUCCEEDED
    assert seconds < JOB_TIMEOUT_S


def test_the_job_ran_its_actors_on_the_head(head, submitted):
    """``--address auto`` joined the head: the head's state API lists this job's actors.

    (Had the run started an embedded instance of its own, the head would have
    recorded no actors for the job.)
    """
    from ray.job_submission import JobSubmissionClient
    from ray.util.state import list_actors

    _, _, submission_id, _ = submitted
    job_id = JobSubmissionClient(head.dashboard).get_job_info(submission_id).job_id
    actors = list_actors(
        address=head.dashboard,
        filters=[("class_name", "=", "EstimatorActor")],
        detail=True,
        timeout=30,
        raise_on_missing_output=False,
    )
    assert [a.job_id for a in actors] == [job_id]


def test_the_job_wrote_checkpoints_and_events_where_it_was_told(submitted):
    _, run, *_ = submitted
    checkpoints = list_checkpoints(run / "checkpoints")
    assert [int(p.stem.split("_")[1]) for p in checkpoints] == [10, 20]
    scalars = read_scalars(run)
    assert [step for step, _ in scalars["meta_loss"]] == list(range(5, STEPS + 1, 5))
    assert (run / "config.yaml").exists()


USER_RUN = f"""
name: user-job
task: {{kind: "job_kinds:noisy_targets", dim: 3}}
learned_optimizer: {{kind: "job_kinds:LogLrSGD", initial_lr: 0.05}}
truncation: {{kind: constant, length: 20}}
estimator: {{kind: pes, trunc_length: 5, num_tasks: 2, random_initial_iteration_offset: 20}}
population: {{num_actors: 1, call_timeout_s: {CALL_TIMEOUT_S}}}
train: {{num_steps: 10, checkpoint_every: 10, log_every: 5}}
eval: {{num_tasks: 2, num_steps: 5, after_training: false}}
"""


@pytest.fixture(scope="module")
def user_job(head, tmp_path_factory):
    """A job whose kinds live in a module of its ``--working-dir`` only."""
    work = tmp_path_factory.mktemp("work")
    (work / "job_kinds.py").write_text(USER_KINDS)
    (work / "run.yaml").write_text(USER_RUN)
    run_dir = tmp_path_factory.mktemp("user-job") / "runs"
    train = [*POPMETA, "train", "run.yaml", "--address", "auto", "--set", f"run_dir={run_dir}"]
    result = subprocess.run(
        [
            *RAY_CLI,
            *("job", "submit", "--address", head.dashboard, "--working-dir", str(work)),
            *("--", *train),
        ],
        env=head.env,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    return result, run_dir / "user-job"


def test_a_jobs_working_dir_carries_a_users_module_to_the_driver_and_the_actors(head, user_job):
    result, run = user_job
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{output}\n--- head log ---\n{head.log()}"
    assert "step 10/10" in output and "job_kinds:LogLrSGD on job_kinds:noisy_targets" in output
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["ckpt_00000010.npz"]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="lists processes via /proc")
def test_stopping_the_head_stops_all_of_it_and_nothing_else(head, ray_session):
    """SIGTERM to the one ``ray start --block`` process takes its whole node down.

    Nothing of the head is left for the forced clean-up to kill, and the test
    session's own Ray instance, running beside it, still works.
    """
    import ray

    processes = head._processes()
    assert len(processes) > 3, "gcs_server, raylet, dashboard, ... are found"
    assert head.stop() == []
    assert head._processes() == []
    assert not [pid for pid in processes if _is_live(pid)]
    assert ray.get(ray.remote(lambda: 42).remote(), timeout=60) == 42
