"""TensorBoard summaries written with tensorboardX."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from tensorboardX import SummaryWriter

__all__ = ["Summaries"]


class Summaries:
    """Scalar summaries under ``run_dir``; ``close()`` drains the writer's queue."""

    def __init__(self, run_dir: str | Path, flush_secs: int = 5):
        self._writer = SummaryWriter(str(run_dir), flush_secs=flush_secs)

    def scalars(self, step: int, values: Mapping[str, float], prefix: str = "") -> None:
        for name, value in values.items():
            self._writer.add_scalar(f"{prefix}{name}", float(value), step)

    def close(self) -> None:
        self._writer.close()
