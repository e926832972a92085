"""Learned optimizers: theta -> Optimizer."""

from popmeta.core.learned_optimizers.adam_mlp_lopt import AdamMLPLOpt, AdamMLPLOptState
from popmeta.core.learned_optimizers.as_optax import LearnedOptimizerState, as_optax
from popmeta.core.learned_optimizers.base import LearnedOptimizer
from popmeta.core.learned_optimizers.learnable import LearnableAdam, LearnableSGD, LearnableSGDM
from popmeta.core.learned_optimizers.mlp_lopt import MLPLOpt, MLPLOptState
from popmeta.core.learned_optimizers.normalized_mlp_lopt import (
    NormalizedMLPLOpt,
    NormalizedMLPLOptState,
)

__all__ = [
    "AdamMLPLOpt",
    "AdamMLPLOptState",
    "LearnableAdam",
    "LearnableSGD",
    "LearnableSGDM",
    "LearnedOptimizer",
    "LearnedOptimizerState",
    "MLPLOpt",
    "MLPLOptState",
    "NormalizedMLPLOpt",
    "NormalizedMLPLOptState",
    "as_optax",
]
