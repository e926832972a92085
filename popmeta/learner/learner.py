"""The learner: owns theta and the outer optimizer, applies aggregated estimates."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from popmeta.config import Config
from popmeta.estimate import Aggregate
from popmeta.experiment import initial_theta, learner_keys
from popmeta.learner.train_state import TrainState, build_apply_estimate_fn, make_outer_optimizer

__all__ = ["Learner"]


class Learner:
    """Holds the ``TrainState`` of theta; one jitted, donating optax step per update."""

    def __init__(self, config: Config):
        self.config = config
        theta = initial_theta(config)
        outer = config.outer_optimizer
        tx = make_outer_optimizer(
            outer.name,
            outer.learning_rate,
            clip_grad_norm=outer.clip_grad_norm,
            weight_decay=outer.weight_decay,
        )
        self.state = TrainState.initial_state(theta, tx, learner_keys(config)[1])
        self._apply = build_apply_estimate_fn(donate_params_and_state=True)
        self._theta_host: Any = None

    @property
    def version(self) -> int:
        return int(self.state.step)

    def theta(self) -> Any:
        """Theta as host numpy arrays (what crosses to workers), cached per version."""
        if self._theta_host is None:
            self._theta_host = jax.tree_util.tree_map(np.asarray, self.state.params)
        return self._theta_host

    def apply(self, aggregate: Aggregate) -> dict[str, float]:
        """One outer step with the aggregated gradient; returns its norms."""
        self.state, metrics = self._apply(self.state, aggregate.grad)
        self._theta_host = None
        return {k: float(v) for k, v in metrics.items()}

    def checkpoint_tree(self) -> dict[str, Any]:
        return {
            "step": self.state.step,
            "theta": self.state.params,
            "opt_state": self.state.opt_state,
            "rng": jax.random.key_data(self.state.root_rng),
        }

    def restore(self, tree: dict[str, Any]) -> None:
        self.state = self.state.replace(
            step=tree["step"],
            params=tree["theta"],
            opt_state=tree["opt_state"],
            root_rng=jax.random.wrap_key_data(tree["rng"]),
        )
        self._theta_host = None
