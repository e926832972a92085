"""``estimator.truncations_per_call: auto``: the rule, throwaway estimates, and runs on Ray.

The rule is plain arithmetic on measured seconds; the workers' throwaway
estimates must leave their estimates bit for bit as they were; a run sizes
its calls once, says so, records the number, and a run with that number set
is the same run.
"""

from __future__ import annotations

import dataclasses
import io
import os
import signal

import jax
import numpy as np
import pytest
import yaml

from popmeta.actors.worker import EstimatorWorker
from popmeta.config import ConfigError, config_from_dict
from popmeta.experiment import WorkerSpec, initial_theta
from popmeta.population.call_size import (
    MAX_AUTO_CALL_S,
    MAX_SIZES,
    OVERHEAD_SHARE,
    TIMED_ROUNDS,
    WARM_ROUNDS,
    CallCost,
    RoundCost,
    size_calls,
    truncations_for,
)
from popmeta.population.ray_population import RayPopulation
from popmeta.run_loop import train
from tests.events import read_scalars
from tests.local_run import local_config
from tests.population import population_of, tiny_config

pytestmark = pytest.mark.timeout(600)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


# ---------------------------------------------------------------------- the rule


def test_calls_get_the_fewest_truncations_that_make_the_per_call_cost_a_small_share():
    for cost in (CallCost(1e-4, 0.0, 2e-3), CallCost(3e-5, 3e-4, 2e-3), CallCost(2e-5, 0, 4e-4)):
        n = truncations_for(cost)
        assert cost.overhead_s <= OVERHEAD_SHARE * cost.compute_s(n) * (1 + 1e-9)
        assert cost.overhead_s > OVERHEAD_SHARE * cost.compute_s(n - 1)
    # A call that is already long enough runs one truncation; none runs fewer.
    assert truncations_for(CallCost(0.05, 0.0, 1e-3)) == 1
    assert truncations_for(CallCost(0.05, 0.0, 0.0)) == 1
    # A call whose cost would ask for more than MAX_AUTO_CALL_S of compute is capped.
    capped = truncations_for(CallCost(1e-3, 0.0, 10 * MAX_AUTO_CALL_S))
    assert capped == round(MAX_AUTO_CALL_S / 1e-3)


class _Linear:
    """Rounds that cost ``call_s + n * truncation_s`` of compute and ``overhead_s`` more,
    the first ``WARM_ROUNDS`` of each size 100x slower (they compile): what a population's
    ``throwaway_round`` measures, without the noise."""

    def __init__(self, cost: CallCost, can_time: bool = True):
        self.cost, self.can_time = cost, can_time
        self.sizes: list[int] = []

    def throwaway_round(self, theta, num_truncations):
        del theta
        if not self.can_time:
            return None
        warm = self.sizes.count(num_truncations) < WARM_ROUNDS
        self.sizes.append(num_truncations)
        compute = self.cost.compute_s(num_truncations)
        return RoundCost(compute * (100 if warm else 1), self.cost.overhead_s)


def test_sizing_tells_a_truncation_from_the_calls_own_compute():
    # A call's own compute (0.3 ms) is ten truncations': timed at one truncation
    # alone, it would look like a truncation and the calls would come out short.
    cost = CallCost(truncation_s=3e-5, call_s=3e-4, overhead_s=2e-3)
    population = _Linear(cost)
    size = size_calls(population, theta=None)
    assert size.truncations_per_call == truncations_for(cost)
    np.testing.assert_allclose(size.cost, cost, rtol=1e-6)
    # Each size's warm rounds are left out; the size that one truncation's
    # whole compute asks for is timed, then the chosen size itself.
    guess = truncations_for(CallCost(3.3e-4, 0, 2e-3))
    assert sorted(set(population.sizes)) == [1, guess, size.truncations_per_call]
    assert len(population.sizes) == 3 * (WARM_ROUNDS + TIMED_ROUNDS)
    assert f"auto -> {size.truncations_per_call} " in size.describe()
    assert f"Set it to {size.truncations_per_call}" in size.describe()
    # A long call is timed once; workers that cannot time one run one truncation.
    long = _Linear(CallCost(0.05, 0.0, 2e-3))
    assert size_calls(long, theta=None).truncations_per_call == 1 and set(long.sizes) == {1}
    unmeasured = size_calls(_Linear(cost, can_time=False), theta=None)
    assert unmeasured.truncations_per_call == 1 and unmeasured.cost is None
    assert "host batches" in unmeasured.describe()


class _Noisy(_Linear):
    """Rounds whose compute reads the same at every size up to ``flat_up_to``
    truncations (timer noise on a busy machine), and rises as it does after."""

    def __init__(self, cost: CallCost, flat_up_to: int):
        super().__init__(cost)
        self.flat_up_to = flat_up_to

    def compute_s(self, num_truncations: int) -> float:
        return self.cost.compute_s(max(num_truncations, self.flat_up_to))

    def throwaway_round(self, theta, num_truncations):
        warm = self.sizes.count(num_truncations) < WARM_ROUNDS
        self.sizes.append(num_truncations)
        compute = self.compute_s(num_truncations)
        return RoundCost(compute * (100 if warm else 1), self.cost.overhead_s)


def test_sizing_never_chooses_a_size_it_did_not_time_nor_one_past_the_longest_call():
    # Timed as flat at small sizes, a truncation looks free: a line through two
    # such rounds would ask for millions of truncations per call.
    cost = CallCost(truncation_s=2e-5, call_s=3e-4, overhead_s=1.5e-3)
    noisy = _Noisy(cost, flat_up_to=40)
    size = size_calls(noisy, theta=None)
    assert size.truncations_per_call in noisy.sizes
    assert len(set(noisy.sizes)) <= MAX_SIZES
    chosen = noisy.compute_s(size.truncations_per_call)
    assert cost.overhead_s <= OVERHEAD_SHARE * chosen <= OVERHEAD_SHARE * MAX_AUTO_CALL_S
    # Where the cost is too large for any call within MAX_AUTO_CALL_S, the
    # largest timed size is chosen, and its compute stays within it.
    costly = _Linear(CallCost(1e-3, 0.0, 10 * MAX_AUTO_CALL_S))
    size = size_calls(costly, theta=None)
    assert size.truncations_per_call == max(costly.sizes)
    assert costly.cost.compute_s(size.truncations_per_call) <= MAX_AUTO_CALL_S


def test_the_config_takes_auto_or_a_positive_number():
    assert config_from_dict({}).estimator.truncations_per_call == "auto"
    assert (
        config_from_dict({"estimator": {"truncations_per_call": 7}}).estimator.truncations_per_call
        == 7
    )
    for bad, message in ((0, "must be > 0"), ("fast", "expected int or one of 'auto'")):
        with pytest.raises(ConfigError, match=rf"estimator\.truncations_per_call: {message}"):
            config_from_dict({"estimator": {"truncations_per_call": bad}})


# ---------------------------------------------------------------------- throwaway estimates


def _worker(truncations_per_call, rank=1):
    config = tiny_config(num_tasks=3)
    config = config.with_truncations_per_call(truncations_per_call)
    return config, EstimatorWorker(WorkerSpec.of(config), rank)


def test_throwaway_estimates_leave_the_workers_estimates_bit_for_bit():
    config, plain = _worker(1)
    _, probed = _worker("auto")
    theta = jax.tree_util.tree_map(np.asarray, initial_theta(WorkerSpec.of(config).sections))
    for version in range(3):
        for _ in range(2):
            estimate = probed.throwaway(1, theta, keep=True)
            assert estimate is not None and estimate.metrics["compute_time_s"] > 0
        np.testing.assert_equal(
            _leaves(probed.compute(theta, version).grad),
            _leaves(plain.compute(theta, version).grad),
        )
    # Switched to 3 per call, it computes what a worker built with 3 computes
    # from the same state: exported after the same calls, loaded into one of 3.
    _, three = _worker(3)
    three.load_state(plain.export_state())
    probed.use_truncations_per_call(3)
    assert probed.steps_per_estimate == three.steps_per_estimate == 3 * plain.steps_per_estimate
    for version in range(3, 5):
        a, b = probed.compute(theta, version), three.compute(theta, version)
        np.testing.assert_equal(_leaves(a.grad), _leaves(b.grad))
        assert a.mean_loss == b.mean_loss


# ---------------------------------------------------------------------- runs on Ray


def test_a_ray_population_sizes_its_calls_and_replacements_keep_the_size(ray_session):
    config = tiny_config(num_actors=2, max_actor_restarts=2)
    theta = jax.tree_util.tree_map(np.asarray, initial_theta(WorkerSpec.of(config).sections))
    with population_of(config) as population:
        one = population.steps_per_estimate
        cost = population.throwaway_round(theta, 3)
        assert cost is not None and cost.compute_s > 0 and cost.overhead_s >= 0
        population.use_truncations_per_call(4)
        assert population.steps_per_estimate == 4 * one
        info = population.describe_actors()
        assert [i.steps_per_estimate for i in info] == [4 * one] * 2
        # A replacement is built from the sized spec.
        os.kill(info[0].pid, signal.SIGKILL)
        version, restarted = 0, 0
        while not restarted:
            restarted += population.gather(theta, version).restarted
            version += 1
        replaced = population.describe_actors()  # waits for the replacement to report
        assert replaced[0].restart == 1 and replaced[0].steps_per_estimate == 4 * one


def _run(tmp_path, name, truncations_per_call, num_steps=6):
    config = tiny_config(run_dir=str(tmp_path), num_steps=num_steps)
    config = dataclasses.replace(
        config.with_truncations_per_call(truncations_per_call),
        name=name,
        train=dataclasses.replace(config.train, summary_every=3, checkpoint_every=3),
    )
    out = io.StringIO()
    return train(config, RayPopulation, stream=out), out.getvalue()


def _recorded(tmp_path, name):
    return yaml.safe_load((tmp_path / name / "config.yaml").read_text())["estimator"][
        "truncations_per_call"
    ]


def test_an_auto_run_says_records_and_logs_its_size_and_equals_a_run_with_it_set(
    ray_session, tmp_path, capsys
):
    auto, out = _run(tmp_path, "auto", "auto")
    chosen = _recorded(tmp_path, "auto")
    assert isinstance(chosen, int) and chosen >= 1
    assert f"estimator.truncations_per_call: auto -> {chosen} " in out
    assert f"trunc/call={chosen}" in capsys.readouterr().err  # the progress line
    scalars = read_scalars(tmp_path / "auto")
    assert [v for _, v in scalars["truncations_per_call"]] == [chosen, chosen]
    # inner-steps/s counts every truncation: 2 members x 2 tasks x 5 steps each.
    np.testing.assert_allclose(
        [v for _, v in scalars["inner_steps_per_s"]],
        [v * 2 * 2 * 5 * chosen for _, v in scalars["estimates_per_s"]],
        rtol=1e-5,
    )
    # The recorded number makes the same run again, bit for bit.
    pinned, out = _run(tmp_path, "pinned", chosen)
    assert "auto -> " not in out
    np.testing.assert_equal(_leaves(auto.theta), _leaves(pinned.theta))
    # A resume keeps the recorded number: nothing is measured again.
    resumed, out = _run(tmp_path, "auto", "auto", num_steps=9)
    assert resumed.final_step == 9 and "auto -> " not in out
    assert f"trunc/call={chosen}" in capsys.readouterr().err
    assert _recorded(tmp_path, "auto") == chosen


def test_the_local_engine_sizes_its_calls_too(tmp_path):
    config = local_config(tmp_path, estimator={"truncations_per_call": "auto"})
    out = io.StringIO()
    result = train(config, stream=out)
    chosen = _recorded(tmp_path, "ident")
    assert result.final_step == 4 and isinstance(chosen, int) and chosen >= 1
    assert f"estimator.truncations_per_call: auto -> {chosen} " in out.getvalue()
