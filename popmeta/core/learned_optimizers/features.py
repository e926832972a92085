"""Building blocks shared by the per-parameter MLP learned optimizers.

Both :class:`~popmeta.core.learned_optimizers.MLPLOpt` and
:class:`~popmeta.core.learned_optimizers.AdamMLPLOpt` apply one tiny MLP to
every parameter of every tensor, reading the same per-parameter features of
its optimisation history; this module holds those features, the accumulators
they read and the MLP.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "DEFAULT_DECAYS",
    "mlp_apply",
    "mlp_init",
    "num_per_parameter_features",
    "per_parameter_features",
    "per_parameter_mlp",
    "update_accumulators",
    "zero_accumulators",
]

Params = Any

#: Momentum EMA decays of the reference MLPLOpt.
DEFAULT_DECAYS: tuple[float, ...] = (0.5, 0.9, 0.99)
#: Per-parameter features besides the per-decay ones: ``p``, ``g``, ``v``, ``1/sqrt(v)``.
_NUM_PER_PARAMETER_BASE = 4


def num_per_parameter_features(num_decays: int) -> int:
    """Width of :func:`per_parameter_features` for ``num_decays`` momentum decays."""
    return _NUM_PER_PARAMETER_BASE + 2 * num_decays


def zero_accumulators(params: Params, num_decays: int) -> tuple[Params, Params]:
    """Empty gradient EMAs (a trailing axis of ``num_decays``) and squared-gradient EMA."""
    momentums = jax.tree.map(lambda p: jnp.zeros((*jnp.shape(p), num_decays), jnp.float32), params)
    rms = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    return momentums, rms


def update_accumulators(
    momentums: Params, rms: Params, grad: Params, decays: Sequence[float], rms_decay: float
) -> tuple[Params, Params]:
    """One step of the gradient EMAs (one per decay, trailing axis) and the squared-gradient EMA."""
    decay_array = jnp.asarray(decays, jnp.float32)
    momentums = jax.tree.map(
        lambda m, g: decay_array * m + (1.0 - decay_array) * g[..., None], momentums, grad
    )
    rms_decay = jnp.float32(rms_decay)
    rms = jax.tree.map(lambda v, g: rms_decay * v + (1.0 - rms_decay) * jnp.square(g), rms, grad)
    return momentums, rms


def _second_moment_normalize(x: jax.Array, axes: tuple[int, ...], eps: float = 1e-5) -> jax.Array:
    return x * jax.lax.rsqrt(eps + jnp.mean(jnp.square(x), axis=axes, keepdims=True))


def per_parameter_features(
    p: jax.Array, g: jax.Array, m: jax.Array, v: jax.Array, epsilon: float
) -> jax.Array:
    """``[*p.shape, 4 + 2 * num_decays]`` features of one tensor, normalised over the tensor.

    In order: ``p``, ``g``, the momentums ``m`` (trailing axis), ``v``, the
    Adam-like ratios ``m / sqrt(v + epsilon)`` and ``1 / sqrt(v + epsilon)``,
    each divided by its root mean square over the tensor, which makes the
    optimizer invariant to each tensor's gradient and parameter scale. A
    scalar tensor is treated as a tensor of one element.
    """
    if not p.shape:
        p, g, m, v = p[None], g[None], m[None], v[None]
    inv_rms = jax.lax.rsqrt(v + epsilon)
    features = jnp.concatenate(
        [p[..., None], g[..., None], m, v[..., None], m * inv_rms[..., None], inv_rms[..., None]],
        axis=-1,
    )
    return _second_moment_normalize(features, tuple(range(p.ndim)))


def mlp_init(key: jax.Array, sizes: Sequence[int], output_init_scale: float) -> Params:
    """``{"linear_i": {"w", "b"}}`` for layer widths ``sizes``.

    Haiku's default Linear init (truncated normal, std ``1/sqrt(fan_in)``, zero
    biases), as the reference MLPLOpt uses, with the output layer's weights
    multiplied by ``output_init_scale``.
    """
    keys = jax.random.split(key, len(sizes) - 1)
    theta = {}
    for i, (k, fan_in, fan_out) in enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True)):
        w = jax.random.truncated_normal(k, -2.0, 2.0, (fan_in, fan_out), jnp.float32)
        w = w / np.float32(np.sqrt(fan_in))
        if i == len(sizes) - 2:
            w = w * np.float32(output_init_scale)
        theta[f"linear_{i}"] = {"w": w, "b": jnp.zeros((fan_out,), jnp.float32)}
    return theta


def mlp_apply(theta: Params, x: jax.Array) -> jax.Array:
    """The relu MLP of :func:`mlp_init` on the trailing axis of ``x``."""
    n_layers = len(theta)
    for i in range(n_layers):
        layer = theta[f"linear_{i}"]
        x = x @ layer["w"] + layer["b"]
        if i < n_layers - 1:
            x = jax.nn.relu(x)
    return x


def per_parameter_mlp(
    theta: Params,
    p: jax.Array,
    g: jax.Array,
    m: jax.Array,
    v: jax.Array,
    shared: jax.Array,
    epsilon: float,
) -> jax.Array:
    """The MLP's two outputs for every element of one tensor, ``[*p.shape, 2]``.

    Its input per element is :func:`per_parameter_features` followed by the
    ``shared`` features (a vector every element of every tensor reads).
    """
    per_param = per_parameter_features(p, g, m, v, epsilon)
    inputs = jnp.concatenate(
        [per_param, jnp.broadcast_to(shared, (*per_param.shape[:-1], shared.size))], axis=-1
    )
    return jnp.reshape(mlp_apply(theta, inputs), (*p.shape, 2))
