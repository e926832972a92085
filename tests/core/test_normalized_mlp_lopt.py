"""NormalizedMLPLOpt: per-tensor RMS-normalized updates, a learned step-size schedule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from popmeta.core.learned_optimizers import NormalizedMLPLOpt, as_optax
from popmeta.core.learned_optimizers.features import mirror_signs, per_parameter_features

PARAMS = {
    "w": jax.random.normal(jax.random.key(1), (7, 5)),
    "b": jnp.linspace(-1.0, 1.0, 5),
    "scale": jnp.float32(0.3),
}


#: Weights of fan-in 256, 36 (a 3x3 kernel over 4 channels), 64 and 16, and a bias.
FAN_IN_PARAMS = {
    "wide": jax.random.normal(jax.random.key(2), (256, 10)),
    "kernel": jax.random.normal(jax.random.key(3), (3, 3, 4, 4)),
    "at_base": jax.random.normal(jax.random.key(4), (64, 32)),
    "narrow": jax.random.normal(jax.random.key(5), (16, 32)),
    "b": jnp.linspace(-1.0, 1.0, 10),
}


def _grad(params, i: int, scale: float = 1.0):
    return jax.tree.map(lambda p: scale * jnp.sin(3.0 * p + i) + 0.1 * i, params)


def _rms(x) -> float:
    return float(jnp.sqrt(jnp.mean(jnp.square(x))))


def _random_theta(lopt: NormalizedMLPLOpt, scale: float):
    """Theta with every array replaced by large random values (nothing like an untrained one)."""
    theta = lopt.init(jax.random.key(0))
    leaves, treedef = jax.tree.flatten(theta)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    noisy = [
        leaf + scale * jax.random.normal(k, leaf.shape)
        for leaf, k in zip(leaves, keys, strict=True)
    ]
    return treedef.unflatten(noisy)


def test_untrained_it_is_adam_normalized_per_tensor():
    lopt = NormalizedMLPLOpt(initial_lr=0.02)
    opt = lopt.opt_fn(lopt.init(jax.random.key(0)))
    adam = optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8)
    state, adam_state = opt.init(PARAMS, num_steps=50), adam.init(PARAMS)
    step = jax.jit(opt.step)
    for i in range(12):
        grad = _grad(opt.get_params(state), i)
        updates, state = step(state, grad, loss=jnp.float32(5.0 / (i + 1)))
        direction, adam_state = adam.update(grad, adam_state)
        expected = jax.tree.map(lambda u: -0.02 * u / jnp.sqrt(jnp.mean(u**2)), direction)
        for name in PARAMS:
            np.testing.assert_allclose(updates[name], expected[name], rtol=2e-5, atol=1e-9)
    assert int(state.iteration) == 12


def test_with_step_rms_at_most_untrained_it_is_adam_clipped_per_tensor():
    """Adam's update divided by max(its RMS over the tensor, 1): Adam's own, whose RMS is at most 1."""
    lopt = NormalizedMLPLOpt(initial_lr=0.02, step_rms="at_most")
    opt = lopt.opt_fn(lopt.init(jax.random.key(0)))
    adam = optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8)
    state, adam_state = opt.init(PARAMS, num_steps=50), adam.init(PARAMS)
    step = jax.jit(opt.step)
    smallest = 1.0
    for i in range(12):
        # Gradients whose sign flips every step: Adam's update RMS falls well below 1.
        grad = _grad(opt.get_params(state), i, scale=(-1.0) ** i)
        updates, state = step(state, grad, loss=jnp.float32(5.0 / (i + 1)))
        direction, adam_state = adam.update(grad, adam_state)
        for name in PARAMS:
            expected = -0.02 * direction[name] / max(_rms(direction[name]), 1.0)
            np.testing.assert_allclose(updates[name], expected, rtol=2e-5, atol=1e-9)
            smallest = min(smallest, _rms(updates[name]) / 0.02)
    assert smallest < 0.5  # steps shrank with the signal, as the "equal" rule's never do
    with pytest.raises(ValueError, match="step_rms"):
        NormalizedMLPLOpt(step_rms="clip")


def test_with_correction_scale_adam_the_learned_part_of_a_step_shrinks_with_adams():
    """The MLP's correction, in units of Adam's step, cannot keep steps large once Adam's shrink."""
    rules = {
        c: NormalizedMLPLOpt(initial_lr=0.01, step_rms="at_most", correction_scale=c)
        for c in ("unit", "adam")
    }
    theta = rules["unit"].init(jax.random.key(0))
    # A learned rule's output layer (its corrections and log-scales of order 0.1-1, as measured
    # for meta-trained ones), with the step-size schedule left at initial_lr.
    output = theta["mlp"]["linear_2"]
    output["w"] = 0.3 * jax.random.normal(jax.random.key(5), output["w"].shape)
    opts = {c: rule.opt_fn(theta) for c, rule in rules.items()}
    adam = optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8)
    state, adam_state = opts["unit"].init(PARAMS, num_steps=100), adam.init(PARAMS)
    for i in range(40):
        # Pure noise: the gradient's sign flips every step, and Adam's steps shrink to ~1/20.
        grad = jax.tree.map(lambda p, i=i: (-1.0) ** i * (1.5 + jnp.sin(3.0 * p)), state.params)
        direction, adam_state = adam.update(grad, adam_state)
        relative, _ = opts["adam"].step(state, grad, loss=jnp.float32(1.0))
        absolute, state = opts["unit"].step(state, grad, loss=jnp.float32(1.0))
        if i == 0:
            # Adam's first direction is sign(g), of RMS 1: both scales of correction agree.
            for name in PARAMS:
                np.testing.assert_allclose(relative[name], absolute[name], rtol=1e-5, atol=1e-9)
    for name in PARAMS:
        assert _rms(direction[name]) < 0.1
        assert _rms(absolute[name]) > 0.2 * 0.01  # the unit-scale correction keeps steps large
        assert _rms(relative[name]) < 0.25 * _rms(absolute[name])
    with pytest.raises(ValueError, match="correction_scale"):
        NormalizedMLPLOpt(correction_scale="tensor")


def test_with_run_length_feature_steps_depend_on_the_run_length_not_only_the_fraction():
    """At the first step every other feature is the same for a 50- and a 500-step run."""
    for reads_length in (False, True):
        lopt = NormalizedMLPLOpt(initial_lr=0.01, run_length_feature=reads_length)
        assert lopt.num_global_features == 10 + reads_length
        opt = lopt.opt_fn(_random_theta(lopt, 1.0))
        grad = _grad(PARAMS, 0)
        short, _ = opt.step(opt.init(PARAMS, num_steps=50), grad, loss=jnp.float32(2.0))
        long, _ = opt.step(opt.init(PARAMS, num_steps=500), grad, loss=jnp.float32(2.0))
        differences = [float(jnp.max(jnp.abs(short[name] - long[name]))) for name in PARAMS]
        if reads_length:
            assert max(differences) > 1e-4
        else:
            assert max(differences) == 0.0


def test_element_clip_bounds_one_parameters_step_and_leaves_adams_own_alone():
    """RMS normalization lets the one element of 64 that gets a gradient move 8 step sizes."""
    params = {"w": jnp.zeros((8, 8))}
    spike = {"w": jnp.zeros((8, 8)).at[3, 4].set(2.0)}
    steps = {}
    for clip in (None, 3.0):
        lopt = NormalizedMLPLOpt(initial_lr=0.01, element_clip=clip)
        opt = lopt.opt_fn(lopt.init(jax.random.key(0)))
        updates, _ = opt.step(opt.init(params, num_steps=20), spike, loss=jnp.float32(1.0))
        steps[clip] = float(jnp.max(jnp.abs(updates["w"])))
    np.testing.assert_allclose(steps[None], 0.01 * 8.0, rtol=1e-5)
    np.testing.assert_allclose(steps[3.0], 0.01 * 3.0, rtol=1e-5)

    # A lone gradient after a long silence takes one element of Adam's direction towards
    # (1 - 0.9) / sqrt(1 - 0.999) = 3.16 (Adam's bound for gradients that grow step after step
    # is 7.27): a bound above the step it takes here changes nothing of the untrained rule.
    flipping = jnp.where(jnp.arange(64).reshape(8, 8) % 2 == 0, 0.01, -0.01).at[3, 4].set(0.0)
    last = {}
    for clip in (None, 3.2):
        lopt = NormalizedMLPLOpt(initial_lr=0.01, step_rms="at_most", element_clip=clip)
        opt = lopt.opt_fn(lopt.init(jax.random.key(0)))
        step = jax.jit(opt.step)
        state = opt.init(params, num_steps=2001)
        for i in range(2000):
            _, state = step(state, {"w": (-1) ** i * flipping}, loss=jnp.float32(1.0))
        last[clip], _ = step(state, {"w": flipping.at[3, 4].set(1.0)}, loss=jnp.float32(1.0))
    assert float(jnp.max(jnp.abs(last[None]["w"]))) > 0.01 * 2.9
    np.testing.assert_array_equal(last[3.2]["w"], last[None]["w"])
    with pytest.raises(ValueError, match="element_clip"):
        NormalizedMLPLOpt(element_clip=0.0)


def _reference_guards(losses: list[float], threshold: float, relative: float = 0.0) -> list[float]:
    """The brake's guard after each loss, from its definition (positive losses)."""
    ema, lowest, guard, guards = losses[0], losses[0], 1.0, []
    for i, loss in enumerate(losses):
        ema = ema if i == 0 else 0.9 * ema + 0.1 * loss  # the state's EMA, this step's loss in it
        lowest = min(lowest, ema)
        if ema - lowest > relative * lowest:
            guard = min(guard, threshold / ((ema - lowest) / losses[0]))
        guards.append(guard)
    return guards


def test_loss_guard_brakes_every_later_step_by_the_largest_climb_and_never_releases():
    """guard = min over the run of min(1, g / c), c the loss EMA's climb above its lowest, in first losses."""
    losses = [2.0] + [0.2] * 30 + [1.0] * 10 + [0.2] * 10  # falls, climbs, falls again
    expected = _reference_guards(losses, 0.05)
    assert expected[30] == 1.0 and expected[40] < 0.5 and expected[-1] == expected[40]

    plain, guarded = (
        NormalizedMLPLOpt(initial_lr=0.02),
        NormalizedMLPLOpt(initial_lr=0.02, loss_guard=0.05),
    )
    theta = _random_theta(plain, 1.0)
    opts = {"plain": plain.opt_fn(theta), "guarded": guarded.opt_fn(theta)}
    steps = {name: jax.jit(opt.step) for name, opt in opts.items()}
    state = opts["plain"].init(PARAMS, num_steps=len(losses))
    guarded_state = opts["guarded"].init(PARAMS, num_steps=len(losses))
    for i, loss in enumerate(losses):
        # Both step from the same parameters and accumulators: only the step size may differ.
        grad, before = _grad(state.params, i), state
        plain_updates, state = steps["plain"](before, grad, loss=jnp.float32(loss))
        braked = before._replace(
            guard=guarded_state.guard, lowest_loss_ema=guarded_state.lowest_loss_ema
        )
        guarded_updates, guarded_state = steps["guarded"](braked, grad, loss=jnp.float32(loss))
        np.testing.assert_allclose(float(guarded_state.guard), expected[i], rtol=1e-5)
        for name in PARAMS:
            np.testing.assert_allclose(
                guarded_updates[name], expected[i] * plain_updates[name], rtol=1e-5, atol=1e-9
            )
    # Without a guard the state holds nothing of it: checkpointed worker states keep their layout.
    assert state.guard is None and state.lowest_loss_ema is None

    lossless = NormalizedMLPLOpt(loss_features=False, loss_guard=0.05)
    assert lossless.uses_loss and lossless.num_features == plain.num_features - 2
    with pytest.raises(ValueError, match="loss_guard"):
        NormalizedMLPLOpt(loss_guard=0.0)


def test_loss_guard_relative_lets_climbs_within_q_times_the_lowest_ema_through():
    """A climb counts only once it exceeds q times the lowest EMA: noise far above zero does not brake."""
    losses = [2.0] + [1.0] * 30 + [1.3] * 10 + [0.2] * 30 + [1.0] * 10
    rules = {
        q: NormalizedMLPLOpt(initial_lr=0.02, loss_guard=0.05, loss_guard_relative=q)
        for q in (0.0, 1.0)
    }
    theta = _random_theta(rules[0.0], 1.0)
    for q, rule in rules.items():
        expected = _reference_guards(losses, 0.05, relative=q)
        opt = rule.opt_fn(theta)
        step, state = jax.jit(opt.step), opt.init(PARAMS, num_steps=len(losses))
        guards = []
        for i, loss in enumerate(losses):
            _, state = step(state, _grad(state.params, i), loss=jnp.float32(loss))
            guards.append(float(state.guard))
        np.testing.assert_allclose(guards, expected, rtol=1e-5)
        if q == 0.0:
            assert guards[40] < 0.7  # the 30% climb on a loss of 1 brakes the step
        else:
            assert guards[40] == 1.0 and guards[-1] < 0.3  # it passes; the fivefold climb does not
    with pytest.raises(ValueError, match="loss_guard_relative"):
        NormalizedMLPLOpt(loss_guard_relative=1.0)  # no brake to relax
    with pytest.raises(ValueError, match="loss_guard_relative"):
        NormalizedMLPLOpt(loss_guard=0.05, loss_guard_relative=-1.0)


def test_fan_in_base_shrinks_only_the_steps_of_weights_with_more_inputs_than_the_base():
    """A weight of fan-in n > B steps (B / n) ** power of the rule's step; the rest as without it."""
    rules = {
        "plain": NormalizedMLPLOpt(initial_lr=0.02),
        "sqrt": NormalizedMLPLOpt(initial_lr=0.02, fan_in_base=64.0),
        "linear": NormalizedMLPLOpt(initial_lr=0.02, fan_in_base=64.0, fan_in_power=1.0),
    }
    theta = _random_theta(rules["plain"], 1.0)
    state = rules["plain"].opt_fn(theta).init(FAN_IN_PARAMS, num_steps=10)
    grad = _grad(FAN_IN_PARAMS, 1)
    updates = {
        name: rule.opt_fn(theta).step(state, grad, loss=jnp.float32(1.0))[0]
        for name, rule in rules.items()
    }
    for name, factor in (("sqrt", 0.5), ("linear", 0.25)):
        np.testing.assert_allclose(
            updates[name]["wide"], factor * updates["plain"]["wide"], rtol=1e-6
        )
        for kept in ("kernel", "at_base", "narrow", "b"):
            np.testing.assert_array_equal(updates[name][kept], updates["plain"][kept])
    with pytest.raises(ValueError, match="fan_in_base"):
        NormalizedMLPLOpt(fan_in_base=0.0)
    with pytest.raises(ValueError, match="fan_in_power"):
        NormalizedMLPLOpt(fan_in_base=64.0, fan_in_power=-0.5)
    with pytest.raises(ValueError, match="fan_in_power"):
        NormalizedMLPLOpt(fan_in_power=1.0)  # no base: the power would be ignored


def test_a_learned_fan_in_power_starts_at_zero_and_then_scales_every_weight_both_ways():
    """Untrained, the rule without a base bit for bit; at power p a weight of fan-in n steps (B / n) ** p."""
    plain = NormalizedMLPLOpt(initial_lr=0.02)
    learned = NormalizedMLPLOpt(initial_lr=0.02, fan_in_base=64.0, fan_in_power="learned")
    assert float(learned.init(jax.random.key(0))["fan_in_power"]) == 0.0
    theta = _random_theta(plain, 1.0)
    state = plain.opt_fn(theta).init(FAN_IN_PARAMS, num_steps=10)
    grad = _grad(FAN_IN_PARAMS, 1)

    def step(rule, theta):
        return rule.opt_fn(theta).step(state, grad, loss=jnp.float32(1.0))[0]

    expected = step(plain, theta)
    at_zero = step(learned, {**theta, "fan_in_power": jnp.float32(0.0)})
    jax.tree.map(np.testing.assert_array_equal, at_zero, expected)
    power = 0.6  # theta holds atanh(power): the power is bounded by tanh
    scaled = step(learned, {**theta, "fan_in_power": jnp.float32(np.arctanh(power))})
    for name, fan_in in (("wide", 256), ("kernel", 36), ("at_base", 64), ("narrow", 16)):
        np.testing.assert_allclose(
            scaled[name], (64 / fan_in) ** power * expected[name], rtol=1e-5, err_msg=name
        )
    np.testing.assert_array_equal(scaled["b"], expected["b"])
    with pytest.raises(ValueError, match="fan_in_base"):
        NormalizedMLPLOpt(fan_in_power="learned")
    with pytest.raises(ValueError, match="fan_in_power"):
        NormalizedMLPLOpt(fan_in_base=64.0, fan_in_power="fitted")


def test_braked_weight_decay_rises_from_weight_decay_as_the_brake_engages():
    """The decay is ``wd + (w - wd) * (1 - guard)``: ``wd`` while unbraked, near ``w`` once stopped."""
    losses = [2.0] + [0.2] * 30 + [1.0] * 10  # falls, then climbs: the guard falls below 0.5
    rules = {
        "undecayed": NormalizedMLPLOpt(initial_lr=0.02, loss_guard=0.05),
        "decayed": NormalizedMLPLOpt(initial_lr=0.02, loss_guard=0.05, weight_decay=0.1),
        "braked": NormalizedMLPLOpt(
            initial_lr=0.02, loss_guard=0.05, weight_decay=0.1, braked_weight_decay=0.5
        ),
    }
    theta = _random_theta(rules["undecayed"], 1.0)
    steps = {name: jax.jit(rule.opt_fn(theta).step) for name, rule in rules.items()}
    state = rules["undecayed"].opt_fn(theta).init(PARAMS, num_steps=len(losses))
    for i, loss in enumerate(losses):
        # All three step from the same state, so they differ only in the decay's term.
        grad, before = _grad(state.params, i), state
        undecayed, state = steps["undecayed"](before, grad, loss=jnp.float32(loss))
        decayed, _ = steps["decayed"](before, grad, loss=jnp.float32(loss))
        braked, _ = steps["braked"](before, grad, loss=jnp.float32(loss))
        guard = float(state.guard)
        expected_decay = 0.1 + (0.5 - 0.1) * (1.0 - guard)
        for name in PARAMS:
            per_unit_decay = (decayed[name] - undecayed[name]) / 0.1  # -lr * guard * p
            np.testing.assert_allclose(
                braked[name],
                undecayed[name] + expected_decay * per_unit_decay,
                rtol=1e-4,
                atol=1e-8,
            )
            if guard == 1.0:
                np.testing.assert_allclose(braked[name], decayed[name], rtol=1e-6, atol=0)
    assert guard < 0.5
    with pytest.raises(ValueError, match="braked_weight_decay"):
        NormalizedMLPLOpt(braked_weight_decay=0.1)  # no brake to follow
    with pytest.raises(ValueError, match="braked_weight_decay"):
        NormalizedMLPLOpt(loss_guard=0.05, braked_weight_decay=-0.1)


def test_a_weight_decay_horizon_gives_every_run_length_the_same_decay_in_all():
    """With ``H``, a run of ``T`` steps decays ``wd * H / T`` a step: as the rule with that decay."""
    theta = _random_theta(NormalizedMLPLOpt(initial_lr=0.02), 1.0)
    per_run = NormalizedMLPLOpt(initial_lr=0.02, weight_decay=0.1, weight_decay_horizon=100.0)
    grad = _grad(PARAMS, 3)
    for num_steps in (25, 100, 1000):
        state = per_run.opt_fn(theta).init(PARAMS, num_steps=num_steps)
        step, _ = per_run.opt_fn(theta).step(state, grad, loss=jnp.float32(1.0))
        per_step = NormalizedMLPLOpt(initial_lr=0.02, weight_decay=0.1 * 100.0 / num_steps)
        expected, _ = per_step.opt_fn(theta).step(state, grad, loss=jnp.float32(1.0))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), step, expected)

    # Where the gradient is zero only the decay moves the weights: untrained, a run of any
    # length shrinks them by about exp(-lr * wd * H) in all; a per-step decay, T times as far.
    def shrink(rule: NormalizedMLPLOpt, num_steps: int) -> float:
        opt = as_optax(rule, rule.init(jax.random.key(0)), num_steps=num_steps)
        params, zero = {"w": jnp.ones((4, 3))}, {"w": jnp.zeros((4, 3))}
        update = jax.jit(opt.update)
        state = opt.init(params)
        for _ in range(num_steps):
            updates, state = update(zero, state, params, value=jnp.float32(1.0))
            params = optax.apply_updates(params, updates)
        return float(params["w"][0, 0])

    for num_steps in (50, 400):
        assert shrink(per_run, num_steps) == pytest.approx(np.exp(-0.02 * 0.1 * 100), rel=2e-3)
    plain = NormalizedMLPLOpt(initial_lr=0.02, weight_decay=0.1)
    assert shrink(plain, 400) == pytest.approx(np.exp(-0.02 * 0.1 * 400), rel=1e-2)
    with pytest.raises(ValueError, match="weight_decay_horizon"):
        NormalizedMLPLOpt(weight_decay=0.1, weight_decay_horizon=0.0)


def test_mirror_signs_are_the_features_of_a_parameter_negated_with_its_gradient_history():
    """The signs the symmetric MLP mirrors by, row for row against the features' own definition."""
    keys = jax.random.split(jax.random.key(3), 4)
    p, g = jax.random.normal(keys[0], (6, 5)), jax.random.normal(keys[1], (6, 5))
    m = jax.random.normal(keys[2], (6, 5, 3))
    v = jnp.square(jax.random.normal(keys[3], (6, 5)))
    features = per_parameter_features(p, g, m, v, 1e-8)
    negated = per_parameter_features(-p, -g, -m, v, 1e-8)
    signs = mirror_signs(3)
    assert signs.shape == (features.shape[0],) and set(signs.tolist()) == {-1.0, 1.0}
    np.testing.assert_allclose(negated, signs[:, None] * features, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("step_rms", ["equal", "at_most"])
def test_sign_symmetric_steps_a_parameter_negated_with_its_gradients_by_the_step_negated(step_rms):
    """Odd in (p, g, m), as Adam and decoupled decay are, for any theta; without it, not."""
    options = dict(
        initial_lr=0.02,
        step_rms=step_rms,
        correction_scale="adam",
        element_clip=3.0,
        weight_decay=0.1,
        loss_guard=0.01,
    )
    symmetric = NormalizedMLPLOpt(sign_symmetric=True, **options)
    plain = NormalizedMLPLOpt(**options)
    theta = _random_theta(plain, 1.0)
    negated = jax.tree.map(jnp.negative, PARAMS)

    def gaps(lopt):
        opt = lopt.opt_fn(theta)
        step = jax.jit(opt.step)
        state, mirror = opt.init(PARAMS, num_steps=30), opt.init(negated, num_steps=30)
        worst, largest = 0.0, 0.0
        for i in range(6):
            grad, loss = _grad(state.params, i), jnp.float32(2.0 / (i + 1))
            updates, state = step(state, grad, loss=loss)
            mirrored, mirror = step(mirror, jax.tree.map(jnp.negative, grad), loss=loss)
            for name in PARAMS:
                worst = max(worst, float(jnp.max(jnp.abs(updates[name] + mirrored[name]))))
                largest = max(largest, float(jnp.max(jnp.abs(updates[name]))))
        return worst, largest

    worst, largest = gaps(symmetric)
    assert largest > 1e-3
    assert worst <= 1e-6 * largest
    plain_worst, plain_largest = gaps(plain)
    assert plain_worst > 0.05 * plain_largest  # the check can fail: theta alone breaks the symmetry


def test_sign_symmetric_untrained_is_the_same_rule_and_keeps_theta():
    """The same theta (so a checkpoint runs either way); untrained the MLP's outputs are 0 either way."""
    symmetric, plain = (
        NormalizedMLPLOpt(initial_lr=0.02, step_rms="at_most", sign_symmetric=s)
        for s in (True, False)
    )
    theta = plain.init(jax.random.key(0))
    assert jax.tree.structure(symmetric.init(jax.random.key(0))) == jax.tree.structure(theta)
    opts = [lopt.opt_fn(theta) for lopt in (symmetric, plain)]
    states = [opt.init(PARAMS, num_steps=20) for opt in opts]
    for i in range(4):
        grad = _grad(states[1].params, i)
        steps = [
            opt.step(state, grad, loss=jnp.float32(1.0))
            for opt, state in zip(opts, states, strict=True)
        ]
        states = [state for _, state in steps]
        for name in PARAMS:
            np.testing.assert_array_equal(steps[0][0][name], steps[1][0][name])


def test_weight_decay_is_decoupled_and_scaled_by_the_step_size():
    """``p <- p - lr * (n + wd * p)``, as AdamW: the plain rule's step minus ``lr * wd * p``."""
    decayed, plain = (
        NormalizedMLPLOpt(initial_lr=0.02, weight_decay=0.5),
        NormalizedMLPLOpt(initial_lr=0.02),
    )
    theta = _random_theta(plain, 1.0)
    opts = {"decayed": decayed.opt_fn(theta), "plain": plain.opt_fn(theta)}
    states = {k: o.init(PARAMS, num_steps=30) for k, o in opts.items()}
    for i in range(5):
        # Both step from the same state: the decay's term is then exactly -lr * wd * p.
        grad, loss = _grad(states["plain"].params, i), jnp.float32(1.0 / (i + 1))
        decayed_updates, _ = opts["decayed"].step(states["plain"], grad, loss=loss)
        plain_updates, states["plain"] = opts["plain"].step(states["plain"], grad, loss=loss)
        lr = _rms(plain_updates["w"])  # every tensor's plain step has RMS lr
        for name, p in states["plain"].params.items():
            before = p - plain_updates[name]
            np.testing.assert_allclose(
                decayed_updates[name], plain_updates[name] - lr * 0.5 * before, rtol=1e-4, atol=1e-7
            )
    with pytest.raises(ValueError, match="weight_decay"):
        NormalizedMLPLOpt(weight_decay=-0.1)


def test_every_tensor_moves_by_the_same_rms_whatever_theta():
    lopt = NormalizedMLPLOpt(initial_lr=0.01)
    opt = lopt.opt_fn(_random_theta(lopt, 3.0))
    state = opt.init(PARAMS, num_steps=40)
    for i in range(6):
        updates, state = opt.step(state, _grad(opt.get_params(state), i), loss=jnp.float32(i))
        sizes = [_rms(u) for u in jax.tree.leaves(updates)]
        np.testing.assert_allclose(sizes, sizes[0], rtol=1e-4)
        # The learned log step size is bounded: within e^+-4 of the nominal one.
        assert 0.01 * np.exp(-4.0) * 0.999 <= sizes[0] <= 0.01 * np.exp(4.0) * 1.001


def test_with_step_rms_at_most_no_tensor_moves_by_more_than_the_step_size_whatever_theta():
    at_most, equal = (NormalizedMLPLOpt(initial_lr=0.01, step_rms=s) for s in ("at_most", "equal"))
    theta = _random_theta(equal, 3.0)
    opts = {"at_most": at_most.opt_fn(theta), "equal": equal.opt_fn(theta)}
    state = opts["equal"].init(PARAMS, num_steps=40)
    ratios = []
    for i in range(6):
        grad, loss = _grad(state.params, i), jnp.float32(i)
        bounded, _ = opts["at_most"].step(state, grad, loss=loss)
        updates, state = opts["equal"].step(state, grad, loss=loss)
        # Same theta and state: the same step size, which "equal" steps have as their RMS.
        ratios += [
            _rms(b) / _rms(u)
            for b, u in zip(jax.tree.leaves(bounded), jax.tree.leaves(updates), strict=True)
        ]
    assert max(ratios) <= 1 + 1e-5
    assert np.isclose(max(ratios), 1.0, rtol=1e-5)  # some tensors' directions had RMS above 1


def test_steps_do_not_depend_on_the_gradient_or_loss_scale():
    """Wherever the squared gradients are well above epsilon (1e-8), as Adam's steps are."""
    lopt = NormalizedMLPLOpt(initial_lr=0.01)
    opt = lopt.opt_fn(_random_theta(lopt, 1.0))

    def grad(params, i: int, scale: float):
        # Every element's magnitude in [0.5, 2.5] times scale: none near Adam's epsilon.
        return jax.tree.map(lambda p: scale * (1.5 + jnp.sin(3.0 * p + i)), params)

    small = big = opt.init(PARAMS, num_steps=30)
    for i in range(5):
        loss = jnp.float32(2.0 - 0.1 * i)
        small_updates, small = opt.step(small, grad(small.params, i, 1.0), loss=loss)
        big_updates, big = opt.step(big, grad(big.params, i, 1000.0), loss=1e4 * loss)
        for name in PARAMS:
            np.testing.assert_allclose(small_updates[name], big_updates[name], rtol=1e-4, atol=1e-8)


def test_an_external_cosine_schedule_multiplies_the_step_size():
    num_steps = 20
    lopt = NormalizedMLPLOpt(initial_lr=0.05, external_schedule="cosine")
    opt = lopt.opt_fn(lopt.init(jax.random.key(0)))
    state = opt.init(PARAMS, num_steps=num_steps)
    for i in range(num_steps):
        updates, state = opt.step(state, _grad(state.params, i), loss=jnp.float32(1.0))
        expected = 0.05 * 0.5 * (1.0 + np.cos(np.pi * i / num_steps))
        np.testing.assert_allclose(_rms(updates["w"]), expected, rtol=1e-4, atol=1e-9)


def test_zero_gradients_and_a_nan_loss_leave_every_state_finite():
    lopt = NormalizedMLPLOpt()
    grad = {**_grad(PARAMS, 0), "b": jnp.zeros(5)}
    for theta in (lopt.init(jax.random.key(0)), _random_theta(lopt, 1.0)):
        opt = lopt.opt_fn(theta)
        state = opt.init(PARAMS, num_steps=10)
        for loss in (jnp.float32(jnp.nan), jnp.float32(2.0), jnp.float32(jnp.inf)):
            updates, state = opt.step(state, grad, loss=loss)
            assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves((updates, state)))
    # Untrained, a tensor without gradients stays put, as under Adam.
    opt = lopt.opt_fn(lopt.init(jax.random.key(0)))
    updates, _ = opt.step(opt.init(PARAMS, num_steps=10), grad, loss=jnp.float32(1.0))
    np.testing.assert_array_equal(updates["b"], np.zeros(5, np.float32))


def test_the_loss_is_required_unless_its_features_are_off():
    lopt = NormalizedMLPLOpt()
    opt = lopt.opt_fn(lopt.init(jax.random.key(0)))
    assert lopt.uses_loss and lopt.needs_num_steps
    with pytest.raises(ValueError, match="num_steps"):
        opt.init(PARAMS)
    with pytest.raises(ValueError, match="loss"):
        opt.step(opt.init(PARAMS, num_steps=5), _grad(PARAMS, 0))
    lossless = NormalizedMLPLOpt(loss_features=False)
    assert not lossless.uses_loss
    opt = lossless.opt_fn(lossless.init(jax.random.key(0)))
    updates, _ = opt.step(opt.init(PARAMS, num_steps=5), _grad(PARAMS, 0))
    assert lossless.num_features == lopt.num_features - 2
    assert np.isfinite(_rms(updates["w"]))
    with pytest.raises(ValueError, match="external_schedule"):
        NormalizedMLPLOpt(external_schedule="warmup")


def test_through_optax_it_follows_its_own_trajectory_bit_for_bit():
    lopt = NormalizedMLPLOpt(initial_lr=0.03)
    theta = _random_theta(lopt, 0.5)
    transform = as_optax(lopt, theta, num_steps=8)

    def loss_fn(p):
        return sum(jnp.sum(jnp.square(x - 0.5)) for x in jax.tree.leaves(p))

    @jax.jit
    def optax_step(params, state):
        loss, grad = jax.value_and_grad(loss_fn)(params)
        updates, state = transform.update(grad, state, params, value=loss)
        return optax.apply_updates(params, updates), state

    @jax.jit
    def own_step(state):
        loss, grad = jax.value_and_grad(loss_fn)(state.params)
        return lopt.opt_fn(theta).update(state, grad, loss=loss)

    params, optax_state = PARAMS, transform.init(PARAMS)
    own = lopt.opt_fn(theta).init(PARAMS, num_steps=8)
    for _ in range(8):
        params, optax_state = optax_step(params, optax_state)
        own = own_step(own)
    for name in PARAMS:
        np.testing.assert_array_equal(params[name], own.params[name])
    with pytest.raises(ValueError, match="value=loss"):
        transform.update(_grad(PARAMS, 0), transform.init(PARAMS), PARAMS)


def _flat_stretch_loss(params):
    # "scale" sits where the loss is flat: its gradient is zero but depends on it.
    flat = jnp.maximum(params["scale"] - 1.0, 0.0) ** 2
    return jnp.sum(jnp.square(params["w"])) + jnp.sum(params["b"]) + flat


@pytest.mark.parametrize("step_rms", ["equal", "at_most"])
@pytest.mark.parametrize("correction_scale", ["unit", "adam"])
def test_meta_gradient_is_finite_where_a_tensors_gradient_is_zero(step_rms, correction_scale):
    """Backpropagating through the rule (the truncated_grad estimator does) past a zero gradient."""
    lopt = NormalizedMLPLOpt(initial_lr=0.01, step_rms=step_rms, correction_scale=correction_scale)

    def meta_loss(theta):
        opt = lopt.opt_fn(theta)

        def inner_step(state, _):
            value, grad = jax.value_and_grad(_flat_stretch_loss)(state.params)
            return opt.step(state, grad, loss=value)[1], None

        state, _ = jax.lax.scan(inner_step, opt.init(PARAMS, num_steps=10), length=3)
        return _flat_stretch_loss(state.params)

    theta = _random_theta(lopt, 0.3)
    meta_grad = jax.jit(jax.grad(meta_loss))(theta)
    assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(meta_grad))
    # And it is the derivative: along a random direction, a central difference agrees.
    leaves, treedef = jax.tree.flatten(theta)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    direction = treedef.unflatten(
        [jax.random.normal(k, leaf.shape) for leaf, k in zip(leaves, keys, strict=True)]
    )
    h = 1e-3
    value = jax.jit(meta_loss)
    ahead = value(jax.tree.map(lambda t, d: t + h * d, theta, direction))
    behind = value(jax.tree.map(lambda t, d: t - h * d, theta, direction))
    along = sum(
        float(jnp.vdot(g, d))
        for g, d in zip(jax.tree.leaves(meta_grad), jax.tree.leaves(direction), strict=True)
    )
    np.testing.assert_allclose(along, float(ahead - behind) / (2 * h), rtol=2e-2, atol=1e-4)
