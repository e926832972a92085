"""Building blocks shared by the per-parameter MLP learned optimizers.

:class:`~popmeta.core.learned_optimizers.MLPLOpt`,
:class:`~popmeta.core.learned_optimizers.AdamMLPLOpt` and
:class:`~popmeta.core.learned_optimizers.NormalizedMLPLOpt` apply one tiny MLP
to every parameter of every tensor, reading the same per-parameter features of
its optimisation history; this module holds those features, the accumulators
they read (and the state fields that carry them), Adam's direction and the MLP.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = [
    "DEFAULT_DECAYS",
    "HORIZON_CENTERS",
    "MLP_DTYPES",
    "SHORT_TIMESCALES",
    "AccumulatorFields",
    "AdamFields",
    "adam_and_mlp",
    "adam_directions",
    "advanced_fields",
    "beta1_index",
    "checked_mlp_dtype",
    "checked_num_steps",
    "mlp_init",
    "num_per_parameter_features",
    "num_time_and_horizon_features",
    "per_parameter_features",
    "per_parameter_mlp",
    "per_parameter_mlp_init",
    "safe_sqrt",
    "second_moment_normalize",
    "short_time_features",
    "start_fields",
    "time_and_horizon_features",
    "update_accumulators",
]

Params = Any

#: Momentum EMA decays of popmeta's MLPLOpt (learned_optimization's has six: docs/learned-optimizers.md).
DEFAULT_DECAYS: tuple[float, ...] = (0.5, 0.9, 0.99)
#: Timescales (in steps) of the short time features: where a run is in its first steps.
SHORT_TIMESCALES: tuple[float, ...] = (1, 3, 10, 30)
#: Fractions of the run where a ``tanh`` horizon feature switches sign.
HORIZON_CENTERS: tuple[float, ...] = (0.1, 0.5, 0.9)
#: Sharpness of the ``tanh(8 (f - c))`` horizon features.
_HORIZON_SHARPNESS = 8.0
#: Per-parameter features besides the per-decay ones: ``p``, ``g``, ``v``, ``1/sqrt(v)``.
_NUM_PER_PARAMETER_BASE = 4


#: What a per-parameter MLP's layers may multiply in (``mlp_dtype``).
MLP_DTYPES = ("float32", "bfloat16")


def checked_mlp_dtype(mlp_dtype: str) -> str:
    """``mlp_dtype`` if it is one of :data:`MLP_DTYPES`; else a ValueError naming them."""
    if mlp_dtype not in MLP_DTYPES:
        raise ValueError(f"mlp_dtype must be one of {MLP_DTYPES}, got {mlp_dtype!r}")
    return mlp_dtype


def num_per_parameter_features(num_decays: int) -> int:
    """Width of :func:`per_parameter_features` for ``num_decays`` momentum decays."""
    return _NUM_PER_PARAMETER_BASE + 2 * num_decays


def mirror_signs(num_decays: int) -> np.ndarray:
    """Each row's factor in :func:`per_parameter_features` when ``p``, ``g`` and ``m`` are negated.

    Negating a parameter with its gradient history negates ``p``, ``g``, the
    momentums and the ratios ``m / sqrt(v)``, and leaves ``v`` and
    ``1 / sqrt(v)``: ``-1`` for the first rows, ``+1`` for the second.
    """
    signed = np.full(num_decays, -1.0, np.float32)
    return np.concatenate([[-1.0, -1.0], signed, [1.0], signed, [1.0]]).astype(np.float32)


def start_fields(params: Params, num_decays: int) -> dict[str, Any]:
    """The state fields every per-parameter MLP optimizer starts from.

    ``params``, empty gradient EMAs ``momentums`` (a trailing axis of
    ``num_decays``), an empty squared-gradient EMA ``rms`` and ``iteration`` 0.
    """
    return {
        "params": params,
        "momentums": jax.tree.map(
            lambda p: jnp.zeros((*jnp.shape(p), num_decays), jnp.float32), params
        ),
        "rms": jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params),
        "iteration": jnp.asarray(0, jnp.int32),
    }


def advanced_fields(state: Any, updates: Params, momentums: Params, rms: Params) -> dict[str, Any]:
    """``state``'s fields of :func:`start_fields` one step on: ``updates`` applied, the new EMAs."""
    return {
        "params": optax.apply_updates(state.params, updates),
        "momentums": momentums,
        "rms": rms,
        "iteration": state.iteration + 1,
    }


class AccumulatorFields(Protocol):
    """The fields of a learned optimizer whose state holds the EMAs of :func:`start_fields`."""

    decays: tuple[float, ...]
    rms_decay: float


def update_accumulators(
    lopt: AccumulatorFields, state: Any, grad: Params
) -> tuple[Params, Params, jax.Array]:
    """``state``'s EMAs one step on with ``grad``, and its ``iteration`` as float32.

    The gradient EMAs (one per ``lopt.decays``, trailing axis) and the
    squared-gradient EMA (decay ``lopt.rms_decay``). The iteration is the
    step being taken (0 on the first), which the time features read.
    """
    decay_array = jnp.asarray(lopt.decays, jnp.float32)
    momentums = jax.tree.map(
        lambda m, g: decay_array * m + (1.0 - decay_array) * g[..., None], state.momentums, grad
    )
    rms_decay = jnp.float32(lopt.rms_decay)
    rms = jax.tree.map(
        lambda v, g: rms_decay * v + (1.0 - rms_decay) * jnp.square(g), state.rms, grad
    )
    return momentums, rms, jnp.asarray(state.iteration, jnp.float32)


def beta1_index(beta1: float, decays: Sequence[float]) -> int:
    """Where Adam's first-moment decay ``beta1`` is among the momentum ``decays``."""
    if float(beta1) not in decays:
        raise ValueError(f"beta1 ({beta1!r}) must be one of decays {tuple(decays)}")
    return list(decays).index(float(beta1))


def num_time_and_horizon_features(num_timescales: int, num_horizon_centers: int) -> int:
    """Width of :func:`time_and_horizon_features`: the short features, the fraction, the horizon."""
    return num_timescales + 1 + num_horizon_centers


def checked_num_steps(name: str, num_steps: int | jax.Array | None) -> jax.Array:
    """``num_steps`` as a float32 scalar of at least 1, for optimizers that read the horizon."""
    if num_steps is None:
        raise ValueError(
            f"{name} reads how far through its run it is: pass num_steps, the planned "
            "number of inner steps, to init(params, num_steps=...)"
        )
    return jnp.maximum(jnp.asarray(num_steps, jnp.float32), 1.0)


def short_time_features(iteration: jax.Array, timescales: Sequence[float]) -> jax.Array:
    """``tanh(iteration / timescale - 1)`` for each of ``timescales``: where a run is in its first steps."""
    return jnp.tanh(iteration / jnp.asarray(timescales, jnp.float32) - 1.0)


def time_and_horizon_features(
    iteration: jax.Array,
    num_steps: jax.Array,
    timescales: Sequence[float],
    horizon_centers: Sequence[float],
) -> jax.Array:
    """The time features every parameter reads at ``iteration`` (float32) of a ``num_steps`` run.

    :func:`short_time_features` (the first steps, while accumulators fill), the fraction of the run done
    ``f = iteration / num_steps`` and ``tanh(8 (f - c))`` for each of
    ``horizon_centers``. None reads the absolute number of steps beyond the
    short timescales, so a run ``k`` times longer than any trained on feeds
    the same range of inputs.
    """
    short = short_time_features(iteration, timescales)
    fraction = iteration / num_steps
    centers = jnp.asarray(horizon_centers, jnp.float32)
    horizon = jnp.tanh(_HORIZON_SHARPNESS * (fraction - centers))
    return jnp.concatenate([short, fraction[None], horizon])


def adam_directions(
    momentums: Params,
    rms: Params,
    iteration: jax.Array,
    beta1_index: int,
    beta1: float,
    beta2: float,
    epsilon: float,
) -> Params:
    """Adam's bias-corrected direction ``m_hat / (sqrt(v_hat) + epsilon)`` for every parameter.

    ``momentums`` and ``rms`` are the accumulators after this step's update;
    ``iteration`` (float32) counts the steps before it, so the first step's
    corrections are ``1 - beta ** 1``.
    """
    t = iteration + 1.0
    momentum_correction = 1.0 - jnp.float32(beta1) ** t
    rms_correction = 1.0 - jnp.float32(beta2) ** t

    def direction(m: jax.Array, v: jax.Array) -> jax.Array:
        m_hat = m[..., beta1_index] / momentum_correction
        return m_hat / (safe_sqrt(v / rms_correction) + epsilon)

    return jax.tree.map(direction, momentums, rms)


class AdamFields(AccumulatorFields, Protocol):
    """The fields of a learned optimizer built on Adam's direction (``rms_decay`` is its beta2)."""

    beta1: float
    beta1_index: int
    epsilon: float
    mlp_dtype: str


def adam_and_mlp(
    lopt: AdamFields,
    theta_mlp: Params,
    params: Params,
    grad: Params,
    momentums: Params,
    rms: Params,
    iteration: jax.Array,
    shared: jax.Array,
    normalize_epsilon: float = 1e-5,
    sign_symmetric: bool = False,
) -> tuple[Params, Params, Params]:
    """Adam's direction and the MLP's two outputs, each a params-shaped pytree.

    :func:`adam_directions` with ``lopt``'s ``beta1`` (its ``rms_decay`` as
    ``beta2``) and :func:`per_parameter_mlp` of ``theta_mlp`` in ``lopt.mlp_dtype``
    (``sign_symmetric`` as there), both reading the accumulators after this
    step's update and ``lopt.epsilon``.
    """
    directions = adam_directions(
        momentums, rms, iteration, lopt.beta1_index, lopt.beta1, lopt.rms_decay, lopt.epsilon
    )
    first, second = per_parameter_mlp(
        theta_mlp,
        params,
        grad,
        momentums,
        rms,
        shared,
        lopt.epsilon,
        normalize_epsilon,
        lopt.mlp_dtype,
        sign_symmetric,
    )
    return directions, first, second


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def second_moment_normalize(x: jax.Array, axes: tuple[int, ...], eps: float = 1e-5) -> jax.Array:
    """``x / sqrt(mean(x**2) + eps)`` over ``axes``, differentiable where ``x`` is all zero.

    The plain derivative goes through ``rsqrt``'s, ``-(mean + eps)**-1.5 / 2``,
    which overflows float32 for any ``eps`` below 1e-25 when the mean square
    is that small: a tensor whose gradient is zero (a dead unit, a flat
    stretch of the loss) then gives a NaN meta-gradient. The JVP below is the
    same derivative written as ``r * (dx - y * mean(y * dx))`` with ``y`` the
    result and ``r`` the ``rsqrt`` factor, none of which overflows.
    """
    return x * jax.lax.rsqrt(eps + jnp.mean(jnp.square(x), axis=axes, keepdims=True))


@second_moment_normalize.defjvp
def _second_moment_normalize_jvp(axes, eps, primals, tangents):
    (x,), (dx,) = primals, tangents
    r = jax.lax.rsqrt(eps + jnp.mean(jnp.square(x), axis=axes, keepdims=True))
    y = x * r
    return y, r * (dx - y * jnp.mean(y * dx, axis=axes, keepdims=True))


def safe_sqrt(x: jax.Array) -> jax.Array:
    """``sqrt(x)`` with a zero derivative at 0 instead of an infinite one (then NaN meta-gradients)."""
    positive = x > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, x, 1.0)), 0.0)


def per_parameter_features(
    p: jax.Array,
    g: jax.Array,
    m: jax.Array,
    v: jax.Array,
    epsilon: float,
    normalize_epsilon: float = 1e-5,
) -> jax.Array:
    """``[4 + 2 * num_decays, p.size]`` features of one tensor, normalised over the tensor.

    Feature-major: row ``i`` holds feature ``i`` of every element of the
    flattened tensor, so the normalisation reduces along rows
    (:func:`per_parameter_mlp` stacks the tensors' features side by side). In
    order: ``p``, ``g``, the momentums ``m`` (one row per decay), ``v``, the
    Adam-like ratios ``m / sqrt(v + epsilon)`` and ``1 / sqrt(v + epsilon)``,
    each divided by its root mean square over the tensor, which makes the
    optimizer invariant to each tensor's gradient and parameter scale where
    the mean squares are well above ``normalize_epsilon`` (added to them). A
    scalar tensor is treated as a tensor of one element.
    """
    size = p.size
    p, g, v = p.reshape(1, size), g.reshape(1, size), v.reshape(1, size)
    m = m.reshape(size, -1).T
    inv_rms = jax.lax.rsqrt(v + epsilon)
    features = jnp.concatenate([p, g, m, v, m * inv_rms, inv_rms], axis=0)
    return second_moment_normalize(features, (1,), normalize_epsilon)


def per_parameter_mlp_init(
    key: jax.Array,
    num_features: int,
    hidden_size: int,
    hidden_layers: int,
    output_init_scale: float,
) -> Params:
    """Theta of :func:`per_parameter_mlp`: ``hidden_layers`` of ``hidden_size`` units, 2 outputs."""
    sizes = (num_features, *([hidden_size] * hidden_layers), 2)
    return mlp_init(key, sizes, output_init_scale)


def mlp_init(key: jax.Array, sizes: Sequence[int], output_init_scale: float) -> Params:
    """``{"linear_i": {"w", "b"}}`` for layer widths ``sizes``.

    Haiku's default Linear init (truncated normal, std ``1/sqrt(fan_in)``, zero
    biases), as learned_optimization's MLPLOpt uses, with the output layer's weights
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


#: A layer with at most this many weights runs as a sum of outer products (see :func:`_linear`).
_MAX_UNROLLED_WEIGHTS = 512

#: From this many rows of features on (parameters, twice that with ``sign_symmetric``), the
#: MLP runs feature-major (see :func:`_mlp`).
FEATURE_MAJOR_MIN_ROWS = 1024


def _linear(w: jax.Array, x: jax.Array, feature_major: bool) -> jax.Array:
    """``x @ w`` for row-major ``x`` of ``[n, fan_in]``; ``w.T @ x`` for feature-major ``[fan_in, n]``.

    A small layer (the first, reading ~10 features, and the 2-unit output
    layer) is written as ``fan_in`` broadcast multiply-adds, which XLA fuses
    into one elementwise loop with the bias and the activation around it.
    Under a vmap over tasks and members, XLA's CPU dot kernels run such
    shapes one small product per member, which was slower (docs/performance.md,
    "Why it is fast"). A larger layer (the 32x32 hidden layer) is a dot;
    unrolled, it ran no faster and compiled far slower.

    Inputs of a narrower float type (bfloat16) are multiplied in it and
    summed in float32; the result is float32 either way.
    """
    fan_in, fan_out = w.shape
    if fan_in * fan_out > _MAX_UNROLLED_WEIGHTS:
        if feature_major:
            return jnp.matmul(w.T, x, preferred_element_type=jnp.float32)
        return jnp.matmul(x, w, preferred_element_type=jnp.float32)
    w, x = w.astype(jnp.float32), x.astype(jnp.float32)

    def term(k: int) -> jax.Array:  # input k of every parameter times its weights
        return x[k][None, :] * w[k][:, None] if feature_major else x[:, k, None] * w[k][None, :]

    out = term(0)
    for k in range(1, fan_in):
        out = out + term(k)
    return out


def _mlp(theta: Params, x: jax.Array, shared: jax.Array, dtype: str = "float32") -> jax.Array:
    """The MLP on feature-major inputs ``x`` of ``[features, n]``; ``[2, n]`` float32 outputs.

    ``dtype`` is what the layers' inputs and weights are multiplied in
    (``bfloat16``: in it, summed in float32, each layer's output rounded to it
    before the next layer); biases and outputs stay float32. The shared
    inputs' share of the first layer is a bias.

    Below :data:`FEATURE_MAJOR_MIN_ROWS` rows the layers run row-major
    (``[n, 32] @ [32, 32]`` for the hidden layer), from there on
    feature-major (``[32, 32] @ [32, n]``): on XLA's CPU backend the small
    problems' layers run faster row-major, the large ones' feature-major on
    one core, where the default Ray actors run (docs/performance.md, "The
    per-parameter MLP's layout"). The choice depends only on the shapes, so
    every process of a run, the driver and each actor whatever its cores,
    computes the same numbers: a run moved between engines goes on bit for
    bit.
    """
    num_per_parameter = x.shape[0]
    feature_major = x.shape[1] >= FEATURE_MAJOR_MIN_ROWS
    if not feature_major:
        x = x.T
    n_layers = len(theta)
    for i in range(n_layers):
        layer = theta[f"linear_{i}"]
        w, b = layer["w"], layer["b"]
        if i == 0:
            b = b + shared @ w[num_per_parameter:]
            w = w[:num_per_parameter]
        x = _linear(w.astype(dtype), x.astype(dtype), feature_major)
        x = x + (b[:, None] if feature_major else b)
        if i < n_layers - 1:
            x = jax.nn.relu(x)
    return x if feature_major else x.T


def per_parameter_mlp(
    theta: Params,
    params: Params,
    grad: Params,
    momentums: Params,
    rms: Params,
    shared: jax.Array,
    epsilon: float,
    normalize_epsilon: float = 1e-5,
    mlp_dtype: str = "float32",
    sign_symmetric: bool = False,
) -> tuple[Params, Params]:
    """The MLP's two outputs for every parameter, as two params-shaped pytrees.

    The features are computed in float32; ``mlp_dtype`` is what the MLP's
    layers multiply in (``bfloat16``: float32 sums, float32 outputs).

    With ``sign_symmetric`` the MLP ``f`` also runs on every parameter's
    mirrored input ``x'`` (:func:`mirror_signs`: ``p``, ``g`` and the
    momentums negated; the shared features as they are), and the outputs are
    ``(f_0(x) - f_0(x')) / 2`` and ``(f_1(x) + f_1(x')) / 2``: the first is odd
    and the second even under negating a parameter with its gradient history,
    as every hand-designed rule's step and step size are. A parameter whose
    gradients are all zero then gets no first output at ``p = 0``: the MLP
    cannot learn a drift that moves every parameter the same way whatever its
    gradient says. It costs a second pass of the MLP's layers.

    The MLP's input per parameter is :func:`per_parameter_features` of its
    tensor followed by the ``shared`` features (a vector every parameter
    reads), and the MLP is the relu MLP of :func:`mlp_init`. It is computed
    the way XLA runs it fastest, and equals the MLP applied to each
    parameter's input row up to float rounding: every tensor's features are
    stacked into one ``[features, total parameters]`` matrix, so each layer
    is one operation however many tensors the inner problem has, and the
    shared features' share of the first layer is computed once, as a bias,
    instead of once per parameter (faster than per-tensor dots:
    docs/performance.md, "Why it is fast").
    """
    leaves, treedef = jax.tree_util.tree_flatten(params)
    with jax.named_scope("per_parameter_features"):
        columns = [
            per_parameter_features(p, g, m, v, epsilon, normalize_epsilon)
            for p, g, m, v in zip(
                leaves,
                treedef.flatten_up_to(grad),
                treedef.flatten_up_to(momentums),
                treedef.flatten_up_to(rms),
                strict=True,
            )
        ]
    with jax.named_scope("per_parameter_mlp"):
        x = jnp.concatenate(columns, axis=1)
        if sign_symmetric:
            signs = mirror_signs((x.shape[0] - _NUM_PER_PARAMETER_BASE) // 2)[:, None]
            both = _mlp(theta, jnp.concatenate([x, x * signs], axis=1), shared, mlp_dtype)
            plain, mirrored = jnp.split(both, 2, axis=1)
            x = jnp.stack([plain[0] - mirrored[0], plain[1] + mirrored[1]]) * 0.5
        else:
            x = _mlp(theta, x, shared, mlp_dtype)
    offsets = np.cumsum([p.size for p in leaves])[:-1]
    outputs = jnp.split(x, offsets, axis=1)
    first = [o[0].reshape(p.shape) for o, p in zip(outputs, leaves, strict=True)]
    second = [o[1].reshape(p.shape) for o, p in zip(outputs, leaves, strict=True)]
    return treedef.unflatten(first), treedef.unflatten(second)
