"""Truncation schedules: ``truncation.kind`` -> a ``TruncationSchedule``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from popmeta.core.truncation import (
    ConstantTruncationSchedule,
    LogUniformLengthSchedule,
    NeverEndingTruncationSchedule,
    TruncationSchedule,
)
from popmeta.registry.kinds import PositiveInt, Registry

__all__ = ["TRUNCATION_SCHEDULES"]

TRUNCATION_SCHEDULES: Registry[TruncationSchedule] = Registry(
    "truncation", "Truncation schedules", "a `TruncationSchedule`", returns=TruncationSchedule
)


@TRUNCATION_SCHEDULES.register("constant", "every trajectory runs `length` steps")
def constant(length: PositiveInt = 100) -> TruncationSchedule:
    """Args:
    length: steps of every trajectory.
    """
    return ConstantTruncationSchedule(length)


def _ordered(config: Any, where: str, section: Any) -> Iterator[tuple[str, str]]:
    del config
    if section.max_length < section.min_length:
        yield (
            f"{where}.max_length",
            f"must be >= {where}.min_length ({section.min_length}), got {section.max_length!r}",
        )


@TRUNCATION_SCHEDULES.register(
    "log_uniform",
    "each trajectory's length is drawn log-uniformly in [`min_length`, `max_length`]",
    rules=_ordered,
)
def log_uniform(min_length: PositiveInt = 10, max_length: PositiveInt = 100) -> TruncationSchedule:
    """Args:
    min_length: the shortest trajectory.
    max_length: the longest trajectory.
    """
    return LogUniformLengthSchedule(min_length, max_length)


@TRUNCATION_SCHEDULES.register("never_ending", "trajectories never reset")
def never_ending() -> TruncationSchedule:
    return NeverEndingTruncationSchedule()
