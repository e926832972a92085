"""Writes a checkpoint whose theta is the mean of several checkpoints' thetas, leaf by leaf.

A probe of tail averaging (docs/generalist.md, "Choosing the checkpoint:
`popmeta select`"): the file holds the newest checkpoint's config, outer
optimizer state and key, the averaged theta and no workers' states, at the
step given, so that ``popmeta select`` and ``popmeta eval`` read it as any
checkpoint. Write it outside the run's ``checkpoints/``, which a resume reads.

    python docs/results/average_checkpoints.py runs/avg/checkpoints 12999 \\
        runs/generalist_12k_seed0/checkpoints/ckpt_0001{0,1,2}000.npz
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from popmeta.config import config_to_dict
from popmeta.evaluate.checkpoints import load_theta
from popmeta.experiment import learner_start
from popmeta.learner.checkpoint_layout import load_run_checkpoint, save_run_checkpoint
from popmeta.learner.learner import Learner


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="where ckpt_<step>.npz is written")
    parser.add_argument("step", type=int, help="the step its name carries")
    parser.add_argument("checkpoints", nargs="+", help="checkpoints of one run, newest last")
    args = parser.parse_args(argv)

    loaded = [load_theta(path) for path in args.checkpoints]
    config = loaded[-1][0]
    theta = jax.tree.map(
        lambda *leaves: jnp.mean(jnp.stack(leaves), axis=0), *(t for _, t in loaded)
    )
    newest = load_run_checkpoint(
        args.checkpoints[-1], Learner.of(learner_start(config)).checkpoint_tree()
    ).learner
    learner = newest._replace(step=jnp.int32(args.step), theta=theta)
    print(save_run_checkpoint(args.out_dir, learner, {}, config_to_dict(config), [], keep=None))


if __name__ == "__main__":
    main()
