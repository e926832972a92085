"""MLP image classifiers on small in-memory 8x8 datasets.

:class:`ImageMLPTask` computes what learned_optimization's image MLP tasks
(``learned_optimization.tasks.fixed.image_mlp``, e.g.
``ImageMLP_FashionMnist8_Relu32``) compute: images flattened, a relu MLP
(``hk.nets.MLP``'s init, no activation on the logits), mean softmax
cross-entropy, and a normalizer that clips the loss to
``[0, 1.5 log(num_classes)]`` and maps NaN to that upper bound. Its
parameters are ``{"linear_i": {"w", "b"}}`` where Haiku names them
``"mlp/~/linear_i"``. The datasets and task names are popmeta's:
learned_optimization's 8x8 tasks read TFDS datasets that need downloads;
``ImageMLP_Digits8_Relu32`` uses scikit-learn's bundled 8x8 digits (also
resampled to 4x4 and 16x16) and ``ImageMLP_Npz8_Relu32`` a local ``.npz``,
all small enough to live on device, so batches are sampled inside jit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from popmeta.core.tasks.base import Task
from popmeta.core.tasks.datasets import (
    DEFAULT_SPLIT_FRACTIONS,
    Batch,
    InMemoryDataset,
    load_digits_8x8,
    load_npz_images_8x8,
    resample_images,
    split_arrays,
)

__all__ = [
    "ImageMLPTask",
    "ImageMLP_Digits4_Relu32",
    "ImageMLP_Digits8_Relu32",
    "ImageMLP_Digits16_Relu32",
    "ImageMLP_Npz8_Relu32",
]

Params = dict[str, dict[str, jax.Array]]


class ImageMLPTask(Task):
    """Softmax MLP classifier over flattened images.

    Batches are ``{"image": float32 [B, H, W, C], "label": int32 [B]}``.
    Params are ``{"linear_i": {"w": [fan_in, fan_out], "b": [fan_out]}}``;
    weights are truncated-normal with std ``1/sqrt(fan_in)`` (Haiku's
    ``hk.Linear`` default, as in learned_optimization's tasks), biases are zero.

    Attributes:
      data: The :class:`InMemoryDataset` sampled on device.
      datasets: Host iterators over the same arrays.
    """

    def __init__(
        self,
        data: InMemoryDataset | Mapping[str, Batch],
        hidden_sizes: Sequence[int] = (32,),
        batch_size: int = 128,
        num_classes: int = 10,
        activation: Callable[[jax.Array], jax.Array] = jax.nn.relu,
        seed: int = 0,
        compute_dtype: str = "float32",
    ):
        """Builds the task.

        Args:
          data: An :class:`InMemoryDataset`, or a mapping from each split name
            to ``{"image": [N, H, W, C], "label": [N]}`` arrays.
          hidden_sizes: Widths of the hidden layers.
          batch_size: Examples per batch, on device and on the host.
          num_classes: Number of output logits.
          activation: Hidden nonlinearity.
          seed: Seed of the host iterators' shuffling.
          compute_dtype: what the layers' products are computed in:
            ``float32``, or ``bfloat16`` (float32 sums, activations and loss;
            parameters and gradients stay float32).
        """
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"compute_dtype must be one of {COMPUTE_DTYPES}, got {compute_dtype!r}"
            )
        if not isinstance(data, InMemoryDataset):
            data = InMemoryDataset(data)
        train = data.split("train").host_arrays
        if not isinstance(train, Mapping) or set(train) != {"image", "label"}:
            raise ValueError("ImageMLPTask data must be {'image': ..., 'label': ...} per split.")
        self.data = data
        self.hidden_sizes = tuple(int(h) for h in hidden_sizes)
        self.batch_size = batch_size
        self.num_classes = num_classes
        self.activation = activation
        self.compute_dtype = compute_dtype
        self.input_size = int(np.prod(train["image"].shape[1:]))
        self.datasets = data.host_datasets(
            batch_size, seed=seed, extra_info={"num_classes": num_classes}
        )

    @classmethod
    def from_arrays(
        cls,
        images: Any,
        labels: Any,
        fractions: Sequence[float] = DEFAULT_SPLIT_FRACTIONS,
        split_seed: int = 0,
        **kwargs: Any,
    ) -> ImageMLPTask:
        """Builds the task from one pool of examples split deterministically.

        Args:
          images: ``[N, H, W, C]`` float images.
          labels: ``[N]`` integer labels.
          fractions: (train, inner_valid, outer_valid, test) fractions.
          split_seed: Seed of the fixed permutation before splitting.
          **kwargs: Forwarded to the constructor.
        """
        splits = split_arrays({"image": images, "label": labels}, fractions, split_seed)
        return cls(InMemoryDataset(splits), **kwargs)

    def init(self, key: jax.Array) -> Params:
        sizes = (self.input_size, *self.hidden_sizes, self.num_classes)
        keys = jax.random.split(key, len(sizes) - 1)
        params = {}
        for i, (k, fan_in, fan_out) in enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True)):
            w = jax.random.truncated_normal(k, -2.0, 2.0, (fan_in, fan_out), jnp.float32)
            params[f"linear_{i}"] = {
                "w": w / np.sqrt(fan_in).astype(np.float32),
                "b": jnp.zeros((fan_out,), jnp.float32),
            }
        return params

    def apply(self, params: Params, images: jax.Array) -> jax.Array:
        """Returns logits ``[B, num_classes]`` for images ``[B, ...]``."""
        x = jnp.reshape(images, (images.shape[0], -1))
        n_layers = len(self.hidden_sizes) + 1
        for i in range(n_layers):
            layer = params[f"linear_{i}"]
            x = dense(x, layer["w"], self.compute_dtype) + layer["b"]
            if i < n_layers - 1:
                x = self.activation(x)
        return x

    def loss(self, params: Params, key: jax.Array, data: Batch) -> jax.Array:
        del key
        logits = self.apply(params, data["image"])
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, data["label"]))

    def accuracy(self, params: Params, data: Batch) -> jax.Array:
        logits = self.apply(params, data["image"])
        return jnp.mean(jnp.argmax(logits, axis=-1) == data["label"])

    def normalizer(self, loss: jax.Array) -> jax.Array:
        # Divergent inner runs would otherwise dominate the meta-loss (or make it
        # NaN); learned_optimization's image tasks cap it at 1.5x the loss of a uniform
        # prediction.
        max_value = np.float32(1.5 * np.log(self.num_classes))
        return jnp.nan_to_num(jnp.clip(loss, 0.0, max_value), nan=max_value)

    def sample_batch(self, key: jax.Array, split: str = "train") -> Batch:
        return self.data.sample_batch(key, self.batch_size, split)


#: What an image task's products may be computed in.
COMPUTE_DTYPES = ("float32", "bfloat16")


def dense(x: jax.Array, w: jax.Array, dtype: str) -> jax.Array:
    """``x @ w`` with both rounded to ``dtype`` and summed in float32 (float32: ``x @ w``)."""
    return jnp.matmul(x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)


def ImageMLP_Digits8_Relu32(batch_size: int = 128, seed: int = 0) -> ImageMLPTask:
    """64 -> 32 -> 10 relu MLP on scikit-learn's bundled 8x8 digits.

    1797 images, pixels scaled to [0, 1], split 70/10/10/10 into
    train / inner_valid / outer_valid / test with a fixed permutation (seed 0).

    Args:
      batch_size: Examples per batch.
      seed: Seed of the host iterators' shuffling (the split is always fixed).
    """
    images, labels = load_digits_8x8()
    return ImageMLPTask.from_arrays(
        images, labels, hidden_sizes=(32,), batch_size=batch_size, num_classes=10, seed=seed
    )


def _digits_mlp(size: int, batch_size: int, seed: int) -> ImageMLPTask:
    images, labels = load_digits_8x8()
    return ImageMLPTask.from_arrays(
        resample_images(images, size),
        labels,
        hidden_sizes=(32,),
        batch_size=batch_size,
        num_classes=10,
        seed=seed,
    )


def ImageMLP_Digits4_Relu32(batch_size: int = 128, seed: int = 0) -> ImageMLPTask:
    """16 -> 32 -> 10 relu MLP on the bundled digits shrunk to 4x4 (2x2 block means).

    Same examples and fixed 70/10/10/10 split as :func:`ImageMLP_Digits8_Relu32`.

    Args:
      batch_size: Examples per batch.
      seed: Seed of the host iterators' shuffling (the split is always fixed).
    """
    return _digits_mlp(4, batch_size, seed)


def ImageMLP_Digits16_Relu32(batch_size: int = 128, seed: int = 0) -> ImageMLPTask:
    """256 -> 32 -> 10 relu MLP on the bundled digits enlarged to 16x16 (bilinear).

    Same examples and fixed 70/10/10/10 split as :func:`ImageMLP_Digits8_Relu32`.

    Args:
      batch_size: Examples per batch.
      seed: Seed of the host iterators' shuffling (the split is always fixed).
    """
    return _digits_mlp(16, batch_size, seed)


def ImageMLP_Npz8_Relu32(
    path: str | os.PathLike[str], batch_size: int = 128, num_classes: int = 10, seed: int = 0
) -> ImageMLPTask:
    """64 -> 32 -> num_classes relu MLP on 8x8 images from a local ``.npz``.

    The file holds ``images`` (``[N, 8, 8]``, ``[N, 8, 8, 1]`` or ``[N, 64]``;
    uint8 is divided by 255, other dtypes used as-is) and ``labels`` (``[N]``
    ints in ``[0, num_classes)``); see
    :func:`popmeta.core.tasks.datasets.load_npz_images_8x8`. The examples are
    split 70/10/10/10 with a fixed permutation, as for the digits task.

    Raises:
      ValueError: Unreadable file, missing key, or wrong shape / dtype / range;
        the message names the file and key.
    """
    images, labels = load_npz_images_8x8(path, num_classes=num_classes)
    try:
        splits = split_arrays({"image": images, "label": labels})
    except ValueError as e:
        raise ValueError(f"{os.fspath(path)}: {e}") from e
    return ImageMLPTask(
        InMemoryDataset(splits),
        hidden_sizes=(32,),
        batch_size=batch_size,
        num_classes=num_classes,
        seed=seed,
    )
