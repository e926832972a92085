"""Tests for popmeta.learner.checkpoint_file and popmeta.learner.checkpoints."""

from __future__ import annotations

import json
import logging
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from popmeta.learner import checkpoint_file, checkpoints
from popmeta.learner.checkpoint_file import (
    CheckpointCorruptedError,
    load_checkpoint,
    read_checkpoint_metadata,
)
from popmeta.learner.checkpoints import (
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    restore_latest,
    save_checkpoint,
)


def _tree(scale: float = 1.0) -> dict:
    params = {
        "layer": {"w": scale * jnp.arange(6.0).reshape(2, 3), "b": jnp.full((3,), scale)},
        "half": jnp.ones((2,), jnp.bfloat16) * scale,
    }
    opt = optax.adam(1e-3)
    opt_state = opt.init(params)
    _, opt_state = opt.update(jax.tree.map(jnp.ones_like, params), opt_state, params)
    return {
        "params": params,
        "opt_state": opt_state,
        "step": 7,
        "rng": jax.random.key(3),
        "raw_rng": jax.random.PRNGKey(4),
        "extra": None,
    }


def _assert_trees_equal(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)

    def check(a, e):
        if jax.dtypes.issubdtype(getattr(e, "dtype", np.float32), jax.dtypes.prng_key):
            assert jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
            assert jax.random.key_impl(a) == jax.random.key_impl(e)
            a, e = jax.random.key_data(a), jax.random.key_data(e)
        if isinstance(e, int):
            assert type(a) is int
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
        if hasattr(e, "dtype"):
            assert np.asarray(a).dtype == np.asarray(e).dtype

    jax.tree.map(check, actual, expected)


def _no_temp_files(directory) -> bool:
    return all(p.name.startswith("ckpt_") for p in directory.iterdir())


def test_round_trip(tmp_path):
    tree = _tree()
    meta = {"config": {"estimator": {"std": 0.01}}, "versions": {"jax": jax.__version__}}
    path = save_checkpoint(tmp_path, 7, tree, metadata=meta)
    assert path == tmp_path / "ckpt_00000007.npz" == checkpoint_path(tmp_path, 7)

    ckpt = load_checkpoint(path, _tree(scale=0.0))
    _assert_trees_equal(ckpt.tree, tree)
    assert ckpt.step == 7 and ckpt.path == path
    assert ckpt.metadata == meta
    assert isinstance(ckpt.tree["step"], int)
    assert read_checkpoint_metadata(path) == {"step": 7, **meta}

    # Plain numpy archive, keyed by pytree path, readable without pickle.
    with np.load(path, allow_pickle=False) as npz:
        assert "['params']['layer']['w']" in npz.files
        assert "['opt_state'][0].mu['layer']['w']" in npz.files
        header = json.loads(str(npz["__metadata__"]))
    assert header["step"] == 7
    assert header["prng_keys"] == {"['rng']": "threefry2x32"}


def test_restore_into_abstract_target(tmp_path):
    tree = _tree()
    save_checkpoint(tmp_path, 1, tree)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.asarray(x).dtype), tree)
    # Python-int leaves are kept as python ints in the target.
    target["step"] = 0
    ckpt = load_checkpoint(checkpoint_path(tmp_path, 1), target)
    _assert_trees_equal(ckpt.tree, tree)


class _XY(NamedTuple):
    x: jax.Array
    y: jax.Array


class _YX(NamedTuple):
    y: jax.Array
    x: jax.Array


def test_leaf_order_independence(tmp_path):
    tree = {"a": jnp.array([1.0, 2.0]), "b": {"x": jnp.array(3), "y": jnp.zeros((2, 2))}}
    save_checkpoint(tmp_path, 0, tree)
    # Same paths, different dict insertion order at every level.
    target = {"b": {"y": jnp.ones((2, 2)), "x": jnp.array(0)}, "a": jnp.zeros(2)}
    restored = load_checkpoint(checkpoint_path(tmp_path, 0), target).tree
    np.testing.assert_array_equal(restored["a"], [1.0, 2.0])
    assert int(restored["b"]["x"]) == 3
    np.testing.assert_array_equal(restored["b"]["y"], np.zeros((2, 2)))

    # jax sorts dict keys, so also check a case where the *leaf order* really
    # differs for the same paths: fields .x/.y declared in opposite orders.
    save_checkpoint(tmp_path, 1, {"s": _XY(x=jnp.array(1.0), y=jnp.array([2.0, 3.0]))})
    target = {"s": _YX(y=jnp.zeros(2), x=jnp.array(0.0))}
    assert [leaf.shape for leaf in jax.tree.leaves(target)] == [(2,), ()]
    restored = load_checkpoint(checkpoint_path(tmp_path, 1), target).tree["s"]
    assert isinstance(restored, _YX)
    assert float(restored.x) == 1.0
    np.testing.assert_array_equal(restored.y, [2.0, 3.0])


def test_structure_mismatch_errors_name_key_and_file(tmp_path):
    save_checkpoint(tmp_path, 0, {"a": jnp.zeros(2), "b": jnp.zeros(3)})
    path = checkpoint_path(tmp_path, 0)
    with pytest.raises(ValueError, match=r"ckpt_00000000\.npz.*\['c'\]"):
        load_checkpoint(path, {"a": jnp.zeros(2), "b": jnp.zeros(3), "c": jnp.zeros(1)})
    with pytest.raises(ValueError, match=r"ckpt_00000000\.npz.*\['b'\].*not in the target"):
        load_checkpoint(path, {"a": jnp.zeros(2)})
    with pytest.raises(ValueError, match=r"ckpt_00000000\.npz.*\['b'\].*expected \(4,\).*\(3,\)"):
        load_checkpoint(path, {"a": jnp.zeros(2), "b": jnp.zeros(4)})


def test_keep_last_k(tmp_path):
    for step in range(0, 60, 10):
        save_checkpoint(tmp_path, step, {"x": jnp.array(float(step))}, keep=3)
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "ckpt_00000030.npz",
        "ckpt_00000040.npz",
        "ckpt_00000050.npz",
    ]
    ckpt = restore_latest(tmp_path, {"x": jnp.array(0.0)})
    assert ckpt.step == 50 and float(ckpt.tree["x"]) == 50.0
    assert _no_temp_files(tmp_path)


def test_truncated_newest_falls_back_with_warning(tmp_path, caplog):
    target = {"x": jnp.zeros(100)}
    save_checkpoint(tmp_path, 1, {"x": jnp.full((100,), 1.0)})
    newest = save_checkpoint(tmp_path, 2, {"x": jnp.full((100,), 2.0)})
    with open(newest, "r+b") as f:
        f.truncate(os.path.getsize(newest) // 2)

    with pytest.raises(CheckpointCorruptedError, match="ckpt_00000002"):
        load_checkpoint(newest, target)
    with caplog.at_level(logging.WARNING, logger=checkpoints.__name__):
        ckpt = restore_latest(tmp_path, target)
    assert ckpt.step == 1
    np.testing.assert_array_equal(ckpt.tree["x"], np.full((100,), 1.0))
    assert any("ckpt_00000002.npz" in r.getMessage() for r in caplog.records)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=checkpoints.__name__):
        assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 1)
    assert any("ckpt_00000002.npz" in r.getMessage() for r in caplog.records)


def test_garbage_file_and_empty_directory(tmp_path, caplog):
    assert restore_latest(tmp_path, {"x": jnp.zeros(1)}) is None
    assert restore_latest(tmp_path / "missing", {"x": jnp.zeros(1)}) is None
    assert latest_checkpoint(tmp_path) is None
    checkpoint_path(tmp_path, 5).write_bytes(b"not a zip at all")
    with caplog.at_level(logging.WARNING, logger=checkpoints.__name__):
        assert restore_latest(tmp_path, {"x": jnp.zeros(1)}) is None
    assert any("ckpt_00000005.npz" in r.getMessage() for r in caplog.records)


def test_crash_mid_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"x": jnp.array(1.0)})
    before = checkpoint_path(tmp_path, 1).read_bytes()

    def crash(src, dst):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(checkpoint_file.os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(tmp_path, 2, {"x": jnp.array(2.0)}, keep=1)
    monkeypatch.undo()

    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt_00000001.npz"]
    assert checkpoint_path(tmp_path, 1).read_bytes() == before
    assert _no_temp_files(tmp_path)
    ckpt = restore_latest(tmp_path, {"x": jnp.array(0.0)})
    assert ckpt.step == 1 and float(ckpt.tree["x"]) == 1.0


def test_stale_temp_file_from_killed_writer_is_cleaned(tmp_path):
    stale = tmp_path / ".tmp-ckpt_abc.npz.partial"
    stale.write_bytes(b"half written")
    save_checkpoint(tmp_path, 3, {"x": jnp.array(3.0)})
    assert not stale.exists()
    assert _no_temp_files(tmp_path)


def test_rejects_non_json_metadata_and_non_dict_tree(tmp_path):
    with pytest.raises(TypeError, match="json"):
        save_checkpoint(tmp_path, 0, {"x": jnp.zeros(1)}, metadata={"bad": object()})
    with pytest.raises(TypeError, match="dict"):
        save_checkpoint(tmp_path, 0, [jnp.zeros(1)])
    assert list(tmp_path.iterdir()) == []


def test_train_state_round_trip_and_resume(tmp_path):
    from popmeta.learner.train_state import (
        TrainState,
        build_apply_estimates_fn,
        make_outer_optimizer,
    )

    tx = make_outer_optimizer("adam", 3.0, learning_rate=0.1)
    step = build_apply_estimates_fn()

    def apply(state, grad):
        return step(state, [grad])[:2]

    def fresh():
        return TrainState.initial_state({"w": jnp.zeros(3)}, tx, jax.random.key(0))

    state, _ = apply(fresh(), {"w": jnp.ones(3)})
    save_checkpoint(tmp_path, int(state.step), {"train_state": state})
    restored = restore_latest(tmp_path, {"train_state": fresh()}).tree["train_state"]
    assert restored.tx is tx and int(restored.step) == 1
    # Resuming gives exactly what continuing would have given.
    continued, _ = apply(state, {"w": jnp.ones(3)})
    resumed, _ = apply(restored, {"w": jnp.ones(3)})
    np.testing.assert_array_equal(resumed.params["w"], continued.params["w"])
    np.testing.assert_array_equal(
        jax.random.key_data(resumed.step_rng()), jax.random.key_data(continued.step_rng())
    )
