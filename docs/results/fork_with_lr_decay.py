"""Copies a constant-rate run's checkpoint so that a run with ``outer_optimizer.lr_decay`` can take it over.

A probe of the decay from the same first half (docs/generalist.md, "The
meta learning rate held, then decayed"): with a decay, the outer optimizer's
state has one entry more than without, the schedule's update count, so
``popmeta train --from-checkpoint`` refuses the constant-rate run's file. This
writes the same file with that count (``['opt_state'][2].count``, the
checkpoint's step) added, everything else as it was; ``--from-checkpoint``
then continues from it bit for bit, with the decay. The file keeps its name
(``ckpt_<step>.npz``), which the take-over reads.

    python docs/results/fork_with_lr_decay.py \\
        runs/generalist_seed1_epyc/checkpoints/ckpt_00006000.npz /tmp/fork
    popmeta train configs/generalist.yaml --set name=... \\
        --set outer_optimizer.lr_decay=cosine ... --from-checkpoint /tmp/fork/ckpt_00006000.npz
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

SCHEDULE_COUNT = "['opt_state'][2].count"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint of a run without lr_decay")
    parser.add_argument("out_dir", help="where the copy is written, under the same name")
    args = parser.parse_args(argv)

    with np.load(args.checkpoint) as loaded:
        arrays = {key: loaded[key] for key in loaded.files}
    metadata = json.loads(str(arrays["__metadata__"]))
    if SCHEDULE_COUNT in arrays:
        parser.error(f"{args.checkpoint} already has a schedule count: its run had a decay")
    arrays[SCHEDULE_COUNT] = np.asarray(metadata["step"], dtype=np.int32)
    metadata["dtypes"][SCHEDULE_COUNT] = "int32"
    arrays["__metadata__"] = np.asarray(json.dumps(metadata))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / Path(args.checkpoint).name, **arrays)


if __name__ == "__main__":
    main()
