"""The learner: TrainState, its jitted optax step, and checkpoints."""

from popmeta.learner.checkpoint_file import (
    Checkpoint,
    CheckpointCorruptedError,
    load_checkpoint,
    read_checkpoint_metadata,
    save_tree,
)
from popmeta.learner.checkpoint_layout import (
    WORKERS,
    LearnerCheckpoint,
    RunCheckpoint,
    RunMetadata,
    load_run_checkpoint,
    read_run_metadata,
    save_run_checkpoint,
)
from popmeta.learner.checkpoints import (
    checkpoint_path,
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
    restore_latest,
    save_checkpoint,
)
from popmeta.learner.train_state import (
    TrainState,
    build_apply_estimates_fn,
    make_outer_optimizer,
)

__all__ = [
    "WORKERS",
    "Checkpoint",
    "CheckpointCorruptedError",
    "LearnerCheckpoint",
    "RunCheckpoint",
    "RunMetadata",
    "TrainState",
    "build_apply_estimates_fn",
    "checkpoint_path",
    "checkpoint_step",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_run_checkpoint",
    "make_outer_optimizer",
    "read_checkpoint_metadata",
    "read_run_metadata",
    "restore_latest",
    "save_checkpoint",
    "save_run_checkpoint",
    "save_tree",
]
