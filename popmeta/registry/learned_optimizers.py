"""Learned optimizers: ``learned_optimizer.kind`` -> a ``LearnedOptimizer``."""

from __future__ import annotations

from typing import Literal

from popmeta.core.learned_optimizers import (
    AdamMLPLOpt,
    LearnableAdam,
    LearnableSGD,
    LearnableSGDM,
    LearnedOptimizer,
    MLPLOpt,
    NormalizedMLPLOpt,
)
from popmeta.registry.kinds import (
    Fraction,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    Registry,
)

__all__ = ["LEARNED_OPTIMIZERS"]

#: What a per-parameter MLP may multiply in (``popmeta.core.learned_optimizers.features``).
MLPDtype = Literal["float32", "bfloat16"]

LEARNED_OPTIMIZERS: Registry[LearnedOptimizer] = Registry(
    "learned_optimizer", "Learned optimizers", "a `LearnedOptimizer`", returns=LearnedOptimizer
)


@LEARNED_OPTIMIZERS.register("learnable_sgd", "SGD with a learned learning rate")
def learnable_sgd(initial_lr: PositiveFloat = 1e-3) -> LearnedOptimizer:
    """Args:
    initial_lr: the learning rate of the untrained optimizer.
    """
    return LearnableSGD(initial_lr=initial_lr)


@LEARNED_OPTIMIZERS.register("learnable_sgdm", "SGD with learned learning rate and momentum")
def learnable_sgdm(
    initial_lr: PositiveFloat = 1e-3, initial_momentum: Fraction = 0.9
) -> LearnedOptimizer:
    """Args:
    initial_lr: the learning rate of the untrained optimizer.
    initial_momentum: its momentum, in [0, 1).
    """
    return LearnableSGDM(initial_lr=initial_lr, initial_momentum=initial_momentum)


@LEARNED_OPTIMIZERS.register("learnable_adam", "Adam with learned learning rate, betas and epsilon")
def learnable_adam(
    initial_lr: PositiveFloat = 1e-3, initial_beta1: Fraction = 0.9
) -> LearnedOptimizer:
    """Args:
    initial_lr: the learning rate of the untrained optimizer.
    initial_beta1: its first-moment decay, in [0, 1).
    """
    return LearnableAdam(initial_lr=initial_lr, initial_beta1=initial_beta1)


@LEARNED_OPTIMIZERS.register("mlp", "a per-parameter MLP over gradient and momentum features")
def mlp(
    step_multiplier: PositiveFloat = 0.001,
    magnitude_multiplier: PositiveFloat = 0.001,
    hidden_size: PositiveInt = 32,
    mlp_dtype: MLPDtype = "float32",
) -> LearnedOptimizer:
    """Args:
    step_multiplier: scale of every step.
    magnitude_multiplier: scale of the log-magnitude output.
    hidden_size: width of each hidden layer.
    mlp_dtype: what the MLP multiplies in (bfloat16: float32 sums, theta and state float32).
    """
    return MLPLOpt(
        step_multiplier=step_multiplier,
        magnitude_multiplier=magnitude_multiplier,
        hidden_size=hidden_size,
        mlp_dtype=mlp_dtype,
    )


@LEARNED_OPTIMIZERS.register(
    "mlp_adam",
    "Adam (learning rate `initial_lr`) rescaled and corrected per parameter by an MLP that "
    "reads the MLP features and the fraction of the run done; starts as Adam",
)
def mlp_adam(
    initial_lr: PositiveFloat = 1e-3,
    hidden_size: PositiveInt = 32,
    mlp_dtype: MLPDtype = "float32",
) -> LearnedOptimizer:
    """Args:
    initial_lr: Adam's learning rate, the untrained optimizer's.
    hidden_size: width of each hidden layer.
    mlp_dtype: what the MLP multiplies in (bfloat16: float32 sums, theta and state float32).
    """
    return AdamMLPLOpt(initial_lr=initial_lr, hidden_size=hidden_size, mlp_dtype=mlp_dtype)


@LEARNED_OPTIMIZERS.register(
    "normalized_mlp",
    "a per-parameter MLP's direction (from Adam's), RMS-normalized per tensor every step, times "
    "a learned step-size schedule over progress and loss; starts as per-tensor normalized Adam",
)
def normalized_mlp(
    initial_lr: PositiveFloat = 1e-3,
    hidden_size: PositiveInt = 32,
    schedule_hidden_size: PositiveInt = 16,
    loss_features: bool = True,
    external_schedule: Literal["constant", "cosine", "linear"] = "constant",
    weight_decay: NonNegativeFloat = 0.0,
    step_rms: Literal["equal", "at_most"] = "equal",
    correction_scale: Literal["unit", "adam"] = "unit",
    run_length_feature: bool = False,
    element_clip: PositiveFloat | None = None,
    loss_guard: PositiveFloat | None = None,
    braked_weight_decay: NonNegativeFloat | None = None,
    loss_guard_relative: NonNegativeFloat = 0.0,
    fan_in_base: PositiveFloat | None = None,
    fan_in_power: NonNegativeFloat | Literal["learned"] = 0.5,
    sign_symmetric: bool = False,
    weight_decay_horizon: PositiveFloat | None = None,
    mlp_dtype: MLPDtype = "float32",
) -> LearnedOptimizer:
    """Args:
    initial_lr: every tensor's step RMS, untrained.
    hidden_size: width of the per-parameter MLP's hidden layers.
    schedule_hidden_size: width of the step-size schedule MLP's hidden layer.
    loss_features: whether the MLPs read the normalized loss (the optimizer then needs the loss).
    external_schedule: a fixed multiplier of the step size over the run.
    weight_decay: decoupled weight decay, times the step size: p -= lr * (update + wd * p).
    step_rms: each tensor's step RMS (before the decay) is the step size (equal), or at most it:
        the direction is divided by max(its RMS, 1), so Adam-scale steps shrink with the signal.
    correction_scale: the MLP's correction to Adam's direction as it comes out (unit), or times
        the RMS of Adam's direction over the tensor (adam), so it shrinks as Adam's steps do.
    run_length_feature: whether the MLPs also read log10(num_steps) - 2: how long the run is.
    element_clip: the most one parameter's step (before the decay) may be, in step sizes; none
        by default. Above 7.27 it never clips Adam's own direction under step_rms: at_most.
    loss_guard: a brake g on long runs: every later step is at most g / c of the rule's, c the
        largest climb of the loss EMA above its lowest so far, in first losses; none by default.
    braked_weight_decay: w, with loss_guard: the decay rises from weight_decay to w as the brake
        engages (weight_decay + (w - weight_decay) * (1 - guard)); none by default.
    loss_guard_relative: q, with loss_guard: the brake ignores a climb of at most q times the
        lowest loss EMA, as a noisy loss far above zero makes; 0: every climb counts.
    fan_in_base: B: a weight whose fan-in (all axes but the last) is above B steps
        (B / fan_in) ** fan_in_power of the step size, as wider layers than meta-training's
        need; none by default.
    fan_in_power: the power of that factor (another value than 0.5 needs fan_in_base); learned:
        meta-trained (theta's fan_in_power, from 0, within +-1) and applied both ways, so a
        weight with fewer inputs than B steps further.
    sign_symmetric: whether the step of a parameter negated with its gradient history is the
        step negated, as Adam's is (the MLP runs twice: on the features and on their mirror).
    weight_decay_horizon: H: a run of num_steps decays by weight_decay * H / num_steps a step, so
        any run length shrinks the weights as much in all as a run of H steps; none by default.
    mlp_dtype: what the MLP multiplies in (bfloat16: float32 sums, theta and state float32).
    """
    return NormalizedMLPLOpt(
        initial_lr=initial_lr,
        hidden_size=hidden_size,
        schedule_hidden_size=schedule_hidden_size,
        loss_features=loss_features,
        external_schedule=external_schedule,
        weight_decay=weight_decay,
        step_rms=step_rms,
        correction_scale=correction_scale,
        run_length_feature=run_length_feature,
        element_clip=element_clip,
        loss_guard=loss_guard,
        braked_weight_decay=braked_weight_decay,
        loss_guard_relative=loss_guard_relative,
        fan_in_base=fan_in_base,
        fan_in_power=fan_in_power,
        sign_symmetric=sign_symmetric,
        weight_decay_horizon=weight_decay_horizon,
        mlp_dtype=mlp_dtype,
    )
