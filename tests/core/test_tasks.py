"""Tests for tasks, task families and in-memory datasets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from popmeta.core.optimizers import Adam
from popmeta.core.tasks import (
    SPLITS,
    CurvedQuadraticFamily,
    Datasets,
    FixedDimQuadraticFamily,
    FixedDimQuadraticFamilyData,
    ImageMLP_Digits8_Relu32,
    ImageMLP_Npz8_Relu32,
    ImageMLPTask,
    InMemoryDataset,
    QuadraticTask,
    Task,
    TaskFamily,
    single_task_to_family,
    split_arrays,
    vec_get_batch,
)


@pytest.fixture(scope="module")
def digits_task() -> ImageMLPTask:
    return ImageMLP_Digits8_Relu32(batch_size=64)


def _row_set(a) -> set[bytes]:
    a = np.asarray(a)
    return {row.tobytes() for row in a.reshape(a.shape[0], -1)}


# Quadratics -------------------------------------------------------------------


def test_quadratic_task_shapes_and_loss():
    task = QuadraticTask(dim=7)
    params = task.init(jax.random.PRNGKey(0))
    assert params.shape == (7,) and params.dtype == jnp.float32
    np.testing.assert_allclose(task.loss(params, None, None), np.sum(np.square(params)), rtol=1e-6)
    assert task.datasets is None
    assert task.sample_batch(jax.random.PRNGKey(1)) is None
    assert task.normalizer(3.0) == 3.0
    assert task.name == "QuadraticTask"


def test_fixed_dim_quadratic_family_samples_a_target_per_task():
    """The reference's definition: loss sum((t - p)**2), target t ~ N(0, I) per task."""
    family = FixedDimQuadraticFamily(dim=5)
    keys = jax.random.split(jax.random.PRNGKey(0), 400)
    targets = jax.jit(jax.vmap(family.sample))(keys)
    assert targets.shape == (400, 5) and targets.dtype == jnp.float32
    assert abs(float(targets.mean())) < 0.1 and 0.9 < float(targets.std()) < 1.1

    @jax.jit
    @jax.vmap
    def init_loss_and_grad(task_param, key):
        task = family.task_fn(task_param)  # task_param is a tracer here
        params = task.init(key)
        loss, grad = jax.value_and_grad(task.loss)(params, key, task.sample_batch(key))
        return params, loss, grad, task.loss(task_param, key, None)

    init_keys = jax.random.split(jax.random.PRNGKey(1), 400)
    params, losses, grads, at_target = init_loss_and_grad(targets, init_keys)
    assert params.shape == (400, 5) and not np.allclose(params, targets)
    np.testing.assert_allclose(losses, np.sum((targets - params) ** 2, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(grads, 2 * (params - targets), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(at_target, 0.0)  # the optimum is the target, not the origin
    task = family.task_fn(targets[0])
    assert task.normalizer(jnp.float32(1e6)) == 1e6 and task.datasets is None
    assert family.datasets is None and vec_get_batch(family, 3) == ()
    with pytest.raises(ValueError, match="dim"):
        FixedDimQuadraticFamily(dim=0)


def test_fixed_dim_quadratic_family_data_adds_noise_to_the_loss_only():
    family = FixedDimQuadraticFamilyData(dim=4)
    sample = jax.jit(jax.vmap(family.sample_batch))
    keys = jax.random.split(jax.random.PRNGKey(0), 2000)
    noise = sample(keys)
    assert noise.shape == (2000,) and noise.dtype == jnp.float32
    np.testing.assert_array_equal(sample(keys), noise)  # a pure function of the key
    assert abs(float(noise.mean())) < 0.1 and 0.9 < float(noise.std()) < 1.1
    outer = jax.jit(family.sample_batch, static_argnames="split")(keys[0], split="outer_valid")
    assert outer.shape == ()
    with pytest.raises(ValueError, match="split"):
        family.sample_batch(keys[0], "validation")

    targets = jax.vmap(family.sample)(keys[:3])
    assert targets.shape == (3, 4)

    @jax.jit
    @jax.vmap
    def loss_and_grad(task_param, key):
        task = family.task_fn(task_param)
        data = task.sample_batch(key)
        return jax.value_and_grad(task.loss)(jnp.zeros(4), key, data), data

    (losses, grads), data = loss_and_grad(targets, keys[:3])
    np.testing.assert_array_equal(data, noise[:3])
    np.testing.assert_allclose(losses, np.sum(targets**2, -1) + noise[:3], rtol=1e-5)
    np.testing.assert_allclose(grads, -2 * targets, rtol=1e-6)  # the noise shifts the loss only
    task = family.task_fn(targets[0])
    assert task.datasets is family.datasets
    np.testing.assert_array_equal(
        task.normalizer(jnp.asarray([-0.5, 3.0, 5e3])), [0.0, 3.0, 1000.0]
    )


def test_fixed_dim_quadratic_family_data_host_datasets_and_vec_get_batch():
    family = FixedDimQuadraticFamilyData(dim=4, seed=3)
    assert isinstance(family.datasets, Datasets)
    b = next(family.datasets.train)
    assert isinstance(b, np.ndarray) and b.shape == () and b.dtype == np.float32
    assert family.datasets.abstract_batch.shape == ()
    assert family.datasets.split("outer_valid") is family.datasets.outer_valid
    with pytest.raises(ValueError, match="split"):
        family.datasets.split("validation")

    stacked = vec_get_batch(family, 500, split="inner_valid", numpy=True)
    assert isinstance(stacked, np.ndarray) and stacked.shape == (500,)
    assert abs(stacked.mean()) < 0.2 and 0.8 < stacked.std() < 1.2
    again = FixedDimQuadraticFamilyData(dim=4, seed=3)
    np.testing.assert_array_equal(next(again.datasets.train), b)  # seeded
    np.testing.assert_array_equal(vec_get_batch(again, 500, "inner_valid", numpy=True), stacked)
    assert not np.array_equal(vec_get_batch(again, 500, "test", numpy=True), stacked)
    stacked_jnp = vec_get_batch(family, 2)
    assert isinstance(stacked_jnp, jax.Array) and stacked_jnp.shape == (2,)


def test_single_task_to_family():
    task = QuadraticTask(dim=3)
    family = single_task_to_family(task)
    assert isinstance(family, TaskFamily)
    task_params = jax.vmap(family.sample)(jax.random.split(jax.random.PRNGKey(0), 4))
    assert task_params.shape == (4,)
    assert family.task_fn(task_params[0]) is task
    assert family.datasets is None and family.sample_batch(jax.random.PRNGKey(0)) is None
    assert family.name == "QuadraticTask"


# Datasets ----------------------------------------------------------------------


def test_split_arrays_is_deterministic_disjoint_and_complete():
    x = np.arange(100, dtype=np.float32)[:, None]
    a = split_arrays({"x": x, "y": x[:, 0].astype(np.int32)})
    b = split_arrays({"x": x, "y": x[:, 0].astype(np.int32)})
    assert [a[s]["x"].shape[0] for s in SPLITS] == [70, 10, 10, 10]
    for s in SPLITS:
        np.testing.assert_array_equal(a[s]["x"], b[s]["x"])
        np.testing.assert_array_equal(a[s]["x"][:, 0], a[s]["y"])  # rows stay aligned
    allx = np.concatenate([a[s]["x"][:, 0] for s in SPLITS])
    np.testing.assert_array_equal(np.sort(allx), x[:, 0])
    with pytest.raises(ValueError, match="too few"):
        split_arrays({"x": x[:3]})
    with pytest.raises(ValueError, match="fractions"):
        split_arrays({"x": x}, fractions=(0.5, 0.5, 0.1, 0.1))


def test_host_iterator_covers_each_epoch():
    x = np.arange(10, dtype=np.int32)
    data = InMemoryDataset({s: x for s in SPLITS})
    it = data.host_datasets(batch_size=5, seed=3).train
    seen = np.concatenate([next(it) for _ in range(4)])
    np.testing.assert_array_equal(np.sort(seen[:10]), x)
    np.testing.assert_array_equal(np.sort(seen[10:]), x)


# Image MLP ----------------------------------------------------------------------


def test_digits_task_params_and_batches(digits_task):
    task = digits_task
    params = task.init(jax.random.PRNGKey(0))
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype), params)
    assert shapes == {
        "linear_0": {"w": ((64, 32), jnp.float32), "b": ((32,), jnp.float32)},
        "linear_1": {"w": ((32, 10), jnp.float32), "b": ((10,), jnp.float32)},
    }
    assert float(jnp.abs(params["linear_0"]["b"]).max()) == 0.0
    assert 0.05 < float(jnp.std(params["linear_0"]["w"])) < 0.2  # ~1/sqrt(64) truncated

    sizes = [task.data.split(s).num_examples for s in SPLITS]
    assert sum(sizes) == 1797 and sizes[0] == 1258
    keys = jax.random.split(jax.random.PRNGKey(1), 2)
    batches = jax.jit(jax.vmap(task.sample_batch))(keys)
    assert batches["image"].shape == (2, 64, 8, 8, 1) and batches["image"].dtype == jnp.float32
    assert batches["label"].shape == (2, 64) and batches["label"].dtype == jnp.int32
    assert not np.array_equal(batches["image"][0], batches["image"][1])
    assert float(batches["image"].min()) >= 0.0 and float(batches["image"].max()) <= 1.0

    train_rows = _row_set(task.data.split("train").host_arrays["image"])
    valid_rows = _row_set(task.data.split("outer_valid").host_arrays["image"])
    assert _row_set(batches["image"][0]) <= train_rows
    vb = jax.jit(task.sample_batch, static_argnames="split")(keys[0], split="outer_valid")
    assert _row_set(vb["image"]) <= valid_rows

    loss = task.loss(params, keys[0], jax.tree.map(lambda a: a[0], batches))
    assert abs(float(loss) - np.log(10)) < 0.5  # near-uniform predictions at init
    np.testing.assert_allclose(task.normalizer(jnp.float32(100.0)), 1.5 * np.log(10), rtol=1e-6)
    np.testing.assert_allclose(task.normalizer(jnp.float32(0.7)), 0.7, rtol=1e-6)
    # A diverged inner run reads as the cap, as in the reference, never as NaN.
    capped = task.normalizer(jnp.asarray([np.nan, np.inf], jnp.float32))
    np.testing.assert_allclose(capped, [1.5 * np.log(10)] * 2, rtol=1e-6)

    host = next(task.datasets.test)
    assert isinstance(host["image"], np.ndarray) and host["image"].shape == (64, 8, 8, 1)
    assert task.datasets.extra_info["num_classes"] == 10
    stacked = vec_get_batch(single_task_to_family(task), 3, split="test", numpy=True)
    assert stacked["image"].shape == (3, 64, 8, 8, 1) and stacked["label"].shape == (3, 64)


def test_digits_adam_training_reduces_loss(digits_task):
    task = digits_task
    opt = Adam(1e-2)

    def step(state, key):
        batch = task.sample_batch(key)
        loss, grad = jax.value_and_grad(task.loss)(opt.get_params(state), key, batch)
        return opt.update(state, grad, loss=loss), loss

    @jax.jit
    def train(key):
        state = opt.init(task.init(key))
        state, losses = jax.lax.scan(step, state, jax.random.split(key, 200))
        test = task.sample_batch(jax.random.fold_in(key, 1), "test")
        return losses, task.loss(opt.get_params(state), key, test)

    losses, test_loss = train(jax.random.PRNGKey(0))
    assert float(losses[0]) > 1.8
    assert float(jnp.mean(losses[-20:])) < 0.3
    assert float(test_loss) < 0.5  # generalises: well below log(10) = 2.30


def _write_npz(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def test_npz_loader_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(40, 8, 8), dtype=np.uint8)
    labels = rng.integers(0, 10, size=(40,)).astype(np.int64)
    path = _write_npz(tmp_path / "imgs.npz", images=images, labels=labels)
    task = ImageMLP_Npz8_Relu32(path, batch_size=4)
    assert [task.data.split(s).num_examples for s in SPLITS] == [28, 4, 4, 4]

    expected = {
        (img.astype(np.float32) / 255.0).tobytes(): int(lab)
        for img, lab in zip(images, labels, strict=True)
    }
    for s in SPLITS:
        arrays = task.data.split(s).host_arrays
        assert arrays["image"].shape[1:] == (8, 8, 1) and arrays["image"].dtype == np.float32
        for img, lab in zip(arrays["image"], arrays["label"], strict=True):
            assert expected[img[..., 0].tobytes()] == int(lab)
    batch = jax.jit(task.sample_batch)(jax.random.PRNGKey(0))
    assert batch["image"].shape == (4, 8, 8, 1)
    assert jnp.isfinite(task.loss(task.init(jax.random.PRNGKey(0)), None, batch))

    # Flat [N, 64] float images are accepted and used as-is.
    flat = rng.random((20, 64), dtype=np.float32)
    path2 = _write_npz(tmp_path / "flat.npz", images=flat, labels=labels[:20])
    task2 = ImageMLP_Npz8_Relu32(path2)
    got = np.concatenate([task2.data.split(s).host_arrays["image"] for s in SPLITS])
    assert _row_set(got) == _row_set(flat)


@pytest.mark.parametrize(
    ("arrays", "match"),
    [
        ({"images": np.zeros((10, 8, 8))}, r"missing key 'labels'"),
        ({"pixels": np.zeros((10, 8, 8)), "labels": np.zeros(10, int)}, r"missing key 'images'"),
        ({"images": np.zeros((10, 7, 7)), "labels": np.zeros(10, int)}, r"'images' has shape"),
        ({"images": np.zeros((10, 8, 8)), "labels": np.zeros(10)}, r"'labels'.*integer"),
        ({"images": np.zeros((10, 8, 8)), "labels": np.zeros(9, int)}, r"one label per image"),
        ({"images": np.zeros((10, 8, 8)), "labels": np.full(10, 12)}, r"'labels'.*\[0, 10\)"),
        ({"images": np.zeros((3, 8, 8)), "labels": np.zeros(3, int)}, r"too few"),
    ],
)
def test_npz_loader_errors_name_file_and_key(tmp_path, arrays, match):
    path = _write_npz(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ValueError, match=match) as err:
        ImageMLP_Npz8_Relu32(path)
    assert "bad.npz" in str(err.value)


def test_npz_loader_rejects_non_npz_and_missing_file(tmp_path):
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"this is not a zip archive")
    with pytest.raises(ValueError, match=r"garbage\.npz.*'images'"):
        ImageMLP_Npz8_Relu32(garbage)
    with pytest.raises(ValueError, match=r"nope\.npz"):
        ImageMLP_Npz8_Relu32(tmp_path / "nope.npz")


def test_custom_task_defaults():
    class Custom(Task):
        def init(self, key):
            return jnp.zeros(2)

        def loss(self, params, key, data):
            return jnp.sum(params)

    task = Custom()
    assert task.datasets is None and task.sample_batch(jax.random.PRNGKey(0)) is None
    assert task.name == "Custom"


def test_curved_quadratics_have_sampled_targets_and_per_coordinate_curvatures():
    family = CurvedQuadraticFamily(dim=6)
    targets, log_curvatures = jax.vmap(family.sample)(jax.random.split(jax.random.key(0), 500))
    curvatures = np.exp(np.asarray(log_curvatures))
    assert curvatures.min() >= 0.1 - 1e-6 and curvatures.max() <= 10.0 + 1e-5
    # Log-uniform: half of the mass below the geometric middle, 1.
    assert abs(np.mean(curvatures < 1.0) - 0.5) < 0.03
    assert abs(float(np.mean(targets))) < 0.05 and abs(float(np.std(targets)) - 1.0) < 0.05
    task = family.task_fn(family.sample(jax.random.key(1)))
    target, log_curvature = family.sample(jax.random.key(1))
    # The optimum is the sampled target, not the origin; the gradient is s * (p - t).
    assert float(task.loss(target, jax.random.key(2), None)) == 0.0
    assert float(task.loss(jnp.zeros(6), jax.random.key(2), None)) > 0.0
    p = task.init(jax.random.key(3))
    np.testing.assert_allclose(
        jax.grad(task.loss)(p, jax.random.key(2), None),
        np.exp(log_curvature) * (p - target),
        rtol=1e-5,
    )
    with pytest.raises(ValueError, match="min_curvature"):
        CurvedQuadraticFamily(dim=3, min_curvature=2.0, max_curvature=1.0)
