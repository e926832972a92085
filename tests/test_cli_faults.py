"""The real ``popmeta`` command under faults: one paragraph and a documented exit status each.

Every run here is a real ``popmeta`` process: real signals (SIGINT, SIGHUP)
delivered to it, its terminal taken away, real Ray actors that cannot be
built or that keep dying, a real disk that refuses writes. None may end in a
traceback, and each ends with the status docs/faults.md's table gives.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from popmeta.cli import (
    EX_CONFIG,
    EX_INTERRUPTED,
    EX_IOERR,
    EX_SOFTWARE,
    EX_UNAVAILABLE,
    EXIT_STATUSES,
    main,
)
from popmeta.config import config_to_yaml
from popmeta.learner.checkpoints import list_checkpoints
from tests.local_run import local_config
from tests.processes import env_with_compilation_cache

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]


def _sets(*overrides: str) -> list[str]:
    return [item for override in overrides for item in ("--set", override)]


#: A quickstart small enough to start in seconds on the Ray engine.
TINY = _sets(
    "task.dim=4", "estimator.num_tasks=2", "eval.after_training=false", "train.log_every=20"
)


POPMETA = [sys.executable, "-m", "popmeta.cli"]


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*POPMETA, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
        env=env_with_compilation_cache(),
    )


@contextlib.contextmanager
def _as_from_a_terminal() -> Iterator[None]:
    """SIGHUP and SIGINT at their defaults for a command started inside, as from a terminal.

    A suite run under `nohup` (or as a background job) has them ignored, which a
    child inherits, and popmeta rightly leaves an ignored SIGHUP alone. Set here
    rather than in a `preexec_fn`, which would fork the multithreaded JAX process.
    """
    ignored = [s for s in (signal.SIGHUP, signal.SIGINT) if signal.getsignal(s) == signal.SIG_IGN]
    for signum in ignored:
        signal.signal(signum, signal.SIG_DFL)
    try:
        yield
    finally:
        for signum in ignored:
            signal.signal(signum, signal.SIG_IGN)


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen]]:
    """The commands a test starts, killed at its end if they still run (a failed test's too)."""
    processes: list[subprocess.Popen] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


def _start(started: list[subprocess.Popen], cwd: Path, *args: str) -> subprocess.Popen:
    pipe = subprocess.PIPE
    with _as_from_a_terminal():
        process = subprocess.Popen(
            [*POPMETA, *args],
            cwd=cwd,
            stdout=pipe,
            stderr=pipe,
            text=True,
            env=env_with_compilation_cache(),
        )
    started.append(process)
    return process


def _paragraph(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    (line,) = [line for line in stderr.splitlines() if line.startswith("popmeta: ")]
    return line


def _wait_for_steps(process: subprocess.Popen) -> None:
    """Reads the run's stderr until its first progress line."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if line.startswith("step "):
            return
        assert line or process.poll() is None, "the run ended before its first step"
    raise AssertionError("no progress line within 120 s")


def test_sighup_saves_a_checkpoint_and_exits_even_when_the_terminal_is_gone(tmp_path, started):
    args = ["train", "--set", "population.engine=local", "--set", "name=hup", *TINY]
    process = _start(started, tmp_path, *args, "--set", "train.num_steps=1000000")
    _wait_for_steps(process)
    # A closed ssh session: the terminal hangs up, and nothing reads the output any more.
    process.send_signal(signal.SIGHUP)
    process.stdout.close()
    process.stderr.close()
    assert process.wait(timeout=120) == EX_INTERRUPTED
    run = tmp_path / "runs" / "hup"
    (saved,) = list_checkpoints(run / "checkpoints")
    assert not (run / ".lock").exists()
    resumed = _run(tmp_path, *args, "--set", f"train.num_steps={int(saved.stem[5:]) + 20}")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {Path('runs/hup/checkpoints') / saved.name}" in resumed.stdout


def test_ctrl_c_while_starting_or_closing_is_one_paragraph_and_exit_130(tmp_path, started):
    # While the actors start: nothing of the start is kept.
    starting = _start(started, tmp_path, "train", "--set", "name=starting", *TINY)
    assert starting.stdout.readline().startswith("popmeta: training 'starting'")
    time.sleep(1.0)
    starting.send_signal(signal.SIGINT)
    out, err = starting.communicate(timeout=120)
    assert starting.returncode == EX_INTERRUPTED, err
    assert "SIGINT while the run was starting: nothing was trained" in _paragraph(err)
    assert not (tmp_path / "runs" / "starting").exists()

    # Ctrl-C, then Ctrl-C again and again while it saves and shuts Ray down.
    closing = _start(started, tmp_path, "train", "--set", "name=closing", *TINY)
    _wait_for_steps(closing)
    closing.send_signal(signal.SIGINT)
    while closing.poll() is None:
        time.sleep(0.2)
        closing.send_signal(signal.SIGINT)
    out, err = closing.communicate(timeout=60)
    assert closing.returncode == EX_INTERRUPTED, err
    assert "Traceback" not in err, err
    (saved,) = list_checkpoints(tmp_path / "runs" / "closing" / "checkpoints")
    assert f"{saved.relative_to(tmp_path)} is saved" in out


# A KeyboardInterrupt leaves code run through PyRun_StringFlags, as one can
# inside Ray's extension while a Ctrl-C stops the start; then the interrupted
# command's own exit, run as `python -m`.
INTERRUPTED_IN_AN_EXTENSION = """
import atexit, ctypes, sys
from pathlib import Path
from popmeta.cli import _exit_interrupted

PY_FILE_INPUT = 257  # Include/compile.h: source run as a module's statements
run = ctypes.pythonapi.PyRun_StringFlags
run.restype = ctypes.py_object
run.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.py_object, ctypes.py_object, ctypes.c_void_p]
try:
    run(b"raise KeyboardInterrupt", PY_FILE_INPUT, {}, {}, None)
except KeyboardInterrupt:
    pass
atexit.register(lambda: Path("exit_handler_ran").touch())
print("closing the run", end="")
_exit_interrupted()
"""


def test_an_interrupted_command_exits_130_after_its_exit_handlers(tmp_path):
    (tmp_path / "interrupted_in_an_extension.py").write_text(INTERRUPTED_IN_AN_EXTENSION)
    done = subprocess.run(
        [sys.executable, "-m", "interrupted_in_an_extension"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == EX_INTERRUPTED, done.stderr
    assert done.stdout == "closing the run"
    assert (tmp_path / "exit_handler_ran").exists()


def test_an_actor_that_cannot_be_built_stops_the_run_naming_it_its_node_and_the_cause(
    tmp_path,
):
    # 3 tasks cannot be sharded over the actor's 2 devices: its constructor raises.
    two_devices = "population.env={XLA_FLAGS: --xla_force_host_platform_device_count=2}"
    failed = _run(tmp_path, "train", *TINY, *_sets("estimator.num_tasks=3", two_devices))
    assert failed.returncode == EX_CONFIG, failed.stderr
    paragraph = _paragraph(failed.stderr)
    assert re.search(r"actor [01] \(restart 0\) could not start: ValueError: ", paragraph)
    assert "multiple of the number of devices" in paragraph and "(on host " in paragraph
    details = re.search(r"The actor's traceback is in (\S+)$", paragraph).group(1)
    assert "EstimatorActor" in Path(details).read_text()
    assert not (tmp_path / "runs" / "quickstart").exists()  # the start left nothing


def test_a_rank_that_keeps_dying_ends_the_run_with_exit_69(tmp_path):
    # XLA aborts on a flag it does not know: every actor dies while it starts.
    unknown_flag = "population.env={XLA_FLAGS: --no_such_flag}"
    failed = _run(tmp_path, "train", *TINY, *_sets("population.max_actor_restarts=1", unknown_flag))
    assert failed.returncode == EX_UNAVAILABLE, failed.stderr
    paragraph = _paragraph(failed.stderr)
    assert "replaced 1 time(s) in a row" in paragraph and "max_actor_restarts=1" in paragraph


DRIVER = """
import sys
from popmeta.cli import main
from popmeta.learner.learner import Learner

def broken(self, estimates):
    raise ZeroDivisionError("a bug")

Learner.update = broken
sys.exit(main(sys.argv[1:]))
"""


def test_an_unexpected_error_is_one_paragraph_with_its_traceback_in_a_file(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(config_to_yaml(local_config(tmp_path / "runs", name="bug")))
    failed = subprocess.run(
        [sys.executable, "-c", DRIVER, "train", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert failed.returncode == EX_SOFTWARE, failed.stderr
    paragraph = _paragraph(failed.stderr)
    assert "unexpected error: ZeroDivisionError: a bug" in paragraph
    report = Path(re.search(r"the traceback is in (\S+):", paragraph).group(1))
    traceback = report.read_text()
    assert "in broken" in traceback and traceback.endswith("ZeroDivisionError: a bug\n")
    report.unlink()


def test_eval_refuses_an_unwritable_output_before_evaluating_and_names_a_non_checkpoint(
    tmp_path, capsys
):
    config = local_config(tmp_path / "runs", name="ev", train={"num_steps": 2})
    config_file = tmp_path / "run.yaml"
    config_file.write_text(config_to_yaml(config))
    assert main(["train", str(config_file)]) == 0
    (checkpoint,) = list_checkpoints(tmp_path / "runs" / "ev" / "checkpoints")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    start = time.monotonic()
    assert main(["eval", str(checkpoint), "--out", str(blocker / "eval")]) == EX_IOERR
    assert time.monotonic() - start < 30  # refused before the tuning grids ran
    assert f"cannot write the evaluation's output to {blocker / 'eval'}" in capsys.readouterr().err
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    assert main(["eval", str(text)]) == 2
    err = capsys.readouterr().err
    assert f"{text} is not a popmeta checkpoint" in err and "allow_pickle" not in err


def test_workers_that_cannot_fit_in_memory_are_refused_naming_the_field(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    args = ["train", "--set", "estimator.num_tasks=10000000", "--set", "population.engine=local"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "estimator.num_tasks: 10000000 tasks per worker cannot fit in memory" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name", ["a" * 300, "tab\tname"])
def test_a_run_name_that_cannot_be_a_directory_is_refused(name, capsys):
    assert main(["validate", "--set", f"name={name}"]) == 2
    assert "name: " in capsys.readouterr().err


def test_the_faults_page_lists_every_exit_status_popmeta_returns():
    page = (REPO / "docs" / "faults.md").read_text()
    table = page[page.index("| exit status | meaning |") :].split("\n\n")[0]
    rows = table.splitlines()[2:]
    assert rows == [f"| {code} | {meaning} |" for code, meaning in sorted(EXIT_STATUSES.items())]
