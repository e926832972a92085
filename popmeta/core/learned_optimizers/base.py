"""The LearnedOptimizer protocol: meta-parameters theta -> an Optimizer."""

from __future__ import annotations

from typing import Any

import jax

from popmeta.core.optimizers import Optimizer

__all__ = ["LearnedOptimizer", "MetaParams", "OptimizerOfTheta"]

MetaParams = Any
"""A pytree of float32 arrays (theta)."""


class LearnedOptimizer:
    """Maps meta-parameters ``theta`` to an inner :class:`Optimizer`.

    ``opt_fn`` must be pure in ``theta``: the returned optimizer closes over it,
    so ``theta`` can be a tracer under ``jit``, ``vmap`` or ``grad`` and the
    meta-gradient (or an ES perturbation) flows through the whole inner unroll.

    Attributes:
      needs_num_steps: its optimizer reads how far through the run it is, so
        its ``init`` needs ``num_steps`` (the planned number of steps).
      uses_loss: its optimizer reads the loss, so its ``update`` needs ``loss``.
    """

    needs_num_steps: bool = False
    uses_loss: bool = False

    def init(self, key: jax.Array) -> MetaParams:
        """Samples initial meta-parameters."""
        raise NotImplementedError

    def opt_fn(self, theta: MetaParams, is_training: bool = False) -> Optimizer:
        """Returns the inner optimizer parameterised by ``theta``.

        Args:
          theta: Meta-parameters (possibly traced).
          is_training: Whether this optimizer is used for meta-training (as
            opposed to meta-testing); optimizers may ignore it.
        """
        raise NotImplementedError

    @property
    def name(self) -> str:
        return type(self).__name__


class OptimizerOfTheta(Optimizer):
    """The inner optimizer a learned optimizer makes of one ``theta`` (which may be a tracer)."""

    def __init__(self, lopt: LearnedOptimizer, theta: MetaParams):
        self._lopt = lopt
        self._theta = theta
