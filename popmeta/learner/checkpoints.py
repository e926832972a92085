"""Checkpoints: one atomic ``.npz`` file per step, keyed by pytree path.

Format. ``<directory>/ckpt_{step:08d}.npz`` is a plain numpy archive (readable
with ``np.load``, no pickle). Every array leaf of the saved tree is stored
under its key path string, ``jax.tree_util.keystr(path)``, e.g.
``['opt_state'][1][0].mu['w']``, so restoring never depends on leaf order or
on dict insertion order. One extra entry, ``__metadata__``, holds a JSON
document with the step, the format version, the stored dtype of every leaf,
which leaves were typed PRNG keys, and whatever json-able ``metadata`` the
caller passed (resolved config, library versions, ...).

Optional sections. Top-level entries of the tree named in ``optional`` at
save time (e.g. the workers' states, which evaluation does not need) are left
out by a reader whose target does not have them, and not even read from the
file; a target that has one gets it restored as strictly as everything else. Files without the header field
``optional_sections`` have none.

PRNG keys. Typed keys (``jax.random.key``) cannot be written by numpy, so
their raw ``jax.random.key_data`` is stored and the key implementation is
recorded. On load, a leaf whose *target* is a typed key is re-wrapped with
``jax.random.wrap_key_data`` using the target's implementation; a raw uint32
key (``jax.random.PRNGKey``) is just a uint32 array and round-trips as one.

Atomicity. The archive is written to a temporary file in the same directory,
flushed and fsynced, then moved into place with ``os.replace`` (atomic on
POSIX and Windows), and the directory is fsynced. A crash at any point leaves
either the old set of checkpoints or the old set plus the complete new file;
stray temporary files from a killed writer are removed by the next save.
One writer per directory is assumed.

Resume. :func:`restore_latest` tries the newest checkpoint; if it is damaged
(truncated, not a zip, bad CRC, unreadable metadata) it logs a warning naming
the file and tries the previous one. A readable checkpoint whose structure does
not match the target is a user error and raises instead of falling back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = [
    "Checkpoint",
    "CheckpointCorruptedError",
    "checkpoint_path",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_checkpoint_metadata",
    "restore_latest",
    "save_checkpoint",
    "save_tree",
]

logger = logging.getLogger(__name__)

_FORMAT_VERSION = 1
_METADATA_KEY = "__metadata__"
_CKPT_RE = re.compile(r"^ckpt_(\d+)\.npz$")
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
      metadata: the caller's metadata dict given to :func:`save_checkpoint`.
    """

    path: Path
    step: int
    tree: Any
    metadata: dict[str, Any]


def checkpoint_path(directory: PathLike, step: int) -> Path:
    """The file name used for ``step`` in ``directory``."""
    return Path(directory) / f"ckpt_{int(step):08d}.npz"


def checkpoint_step(path: PathLike) -> int:
    """The learner step a checkpoint file holds, from its name ``ckpt_<step>.npz``.

    Raises:
      ValueError: the name is not one :func:`checkpoint_path` writes.
    """
    match = _CKPT_RE.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path}: expected a ckpt_<step>.npz file written by popmeta train")
    return int(match.group(1))


def list_checkpoints(directory: PathLike) -> list[Path]:
    """Checkpoint files in ``directory``, oldest (lowest step) first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [entry for entry in directory.iterdir() if _CKPT_RE.match(entry.name)]
    return sorted((entry for entry in found if entry.is_file()), key=checkpoint_step)


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


def save_checkpoint(
    directory: PathLike,
    step: int,
    tree: Mapping[str, Any],
    keep: int | None = 3,
    metadata: Mapping[str, Any] | None = None,
    optional: tuple[str, ...] = (),
) -> Path:
    """Atomically writes ``tree`` as ``ckpt_{step:08d}.npz`` in ``directory``.

    Args:
      directory: where checkpoints live (created if missing).
      step: the step number; also the file name.
      tree: a dict-rooted pytree (e.g. ``{"params": ..., "opt_state": ...,
        "step": ..., "rng": ...}``). Leaves may be jax/numpy arrays, python
        scalars or typed PRNG keys; ``None`` and empty containers store nothing.
      keep: keep only the newest ``keep`` checkpoints after writing (None keeps
        all).
      metadata: json-able extras (resolved config, versions, ...), returned by
        :func:`load_checkpoint` as ``Checkpoint.metadata``.
      optional: top-level keys of ``tree`` that readers may leave out of their
        target (see the module's docstring).

    Returns:
      The path of the written file.

    Raises:
      TypeError: if ``tree`` is not a mapping or ``metadata`` is not json-able.
      ValueError: if ``keep`` < 1 or ``step`` < 0, or ``optional`` names a
        key that ``tree`` does not have.
    """
    if not isinstance(tree, Mapping):
        raise TypeError(f"checkpoint tree must be a dict, got {type(tree).__name__}")
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 or None, got {keep}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if set(optional) - set(tree):
        raise ValueError(f"optional sections {sorted(set(optional) - set(tree))} are not in tree")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, step)
    save_tree(final, tree, step, metadata, optional)
    if keep is not None:
        for old in list_checkpoints(directory)[:-keep]:
            old.unlink(missing_ok=True)
    return final


def save_tree(
    path: PathLike,
    tree: Mapping[str, Any],
    step: int = 0,
    metadata: Mapping[str, Any] | None = None,
    optional: tuple[str, ...] = (),
) -> Path:
    """Atomically writes ``tree`` to the file ``path`` in the checkpoint format.

    What :func:`save_checkpoint` writes, at a path of the caller's choosing
    (its directory must exist); :func:`load_checkpoint` reads it back. Other
    popmeta files that hold arrays (an exported learned optimizer) use it.

    Returns:
      ``path``.

    Raises:
      TypeError: a leaf is not an array, or ``metadata`` is not json-able.
    """
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
        header_json = json.dumps(header)
    except TypeError as e:
        raise TypeError(f"checkpoint metadata must be json-able: {e}") from e
    arrays[_METADATA_KEY] = np.array(header_json)

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


def _read_archive(path: Path, target: Any = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Reads and checks the file; any damage becomes CheckpointCorruptedError.

    The optional sections ``target`` leaves out are neither read nor checked
    (None: every entry is).
    """
    try:
        with _open_archive(path) as npz:
            header = _header(npz, path)
            skipped = _skipped_prefixes(header, target)
            # Reading every member forces zipfile's CRC check, so a damaged
            # array is detected here rather than half-way through a restore.
            contents = {
                name: npz[name]
                for name in npz.files
                if name != _METADATA_KEY and not name.startswith(skipped)
            }
    except (FileNotFoundError, CheckpointCorruptedError):
        raise
    except (zipfile.BadZipFile, OSError, EOFError, KeyError, ValueError) as e:
        raise _corrupted(path, e) from e
    return header, contents


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
    try:
        with _open_archive(path) as npz:
            header = _header(npz, path)
    except (FileNotFoundError, CheckpointCorruptedError):
        raise
    except (zipfile.BadZipFile, OSError, EOFError, KeyError, ValueError) as e:
        raise _corrupted(path, e) from e
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


def _newest_readable(directory: PathLike, read: Any) -> Any:
    for path in reversed(list_checkpoints(directory)):
        try:
            return read(path)
        except CheckpointCorruptedError as e:
            logger.warning("Skipping damaged checkpoint %s (%s); trying the previous one.", path, e)
        except FileNotFoundError:
            # Deleted between listing and reading (e.g. by keep-last-K).
            continue
    return None


def latest_checkpoint(directory: PathLike) -> Path | None:
    """The newest checkpoint file in ``directory`` that is readable.

    Damaged files are skipped with a logged warning naming them.

    Returns:
      Its path, or None if there is no readable checkpoint.
    """

    def check(path: Path) -> Path:
        _read_archive(path)
        return path

    return _newest_readable(directory, check)


def restore_latest(directory: PathLike, target: Any) -> Checkpoint | None:
    """Restores the newest readable checkpoint in ``directory`` into ``target``.

    A damaged newest checkpoint is reported with a logged warning naming the
    file and the previous one is used instead.

    Returns:
      The restored :class:`Checkpoint`, or None if there is none.

    Raises:
      ValueError: if a readable checkpoint does not match ``target``.
    """
    return _newest_readable(directory, lambda path: load_checkpoint(path, target))
