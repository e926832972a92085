"""bench/estimators.py: a ``-split`` configuration is its base configuration, tasks split."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from estimators import CONFIGS, SPLIT, describe, run_one  # noqa: E402


def test_a_split_configuration_runs_its_base_configurations_work():
    # (d) is FullES over 50-step episodes: 2 tasks x 2 members x 50 inner steps an
    # estimate, where any PES configuration of the bench takes truncations of 10.
    plain, split = run_one("d", 0.1, num_tasks=2), run_one("d" + SPLIT, 0.1, num_tasks=2)
    for run in (plain, split):
        assert run["inner_steps_per_s"] / run["estimates_per_s"] == pytest.approx(2 * 2 * 50)
    # This process has one CPU device: nothing to split over.
    assert split["devices"] == plain["devices"] == 1
    assert describe("d" + SPLIT) == CONFIGS["d"] + ", tasks split over CPU devices"
    with pytest.raises(SystemExit, match="unknown configuration 'z-split'"):
        describe("z-split")
