"""No fault hangs or loses a run: a full disk, a read-only run directory, failing event writes.

Faults are injected without privileges: :class:`FaultyDisk` makes writes under
one directory fail the way a full disk (``ENOSPC`` once the space is used up)
or a read-only file system (``EROFS`` on opening a file for writing, and on
every write to a file already open) makes them fail, by wrapping the few
functions popmeta writes files with (``open``, ``tempfile.mkstemp`` and
``os.fdopen``). Where this process may mount one, a real tiny tmpfs fills up
in the same test as well. The runs are real: the local engine's workers, the
learner, the event files and the checkpoints, and the real ``popmeta`` CLI in
a subprocess where the exit code and the message matter.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fnmatch
import io
import logging
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest

from popmeta.cli import EX_IOERR
from popmeta.config import ConfigError, config_to_yaml
from popmeta.experiment import learner_start
from popmeta.learner.checkpoint_layout import load_run_checkpoint
from popmeta.learner.checkpoints import list_checkpoints
from popmeta.learner.learner import Learner
from popmeta.population.local import LocalPopulation
from popmeta.run_dir import RunDirectoryError
from popmeta.run_loop import RunWriteError, train
from popmeta.summaries import Summaries
from tests.events import read_events, read_scalars
from tests.local_run import local_config, no_population

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[1]


class FaultyDisk:
    """Writes under ``root`` to files whose name matches ``pattern`` fail once armed.

    Args:
      root: the directory whose files fail.
      error: the errno the failing calls raise.
      pattern: an ``fnmatch`` pattern for the file names that fail.
      healthy_files: arm on opening the (``healthy_files`` + 1)-th matching
        file for writing; None to arm only by setting :attr:`armed`.
      bytes_left: once armed, how many more bytes the disk takes (a full
        disk: writes fail, creating a file works); None for a read-only file
        system, where opening a file for writing fails too.
    """

    def __init__(
        self,
        root: Path,
        error: int,
        pattern: str = "*",
        healthy_files: int | None = None,
        bytes_left: int | None = 0,
    ):
        self.root = str(Path(root).resolve())
        self.error = error
        self.pattern = pattern
        self.healthy_files = healthy_files
        self.bytes_left = bytes_left
        self.armed = False
        self.refused: list[str] = []
        self._temp_files: dict[int, str] = {}

    def _matches(self, path: str) -> bool:
        path = os.path.abspath(path)
        return path.startswith(self.root + os.sep) and fnmatch.fnmatch(
            os.path.basename(path), self.pattern
        )

    def _refuse(self, path: str) -> OSError:
        self.refused.append(path)
        return OSError(self.error, os.strerror(self.error), path)

    def _opening(self, path: str) -> None:
        if not self.armed and self.healthy_files is not None:
            if self.healthy_files > 0:
                self.healthy_files -= 1
            else:
                self.armed = True
        if self.armed and self.bytes_left is None:
            raise self._refuse(path)

    def _write(self, file: Any, data: Any, path: str) -> int:
        if not self.armed:
            return file.write(data)
        size = len(data)
        if self.bytes_left is None or self.bytes_left == 0:
            raise self._refuse(path)
        if size > self.bytes_left:
            if not isinstance(file, io.RawIOBase):
                raise self._refuse(path)
            # A raw write that only partly fits is short, as the kernel's is.
            data = data[: self.bytes_left]
        written = file.write(data)
        self.bytes_left -= written
        return written

    @contextlib.contextmanager
    def installed(self):
        """Routes ``open``, ``tempfile.mkstemp`` and ``os.fdopen`` through this disk."""
        real_open, real_mkstemp, real_fdopen = builtins.open, tempfile.mkstemp, os.fdopen

        def fake_open(file, mode="r", *args, **kwargs):
            writing = any(flag in mode for flag in "wax+")
            if not isinstance(file, int) and writing and self._matches(os.fspath(file)):
                self._opening(os.fspath(file))
                return _FaultyFile(real_open(file, mode, *args, **kwargs), self, os.fspath(file))
            return real_open(file, mode, *args, **kwargs)

        def fake_mkstemp(suffix=None, prefix=None, dir=None, text=False):
            name = os.path.join(dir or tempfile.gettempdir(), f"{prefix}*{suffix}")
            if not self._matches(name):
                return real_mkstemp(suffix, prefix, dir, text)
            self._opening(name)
            fd, path = real_mkstemp(suffix, prefix, dir, text)
            self._temp_files[fd] = path
            return fd, path

        def fake_fdopen(fd, *args, **kwargs):
            file = real_fdopen(fd, *args, **kwargs)
            path = self._temp_files.pop(fd, None)
            return file if path is None else _FaultyFile(file, self, path)

        with contextlib.ExitStack() as patches:
            patches.enter_context(mock.patch.object(builtins, "open", fake_open))
            patches.enter_context(mock.patch.object(io, "open", fake_open))
            patches.enter_context(mock.patch.object(tempfile, "mkstemp", fake_mkstemp))
            patches.enter_context(mock.patch.object(os, "fdopen", fake_fdopen))
            yield self


class _FaultyFile:
    """A real open file whose writes go through a :class:`FaultyDisk`."""

    def __init__(self, file: Any, disk: FaultyDisk, path: str):
        self._file, self._disk, self._path = file, disk, path

    def write(self, data: Any) -> int:
        return self._disk._write(self._file, data, self._path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def __enter__(self) -> _FaultyFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


class InjectedFullDisk:
    """The run directory's disk, filled up on demand by a :class:`FaultyDisk`."""

    def __init__(self, root: Path):
        self.root = root
        self.faults = FaultyDisk(root, errno.ENOSPC)

    def fill(self) -> None:
        self.faults.armed = True

    def free(self) -> None:
        self.faults.armed = False


class TmpfsFullDisk:
    """A real 1 MiB tmpfs, filled up by a file that takes every free byte."""

    def __init__(self, root: Path):
        self.root = root
        self.filler = root / "filler"

    def fill(self) -> None:
        chunk = b"\0" * 65536
        with open(self.filler, "wb", buffering=0) as file, contextlib.suppress(OSError):
            while True:
                file.write(chunk)

    def free(self) -> None:
        self.filler.unlink()


def _mount_tmpfs(path: Path) -> bool:
    mount = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)]
    try:
        return subprocess.run(mount, capture_output=True, timeout=30).returncode == 0
    except OSError:
        return False


@pytest.fixture(params=["injected", "tmpfs"])
def full_disk(request, tmp_path):
    """A run directory root whose disk a test can fill: injected faults, or a real tmpfs."""
    root = tmp_path / "runs"
    root.mkdir()
    if request.param == "injected":
        disk = InjectedFullDisk(root)
        with disk.faults.installed():
            yield disk
        return
    if not _mount_tmpfs(root):
        # The injected variant of this test checks the same behaviour unprivileged.
        pytest.skip("mounting a tmpfs needs privileges this process does not have")
    try:
        yield TmpfsFullDisk(root)
    finally:
        subprocess.run(["umount", str(root)], capture_output=True, timeout=30)


class FaultAt(LocalPopulation):
    """The real in-process population; at ``version`` it calls ``fault`` (e.g. fills the disk)."""

    closed = False

    def __init__(self, population, worker, version: int, fault):
        super().__init__(population, worker)
        self.version, self.fault = version, fault

    def gather(self, theta: Any, version: int):
        if version == self.version:
            self.fault()
        return super().gather(theta, version)

    def close(self) -> None:
        super().close()
        FaultAt.closed = True


def _config(root: Path, **train):
    return local_config(root, name="faulty", train={"num_steps": 8, "checkpoint_every": 2, **train})


def _run_until_fault(config, version: int, fault) -> RunWriteError:
    FaultAt.closed = False
    with pytest.raises(RunWriteError) as info:
        train(config, lambda p, w: FaultAt(p, w, version, fault), stream=io.StringIO())
    assert FaultAt.closed, "the population was not shut down"
    return info.value


def _assert_checkpoints_intact(run_dir: Path, config, steps: list[int]) -> None:
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [  # no partial or temporary file
        f"ckpt_{step:08d}.npz" for step in steps
    ]
    for path in list_checkpoints(checkpoints):
        load_run_checkpoint(path, Learner.of(learner_start(config)).checkpoint_tree())


def test_a_full_disk_stops_the_run_with_its_checkpoints_intact_and_a_rerun_resumes(
    full_disk, caplog
):
    config = _config(full_disk.root)
    # Full from the gather of step 3: step 4's checkpoint is the first that cannot be written.
    err = _run_until_fault(config, 3, full_disk.fill)
    run_dir = full_disk.root / "faulty"
    message = str(err)
    assert f"cannot write {run_dir / 'checkpoints' / 'ckpt_00000004.npz'}:" in message
    assert "No space left on device" in message and "stopped at step 4" in message
    assert f"Free space on the disk that holds {run_dir}" in message
    newest = run_dir / "checkpoints" / "ckpt_00000002.npz"
    assert f"rerun the same command: it resumes from {newest}" in message
    assert "\n" not in message
    # One error, reported once: the final checkpoint is not tried again.
    assert "final checkpoint" not in caplog.text
    _assert_checkpoints_intact(run_dir, config, [2])

    full_disk.free()
    stream = io.StringIO()
    result = train(config, stream=stream)
    assert "at step 2" in stream.getvalue() and result.final_step == 8
    _assert_checkpoints_intact(run_dir, config, [4, 6, 8])


def test_a_run_dir_that_turns_read_only_stops_the_run_the_same_way(tmp_path, caplog):
    config = _config(tmp_path)
    disk = FaultyDisk(tmp_path, errno.EROFS, bytes_left=None)

    def remount_read_only():
        disk.armed = True

    with disk.installed(), caplog.at_level(logging.WARNING, logger="popmeta"):
        err = _run_until_fault(config, 3, remount_read_only)
    run_dir = tmp_path / "faulty"
    message = str(err)
    assert f"cannot write {run_dir / 'checkpoints' / 'ckpt_00000004.npz'}:" in message
    assert "Read-only file system" in message
    assert f"Make {run_dir} writable again" in message
    assert f"it resumes from {run_dir}/checkpoints/ckpt_00000002.npz" in message
    # The event file, open since the start, failed first: one warning, and the run went on.
    assert caplog.text.count("cannot write TensorBoard events") == 1
    assert caplog.text.count("final checkpoint") == 0
    _assert_checkpoints_intact(run_dir, config, [2])
    assert [step for step, _ in read_scalars(run_dir)["meta_loss"]] == [2]


def test_failing_event_writes_cost_only_the_summaries(tmp_path, caplog):
    config = _config(tmp_path, num_steps=10, summary_every=1)
    # The event file takes a few events, then the disk is full half-way through one.
    disk = FaultyDisk(tmp_path, errno.ENOSPC, pattern="events.out.tfevents.*", bytes_left=20)

    def fill():
        disk.armed = True

    with disk.installed(), caplog.at_level(logging.WARNING, logger="popmeta"):
        result = train(config, lambda p, w: FaultAt(p, w, 3, fill), stream=io.StringIO())
    assert result.final_step == 10 and not result.interrupted
    assert caplog.text.count("cannot write TensorBoard events") == 1
    assert (
        "No space left on device" in caplog.text and "keeps writing its checkpoints" in caplog.text
    )
    run_dir = tmp_path / "faulty"
    _assert_checkpoints_intact(run_dir, config, [6, 8, 10])
    # The half-written event was cut off: the file reads back cleanly up to step 3.
    assert [step for step, _ in read_scalars(run_dir)["meta_loss"]] == [1, 2, 3]


def test_summaries_survive_a_directory_they_cannot_create_a_file_in(tmp_path, caplog):
    disk = FaultyDisk(tmp_path, errno.EACCES, healthy_files=0, bytes_left=None)
    with disk.installed(), caplog.at_level(logging.WARNING, logger="popmeta"):
        summaries = Summaries(tmp_path / "events")
        summaries.scalars(1, {"loss": 1.0})
        summaries.histogram(1, "phase", np.arange(4.0))
        summaries.close()
    assert summaries.failure is not None and "Permission denied" in summaries.failure
    assert caplog.text.count("cannot write TensorBoard events") == 1
    assert read_events(tmp_path) == ({}, {})


def test_a_config_that_cannot_be_recorded_stops_the_start_and_keeps_the_recorded_one(tmp_path):
    assert train(_config(tmp_path), stream=io.StringIO()).final_step == 8
    recorded = (tmp_path / "faulty" / "config.yaml").read_text()
    longer = _config(tmp_path, num_steps=12)
    disk = FaultyDisk(tmp_path, errno.ENOSPC, pattern="config.yaml*", healthy_files=0)
    with disk.installed(), pytest.raises(RunWriteError) as info:
        train(longer, stream=io.StringIO())
    assert f"cannot write {tmp_path / 'faulty' / 'config.yaml'}: No space left" in str(info.value)
    assert (tmp_path / "faulty" / "config.yaml").read_text() == recorded
    assert not (tmp_path / "faulty" / "config.yaml.partial").exists()


class LostPopulation(FaultAt):
    """Fills the disk at the gather of step 3, then loses every worker at step 5."""

    def gather(self, theta: Any, version: int):
        if version == 5:
            raise RuntimeError("every worker was lost")
        return super().gather(theta, version)


def test_a_final_checkpoint_that_fails_does_not_hide_the_error_that_stopped_the_run(
    tmp_path, caplog
):
    config = _config(tmp_path, checkpoint_every=100)
    disk = FaultyDisk(tmp_path, errno.ENOSPC)

    def fill():
        disk.armed = True

    FaultAt.closed = False
    lost = pytest.raises(RuntimeError, match="every worker was lost")
    with disk.installed(), caplog.at_level(logging.WARNING, logger="popmeta"), lost:
        train(config, lambda p, w: LostPopulation(p, w, 3, fill), stream=io.StringIO())
    assert FaultAt.closed
    assert caplog.text.count("the final checkpoint was not written: cannot write") == 1
    assert list((tmp_path / "faulty" / "checkpoints").iterdir()) == []
    # Without another error, a final checkpoint that fails is the run's error.
    disk.armed = False
    full = pytest.raises(RunWriteError, match=r"ckpt_00000008\.npz: No space left")
    with disk.installed(), full:
        train(config, lambda p, w: FaultAt(p, w, 6, fill), stream=io.StringIO())


DRIVER = """
import errno, sys
from tests.test_faults import FaultyDisk
from popmeta.cli import main
disk = FaultyDisk(sys.argv[1], errno.ENOSPC, pattern=".tmp-ckpt_*", healthy_files=1)
with disk.installed():
    sys.exit(main(sys.argv[2:]))
"""


def test_the_cli_exits_with_one_paragraph_naming_the_file_and_the_way_on(tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text(config_to_yaml(_config(tmp_path / "runs")))
    command = ["train", str(config_file)]

    def popmeta(*prefix):
        return subprocess.run(
            [sys.executable, *prefix, *command],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=180,
        )

    # The disk is full once the first checkpoint is written.
    failed = popmeta("-c", DRIVER, str(tmp_path / "runs"))
    assert failed.returncode == EX_IOERR, failed.stderr
    assert "Traceback" not in failed.stderr
    (paragraph,) = [line for line in failed.stderr.splitlines() if line.startswith("popmeta:")]
    newest = tmp_path / "runs" / "faulty" / "checkpoints" / "ckpt_00000002.npz"
    assert "ckpt_00000004.npz: No space left on device" in paragraph
    assert "Free space on the disk" in paragraph
    assert f"rerun the same command: it resumes from {newest}" in paragraph
    # The same command, once there is space again, resumes there and finishes.
    resumed = popmeta("-m", "popmeta.cli")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {newest} at step 2" in resumed.stdout


def test_a_data_file_without_the_expected_arrays_is_refused_before_anything_starts(tmp_path):
    data = tmp_path / "digits.npz"
    np.savez(data, images=np.zeros((10, 5, 5), np.float32), labels=np.zeros(10, np.int32))
    config = local_config(tmp_path / "runs", task={"kind": "image_mlp_npz", "npz_path": str(data)})

    with pytest.raises(ConfigError, match=r"task\.npz_path: .*digits\.npz: key 'images' has"):
        train(config, no_population, stream=io.StringIO())
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "sections, field",
    [
        (
            {
                "task": {
                    "kind": "image_mlp_digits",
                    "mixture": {"image_mlp_digits": 1.0, "image_mlp_npz": {"npz_path": None}},
                }
            },
            "task.mixture.image_mlp_npz.npz_path",
        ),
        (
            {"eval": {"out_of_distribution": {"mine": {"kind": "image_mlp_npz"}}}},
            "eval.out_of_distribution.mine.npz_path",
        ),
    ],
    ids=["mixture member", "evaluation setting"],
)
def test_every_data_file_the_config_names_is_checked_before_anything_starts(
    tmp_path, sections, field
):
    missing = str(tmp_path / "missing.npz")
    for section in sections.values():
        if "mixture" in section:
            section["mixture"]["image_mlp_npz"]["npz_path"] = missing
        else:
            section["out_of_distribution"]["mine"]["npz_path"] = missing
    config = local_config(tmp_path / "runs", **sections)

    with pytest.raises(ConfigError, match=rf"{re.escape(field)}: .*missing\.npz"):
        train(config, no_population, stream=io.StringIO())
    assert not (tmp_path / "runs").exists()


def test_a_lock_file_that_cannot_be_created_is_a_clear_refusal(tmp_path):
    # Past the writability probe, the lock file itself cannot be created (EROFS).
    disk = FaultyDisk(tmp_path, errno.EROFS, pattern=".lock", healthy_files=0, bytes_left=None)
    with disk.installed(), pytest.raises(RunDirectoryError, match=r"cannot create the run's lock"):
        train(_config(tmp_path), stream=io.StringIO())
    assert not (tmp_path / "faulty").exists()  # a failed start leaves nothing


def test_a_disk_full_before_the_start_stops_it_with_a_write_error_and_leaves_no_directory(
    full_disk,
):
    full_disk.fill()
    with pytest.raises(RunWriteError) as info:
        train(_config(full_disk.root), stream=io.StringIO())
    assert f"cannot write {full_disk.root / 'faulty' / 'config.yaml'}" in str(info.value)
    assert "No space left on device" in str(info.value)
    # The lock file's own failing flush neither hid that error nor kept the directory.
    assert not (full_disk.root / "faulty").exists()


START_DRIVER = """
import errno, sys
from tests.test_faults import FaultyDisk
from popmeta.cli import main
disk = FaultyDisk(sys.argv[1], errno.ENOSPC, healthy_files=0)
with disk.installed():
    sys.exit(main(sys.argv[2:]))
"""


def test_the_cli_exits_74_when_the_disk_is_full_before_the_start(tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text(config_to_yaml(_config(tmp_path / "runs")))
    failed = subprocess.run(
        [sys.executable, "-c", START_DRIVER, str(tmp_path / "runs"), "train", str(config_file)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert failed.returncode == EX_IOERR, failed.stderr
    assert "Traceback" not in failed.stderr
    (paragraph,) = [line for line in failed.stderr.splitlines() if line.startswith("popmeta:")]
    assert "config.yaml: No space left on device" in paragraph
    assert "no checkpoint was written yet" in paragraph
    assert not (tmp_path / "runs" / "faulty").exists()
