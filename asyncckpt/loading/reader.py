"""The load side: read a committed checkpoint without trusting its bytes.

A checkpoint directory may come from elsewhere (a shared filesystem, a download), so
nothing in it is allowed to name a path outside it or to run code on load:

- ``.metadata`` (the pickled DCP ``Metadata``) is read with a restricted unpickler
  that resolves only the classes DCP metadata is made of (the "Restricting Globals"
  recipe of Python's :mod:`pickle` documentation); anything else is refused.
- Every ``_StorageInfo.relative_path`` must be a plain file name (no separator, not
  ``.``/``..``, not absolute, no NUL) of a regular file (not a symlink) in the
  directory, and every record must lie inside its file. Files are opened relative to
  a descriptor of the directory with ``O_NOFOLLOW``, so a symlink swapped in later is
  refused too.
- Non-tensor values (``BYTE_IO`` items) are unpickled with ``torch.load(...,
  weights_only=True)`` unless the caller opts in (``allow_pickle=True``); stock DCP's
  ``DefaultLoadPlanner.load_bytes`` uses ``weights_only=False``. They are all decoded
  before any tensor of the state_dict is written, so a refused value leaves the
  state_dict unchanged.

Tensor records written by our writer (``asyncckpt.format.layout``: one fixed
``torch.save`` framing per dtype and shape, the zip64 one for records of 4 GiB and
more) are recognised byte for byte and their raw bytes copied directly, without a
``torch.load`` per tensor; any other record is read with ``torch.load(...,
weights_only=True)`` as DCP's ``FileSystemReader`` does, streamed from the file (no
copy of the whole record in memory). Data integrity is the manifest's job
(``verify_checkpoint``), not this module's, except in :func:`direct_load` given the
manifest, which checks the CRC-32 of each manifest segment it reads.

:func:`plan_direct_load` and :func:`direct_load` are the direct path of
``asyncckpt.load`` for the common case (the state_dict has the checkpoint's keys,
dtypes and shapes): no DCP load planning, few large ``preadv`` calls straight into
the target tensors. It finds the records in ``.records.json``
(:mod:`asyncckpt.format.records`, :meth:`SafeFileSystemReader.read_records`) when that
file stands for the ``.metadata`` in the directory, without unpickling anything.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import gc
import io
import os
import pathlib
import pickle
import stat
import warnings
from typing import Any, Iterable, Iterator, Mapping, NamedTuple

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.futures import Future

from asyncckpt._check import int_key
from asyncckpt.errors import CheckpointError, CorruptCheckpointError
from asyncckpt.format.crc import CrcChain, crc32
from asyncckpt.format.layout import record_framing
from asyncckpt.format.manifest import METADATA_NAME, is_plain_name, run_in_order
from asyncckpt.format.records import (
    RECORDS_NAME,
    Record,
    parse_records,
    records_from_metadata,
)
from asyncckpt.format.torchsave import TensorFraming

__all__ = [
    "METADATA_NAME",
    "check_file_name",
    "read_metadata",
    "SafeLoadPlanner",
    "SafeFileSystemReader",
    "DirectPlan",
    "plan_direct_load",
    "direct_load",
]

#: Records up to this size are read with one ``pread``; larger ones in three.
_SMALL_RECORD_BYTES = 1 << 20
#: Records with at least this many data bytes are read straight into the destination.
_DIRECT_READ_BYTES = 64 << 10

# ----------------------------------------------------------------------------- metadata
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    **{("torch.distributed.checkpoint.metadata", name): getattr(_md, name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")},
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


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while building many small objects (a metadata
    of thousands of entries otherwise triggers several full collections, a tenth of a
    second each with a large heap). Only re-enabled if it was on; nested uses leave it
    to the outermost. Objects freed before the end never count towards a collection
    (CPython counts an allocation up and its deallocation down)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


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


def _open_dir(root: str) -> int:
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{root} does not exist", root) from None
    except OSError as exc:
        raise CorruptCheckpointError(f"{root} cannot be opened as a directory: {exc}", root) from exc


def _open_member(dir_fd: int, root: str, name: str) -> int:
    """Open the regular file ``name`` of the directory ``dir_fd``, never through a symlink."""
    path = os.path.join(root, name)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing", path) from None
    except OSError as exc:
        if os.path.islink(path):
            raise CorruptCheckpointError(f"{path} is a symlink; checkpoint files must be regular files",
                                         path) from None
        raise CorruptCheckpointError(f"{path} cannot be opened: {exc}", path) from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpointError(f"{path} is not a regular file", path)
    return fd


def _pread_into(fd: int, buf: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise CorruptCheckpointError(f"{path} is truncated (a record ends past the end of the file)", path)
        done += n


class _RecordStream(io.RawIOBase):
    """``length`` bytes of ``fd`` from ``offset``, as a seekable binary stream.

    ``torch.load`` reads a record that is not ours from it, as DCP's reader does from
    its file view: positioned reads (the descriptor is shared by the records of one
    file), storages read straight into their memory by ``readinto``. ``readinto``
    fills the whole buffer unless the record ends (one ``preadv`` moves at most
    2 GiB).
    """

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self._fd, self._offset, self._length, self._pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        if base + pos < 0:
            raise ValueError(f"negative seek position {base + pos}")
        self._pos = base + pos
        return self._pos

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        want = max(0, min(len(view), self._length - self._pos))
        done = 0
        while done < want:
            n = os.preadv(self._fd, [view[done:want]], self._offset + self._pos + done)
            if n <= 0:
                break  # the file ends inside the record: torch.load fails on the short read
            done += n
        self._pos += done
        return done


def _pread(fd: int, length: int, offset: int, path: str) -> bytearray:
    buf = bytearray(length)
    _pread_into(fd, memoryview(buf), offset, path)
    return buf


def _validate_metadata(metadata: Any, path: str) -> Metadata:
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
        if (not isinstance(info.offset, int) or not isinstance(info.length, int)
                or info.offset < 0 or info.length < 0):
            raise CorruptCheckpointError(f"{path}: entry {index.fqn!r} has a bad offset or length", path)
        descriptors = info.transform_descriptors
        if descriptors is not None and (not isinstance(descriptors, (list, tuple))
                                        or not all(isinstance(d, str) for d in descriptors)):
            raise CorruptCheckpointError(f"{path}: entry {index.fqn!r} has malformed transform descriptors", path)
    return metadata


def _check_data_files(metadata: Metadata, root: str, dir_fd: int) -> None:
    """Every record lies in a regular file (not a symlink) of the directory ``root``."""
    real_root = os.path.realpath(root)
    ends: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        end = info.offset + info.length
        if end > ends.get(info.relative_path, -1):
            ends[info.relative_path] = end
    for name, end in sorted(ends.items()):
        path = os.path.join(root, name)
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path} is missing (named by {METADATA_NAME})", path) from None
        if stat.S_ISLNK(st.st_mode):
            raise CorruptCheckpointError(f"{path} is a symlink; checkpoint files must be regular files", path)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(f"{path} is not a regular file", path)
        if os.path.dirname(os.path.realpath(os.path.join(real_root, name))) != real_root:
            raise CorruptCheckpointError(f"{path} resolves outside the checkpoint directory", path)
        if end > st.st_size:
            raise CorruptCheckpointError(
                f"{path} has {st.st_size} bytes but {METADATA_NAME} places a record up to byte {end}", path)


def read_metadata(checkpoint_dir: str | os.PathLike) -> Metadata:
    """Read and check the DCP ``.metadata`` of a checkpoint directory, safely.

    Unpickles with an allowlist of DCP metadata classes, then checks that every
    ``storage_data`` entry names a plain file name of a regular file (not a symlink)
    inside ``checkpoint_dir`` and lies within that file.

    Args:
        checkpoint_dir: the checkpoint directory.

    Returns:
        The metadata.

    Raises:
        CorruptCheckpointError: ``.metadata`` is missing, a symlink, unreadable, holds
            a disallowed global, or names a path outside the directory, a symlink, a
            missing file, or bytes past the end of a file.
    """
    root = os.fspath(checkpoint_dir)
    path = os.path.join(root, METADATA_NAME)
    dir_fd = _open_dir(root)
    try:
        fd = _open_member(dir_fd, root, METADATA_NAME)
        try:
            with open(fd, "rb", closefd=False) as f, gc_paused():
                metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        except CheckpointError:
            raise
        except Exception as exc:
            raise CorruptCheckpointError(f"{path} cannot be read safely: {type(exc).__name__}: {exc}",
                                         path) from exc
        finally:
            os.close(fd)
        _validate_metadata(metadata, path)
        _check_data_files(metadata, root, dir_fd)
    finally:
        os.close(dir_fd)
    return metadata


# ----------------------------------------------------------------------------- planner
def _weights_only_reason(exc: BaseException) -> str:
    text = str(exc)
    for line in text.splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip()
    return text.splitlines()[0] if text else type(exc).__name__


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor values load with ``weights_only=True``.

    Stock ``DefaultLoadPlanner.load_bytes`` calls ``torch.load(..., weights_only=False)``,
    which runs arbitrary code from a crafted checkpoint. Here values are restricted
    to what ``torch.load(weights_only=True)`` accepts (tensors, ``int``, ``float``,
    ``str``, ``bytes``, ``None``, ``complex``, ``list``, ``tuple``, ``dict``, ``set``,
    ``OrderedDict``, ``torch.Size``, dtypes, devices, and classes allowlisted with
    ``torch.serialization.safe_globals``), unless ``allow_pickle=True``.

    Args:
        allow_pickle: unpickle arbitrary objects (only for trusted checkpoints).
        **kwargs: passed to ``DefaultLoadPlanner``.
    """

    def __init__(self, *, allow_pickle: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.allow_pickle = allow_pickle

    def decode_bytes(self, read_item: ReadItem, value: io.BytesIO) -> Any:
        """Unpickle one non-tensor value.

        Raises:
            CheckpointError: the value needs unpickling beyond ``weights_only`` and
                ``allow_pickle`` is false (naming the entry).
            CorruptCheckpointError: the bytes are not a ``torch.save`` archive.
        """
        return self.decode_value(read_item.dest_index.fqn, value)

    def decode_value(self, fqn: str, value: io.BytesIO) -> Any:
        """Unpickle the non-tensor value of entry ``fqn`` (see :meth:`decode_bytes`)."""
        try:
            return torch.load(value, map_location="cpu", weights_only=not self.allow_pickle)
        except pickle.UnpicklingError as exc:
            if not self.allow_pickle and "Weights only load failed" in str(exc):
                raise CheckpointError(
                    f"state_dict entry {fqn!r} holds a pickled object that weights_only loading refuses "
                    f"({_weights_only_reason(exc)}); load with allow_pickle=True only if you trust where the "
                    "checkpoint comes from (unpickling can run arbitrary code), or allowlist its classes with "
                    "torch.serialization.safe_globals([...])") from None
            raise CorruptCheckpointError(f"state_dict entry {fqn!r} cannot be unpickled: {exc}") from exc
        except Exception as exc:
            raise CorruptCheckpointError(
                f"state_dict entry {fqn!r} cannot be read: {type(exc).__name__}: {exc}") from exc

    def set_value(self, read_item: ReadItem, obj: Any) -> None:
        """Put a decoded non-tensor value into the state_dict (as ``load_bytes`` does, but
        under the state_dict's own key where it is an ``int``: :func:`set_value`)."""
        if self.flatten_state_dict:
            set_value(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.set_value(read_item, self.decode_bytes(read_item, value))


def set_value(state_dict: dict[str, Any], path: tuple, value: Any) -> None:
    """DCP's ``set_element(state_dict, path, value)`` for a ``path`` of DCP's flatten
    mapping (``str(key)`` for every dict key), that follows the dicts' own keys: where
    a dict holds the ``int`` key ``0`` and not ``"0"`` (an optimizer's ``state``), the
    value goes under ``0``, not under a new ``"0"`` beside it (as stock DCP's load puts
    it). A path that does not lead through ``state_dict`` is ``set_element``'s."""
    parent: Any = state_dict
    key: Any = None
    for depth, k in enumerate(path):
        if isinstance(parent, Mapping):
            if type(k) is str and k not in parent:
                as_int = int_key(k)
                if as_int is not None and as_int in parent:
                    k = as_int
        elif not (isinstance(parent, list) and type(k) is int):
            break
        if depth == len(path) - 1:
            key = k
            break
        try:
            parent = parent[k]
        except (KeyError, IndexError):
            break
    if key is None or not isinstance(parent, (Mapping, list)):
        set_element(state_dict, path, value)
        return
    if isinstance(parent, list):
        parent.extend([None] * (key + 1 - len(parent)))
    parent[key] = value


def _as_listed(data: bytes, entry: Any, whole_crc: int | None) -> bool:
    """Whether ``data`` has the size and segment CRC-32s of its manifest ``entry``
    (``whole_crc``: ``data``'s CRC-32, when the caller has it)."""
    try:
        if entry["size"] != len(data):
            return False
        for offset, length, crc in entry["segments"]:
            if offset == 0 and length == len(data) and whole_crc is not None:
                actual = whole_crc
            else:
                actual = crc32(memoryview(data)[offset:offset + length])
            if actual != crc:
                return False
    except (KeyError, TypeError, ValueError):
        return False
    return True


# ----------------------------------------------------------------------------- reader
def _writer_framing(dtype: torch.dtype, shape: tuple[int, ...]) -> TensorFraming | None:
    try:
        return record_framing(dtype, shape)  # what our writer puts around every record
    except ValueError:
        return None


def _suffix_matches(tail: memoryview, framing: TensorFraming) -> bool:
    """``tail`` is ``framing.suffix`` but for the CRC-32 fields (at ``crc_offsets``)."""
    got, want = tail.tobytes(), framing.suffix  # (bytes compare with memcmp; a memoryview byte by byte)
    if len(got) != len(want):
        return False
    pos = 0
    for offset in sorted(framing.crc_offsets):
        if got[pos:offset] != want[pos:offset]:
            return False
        pos = offset + 4
    return got[pos:] == want[pos:]


def _tensor_from(buf: bytearray, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(dtype).view(shape)


def _read_record(fd: int, path: str, offset: int, framing: TensorFraming, dest: memoryview) -> bool:
    """Read one record of our writer at ``offset``: its data into ``dest`` and its
    framing, in one ``preadv``. Returns whether the framing is ours.

    Raises:
        CorruptCheckpointError: the file ends inside the record.
    """
    head, tail = bytearray(len(framing.prefix)), bytearray(len(framing.suffix))
    got = os.preadv(fd, [head, dest, tail], offset)
    if got != len(head) + len(dest) + len(tail):  # short read (rare): finish it piece by piece
        pos = 0
        for b in (memoryview(head), dest, memoryview(tail)):
            lo = max(0, got - pos)
            if lo < len(b):
                _pread_into(fd, b[lo:], offset + pos + lo, path)
            pos += len(b)
    return bytes(head) == framing.prefix and _suffix_matches(memoryview(tail), framing)


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that checks every path and never follows a symlink.

    ``read_metadata`` is :func:`read_metadata` (restricted unpickling, paths checked),
    cached so that a caller may read and check it before ``dcp.load`` runs.
    ``read_data`` opens data files relative to the directory with ``O_NOFOLLOW``,
    decodes every non-tensor value (through the planner's ``decode_bytes`` when it
    has one, see :class:`SafeLoadPlanner`) before writing any tensor, and copies our
    writer's tensor records without a per-tensor ``torch.load``.

    Args:
        path: the checkpoint directory.
        _extension_registry: as ``FileSystemReader``'s (stream transforms).
    """

    def __init__(self, path: str | os.PathLike, _extension_registry: Any = None) -> None:
        super().__init__(path, _extension_registry)
        self._metadata: Metadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id and os.fspath(checkpoint_id) != os.fspath(self.path):
            self._metadata = None
        super().reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checked metadata (see :func:`read_metadata`).

        Raises:
            CorruptCheckpointError: see :func:`read_metadata`; also when asked for
                rank-local metadata (``rank=``), which asyncckpt never writes.
        """
        if kwargs.get("rank") is not None:
            raise CorruptCheckpointError(f"{self.path}: asyncckpt checkpoints have no rank-local metadata")
        if self._metadata is None:
            self._metadata = read_metadata(self.path)
        metadata = self._metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def check_manifest(self, manifest_files: Iterable[str]) -> None:
        """Every data file named by the metadata must be listed in the manifest.

        Raises:
            CorruptCheckpointError: naming the first unlisted file.
        """
        listed = set(manifest_files)
        metadata = self.read_metadata()
        for name in sorted({info.relative_path for info in metadata.storage_data.values()}):
            if name not in listed:
                path = os.path.join(os.fspath(self.path), name)
                raise CorruptCheckpointError(
                    f"{METADATA_NAME} names {name!r}, a file the manifest does not list", path)

    def read_records(self, manifest_files: Mapping[str, Any]) -> dict[str, Record] | None:
        """The records of the records file (:mod:`asyncckpt.format.records`), when the
        manifest lists one and it stands for this directory's ``.metadata``; else
        ``None``: read :meth:`read_metadata`. Never raises for a bad or missing records
        file (``.metadata`` decides).

        It stands for it when it names the CRC-32 of the ``.metadata`` bytes (read
        here), and both files' bytes have the sizes and CRC-32s the manifest lists for
        them, whatever the load's ``verify``: the commit wrote the three together, so a
        records file edited or swapped on its own (its entries no longer those of
        ``.metadata``) is never used. This costs a CRC-32 of the records file (about
        100 bytes per entry; the ``.metadata`` bytes are checksummed anyway), some
        microseconds per thousand entries, against the tens of milliseconds that
        unpickling ``.metadata`` to compare would cost. A records file rewritten
        together with the manifest's checksum of it is not detected (as a data file
        rewritten with its manifest entry is not): the manifest is the root of the
        checksums."""
        if RECORDS_NAME not in manifest_files or METADATA_NAME not in manifest_files:
            return None
        root = os.fspath(self.path)
        try:
            dir_fd = _open_dir(root)
        except CorruptCheckpointError:
            return None
        try:
            data = {}
            for name in (RECORDS_NAME, METADATA_NAME):
                fd = _open_member(dir_fd, root, name)
                try:
                    with open(fd, "rb", closefd=False) as f:
                        data[name] = f.read()
                finally:
                    os.close(fd)
        except (CorruptCheckpointError, OSError):
            return None
        finally:
            os.close(dir_fd)
        metadata_crc = crc32(data[METADATA_NAME])
        if not (_as_listed(data[RECORDS_NAME], manifest_files[RECORDS_NAME], None)
                and _as_listed(data[METADATA_NAME], manifest_files[METADATA_NAME], metadata_crc)):
            warnings.warn(f"{self.path}: {RECORDS_NAME} or {METADATA_NAME} does not match the manifest's "
                          f"checksum; {RECORDS_NAME} ignored, {METADATA_NAME} read instead", UserWarning,
                          stacklevel=2)
            return None
        return parse_records(data[RECORDS_NAME], metadata_crc, manifest_files)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        _validate_metadata(metadata, os.path.join(os.fspath(self.path), METADATA_NAME))
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata

    # -- data
    def _chunk_spec(self, index: MetadataIndex) -> tuple[torch.dtype, tuple[int, ...]] | None:
        assert self._metadata is not None
        md = self._metadata.state_dict_metadata.get(index.fqn)
        if not isinstance(md, _md.TensorStorageMetadata):
            return None
        chunks = md.chunks
        chunk = None
        if index.index is not None and 0 <= index.index < len(chunks) and chunks[index.index].offsets == index.offset:
            chunk = chunks[index.index]
        else:
            chunk = next((c for c in chunks if c.offsets == index.offset), None)
        if chunk is None:
            return None
        return md.properties.dtype, tuple(int(s) for s in chunk.sizes)

    def _read_tensor(self, fd: int, path: str, req: ReadItem, raw: bool = True) -> torch.Tensor:
        """The tensor of ``req``'s record: raw bytes if the record is ours (``raw``: try
        that), else ``torch.load`` on a stream over the record."""
        info: _StorageInfo = self.storage_data[req.storage_index]
        spec = None if info.transform_descriptors or not raw else self._chunk_spec(req.storage_index)
        framing = _writer_framing(*spec) if spec is not None else None
        if framing is not None:
            head_n, data_n = len(framing.prefix), framing.nbytes
            if info.length == head_n + data_n + len(framing.suffix):
                if info.length <= _SMALL_RECORD_BYTES:
                    buf = _pread(fd, info.length, info.offset, path)
                    view = memoryview(buf)
                    ok = view[:head_n] == framing.prefix and _suffix_matches(view[head_n + data_n:], framing)
                    if ok:
                        return _tensor_from(buf, head_n, data_n, spec[0], spec[1])
                    view.release()
                else:
                    buf = bytearray(data_n)
                    if _read_record(fd, path, info.offset, framing, memoryview(buf)):
                        return _tensor_from(buf, 0, data_n, spec[0], spec[1])
                del buf  # not ours: free it before torch.load allocates the tensor
        # Not our framing: what DCP's FileSystemReader does, weights_only.
        stream: Any = _RecordStream(fd, info.offset, info.length)
        if info.transform_descriptors:
            transformed = self.transforms.transform_load_stream(req, info.transform_descriptors, stream)
            stream = io.BytesIO(transformed.read())  # torch.load needs a seekable stream
        return _torch_load_tensor(stream, path, req.storage_index.fqn)

    def _read_into(self, fd: int, path: str, req: ReadItem, target: torch.Tensor) -> bool | None:
        """Read a whole record of our writer straight into ``target``'s memory.

        One copy (page cache to the destination), no intermediate buffer: taken when
        ``target`` is a contiguous CPU tensor of the record's dtype and shape and the
        request covers the whole chunk.

        Returns:
            ``True``: read. ``False``: not taken (nothing read). ``None``: read, but the
            record is not ours (``target`` holds its bytes; read it the general way,
            without trying the raw read again).
        """
        if target.device.type != "cpu" or not target.is_contiguous() or target.numel() == 0:
            return False
        info: _StorageInfo = self.storage_data[req.storage_index]
        spec = None if info.transform_descriptors else self._chunk_spec(req.storage_index)
        if spec is None or spec[0] != target.dtype or tuple(target.shape) != spec[1]:
            return False
        if any(req.storage_offsets) or tuple(req.lengths) != spec[1]:
            return False
        framing = _writer_framing(*spec)
        if framing is None or target.numel() * target.element_size() != framing.nbytes:
            return False
        data_n = framing.nbytes
        if info.length != len(framing.prefix) + data_n + len(framing.suffix) or data_n < _DIRECT_READ_BYTES:
            return False
        # The target is written before the framing is checked; a record that turns
        # out not to be ours is then read again the general way, overwriting it.
        dest = memoryview((ctypes.c_char * data_n).from_address(target.data_ptr())).cast("B")
        return True if _read_record(fd, path, info.offset, framing, dest) else None

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        root = os.fspath(self.path)
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        decoded: list[tuple[ReadItem, Any]] = []
        raw_values: list[tuple[ReadItem, bytes]] = []
        dir_fd = _open_dir(root)
        fds: dict[str, int] = {}
        try:
            for name in per_file:
                fds[name] = _open_member(dir_fd, root, check_file_name(name, METADATA_NAME))
            # 1. Non-tensor values, all decoded before any tensor is written.
            decode = getattr(planner, "decode_bytes", None)
            for name, reqs in per_file.items():
                for req in reqs:
                    if req.type != LoadItemType.BYTE_IO:
                        continue
                    info = self.storage_data[req.storage_index]
                    data = _pread(fds[name], info.length, info.offset, os.path.join(root, name))
                    stream = self.transforms.transform_load_stream(
                        req, info.transform_descriptors or (), io.BytesIO(data))
                    value = io.BytesIO(stream.read())
                    if decode is not None:
                        decoded.append((req, decode(req, value)))
                    else:
                        raw_values.append((req, value.getvalue()))
            # 2. Tensors, in file order.
            for name, reqs in per_file.items():
                path = os.path.join(root, name)
                tensor_reqs = [r for r in reqs if r.type != LoadItemType.BYTE_IO]
                tensor_reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
                for req in tensor_reqs:
                    target = planner.resolve_tensor(req).detach()
                    taken = self._read_into(fds[name], path, req, target)
                    if taken:
                        planner.commit_tensor(req, target)
                        continue
                    tensor = narrow_tensor_by_index(self._read_tensor(fds[name], path, req, raw=taken is not None),
                                                    req.storage_offsets, req.lengths)
                    if target.size() != tensor.size():
                        raise CorruptCheckpointError(
                            f"{path}: entry {req.storage_index.fqn!r} has size {tuple(tensor.size())}, "
                            f"expected {tuple(target.size())}", path)
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)
        finally:
            for fd in fds.values():
                os.close(fd)
            os.close(dir_fd)
        # 3. Non-tensor values into the state_dict.
        set_value = getattr(planner, "set_value", None)
        for req, obj in decoded:
            assert set_value is not None
            set_value(req, obj)
        for req, data in raw_values:
            planner.load_bytes(req, io.BytesIO(data))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


# ----------------------------------------------------------------------------- direct load
#: ``preadv`` takes at most this many buffers per call (Linux ``IOV_MAX``).
_IOV_MAX = 1024
#: Without manifest segments (``verify=False``), adjacent records are read together up
#: to this many bytes per read (a record larger than this is one read of its own).
_UNIT_BYTES = 16 << 20
#: A file's consecutive reads are gathered into ``preadv`` calls of up to this many
#: bytes (across records and manifest segments), each handed to the CRC helper thread
#: once read. Large calls keep more of the disk busy: a 1 GiB file read cold in 4 MiB
#: calls took 378-421 ms here, in 64 MiB calls 352-373 ms (medians of 7, one run).
_READ_BYTES = 64 << 20
#: Records further apart than this are not read together (the gap would be read for nothing).
_MAX_GAP_BYTES = 64 << 10


class _Entry(NamedTuple):
    """One record the direct path reads: ``fqn``'s bytes at ``[offset, offset + length)``.

    ``framing`` is ``None`` for a non-tensor value (``BYTE_IO``); ``target`` is the
    state_dict tensor to fill (``None`` for a value)."""

    fqn: str
    offset: int
    length: int
    framing: TensorFraming | None
    target: torch.Tensor | None


class DirectPlan(NamedTuple):
    """What :func:`plan_direct_load` found: every record to read, by data file.

    Attributes:
        files: file name -> its entries, sorted by offset.
        mappings: DCP's flatten mapping (flat key -> nested path of the state_dict).
        nbytes: bytes of all records.
        state_dict: the state_dict the plan fills.
    """

    files: dict[str, list[_Entry]]
    mappings: dict[str, Any]
    nbytes: int
    state_dict: dict[str, Any]


#: Values that are never ``Stateful`` (``isinstance`` on the Protocol is slow).
_PLAIN_VALUES = (torch.Tensor, dict, list, tuple, str, int, float, bool, type(None))


def _plain_tensor(obj: Any) -> bool:
    return type(obj) in (torch.Tensor, torch.nn.Parameter) and not obj.is_meta and obj.layout == torch.strided


def plan_direct_load(state_dict: dict[str, Any], metadata: Metadata | Mapping[str, Record] | None
                     ) -> DirectPlan | None:
    """Map every entry of ``state_dict`` to its record, or ``None`` if the checkpoint or
    the state is not the common case that :func:`direct_load` handles.

    The common case: the state's flattened keys (DCP's ``flatten_state_dict``, as
    ``DefaultLoadPlanner`` flattens) are exactly the checkpoint's; every tensor is a plain
    strided tensor (not a DTensor, ShardedTensor or meta tensor) of the checkpoint's dtype
    and shape, saved as one chunk in our writer's framing length
    (``layout.record_framing``); every non-tensor value is a ``BYTE_IO`` record; no
    record has stream transforms; no two target tensors share memory; no top-level value
    is ``Stateful``. Anything else (resharding, a partial load, a missing key, a stock
    ``dcp.save`` record) returns ``None``: DCP's planner handles it, with its errors.

    Args:
        state_dict: the state to fill.
        metadata: the checkpoint's ``Metadata``, or its records (fqn -> record, from
            the records file: :mod:`asyncckpt.format.records`); ``None``: no records.

    Costs one dict lookup and a few comparisons per entry (no collective, no I/O).
    """
    with gc_paused():
        records = records_from_metadata(metadata) if isinstance(metadata, Metadata) else metadata
        return None if records is None else _plan_direct(state_dict, records)


def _plan_direct(state_dict: dict[str, Any], records: Mapping[str, Record]) -> DirectPlan | None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.stateful import Stateful

    if any(not isinstance(v, _PLAIN_VALUES) and isinstance(v, Stateful) for v in state_dict.values()):
        return None  # (the Protocol check is slow: only for what could be Stateful)
    flat, mappings = flatten_state_dict(state_dict)
    if len(flat) != len(records):
        return None  # a partial load, or keys of an older flattening: DCP's planner decides
    files: dict[str, list[_Entry]] = {}
    spans: list[tuple[int, int]] = []
    nbytes = 0
    for fqn, obj in flat.items():
        record = records.get(fqn)
        if record is None:
            return None
        name, offset, length, dtype, shape = record
        if dtype is None:  # a value
            if isinstance(obj, torch.Tensor):
                return None
            framing = None
        else:
            if not _plain_tensor(obj) or obj.dtype != dtype or tuple(obj.shape) != shape:
                return None
            framing = _writer_framing(dtype, shape)
            if framing is None or length != len(framing.prefix) + framing.nbytes + len(framing.suffix):
                return None
            if framing.nbytes and obj.is_cpu:
                if obj.is_contiguous():
                    lo = obj.data_ptr()
                    spans.append((lo, lo + framing.nbytes))
                else:  # its whole storage
                    storage = obj.untyped_storage()
                    spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        files.setdefault(name, []).append(_Entry(fqn, offset, length, framing, obj if framing is not None else None))
        nbytes += length
    spans.sort()
    if any(spans[i][1] > spans[i + 1][0] for i in range(len(spans) - 1)):
        return None  # tied or overlapping tensors: DCP's order of writes decides
    for entries in files.values():
        entries.sort(key=lambda e: e.offset)
        if any(a.offset + a.length > b.offset for a, b in zip(entries, entries[1:])):
            return None
    return DirectPlan(files, mappings, nbytes, state_dict)


def _preadv_all(fd: int, views: list[memoryview], offset: int, path: str) -> None:
    """Fill ``views`` (in order) from ``offset``: at most ``_IOV_MAX`` buffers per
    ``preadv``, short reads finished.

    Raises:
        CorruptCheckpointError: the file ends first.
    """
    i, pos = 0, offset
    while i < len(views):
        batch = views[i:i + _IOV_MAX]
        want = sum(len(v) for v in batch)
        got = os.preadv(fd, batch, pos) if want else 0
        if got < want:  # short (rare): finish the batch buffer by buffer
            done = 0
            for v in batch:
                if done + len(v) > got:
                    lo = max(0, got - done)
                    _pread_into(fd, v[lo:], pos + done + lo, path)
                done += len(v)
        pos += want
        i += _IOV_MAX


class _Unit(NamedTuple):
    """One read: file bytes ``[lo, hi)``, checked against ``crc`` when not ``None``."""

    lo: int
    hi: int
    crc: int | None


def _units(entries: list[_Entry], segments: list[list[int]] | None) -> list[_Unit]:
    """The reads covering ``entries``: the manifest segments that hold a byte of them
    (``segments``: verification on), else the entries merged into reads of up to
    ``_UNIT_BYTES``."""
    units: list[_Unit] = []
    if segments is not None:
        k = 0
        for e in entries:
            end = e.offset + e.length
            while k < len(segments) and segments[k][0] + segments[k][1] <= e.offset:
                k += 1
            j = k
            while j < len(segments) and segments[j][0] < end:
                lo, n, crc = segments[j]
                if not units or units[-1].lo < lo:
                    units.append(_Unit(lo, lo + n, crc))
                j += 1
        return units
    for e in entries:
        end = e.offset + e.length
        if units and e.offset - units[-1].hi <= _MAX_GAP_BYTES and end - units[-1].lo <= _UNIT_BYTES:
            units[-1] = _Unit(units[-1].lo, max(units[-1].hi, end), None)
        else:
            units.append(_Unit(e.offset, end, None))
    return units


class _Landing(NamedTuple):
    """Where one entry's bytes land: ``head`` (framing before the data, or a value's
    whole record), ``data`` (the raw tensor bytes: the target's memory, or ``temp``'s),
    ``tail`` (framing after)."""

    entry: _Entry
    head: memoryview
    data: memoryview
    tail: memoryview
    temp: torch.Tensor | None  # the data, when the target cannot take it directly


_EMPTY = memoryview(b"")


def _land(entry: _Entry, direct: bool, frame: memoryview) -> _Landing:
    """``frame``: ``len(prefix) + len(suffix)`` bytes for the framing (unused for a value)."""
    f = entry.framing
    if f is None:
        return _Landing(entry, memoryview(bytearray(entry.length)), _EMPTY, _EMPTY, None)
    target = entry.target
    assert target is not None
    temp = None
    if f.nbytes == 0:
        data = _EMPTY
    elif direct and target.is_cpu and target.is_contiguous():
        data = memoryview((ctypes.c_char * f.nbytes).from_address(target.data_ptr())).cast("B")
    else:
        temp = torch.empty(target.shape, dtype=target.dtype)
        data = memoryview((ctypes.c_char * f.nbytes).from_address(temp.data_ptr())).cast("B")
    n = len(f.prefix)
    return _Landing(entry, frame[:n], data, frame[n:], temp)


def _unit_views(unit: _Unit, landings: list[_Landing]) -> list[memoryview]:
    """The buffers that file bytes ``[unit.lo, unit.hi)`` are read into, in file order:
    each landing's pieces that lie inside go to their memory, every other byte
    (alignment gaps, records nobody asked for) to a scratch buffer of the unit's own
    (its bytes are checksummed after the next unit was read)."""
    parts: list[memoryview | int] = []  # a piece, or the length of a gap
    pos, gaps = unit.lo, 0
    for land in landings:
        start = land.entry.offset
        if start >= pos and start + land.entry.length <= unit.hi:  # wholly inside (the common case)
            if start > pos:
                parts.append(start - pos)
                gaps += start - pos
            parts += [piece for piece in (land.head, land.data, land.tail) if piece]
            pos = start + land.entry.length
            continue
        for piece in (land.head, land.data, land.tail):
            end = start + len(piece)
            lo, hi = max(start, pos), min(end, unit.hi)
            if hi > lo:
                if lo > pos:
                    parts.append(lo - pos)
                    gaps += lo - pos
                parts.append(piece[lo - start:hi - start])
                pos = hi
            start = end
    if unit.hi > pos:
        parts.append(unit.hi - pos)
        gaps += unit.hi - pos
    scratch = memoryview(bytearray(gaps)) if gaps else None
    views: list[memoryview] = []
    cursor = 0
    for part in parts:
        if isinstance(part, int):
            assert scratch is not None
            views.append(scratch[cursor:cursor + part])
            cursor += part
        else:
            views.append(part)
    return views


def _read_file(fd: int, path: str, reads: list[tuple[_Unit, list[_Landing]]], note: str) -> None:
    """Read one file's ``reads`` in file order, on this thread: one sequential reader per
    file keeps the kernel's readahead going (measured here: a 1 GiB file read by one
    thread as fast as ``readinto`` of the whole, by 2 and 4 threads at different
    offsets 1.2x and 1.6x slower). Consecutive reads are gathered into ``preadv`` calls
    of up to :data:`_READ_BYTES`. With verification each call's bytes are checksummed
    on a helper thread (:class:`~asyncckpt.format.crc.CrcChain`), unit by unit, while
    the next call reads; the first mismatch stops the reads.

    Raises:
        CorruptCheckpointError: a read came short, or a unit's CRC-32 is not the
            manifest's (naming the bytes and the entries in them, plus ``note``).
    """
    def mismatch(read: tuple[_Unit, list[_Landing]], crc: int) -> CorruptCheckpointError:
        unit, landings = read
        keys = [la.entry.fqn for la in landings]
        return CorruptCheckpointError(
            f"{path}: checksum mismatch in bytes [{unit.lo}, {unit.hi}) (crc32 {crc:08x}, "
            f"manifest {unit.crc:08x}), holding state_dict entries {keys[:4]}"
            + (f" and {len(keys) - 4} more" if len(keys) > 4 else "") + note, path)

    lo = n = count = 0  # the call being gathered: file bytes [lo, lo + n) in count buffers
    # Its buffers, per read: (the read, its buffers in this call, whether it ends in it).
    parts: list[tuple[tuple[_Unit, list[_Landing]], list[memoryview], bool]] = []

    def flush(chain: CrcChain | None) -> None:
        nonlocal lo, n, count
        _preadv_all(fd, [v for _, views, _ in parts for v in views], lo, path)
        if chain is not None:
            chain.feed([(views, (read, read[0].crc) if last else None)
                        for read, views, last in parts if read[0].crc is not None])
            chain.raise_mismatch(mismatch)
        parts.clear()
        lo, n, count = lo + n, 0, 0

    verify = any(unit.crc is not None for unit, _ in reads)
    with CrcChain() if verify else contextlib.nullcontext() as chain:
        for read in reads:
            unit = read[0]
            if lo + n != unit.lo:  # not adjacent to the call being gathered
                if parts:
                    flush(chain)
                lo = unit.lo
            views: list[memoryview] = []
            for v in _unit_views(unit, read[1]):
                for piece in (v,) if len(v) <= _READ_BYTES else (v[i:i + _READ_BYTES]
                                                                 for i in range(0, len(v), _READ_BYTES)):
                    if n and (n + len(piece) > _READ_BYTES or count >= _IOV_MAX):
                        parts.append((read, views, False))
                        views = []
                        flush(chain)
                    views.append(piece)
                    n += len(piece)
                    count += 1
            parts.append((read, views, True))
        if parts:
            flush(chain)
        if chain is not None:
            chain.raise_mismatch(mismatch, final=True)


def _checked_segments(manifest_files: dict[str, Any], name: str, path: str, size: int) -> list[list[int]]:
    """The manifest's segments of file ``name``, checked to cover its ``size`` bytes.

    Raises:
        CorruptCheckpointError: the file is not listed, has another size, or the
            segments do not cover it (the messages of ``verify_checkpoint``).
    """
    entry = manifest_files.get(name)
    if entry is None:
        raise CorruptCheckpointError(f"{METADATA_NAME} names {name!r}, a file the manifest does not list", path)
    if size != entry["size"]:
        raise CorruptCheckpointError(f"{path} has {size} bytes, the manifest says {entry['size']}", path)
    pos = 0
    for offset, length, _crc in entry["segments"]:
        if offset != pos:
            raise CorruptCheckpointError(f"{path}: manifest segments do not cover the file", path)
        pos = offset + length
    if pos != size:
        raise CorruptCheckpointError(f"{path}: manifest segments do not cover the file", path)
    return entry["segments"]


def direct_load(plan: DirectPlan, root: str, manifest_files: dict[str, Any] | None, *,
                decode: Any, threads: int | None = None) -> None:
    """Read ``plan``'s records into their targets: the direct path of ``asyncckpt.load``.

    Per data file, the records are read in file order with few large ``preadv`` calls
    (each buffer list covers a manifest segment or, without verification, up to 16 MiB
    of adjacent records): tensor data goes straight into the target's memory when the
    target is a contiguous CPU tensor (else into a CPU tensor copied in afterwards), the
    framing into small buffers that are then compared with our writer's framing. Each
    file is read sequentially by one thread, files in parallel, and with verification
    the CRC-32 runs on a helper thread beside each reader (``preadv`` and ``crc32``
    release the GIL; see :func:`_read_file`). Non-tensor
    values are read, checked and decoded first (``decode(fqn, BytesIO)``), and placed
    last; a refused value leaves the state_dict unchanged.

    Args:
        plan: from :func:`plan_direct_load`.
        root: the checkpoint directory.
        manifest_files: the manifest's ``files`` to check every read against (sizes and
            the CRC-32 of each segment read); ``None`` reads without checking.
        decode: ``decode(fqn, value: io.BytesIO) -> object`` for non-tensor values.
        threads: files read at once (default: up to 4, at most the CPU count).

    Raises:
        CorruptCheckpointError: a file is missing, not a regular file, of the wrong size,
            shorter than a record, or a segment's CRC-32 does not match (naming the
            file, the bytes and the entries in them; the tensors of those bytes may then
            hold the bad bytes).
        CheckpointError: from ``decode`` (a value that needs ``allow_pickle``).
    """
    if threads is None:
        threads = min(4, os.cpu_count() or 1)
    dir_fd = _open_dir(root)
    fds: dict[str, int] = {}
    try:
        value_work: list[tuple[int, str, _Unit, list[_Landing]]] = []  # (order, file, read, its landings)
        tensor_work: list[tuple[int, str, _Unit, list[_Landing]]] = []
        all_landings: list[tuple[str, _Landing]] = []
        for name in sorted(plan.files):
            entries = plan.files[name]
            fd = fds[name] = _open_member(dir_fd, root, check_file_name(name, METADATA_NAME))
            path = os.path.join(root, name)
            size = os.fstat(fd).st_size
            segments = None if manifest_files is None else _checked_segments(manifest_files, name, path, size)
            last = entries[-1]
            if last.offset + last.length > size:
                raise CorruptCheckpointError(
                    f"{path}: entry {last.fqn!r} lies past the end of the file (up to byte "
                    f"{last.offset + last.length}, the file has {size} bytes)", path)
            units = _units(entries, segments)
            # The reads holding a value go first, before any target is written: the
            # tensors in them land in temporaries.
            value_units = {i for e in entries if e.framing is None
                           for i, u in enumerate(units) if u.lo < e.offset + e.length and u.hi > e.offset}
            # The framing of all tensor records in one buffer (a slice each).
            frames = memoryview(bytearray(sum(len(e.framing.prefix) + len(e.framing.suffix)
                                              for e in entries if e.framing is not None)))
            landings = []
            pos = 0
            with gc_paused():  # thousands of ctypes views: no full collection in between
                for e in entries:
                    n = 0 if e.framing is None else len(e.framing.prefix) + len(e.framing.suffix)
                    direct = not any(units[i].lo < e.offset + e.length and units[i].hi > e.offset
                                     for i in value_units)
                    landings.append(_land(e, direct, frames[pos:pos + n]))
                    pos += n
            all_landings += [(name, la) for la in landings]
            k = 0
            for i, u in enumerate(units):
                while k < len(landings) and landings[k].entry.offset + landings[k].entry.length <= u.lo:
                    k += 1
                j = k
                while j < len(landings) and landings[j].entry.offset < u.hi:
                    j += 1
                work = value_work if i in value_units else tensor_work
                work.append((len(value_work) + len(tensor_work), name, u, landings[k:j]))

        def run(work: list, note: str = "") -> None:
            # One task per file, its reads in file order; files in parallel.
            by_file: dict[str, list] = {}
            for order, name, unit, landings in work:
                by_file.setdefault(name, []).append((order, unit, landings))
            tasks = sorted((reads[0][0], name, [(u, la) for _, u, la in reads]) for name, reads in by_file.items())

            def one(task: tuple) -> None:
                _, name, reads = task
                _read_file(fds[name], os.path.join(root, name), reads, note)

            run_in_order(tasks, one, threads, "asyncckpt-load")

        # 1. Values (and the tensors sharing their reads, into temporaries), decoded.
        run(value_work)
        values = [(la.entry.fqn, decode(la.entry.fqn, io.BytesIO(la.head)))
                  for _, la in all_landings if la.entry.framing is None]
        # 2. Tensors, straight into their targets where they can.
        run(tensor_work, "; tensors of the state_dict may already hold bytes of this checkpoint")
        # 3. Framing check (a record not in our framing is read the general way);
        #    temporaries copied into their targets.
        for name, la in all_landings:
            e, f = la.entry, la.entry.framing
            if f is None:
                continue
            assert e.target is not None
            if la.head.tobytes() == f.prefix and _suffix_matches(la.tail, f):
                if la.temp is not None:
                    e.target.detach().copy_(la.temp)
            else:
                e.target.detach().copy_(_load_foreign(fds[name], os.path.join(root, name), e))
    finally:
        for fd in fds.values():
            os.close(fd)
        os.close(dir_fd)
    for fqn, obj in values:
        set_value(plan.state_dict, plan.mappings[fqn], obj)


def _torch_load_tensor(stream: Any, path: str, fqn: str) -> torch.Tensor:
    """``torch.load(stream, weights_only=True)`` of one tensor record.

    Raises:
        CorruptCheckpointError: not a tensor archive, or not a tensor.
    """
    try:
        tensor = torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CorruptCheckpointError(
            f"{path}: the record of {fqn!r} is not a tensor archive: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", path) from exc
    if not isinstance(tensor, torch.Tensor):
        raise CorruptCheckpointError(f"{path}: the record of {fqn!r} holds a {type(tensor).__name__}, not a tensor",
                                     path)
    return tensor


def _load_foreign(fd: int, path: str, entry: _Entry) -> torch.Tensor:
    """A tensor record that is not in our writer's framing: ``torch.load(weights_only=True)``
    of the record, as DCP's ``FileSystemReader`` reads it.

    Raises:
        CorruptCheckpointError: not a tensor archive, or not the target's dtype and shape.
    """
    tensor = _torch_load_tensor(_RecordStream(fd, entry.offset, entry.length), path, entry.fqn)
    assert entry.target is not None
    if tensor.size() != entry.target.size():
        raise CorruptCheckpointError(f"{path}: entry {entry.fqn!r} has size {tuple(tensor.size())}, "
                                     f"expected {tuple(entry.target.size())}", path)
    return tensor
