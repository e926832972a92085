"""An async run on Ray, end to end through the learner loop, read back from TensorBoard."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest

from popmeta.population.ray_population import RayPopulation
from popmeta.run_loop import train
from tests.events import read_events
from tests.population import tiny_config

pytestmark = pytest.mark.timeout(300)


def test_async_run_summaries_are_complete_and_sane(ray_session, tmp_path):
    config = tiny_config(
        mode="async",
        run_dir=str(tmp_path),
        num_steps=60,
        batch_size=2,
        max_staleness=1,
        calls_in_flight=2,
    )
    config = dataclasses.replace(
        config, train=dataclasses.replace(config.train, summary_every=10, checkpoint_every=30)
    )
    result = train(config, RayPopulation, stream=io.StringIO())
    assert result.final_step == 60 and not result.interrupted

    scalars, histograms = read_events(result.run_dir)

    def values(tag):
        assert tag in scalars, tag
        return np.array([v for _, v in scalars[tag]])

    assert [s for s, _ in scalars["meta_loss"]] == [10, 20, 30, 40, 50, 60]
    assert np.all(np.isfinite(values("meta_loss"))) and np.all(values("meta_loss") > 0)
    assert np.all(np.isfinite(values("meta_loss_by_family/fixed_dim_quadratic")))
    for tag in (
        "grad_norm",
        "update_norm",
        "theta_norm",
        "learner_update_time",
        "estimates_per_s",
        "inner_steps_per_s",
    ):
        assert np.all(values(tag) > 0), tag
    staleness_max = values("staleness_max")
    # Above the bound only where the starvation guard let a starving actor's estimate in.
    late_in_window = np.diff(values("accepted_late"), prepend=0)
    assert np.all((staleness_max <= 1) | (late_in_window > 0))
    assert np.all(values("staleness_mean") <= staleness_max)
    assert np.all(values("missing_estimates") == 0) and np.all(values("lost_in_flight") == 0)
    # Queued calls really run on older theta. Not `== 1` in some window: on a
    # loaded machine one actor can starve in every window, and the guard's
    # late estimate is then each window's maximum (test_ray_population checks
    # that estimates one version old are accepted at bound 1).
    assert np.any(staleness_max >= 1)
    assert [n for _, n in histograms["staleness"]] == [20] * 6
    dropped = values("dropped_stale")
    assert np.all(np.diff(dropped) >= 0)  # a running total
    # ... of the per-actor totals, which appear once an actor had a drop.
    by_actor = [tag for tag in scalars if tag.startswith("dropped_stale_by_actor/")]
    assert sum(values(tag)[-1] for tag in by_actor) == dropped[-1]
    # Each actor's latest task phases (2 tasks each), pooled per summary.
    assert [s for s, _ in histograms["trajectory_phase"]] == [10, 20, 30, 40, 50, 60]
    assert all(n in (2, 4) for _, n in histograms["trajectory_phase"])
    assert np.all(values("rejected_nonfinite") == 0) and np.all(values("actor_restarts") == 0)
    assert np.all(values("live_actors") == 2)
    for rank in (0, 1):
        assert np.all(values(f"inner_steps_per_s_by_actor/{rank}") > 0)
    # Theta's scalars by name, the last written from the theta the run ended with.
    for name in ("log_lr", "logit_one_minus_momentum"):
        assert [s for s, _ in scalars[f"theta/{name}"]] == [10, 20, 30, 40, 50, 60], name
        assert values(f"theta/{name}")[-1] == pytest.approx(float(result.theta[name])), name
    assert len(set(values("theta/log_lr"))) > 1  # meta-training moved it
    # inner-steps/s is estimates/s times the inner steps behind each estimate
    np.testing.assert_allclose(
        values("inner_steps_per_s"), values("estimates_per_s") * 2 * 2 * 5, rtol=1e-5
    )
