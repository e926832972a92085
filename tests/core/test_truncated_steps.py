"""The truncation and truncated-step behaviour users of the reference notebooks rely on."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from popmeta import (
    SGD,
    Adam,
    ConstantTruncationSchedule,
    FixedDimQuadraticFamilyData,
    ImageMLP_Digits8_Relu32,
    LearnableSGDM,
    LogUniformLengthSchedule,
    MLPLOpt,
    MLPLOptState,
    NeverEndingTruncationSchedule,
    TruncatedStep,
    TruncatedUnrollOut,
    VectorizedLOptTruncatedStep,
    VectorizedTruncatedStep,
    single_task_to_family,
    vec_get_batch,
)
from popmeta.core.lopt_truncated_step import LOptTruncatedState


def test_constant_schedule_reports_done_from_its_length_on():
    sched = ConstantTruncationSchedule(10)
    state = sched.init(jax.random.key(0), None)
    done = []
    for step in range(12):
        state, is_done = sched.next_state(state, step, jax.random.key(step), None)
        done.append(bool(is_done))
    assert done == [False] * 10 + [True, True]


def test_log_uniform_schedule_stays_in_range_and_redraws_when_done():
    sched = LogUniformLengthSchedule(5, 40)
    keys = jax.random.split(jax.random.key(0), 2000)
    lengths = np.asarray(jax.vmap(lambda k: sched.init(k, None).length)(keys))
    assert lengths.min() >= 5 and lengths.max() <= 40
    # log-uniform: about as many lengths in [5, 14) as in [14, 40]
    assert 0.35 < np.mean(lengths < 14) < 0.65
    state = sched.init(jax.random.key(1), None)
    still, not_done = sched.next_state(state, state.length - 1, jax.random.key(2), None)
    assert not bool(not_done) and int(still.length) == int(state.length)
    redrawn = [
        int(sched.next_state(state, state.length, jax.random.key(k), None)[0].length)
        for k in range(20)
    ]
    assert len(set(redrawn)) > 1


def test_never_ending_schedule_is_never_done():
    sched = NeverEndingTruncationSchedule()
    state = sched.init(jax.random.key(0), None)
    assert not bool(sched.next_state(state, 10**9, jax.random.key(0), None)[1])


class EveryFiveSteps(TruncatedStep):
    """The notebook's hand-written step: a counter that resets every 5 iterations."""

    def init_step_state(self, theta, outer_state, key, theta_is_vector=False):
        return jnp.asarray(0, jnp.int32)

    def unroll_step(self, theta, unroll_state, key, data, outer_state, theta_is_vector=False):
        resetting = unroll_state >= 5
        iteration = jnp.where(resetting, 0, unroll_state + 1)
        out = TruncatedUnrollOut(
            loss=jnp.where(resetting, 0.0, theta * iteration),
            is_done=iteration >= 5,
            task_param=None,
            iteration=iteration,
            mask=~resetting,
        )
        return iteration, out


def _run(step, num_steps, theta=1.0):
    state = step.init_step_state(theta, None, jax.random.key(0))
    outs = []
    for i in range(num_steps):
        state, out = step.unroll_step(theta, state, jax.random.key(i), None, None)
        outs.append(out)
    return outs


def test_hand_written_truncated_step_resets_after_done():
    outs = _run(EveryFiveSteps(), 10)
    assert [int(o.iteration) for o in outs] == [1, 2, 3, 4, 5, 0, 1, 2, 3, 4]
    assert [bool(o.is_done) for o in outs] == [False] * 4 + [True] + [False] * 5
    assert float(outs[5].loss) == 0.0 and not bool(outs[5].mask)
    assert all(bool(o.mask) for i, o in enumerate(outs) if i != 5)


def test_vectorized_hand_written_step_runs_each_task():
    outs = _run(VectorizedTruncatedStep(EveryFiveSteps(), 3), 10)
    iterations = np.stack([np.asarray(o.iteration) for o in outs])
    assert iterations.shape == (10, 3)
    np.testing.assert_array_equal(
        iterations, np.tile([[1], [2], [3], [4], [5], [0], [1], [2], [3], [4]], 3)
    )
    assert not np.asarray(outs[5].mask).any() and np.asarray(outs[4].is_done).all()


def _lopt_step(num_tasks=3, offset=5, length=5):
    return VectorizedLOptTruncatedStep(
        FixedDimQuadraticFamilyData(10),
        LearnableSGDM(),
        ConstantTruncationSchedule(length),
        num_tasks=num_tasks,
        random_initial_iteration_offset=offset,
    )


def test_lopt_step_offsets_advance_and_reset_one_task_at_a_time():
    step = _lopt_step()
    theta = step.learned_opt.init(jax.random.key(0))
    state = step.init_step_state(theta, None, jax.random.key(4))
    start = np.asarray(state.inner_step)
    assert start.min() >= 0 and start.max() < 5 and len(set(start.tolist())) > 1

    unroll = jax.jit(step.unroll_step)
    expected = start.copy()
    updates = np.zeros(3, int)  # updates applied since the task's (re)start
    pending = np.zeros(3, bool)
    for i in range(12):
        state, out = unroll(theta, state, jax.random.key(i), None, None)
        expected = np.where(pending, 0, expected + 1)
        updates = np.where(pending, 0, updates + 1)
        np.testing.assert_array_equal(np.asarray(out.iteration), expected)
        np.testing.assert_array_equal(np.asarray(state.inner_step), expected)
        np.testing.assert_array_equal(np.asarray(state.inner_opt_state.iteration), updates)
        np.testing.assert_array_equal(np.asarray(out.mask), ~pending)
        assert np.all(np.asarray(out.loss)[pending] == 0.0)
        assert np.all(np.asarray(out.loss)[~pending] > 0.0)
        pending = np.asarray(out.is_done)
        np.testing.assert_array_equal(pending, expected >= 5)


def test_the_offset_moves_only_the_truncation_counter():
    """As in the reference: a task at offset k is a fresh task whose optimizer is at iteration 0."""
    step = _lopt_step(num_tasks=64, offset=50, length=100)
    theta = step.learned_opt.init(jax.random.key(0))
    state = step.init_step_state(theta, None, jax.random.key(1))
    offsets = np.asarray(state.inner_step)
    assert offsets.min() >= 0 and offsets.max() < 50 and len(set(offsets.tolist())) > 10
    np.testing.assert_array_equal(np.asarray(state.inner_opt_state.iteration), 0)
    # init_step_state is init_episode_state on its first key, then the offsets:
    # tasks, params and optimizer states are those of fresh tasks.
    fresh = step.init_episode_state(theta, None, jax.random.split(jax.random.key(1))[0])
    np.testing.assert_array_equal(np.asarray(fresh.inner_step), 0)
    jax.tree.map(np.testing.assert_array_equal, fresh.replace(inner_step=offsets), state)
    stepped, out = step.unroll_step(theta, state, jax.random.key(2), None, None)
    stepped_fresh, out_fresh = step.unroll_step(theta, fresh, jax.random.key(2), None, None)
    np.testing.assert_array_equal(np.asarray(out.iteration), offsets + 1)
    np.testing.assert_array_equal(np.asarray(out_fresh.iteration), 1)
    np.testing.assert_array_equal(out.loss, out_fresh.loss)
    jax.tree.map(
        np.testing.assert_array_equal, stepped.inner_opt_state, stepped_fresh.inner_opt_state
    )
    # An offset at or past the length ends the trajectory on its first step.
    late = step.init_episode_state(theta, None, jax.random.key(1)).replace(
        inner_step=jnp.full((64,), 99, jnp.int32)
    )
    _, out = step.unroll_step(theta, late, jax.random.key(2), None, None)
    assert np.asarray(out.is_done).all() and np.asarray(out.mask).all()
    np.testing.assert_allclose(step.trajectory_phase(late), 0.99)


def test_notebook_api_outer_init_inner_step_and_replace():
    """What the reference notebooks call: outer_init -> theta, unroll_state.inner_step, .replace."""
    step = VectorizedLOptTruncatedStep(
        FixedDimQuadraticFamilyData(10),
        MLPLOpt(),
        ConstantTruncationSchedule(10),
        num_tasks=4,
        random_initial_iteration_offset=10,
    )
    theta = step.outer_init(jax.random.key(0))
    expected = MLPLOpt().init(jax.random.key(0))
    assert jax.tree.structure(theta) == jax.tree.structure(expected)
    jax.tree.map(np.testing.assert_array_equal, theta, expected)

    unroll_state = step.init_step_state(theta, None, jax.random.key(1))
    assert unroll_state.inner_step.shape == (4,) and unroll_state.inner_step.dtype == jnp.int32
    assert "inner_step" in repr(unroll_state)
    assert isinstance(unroll_state.inner_opt_state, MLPLOptState)
    for _ in range(3):
        unroll_state, _ = step.unroll_step(theta, unroll_state, jax.random.key(2), None, None)
    # the notebook's edit of an optimizer state, on the state the unroll carries
    opt_state = unroll_state.inner_opt_state.replace(iteration=jnp.zeros((4,), jnp.int32))
    assert isinstance(opt_state, MLPLOptState)
    np.testing.assert_array_equal(opt_state.iteration, 0)
    np.testing.assert_array_equal(opt_state.params, unroll_state.inner_opt_state.params)
    unroll_state = unroll_state.replace(inner_opt_state=opt_state)
    assert isinstance(unroll_state, LOptTruncatedState)
    np.testing.assert_array_equal(unroll_state.inner_opt_state.iteration, 0)
    for opt in (SGD(0.1), Adam(0.1)):
        state = opt.init(jnp.ones(3)).replace(iteration=jnp.asarray(7, jnp.int32))
        assert int(opt.update(state, jnp.ones(3)).iteration) == 8
    trunc_state = ConstantTruncationSchedule(5).init(jax.random.key(0)).replace(length=7)
    assert int(trunc_state.length) == 7
    with pytest.raises(ValueError, match="no_such_field"):
        opt_state.replace(no_such_field=1)


def test_lopt_step_reset_draws_a_new_task():
    step = _lopt_step(num_tasks=2, offset=0, length=2)
    theta = step.learned_opt.init(jax.random.key(0))
    state = step.init_step_state(theta, None, jax.random.key(1))
    params = []
    for i in range(3):
        state, out = step.unroll_step(theta, state, jax.random.key(i), None, None)
        params.append(np.asarray(out.task_param))
    assert not np.allclose(params[2], params[1])  # the third step reset both tasks


def test_lopt_step_unrolls_equally_on_device_and_host_data():
    digits = single_task_to_family(ImageMLP_Digits8_Relu32())
    theta = LearnableSGDM(initial_lr=0.1).init(jax.random.key(0))
    step = VectorizedLOptTruncatedStep(
        digits,
        LearnableSGDM(initial_lr=0.1),
        ConstantTruncationSchedule(20),
        num_tasks=2,
        host_data=True,
    )
    assert step.get_batch() is not None
    state = step.init_step_state(theta, None, jax.random.key(0))
    batch = vec_get_batch(digits, 2, "train")
    _, out = jax.jit(step.unroll_step)(theta, state, jax.random.key(1), batch, None)
    assert np.all(np.isfinite(np.asarray(out.loss))) and np.asarray(out.mask).all()
    on_device = VectorizedLOptTruncatedStep(
        digits, LearnableSGDM(initial_lr=0.1), ConstantTruncationSchedule(20), num_tasks=2
    )
    assert on_device.get_batch(5) is None
    _, out_device = jax.jit(on_device.unroll_step)(theta, state, jax.random.key(1), None, None)
    assert np.all(np.isfinite(np.asarray(out_device.loss)))
