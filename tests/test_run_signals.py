"""A signal while the run starts stops the start, even when Python cannot raise it where it lands."""

from __future__ import annotations

import gc
import signal
import sys

import pytest

from popmeta.run_signals import StopSignals


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
