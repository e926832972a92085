"""Copies a constant-rate run's checkpoint so that a run with ``outer_optimizer.lr_decay`` can take it over.

A probe of the decay from the same first half (docs/generalist.md, "The
meta learning rate held, then decayed"): with a decay, the outer optimizer's
state has one entry more than without, the schedule's update count, so
``popmeta train --from-checkpoint`` refuses the constant-rate run's file. This
writes the same file with that count (the step of the checkpoint, as the
entry after the outer state's last, where the decay is chained) added, everything else as it was; ``--from-checkpoint``
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
import re
from pathlib import Path

import numpy as np


def schedule_count_key(keys: list[str]) -> str:
    """The key of the decay's count: the optimizer state's next entry, after the clip and the kind's own."""
    entries = [int(m.group(1)) for key in keys if (m := re.match(r"\['opt_state'\]\[(\d+)\]", key))]
    return f"['opt_state'][{max(entries) + 1}].count"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint of a run without lr_decay")
    parser.add_argument("out_dir", help="where the copy is written, under the same name")
    args = parser.parse_args(argv)

    with np.load(args.checkpoint) as loaded:
        arrays = {key: loaded[key] for key in loaded.files}
    metadata = json.loads(str(arrays["__metadata__"]))
    # A schedule's state is a bare count at the top of the chain; Adam's sits inside its entry.
    if any(re.fullmatch(r"\['opt_state'\]\[\d+\]\.count", key) for key in arrays):
        parser.error(f"{args.checkpoint} already has a schedule count: its run had a decay")
    count_key = schedule_count_key(list(arrays))
    arrays[count_key] = np.asarray(metadata["step"], dtype=np.int32)
    metadata["dtypes"][count_key] = "int32"
    arrays["__metadata__"] = np.asarray(json.dumps(metadata))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / Path(args.checkpoint).name, **arrays)


if __name__ == "__main__":
    main()
