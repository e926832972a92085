"""Outer optimizers: ``outer_optimizer.kind`` -> the optax transformation(s) of the learner.

A kind returns one ``optax.GradientTransformation`` (``kind: optax:adamw``
takes any optax alias with its keyword arguments) or a list of them; the
learner chains them after its gradient clipping, as one flat chain.
"""

from __future__ import annotations

from collections.abc import Callable

import optax

from popmeta.registry.kinds import Fraction, NonNegativeFloat, PositiveFloat, Registry

__all__ = ["OUTER_LR_DECAYS", "OUTER_OPTIMIZERS", "outer_lr_decay"]

OUTER_OPTIMIZERS: Registry[optax.GradientTransformation | list] = Registry(
    "outer_optimizer",
    "Outer optimizers",
    "an `optax.GradientTransformation` (or a list of them)",
    returns=(optax.GradientTransformation, list),
)


def _l2(weight_decay: float) -> list[optax.GradientTransformation]:
    # Coupled L2: `wd * params` joins the (clipped) gradient before the optimizer.
    return [optax.add_decayed_weights(weight_decay)] if weight_decay > 0 else []


def _adam(decoupled: bool) -> Callable[..., list[optax.GradientTransformation]]:
    """Adam's kind, with coupled L2 or decoupled weight decay."""

    def build(
        learning_rate: PositiveFloat = 1e-2,
        b1: Fraction = 0.9,
        b2: Fraction = 0.999,
        eps: PositiveFloat = 1e-8,
        weight_decay: NonNegativeFloat = 0.0,
    ) -> list[optax.GradientTransformation]:
        """Args:
        learning_rate: the meta learning rate.
        b1: first-moment decay.
        b2: second-moment decay.
        eps: added to the second moment's root.
        weight_decay: decay of theta (coupled L2 for adam: ``wd * theta`` joins the gradient).
        """
        if decoupled:
            return [optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)]
        return [*_l2(weight_decay), optax.adam(learning_rate, b1=b1, b2=b2, eps=eps)]

    return build


OUTER_OPTIMIZERS.register("adam", "Adam, with coupled L2 weight decay")(_adam(decoupled=False))
OUTER_OPTIMIZERS.register("adamw", "Adam with decoupled weight decay")(_adam(decoupled=True))


@OUTER_OPTIMIZERS.register("sgd", "plain SGD, with coupled L2 weight decay")
def sgd(
    learning_rate: PositiveFloat = 1e-2, weight_decay: NonNegativeFloat = 0.0
) -> list[optax.GradientTransformation]:
    """Args:
    learning_rate: the meta learning rate.
    weight_decay: coupled L2 decay.
    """
    return [*_l2(weight_decay), optax.sgd(learning_rate)]


@OUTER_OPTIMIZERS.register("sgdm", "SGD with momentum, with coupled L2 weight decay")
def sgdm(
    learning_rate: PositiveFloat = 1e-2,
    momentum: Fraction = 0.9,
    weight_decay: NonNegativeFloat = 0.0,
) -> list[optax.GradientTransformation]:
    """Args:
    learning_rate: the meta learning rate.
    momentum: heavy-ball momentum.
    weight_decay: coupled L2 decay.
    """
    return [*_l2(weight_decay), optax.sgd(learning_rate, momentum=momentum)]


#: The meta learning rate's schedules over a run, by name: the ``kind``'s learning rate times these.
OUTER_LR_DECAYS = ("constant", "cosine", "linear")


def outer_lr_decay(
    kind: str, num_steps: int, final_fraction: float = 0.0, start_fraction: float = 0.0
) -> list[optax.GradientTransformation]:
    """The transformation that decays the outer optimizer's steps over a run, if any.

    Chained after the optimizer, it multiplies each step by a factor that
    holds at 1 until update ``start_fraction * num_steps`` and then falls
    to ``final_fraction`` at update ``num_steps`` (and stays there): for
    Adam and SGD, whose steps are proportional to their learning rate, the
    same as decaying that rate. Its update count is part of the optimizer
    state, so it survives a checkpoint.

    Args:
      kind: ``constant`` (no transformation), ``cosine`` or ``linear``.
      num_steps: the update at which the decay ends (a run's ``train.num_steps``).
      final_fraction: the factor from update ``num_steps`` on, in [0, 1].
      start_fraction: the fraction of ``num_steps`` before the decay begins, in [0, 1).

    Returns:
      ``[]`` for ``constant``, else the one ``optax.scale_by_schedule``.
    """
    if kind not in OUTER_LR_DECAYS:
        raise ValueError(
            f"outer learning-rate decay must be one of {OUTER_LR_DECAYS}, got {kind!r}"
        )
    if not 0.0 <= final_fraction <= 1.0:
        raise ValueError(f"final_fraction must be in [0, 1], got {final_fraction!r}")
    if not 0.0 <= start_fraction < 1.0:
        raise ValueError(f"start_fraction must be in [0, 1), got {start_fraction!r}")
    if num_steps <= 0:
        raise ValueError(f"num_steps must be > 0, got {num_steps!r}")
    if kind == "constant":
        return []
    start = int(start_fraction * num_steps)
    if kind == "cosine":
        decay = optax.cosine_decay_schedule(1.0, num_steps - start, alpha=final_fraction)
    else:
        decay = optax.linear_schedule(1.0, final_fraction, num_steps - start)
    schedule = optax.join_schedules([optax.constant_schedule(1.0), decay], [start])
    return [optax.scale_by_schedule(schedule)]
