"""Meta-testing: inner training curves of an optimizer on freshly sampled tasks."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from popmeta.core.optimizers import Optimizer
from popmeta.core.tasks.base import TaskFamily

__all__ = ["TrainingCurves", "training_curves"]


class TrainingCurves(NamedTuple):
    """Per-task curves, ``[num_tasks, num_steps]``, and final accuracies.

    Attributes:
      train_loss: training loss of the batch each step trained on (before the update).
      eval_loss: loss of the parameters after each update on a batch of ``eval_split``
        (the training loss again for data-free tasks).
      final_accuracy: ``[num_tasks]`` accuracy of the final parameters on a fresh
        batch of ``eval_split``, for tasks that define :meth:`Task.accuracy`;
        None otherwise.
      initial_eval_loss: ``[num_tasks]`` loss of the initial parameters on a
        batch of ``eval_split`` (data-free tasks: their loss).
    """

    train_loss: jax.Array
    eval_loss: jax.Array
    final_accuracy: jax.Array | None = None
    initial_eval_loss: jax.Array | None = None


def training_curves(
    task_family: TaskFamily,
    optimizer: Optimizer,
    key: jax.Array,
    num_tasks: int,
    num_steps: int,
    eval_split: str = "test",
) -> TrainingCurves:
    """Trains ``num_tasks`` sampled tasks for ``num_steps`` steps with ``optimizer``.

    Pure and jittable (``num_tasks`` and ``num_steps`` static); pass a learned
    optimizer as ``learned_opt.opt_fn(theta)`` inside the jitted function.
    """

    def one_task(key):
        key_task, key_init, key_opt, key_steps = jax.random.split(key, 4)
        task_param = task_family.sample(key_task)
        task = task_family.task_fn(task_param)
        params = task.init(key_init)
        opt_state = optimizer.init(params, num_steps=num_steps, key=key_opt)
        # Its own key (folded from the task's), so every other draw is what it was without it.
        key_initial = jax.random.fold_in(key_task, 1)
        initial_batch = task_family.sample_batch(key_initial, eval_split)
        initial_loss = task.loss(params, key_initial, initial_batch)

        def body(opt_state, key):
            key_train, key_eval, key_loss, key_update = jax.random.split(key, 4)
            batch = task_family.sample_batch(key_train, "train")
            loss, grad = jax.value_and_grad(task.loss)(
                optimizer.get_params(opt_state), key_loss, batch
            )
            opt_state = optimizer.update(opt_state, grad, loss=loss, key=key_update)
            eval_batch = task_family.sample_batch(key_eval, eval_split)
            if eval_batch is None:
                eval_batch = batch
            eval_loss = task.loss(optimizer.get_params(opt_state), key_eval, eval_batch)
            return opt_state, (loss, eval_loss)

        key_steps, key_final = jax.random.split(key_steps)
        opt_state, (train_loss, eval_loss) = jax.lax.scan(
            body, opt_state, jax.random.split(key_steps, num_steps)
        )
        final_batch = task_family.sample_batch(key_final, eval_split)
        accuracy = None
        if final_batch is not None:
            accuracy = task.accuracy(optimizer.get_params(opt_state), final_batch)
        return train_loss, eval_loss, accuracy, initial_loss

    train_loss, eval_loss, accuracy, initial_loss = jax.vmap(one_task)(
        jax.random.split(key, num_tasks)
    )
    if accuracy is not None:
        accuracy = accuracy.astype(jnp.float32)
    return TrainingCurves(
        train_loss.astype(jnp.float32),
        eval_loss.astype(jnp.float32),
        accuracy,
        initial_loss.astype(jnp.float32),
    )
