"""Task families: ``task.kind`` -> a ``TaskFamily``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from popmeta.core.tasks import (
    ACTIVATIONS,
    Conv_Digits8,
    CurvedQuadraticFamily,
    FixedDimQuadraticFamily,
    FixedDimQuadraticFamilyData,
    ImageMLP_Digits4_Relu32,
    ImageMLP_Digits16_Relu32,
    ImageMLP_Npz8_Relu32,
    ImageMLPConfig,
    ImageMLPTask,
    ParametricImageMLP_Digits8,
    QuadraticTask,
    TaskFamily,
    load_digits_8x8,
    single_task_to_family,
    space_problems,
)
from popmeta.registry.kinds import PositiveInt, Registry

__all__ = ["TASK_FAMILIES"]

#: What an image task's products may be computed in (``ImageMLPTask.compute_dtype``).
ComputeDtype = Literal["float32", "bfloat16"]

TASK_FAMILIES: Registry[TaskFamily] = Registry(
    "task", "Task families", "a `TaskFamily`", returns=TaskFamily
)


def _refuses_outer_valid(config: Any, where: str, section: Any) -> Iterator[tuple[str, str]]:
    """A family without data has no ``outer_valid`` split to take a meta-loss on."""
    if config.estimator.meta_loss_split == "outer_valid":
        yield (
            "estimator.meta_loss_split",
            f"'outer_valid' evaluates on held-out data, and {where}.kind {section.kind!r} is "
            "data-free (no outer_valid split); use meta_loss_split: train or a family with data",
        )


def _data_free(name: str, summary: str):
    return TASK_FAMILIES.register(name, summary, rules=_refuses_outer_valid, data_free=True)


@_data_free("quadratic", "`sum(p**2)` in `dim` dimensions from a random start")
def quadratic(dim: PositiveInt = 10) -> TaskFamily:
    """Args:
    dim: dimension of the parameters.
    """
    return single_task_to_family(QuadraticTask(dim))


@_data_free(
    "fixed_dim_quadratic",
    "`sum((t - p)**2)` in `dim` dimensions, target `t ~ N(0, I)` sampled per task",
)
def fixed_dim_quadratic(dim: PositiveInt = 10) -> TaskFamily:
    """Args:
    dim: dimension of the parameters.
    """
    return FixedDimQuadraticFamily(dim)


@_data_free(
    "curved_quadratic",
    "popmeta's own: `0.5 * sum(s * (p - t)**2)`, target `t ~ N(0, I)` and per-coordinate "
    "curvature `s ~ LogUniform(0.1, 10)` sampled per task (the quickstart's family)",
)
def curved_quadratic(dim: PositiveInt = 10) -> TaskFamily:
    """Args:
    dim: dimension of the parameters.
    """
    return CurvedQuadraticFamily(dim)


@TASK_FAMILIES.register(
    "fixed_dim_quadratic_data",
    "`fixed_dim_quadratic` plus scalar `N(0, 1)` noise data; meta-loss clipped to [0, 1000]",
)
def fixed_dim_quadratic_data(dim: PositiveInt = 10) -> TaskFamily:
    """Args:
    dim: dimension of the parameters.
    """
    return FixedDimQuadraticFamilyData(dim)


@TASK_FAMILIES.register(
    "image_mlp_digits",
    "an MLP on scikit-learn's bundled 8x8 digits: 64-32-10 ReLU, batch 128, unless its fields "
    "say otherwise (`width: 128, depth: 2` is 64-128-128-10)",
)
def image_mlp_digits(
    width: PositiveInt = 32,
    depth: PositiveInt = 1,
    activation: Literal["relu", "tanh", "gelu", "elu"] = "relu",
    batch_size: PositiveInt = 128,
    compute_dtype: ComputeDtype = "float32",
) -> TaskFamily:
    """Args:
    width: units of every hidden layer.
    depth: number of hidden layers.
    activation: the hidden nonlinearity.
    batch_size: examples per inner batch.
    compute_dtype: what products are computed in (bfloat16: float32 sums and parameters).
    """
    images, labels = load_digits_8x8()
    task = ImageMLPTask.from_arrays(
        images,
        labels,
        hidden_sizes=(width,) * depth,
        batch_size=batch_size,
        num_classes=10,
        activation=ACTIVATIONS[activation],
        compute_dtype=compute_dtype,
    )
    return single_task_to_family(task)


@TASK_FAMILIES.register(
    "image_mlp_digits4", "a 16-32-10 ReLU MLP on the bundled digits shrunk to 4x4 (2x2 means)"
)
def image_mlp_digits4() -> TaskFamily:
    return single_task_to_family(ImageMLP_Digits4_Relu32())


@TASK_FAMILIES.register(
    "image_mlp_digits16", "a 256-32-10 ReLU MLP on the bundled digits enlarged to 16x16"
)
def image_mlp_digits16() -> TaskFamily:
    return single_task_to_family(ImageMLP_Digits16_Relu32())


@TASK_FAMILIES.register(
    "conv_digits",
    "two 3x3 ReLU convolutions (8 channels, unless `channels` says otherwise) and a dense layer "
    "on the 8x8 digits",
)
def conv_digits(
    channels: PositiveInt = 8,
    batch_size: PositiveInt = 128,
    compute_dtype: ComputeDtype = "float32",
) -> TaskFamily:
    """Args:
    channels: output channels of each convolution.
    batch_size: examples per inner batch.
    compute_dtype: what products are computed in (bfloat16: float32 sums and parameters).
    """
    return single_task_to_family(
        Conv_Digits8(channels=channels, batch_size=batch_size, compute_dtype=compute_dtype)
    )


Activation = Literal["relu", "tanh", "gelu", "elu"]


def _choices_drawn(config: Any, where: str, section: Any) -> Iterator[tuple[str, str]]:
    """The family's own check of its architecture space, named by field."""
    del config
    choices = ("widths", "depths", "activations", "batch_sizes")
    problems = space_problems(**{name: getattr(section, name) for name in choices})
    yield from ((f"{where}.{field}", problem) for field, problem in problems)


@TASK_FAMILIES.register(
    "parametric_image_mlp_digits",
    "MLPs on the 8x8 digits with sampled width, depth, activation and batch size (each drawn "
    "from its list): `groups` architectures drawn from the run's seed, one group of task slots "
    "each; meta-testing runs its nominal member (`nominal_*`, batch 128)",
    rules=_choices_drawn,
)
def parametric_image_mlp_digits(
    groups: PositiveInt = 3,
    widths: tuple[int, ...] = (16, 32, 64),
    depths: tuple[int, ...] = (1, 2, 3),
    activations: tuple[Activation, ...] = ("relu", "tanh", "gelu", "elu"),
    batch_sizes: tuple[int, ...] = (32, 64, 128),
    nominal_width: PositiveInt = 32,
    nominal_depth: PositiveInt = 1,
    nominal_activation: Activation = "relu",
) -> TaskFamily:
    """Args:
    groups: architectures a worker trains at once, each with its own compile.
    widths: hidden widths an architecture draws from (every hidden layer has its one width).
    depths: numbers of hidden layers an architecture draws from.
    activations: hidden nonlinearities an architecture draws from.
    batch_sizes: examples per inner batch an architecture draws from.
    nominal_width: hidden width of the member meta-testing runs.
    nominal_depth: hidden layers of the member meta-testing runs.
    nominal_activation: nonlinearity of the member meta-testing runs.
    """
    nominal = ImageMLPConfig(nominal_width, nominal_depth, nominal_activation, batch_size=128)
    return ParametricImageMLP_Digits8(
        widths=widths,
        depths=depths,
        activations=activations,
        batch_sizes=batch_sizes,
        num_groups=groups,
        nominal=nominal,
    )


@TASK_FAMILIES.register(
    "image_mlp_npz", "a 64-32-10 ReLU MLP on 8x8 images from the `.npz` file `npz_path`"
)
def image_mlp_npz(npz_path: str) -> TaskFamily:
    """Args:
    npz_path: a ``.npz`` with ``images`` and ``labels``.
    """
    return single_task_to_family(ImageMLP_Npz8_Relu32(npz_path))
