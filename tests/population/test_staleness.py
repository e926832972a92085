"""How late async estimates arrive, and the warning when they would be thrown away.

The arithmetic alone, and ``popmeta validate`` saying what the population says at its start.
"""

from __future__ import annotations

from popmeta.cli import main
from popmeta.population.staleness import arrival_staleness, staleness_warning


def test_the_staleness_of_async_arrivals_is_calls_in_flight_times_actors_per_batch():
    assert arrival_staleness(num_ranks=2, calls_in_flight=2, batch_size=1) == 4
    assert arrival_staleness(num_ranks=3, calls_in_flight=1, batch_size=2) == 1.5
    # popmeta's defaults with mode: async (2 actors, 2 calls in flight, batch 1,
    # max_staleness 2): about 40% of the estimates were dropped
    # (docs/population.md), so the population warns and says what to change.
    warning = staleness_warning(2, 2, 1, 2)
    assert warning is not None
    assert "about 4 learner versions" in warning
    assert "raise batch_size to 2 or raise max_staleness to 4 or lower calls_in_flight" in warning
    # Within the bound: nothing to say (the cluster configs' batch_size 2 with two actors).
    assert staleness_warning(2, 2, 2, 2) is None
    # With max_staleness 0 no batch size is enough.
    assert "batch_size" not in staleness_warning(3, 1, 3, 0).split("To use them")[1]


def test_validate_warns_of_an_async_population_whose_estimates_arrive_too_stale(capsys):
    assert main(["validate", "--set", "population.mode=async"]) == 0
    err = capsys.readouterr().err
    assert "popmeta: warning: population: async estimates will arrive about 4" in err
    # The remedy it names silences it; sync mode has nothing to say.
    for settings in (["population.mode=async", "population.calls_in_flight=1"], []):
        assert main(["validate", *(f for s in settings for f in ("--set", s))]) == 0
        assert "warning" not in capsys.readouterr().err
