"""Meta-loss on the outer-validation split, the extra image families, task mixtures."""

from __future__ import annotations

import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from popmeta.config import ConfigError, config_from_dict
from popmeta.core.estimators import TruncatedPES
from popmeta.core.estimators.antithetic import (
    antithetic_deltas,
    perturbed_unroll,
    sample_perturbation,
)
from popmeta.core.learned_optimizers import LearnableSGD
from popmeta.core.lopt_truncated_step import META_LOSS_LOG_FLOOR, VectorizedLOptTruncatedStep
from popmeta.core.mixture_truncated_step import MixtureTruncatedStep, apportion
from popmeta.core.tasks import (
    Conv_Digits8,
    FixedDimQuadraticFamily,
    ImageMLP_Digits4_Relu32,
    ImageMLP_Digits8_Relu32,
    ImageMLP_Digits16_Relu32,
    ImageMLPTask,
    InMemoryDataset,
    ParametricImageMLP_Digits8,
    ParametricImageMLPFamily,
    load_digits_8x8,
    resample_images,
    single_task_to_family,
)
from popmeta.core.tree_utils import per_task, tree_add
from popmeta.core.truncation import ConstantTruncationSchedule
from popmeta.experiment import EstimatorSections, build_task_family, build_truncated_step
from popmeta.run_loop import train
from tests.events import read_scalars
from tests.local_run import local_config


def _split_data(outer_label: int) -> dict:
    """Train data of random digits-like images; an outer_valid split of one repeated example."""
    rng = np.random.default_rng(0)
    train = {
        "image": rng.random((40, 8, 8, 1), dtype=np.float32),
        "label": rng.integers(0, 10, 40).astype(np.int32),
    }
    one = {
        "image": np.tile(rng.random((1, 8, 8, 1), dtype=np.float32), (5, 1, 1, 1)),
        "label": np.full((5,), outer_label, np.int32),
    }
    return {"train": train, "inner_valid": train, "outer_valid": one, "test": train}


# Meta-loss on the outer-validation split ------------------------------------------------


def _outer_valid_problem():
    """A task whose outer_valid batches all hold one example, its family, SGD and its theta."""
    task = ImageMLPTask(InMemoryDataset(_split_data(outer_label=7)), batch_size=4)
    lopt = LearnableSGD(initial_lr=0.5)
    return task, single_task_to_family(task), lopt, lopt.init(jax.random.key(0))


def test_outer_valid_meta_loss_is_the_updated_params_loss_on_that_split():
    task, family, lopt, theta = _outer_valid_problem()

    def step(split):
        ts = VectorizedLOptTruncatedStep(
            family, lopt, ConstantTruncationSchedule(5), num_tasks=2, meta_loss_split=split
        )
        state = ts.init_step_state(theta, None, jax.random.key(1))
        return ts.unroll_step(theta, state, jax.random.key(2), None, None)

    state, out = step("outer_valid")
    # Every outer_valid batch is the same example, so the loss is known exactly.
    batch = task.sample_batch(jax.random.key(3), "outer_valid")
    params = lopt.opt_fn(theta).get_params(state.inner_opt_state)
    expected = jax.vmap(lambda p: task.normalizer(task.loss(p, None, batch)))(params)
    np.testing.assert_allclose(out.loss, expected, rtol=1e-6)
    _, train_out = step(None)
    assert not np.allclose(out.loss, train_out.loss)


def test_log_meta_loss_is_the_log_of_each_steps_loss_plus_the_floor():
    _, family, lopt, theta = _outer_valid_problem()

    def losses(transform):
        ts = VectorizedLOptTruncatedStep(
            family,
            lopt,
            ConstantTruncationSchedule(5),
            num_tasks=3,
            meta_loss_split="outer_valid",
            meta_loss_transform=transform,
        )
        state = ts.init_step_state(theta, None, jax.random.key(1))
        steps = []
        for i in range(4):
            state, out = ts.unroll_step(theta, state, jax.random.key(2 + i), None, None)
            steps.append(out.loss)
        return np.stack(steps)

    plain, logged = losses("identity"), losses("log")
    np.testing.assert_allclose(logged, np.log(plain + META_LOSS_LOG_FLOOR), rtol=1e-5)
    # The losses fall over the steps, so the check spans more than one scale.
    assert plain[0].mean() > plain[-1].mean()
    with pytest.raises(ValueError, match="meta_loss_transform must be one of"):
        VectorizedLOptTruncatedStep(
            family, lopt, ConstantTruncationSchedule(5), 2, meta_loss_transform="sqrt"
        )


def _config(**task_and_estimator):
    task = task_and_estimator.pop("task", {})
    return config_from_dict(
        {
            "task": task,
            "learned_optimizer": {"kind": "learnable_sgd"},
            "estimator": {"num_tasks": 2, "trunc_length": 2, **task_and_estimator},
        }
    )


def test_meta_loss_split_config_reaches_the_step_and_data_free_families_refuse_it():
    cfg = _config(task={"kind": "image_mlp_digits"}, meta_loss_split="outer_valid")
    assert build_truncated_step(EstimatorSections.of(cfg)).meta_loss_split == "outer_valid"
    assert build_truncated_step(EstimatorSections.of(_config())).meta_loss_split is None
    # The noisy quadratics have data (and so an outer_valid split).
    _config(task={"kind": "fixed_dim_quadratic_data"}, meta_loss_split="outer_valid")
    for family in ("quadratic", "fixed_dim_quadratic"):
        with pytest.raises(ConfigError, match=rf"estimator\.meta_loss_split: .*{family!r}"):
            _config(task={"kind": family}, meta_loss_split="outer_valid")
    with pytest.raises(ConfigError, match=r"estimator\.meta_loss_split: expected one of"):
        _config(meta_loss_split="valid")


def test_meta_loss_transform_config_reaches_every_member_of_a_mixture():
    mixture = {"image_mlp_digits": 1, "image_mlp_digits4": 1}
    cfg = _config(task={"kind": "image_mlp_digits", "mixture": mixture}, meta_loss_transform="log")
    step = build_truncated_step(EstimatorSections.of(cfg))
    assert [g.meta_loss_transform for g in step.groups] == ["log", "log"]
    assert build_truncated_step(EstimatorSections.of(_config())).meta_loss_transform == "identity"
    with pytest.raises(ConfigError, match=r"estimator\.meta_loss_transform: expected one of"):
        _config(meta_loss_transform="sqrt")


# Digits at other resolutions, and a small conv net -----------------------------------------


def test_resampled_digits_keep_the_examples_and_split():
    images, _ = load_digits_8x8()
    small = resample_images(images, 4)
    # Shrinking by 2 is the mean of each 2x2 block: every pixel counts.
    np.testing.assert_allclose(small[5, 1, 2, 0], images[5, 2:4, 4:6, 0].mean(), rtol=1e-6)
    large = resample_images(images, 16)
    assert large.shape == (images.shape[0], 16, 16, 1) and large.dtype == np.float32
    np.testing.assert_allclose(large.mean(axis=(1, 2)), images.mean(axis=(1, 2)), atol=0.02)
    with pytest.raises(ValueError, match="size must be a positive integer"):
        resample_images(images, 0)
    base = ImageMLP_Digits8_Relu32()
    for task, side in ((ImageMLP_Digits4_Relu32(), 4), (ImageMLP_Digits16_Relu32(), 16)):
        assert task.input_size == side * side
        params = task.init(jax.random.key(0))
        assert params["linear_0"]["w"].shape == (side * side, 32)
        batch = task.sample_batch(jax.random.key(1), "outer_valid")
        assert batch["image"].shape == (128, side, side, 1)
        # The same fixed split as the 8x8 task: the labels line up one to one.
        for split in ("train", "test"):
            np.testing.assert_array_equal(
                task.data.split(split).host_arrays["label"],
                base.data.split(split).host_arrays["label"],
            )


def test_conv_digits_has_conv_params_and_learns():
    task = Conv_Digits8(batch_size=64)
    params = task.init(jax.random.key(0))
    assert params["conv_0"]["w"].shape == (3, 3, 1, 8)
    assert params["conv_1"]["w"].shape == (3, 3, 8, 8)
    assert params["linear_0"]["w"].shape == (8 * 8 * 8, 10)
    batch = task.sample_batch(jax.random.key(1))
    assert task.apply(params, batch["image"]).shape == (64, 10)

    @jax.jit
    def sgd(params, key):
        batch = task.sample_batch(key)
        grad = jax.grad(task.loss)(params, key, batch)
        return jax.tree.map(lambda p, g: p - 0.5 * g, params, grad)

    test_batch = task.data.split("test").host_arrays
    before = task.loss(params, None, test_batch)
    for key in jax.random.split(jax.random.key(2), 60):
        params = sgd(params, key)
    after = task.loss(params, None, test_batch)
    assert after < 0.6 * before
    assert task.accuracy(params, test_batch) > 0.6


# Mixtures of families -----------------------------------------------------------------


def test_apportion_follows_the_weights_with_a_slot_for_every_family():
    assert apportion([3.0, 1.0], 8) == (6, 2)
    assert apportion([1.0, 1.0, 1.0], 4) == (2, 1, 1)
    assert apportion([100.0, 1.0], 3) == (2, 1)
    assert apportion([0.5, 0.3, 0.2], 10) == (5, 3, 2)
    for weights, n in (([1.0, 2.0, 3.5], 7), ([0.01, 0.01, 5.0], 3), ([2.0], 5)):
        counts = apportion(weights, n)
        assert sum(counts) == n and min(counts) >= 1
    with pytest.raises(ValueError, match="3 families need at least 3 task slots"):
        apportion([1.0, 1.0, 1.0], 2)
    with pytest.raises(ValueError, match="positive"):
        apportion([1.0, 0.0], 4)


class _FoldedKeyStep:
    """One group of a mixture run alone, with the key the mixture gives it."""

    def __init__(self, step, index):
        self.step, self.index, self.num_tasks = step, index, step.num_tasks

    def unroll_members(self, thetas, states, key, data, outer_state):
        return self.step.unroll_members(
            thetas, states, jax.random.fold_in(key, self.index), data, outer_state
        )


def test_a_mixture_estimate_is_its_groups_estimates_combined():
    """PES on a mixture of two quadratic families of different dimensions equals,
    exactly, PES run on each group with its slice of the noise, weighted by valid tasks."""
    lopt = LearnableSGD(initial_lr=0.1)
    theta = lopt.init(jax.random.key(0))
    groups = [
        VectorizedLOptTruncatedStep(
            family, lopt, ConstantTruncationSchedule(4), n, random_initial_iteration_offset=4
        )
        for family, n in ((FixedDimQuadraticFamily(3), 2), (FixedDimQuadraticFamily(5), 1))
    ]
    mixture = MixtureTruncatedStep(groups, ["small", "large"])
    assert mixture.num_tasks == 3 and mixture.family_names == ("small", "large")
    np.testing.assert_array_equal(mixture.family_of_task, [0, 0, 1])
    std, trunc = 0.05, 3
    pes = TruncatedPES(mixture, trunc_length=trunc, std=std)
    state = pes.init_worker_state(theta, jax.random.key(1))
    # Two truncations, so the second starts from persistent states with a PES history.
    out, _ = pes.estimate(theta, state, jax.random.key(2))
    state = out.state
    out, metrics = jax.jit(pes.estimate)(theta, state, jax.random.key(3))

    key_noise, key_unroll = jax.random.split(jax.random.key(3))
    noise = sample_perturbation(key_noise, theta, 3, std)
    grad_sum, valid_sum, family_losses = None, 0, []
    for i, (start, stop) in enumerate(((0, 2), (2, 3))):
        part = jax.tree.map(lambda x, a=start, b=stop: x[a:b], noise)
        history = jax.tree.map(lambda x, a=start, b=stop: x[a:b], state.accumulator)
        unrolled = perturbed_unroll(
            _FoldedKeyStep(groups[i], i),
            theta,
            (1.0, -1.0),
            part,
            part,
            state.member_states[i],
            state.starts_with_reset[start:stop],
            key_unroll,
            None,
            trunc,
            None,
        )
        deltas = antithetic_deltas(unrolled)
        per_task_grad = tree_add(
            per_task(deltas.first, tree_add(history, part)), per_task(deltas.after, part)
        )
        summed = jax.tree.map(lambda g, d=deltas: jnp.tensordot(d.valid, g, axes=1), per_task_grad)
        grad_sum = summed if grad_sum is None else jax.tree.map(jnp.add, grad_sum, summed)
        valid_sum += int(deltas.valid.sum())
        family_losses.append(float(deltas.mean_loss.mean()))
        for got, want in zip(
            jax.tree.leaves(out.state.member_states[i]),
            jax.tree.leaves(unrolled.state),
            strict=True,
        ):
            np.testing.assert_array_equal(got, want)
    expected = jax.tree.map(lambda g: g / valid_sum / (2 * std**2), grad_sum)
    assert float(out.weight) == valid_sum == 3
    for got, want in zip(jax.tree.leaves(out.grad), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["meta_loss_by_family/small"], family_losses[0], rtol=1e-5)
    np.testing.assert_allclose(metrics["meta_loss_by_family/large"], family_losses[1], rtol=1e-5)
    phases = mixture.trajectory_phase(pes.unroll_state(out.state))
    assert phases.shape == (3,)


def test_mixture_config_builds_the_split_and_bad_mixtures_fail_naming_the_field():
    cfg = _config(
        task={"kind": "conv_digits", "mixture": {"conv_digits": 1, "image_mlp_digits4": 3}},
        num_tasks=4,
    )
    step = build_truncated_step(EstimatorSections.of(cfg))
    assert isinstance(step, MixtureTruncatedStep)
    assert [g.num_tasks for g in step.groups] == [1, 3]
    assert step.family_names == ("conv_digits", "image_mlp_digits4")
    # Every worker (and every rebuild) gets the same split: one state template for all.
    np.testing.assert_array_equal(
        build_truncated_step(EstimatorSections.of(cfg)).family_of_task, step.family_of_task
    )
    bad = {
        r"task\.mixture\.nope\.kind: expected one of 'quadratic'.*got 'nope'": {
            "kind": "quadratic",
            "mixture": {"quadratic": 1, "nope": 1},
        },
        r"task\.mixture\.quadratic\.weight: must be > 0": {
            "kind": "quadratic",
            "mixture": {"quadratic": 0},
        },
        r"task\.kind: with task\.mixture set.*'curved_quadratic'": {"mixture": {"conv_digits": 1}},
        r"task\.mixture\.image_mlp_npz\.npz_path: kind 'image_mlp_npz' needs it": {
            "kind": "quadratic",
            "mixture": {"quadratic": 1, "image_mlp_npz": 1},
        },
        # A member with fields of its own: the task section must match one member whole.
        r"task\.kind: with task\.mixture set": {
            "kind": "quadratic",
            "options": None,
            "dim": 3,
            "mixture": {"quadratic": {"weight": 1.0, "dim": 4}},
        },
    }
    for match, task in bad.items():
        task = {k: v for k, v in task.items() if k != "options"}
        with pytest.raises(ConfigError, match=match):
            _config(task=task)
    three = {
        "kind": "quadratic",
        "mixture": {"quadratic": 1, "conv_digits": 1, "image_mlp_digits": 1},
    }
    with pytest.raises(ConfigError, match=r"task\.mixture: 3 families need .*num_tasks is 2"):
        _config(task=three)
    with pytest.raises(
        ConfigError, match=r"estimator\.meta_loss_split: .*task\.mixture\.quadratic\.kind"
    ):
        _config(
            task={**three, "mixture": {"quadratic": 1, "conv_digits": 1}},
            meta_loss_split="outer_valid",
        )
    # Members may carry their own fields and labels of their own.
    labelled = _config(
        task={
            "kind": "quadratic",
            "dim": 3,
            "mixture": {
                "small": {"kind": "quadratic", "dim": 3},
                "large": {"kind": "quadratic", "dim": 5, "weight": 3},
            },
        },
        num_tasks=4,
    )
    step = build_truncated_step(EstimatorSections.of(labelled))
    assert step.family_names == ("small", "large") and [g.num_tasks for g in step.groups] == [1, 3]


def test_a_mixture_run_writes_the_meta_loss_of_every_family(tmp_path):
    config = local_config(
        tmp_path,
        task={
            "kind": "fixed_dim_quadratic",
            "mixture": {"fixed_dim_quadratic": 1.0, "fixed_dim_quadratic_data": 1.0},
        },
        estimator={"num_tasks": 3},
        train={"num_steps": 2, "checkpoint_every": 2, "summary_every": 1},
    )
    result = train(config, stream=io.StringIO())
    assert result.final_step == 2
    scalars = read_scalars(tmp_path / "ident")
    plain = np.array([v for _, v in scalars["meta_loss_by_family/fixed_dim_quadratic"]])
    noisy = np.array([v for _, v in scalars["meta_loss_by_family/fixed_dim_quadratic_data"]])
    overall = np.array([v for _, v in scalars["meta_loss"]])
    assert plain.shape == noisy.shape == (2,) and np.all(plain > 0) and np.all(noisy > 0)
    # 3 slots split 2 + 1, every task valid: the meta-loss is the slot-weighted mean.
    np.testing.assert_allclose(overall, (2 * plain + noisy) / 3, rtol=1e-5)


# The parametric image-MLP family --------------------------------------------------------


def test_parametric_family_draws_architectures_from_the_seed_and_trains_them_as_groups():
    family = ParametricImageMLP_Digits8()
    configs = family.sample_configs(seed=0, count=12)
    assert configs == family.sample_configs(seed=0, count=12)
    assert configs != family.sample_configs(seed=1, count=12)
    assert len({c.name for c in configs}) > 6
    for c in configs:
        assert c.width in family.widths and c.depth in family.depths
        assert c.activation in family.activations and c.batch_size in family.batch_sizes
    task = family.family_of(configs[0]).task_fn(None)
    assert len(task.init(jax.random.key(0))) == configs[0].depth + 1
    assert task.sample_batch(jax.random.key(0))["label"].shape == (configs[0].batch_size,)
    with pytest.raises(ValueError, match="activations must be some of"):
        ParametricImageMLPFamily(family.data, activations=("swish",))

    cfg = _config(
        task={"kind": "parametric_image_mlp_digits", "groups": 2},
        num_tasks=4,
        meta_loss_split="outer_valid",
    )
    step = build_truncated_step(EstimatorSections.of(cfg))
    assert isinstance(step, MixtureTruncatedStep) and len(step.groups) == 2
    assert [g.num_tasks for g in step.groups] == [2, 2]
    assert step.family_names == ("parametric_image_mlp_digits",)
    drawn = family.sample_configs(cfg.seed, 2)
    for group, c in zip(step.groups, drawn, strict=True):
        assert group.task_family.task.hidden_sizes == (c.width,) * c.depth
        assert group.task_family.task.batch_size == c.batch_size
        assert group.meta_loss_split == "outer_valid"
    pes = TruncatedPES(step, trunc_length=2, std=0.01)
    theta = LearnableSGD().init(jax.random.key(0))
    state = pes.init_worker_state(theta, jax.random.key(1))
    out, metrics = jax.jit(pes.estimate)(theta, state, jax.random.key(2))
    assert np.isfinite(out.grad["log_lr"]) and float(out.weight) == 4
    np.testing.assert_allclose(
        metrics["meta_loss_by_family/parametric_image_mlp_digits"], out.mean_loss, rtol=1e-6
    )


def test_meta_testing_runs_the_parametric_familys_nominal_member_as_configured():
    nominal = {"nominal_width": 48, "nominal_depth": 2, "nominal_activation": "tanh"}
    cfg = _config(task={"kind": "parametric_image_mlp_digits", "groups": 2, **nominal})
    family = build_task_family(cfg.task)
    task = family.task_fn(family.sample(jax.random.key(0)))
    assert task.hidden_sizes == (48, 48) and task.batch_size == 128
    assert task.activation is jnp.tanh
    # Training draws its groups as before: the nominal member is meta-testing's only.
    step = build_truncated_step(EstimatorSections.of(cfg))
    drawn = ParametricImageMLP_Digits8().sample_configs(cfg.seed, 2)
    assert [g.task_family.task.hidden_sizes for g in step.groups] == [
        (c.width,) * c.depth for c in drawn
    ]


def test_the_parametric_familys_architecture_space_comes_from_the_config():
    space = {"widths": [128, 16], "depths": [2], "activations": ["tanh"], "batch_sizes": [32]}
    member = {"weight": 1, "groups": 3, **space}
    mixture = {"image_mlp_digits": 1, "parametric_image_mlp_digits": member}
    cfg = _config(task={"kind": "image_mlp_digits", "mixture": mixture}, num_tasks=8)
    parametric = build_truncated_step(EstimatorSections.of(cfg)).groups[1:]
    drawn = [(g.task_family.task.hidden_sizes, g.task_family.task.batch_size) for g in parametric]
    assert len(drawn) == 3 and {sizes for sizes, _ in drawn} <= {(128, 128), (16, 16)}
    assert {batch for _, batch in drawn} == {32}
    assert all(g.task_family.task.activation is jnp.tanh for g in parametric)
    # The defaults are the space the family always drew from, so a config without them draws
    # what it drew before.
    default = build_task_family(_config(task={"kind": "parametric_image_mlp_digits"}).task)
    assert default.sample_configs(3, 4) == ParametricImageMLP_Digits8().sample_configs(3, 4)

    where = "task.mixture.parametric_image_mlp_digits"
    for bad, message in (
        ({"widths": []}, r"\.widths: must list at least one choice"),
        ({"depths": [2, 0]}, r"\.depths: must be positive integers, got \[2, 0\]"),
        ({"activations": ["swish"]}, r"\.activations\[0\]: expected one of 'relu'"),
        ({"batch_sizes": 32}, r"\.batch_sizes: expected a list of int"),
    ):
        mixture = {"image_mlp_digits": 1, "parametric_image_mlp_digits": {**member, **bad}}
        with pytest.raises(ConfigError, match=re.escape(where) + message):
            _config(task={"kind": "image_mlp_digits", "mixture": mixture})


def test_conv_digits_takes_its_channels_and_batch_size_from_the_config():
    cfg = _config(task={"kind": "conv_digits", "channels": 4, "batch_size": 32})
    task = build_task_family(cfg.task).task_fn(None)
    params = task.init(jax.random.key(0))
    assert params["conv_0"]["w"].shape == (3, 3, 1, 4)
    assert params["conv_1"]["w"].shape == (3, 3, 4, 4)
    assert task.sample_batch(jax.random.key(1))["label"].shape == (32,)
