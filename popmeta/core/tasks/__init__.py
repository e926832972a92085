"""Inner problems: Task / TaskFamily, quadratics, image MLPs, in-memory datasets."""

from popmeta.core.tasks.base import (
    Task,
    TaskFamily,
    single_task_to_family,
    vec_get_batch,
)
from popmeta.core.tasks.datasets import (
    SPLITS,
    ArrayDataset,
    Datasets,
    InMemoryDataset,
    load_digits_8x8,
    load_npz_images_8x8,
    split_arrays,
)
from popmeta.core.tasks.image_mlp import (
    ImageMLP_Digits8_Relu32,
    ImageMLP_Npz8_Relu32,
    ImageMLPTask,
)
from popmeta.core.tasks.quadratics import (
    FixedDimQuadraticFamily,
    FixedDimQuadraticFamilyData,
    QuadraticTask,
)

__all__ = [
    "SPLITS",
    "ArrayDataset",
    "Datasets",
    "FixedDimQuadraticFamily",
    "FixedDimQuadraticFamilyData",
    "ImageMLPTask",
    "ImageMLP_Digits8_Relu32",
    "ImageMLP_Npz8_Relu32",
    "InMemoryDataset",
    "QuadraticTask",
    "Task",
    "TaskFamily",
    "load_digits_8x8",
    "load_npz_images_8x8",
    "single_task_to_family",
    "split_arrays",
    "vec_get_batch",
]
