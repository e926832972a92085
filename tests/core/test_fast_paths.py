"""The properties that make estimators fast, checked as behaviour rather than timed."""

from __future__ import annotations

import jax
import numpy as np

import popmeta as pm


def _pes(family=None, length=50, offset=50, num_tasks=4):
    step = pm.VectorizedLOptTruncatedStep(
        family or pm.FixedDimQuadraticFamilyData(10),
        pm.LearnableSGDM(),
        pm.ConstantTruncationSchedule(length),
        num_tasks=num_tasks,
        random_initial_iteration_offset=offset,
    )
    return pm.TruncatedPES(step, trunc_length=10, std=0.01)


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in its parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def test_a_truncation_is_one_scan_with_no_host_callbacks():
    estimator = _pes()
    theta = estimator.truncated_step.learned_opt.init(jax.random.key(0))
    state = estimator.init_worker_state(theta, jax.random.key(1))
    jaxpr = jax.make_jaxpr(estimator.estimate)(theta, state, jax.random.key(2)).jaxpr
    top_scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert [e.params["length"] for e in top_scans] == [10]
    names = {e.primitive.name for e in _equations(jaxpr)}
    assert "cond" in names  # the walk reaches the jaxprs nested in the scan
    assert not {n for n in names if "callback" in n}


def test_worker_state_is_donated_and_the_call_compiles_once():
    estimator = _pes()
    theta = estimator.truncated_step.learned_opt.init(jax.random.key(0))
    state = estimator.init_worker_state(theta, jax.random.key(1))
    for i in range(3):
        old_leaves = jax.tree_util.tree_leaves(state)
        out, _ = estimator.compute_gradient_estimate(theta, state, jax.random.key(i))
        state = out.state
        assert all(leaf.is_deleted() for leaf in old_leaves if isinstance(leaf, jax.Array))
    assert estimator.runner.jitted_estimate()._cache_size() == 1


class CountingFamily(pm.FixedDimQuadraticFamilyData):
    """Counts, at run time, how often a task is sampled (i.e. a reset is paid for)."""

    samples = 0

    def sample(self, key):
        def count(key_data):
            CountingFamily.samples += 1

        jax.debug.callback(count, jax.random.key_data(key))
        return super().sample(key)


def test_steps_without_a_reset_do_not_pay_for_task_and_optimizer_init():
    family = CountingFamily(10)
    step = pm.VectorizedLOptTruncatedStep(
        family, pm.LearnableSGDM(), pm.ConstantTruncationSchedule(6), num_tasks=4
    )
    theta = step.learned_opt.init(jax.random.key(0))
    state = step.init_step_state(theta, None, jax.random.key(1))
    unroll = jax.jit(step.unroll_step)
    jax.effects_barrier()
    CountingFamily.samples = 0
    for i in range(6):  # iterations 1..6, the 6th reports is_done: no reset yet
        state, out = unroll(theta, state, jax.random.key(i), None, None)
    jax.effects_barrier()
    assert bool(np.all(out.is_done)) and CountingFamily.samples == 0
    state, out = unroll(theta, state, jax.random.key(7), None, None)
    jax.effects_barrier()
    assert not np.any(out.mask) and CountingFamily.samples > 0


def test_on_device_data_is_sampled_inside_jit():
    estimator = _pes(pm.single_task_to_family(pm.ImageMLP_Digits8_Relu32()), num_tasks=2)
    assert estimator.truncated_step.get_batch(10) is None


def test_estimator_truncations_without_a_reset_do_not_pay_for_init():
    """The same through the antithetic members, which must not turn the cond into a select."""

    def counted_estimate(length):
        step = pm.VectorizedLOptTruncatedStep(
            CountingFamily(10),
            pm.LearnableSGDM(),
            pm.ConstantTruncationSchedule(length),
            num_tasks=4,
        )
        estimator = pm.TruncatedPES(step, trunc_length=10, std=0.01)
        theta = step.learned_opt.init(jax.random.key(0))
        state = estimator.init_worker_state(theta, jax.random.key(1))
        jax.effects_barrier()
        CountingFamily.samples = 0
        _, metrics = estimator.compute_gradient_estimate(theta, state, jax.random.key(2))
        jax.effects_barrier()
        return CountingFamily.samples, int(metrics["num_done"])

    assert counted_estimate(length=100) == (0, 0)
    samples, num_done = counted_estimate(length=6)  # every task ends at step 6, resets at 7
    assert num_done > 0 and samples > 0
