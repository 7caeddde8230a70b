"""Whole tensors of a checkpoint, one at a time: bounded memory, checksums checked.

:func:`iter_tensors` yields the tensors of a checkpoint directory one by one, each
assembled from its chunks (an FSDP2 / DTensor checkpoint of N ranks holds a chunk of
every tensor in each rank's file; ``.metadata`` records the chunks' offsets), so a
consumer (``asyncckpt.export_safetensors``) holds one tensor at a time, never the whole
model. This is the idea of DCP's ``format_utils.dcp_to_torch_save`` and of
``_consolidate_hf_safetensors``, with the loaders' safety: ``.metadata`` is read with
the restricted unpickler (:mod:`asyncckpt.loading.metadata`), files through the
directory's descriptor without following symlinks, and a checkpoint of ours (with a
manifest) is checked against the manifest's CRC-32 segments as it is read: every byte
read lies in a segment whose checksum is compared before the bytes are handed out.
A stock ``torch.distributed.checkpoint`` directory has no manifest: it is read
without checksums and a ``UserWarning`` says so, as :func:`asyncckpt.load` does.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import io
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from asyncckpt._check import check_path
from asyncckpt.errors import CheckpointNotFoundError, CheckpointPathError, CorruptCheckpointError
from asyncckpt.format.crc import crc32
from asyncckpt.format.manifest import MANIFEST_NAME, METADATA_NAME
from asyncckpt.io.storage import LOCAL, LocalFileReader
from asyncckpt.loading.direct import _checked_segments
from asyncckpt.loading.framing import RecordStream, pread_into, suffix_matches, torch_load_tensor, writer_framing
from asyncckpt.loading.metadata import check_file_name, read_metadata
from asyncckpt.loading.read import typed_entry_paths
from asyncckpt.root import is_in_root

__all__ = ["TensorEntry", "CheckpointTensors", "tensor_memory"]

#: Small segments (runs of small records and framing) kept per file, so that the
#: records of one segment, read one by one in file order, read it once.
_CACHED_SEGMENTS = 2


class TensorEntry(NamedTuple):
    """One tensor of a checkpoint, as :class:`CheckpointTensors` lists it.

    Attributes:
        fqn: DCP's flattened key (``model.layer.weight``).
        path: the nested path of the entry in the saved state_dict (``("model",
            "layer.weight")``), from the metadata's ``planner_data``.
        dtype: the saved dtype.
        shape: the global shape (all chunks together).
        nbytes: ``numel * itemsize`` of the whole tensor, in bytes.
    """

    fqn: str
    path: tuple[str | int, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


class _Chunk(NamedTuple):
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    info: _StorageInfo


class _File:
    """Positioned reads of one data file, checked against the manifest's segments
    (``segments`` ``None``: a stock DCP file, read unchecked)."""

    def __init__(self, fd: int, path: str, segments: list[list[int]] | None) -> None:
        self.fd, self.path, self.segments = fd, path, segments
        self.starts = [s[0] for s in segments] if segments is not None else []
        self.cache: collections.OrderedDict[int, bytearray] = collections.OrderedDict()

    def _mismatch(self, lo: int, n: int, actual: int, expected: int) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.path}: checksum mismatch in bytes [{lo}, {lo + n}) (crc32 {actual:08x}, manifest {expected:08x})",
            self.path,
        )

    def _segment(self, i: int) -> bytearray:
        buf = self.cache.get(i)
        if buf is not None:
            self.cache.move_to_end(i)
            return buf
        assert self.segments is not None
        lo, n, crc = self.segments[i]
        buf = bytearray(n)
        pread_into(self.fd, memoryview(buf), lo, self.path)
        actual = crc32(buf)
        if actual != crc:
            raise self._mismatch(lo, n, actual, crc)
        self.cache[i] = buf
        while len(self.cache) > _CACHED_SEGMENTS:
            self.cache.popitem(last=False)
        return buf

    def read_into(self, offset: int, dest: memoryview) -> None:
        """Fill ``dest`` with the file's bytes ``[offset, offset + len(dest))``; with
        segments, every segment those bytes touch is checksummed first (a segment wholly
        inside is read straight into ``dest`` and checked there).

        Raises:
            CorruptCheckpointError: the file ends first, or a checksum mismatches.
        """
        end = offset + len(dest)
        if self.segments is None:
            pread_into(self.fd, dest, offset, self.path)
            return
        i = max(0, bisect.bisect_right(self.starts, offset) - 1)
        pos = offset
        while pos < end:
            if i >= len(self.segments):
                raise CorruptCheckpointError(f"{self.path}: a record lies past the manifest's segments", self.path)
            lo, n, crc = self.segments[i]
            hi = lo + n
            if lo >= offset and hi <= end and i not in self.cache:
                view = dest[lo - offset : hi - offset]
                pread_into(self.fd, view, lo, self.path)
                actual = crc32(view)
                if actual != crc:
                    raise self._mismatch(lo, n, actual, crc)
            elif hi > pos:
                buf = self._segment(i)
                a, b = max(lo, offset), min(hi, end)
                dest[a - offset : b - offset] = memoryview(buf)[a - lo : b - lo]
            pos = max(pos, hi)
            i += 1


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def tensor_memory(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy (as
    :mod:`asyncckpt.loading.direct` reads into its targets)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class CheckpointTensors:
    """The tensors of a checkpoint directory, read whole, one at a time.

    Opening reads and checks the metadata (and, for a checkpoint of ours, the manifest
    and the CRC-32 of ``.metadata``); :meth:`read` then reads one tensor, assembled
    from all its chunks. Use as a context manager (it holds the data files open).

    Args:
        checkpoint_dir: a committed asyncckpt checkpoint, or a stock DCP directory.
        verify: check every byte read against the manifest's CRC-32 segments (a
            checkpoint of ours). A stock DCP directory has none: it is read unchecked,
            with a ``UserWarning`` (not with ``verify=False``).

    Attributes:
        entries: every tensor entry, in the order of its first chunk in the files (read
            them in this order: each file is then read front to back).
        skipped: the flattened keys of the non-tensor values (not readable here).
        stock: whether the directory is a stock DCP one (no manifest).

    Raises:
        CheckpointNotFoundError: (a ``FileNotFoundError``) no such directory.
        CheckpointPathError: (a ``NotADirectoryError``) not a directory.
        CorruptCheckpointError: the manifest or ``.metadata`` is missing, malformed or
            does not match; a data file is missing, a symlink, or outside the directory;
            the chunks of a tensor do not tile it.
    """

    def __init__(self, checkpoint_dir: str | os.PathLike, *, verify: bool = True) -> None:
        path = Path(check_path(checkpoint_dir))
        if not path.exists():
            raise CheckpointNotFoundError("no such checkpoint directory", str(path))
        if not path.is_dir():
            raise CheckpointPathError.of(20, "not a checkpoint directory", path)  # errno.ENOTDIR
        self.path = path
        manifest: dict[str, Any] | None = None
        if LOCAL.exists(path, MANIFEST_NAME):
            manifest = LOCAL.read_manifest(path)
            if verify:
                LOCAL.verify(path, [METADATA_NAME])
        elif is_in_root(path):  # ours, damaged: refused as the loaders refuse it
            LOCAL.read_manifest(path)
        elif verify:
            warnings.warn(
                f"{path} has no {MANIFEST_NAME} (a stock torch.distributed.checkpoint directory): "
                "read without checksum verification",
                UserWarning,
                stacklevel=2,
            )
        self.stock = manifest is None
        self._manifest_files = manifest["files"] if manifest is not None and verify else None
        if manifest is not None:
            listed = manifest["files"]
        metadata = read_metadata(path, LOCAL)  # restricted unpickling; paths and sizes checked
        self._metadata: Metadata = metadata
        where = str(path / METADATA_NAME)
        chunks: dict[str, list[_Chunk]] = {}
        chunk_specs: dict[str, dict[tuple[int, ...], Any]] = {}
        for index, info in metadata.storage_data.items():
            if manifest is not None and info.relative_path not in listed:
                raise CorruptCheckpointError(
                    f"{METADATA_NAME} names {info.relative_path!r}, a file the manifest does not list",
                    str(path / info.relative_path),
                )
            md = metadata.state_dict_metadata.get(index.fqn)
            if not isinstance(md, TensorStorageMetadata):
                continue
            offsets = tuple(int(o) for o in (index.offset or ()))
            by_offsets = chunk_specs.get(index.fqn)
            if by_offsets is None:  # (a dict per entry: N ranks' chunks found in O(N), not O(N^2))
                by_offsets = chunk_specs[index.fqn] = {tuple(int(o) for o in c.offsets): c for c in md.chunks}
            chunk = by_offsets.get(offsets)
            if chunk is None:
                raise CorruptCheckpointError(f"{where}: entry {index.fqn!r} has no chunk at offsets {offsets}", where)
            chunks.setdefault(index.fqn, []).append(_Chunk(offsets, tuple(int(s) for s in chunk.sizes), info))
        paths = typed_entry_paths(metadata, {}, where)
        entries: list[tuple[tuple[str, int], TensorEntry]] = []
        self.skipped: list[str] = []
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                self.skipped.append(fqn)
                continue
            shape = tuple(int(s) for s in md.size)
            dtype = md.properties.dtype
            if not isinstance(dtype, torch.dtype):
                raise CorruptCheckpointError(f"{where}: entry {fqn!r} has no dtype", where)
            mine = chunks.get(fqn, [])
            self._check_tiling(fqn, shape, mine, where)
            first = min((c.info.relative_path, c.info.offset) for c in mine) if mine else ("", 0)
            nbytes = _numel(shape) * dtype.itemsize
            entries.append((first, TensorEntry(fqn, paths[fqn][0], dtype, shape, nbytes)))
        entries.sort(key=lambda e: e[0])
        self.entries: list[TensorEntry] = [e for _, e in entries]
        self._chunks = chunks
        self._dir_fd: int | None = None
        self._files: dict[str, _File] = {}

    @staticmethod
    def _check_tiling(fqn: str, shape: tuple[int, ...], chunks: list[_Chunk], where: str) -> None:
        """The chunks lie inside the tensor, at distinct offsets, and their elements add
        up to the tensor's (a hole or an overlap would leave bytes unread)."""
        total = 0
        seen: set[tuple[int, ...]] = set()
        for c in chunks:
            if (
                len(c.offsets) != len(shape)
                or len(c.sizes) != len(shape)
                or any(o < 0 or s < 0 or o + s > d for o, s, d in zip(c.offsets, c.sizes, shape))
                or c.offsets in seen
            ):
                raise CorruptCheckpointError(f"{where}: entry {fqn!r} has a chunk outside its shape {shape}", where)
            seen.add(c.offsets)
            total += _numel(c.sizes)
        if total != _numel(shape) or (not chunks and _numel(shape)):
            raise CorruptCheckpointError(
                f"{where}: the chunks of entry {fqn!r} hold {total} elements, its shape {shape} has {_numel(shape)}",
                where,
            )

    def __enter__(self) -> CheckpointTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the data files (idempotent)."""
        for f in self._files.values():
            os.close(f.fd)
        self._files.clear()
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def _file(self, name: str) -> _File:
        f = self._files.get(name)
        if f is None:
            root = str(self.path)
            if self._dir_fd is None:
                self._dir_fd = LOCAL.open_dir(root)
            fd = LOCAL.open_file(self._dir_fd, root, check_file_name(name, METADATA_NAME))
            path = os.path.join(root, name)
            segments = None
            if self._manifest_files is not None:
                try:
                    segments = _checked_segments(self._manifest_files, name, path, os.fstat(fd).st_size)
                except BaseException:
                    os.close(fd)
                    raise
            f = self._files[name] = _File(fd, path, segments)
        return f

    def read(self, entry: TensorEntry) -> torch.Tensor:
        """The whole tensor of ``entry`` (a new contiguous CPU tensor of its saved dtype
        and global shape, ``entry.nbytes`` bytes), its chunks read and placed.

        Raises:
            CorruptCheckpointError: a record is not a tensor of its chunk's dtype and
                shape, a file ends early, or a checksum mismatches.
        """
        chunks = self._chunks.get(entry.fqn, [])
        whole = len(chunks) == 1 and chunks[0].sizes == entry.shape
        out = torch.empty(entry.shape, dtype=entry.dtype)
        for c in chunks:
            if whole:
                dest, placed = out, True
            elif all(o == 0 and s == d for o, s, d in zip(c.offsets[1:], c.sizes[1:], entry.shape[1:])):
                dest, placed = out.narrow(0, c.offsets[0], c.sizes[0]), True  # whole rows: contiguous
            else:
                dest, placed = torch.empty(c.sizes, dtype=entry.dtype), False
            self._read_chunk(entry, c, dest)
            if not placed:
                view = out
                for dim, (o, s) in enumerate(zip(c.offsets, c.sizes)):
                    view = view.narrow(dim, o, s)
                view.copy_(dest)
        return out

    def _read_chunk(self, entry: TensorEntry, chunk: _Chunk, dest: torch.Tensor) -> None:
        """Read one chunk's record into ``dest`` (contiguous, the chunk's shape)."""
        info = chunk.info
        f = self._file(info.relative_path)
        if info.transform_descriptors:
            raise CorruptCheckpointError(
                f"{f.path}: entry {entry.fqn!r} is stored with stream transforms "
                f"{list(info.transform_descriptors)}, which this reader does not apply",
                f.path,
            )
        framing = writer_framing(entry.dtype, chunk.sizes)
        if framing is not None and info.length == len(framing.prefix) + framing.nbytes + len(framing.suffix):
            head = bytearray(len(framing.prefix))
            f.read_into(info.offset, memoryview(head))
            if head == framing.prefix:
                tail = bytearray(len(framing.suffix))
                f.read_into(info.offset + len(head), tensor_memory(dest))
                f.read_into(info.offset + len(head) + framing.nbytes, memoryview(tail))
                if suffix_matches(memoryview(tail), framing):
                    return
        # Not our writer's framing (stock dcp.save): torch.load(weights_only=True) of the record.
        stream: Any
        if f.segments is not None:
            raw = bytearray(info.length)
            f.read_into(info.offset, memoryview(raw))
            stream = io.BytesIO(raw)
        else:
            stream = RecordStream(LocalFileReader(f.fd, f.path), info.offset, info.length)  # (f keeps the fd)
        tensor = torch_load_tensor(stream, f.path, entry.fqn)
        if tuple(tensor.shape) != chunk.sizes or tensor.dtype != entry.dtype:
            raise CorruptCheckpointError(
                f"{f.path}: the record of {entry.fqn!r} is a {tensor.dtype} tensor of shape {tuple(tensor.shape)}, "
                f"the metadata says {entry.dtype} {chunk.sizes}",
                f.path,
            )
        dest.copy_(tensor)

    def __iter__(self) -> Iterator[tuple[TensorEntry, torch.Tensor]]:
        """``(entry, tensor)`` for every entry, in :attr:`entries` order."""
        for entry in self.entries:
            yield entry, self.read(entry)

    def select(self, keep: Callable[[TensorEntry], bool]) -> list[TensorEntry]:
        """The entries ``keep`` accepts, in read order."""
        return [e for e in self.entries if keep(e)]
