"""The conv net's inner training under a vmap over tasks: lax.conv against one matrix product.

Runs ``conv_digits`` (two 3x3 convolutions of 8 channels, batch 128) for
``--steps`` Adam steps on ``--tasks`` tasks at once, as meta-testing does,
with the network's convolutions written two ways: ``lax.conv_general_dilated``
(which a vmap over per-task kernels turns into a grouped convolution) and
popmeta's :func:`~popmeta.core.tasks.conv._conv_same` (neighbourhoods side by
side, one batched matrix product). The sides alternate for ``--rounds``
rounds; the median run (compiled) is printed in task-steps/s, with the ratio
and ``uptime`` before and after.

Usage: python bench/conv.py [--tasks 32] [--steps 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp

from popmeta.core.evaluation import training_curves
from popmeta.core.optimizers import Adam
from popmeta.core.tasks import Conv_Digits8, single_task_to_family
from popmeta.core.tasks.conv import ImageConvTask


class _LaxConvTask(ImageConvTask):
    def apply(self, params, images):
        x = images
        for i in range(len(self.channels)):
            layer = params[f"conv_{i}"]
            x = jax.lax.conv_general_dilated(
                x, layer["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            )
            x = jax.nn.relu(x + layer["b"])
        x = jnp.reshape(x, (x.shape[0], -1))
        return x @ params["linear_0"]["w"] + params["linear_0"]["b"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print("uptime before:", os.popen("uptime").read().strip())
    matmul = Conv_Digits8()
    lax = _LaxConvTask(matmul.data)
    runs = {}
    for name, task in (("lax.conv", lax), ("matrix product", matmul)):
        family = single_task_to_family(task)
        runs[name] = jax.jit(
            lambda key, family=family: (
                training_curves(family, Adam(1e-2), key, args.tasks, args.steps).train_loss
            )
        )
        runs[name](jax.random.key(0)).block_until_ready()  # compile
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_index in range(args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            loss = run(jax.random.key(round_index + 1)).block_until_ready()
            times[name].append(time.perf_counter() - start)
    rates = {name: args.tasks * args.steps / statistics.median(t) for name, t in times.items()}
    for name, rate in rates.items():
        print(f"{name:>15}: {rate:8.0f} task-steps/s")
    print(f"matrix product / lax.conv: {rates['matrix product'] / rates['lax.conv']:.1f}x")
    print(f"final mean loss of the last round: {float(loss[:, -1].mean()):.4f}")
    print("uptime after: ", os.popen("uptime").read().strip())


if __name__ == "__main__":
    main()
