"""Read a whole checkpoint into a new nested dict, without a template.

``asyncckpt.load`` (like ``torch.distributed.checkpoint.load``) fills a state_dict the
caller already has. :func:`read_state_dict` needs none: like ``torch.load`` it returns
a new structure, rebuilt from the checkpoint's DCP metadata (the idea of DCP's
``_load_state_dict_from_keys`` and ``format_utils.dcp_to_torch_save``), with the
checks of ``asyncckpt.load``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException as _DcpCheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from ._check import check_path
from .errors import CheckpointNotFoundError, CheckpointPathError, CorruptCheckpointError
from .loading import from_dcp_exception
from .root import is_in_root
from .storage import commit as _commit
from .storage.reader import SafeFileSystemReader, SafeLoadPlanner

__all__ = ["read_state_dict"]

_UNSET = object()  # a list slot not filled (yet)


def _entry_path(fqn: str, planner_data: Any, limit: int, where: str) -> tuple[str | int, ...]:
    """The nested path of entry ``fqn`` (``Metadata.planner_data``), checked: a non-empty
    tuple of ``str`` keys and list indices below ``limit``, starting with a ``str``."""
    path = planner_data.get(fqn) if isinstance(planner_data, dict) else None
    if path is None:
        return (fqn,)
    if (not isinstance(path, (tuple, list)) or not path or not isinstance(path[0], str)
            or not all(isinstance(p, str) or (type(p) is int and 0 <= p < limit) for p in path)):
        raise CorruptCheckpointError(f"{where}: malformed planner_data for entry {fqn!r}: {path!r}", where)
    return tuple(path)


def _place(root: dict[str, Any], path: tuple[str | int, ...], value: Any, fqn: str, where: str) -> None:
    """Put ``value`` at ``path`` in ``root``, creating dicts (``str`` keys) and lists
    (``int`` indices) on the way, as DCP's ``set_element`` does, but refusing a path
    that runs through a value or lands on an entry already placed."""

    def bad() -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{where}: planner_data is inconsistent at entry {fqn!r} (path {path!r})", where)

    container: Any = root
    for depth, key in enumerate(path):
        last = depth == len(path) - 1
        if isinstance(container, dict):
            if not isinstance(key, str):
                raise bad()
            current = container.get(key, _UNSET)
        else:
            if type(key) is not int:
                raise bad()
            if len(container) <= key:
                container.extend([_UNSET] * (key + 1 - len(container)))
            current = container[key]
        if last:
            if current is not _UNSET:
                raise bad()
            container[key] = value
            return
        if current is _UNSET:
            current = {} if isinstance(path[depth + 1], str) else []
            container[key] = current
        elif not isinstance(current, dict if isinstance(path[depth + 1], str) else list):
            raise bad()
        container = current


def _fill_holes(value: Any) -> None:
    """Replace the list slots that no entry filled with ``None`` (as ``set_element`` does)."""
    stack = [value]
    while stack:
        item = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if isinstance(item, list):
            for i, child in enumerate(item):
                if child is _UNSET:
                    item[i] = None
        for child in children:
            if isinstance(child, (dict, list)):
                stack.append(child)


def _nest(flat: dict[str, Any], metadata: Metadata, where: str) -> dict[str, Any]:
    limit = len(metadata.state_dict_metadata)
    out: dict[str, Any] = {}
    for fqn, value in flat.items():
        _place(out, _entry_path(fqn, metadata.planner_data, limit, where), value, fqn, where)
    _fill_holes(out)
    return out


def read_state_dict(checkpoint_dir: str | os.PathLike, *, verify: bool = True,
                    allow_pickle: bool = False) -> dict[str, Any]:
    """Read a whole checkpoint into a new nested dict, like ``torch.load`` does for a file.

    No template is needed: the structure is rebuilt from the DCP metadata, as
    ``torch.distributed.checkpoint``'s ``_load_state_dict_from_keys`` (and
    ``format_utils.dcp_to_torch_save``) do. Tensors come back whole (unsharded, with
    the global shape recorded in the metadata: the shards of every rank are assembled)
    on the CPU; non-tensor values are decoded; the nesting that DCP flattened into
    dotted keys is restored from the metadata's ``planner_data`` (dict keys are
    strings, as DCP records them; lists holding tensors come back as lists; tuples,
    sets and other values as saved). Works on asyncckpt checkpoints and on any
    directory written by ``torch.distributed.checkpoint.save`` to a filesystem.

    It reads in this process alone, whether or not ``torch.distributed`` is
    initialized (no collective is issued; every tensor is read in full, so the
    process needs memory for the whole checkpoint).

    The checkpoint is not trusted, as in :func:`asyncckpt.load`: ``.metadata`` is
    unpickled with an allowlist of DCP metadata classes, every file it (or the
    manifest) names must be a plain file name of a regular file inside
    ``checkpoint_dir``, and non-tensor values load with ``torch.load(weights_only=True)``
    semantics unless ``allow_pickle``.

    Args:
        checkpoint_dir: a checkpoint directory: committed by asyncckpt (it has a
            ``.manifest.json``), or a stock DCP directory (no manifest; a step of an
            asyncckpt root without one is corrupt, see :func:`asyncckpt.root.is_in_root`).
        verify: check the sizes and CRC-32 checksums of every file against the
            manifest before reading. A stock DCP directory has no manifest: it is read
            without that check and a ``UserWarning`` says so (not with
            ``verify=False``).
        allow_pickle: unpickle non-tensor values of any class (stock DCP's
            ``weights_only=False``). Unpickling runs code chosen by whoever wrote the
            checkpoint: pass ``True`` only for checkpoints you trust. To allow a few
            classes instead, use ``torch.serialization.safe_globals([...])``.

    Returns:
        A new dict: the saved state_dict, with CPU tensors of the saved dtypes and
        global shapes (each tensor has its own memory, ``numel * itemsize`` bytes).

    Raises:
        CheckpointNotFoundError: (a ``FileNotFoundError``) ``checkpoint_dir`` does not
            exist.
        CheckpointPathError: (a ``NotADirectoryError``) ``checkpoint_dir`` is not a
            directory.
        InvalidArgumentError: ``checkpoint_dir`` is not a path.
        CorruptCheckpointError: ``.metadata`` is missing, unreadable or holds a
            disallowed global; a file is missing or does not match the manifest (with
            ``verify``); the metadata or the manifest names a path outside the
            directory or a symlink; ``planner_data`` is inconsistent.
        CheckpointError: a non-tensor value needs ``allow_pickle=True`` (its entry is
            named).
    """
    path = Path(check_path(checkpoint_dir))
    if not path.exists():
        raise CheckpointNotFoundError("no such checkpoint directory", str(path))
    if not path.is_dir():
        raise CheckpointPathError.of(20, "not a checkpoint directory", path)  # errno.ENOTDIR
    reader = SafeFileSystemReader(str(path))
    if os.path.lexists(path / _commit.MANIFEST_NAME):
        manifest = (_commit.verify_checkpoint(path) if verify  # also refuses names outside the directory
                    else _commit.read_manifest(path))
        reader.check_manifest(manifest["files"])  # reads and checks .metadata
    elif is_in_root(path):  # a step of an asyncckpt root that lost its manifest: ours, damaged
        _commit.read_manifest(path)  # raises CorruptCheckpointError (missing)
    elif verify:
        warnings.warn(f"{path} has no {_commit.MANIFEST_NAME} (a stock torch.distributed.checkpoint "
                      "directory?): its checksums were not verified", UserWarning, stacklevel=2)
    metadata = reader.read_metadata()
    where = str(path / _commit.METADATA_NAME)

    # One destination per entry, keyed by its flat FQN (what DCP's planner matches).
    flat: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            flat[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        else:
            flat[fqn] = None  # replaced by the decoded value
    planner = SafeLoadPlanner(allow_pickle=allow_pickle, flatten_state_dict=False, flatten_sharded_tensors=False)
    try:
        # no_dist: this process alone, even when a process group exists (the other
        # ranks are not reading with us).
        _load_state_dict(flat, storage_reader=reader, planner=planner, no_dist=True)
    except _DcpCheckpointException as exc:
        raise from_dcp_exception(exc, path) from exc
    return _nest(planner.state_dict, metadata, where)
