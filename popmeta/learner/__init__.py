"""The learner: TrainState, its jitted optax step, and checkpoints."""

from popmeta.learner.checkpoints import (
    Checkpoint,
    CheckpointCorruptedError,
    checkpoint_path,
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_checkpoint_metadata,
    restore_latest,
    save_checkpoint,
)
from popmeta.learner.train_state import (
    TrainState,
    build_apply_estimates_fn,
    make_outer_optimizer,
)

__all__ = [
    "Checkpoint",
    "CheckpointCorruptedError",
    "TrainState",
    "build_apply_estimates_fn",
    "checkpoint_path",
    "checkpoint_step",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "make_outer_optimizer",
    "read_checkpoint_metadata",
    "restore_latest",
    "save_checkpoint",
]
