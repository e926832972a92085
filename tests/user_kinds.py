"""The source of a user's module of kinds, for tests that write it where a user would.

A task family (``noisy_targets``), a learned optimizer (``LogLrSGD``) and a
callable that returns the wrong type (``not_a_family``), written with
popmeta's public names only.
"""

from __future__ import annotations

import textwrap

__all__ = ["USER_KINDS"]

USER_KINDS = textwrap.dedent(
    '''
    import jax
    import jax.numpy as jnp
    import popmeta as pm


    class _Target(pm.Task):
        def __init__(self, target, noise):
            self.target, self.noise = target, noise

        def init(self, key):
            return jax.random.normal(key, self.target.shape)

        def loss(self, params, key, data):
            noisy = self.target + self.noise * jax.random.normal(key, self.target.shape)
            return jnp.mean(jnp.square(params - noisy))


    class _Targets(pm.TaskFamily):
        def __init__(self, dim, noise):
            self.dim, self.noise = dim, noise

        def sample(self, key):
            return jax.random.normal(key, (self.dim,))

        def task_fn(self, target):
            return _Target(target, self.noise)


    def noisy_targets(dim: int = 4, noise: float = 0.1) -> pm.TaskFamily:
        """Reach a random target through noisy losses."""
        return _Targets(dim, noise)


    class LogLrSGD(pm.LearnedOptimizer):
        """SGD whose log learning rate is theta."""

        def __init__(self, initial_lr: float = 0.05):
            self.initial_lr = initial_lr

        def init(self, key):
            return {"log_lr": jnp.log(jnp.asarray(self.initial_lr, jnp.float32))}

        def opt_fn(self, theta, is_training=False):
            return pm.SGD(jnp.exp(theta["log_lr"]))


    def not_a_family(dim: int = 4) -> int:
        return dim
    '''
)
