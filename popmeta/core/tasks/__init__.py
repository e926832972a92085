"""Inner problems: Task / TaskFamily, quadratics, image MLPs, in-memory datasets."""

from popmeta.core.tasks.base import (
    Task,
    TaskFamily,
    single_task_to_family,
    vec_get_batch,
)
from popmeta.core.tasks.conv import Conv_Digits8, ImageConvTask
from popmeta.core.tasks.datasets import (
    SPLITS,
    ArrayDataset,
    Datasets,
    InMemoryDataset,
    load_digits_8x8,
    load_npz_images_8x8,
    resample_images,
    split_arrays,
)
from popmeta.core.tasks.image_mlp import (
    ImageMLP_Digits4_Relu32,
    ImageMLP_Digits8_Relu32,
    ImageMLP_Digits16_Relu32,
    ImageMLP_Npz8_Relu32,
    ImageMLPTask,
)
from popmeta.core.tasks.parametric import (
    ACTIVATIONS,
    ImageMLPConfig,
    ParametricImageMLP_Digits8,
    ParametricImageMLPFamily,
    space_problems,
)
from popmeta.core.tasks.quadratics import (
    CurvedQuadraticFamily,
    FixedDimQuadraticFamily,
    FixedDimQuadraticFamilyData,
    QuadraticTask,
)
from popmeta.core.tasks.rescaled import RescaledFamily, RescaledTaskParams, ScaleRange

__all__ = [
    "ACTIVATIONS",
    "SPLITS",
    "ArrayDataset",
    "Conv_Digits8",
    "CurvedQuadraticFamily",
    "Datasets",
    "FixedDimQuadraticFamily",
    "FixedDimQuadraticFamilyData",
    "ImageConvTask",
    "ImageMLPConfig",
    "ImageMLPTask",
    "ImageMLP_Digits4_Relu32",
    "ImageMLP_Digits8_Relu32",
    "ImageMLP_Digits16_Relu32",
    "ImageMLP_Npz8_Relu32",
    "InMemoryDataset",
    "ParametricImageMLPFamily",
    "ParametricImageMLP_Digits8",
    "QuadraticTask",
    "RescaledFamily",
    "RescaledTaskParams",
    "ScaleRange",
    "Task",
    "TaskFamily",
    "load_digits_8x8",
    "load_npz_images_8x8",
    "resample_images",
    "single_task_to_family",
    "space_problems",
    "split_arrays",
    "vec_get_batch",
]
