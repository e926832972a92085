"""NormalizedMLPLOpt: a per-parameter MLP's direction, RMS-normalized per tensor, times a learned schedule.

The update rule of the generalist learned optimizer, after the elements Celo
(2025) and Celo2 (ICLR 2026) credit for stability far outside the training
distribution:

    a       = m_hat / (sqrt(v_hat) + epsilon)            Adam's direction, per parameter
    d, s    = MLP(per-parameter features, global features)
    u       = exp(bound(s)) * (a + d)                    (correction_scale="adam": a + rms(a) * d)
    n       = u / rms(u)                                  RMS over each tensor, every step
                                                          (step_rms="at_most": u / max(rms(u), 1))
                                                          (element_clip=c: then clip(n, -c, c))
    lr      = exp(log_lr + bound(schedule(global features))) * external(f)
                                                          (loss_guard=g: times guard, below)
    p      <- p - lr * (n + wd * p)                      wd: weight_decay (weight_decay_horizon=H:
                                                          times H / num_steps; braked_weight_decay=w:
                                                          wd + (w - wd) * (1 - guard))
                                                          (fan_in_base=B: lr times
                                                          min(1, B / fan_in) ** fan_in_power;
                                                          fan_in_power="learned": times
                                                          (B / fan_in) ** bound(theta's power))
                                                          (sign_symmetric: d odd, s even under
                                                          negating p with its gradients)

Every tensor moves by exactly ``lr`` in root mean square (at most ``lr`` with
``step_rms="at_most"``), so no input the MLP never saw can make a step
explode. Untrained, it is Adam with its update RMS-normalized per tensor
(clipped to RMS 1 per tensor with ``at_most``). With
``correction_scale="adam"`` the MLP's correction is measured in units of
Adam's own step per tensor, so the learned part of a step shrinks as Adam's
does once the gradient's sign is noise. The RMS bounds a tensor's step, not
one parameter's: one of ``n`` elements may take up to ``sqrt(n)`` step sizes;
``element_clip`` bounds that too. ``loss_guard`` is a hand-designed brake
on the step size for runs longer than meta-training's: with ``c`` the loss
EMA's climb above its lowest value so far, in units of the first loss,
``guard = min over the run so far of min(1, g / c)``, so a climb of ``2 g``
halves every later step (one that never climbs by ``g`` is untouched).
``loss_guard_relative`` (``q``) also lets through a climb of at most ``q``
times the lowest EMA: a noisy loss far above zero climbs by ``g`` first
losses on noise alone, an unstable run by several times its lowest loss.
``braked_weight_decay`` raises the decay as the brake engages: a loss that
climbs late in a run is a rule fitting faster than the task generalizes, and
a run whose loss never climbs keeps the small decay. ``weight_decay_horizon``
scales the decay by ``H / num_steps``, so that a run of any length decays
its weights as much in all as a run of ``H`` steps: a decay per step that
regularizes a short run enough shrinks the weights ten times as far over a
run ten times as long. ``fan_in_base`` shrinks
the step of a tensor with more inputs than the rule met in meta-training: an
RMS-normalized step moves a layer's output by about the step size times its
fan-in, so a wider layer takes a larger step in what it computes; with
``fan_in_power="learned"`` meta-training chooses the power, and a layer with
fewer inputs than ``B`` steps further. Its features, and why:
docs/generalist.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from popmeta.core import tree_utils
from popmeta.core.learned_optimizers.base import LearnedOptimizer, MetaParams, OptimizerOfTheta
from popmeta.core.learned_optimizers.features import (
    DEFAULT_DECAYS,
    HORIZON_CENTERS,
    SHORT_TIMESCALES,
    adam_and_mlp,
    advanced_fields,
    beta1_index,
    checked_mlp_dtype,
    checked_num_steps,
    mlp_init,
    num_per_parameter_features,
    num_time_and_horizon_features,
    per_parameter_mlp_init,
    safe_sqrt,
    second_moment_normalize,
    start_fields,
    time_and_horizon_features,
    update_accumulators,
)
from popmeta.core.optimizers import Optimizer

__all__ = ["EXTERNAL_SCHEDULES", "NormalizedMLPLOpt", "NormalizedMLPLOptState"]

Params = Any

#: Fixed multipliers of the step size, by name, as functions of the fraction of the run done.
EXTERNAL_SCHEDULES = {
    "constant": lambda f: jnp.ones_like(f),
    "cosine": lambda f: 0.5 * (1.0 + jnp.cos(jnp.pi * jnp.clip(f, 0.0, 1.0))),
    "linear": lambda f: 1.0 - jnp.clip(f, 0.0, 1.0),
}
#: The learned log step-size offset and per-parameter log-scale stay within +- this.
_LOG_SCALE_BOUND = 4.0
_LOSS_EMA_DECAY = 0.9
#: Added to a feature's mean square before it is normalized: far below float32's squares of
#: gradients, so a tensor's features are the same at any gradient scale (MLPLOpt's 1e-5 is not).
_FEATURE_EPSILON = 1e-30
#: Added under the square root of the per-tensor RMS: a tensor whose gradients are all zero stays put.
_RMS_EPSILON = 1e-30
#: A meta-trained fan-in power stays within +- this: at 1 a weight's step is inversely
#: proportional to its fan-in, as tuned Adam's rate nearly is across the digits MLPs' input sizes.
_FAN_IN_POWER_BOUND = 1.0


def _bounded(x: jax.Array) -> jax.Array:
    return _LOG_SCALE_BOUND * jnp.tanh(x / _LOG_SCALE_BOUND)


def _finite_or_zero(x: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(x), x, 0.0)


def _relative(loss: jax.Array, reference: jax.Array) -> jax.Array:
    """``(loss - reference) / (|loss| + |reference|)`` in [-1, 1]; 0 for non-finite inputs."""
    ratio = (loss - reference) / (jnp.abs(loss) + jnp.abs(reference) + 1e-12)
    return _finite_or_zero(ratio)


class NormalizedMLPLOptState(NamedTuple):
    """State of the optimizer produced by :class:`NormalizedMLPLOpt`.

    Attributes:
      params: Current parameters.
      momentums: Params-shaped pytree; each leaf has a trailing axis of size
        ``len(decays)`` holding the gradient EMAs.
      rms: Params-shaped pytree of squared-gradient EMAs.
      iteration: Number of updates applied so far (int32 scalar).
      num_steps: Planned length of the inner run (float32 scalar).
      initial_loss: The loss at the first step (float32; 0 before it).
      loss_ema: EMA of the loss (float32; the first loss before the second step).
      lowest_loss_ema: The lowest ``loss_ema`` so far (float32; None without ``loss_guard``).
      guard: The ``loss_guard``'s factor on the step size (float32; None without it, so that
        the state, and the worker states in checkpoints, stay as they were without it).
    """

    params: Params
    momentums: Params
    rms: Params
    iteration: jax.Array
    num_steps: jax.Array
    initial_loss: jax.Array
    loss_ema: jax.Array
    lowest_loss_ema: jax.Array | None
    guard: jax.Array | None

    replace = tree_utils.replace


class _NormalizedMLPLOptOptimizer(OptimizerOfTheta):
    _lopt: NormalizedMLPLOpt

    def init(
        self, params: Params, num_steps: int | jax.Array | None = None, key: jax.Array | None = None
    ) -> NormalizedMLPLOptState:
        del key
        zero = jnp.asarray(0.0, jnp.float32)
        guarded = self._lopt.loss_guard is not None
        return NormalizedMLPLOptState(
            **start_fields(params, len(self._lopt.decays)),
            num_steps=checked_num_steps(self._lopt.name, num_steps),
            initial_loss=zero,
            loss_ema=zero,
            lowest_loss_ema=zero if guarded else None,
            guard=jnp.asarray(1.0, jnp.float32) if guarded else None,
        )

    def _loss_features(
        self, state: NormalizedMLPLOptState, loss: jax.Array | None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The loss features and the state's next ``initial_loss`` and ``loss_ema``."""
        if loss is None:
            raise ValueError(f"{self._lopt.name} reads the loss: pass loss= to update or step")
        loss = jnp.asarray(loss, jnp.float32)
        first = state.iteration == 0
        # A non-finite first loss leaves no reference (0) rather than a NaN for the whole run.
        initial = _finite_or_zero(jnp.where(first, loss, state.initial_loss))
        ema = _finite_or_zero(jnp.where(first, loss, state.loss_ema))
        features = jnp.stack([_relative(loss, initial), _relative(loss, ema)])
        next_ema = _LOSS_EMA_DECAY * ema + (1.0 - _LOSS_EMA_DECAY) * loss
        next_ema = jnp.where(jnp.isfinite(next_ema), next_ema, ema)
        return features, initial, next_ema

    def step(
        self,
        state: NormalizedMLPLOptState,
        grad: Params,
        loss: jax.Array | None = None,
        key: jax.Array | None = None,
    ) -> tuple[Params, NormalizedMLPLOptState]:
        del key
        lopt, theta = self._lopt, self._theta
        momentums, rms, iteration = update_accumulators(lopt, state, grad)
        shared = time_and_horizon_features(
            iteration, state.num_steps, lopt.timescales, lopt.horizon_centers
        )
        initial_loss, loss_ema = state.initial_loss, state.loss_ema
        lowest_loss_ema, guard = state.lowest_loss_ema, state.guard
        if lopt.uses_loss:
            loss_features, initial_loss, loss_ema = self._loss_features(state, loss)
            if lopt.loss_features:
                shared = jnp.concatenate([shared, loss_features])
        if lopt.loss_guard is not None:
            lowest_loss_ema, guard = _guarded(
                state, initial_loss, loss_ema, lopt.loss_guard, lopt.loss_guard_relative
            )
        if lopt.run_length_feature:
            shared = jnp.concatenate([shared, (jnp.log10(state.num_steps) - 2.0)[None]])

        schedule = _schedule_mlp(theta["schedule"], shared)
        fraction = iteration / state.num_steps
        lr = jnp.exp(theta["log_lr"] + _bounded(schedule)) * EXTERNAL_SCHEDULES[
            lopt.external_schedule
        ](fraction)
        weight_decay = lopt.weight_decay
        if lopt.weight_decay_horizon is not None:
            weight_decay = weight_decay * (lopt.weight_decay_horizon / state.num_steps)
        if guard is not None:
            lr = lr * guard
            if lopt.braked_weight_decay is not None:
                weight_decay = weight_decay + (lopt.braked_weight_decay - weight_decay) * (
                    1 - guard
                )

        directions, corrections, log_scales = adam_and_mlp(
            lopt,
            theta["mlp"],
            state.params,
            grad,
            momentums,
            rms,
            iteration,
            shared,
            normalize_epsilon=_FEATURE_EPSILON,
            sign_symmetric=lopt.sign_symmetric,
        )

        fan_in_power = (
            _FAN_IN_POWER_BOUND * jnp.tanh(theta["fan_in_power"])
            if lopt.fan_in_power == "learned"
            else lopt.fan_in_power
        )

        def tensor_update(
            p: jax.Array, a: jax.Array, correction: jax.Array, log_scale: jax.Array
        ) -> jax.Array:
            if lopt.correction_scale == "adam":
                correction = correction * safe_sqrt(jnp.mean(jnp.square(a)))
            u = jnp.exp(_bounded(log_scale)) * (a + correction)
            if lopt.step_rms == "at_most":
                normalized = u * jax.lax.rsqrt(jnp.maximum(jnp.mean(jnp.square(u)), 1.0))
            else:
                normalized = second_moment_normalize(u, tuple(range(u.ndim)), _RMS_EPSILON)
            if lopt.element_clip is not None:
                normalized = jnp.clip(normalized, -lopt.element_clip, lopt.element_clip)
            if lopt.weight_decay or lopt.braked_weight_decay:
                normalized = normalized + weight_decay * p
            return -(lr * _fan_in_factor(lopt, fan_in_power, p.shape) * normalized).astype(p.dtype)

        updates = jax.tree.map(tensor_update, state.params, directions, corrections, log_scales)
        following = state._replace(
            **advanced_fields(state, updates, momentums, rms),
            initial_loss=initial_loss,
            loss_ema=loss_ema,
            lowest_loss_ema=lowest_loss_ema,
            guard=guard,
        )
        return updates, following


def _guarded(
    state: NormalizedMLPLOptState,
    initial_loss: jax.Array,
    loss_ema: jax.Array,
    threshold: float,
    relative: float,
) -> tuple[jax.Array, jax.Array]:
    """The next ``lowest_loss_ema`` and ``guard``: the step shrinks as the loss EMA climbs.

    The climb is measured in units of the first loss so that the noise of a
    loss near zero (a ratio to the lowest EMA would be huge) does not brake
    the step; a climb within ``relative`` times the lowest EMA does not
    either, so that neither does the noise of a loss far from zero. The
    guard only ever falls: a rule whose loss climbed once at this step size
    keeps the smaller step for the rest of the run.
    """
    lowest = jnp.where(state.iteration == 0, loss_ema, jnp.minimum(state.lowest_loss_ema, loss_ema))
    rise = loss_ema - lowest
    climb = _finite_or_zero(rise / (jnp.abs(initial_loss) + 1e-12))
    allowed = jnp.minimum(1.0, threshold / jnp.maximum(climb, 1e-12))
    allowed = jnp.where(rise > relative * jnp.abs(lowest), allowed, 1.0)
    return lowest, jnp.minimum(state.guard, allowed)


def _fan_in_factor(
    lopt: NormalizedMLPLOpt, power: float | jax.Array, shape: tuple[int, ...]
) -> float | jax.Array:
    """The step-size factor of a tensor of ``shape``; 1 without a base.

    A fixed ``power`` only shrinks wide weights: ``min(1, fan_in_base / fan_in)
    ** power``. A learned one (``step`` bounds it once per step) scales both
    ways, ``(fan_in_base / fan_in) ** power``, written as an ``exp`` so that
    the untrained power 0 gives exactly 1. The fan-in of a weight (two or more
    axes) is the product of all but its last axis: a dense ``[in, out]``
    matrix's ``in``, a ``[k, k, C, C_out]`` kernel's ``k * k * C``. A bias or
    scalar has none and keeps its step.
    """
    if lopt.fan_in_base is None or len(shape) < 2:
        return 1.0
    fan_in = float(np.prod(shape[:-1]))
    if lopt.fan_in_power == "learned":
        return jnp.exp(power * float(np.log(lopt.fan_in_base / fan_in)))
    return min(1.0, lopt.fan_in_base / fan_in) ** power


def _schedule_mlp(theta: Params, x: jax.Array) -> jax.Array:
    """The schedule MLP (relu hidden layers, one output) on the global features ``x``."""
    n_layers = len(theta)
    for i in range(n_layers):
        layer = theta[f"linear_{i}"]
        x = x @ layer["w"] + layer["b"]
        if i < n_layers - 1:
            x = jax.nn.relu(x)
    return x[0]


class NormalizedMLPLOpt(LearnedOptimizer):
    """Per-tensor RMS-normalized MLP updates times a learned step-size schedule (module docstring).

    Theta is ``{"log_lr": scalar, "mlp": {"linear_i": {"w", "b"}}, "schedule":
    {"linear_i": {"w", "b"}}}``, and ``"fan_in_power": scalar`` (from 0) with
    ``fan_in_power="learned"``; both MLPs' output layers start at zero.
    """

    needs_num_steps = True

    def __init__(
        self,
        initial_lr: float = 1e-3,
        beta1: float = 0.9,
        hidden_size: int = 32,
        hidden_layers: int = 2,
        schedule_hidden_size: int = 16,
        loss_features: bool = True,
        external_schedule: str = "constant",
        weight_decay: float = 0.0,
        step_rms: str = "equal",
        correction_scale: str = "unit",
        run_length_feature: bool = False,
        element_clip: float | None = None,
        loss_guard: float | None = None,
        braked_weight_decay: float | None = None,
        loss_guard_relative: float = 0.0,
        fan_in_base: float | None = None,
        fan_in_power: float | str = 0.5,
        sign_symmetric: bool = False,
        weight_decay_horizon: float | None = None,
        decays: Sequence[float] = DEFAULT_DECAYS,
        rms_decay: float = 0.999,
        timescales: Sequence[float] = SHORT_TIMESCALES,
        horizon_centers: Sequence[float] = HORIZON_CENTERS,
        epsilon: float = 1e-8,
        mlp_dtype: str = "float32",
    ):
        """Builds the learned optimizer.

        Args:
          initial_lr: root mean square of every tensor's step, untrained.
          beta1: the first-moment decay of Adam's direction; one of ``decays``.
          hidden_size: width of the per-parameter MLP's hidden layers.
          hidden_layers: number of its hidden layers.
          schedule_hidden_size: width of the schedule MLP's one hidden layer.
          loss_features: whether both MLPs read the normalized loss features
            (then the optimizer needs the loss every step).
          external_schedule: a key of :data:`EXTERNAL_SCHEDULES` multiplying the step size.
          weight_decay: decoupled weight decay scaled by the step size, as in
            AdamW: ``p <- p - lr * (n + weight_decay * p)``. A normalized step
            keeps its full size once the gradient carries no signal, and
            without decay keeps scaling the weights up (docs/generalist.md).
          decays: momentum EMA decays, one feature (and one ratio feature) each.
          rms_decay: decay of the squared-gradient EMA (Adam's beta2).
          timescales: iteration timescales of the short time features.
          horizon_centers: fractions of the run where a horizon feature switches sign.
          epsilon: Adam's epsilon, also added before ``rsqrt`` in the features.
          step_rms: ``equal``: every tensor's step (before the decay) has a
            root mean square of exactly the step size. ``at_most``: the
            direction is divided by ``max(rms, 1)`` instead, so a step is
            bounded by the step size but shrinks where Adam's does, when the
            gradient's sign is noise (untrained, it is then Adam with its
            update clipped to RMS 1 per tensor).
          correction_scale: what the MLP's correction to Adam's direction is
            measured in. ``unit``: it is added as it comes out, so late in a
            long run, when Adam's steps have shrunk, it is most of the step.
            ``adam``: it is multiplied by the root mean square of Adam's
            direction over the tensor first, so the learned part of a step
            shrinks with Adam's (docs/generalist.md).
          run_length_feature: whether both MLPs also read how long the run
            is, ``log10(num_steps) - 2`` (0 at 100 steps), so that the rule can
            take different steps in runs of different lengths at the same
            fraction done; the other time features read only that fraction.
          element_clip: the largest step one parameter may take (before the
            decay), in step sizes; ``None``: no bound but the tensor's RMS,
            which lets one of ``n`` elements move ``sqrt(n)`` step sizes.
            One element of Adam's own direction is at most ``(1 - beta1) /
            sqrt((1 - rms_decay) * (1 - beta1**2 / rms_decay))`` (7.27 with
            the defaults, by Cauchy-Schwarz over the two EMAs; a gradient
            growing by ``rms_decay / beta1`` a step approaches it, a lone
            gradient after a long silence reaches 3.16), so with
            ``step_rms="at_most"`` a bound above 7.27 leaves the untrained
            rule's steps as they are.
          loss_guard: ``g``: every later step is at most ``g / c`` of the
            rule's own, ``c`` the largest climb of the loss EMA above its
            lowest value so far, in units of the first loss (the module
            docstring); ``None``: no brake. Hand-designed, not meta-trained.
          braked_weight_decay: ``w`` (needs ``loss_guard``): the decay once the
            brake has stopped the step, ``weight_decay + (w - weight_decay) *
            (1 - guard)`` on the way; ``None``: ``weight_decay`` throughout.
          loss_guard_relative: ``q`` (with ``loss_guard``): the brake ignores
            a climb of the loss EMA of at most ``q`` times its lowest value
            (absolute), so the noise of a loss far above zero does not brake
            a converging run; 0: every climb counts.
          fan_in_base: ``B``: a weight with fan-in above ``B`` (the product
            of all its axes but the last) steps ``(B / fan_in) **
            fan_in_power`` of the step size; biases, scalars and weights of
            fan-in at most ``B`` keep it. ``None``: every tensor steps the
            step size. Hand-designed, not meta-trained.
          fan_in_power: the power of that factor (0.5: a fourfold fan-in
            halves the step); another value needs ``fan_in_base``.
            ``"learned"`` (needs ``fan_in_base``): theta's ``fan_in_power``,
            meta-trained from 0 (untrained, every tensor keeps its step)
            within +-1, and the factor ``(B / fan_in) ** power`` applies
            both ways, so a weight of fewer inputs than ``B`` steps further.
          sign_symmetric: whether the MLP's correction is odd and its
            log-scale even under negating a parameter with its gradient
            history (:func:`~popmeta.core.learned_optimizers.features.per_parameter_mlp`),
            so that the step of a parameter negated with its gradients is
            the step negated, as Adam's is: a correction that moves every
            parameter the same way, whatever its gradient, cannot be learned.
            The same theta; one more pass of the MLP.
          weight_decay_horizon: ``H``: ``weight_decay`` holds in a run of
            ``H`` steps, and a run of ``num_steps`` decays by ``weight_decay *
            H / num_steps`` a step, so every run length shrinks the weights
            by the same factor in all (braked decay still rises to
            ``braked_weight_decay``); ``None``: ``weight_decay`` a step at
            every length. Hand-designed, not meta-trained.
          mlp_dtype: what the MLP's layers multiply in: ``float32``, or
            ``bfloat16`` (float32 sums; features, theta and state stay float32).
        """
        if not initial_lr > 0:
            raise ValueError(f"initial_lr must be > 0, got {initial_lr!r}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        if step_rms not in ("equal", "at_most"):
            raise ValueError(f"step_rms must be 'equal' or 'at_most', got {step_rms!r}")
        if correction_scale not in ("unit", "adam"):
            raise ValueError(f"correction_scale must be 'unit' or 'adam', got {correction_scale!r}")
        if element_clip is not None and not element_clip > 0:
            raise ValueError(f"element_clip must be > 0 or None, got {element_clip!r}")
        if loss_guard is not None and not loss_guard > 0:
            raise ValueError(f"loss_guard must be > 0 or None, got {loss_guard!r}")
        if braked_weight_decay is not None and not (
            loss_guard is not None and braked_weight_decay >= 0
        ):
            raise ValueError(
                f"braked_weight_decay must be >= 0 and needs loss_guard, got "
                f"braked_weight_decay={braked_weight_decay!r}, loss_guard={loss_guard!r}"
            )
        if not loss_guard_relative >= 0 or (loss_guard_relative and loss_guard is None):
            raise ValueError(
                f"loss_guard_relative must be >= 0 and needs loss_guard when > 0, got "
                f"loss_guard_relative={loss_guard_relative!r}, loss_guard={loss_guard!r}"
            )
        if weight_decay_horizon is not None and not weight_decay_horizon > 0:
            raise ValueError(
                f"weight_decay_horizon must be > 0 or None, got {weight_decay_horizon!r}"
            )
        if fan_in_base is not None and not fan_in_base > 0:
            raise ValueError(f"fan_in_base must be > 0 or None, got {fan_in_base!r}")
        learned_power = fan_in_power == "learned"
        fixed_power = isinstance(fan_in_power, int | float) and fan_in_power >= 0
        if not (learned_power or fixed_power) or (fan_in_power != 0.5 and fan_in_base is None):
            raise ValueError(
                f"fan_in_power must be >= 0 or 'learned' and needs fan_in_base when not 0.5, "
                f"got fan_in_power={fan_in_power!r}, fan_in_base={fan_in_base!r}"
            )
        if external_schedule not in EXTERNAL_SCHEDULES:
            raise ValueError(
                f"external_schedule must be one of {sorted(EXTERNAL_SCHEDULES)}, "
                f"got {external_schedule!r}"
            )
        self.decays = tuple(float(d) for d in decays)
        self.initial_lr = float(initial_lr)
        self.beta1 = float(beta1)
        self.beta1_index = beta1_index(beta1, self.decays)
        self.hidden_size = int(hidden_size)
        self.hidden_layers = int(hidden_layers)
        self.schedule_hidden_size = int(schedule_hidden_size)
        self.loss_features = bool(loss_features)
        self.external_schedule = external_schedule
        self.weight_decay = float(weight_decay)
        self.step_rms = step_rms
        self.correction_scale = correction_scale
        self.run_length_feature = bool(run_length_feature)
        self.element_clip = None if element_clip is None else float(element_clip)
        self.loss_guard = None if loss_guard is None else float(loss_guard)
        self.braked_weight_decay = (
            None if braked_weight_decay is None else float(braked_weight_decay)
        )
        self.loss_guard_relative = float(loss_guard_relative)
        self.fan_in_base = None if fan_in_base is None else float(fan_in_base)
        self.fan_in_power = fan_in_power if learned_power else float(fan_in_power)
        self.sign_symmetric = bool(sign_symmetric)
        self.weight_decay_horizon = (
            None if weight_decay_horizon is None else float(weight_decay_horizon)
        )
        self.rms_decay = float(rms_decay)
        self.timescales = tuple(float(t) for t in timescales)
        self.horizon_centers = tuple(float(c) for c in horizon_centers)
        self.epsilon = float(epsilon)
        self.mlp_dtype = checked_mlp_dtype(mlp_dtype)

    @property
    def uses_loss(self) -> bool:
        """Whether its optimizer needs the loss every step (with ``loss_features`` or ``loss_guard``)."""
        return self.loss_features or self.loss_guard is not None

    @property
    def num_global_features(self) -> int:
        """Width of the global features (10 with the defaults)."""
        loss = 2 if self.loss_features else 0
        run_length = 1 if self.run_length_feature else 0
        time = num_time_and_horizon_features(len(self.timescales), len(self.horizon_centers))
        return time + loss + run_length

    @property
    def num_features(self) -> int:
        """Width of the per-parameter MLP's input (20 with the defaults)."""
        return num_per_parameter_features(len(self.decays)) + self.num_global_features

    def init(self, key: jax.Array) -> MetaParams:
        key_mlp, key_schedule = jax.random.split(key)
        schedule_sizes = (self.num_global_features, self.schedule_hidden_size, 1)
        theta = {
            "log_lr": jnp.asarray(np.log(self.initial_lr), jnp.float32),
            "mlp": per_parameter_mlp_init(
                key_mlp,
                self.num_features,
                self.hidden_size,
                self.hidden_layers,
                output_init_scale=0.0,
            ),
            "schedule": mlp_init(key_schedule, schedule_sizes, output_init_scale=0.0),
        }
        if self.fan_in_power == "learned":
            theta["fan_in_power"] = jnp.asarray(0.0, jnp.float32)
        return theta

    def opt_fn(self, theta: MetaParams, is_training: bool = False) -> Optimizer:
        del is_training
        return _NormalizedMLPLOptOptimizer(self, theta)
