"""A signal while the run starts stops the start, even when Python cannot raise it where it lands.

What a stopped start leaves must be what its message says: nothing (a signal
before the run directory is the run's) or a checkpoint (a signal after).
"""

from __future__ import annotations

import gc
import io
import os
import signal
import sys

import pytest

from popmeta import run_loop
from popmeta.learner.checkpoints import list_checkpoints
from popmeta.run_loop import RunInterrupted, train
from popmeta.run_signals import StopSignals
from tests.local_run import local_config


def _record_unraisable(monkeypatch) -> list:
    seen: list = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    return seen


def test_an_interrupt_swallowed_by_a_gc_callback_is_silent_and_stops_the_start(monkeypatch):
    seen = _record_unraisable(monkeypatch)
    with StopSignals() as stop:
        fired = []

        def callback(phase: str, info: dict) -> None:
            # Where JAX's own gc callback runs when a signal arrives mid-collection.
            if phase == "start" and not fired:
                fired.append(True)
                stop._handle(signal.SIGINT, None)

        gc.callbacks.append(callback)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(callback)
        assert fired and stop.received == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            stop.begin_training()
        assert not stop.trained
    assert seen == []


def test_training_begins_when_no_signal_came():
    with StopSignals() as stop:
        stop.begin_training()
        assert stop.phase == "training" and stop.trained
        stop._handle(signal.SIGTERM, None)  # while training: a flag, read between steps
        assert stop.received == "SIGTERM"


def test_other_unraisable_errors_still_reach_the_previous_hook(monkeypatch):
    seen = _record_unraisable(monkeypatch)
    with StopSignals():

        class Broken:
            def __del__(self) -> None:
                raise ValueError("from a finaliser")

        Broken()
        gc.collect()
    assert [str(err) for err in seen] == ["from a finaliser"]


def _signal_after(monkeypatch, name: str) -> None:
    """A real SIGINT to this process as soon as the run loop's ``name`` returns."""
    original = getattr(run_loop, name)

    def and_a_signal(*args):
        value = original(*args)
        os.kill(os.getpid(), signal.SIGINT)
        return value

    monkeypatch.setattr(run_loop, name, and_a_signal)


def test_a_signal_while_the_population_starts_leaves_no_run_directory(tmp_path, monkeypatch):
    _signal_after(monkeypatch, "describe_placement")
    with pytest.raises(RunInterrupted, match="nothing of this start was kept"):
        train(local_config(tmp_path, "early"), stream=io.StringIO())
    assert not (tmp_path / "early").exists()


def test_a_signal_once_the_config_is_recorded_ends_with_a_checkpoint(tmp_path, monkeypatch):
    _signal_after(monkeypatch, "record_config")
    out = io.StringIO()
    result = train(local_config(tmp_path, "late"), stream=out)
    assert result.interrupted and result.final_step == 0
    (saved,) = list_checkpoints(tmp_path / "late" / "checkpoints")
    assert f"interrupted (SIGINT) at step 0: {saved}" in out.getvalue()


@pytest.fixture
def restored_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)
    StopSignals.process_ends_with_run = False


def test_a_process_that_ends_with_its_run_ignores_signals_once_one_stopped_it(restored_handlers):
    before = signal.getsignal(signal.SIGINT)
    StopSignals.process_ends_with_run = True
    with StopSignals():
        pass  # no signal came: the handlers are given back
    assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(KeyboardInterrupt), StopSignals() as stop:
        stop._handle(signal.SIGINT, None)  # while starting: stops at once
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_elsewhere_the_previous_handlers_come_back_after_a_stop(restored_handlers):
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt), StopSignals() as stop:
        stop._handle(signal.SIGINT, None)
    assert signal.getsignal(signal.SIGINT) is before


def test_each_phase_stops_at_once_only_once_and_ignores_the_signals_after(capfd):
    with StopSignals() as stop:
        with pytest.raises(KeyboardInterrupt):
            stop._handle(signal.SIGINT, None)  # while starting: at once
        assert stop.phase == "closing"  # what the start built is being taken down
        stop._handle(signal.SIGINT, None)  # says so
        with pytest.raises(KeyboardInterrupt):
            stop._handle(signal.SIGINT, None)  # at once
        for _ in range(3):  # Ctrl-C held down: its cleanup and message are not broken off
            stop._handle(signal.SIGINT, None)
    assert capfd.readouterr().err.count("once more after that stops at once") == 1

    with StopSignals() as stop:
        stop.begin_training()
        stop._handle(signal.SIGINT, None)  # the loop stops after this step
        with pytest.raises(KeyboardInterrupt):
            stop._handle(signal.SIGINT, None)  # at once
        stop._handle(signal.SIGINT, None)  # the loop unwinds towards its final checkpoint
        stop.phase = "saving"
        stop._handle(signal.SIGTERM, None)  # says so
        stop.phase = "closing"
        with pytest.raises(KeyboardInterrupt):
            stop._handle(signal.SIGINT, None)
        stop._handle(signal.SIGINT, None)
