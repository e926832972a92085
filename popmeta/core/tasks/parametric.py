"""A parametric family of image MLPs: width, depth, activation and batch size sampled.

Tasks of different architectures have parameter pytrees (and batches) of
different shapes, so they cannot be sampled inside one vmapped batch the way a
task parameter is. :class:`ParametricImageMLPFamily` therefore samples on the
host: :meth:`~ParametricImageMLPFamily.sample_configs` draws a few
architectures (:class:`ImageMLPConfig`) from a seed, and
:meth:`~ParametricImageMLPFamily.family_of` turns each into an ordinary task
family, which a mixture trains as one group of task slots (one compile per
architecture). Used directly as a :class:`TaskFamily` (meta-testing, which
runs one family), it is its *nominal* member: 32 relu units, one hidden layer,
batches of 128, i.e. the digits MLP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from popmeta.core.tasks.base import Batch, Task, TaskFamily, TaskParams, single_task_to_family
from popmeta.core.tasks.datasets import InMemoryDataset, load_digits_8x8, split_arrays
from popmeta.core.tasks.image_mlp import ImageMLPTask

__all__ = [
    "ACTIVATIONS",
    "ImageMLPConfig",
    "ParametricImageMLPFamily",
    "ParametricImageMLP_Digits8",
    "space_problems",
]

#: The hidden nonlinearities an architecture may draw, by name.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "tanh": jnp.tanh,
    "gelu": jax.nn.gelu,
    "elu": jax.nn.elu,
}


class ImageMLPConfig(NamedTuple):
    """One architecture of the parametric family.

    Attributes:
      width: units of every hidden layer.
      depth: number of hidden layers.
      activation: a key of :data:`ACTIVATIONS`.
      batch_size: examples per inner batch.
    """

    width: int
    depth: int
    activation: str
    batch_size: int

    @property
    def name(self) -> str:
        return f"w{self.width}_d{self.depth}_{self.activation}_b{self.batch_size}"


#: The digits MLP: the member used where one family is needed.
NOMINAL = ImageMLPConfig(width=32, depth=1, activation="relu", batch_size=128)


def space_problems(
    widths: Sequence[int],
    depths: Sequence[int],
    activations: Sequence[str],
    batch_sizes: Sequence[int],
) -> Iterator[tuple[str, str]]:
    """What is wrong with an architecture space, as ``(field, problem)`` pairs; none when valid.

    Every choice must list at least one value; sizes must be positive integers and
    activations keys of :data:`ACTIVATIONS`.
    """
    empty = "must list at least one choice, got []"
    for field, sizes in (("widths", widths), ("depths", depths), ("batch_sizes", batch_sizes)):
        if not sizes:
            yield field, empty
        elif any(int(v) != v or v < 1 for v in sizes):
            yield field, f"must be positive integers, got {list(sizes)!r}"
    if not activations:
        yield "activations", empty
    elif any(a not in ACTIVATIONS for a in activations):
        yield "activations", f"must be some of {sorted(ACTIVATIONS)}, got {list(activations)!r}"


class ParametricImageMLPFamily(TaskFamily):
    """Image MLPs whose architecture and batch size are sampled per group of tasks.

    Args:
      data: the dataset every architecture trains on.
      widths: hidden widths to draw from.
      depths: numbers of hidden layers to draw from.
      activations: activation names (keys of :data:`ACTIVATIONS`) to draw from.
      batch_sizes: batch sizes to draw from.
      num_classes: number of output logits.
      nominal: the member used where one family is needed (meta-testing).
      num_groups: architectures a worker trains at once (each a group of task
        slots with its own compile), drawn from the run's seed.

    Raises:
      ValueError: on an empty choice, a non-positive size or an unknown activation.
    """

    def __init__(
        self,
        data: InMemoryDataset,
        widths: Sequence[int] = (16, 32, 64),
        depths: Sequence[int] = (1, 2, 3),
        activations: Sequence[str] = ("relu", "tanh", "gelu", "elu"),
        batch_sizes: Sequence[int] = (32, 64, 128),
        num_classes: int = 10,
        nominal: ImageMLPConfig = NOMINAL,
        num_groups: int = 3,
    ):
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1; got {num_groups!r}")
        for field, problem in space_problems(widths, depths, activations, batch_sizes):
            raise ValueError(f"{field} {problem}")
        if nominal.activation not in ACTIVATIONS:
            raise ValueError(
                f"nominal.activation must be one of {sorted(ACTIVATIONS)}; "
                f"got {nominal.activation!r}"
            )
        self.data = data
        self.widths = tuple(int(w) for w in widths)
        self.depths = tuple(int(d) for d in depths)
        self.activations = tuple(activations)
        self.batch_sizes = tuple(int(b) for b in batch_sizes)
        self.num_classes = num_classes
        self.nominal = nominal
        self.num_groups = int(num_groups)
        self._nominal_family = self.family_of(nominal)
        self.datasets = self._nominal_family.datasets

    def sample_configs(self, seed: int, count: int) -> list[ImageMLPConfig]:
        """Draws ``count`` architectures, each choice uniform and independent, from ``seed``.

        Host-side and deterministic: the same seed gives the same architectures.
        """
        rng = np.random.default_rng([int(seed), 0x9A7A])
        return [
            ImageMLPConfig(
                width=int(rng.choice(self.widths)),
                depth=int(rng.choice(self.depths)),
                activation=str(rng.choice(self.activations)),
                batch_size=int(rng.choice(self.batch_sizes)),
            )
            for _ in range(count)
        ]

    def family_of(self, config: ImageMLPConfig) -> TaskFamily:
        """The (single-task) family of one architecture, on this family's data."""
        task = ImageMLPTask(
            self.data,
            hidden_sizes=(config.width,) * config.depth,
            batch_size=config.batch_size,
            num_classes=self.num_classes,
            activation=ACTIVATIONS[config.activation],
        )
        return single_task_to_family(task)

    def sample(self, key: jax.Array) -> TaskParams:
        return self._nominal_family.sample(key)

    def task_fn(self, task_params: TaskParams) -> Task:
        return self._nominal_family.task_fn(task_params)

    def sample_batch(self, key: jax.Array, split: str = "train") -> Batch:
        return self._nominal_family.sample_batch(key, split)


def ParametricImageMLP_Digits8(**kwargs) -> ParametricImageMLPFamily:
    """:class:`ParametricImageMLPFamily` on scikit-learn's bundled 8x8 digits.

    Same examples and fixed 70/10/10/10 split as the digits MLP.

    Args:
      **kwargs: forwarded to :class:`ParametricImageMLPFamily`.
    """
    images, labels = load_digits_8x8()
    data = InMemoryDataset(split_arrays({"image": images, "label": labels}))
    return ParametricImageMLPFamily(data, **kwargs)
