"""learned_optimization's side of ``bench/estimators.py --peer``: configurations (a) to (e).

Runs inside the peer's interpreter (its own environment, with haiku, flax and
gin installed beside the same jax and optax as popmeta's), with a
learned_optimization checkout on ``PYTHONPATH``; it never imports popmeta.
``python bench/learned_optimization_peer.py --one c --seconds 8`` prints one
JSON line, as ``bench/estimators.py --one`` does.

Each configuration is built from learned_optimization's own classes with the
arguments popmeta's ``bench/estimators.py`` gives its namesakes: 8 tasks,
``ConstantTruncationSchedule(50)``, ``random_initial_iteration_offset`` 50
(0 for FullES), PES over truncations of 10 steps with std 0.01 (FullES over
the whole 50), ``MLPLOpt()`` or ``LearnableSGDM()`` at their defaults, outer
Adam at 1e-3, all driven by ``SingleMachineGradientLearner.update``. The
quadratic is ``FixedDimQuadraticFamilyData(10)``. (c)'s task is the shape of
learned_optimization's ``ImageMLP_FashionMnist8_Relu32`` (a Haiku MLP 64-32-10
with softmax cross-entropy, batch 128) on scikit-learn's 8x8 digits, because
its own dataset comes from TensorFlow Datasets; (e)'s is the same with
hidden layers 256-256 and batch 512. Their batches reach the step
the way learned_optimization's tasks deliver them (``--data host``: a Python
iterator of numpy batches, drawn by the truncated step for every task and
step), or sampled on the device from the loss's key as popmeta's image tasks
do (``--data device``), which spares learned_optimization its host pipeline.

Inner steps are counted as popmeta counts them: every task, antithetic member
and step of the truncation.
"""

from __future__ import annotations

import argparse
import json
import os
import resource

from work import (
    EPISODE_LENGTH,
    IMAGE_MLPS,
    NAMESAKES,
    NUM_TASKS,
    STD,
    TRUNCATION_LENGTH,
    median_rate,
)


def _digits():
    """scikit-learn's 8x8 digits as float32 ``[N, 8, 8, 1]`` in [0, 1] and int32 labels."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (np.asarray(digits.images, np.float32) / 16.0)[..., None], np.asarray(
        digits.target, np.int32
    )


def _image_task(name: str, data: str):
    """(c)'s or (e)'s Haiku MLP on the digits, fed from the host or sampled from the loss's key."""
    import haiku as hk
    import jax
    import jax.numpy as jnp
    import numpy as np
    from learned_optimization.tasks import base
    from learned_optimization.tasks.datasets import base as datasets_base

    images, labels = _digits()
    hidden, batch_size = IMAGE_MLPS[name]

    def forward(image):
        return hk.nets.MLP([*hidden, 10])(jnp.reshape(image, [image.shape[0], -1]))

    network = hk.without_apply_rng(hk.transform(forward))

    def host_batches(seed: int):
        rng = np.random.default_rng(seed)
        while True:
            index = rng.integers(0, len(labels), batch_size)
            yield {"image": images[index], "label": labels[index]}

    device_images, device_labels = jnp.asarray(images), jnp.asarray(labels)

    class DigitsMLP(base.Task):
        datasets = (
            datasets_base.Datasets(*(host_batches(seed) for seed in range(4)))
            if data == "host"
            else None
        )

        def init(self, key):
            return network.init(key, images[:batch_size])

        def loss(self, params, key, batch):
            if data == "device":
                index = jax.random.randint(key, (batch_size,), 0, len(labels))
                batch = {"image": device_images[index], "label": device_labels[index]}
            logits = network.apply(params, batch["image"])
            one_hot = jax.nn.one_hot(batch["label"], 10)
            return jnp.mean(base.softmax_cross_entropy(logits=logits, labels=one_hot))

        def normalizer(self, loss):
            top = 1.5 * np.log(10.0)
            return jnp.nan_to_num(jnp.clip(loss, 0, top), nan=top, posinf=top, neginf=top)

    return DigitsMLP()


def adapt_to_this_jax() -> list[str]:
    """Lets an unmodified learned_optimization checkout import and run on today's JAX.

    It was written for JAX before 0.4.30 and imports TensorFlow at the top of
    modules that use it only for datasets, TensorBoard and ``gs://`` paths.
    Each gap is filled only where it exists, without changing what anything
    computes: empty TensorFlow modules when TensorFlow is not installed;
    ``jax.ShapedArray``, ``jax.lib.xla_client.Device`` and
    ``jax.core.cur_sublevel`` (which it reads only to ask whether it is being
    traced) by their current equivalents; and ``tree_utils.strip_weak_type``,
    whose attribute assignment current arrays refuse, by a conversion to the
    same dtype. Call before importing learned_optimization.

    Returns:
      What was filled, for the record.
    """
    import importlib.util
    import sys
    import types

    import jax
    from jax._src import core as jax_core

    filled = []
    if importlib.util.find_spec("tensorflow") is None:
        # Flax looks for TensorFlow itself when first imported: it must find none.
        import flax.io  # noqa: F401

        tf = types.ModuleType("tensorflow")
        tf.compat = types.ModuleType("tensorflow.compat")
        tf.compat.v2 = types.ModuleType("tensorflow.compat.v2")
        tf.compat.v2.enable_v2_behavior = lambda: None
        sys.modules.update(
            {
                "tensorflow": tf,
                "tensorflow.compat": tf.compat,
                "tensorflow.compat.v2": tf.compat.v2,
                "tensorflow_datasets": types.ModuleType("tensorflow_datasets"),
            }
        )
        filled.append("tensorflow and tensorflow_datasets: empty modules")
    if not hasattr(jax, "ShapedArray"):
        jax.ShapedArray = jax.core.ShapedArray
        filled.append("jax.ShapedArray = jax.core.ShapedArray")
    if not hasattr(jax.lib, "xla_client"):
        jax.lib.xla_client = types.SimpleNamespace(Device=jax.Device)
        filled.append("jax.lib.xla_client.Device = jax.Device")
    if not hasattr(jax.core, "cur_sublevel"):
        jax.core.cur_sublevel = lambda: types.SimpleNamespace(
            level=int(jax_core.unsafe_am_i_under_a_jit())
        )
        filled.append("jax.core.cur_sublevel().level: 1 under jit, else 0")

    from learned_optimization import tree_utils

    def strip_weak_type(pytree):
        return jax.tree_util.tree_map(
            lambda x: jax.lax.convert_element_type(x, jax.numpy.asarray(x).dtype), pytree
        )

    tree_utils.strip_weak_type = strip_weak_type
    filled.append("tree_utils.strip_weak_type: a conversion to the same dtype")
    return filled


def build_learner(name: str, data: str, num_tasks: int = NUM_TASKS):
    """learned_optimization's learner for configuration ``name``, and its inner steps per update."""
    adapt_to_this_jax()
    from learned_optimization.learned_optimizers import base as lopt_base
    from learned_optimization.learned_optimizers import mlp_lopt
    from learned_optimization.optimizers import optax_opts
    from learned_optimization.outer_trainers import (
        full_es,
        gradient_learner,
        lopt_truncated_step,
        truncated_pes,
        truncation_schedule,
    )
    from learned_optimization.tasks import base as tasks_base
    from learned_optimization.tasks import quadratics

    lopt = lopt_base.LearnableSGDM() if name in ("a", "d") else mlp_lopt.MLPLOpt()
    if name in IMAGE_MLPS:
        family = tasks_base.single_task_to_family(_image_task(name, data))
    else:
        family = quadratics.FixedDimQuadraticFamilyData(10)
    # FullES owns the episode's length and refuses a step with a finite schedule of its own.
    step = lopt_truncated_step.VectorizedLOptTruncatedStep(
        family,
        lopt,
        truncation_schedule.NeverEndingTruncationSchedule()
        if name == "d"
        else truncation_schedule.ConstantTruncationSchedule(EPISODE_LENGTH),
        num_tasks=num_tasks,
        random_initial_iteration_offset=0 if name == "d" else EPISODE_LENGTH,
    )
    if name == "d":
        estimator = full_es.FullES(
            step, truncation_schedule.ConstantTruncationSchedule(EPISODE_LENGTH), std=STD
        )
        length = EPISODE_LENGTH
    else:
        estimator = truncated_pes.TruncatedPES(step, trunc_length=TRUNCATION_LENGTH, std=STD)
        length = TRUNCATION_LENGTH
    learner = gradient_learner.SingleMachineGradientLearner(
        lopt, [estimator], optax_opts.Adam(1e-3)
    )
    return learner, 2 * num_tasks * length


def run_one(name: str, seconds: float, data: str, num_tasks: int = NUM_TASKS) -> dict:
    import jax

    learner, inner_steps = build_learner(name, data, num_tasks)
    state = learner.init(jax.random.key(0))
    root_key, call_key = jax.random.key(1), jax.jit(jax.random.fold_in)
    count = 0

    def one() -> int:
        nonlocal state, count
        state, _, _ = learner.update(state, call_key(root_key, count), with_metrics=False)
        count += 1
        return 1

    for _ in range(3):
        one()
    jax.block_until_ready(state)
    estimates_per_s = median_rate(one, lambda: jax.block_until_ready(state), seconds)
    return {
        "config": name,
        "data": data,
        "estimates_per_s": estimates_per_s,
        "inner_steps_per_s": estimates_per_s * inner_steps,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", choices=NAMESAKES, required=True)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--data", choices=("host", "device"), default="host")
    parser.add_argument("--tasks", type=int, default=NUM_TASKS)
    args = parser.parse_args()
    print(json.dumps(run_one(args.one, args.seconds, args.data, args.tasks)))


if __name__ == "__main__":
    main()
