"""One checkpoint file: a plain ``.npz`` archive keyed by pytree path, written atomically.

Every array leaf of a dict-rooted pytree is stored under its key path string
(``jax.tree_util.keystr``), so restoring never depends on leaf order; one
``__metadata__`` entry holds a JSON header (step, format version, stored
dtypes, typed PRNG keys, the caller's metadata, optional sections). A file is
written to a temporary file, fsynced and renamed into place, so a crash
leaves the old file or the complete new one. Reading checks every array
(damage is :class:`CheckpointCorruptedError`) and restores into the
structure, shapes and dtypes of a target. The format in full is in
``docs/checkpoints.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = [
    "Checkpoint",
    "CheckpointCorruptedError",
    "PathLike",
    "check_readable",
    "load_checkpoint",
    "read_checkpoint_metadata",
    "save_tree",
]

_FORMAT_VERSION = 1
_METADATA_KEY = "__metadata__"
_TMP_PREFIX = ".tmp-ckpt_"
_TMP_SUFFIX = ".npz.partial"

PathLike = str | os.PathLike[str]


class CheckpointCorruptedError(ValueError):
    """A checkpoint file exists but cannot be read (truncated, bad zip, ...)."""


class Checkpoint(NamedTuple):
    """A restored checkpoint.

    Attributes:
      path: the file it was read from.
      step: the step it was saved at.
      tree: the restored pytree, with the structure of the target.
      metadata: the caller's metadata dict given to :func:`save_tree`.
    """

    path: Path
    step: int
    tree: Any
    metadata: dict[str, Any]


def _is_prng_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _flatten(tree: Any) -> dict[str, Any]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def _fsync_directory(directory: Path) -> None:
    # Makes the rename itself durable. Not possible on every platform (e.g.
    # Windows cannot open a directory), where the rename is still atomic.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_tree(
    path: PathLike,
    tree: Mapping[str, Any],
    step: int = 0,
    metadata: Mapping[str, Any] | None = None,
    optional: tuple[str, ...] = (),
) -> Path:
    """Atomically writes ``tree`` to the file ``path`` in the checkpoint format.

    What :func:`~popmeta.learner.checkpoints.save_checkpoint` writes, at a
    path of the caller's choosing (its directory must exist);
    :func:`load_checkpoint` reads it back. Other popmeta files that hold
    arrays (an exported learned optimizer) use it.

    Args:
      path: the file to write.
      tree: a dict-rooted pytree; leaves may be jax/numpy arrays, python
        scalars or typed PRNG keys; ``None`` and empty containers store nothing.
      step: the step recorded in the header.
      metadata: json-able extras, returned by :func:`read_checkpoint_metadata`
        and as ``Checkpoint.metadata``.
      optional: top-level keys of ``tree`` that readers may leave out of
        their target.

    Returns:
      ``path``.

    Raises:
      TypeError: a leaf is not an array, or ``metadata`` is not json-able.
    """
    arrays = _encode(tree, step, metadata, optional)
    final = Path(path)
    directory = final.parent
    _remove_stale_temp_files(directory)
    fd, tmp_name = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=_TMP_SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, final)
    except BaseException:
        # Never leave a partial file behind; the previous checkpoints are
        # untouched because nothing was renamed. Where even the unlink fails
        # (the directory became read-only), the write's own error is the one
        # to report, and the next save removes the stray file.
        with contextlib.suppress(OSError):
            Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_directory(directory)
    return final


def _encode(
    tree: Mapping[str, Any],
    step: int,
    metadata: Mapping[str, Any] | None,
    optional: tuple[str, ...],
) -> dict[str, np.ndarray]:
    """The archive's entries: every leaf by key path, and the JSON header."""
    arrays: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    prng_impls: dict[str, str] = {}
    for key, leaf in _flatten(tree).items():
        if _is_prng_key(leaf):
            prng_impls[key] = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        array = np.asarray(jax.device_get(leaf))
        if array.dtype == object:
            raise TypeError(f"checkpoint leaf {key} is not an array (got {type(leaf).__name__})")
        arrays[key] = array
        # numpy writes extension dtypes such as bfloat16 as raw void bytes;
        # the name lets load view them back.
        dtypes[key] = array.dtype.name

    header = {
        "format_version": _FORMAT_VERSION,
        "step": int(step),
        "dtypes": dtypes,
        "prng_keys": prng_impls,
        "metadata": dict(metadata or {}),
        "optional_sections": list(optional),
    }
    try:
        arrays[_METADATA_KEY] = np.array(json.dumps(header))
    except TypeError as e:
        raise TypeError(f"checkpoint metadata must be json-able: {e}") from e
    return arrays


def _remove_stale_temp_files(directory: Path) -> None:
    for entry in directory.iterdir():
        if entry.name.startswith(_TMP_PREFIX) and entry.name.endswith(_TMP_SUFFIX):
            with contextlib.suppress(OSError):
                entry.unlink()


def _header(npz: Any, path: Path) -> dict[str, Any]:
    if _METADATA_KEY not in npz.files:
        raise CheckpointCorruptedError(
            f"{path} is not a popmeta checkpoint: a .npz archive without popmeta's header"
        )
    header = json.loads(str(npz[_METADATA_KEY][()]))
    if not isinstance(header, dict) or "step" not in header:
        raise ValueError("metadata entry is not a checkpoint header")
    return header


def _corrupted(path: Path, e: BaseException) -> CheckpointCorruptedError:
    return CheckpointCorruptedError(
        f"checkpoint {path} is damaged or unreadable: {type(e).__name__}: {e}"
    )


def _open_archive(path: Path) -> Any:
    """``np.load`` of a checkpoint; a file that is not a whole zip archive is named as such.

    (numpy would read any other file as a pickle, and advise ``allow_pickle``.)
    """
    if path.exists() and not zipfile.is_zipfile(path):
        raise CheckpointCorruptedError(
            f"{path} is not a popmeta checkpoint, or a damaged one: it is not a complete "
            ".npz (zip) archive"
        )
    return np.load(path, allow_pickle=False)


def _skipped_prefixes(header: dict[str, Any], target: Any) -> tuple[str, ...]:
    """Key prefixes of the optional sections ``target`` leaves out (all kept if None)."""
    if target is None:
        return ()
    return tuple(
        jax.tree_util.keystr((jax.tree_util.DictKey(name),))
        for name in header.get("optional_sections", ())
        if not (isinstance(target, Mapping) and name in target)
    )


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[Any]:
    """The open archive; any damage met while reading it becomes CheckpointCorruptedError."""
    try:
        with _open_archive(path) as npz:
            yield npz
    except (FileNotFoundError, CheckpointCorruptedError):
        raise
    except (zipfile.BadZipFile, OSError, EOFError, KeyError, ValueError) as e:
        raise _corrupted(path, e) from e


def _read_archive(path: Path, target: Any = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Reads and checks the file; any damage becomes CheckpointCorruptedError.

    The optional sections ``target`` leaves out are neither read nor checked
    (None: every entry is).
    """
    with _reading(path) as npz:
        header = _header(npz, path)
        skipped = _skipped_prefixes(header, target)
        # Reading every member forces zipfile's CRC check, so a damaged
        # array is detected here rather than half-way through a restore.
        contents = {
            name: npz[name]
            for name in npz.files
            if name != _METADATA_KEY and not name.startswith(skipped)
        }
    return header, contents


def check_readable(path: PathLike) -> Path:
    """Reads every entry of the checkpoint file ``path`` (checking each CRC); returns ``path``.

    Raises:
      FileNotFoundError: there is no such file.
      CheckpointCorruptedError: the file is damaged or not a popmeta checkpoint.
    """
    path = Path(path)
    _read_archive(path)
    return path


def read_checkpoint_metadata(path: PathLike) -> dict[str, Any]:
    """The caller's metadata stored in a checkpoint, plus its ``step``.

    Useful to rebuild the target structure (e.g. from the stored config)
    before calling :func:`load_checkpoint`. Reads only the header entry: the
    arrays are checked when they are loaded.

    Raises:
      CheckpointCorruptedError: if the file is not a readable archive or its
        header is damaged.
    """
    path = Path(path)
    with _reading(path) as npz:
        header = _header(npz, path)
    return {"step": header["step"], **header.get("metadata", {})}


def _restore_leaf(key: str, stored: np.ndarray, target: Any, header: dict, path: Path) -> Any:
    dtype_name = header.get("dtypes", {}).get(key)
    if dtype_name is not None and stored.dtype.name != dtype_name:
        # Extension dtypes (bfloat16, ...) come back from numpy as raw void.
        stored = stored.view(np.dtype(dtype_name))
    expected_shape = getattr(target, "shape", None)

    if _is_prng_key(target):
        impl = header.get("prng_keys", {}).get(key)
        if impl is None:
            raise ValueError(
                f"checkpoint {path}: {key} is a typed PRNG key in the target but was stored "
                "as a plain array"
            )
        # Stored key data has the key array's shape plus the impl's trailing dims.
        if tuple(stored.shape[: len(expected_shape)]) != tuple(expected_shape):
            raise ValueError(
                f"checkpoint {path}: shape mismatch for {key}: expected key array "
                f"{tuple(expected_shape)}, found key data {tuple(stored.shape)}"
            )
        return jax.random.wrap_key_data(stored, impl=impl)

    if isinstance(target, bool | int | float | complex) and not isinstance(target, np.generic):
        if stored.shape != ():
            raise ValueError(
                f"checkpoint {path}: shape mismatch for {key}: expected a scalar, "
                f"found shape {tuple(stored.shape)}"
            )
        return type(target)(stored[()])

    if expected_shape is not None and tuple(stored.shape) != tuple(expected_shape):
        raise ValueError(
            f"checkpoint {path}: shape mismatch for {key}: expected {tuple(expected_shape)}, "
            f"found {tuple(stored.shape)}"
        )
    expected_dtype = getattr(target, "dtype", None)
    if expected_dtype is not None and np.dtype(expected_dtype) != stored.dtype:
        raise ValueError(
            f"checkpoint {path}: dtype mismatch for {key}: expected {np.dtype(expected_dtype)}, "
            f"found {stored.dtype}"
        )
    return stored


def load_checkpoint(path: PathLike, target: Any) -> Checkpoint:
    """Restores a checkpoint into the structure of ``target``.

    Leaves are matched by key path, so ``target`` only needs the same paths,
    shapes and dtypes (its values are ignored; ``jax.ShapeDtypeStruct`` leaves
    work too). Restored array leaves are numpy arrays (place them with
    ``jax.device_put`` and the desired shardings); python-scalar leaves of the
    target come back as the same python type; typed PRNG keys come back as
    typed keys.

    Args:
      path: the checkpoint file.
      target: a pytree with the structure to restore into.

    Returns:
      The restored :class:`Checkpoint`.

    Raises:
      FileNotFoundError: if ``path`` does not exist.
      CheckpointCorruptedError: if the file is damaged or unreadable.
      ValueError: if keys are missing or extra, or shapes / dtypes differ;
        the message names the key and the file.
    """
    path = Path(path)
    header, stored = _read_archive(path, target)
    target_leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    target_keys = [jax.tree_util.keystr(p) for p, _ in target_leaves]

    missing = [k for k in target_keys if k not in stored]
    if missing:
        raise ValueError(
            f"checkpoint {path} has no entry for key {missing[0]}"
            + (f" (and {len(missing) - 1} more missing)" if len(missing) > 1 else "")
        )
    extra = sorted(set(stored) - set(target_keys))
    if extra:
        raise ValueError(
            f"checkpoint {path} has key {extra[0]} that is not in the target"
            + (f" (and {len(extra) - 1} more extra)" if len(extra) > 1 else "")
        )

    restored = [
        _restore_leaf(key, stored[key], leaf, header, path)
        for key, (_, leaf) in zip(target_keys, target_leaves, strict=True)
    ]
    return Checkpoint(
        path=path,
        step=int(header["step"]),
        tree=jax.tree_util.tree_unflatten(treedef, restored),
        metadata=dict(header.get("metadata", {})),
    )
