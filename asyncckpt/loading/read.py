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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.api import (
    CheckpointException as _DcpCheckpointException,
)
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from asyncckpt._check import check_path, int_key
from asyncckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    RemoteStorageError,
)
from asyncckpt.format.manifest import MANIFEST_NAME, METADATA_NAME
from asyncckpt.format.records import RECORDS_NAME
from asyncckpt.io import s3 as _s3
from asyncckpt.io.storage import LOCAL
from asyncckpt.loading.api import from_dcp_exception, not_a_directory
from asyncckpt.loading.dcp import SafeFileSystemReader, SafeLoadPlanner
from asyncckpt.loading.hf import is_hf_dir, read_hf_state_dict
from asyncckpt.root import is_in_root

__all__ = ["read_state_dict"]

_UNSET = object()  # a list slot not filled (yet)


def _entry_path(fqn: str, planner_data: Any, limit: int, where: str) -> tuple[str | int, ...]:
    """The nested path of entry ``fqn`` (``Metadata.planner_data``), checked: a non-empty
    tuple of ``str`` keys and list indices below ``limit``, starting with a ``str``."""
    path = planner_data.get(fqn) if isinstance(planner_data, dict) else None
    if path is None:
        return (fqn,)
    if (
        not isinstance(path, (tuple, list))
        or not path
        or not isinstance(path[0], str)
        or not all(isinstance(p, str) or (type(p) is int and 0 <= p < limit) for p in path)
    ):
        raise CorruptCheckpointError(f"{where}: malformed planner_data for entry {fqn!r}: {path!r}", where)
    return tuple(path)


def manifest_int_keys(manifest: Mapping[str, Any] | None, where: str) -> dict[str, frozenset[int]]:
    """The manifest's ``int_keys`` (entry -> the positions of its ``planner_data`` path
    that were ``int`` dict keys; DCP records ``str(key)``), checked; ``{}`` without one.

    Raises:
        CorruptCheckpointError: ``int_keys`` is not a dict of lists of distinct
            non-negative ints.
    """
    found = manifest.get("int_keys") if manifest is not None else None
    if found is None:
        return {}
    out: dict[str, frozenset[int]] = {}
    if type(found) is dict:
        for fqn, positions in found.items():
            if (
                type(positions) is not list
                or not positions
                or not all(type(i) is int and 0 <= i for i in positions)
                or len(set(positions)) != len(positions)
            ):
                break
            out[fqn] = frozenset(positions)
        else:
            return out
    raise CorruptCheckpointError(f"{where}: malformed int_keys in the manifest", where)


def typed_entry_paths(
    metadata: Metadata, int_keys: Mapping[str, frozenset[int]], where: str
) -> dict[str, tuple[tuple[str | int, ...], frozenset[int]]]:
    """Every entry's nested path, with its keys of the types they were saved with: each
    entry's ``planner_data`` path (DCP's: ``str`` dict keys, ``int`` list indices) with
    the ``str`` keys at the positions ``int_keys`` names turned back into ``int``; and
    those positions (where an ``int`` is a dict key, not a list index).

    Raises:
        CorruptCheckpointError: a path is malformed; ``int_keys`` names an entry the
            metadata does not have, or a position that is not the ``str`` of an int.
    """
    limit = len(metadata.state_dict_metadata)
    unknown = set(int_keys) - set(metadata.state_dict_metadata)
    if unknown:
        raise CorruptCheckpointError(
            f"{where}: the manifest's int_keys names {sorted(unknown)[0]!r}, an entry the metadata does not have", where
        )
    out: dict[str, tuple[tuple[str | int, ...], frozenset[int]]] = {}
    for fqn in metadata.state_dict_metadata:
        path = _entry_path(fqn, metadata.planner_data, limit, where)
        ints = int_keys.get(fqn, frozenset())
        if ints:
            typed = list(path)
            for i in ints:
                item = typed[i] if i < len(typed) else None
                value = int_key(item) if isinstance(item, str) else None
                if value is None:
                    raise CorruptCheckpointError(
                        f"{where}: the manifest's int_keys for entry {fqn!r} does not fit its path {path!r}", where
                    )
                typed[i] = value
            path = tuple(typed)
        out[fqn] = (path, ints)
    return out


def _place(
    root: dict[str, Any], path: tuple[str | int, ...], ints: frozenset[int], value: Any, fqn: str, where: str
) -> None:
    """Put ``value`` at ``path`` in ``root``, creating dicts (``str`` keys, and ``int``
    keys at the positions ``ints``) and lists (other ``int`` indices) on the way, as
    DCP's ``set_element`` does, but refusing a path that runs through a value or lands
    on an entry already placed."""

    def bad() -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: planner_data is inconsistent at entry {fqn!r} (path {path!r})", where)

    def is_key(depth: int) -> bool:  # path[depth] is a dict key (not a list index)
        return isinstance(path[depth], str) or depth in ints

    container: Any = root
    for depth, key in enumerate(path):
        last = depth == len(path) - 1
        if isinstance(container, dict):
            if not is_key(depth):
                raise bad()
            current = container.get(key, _UNSET)
        else:
            if is_key(depth) or not isinstance(key, int):
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
            current = {} if is_key(depth + 1) else []
            container[key] = current
        elif not isinstance(current, dict if is_key(depth + 1) else list):
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


def _nest(
    flat: dict[str, Any], metadata: Metadata, int_keys: Mapping[str, frozenset[int]], where: str
) -> dict[str, Any]:
    paths = typed_entry_paths(metadata, int_keys, where)
    out: dict[str, Any] = {}
    for fqn, value in flat.items():
        path, ints = paths[fqn]
        _place(out, path, ints, value, fqn, where)
    _fill_holes(out)
    return out


def read_state_dict(
    checkpoint_dir: str | os.PathLike,
    *,
    verify: bool | Literal["inline"] = True,
    allow_pickle: bool = False,
    strip_prefix: str | None = None,
    rename: Callable[[str], str | None] | None = None,
) -> dict[str, Any]:
    """Read a whole checkpoint into a new nested dict, like ``torch.load`` does for a file.

    No template is needed: the structure is rebuilt from the DCP metadata, as
    ``torch.distributed.checkpoint``'s ``_load_state_dict_from_keys`` (and
    ``format_utils.dcp_to_torch_save``) do. Tensors come back whole (unsharded, with
    the global shape recorded in the metadata: the shards of every rank are assembled)
    on the CPU; non-tensor values are decoded; the nesting that DCP flattened into
    dotted keys is restored from the metadata's ``planner_data`` (lists holding
    tensors come back as lists; tuples, sets and other values as saved). Dict keys come
    back with their types, as from ``torch.load``: DCP records every key as ``str(key)``,
    and an asyncckpt manifest records which were ``int`` (an optimizer's ``state`` is
    keyed by parameter index), so ``{0: ...}`` is read back as ``{0: ...}``; a stock DCP
    directory (no manifest) gives ``str`` keys, as DCP's ``dcp_to_torch_save`` does.
    Works on asyncckpt checkpoints and on any directory written by
    ``torch.distributed.checkpoint.save`` to a filesystem. A Hugging Face safetensors
    directory (``model.safetensors``, or ``model.safetensors.index.json`` and its
    shards) gives a flat dict of its tensors by name (after ``strip_prefix`` and
    ``rename``), its index and headers checked (:mod:`asyncckpt.loading.hf`; no pickle,
    no checksums in that format).

    It reads in this process alone, whether or not ``torch.distributed`` is
    initialized (no collective is issued; every tensor is read in full, so the
    process needs memory for the whole checkpoint).

    The checkpoint is not trusted, as in :func:`asyncckpt.load`: ``.metadata`` is
    unpickled with an allowlist of DCP metadata classes, every file it (or the
    manifest) names must be a plain file name of a regular file inside
    ``checkpoint_dir``, and non-tensor values load with ``torch.load(weights_only=True)``
    semantics unless ``allow_pickle``.

    Args:
        checkpoint_dir: an ``s3://bucket/prefix/step_N`` URL (its objects read with
            ranged GETs in parallel, windows of records at a time, nothing on disk:
            :class:`asyncckpt.io.s3.S3Checkpoint`; with ``verify``, every segment's
            CRC-32 is checked as it arrives, before anything is returned), or a checkpoint
            directory: committed by asyncckpt (it has a
            ``.manifest.json``), or a stock DCP directory (no manifest; a step of an
            asyncckpt root without one is corrupt, see :func:`asyncckpt.root.is_in_root`).
        verify: check the sizes and CRC-32 checksums of every file against the
            manifest before reading. A stock DCP directory has no manifest: it is read
            without that check and a ``UserWarning`` says so (not with
            ``verify=False``). ``"inline"`` (``load``'s default) is accepted and
            checks the same way, before reading; any other value is refused.
        allow_pickle: unpickle non-tensor values of any class (stock DCP's
            ``weights_only=False``). Unpickling runs code chosen by whoever wrote the
            checkpoint: pass ``True`` only for checkpoints you trust. To allow a few
            classes instead, use ``torch.serialization.safe_globals([...])``.
        strip_prefix: (a safetensors directory only) removed from the start of the
            tensor names that have it.
        rename: (a safetensors directory only) ``rename(name) -> name | None``
            (``None``: leave that tensor out), after ``strip_prefix``.

    Returns:
        A new dict: the saved state_dict, with CPU tensors of the saved dtypes and
        global shapes (each tensor has its own memory, ``numel * itemsize`` bytes).

    Raises:
        CheckpointNotFoundError: (a ``FileNotFoundError``) ``checkpoint_dir`` does not
            exist.
        CheckpointPathError: (a ``NotADirectoryError``) ``checkpoint_dir`` is not a
            directory.
        InvalidArgumentError: ``checkpoint_dir`` is not a path, or ``verify`` is not
            ``True``, ``False`` or ``"inline"`` (as :func:`asyncckpt.load`).
        CorruptCheckpointError: ``.metadata`` is missing, unreadable or holds a
            disallowed global; a file is missing or does not match the manifest (with
            ``verify``); the metadata or the manifest names a path outside the
            directory or a symlink; ``planner_data`` (or the manifest's ``int_keys``)
            is inconsistent.
        CheckpointError: a non-tensor value needs ``allow_pickle=True`` (its entry is
            named).
    """
    if _s3.is_url(checkpoint_dir):
        if verify not in (True, False, "inline"):
            raise InvalidArgumentError(f"verify must be True, False or 'inline', not {verify!r}")
        with _s3.open_url(str(checkpoint_dir)) as remote:
            listed = remote.read_manifest()
            url_reader = SafeFileSystemReader(remote.root, storage=remote)
            if verify:  # the small files now; every segment of the data as it is read
                remote.verify(names=[n for n in (METADATA_NAME, RECORDS_NAME) if n in listed["files"]])
                url_reader.inline_files = listed["files"]
            url_reader.check_manifest(listed["files"])  # reads and checks .metadata
            return _read(url_reader, listed, remote.root, allow_pickle)
    path = Path(check_path(checkpoint_dir))
    if verify not in (True, False, "inline"):
        raise InvalidArgumentError(f"verify must be True, False or 'inline', not {verify!r}")
    if not path.exists():
        raise CheckpointNotFoundError("no such checkpoint directory", str(path))
    if not path.is_dir():
        raise not_a_directory(path)  # the same error as load and verify
    if is_hf_dir(path):
        return dict(read_hf_state_dict(path, strip_prefix=strip_prefix, rename=rename))
    if strip_prefix is not None or rename is not None:
        raise InvalidArgumentError(f"strip_prefix and rename are for a safetensors directory; {path} is not one")
    reader = SafeFileSystemReader(str(path), storage=LOCAL)
    manifest: dict[str, Any] | None = None
    if LOCAL.exists(path, MANIFEST_NAME):
        manifest = (
            LOCAL.verify(path)
            if verify  # also refuses names outside the directory
            else LOCAL.read_manifest(path)
        )
        reader.check_manifest(manifest["files"])  # reads and checks .metadata
    elif is_in_root(path):  # a step of an asyncckpt root that lost its manifest: ours, damaged
        LOCAL.read_manifest(path)  # raises CorruptCheckpointError (missing)
    elif verify:
        warnings.warn(
            f"{path} has no {MANIFEST_NAME} (a stock torch.distributed.checkpoint "
            "directory?): its checksums were not verified",
            UserWarning,
            stacklevel=2,
        )
    return _read(reader, manifest, str(path), allow_pickle)


def _read(
    reader: SafeFileSystemReader, manifest: dict[str, Any] | None, root: str, allow_pickle: bool
) -> dict[str, Any]:
    """:func:`read_state_dict` of a checked checkpoint, read through ``reader``."""
    metadata = reader.read_metadata()
    where = os.path.join(root, METADATA_NAME)
    int_keys = manifest_int_keys(manifest, os.path.join(root, MANIFEST_NAME))

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
        if _s3.is_url(root):  # a remote object gone, a request failed: as they are
            for _, (cause, _tb) in sorted(exc.failures.items()):
                if isinstance(cause, (CheckpointNotFoundError, RemoteStorageError)):
                    raise cause from exc
        raise from_dcp_exception(exc, root) from exc
    return _nest(planner.state_dict, metadata, int_keys, where)
