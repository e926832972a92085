"""Small in-memory datasets: sampled on device inside jit, iterated on the host.

The data of every built-in task is small enough to sit on the accelerator, so
batches are drawn *inside* the jitted inner step from a PRNG key
(:meth:`ArrayDataset.sample`): no host round trip, no input pipeline, and a
batch is a pure function of its key, which is what antithetic ES needs (both
members of a pair see the same data by reusing the key).

For code written against ``learned_optimization``'s host-side API, the same
arrays are also exposed as :class:`Datasets`: one infinite numpy iterator per
split.

The only I/O in ``popmeta.core`` lives here and runs on the host when a task is
constructed: :func:`load_digits_8x8` (scikit-learn's bundled copy of the UCI
digits) and :func:`load_npz_images_8x8` (an explicit local ``.npz`` path).
"""

from __future__ import annotations

import dataclasses
import os
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SPLITS: tuple[str, ...] = ("train", "inner_valid", "outer_valid", "test")
"""The four splits every dataset exposes, in learned_optimization's order."""

DEFAULT_SPLIT_FRACTIONS: tuple[float, float, float, float] = (0.7, 0.1, 0.1, 0.1)

Batch = Any
"""A pytree of arrays sharing a leading batch axis."""


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; expected one of {SPLITS}.")


class _HostBatchIterator:
    """Infinite iterator of numpy batches, shuffled without replacement per epoch.

    Epoch-wise shuffling (rather than i.i.d. draws) mirrors a
    ``shuffle().repeat().batch()`` input pipeline, which is what host-side users
    of learned_optimization are used to.
    """

    def __init__(self, arrays: Any, batch_size: int, seed: int):
        self._arrays = arrays
        self._batch_size = batch_size
        self._num_examples = jax.tree.leaves(arrays)[0].shape[0]
        self._rng = np.random.default_rng(seed)
        self._order = np.zeros((0,), dtype=np.int64)

    def __iter__(self) -> _HostBatchIterator:
        return self

    def __next__(self) -> Batch:
        # Top the index queue up with fresh permutations; a batch may straddle two
        # epochs, so every example is seen equally often in the long run.
        while self._order.shape[0] < self._batch_size:
            perm = self._rng.permutation(self._num_examples)
            self._order = np.concatenate([self._order, perm])
        idx, self._order = self._order[: self._batch_size], self._order[self._batch_size :]
        return jax.tree.map(lambda a: a[idx], self._arrays)


class ArrayDataset:
    """One split held as a pytree of arrays with a shared leading example axis.

    Keeps a host (numpy) and a device (jax) copy of the same arrays: the device
    copy feeds :meth:`sample`, the host copy feeds :meth:`host_iterator`.

    Attributes:
      host_arrays: Pytree of numpy arrays.
      arrays: The same pytree as jax arrays.
      num_examples: Size of the leading axis.
    """

    def __init__(self, arrays: Any):
        """Builds the dataset.

        Args:
          arrays: Pytree of array-likes, all with the same (non-zero) leading size.

        Raises:
          ValueError: If the pytree is empty, or leading sizes differ or are zero.
        """
        host = jax.tree.map(np.asarray, arrays)
        leaves = jax.tree.leaves(host)
        if not leaves:
            raise ValueError("ArrayDataset needs at least one array.")
        sizes = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
        if len(sizes) != 1 or None in sizes or 0 in sizes:
            raise ValueError(
                "ArrayDataset arrays must share a non-zero leading (example) axis; got "
                f"shapes {[leaf.shape for leaf in leaves]}."
            )
        self.host_arrays = host
        self.arrays = jax.tree.map(jnp.asarray, host)
        self.num_examples: int = sizes.pop()

    def sample(self, key: jax.Array, batch_size: int) -> Batch:
        """Draws a batch on device (jittable, vmappable over ``key``).

        Indices are drawn uniformly *with* replacement: that keeps a batch a pure,
        cheap function of the key with no epoch state to carry through the unroll.

        Args:
          key: PRNG key.
          batch_size: Static number of examples.

        Returns:
          The arrays gathered at ``batch_size`` random indices.
        """
        idx = jax.random.randint(key, (batch_size,), 0, self.num_examples)
        return jax.tree.map(lambda a: jnp.take(a, idx, axis=0), self.arrays)

    def host_iterator(self, batch_size: int, seed: int = 0) -> Iterator[Batch]:
        """Returns an infinite iterator of numpy batches (epoch-shuffled)."""
        return _HostBatchIterator(self.host_arrays, batch_size, seed)

    def abstract_batch(self, batch_size: int) -> Any:
        """Shapes and dtypes of one batch, as ``jax.ShapeDtypeStruct`` leaves."""
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((batch_size, *a.shape[1:]), a.dtype), self.host_arrays
        )


@dataclasses.dataclass
class Datasets:
    """Host-side iterators of one task (family), one per split.

    Mirrors ``learned_optimization.tasks.datasets.base.Datasets``: each field is
    an infinite python iterator of numpy batches; ``next(datasets.train)``.

    Attributes:
      train: Batches the inner optimizer trains on.
      inner_valid: Validation batches visible to the inner problem.
      outer_valid: Batches for meta-validation / meta-loss.
      test: Held-out batches.
      abstract_batch: ``jax.ShapeDtypeStruct`` pytree of one batch, or None.
      extra_info: Free-form metadata (e.g. ``num_classes``).
    """

    train: Iterator[Batch]
    inner_valid: Iterator[Batch]
    outer_valid: Iterator[Batch]
    test: Iterator[Batch]
    abstract_batch: Any = None
    extra_info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def split(self, name: str) -> Iterator[Batch]:
        """Returns the iterator of split ``name``."""
        _check_split(name)
        return getattr(self, name)


class InMemoryDataset:
    """The four splits of a small dataset, each an :class:`ArrayDataset`.

    Batch size is not stored here: it belongs to the task that consumes the data.
    """

    def __init__(self, splits: Mapping[str, Any]):
        """Builds the container.

        Args:
          splits: Mapping from every name in :data:`SPLITS` to a pytree of arrays
            (all splits must have the same pytree structure).

        Raises:
          ValueError: If a split is missing or structures differ.
        """
        missing = [s for s in SPLITS if s not in splits]
        if missing:
            raise ValueError(f"InMemoryDataset is missing splits {missing}; expected {SPLITS}.")
        self._splits = {s: ArrayDataset(splits[s]) for s in SPLITS}
        structures = {s: jax.tree.structure(d.host_arrays) for s, d in self._splits.items()}
        if len(set(structures.values())) != 1:
            raise ValueError(f"All splits must share one pytree structure; got {structures}.")

    def split(self, name: str) -> ArrayDataset:
        """Returns the :class:`ArrayDataset` of split ``name``."""
        _check_split(name)
        return self._splits[name]

    def sample_batch(self, key: jax.Array, batch_size: int, split: str = "train") -> Batch:
        """Draws a batch of ``split`` on device; ``split`` and ``batch_size`` are static."""
        return self.split(split).sample(key, batch_size)

    def host_datasets(
        self,
        batch_size: int,
        seed: int = 0,
        extra_info: Mapping[str, Any] | None = None,
    ) -> Datasets:
        """Builds host iterators over the same arrays.

        Args:
          batch_size: Examples per host batch.
          seed: Seed of the numpy shuffling; split ``i`` uses ``seed + i`` so the
            splits do not shuffle in lockstep.
          extra_info: Stored on the returned :class:`Datasets`.

        Returns:
          A :class:`Datasets` with one infinite iterator per split.
        """
        iters = {
            s: self._splits[s].host_iterator(batch_size, seed=seed + i)
            for i, s in enumerate(SPLITS)
        }
        return Datasets(
            **iters,
            abstract_batch=self._splits["train"].abstract_batch(batch_size),
            extra_info=dict(extra_info or {}),
        )


def split_arrays(
    arrays: Any,
    fractions: Sequence[float] = DEFAULT_SPLIT_FRACTIONS,
    seed: int = 0,
) -> dict[str, Any]:
    """Deterministically partitions arrays into the four splits.

    Args:
      arrays: Pytree of arrays sharing a leading example axis.
      fractions: Fractions of (train, inner_valid, outer_valid, test); must be
        positive and sum to 1.
      seed: Seed of the fixed permutation applied before splitting, so that the
        splits are i.i.d. even if the source is ordered (e.g. by class).

    Returns:
      Mapping from split name to a pytree of numpy arrays.

    Raises:
      ValueError: If the fractions are invalid or a split would be empty.
    """
    fractions = tuple(float(f) for f in fractions)
    if len(fractions) != len(SPLITS) or min(fractions) <= 0 or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(
            f"fractions must be {len(SPLITS)} positive numbers summing to 1; got {fractions}."
        )
    host = jax.tree.map(np.asarray, arrays)
    n = jax.tree.leaves(host)[0].shape[0]
    bounds = np.round(np.cumsum((0.0, *fractions)) * n).astype(np.int64)
    bounds[-1] = n
    if np.any(np.diff(bounds) <= 0):
        raise ValueError(
            f"{n} examples are too few to split with fractions {fractions}: a split would be empty."
        )
    perm = np.random.default_rng(seed).permutation(n)
    return {
        s: jax.tree.map(lambda a, lo=lo, hi=hi: a[perm[lo:hi]], host)
        for s, lo, hi in zip(SPLITS, bounds[:-1], bounds[1:], strict=True)
    }


def load_digits_8x8() -> tuple[np.ndarray, np.ndarray]:
    """Loads scikit-learn's bundled 8x8 handwritten digits (no download).

    Returns:
      ``(images, labels)``: images float32 ``[1797, 8, 8, 1]`` scaled to [0, 1]
      (raw pixels are 0..16), labels int32 ``[1797]`` in 0..9.
    """
    # Imported lazily: sklearn is heavy and only needed for this task.
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (np.asarray(digits.images, np.float32) / 16.0)[..., None]
    return images, np.asarray(digits.target, np.int32)


def resample_images(images: np.ndarray, size: int) -> np.ndarray:
    """Resamples square images ``[N, H, W, C]`` to ``[N, size, size, C]`` on the host.

    Shrinking by a whole factor ``k`` averages each ``k x k`` block (8x8 -> 4x4
    is the mean of each 2x2 block), so no pixel is dropped; any other size is
    bilinear interpolation with antialiasing (``jax.image.resize``), which for
    enlarging (8x8 -> 16x16) interpolates between neighbouring pixels. Runs
    once, when a task is built.

    Args:
      images: float images with a leading example axis.
      size: side of the output images.

    Returns:
      float32 numpy images.

    Raises:
      ValueError: if ``size`` is not a positive integer.
    """
    if isinstance(size, bool) or int(size) != size or size < 1:
        raise ValueError(f"size must be a positive integer; got {size!r}.")
    size = int(size)
    n, height, width, channels = images.shape
    images = np.asarray(images, np.float32)
    if height == width and height % size == 0:
        k = height // size
        return images.reshape(n, size, k, size, k, channels).mean(axis=(2, 4))
    resized = jax.image.resize(
        jnp.asarray(images), (n, size, size, channels), method="linear", antialias=True
    )
    return np.asarray(resized, np.float32)


NPZ_IMAGES_KEY = "images"
NPZ_LABELS_KEY = "labels"


def load_npz_images_8x8(
    path: str | os.PathLike[str], num_classes: int = 10
) -> tuple[np.ndarray, np.ndarray]:
    """Loads 8x8 grayscale images and integer labels from a local ``.npz``.

    Expected keys:

    * ``images``: ``[N, 8, 8]``, ``[N, 8, 8, 1]`` or ``[N, 64]``, any real dtype.
      ``uint8`` pixels are divided by 255; other dtypes are used as they are, so
      store them already scaled to about [0, 1].
    * ``labels``: ``[N]`` integers in ``[0, num_classes)``.

    Args:
      path: Path of the ``.npz`` file (e.g. written by ``np.savez``).
      num_classes: Number of classes the labels must fall in.

    Returns:
      ``(images, labels)``: float32 ``[N, 8, 8, 1]`` and int32 ``[N]``.

    Raises:
      ValueError: If the file cannot be read as ``.npz``, a key is missing, or a
        shape / dtype / label range is wrong. The message names the file, the key
        and what was expected.
    """
    path = os.fspath(path)
    expected = (
        f"a .npz archive with keys {NPZ_IMAGES_KEY!r} ([N, 8, 8] images) and "
        f"{NPZ_LABELS_KEY!r} ([N] int labels)"
    )
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):  # a plain .npy gives one array
            raise ValueError("found a single .npy array")
        with loaded as npz:
            contents = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise ValueError(f"{path}: cannot read it as {expected}: {e}") from e

    for key in (NPZ_IMAGES_KEY, NPZ_LABELS_KEY):
        if key not in contents:
            raise ValueError(
                f"{path}: missing key {key!r}; expected keys {NPZ_IMAGES_KEY!r} ([N, 8, 8] images) "
                f"and {NPZ_LABELS_KEY!r} ([N] int labels), found {sorted(contents)}."
            )
    images, labels = contents[NPZ_IMAGES_KEY], contents[NPZ_LABELS_KEY]

    if not (np.issubdtype(images.dtype, np.integer) or np.issubdtype(images.dtype, np.floating)):
        raise ValueError(
            f"{path}: key {NPZ_IMAGES_KEY!r} must be numeric, got dtype {images.dtype}."
        )
    if images.ndim == 2 and images.shape[1] == 64:
        images = images.reshape(-1, 8, 8)
    elif images.ndim == 4 and images.shape[1:] == (8, 8, 1):
        images = images[..., 0]
    if images.ndim != 3 or images.shape[1:] != (8, 8):
        raise ValueError(
            f"{path}: key {NPZ_IMAGES_KEY!r} has shape {contents[NPZ_IMAGES_KEY].shape}; expected "
            "[N, 8, 8], [N, 8, 8, 1] or [N, 64]."
        )
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"{path}: key {NPZ_LABELS_KEY!r} has shape {labels.shape} and dtype {labels.dtype}; "
            "expected a 1-D integer array [N]."
        )
    if labels.shape[0] != images.shape[0]:
        raise ValueError(
            f"{path}: key {NPZ_LABELS_KEY!r} has {labels.shape[0]} entries but key "
            f"{NPZ_IMAGES_KEY!r} has {images.shape[0]} images; expected one label per image."
        )
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(
            f"{path}: key {NPZ_LABELS_KEY!r} has values in [{labels.min()}, {labels.max()}]; "
            f"expected integers in [0, {num_classes})."
        )

    scale = 255.0 if images.dtype == np.uint8 else 1.0
    images = (images.astype(np.float32) / np.float32(scale))[..., None]
    if not np.all(np.isfinite(images)):
        raise ValueError(f"{path}: key {NPZ_IMAGES_KEY!r} contains non-finite values.")
    return images, labels.astype(np.int32)
