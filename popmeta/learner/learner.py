"""The learner: owns theta and the outer optimizer, applies each round of estimates."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from popmeta.estimate import Aggregate, Estimate, aggregate
from popmeta.experiment import LearnerStart
from popmeta.learner.checkpoint_layout import LearnerCheckpoint
from popmeta.learner.train_state import TrainState, build_apply_estimates_fn, make_outer_optimizer

__all__ = ["Learner", "Update"]


class Update(NamedTuple):
    """What one round did to theta.

    Attributes:
      aggregate: the estimates used and their weights, and what was left out.
      norms: ``grad_norm``, ``update_norm`` and ``param_norm`` of the step, or
        None when no step was taken (nothing usable; theta is unchanged).
    """

    aggregate: Aggregate
    norms: dict[str, float] | None


class Learner:
    """Holds the ``TrainState`` of theta; one jitted, donating step per round of estimates.

    Args:
      theta: theta to start from.
      optimizer: the outer optimizer (clipping included: :func:`make_outer_optimizer`).
      rng: the ``TrainState``'s key.
    """

    def __init__(self, theta: Any, optimizer: optax.GradientTransformation, rng: jax.Array):
        self.state = TrainState.initial_state(theta, optimizer, rng)
        self._step = build_apply_estimates_fn(donate_params_and_state=True)
        self._theta_host: Any = None
        # The most estimates a round has had, and a theta of zeros to pad with.
        self._round_size = 0
        self._zeros: Any = None

    @classmethod
    def of(cls, start: LearnerStart) -> Learner:
        """The learner of a run (``Experiment.learner``); theta is copied, as the step donates it."""
        optimizer = make_outer_optimizer(start.outer_transforms, start.clip_grad_norm)
        return cls(jax.tree_util.tree_map(jnp.copy, start.theta), optimizer, start.rng)

    @property
    def version(self) -> int:
        return int(self.state.step)

    def theta(self) -> Any:
        """Theta as host numpy arrays (what crosses to workers), cached per version."""
        if self._theta_host is None:
            self._theta_host = jax.tree_util.tree_map(np.asarray, self.state.params)
        return self._theta_host

    def update(self, estimates: Sequence[Estimate]) -> Update:
        """One outer step with the weighted mean of ``estimates`` (see :func:`aggregate`).

        The mean is taken inside the jitted step, from the arrays as they
        came. If it is not finite, the step leaves theta as it was, the
        estimates are checked one by one, and the step is taken again without
        the non-finite ones; if they were all finite (a sum too large for
        float32), no step is taken.
        """
        agg = aggregate(estimates)
        norms = self._apply(agg)
        if norms is None and agg.num_used:
            checked = aggregate(estimates, check_grads=True)
            if checked.num_used < agg.num_used:
                norms = self._apply(checked)
            agg = checked
        return Update(agg, norms)

    def _apply(self, agg: Aggregate) -> dict[str, float] | None:
        if not agg.num_used:
            return None
        grads, weights = self._padded(agg)
        self.state, metrics, applied = self._step(self.state, grads, weights)
        if not applied:
            return None
        self._theta_host = None
        return {k: float(v) for k, v in metrics.items()}

    def _padded(self, agg: Aggregate) -> tuple[tuple[Any, ...], np.ndarray]:
        """The round's estimates, padded with zeros of weight 0 to the largest round so far.

        The step is compiled once per number of estimates (seconds: see
        docs/performance.md, "The learner"), so a round short of an estimate (a
        lost actor, a rejected estimate) would otherwise stall for a compile.
        Zeros of weight 0 add exactly nothing to the sum.
        """
        self._round_size = max(self._round_size, agg.num_used)
        missing = self._round_size - agg.num_used
        if not missing:
            return agg.grads, agg.weights
        if self._zeros is None:
            self._zeros = jax.tree_util.tree_map(np.zeros_like, self.theta())
        weights = np.concatenate([agg.weights, np.zeros(missing, agg.weights.dtype)])
        return agg.grads + (self._zeros,) * missing, weights

    def adopt(self, state: TrainState) -> None:
        """Continues from ``state``: the state after steps taken outside :meth:`update`.

        The local engine's fused rounds (:mod:`popmeta.population.fused`)
        start from :attr:`state` and hand back the state after their steps.
        """
        self.state = state
        self._theta_host = None

    def checkpoint_tree(self) -> LearnerCheckpoint:
        """The learner's part of a checkpoint: also the template to restore one into."""
        return LearnerCheckpoint(
            step=self.state.step,
            theta=self.state.params,
            opt_state=self.state.opt_state,
            rng=jax.random.key_data(self.state.root_rng),
        )

    def restore(self, checkpoint: LearnerCheckpoint) -> None:
        """Continues from a restored :meth:`checkpoint_tree`."""
        self.state = self.state.replace(
            step=checkpoint.step,
            params=checkpoint.theta,
            opt_state=checkpoint.opt_state,
            root_rng=jax.random.wrap_key_data(checkpoint.rng),
        )
        self._theta_host = None
