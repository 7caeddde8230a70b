"""Reading a checkpoint's ``.metadata`` without trusting it.

A checkpoint directory may come from elsewhere (a shared filesystem, a download), so
nothing in it is allowed to name a path outside it or to run code on load:

- ``.metadata`` (the pickled DCP ``Metadata``) is read with a restricted unpickler
  that resolves only the classes DCP metadata is made of (the "Restricting Globals"
  recipe of Python's :mod:`pickle` documentation); anything else is refused.
- Every ``_StorageInfo.relative_path`` must be a plain file name (no separator, not
  ``.``/``..``, not absolute, no NUL) of a regular file (not a symlink) in the
  directory, and every record must lie inside its file. Files are opened relative to
  a descriptor of the directory with ``O_NOFOLLOW`` (:class:`asyncckpt.io.storage.Storage`),
  so a symlink swapped in later is refused too.

The data files are read by :mod:`asyncckpt.loading.dcp` (DCP's load path) and
:mod:`asyncckpt.loading.direct` (the direct path).
"""

from __future__ import annotations

import collections
import io
import os
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from asyncckpt._gc import gc_paused
from asyncckpt.errors import CheckpointError, CorruptCheckpointError
from asyncckpt.format.manifest import METADATA_NAME, is_plain_name
from asyncckpt.io.storage import LOCAL, CheckpointReader, ReadableStorage

__all__ = ["METADATA_NAME", "check_file_name", "validate_metadata", "read_metadata"]

_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    **{
        ("torch.distributed.checkpoint.metadata", name): getattr(_md, name)
        for name in (
            "Metadata",
            "StorageMeta",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    # Stock DCP records StorageMeta.checkpoint_id as a Path.
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
}


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals DCP metadata is made of.

    Allowed: the classes of ``torch.distributed.checkpoint.metadata``,
    ``filesystem._StorageInfo``, ``torch.Size``, the ``torch`` dtypes,
    ``torch.serialization._get_layout``, ``collections.OrderedDict``, ``set``,
    ``frozenset`` and ``pathlib.PosixPath``. Source: "Restricting Globals" in the
    documentation of Python's :mod:`pickle`.
    """

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED_GLOBALS.get((module, name))
        if allowed is not None:
            return allowed
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in checkpoint metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed in checkpoint metadata")


def check_file_name(name: Any, where: str) -> str:
    """Return ``name`` if it is a plain file name (see
    :func:`asyncckpt.format.manifest.is_plain_name`): joined to a directory, it names an
    entry of that directory and nothing else.

    Args:
        name: the candidate (from a manifest or metadata).
        where: the file naming it (for the message).

    Raises:
        CorruptCheckpointError: ``name`` is not a plain file name.
    """
    if not is_plain_name(name):
        raise CorruptCheckpointError(f"{where} names a file outside the checkpoint directory: {name!r}", where)
    return name


def validate_metadata(metadata: Any, path: str) -> Metadata:
    """``metadata`` if it is DCP ``Metadata`` whose every entry is well-formed and names a
    plain file name (``path``: where it was read, for the messages).

    Raises:
        CorruptCheckpointError: naming the first malformed entry.
    """
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{path} does not hold DCP Metadata (found {type(metadata).__name__})", path)
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        raise CorruptCheckpointError(f"{path}: state_dict_metadata and storage_data must be dicts", path)
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(fqn, str) or not isinstance(md, (_md.TensorStorageMetadata, _md.BytesStorageMetadata)):
            raise CorruptCheckpointError(f"{path}: malformed entry {fqn!r} in state_dict_metadata", path)
    names: set[str] = set()  # checked once each (a few files for thousands of entries)
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CorruptCheckpointError(f"{path}: malformed storage_data entry {index!r}", path)
        name = info.relative_path
        if type(name) is not str or name not in names:
            names.add(check_file_name(name, path))
        if not isinstance(info.offset, int) or not isinstance(info.length, int) or info.offset < 0 or info.length < 0:
            raise CorruptCheckpointError(f"{path}: entry {index.fqn!r} has a bad offset or length", path)
        descriptors = info.transform_descriptors
        if descriptors is not None and (
            not isinstance(descriptors, (list, tuple)) or not all(isinstance(d, str) for d in descriptors)
        ):
            raise CorruptCheckpointError(f"{path}: entry {index.fqn!r} has malformed transform descriptors", path)
    return metadata


def _check_data_files(metadata: Metadata, checkpoint: CheckpointReader) -> None:
    """Every record lies in a regular file (not a symlink) of the checkpoint."""
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        if end > ends.get(info.relative_path, -1):
            ends[info.relative_path] = end
    for name, end in sorted(ends.items()):
        path = os.path.join(checkpoint.root, name)
        size = checkpoint.file_size(name)
        if size is None:
            raise CorruptCheckpointError(f"{path} is missing (named by {METADATA_NAME})", path)
        if end > size:
            raise CorruptCheckpointError(
                f"{path} has {size} bytes but {METADATA_NAME} places a record up to byte {end}", path
            )


def read_metadata(checkpoint_dir: str | os.PathLike, storage: ReadableStorage = LOCAL) -> Metadata:
    """Read and check the DCP ``.metadata`` of a checkpoint directory, safely.

    Unpickles with an allowlist of DCP metadata classes, then checks that every
    ``storage_data`` entry names a plain file name of a regular file (not a symlink)
    inside ``checkpoint_dir`` and lies within that file.

    Args:
        checkpoint_dir: the checkpoint directory.
        storage: the tier it is read from.

    Returns:
        The metadata.

    Raises:
        CorruptCheckpointError: ``.metadata`` is missing, a symlink, unreadable, holds
            a disallowed global, or names a path outside the directory, a symlink, a
            missing file, or bytes past the end of a file.
    """
    root = os.fspath(checkpoint_dir)
    path = os.path.join(root, METADATA_NAME)
    with storage.open_checkpoint(root) as checkpoint:
        data = checkpoint.read_bytes(METADATA_NAME)
        try:
            with gc_paused():
                metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except CheckpointError:
            raise
        except Exception as exc:
            raise CorruptCheckpointError(f"{path} cannot be read safely: {type(exc).__name__}: {exc}", path) from exc
        del data
        validate_metadata(metadata, path)
        _check_data_files(metadata, checkpoint)
    return metadata
