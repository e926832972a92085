"""bench/estimators.py: a ``-split`` configuration is its base configuration, tasks split, a
``-fused`` one its base configuration in fused rounds;
``--peer`` runs only configurations learned_optimization has, from a folder that holds it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from estimators import (  # noqa: E402
    CONFIGS,
    FUSED,
    FUSED_ROUNDS,
    SPLIT,
    describe,
    main,
    peer_config,
    run_one,
)


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


def test_a_fused_configuration_runs_its_base_configurations_work_in_fused_rounds():
    fused = run_one("d" + FUSED, 0.1, num_tasks=2)
    assert fused["inner_steps_per_s"] / fused["estimates_per_s"] == pytest.approx(2 * 2 * 50)
    assert describe("c" + SPLIT + FUSED) == (
        CONFIGS["c"] + f", tasks split over CPU devices, {FUSED_ROUNDS} fused rounds per call"
    )
    with pytest.raises(SystemExit, match="unknown configuration 'c-fused-split'"):
        describe("c" + FUSED + SPLIT)


def test_the_peer_runs_the_base_of_a_through_e_from_a_folder_holding_learned_optimization(
    tmp_path, monkeypatch
):
    names = ("a", "b-fused", "c-split", "c-split-fused", "d", "e")
    assert [peer_config(n) for n in names] == ["a", "b", "c", "c", "d", "e"]
    with pytest.raises(SystemExit, match=r"\(c-bf16\) has no learned_optimization namesake"):
        peer_config("c-bf16")
    argv = ["estimators.py", "--peer", str(tmp_path), "--configs", "c"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit, match=f"--peer {tmp_path}: no learned_optimization package"):
        main()
    (tmp_path / "learned_optimization").mkdir()
    monkeypatch.setattr(sys, "argv", [*argv[:-1], "e-bf16"])
    with pytest.raises(SystemExit, match=r"\(e-bf16\) has no learned_optimization namesake"):
        main()
    monkeypatch.setattr(sys, "argv", [*argv, "--compare-with", str(tmp_path)])
    with pytest.raises(SystemExit, match="give one of them"):
        main()
