"""DCP's load path, safe: a ``LoadPlanner`` and a ``StorageReader`` for ``dcp.load``.

:class:`SafeLoadPlanner` is ``DefaultLoadPlanner`` whose non-tensor values load with
``torch.load(..., weights_only=True)`` unless the caller opts in (``allow_pickle=True``);
stock DCP's ``DefaultLoadPlanner.load_bytes`` uses ``weights_only=False``. They are
all decoded before any tensor of the state_dict is written, so a refused value leaves
the state_dict unchanged.

:class:`SafeFileSystemReader` is ``FileSystemReader`` reading ``.metadata`` with the
restricted unpickler (:mod:`asyncckpt.loading.metadata`), every data file through the
tier (:class:`asyncckpt.io.storage.Storage`: relative to the directory, never through
a symlink), and our writer's tensor records raw (:mod:`asyncckpt.loading.framing`).
Data integrity is the manifest's job (``verify_checkpoint``), not this module's.
"""

from __future__ import annotations

import bisect
import ctypes
import io
import os
import pickle
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

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
from asyncckpt.format.crc import crc32
from asyncckpt.format.manifest import CHUNKS_NAME, METADATA_NAME, SHARDS_NAME
from asyncckpt.format.records import RECORDS_NAME, Record, parse_records
from asyncckpt.format.shards import Chunk, ShardIndex, parse_chunks, parse_shards
from asyncckpt.io.storage import LOCAL, FileReader, ReadableStorage
from asyncckpt.loading.framing import (
    RecordStream,
    pread,
    read_record,
    suffix_matches,
    tensor_from,
    torch_load_tensor,
    writer_framing,
)
from asyncckpt.loading.metadata import check_file_name, read_metadata, validate_metadata

__all__ = ["SafeLoadPlanner", "SafeFileSystemReader", "set_value"]

#: Records up to this size are read with one ``pread``; larger ones in three.
_SMALL_RECORD_BYTES = 1 << 20
#: Records with at least this many data bytes are read straight into the destination.
_DIRECT_READ_BYTES = 64 << 10
#: A remote file's read-ahead window reads across gaps up to this many bytes between
#: the records the plan asks for (one GET instead of two).
_WINDOW_GAP_BYTES = 1 << 20


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
                    "torch.serialization.safe_globals([...])"
                ) from None
            raise CorruptCheckpointError(f"state_dict entry {fqn!r} cannot be unpickled: {exc}") from exc
        except Exception as exc:
            raise CorruptCheckpointError(
                f"state_dict entry {fqn!r} cannot be read: {type(exc).__name__}: {exc}"
            ) from exc

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
    cast(Any, parent)[key] = value


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
                actual = crc32(memoryview(data)[offset : offset + length])
            if actual != crc:
                return False
    except (KeyError, TypeError, ValueError):
        return False
    return True


class _ReadAhead:
    """A :class:`~asyncckpt.io.storage.FileReader` over a remote one (whose
    ``batch_bytes`` asks for large reads: an object store) for DCP's record-by-record
    reads: the byte ranges the plan will ask for (``ranges``, ``(offset, length)``),
    gathered in file order into windows of about ``batch_bytes`` (across gaps up to
    :data:`_WINDOW_GAP_BYTES`), each read with one ``readinto`` (parallel ranged GETs),
    the records then copied out of it. One GET per record would cost a round trip each.

    With ``segments`` (the manifest's ``[offset, length, crc32]`` of the file) every
    window is widened to whole segments and their CRC-32s checked as it arrives, so
    that a rank checks the bytes it reads, and only those.
    """

    def __init__(
        self, reader: FileReader, ranges: Iterable[tuple[int, int]], segments: Sequence[Sequence[int]] | None
    ) -> None:
        self._reader, self.path, self.size = reader, reader.path, reader.size
        self.batch_bytes = reader.batch_bytes
        self._ranges = sorted(ranges)
        self._starts = [r[0] for r in self._ranges]
        self._segments = segments
        self._seg_starts = [int(seg[0]) for seg in segments] if segments is not None else []
        self._lo = 0
        self._window: memoryview | None = None

    def readinto(self, offset: int, buffers: Sequence[memoryview]) -> None:
        end = offset + sum(len(b) for b in buffers)
        window = self._window
        if window is None or not (self._lo <= offset and end <= self._lo + len(window)):
            if self._segments is None and end - offset >= self.batch_bytes:
                self._reader.readinto(offset, buffers)  # large enough on its own
                return
            window = self._fill(offset, end)
        pos = offset - self._lo
        for b in buffers:
            b[:] = window[pos : pos + len(b)]
            pos += len(b)

    def _fill(self, offset: int, end: int) -> memoryview:
        lo, hi = offset, end
        for r_off, r_len in self._ranges[bisect.bisect_left(self._starts, offset) :]:
            if r_off - hi > _WINDOW_GAP_BYTES or r_off + r_len - lo > self.batch_bytes:
                break
            hi = max(hi, r_off + r_len)
        segments = self._segments
        first = last = 0
        if segments is not None:  # whole segments: each checked as the window arrives
            first = max(0, bisect.bisect_right(self._seg_starts, lo) - 1)
            last = max(first, bisect.bisect_left(self._seg_starts, hi) - 1)
            lo = min(lo, int(segments[first][0]))
            hi = max(hi, int(segments[last][0]) + int(segments[last][1]))
        hi = min(hi, max(end, self.size))  # (a record past the end: the reader says so)
        self._window = None
        window = memoryview(bytearray(hi - lo))
        self._reader.readinto(lo, [window])
        if segments is not None:
            for seg_off, seg_len, expected in segments[first : last + 1]:
                actual = crc32(window[seg_off - lo : seg_off - lo + seg_len])
                if actual != expected:
                    raise CorruptCheckpointError(
                        f"{self.path}: checksum mismatch in bytes [{seg_off}, {seg_off + seg_len}) "
                        f"(crc32 {actual:08x}, manifest {expected:08x})",
                        self.path,
                    )
        self._lo, self._window = lo, window
        return window

    def close(self) -> None:
        self._window = None
        self._reader.close()


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that checks every path and never follows a symlink.

    ``read_metadata`` is :func:`read_metadata` (restricted unpickling, paths checked),
    cached so that a caller may read and check it before ``dcp.load`` runs.
    ``read_data`` opens data files relative to the directory with ``O_NOFOLLOW``,
    decodes every non-tensor value (through the planner's ``decode_bytes`` when it
    has one, see :class:`SafeLoadPlanner`) before writing any tensor, and copies our
    writer's tensor records without a per-tensor ``torch.load``.

    Args:
        path: the checkpoint directory (or URL, with its ``storage``).
        _extension_registry: as ``FileSystemReader``'s (stream transforms).
        storage: the tier the checkpoint is read from (every file through its
            ``open_checkpoint``: descriptors locally, ranged GETs from an object store).
    """

    def __init__(
        self, path: str | os.PathLike, _extension_registry: Any = None, *, storage: ReadableStorage = LOCAL
    ) -> None:
        super().__init__(path, _extension_registry)
        self._metadata: Metadata | None = None
        self.storage = storage
        # DCP keeps ``path`` as a Path (which folds the ``//`` of a URL): ours, as given.
        self.root = os.fspath(path)
        #: The manifest's ``files``: with a remote tier, the CRC-32 of every segment read
        #: is checked as it arrives (``verify="inline"``); ``None``: not here.
        self.inline_files: Mapping[str, Any] | None = None

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
            self._metadata = read_metadata(self.root, self.storage)
        metadata = self._metadata
        meta = getattr(metadata, "storage_meta", None)
        if meta is None:
            meta = metadata.storage_meta = StorageMeta()
        meta.load_id = self.load_id
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
                path = os.path.join(self.root, name)
                raise CorruptCheckpointError(f"{METADATA_NAME} names {name!r}, a file the manifest does not list", path)

    def read_records(self, manifest_files: Mapping[str, Any], strict: bool = False) -> dict[str, Record] | None:
        """The records of the records file (:mod:`asyncckpt.format.records`), when the
        manifest lists one and it stands for this directory's ``.metadata``; else
        ``None``: read :meth:`read_metadata`.

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
        checksums. A file that does not match its checksum is named in a warning, and
        ``None`` returned; ``strict`` (a verifying load, which then needs no check of
        its own of these files): raised, as is a file that cannot be read.

        Raises:
            CorruptCheckpointError: ``strict``, and a file is missing, unreadable or
                does not match the manifest.
        """
        if RECORDS_NAME not in manifest_files or METADATA_NAME not in manifest_files:
            return None
        try:
            checkpoint = self.storage.open_checkpoint(self.root)
            try:
                data = {name: checkpoint.read_bytes(name) for name in (RECORDS_NAME, METADATA_NAME)}
            finally:
                checkpoint.close()
        except (CorruptCheckpointError, OSError) as exc:
            if strict:
                raise CorruptCheckpointError(
                    f"{self.root}: {type(exc).__name__}: {exc}", getattr(exc, "path", None) or self.root
                ) from exc
            return None
        metadata_crc = crc32(data[METADATA_NAME])
        bad = [
            name
            for name, whole in ((RECORDS_NAME, None), (METADATA_NAME, metadata_crc))
            if not _as_listed(data[name], manifest_files[name], whole)
        ]
        if bad:
            if strict:
                raise CorruptCheckpointError(
                    f"{self.root}: {' and '.join(bad)} not as the manifest lists (size or checksum)",
                    os.path.join(self.root, bad[0]),
                )
            warnings.warn(
                f"{self.root}: {RECORDS_NAME} or {METADATA_NAME} does not match the manifest's "
                f"checksum; {RECORDS_NAME} ignored, {METADATA_NAME} read instead",
                UserWarning,
                stacklevel=2,
            )
            return None
        return parse_records(data[RECORDS_NAME], metadata_crc, manifest_files)

    def read_shards(
        self, manifest_files: Mapping[str, Any], rank: int, strict: bool = False
    ) -> tuple[ShardIndex, list[tuple[str, Chunk]]] | None:
        """The shard index (:mod:`asyncckpt.format.shards`) and the chunks of ``rank``'s
        own data files (``__<rank>_*.distcp``) and of the files the index names for it
        (:meth:`~asyncckpt.format.shards.ShardIndex.files_of`; one ranged read of the
        chunk file each), when the manifest lists both files and the index stands for
        this directory's ``.metadata``; else ``None``: read :meth:`read_metadata`.

        It stands for it when it names the CRC-32 that the manifest lists for
        ``.metadata`` (a single segment: the file whole; ``.metadata`` itself is not
        read), it has the size and CRC-32 the manifest lists for it, and each line
        read has the CRC-32 the index gives it. An index or a line that does not match
        its checksum (or lies past the end of its file) is named in a warning, and
        ``None`` returned; ``strict``: raised, as the corruption it is. Anything else
        (an index of another format, a malformed field) returns ``None``.

        Raises:
            CorruptCheckpointError: ``strict``, and the index or a line read does not
                match its checksum.
        """
        names = (SHARDS_NAME, CHUNKS_NAME, METADATA_NAME)
        if any(name not in manifest_files for name in names):
            return None
        try:
            (seg,) = manifest_files[METADATA_NAME]["segments"]
            if seg[0] != 0 or seg[1] != manifest_files[METADATA_NAME]["size"]:
                return None
            metadata_crc = int(seg[2])
            checkpoint = self.storage.open_checkpoint(self.root)
        except (CorruptCheckpointError, KeyError, TypeError, ValueError):
            return None
        try:
            data = checkpoint.read_bytes(SHARDS_NAME)
            if not _as_listed(data, manifest_files[SHARDS_NAME], None):
                self._damaged(f"{SHARDS_NAME} does not match the manifest's checksum", SHARDS_NAME, strict)
                return None
            index = parse_shards(data, metadata_crc, manifest_files)
            if index is None:
                return None
            chunks: list[tuple[str, Chunk]] = []
            reader = checkpoint.open(CHUNKS_NAME)
            try:
                for name in index.files_of(rank):
                    start, length, crc = index.chunks[name]
                    line = bytearray(length)
                    if start + length <= reader.size:
                        reader.readinto(start, [memoryview(line)])
                    if start + length > reader.size or crc32(line) != crc:
                        what = f"the line of {name} in {CHUNKS_NAME} does not match its checksum"
                        self._damaged(what, CHUNKS_NAME, strict)
                        return None
                    rows = parse_chunks(bytes(line), index)
                    if rows is None:
                        return None
                    chunks += [(name, row) for row in rows]
            finally:
                reader.close()
        except CorruptCheckpointError:
            if strict:
                raise
            return None
        except OSError:
            return None
        finally:
            checkpoint.close()
        return index, chunks

    def _damaged(self, what: str, name: str, strict: bool) -> None:
        """A shard index file that is not as committed: raised (``strict``), else a warning."""
        if strict:
            raise CorruptCheckpointError(f"{self.root}: {what}", os.path.join(self.root, name))
        warnings.warn(f"{self.root}: {what}; {METADATA_NAME} read instead", UserWarning, stacklevel=3)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        validate_metadata(metadata, os.path.join(self.root, METADATA_NAME))
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

    def _read_tensor(self, fd: FileReader, path: str, req: ReadItem, raw: bool = True) -> torch.Tensor:
        """The tensor of ``req``'s record: raw bytes if the record is ours (``raw``: try
        that), else ``torch.load`` on a stream over the record."""
        info: _StorageInfo = self.storage_data[req.storage_index]
        spec = None if info.transform_descriptors or not raw else self._chunk_spec(req.storage_index)
        framing = writer_framing(*spec) if spec is not None else None
        if framing is not None and spec is not None:
            head_n, data_n = len(framing.prefix), framing.nbytes
            if info.length == head_n + data_n + len(framing.suffix):
                if info.length <= _SMALL_RECORD_BYTES:
                    buf = pread(fd, info.length, info.offset, path)
                    view = memoryview(buf)
                    ok = view[:head_n] == framing.prefix and suffix_matches(view[head_n + data_n :], framing)
                    if ok:
                        return tensor_from(buf, head_n, data_n, spec[0], spec[1])
                    view.release()
                else:
                    buf = bytearray(data_n)
                    if read_record(fd, path, info.offset, framing, memoryview(buf)):
                        return tensor_from(buf, 0, data_n, spec[0], spec[1])
                del buf  # not ours: free it before torch.load allocates the tensor
        # Not our framing: what DCP's FileSystemReader does, weights_only.
        stream: Any = RecordStream(fd, info.offset, info.length)
        if info.transform_descriptors:
            transformed = self.transforms.transform_load_stream(req, info.transform_descriptors, stream)
            stream = io.BytesIO(transformed.read())  # torch.load needs a seekable stream
        return torch_load_tensor(stream, path, req.storage_index.fqn)

    def _read_into(self, fd: FileReader, path: str, req: ReadItem, target: torch.Tensor) -> bool | None:
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
        framing = writer_framing(*spec)
        if framing is None or target.numel() * target.element_size() != framing.nbytes:
            return False
        data_n = framing.nbytes
        if info.length != len(framing.prefix) + data_n + len(framing.suffix) or data_n < _DIRECT_READ_BYTES:
            return False
        # The target is written before the framing is checked; a record that turns
        # out not to be ours is then read again the general way, overwriting it.
        dest = memoryview((ctypes.c_char * data_n).from_address(target.data_ptr())).cast("B")
        return True if read_record(fd, path, info.offset, framing, dest) else None

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        root = self.root
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        decoded: list[tuple[ReadItem, Any]] = []
        raw_values: list[tuple[ReadItem, bytes]] = []
        checkpoint = self.storage.open_checkpoint(root)
        fds: dict[str, FileReader] = {}
        try:
            for name, reqs in per_file.items():
                reader = checkpoint.open(check_file_name(name, METADATA_NAME))
                if reader.batch_bytes:  # a remote tier: read ahead what the plan asks for
                    entry = None if self.inline_files is None else self.inline_files.get(name)
                    ranges = [(info.offset, info.length) for info in (self.storage_data[r.storage_index] for r in reqs)]
                    reader = _ReadAhead(reader, ranges, None if entry is None else entry["segments"])
                fds[name] = reader
            # 1. Non-tensor values, all decoded before any tensor is written.
            decode = getattr(planner, "decode_bytes", None)
            for name, reqs in per_file.items():
                for req in reqs:
                    if req.type != LoadItemType.BYTE_IO:
                        continue
                    info = self.storage_data[req.storage_index]
                    data = pread(fds[name], info.length, info.offset, os.path.join(root, name))
                    stream = self.transforms.transform_load_stream(
                        req, info.transform_descriptors or (), io.BytesIO(data)
                    )
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
                    tensor = narrow_tensor_by_index(
                        self._read_tensor(fds[name], path, req, raw=taken is not None), req.storage_offsets, req.lengths
                    )
                    if target.size() != tensor.size():
                        raise CorruptCheckpointError(
                            f"{path}: entry {req.storage_index.fqn!r} has size {tuple(tensor.size())}, "
                            f"expected {tuple(target.size())}",
                            path,
                        )
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)
        finally:
            for reader in fds.values():
                reader.close()
            checkpoint.close()
        # 3. Non-tensor values into the state_dict.
        set_value = getattr(planner, "set_value", None)
        for req, obj in decoded:
            assert set_value is not None
            set_value(req, obj)
        for req, raw in raw_values:
            planner.load_bytes(req, io.BytesIO(raw))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
