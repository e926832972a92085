"""Reads TensorBoard event files back without TensorFlow (TFRecord framing + tensorboardX protos)."""

from __future__ import annotations

import struct
from collections import defaultdict
from pathlib import Path

from tensorboardX.proto import event_pb2


def read_scalars(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """All scalar summaries under ``run_dir``: tag -> [(step, value), ...]."""
    return read_events(run_dir)[0]


def read_histograms(run_dir: str | Path) -> dict[str, list[tuple[int, int]]]:
    """All histogram summaries under ``run_dir``: tag -> [(step, number of values), ...]."""
    return read_events(run_dir)[1]


def read_events(run_dir: str | Path):
    """Scalars and histograms (as sample counts) of every event file under ``run_dir``."""
    scalars: dict[str, list[tuple[int, float]]] = defaultdict(list)
    histograms: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for path in sorted(Path(run_dir).glob("**/events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            record = data[offset + 12 : offset + 12 + length]
            offset += 12 + length + 4
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                if value.HasField("histo"):
                    histograms[value.tag].append((event.step, int(value.histo.num)))
                else:
                    scalars[value.tag].append((event.step, value.simple_value))
    return dict(scalars), dict(histograms)
