"""A small convolutional classifier on the bundled 8x8 digits.

:class:`ImageConvTask` shares :class:`~popmeta.core.tasks.image_mlp.ImageMLPTask`'s
data handling, loss (mean softmax cross-entropy), accuracy and normalizer
(the loss clipped to ``[0, 1.5 log(num_classes)]``); only the network
differs: 3x3 ``SAME`` convolutions with stride 1 and a relu after each, then
the feature map flattened into one dense layer to the logits. Weights are
truncated-normal with std ``1/sqrt(fan_in)`` (fan-in of a 3x3 convolution is
``9 * in_channels``), biases zero, as for the MLPs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from popmeta.core.tasks.datasets import Batch, InMemoryDataset, load_digits_8x8, split_arrays
from popmeta.core.tasks.image_mlp import ImageMLPTask, dense

__all__ = ["Conv_Digits8", "ImageConvTask"]

Params = dict[str, dict[str, jax.Array]]

_KERNEL = 3


def _truncated_normal(key: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    w = jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)
    return w / np.sqrt(fan_in).astype(np.float32)


def _conv_same(x: jax.Array, w: jax.Array, dtype: str = "float32") -> jax.Array:
    """``SAME`` cross-correlation with stride 1 (``lax.conv``'s), as one matrix product.

    The image's ``k x k`` neighbourhoods are laid side by side (``[B, H, W, k k C]``)
    and multiplied by the kernel as a ``[k k C, C_out]`` matrix. Under a vmap
    over tasks, each with its own kernel, this stays a batched matrix
    product; ``lax.conv_general_dilated`` becomes a grouped convolution there,
    which XLA's CPU backend ran about 10x slower (docs/performance.md, "The
    conv net"). It equals ``lax.conv`` up to float rounding (a test compares them).
    """
    k = w.shape[0]
    height, width = x.shape[1], x.shape[2]
    pad = (k - 1) // 2
    padded = jnp.pad(x, ((0, 0), (pad, k - 1 - pad), (pad, k - 1 - pad), (0, 0)))
    patches = jnp.concatenate(
        [padded[:, i : i + height, j : j + width, :] for i in range(k) for j in range(k)],
        axis=-1,
    )
    return dense(patches, w.reshape(-1, w.shape[-1]), dtype)


class ImageConvTask(ImageMLPTask):
    """Convolutions then one dense layer, on ``{"image": [B, H, W, C], "label": [B]}``.

    Params are ``{"conv_i": {"w": [3, 3, c_in, c_out], "b": [c_out]},
    "linear_0": {"w": [H * W * c_last, num_classes], "b": [num_classes]}}``.

    Args:
      data: An :class:`InMemoryDataset`, or a mapping from each split to arrays.
      channels: Output channels of each convolution.
      batch_size: Examples per batch.
      num_classes: Number of output logits.
      seed: Seed of the host iterators' shuffling.
      compute_dtype: what products are computed in (see :class:`ImageMLPTask`).
    """

    def __init__(
        self,
        data: InMemoryDataset | Mapping[str, Batch],
        channels: Sequence[int] = (8, 8),
        batch_size: int = 128,
        num_classes: int = 10,
        seed: int = 0,
        compute_dtype: str = "float32",
    ):
        super().__init__(
            data,
            hidden_sizes=(),
            batch_size=batch_size,
            num_classes=num_classes,
            seed=seed,
            compute_dtype=compute_dtype,
        )
        self.channels = tuple(int(c) for c in channels)
        self.image_shape = tuple(self.data.split("train").host_arrays["image"].shape[1:])

    def init(self, key: jax.Array) -> Params:
        height, width, in_channels = self.image_shape
        keys = jax.random.split(key, len(self.channels) + 1)
        params = {}
        for i, out_channels in enumerate(self.channels):
            fan_in = _KERNEL * _KERNEL * in_channels
            params[f"conv_{i}"] = {
                "w": _truncated_normal(
                    keys[i], (_KERNEL, _KERNEL, in_channels, out_channels), fan_in
                ),
                "b": jnp.zeros((out_channels,), jnp.float32),
            }
            in_channels = out_channels
        fan_in = height * width * in_channels
        params["linear_0"] = {
            "w": _truncated_normal(keys[-1], (fan_in, self.num_classes), fan_in),
            "b": jnp.zeros((self.num_classes,), jnp.float32),
        }
        return params

    def apply(self, params: Params, images: jax.Array) -> jax.Array:
        x = images
        for i in range(len(self.channels)):
            layer = params[f"conv_{i}"]
            x = jax.nn.relu(_conv_same(x, layer["w"], self.compute_dtype) + layer["b"])
        x = jnp.reshape(x, (x.shape[0], -1))
        return dense(x, params["linear_0"]["w"], self.compute_dtype) + params["linear_0"]["b"]


def Conv_Digits8(
    channels: int = 8, batch_size: int = 128, seed: int = 0, compute_dtype: str = "float32"
) -> ImageConvTask:
    """Two 3x3 relu convolutions (``channels`` each) and a dense layer on the 8x8 digits.

    Same examples and fixed 70/10/10/10 split as the digits MLP.

    Args:
      channels: Output channels of each convolution.
      batch_size: Examples per batch.
      seed: Seed of the host iterators' shuffling (the split is always fixed).
      compute_dtype: what products are computed in (see :class:`ImageMLPTask`).
    """
    images, labels = load_digits_8x8()
    splits = split_arrays({"image": images, "label": labels})
    return ImageConvTask(
        InMemoryDataset(splits),
        channels=(channels, channels),
        batch_size=batch_size,
        seed=seed,
        compute_dtype=compute_dtype,
    )
