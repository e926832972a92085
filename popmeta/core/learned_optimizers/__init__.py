"""Learned optimizers: theta -> Optimizer."""

from popmeta.core.learned_optimizers.base import LearnedOptimizer
from popmeta.core.learned_optimizers.learnable import LearnableAdam, LearnableSGD, LearnableSGDM
from popmeta.core.learned_optimizers.mlp_lopt import MLPLOpt, MLPLOptState

__all__ = [
    "LearnableAdam",
    "LearnableSGD",
    "LearnableSGDM",
    "LearnedOptimizer",
    "MLPLOpt",
    "MLPLOptState",
]
