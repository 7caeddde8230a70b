"""The direct load path: records read straight into the state_dict's tensors.

:func:`plan_direct_load` and :func:`direct_load` are the direct path of
``asyncckpt.load`` for the common case (the state_dict has the checkpoint's keys,
dtypes and shapes): no DCP load planning, few large ``preadv`` calls straight into
the target tensors, and, given the manifest, the CRC-32 of each manifest segment read
checked on the way, from any tier (:class:`asyncckpt.io.storage.FileReader`). It finds the records in ``.records.json``
(:mod:`asyncckpt.format.records`, ``SafeFileSystemReader.read_records``) when that
file stands for the ``.metadata`` in the directory, without unpickling anything.
Anything else goes DCP's way (:mod:`asyncckpt.loading.dcp`).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import itertools
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import Metadata

from asyncckpt._gc import gc_paused
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.crc import CrcChain
from asyncckpt.format.manifest import METADATA_NAME, run_in_order
from asyncckpt.format.records import Record, plain_storage, records_from_metadata
from asyncckpt.format.shards import Chunk, ShardIndex
from asyncckpt.format.torchsave import TensorFraming
from asyncckpt.io.storage import IOV_MAX, LOCAL, FileReader, ReadableStorage
from asyncckpt.loading.dcp import set_value
from asyncckpt.loading.framing import (
    RecordStream,
    suffix_matches,
    torch_load_tensor,
    writer_framing,
)
from asyncckpt.loading.metadata import check_file_name

__all__ = ["DirectPlan", "ShardCatalog", "plan_direct_load", "direct_load", "local_shard"]

#: Buffers per read call at most (``preadv``'s limit, Linux ``IOV_MAX``).
_IOV_MAX = IOV_MAX
#: Without manifest segments (``verify=False``), adjacent records are read together up
#: to this many bytes per read (a record larger than this is one read of its own).
_UNIT_BYTES = 16 << 20
#: A file's consecutive reads are gathered into read calls of up to this many bytes
#: (or the file reader's ``batch_bytes``), across records and manifest segments, each
#: handed to the CRC helper thread once read. Large calls keep more of the disk busy
#: (see the benchmark's load rows).
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


def plan_direct_load(
    state_dict: dict[str, Any], metadata: Metadata | Mapping[str, Record] | ShardCatalog | None
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
            the records file: :mod:`asyncckpt.format.records`), or this rank's
            :class:`ShardCatalog` (a sharded checkpoint); ``None``: no records.

    Costs one dict lookup and a few comparisons per entry (no collective, no I/O).
    """
    with gc_paused():
        if isinstance(metadata, ShardCatalog):
            return _plan_shards(state_dict, metadata, len(metadata.index.entries))
        if not isinstance(metadata, Metadata):
            return None if metadata is None else _plan_direct(state_dict, metadata)
        records = records_from_metadata(metadata)
        if records is not None:
            return _plan_direct(state_dict, records)
        return _plan_shards(state_dict, _MetadataCatalog(metadata), len(metadata.state_dict_metadata))


def local_shard(obj: Any) -> torch.Tensor | None:
    """A DTensor's local shard as a plain tensor, the DTensor's own memory (a load into
    it fills the DTensor); ``None`` for anything that is not a DTensor.

    Its ``_local_tensor``, the same object every time and no autograd node
    (``to_local()`` costs an autograd ``Function`` call, about 20 us, per tensor:
    milliseconds for an LLM state); ``to_local().detach()`` where it has none.
    """
    module = sys.modules.get("torch.distributed.tensor")  # (not imported: no DTensor exists)
    if module is None or not isinstance(obj, module.DTensor):
        return None
    shard = getattr(obj, "_local_tensor", None)
    return shard if isinstance(shard, torch.Tensor) else obj.to_local().detach()


class ShardCatalog:
    """Where a rank's own chunks of a sharded checkpoint lie, from its shard index
    (:mod:`asyncckpt.format.shards`) and the chunk lines of its own data files: what
    :func:`plan_direct_load` needs of ``.metadata`` for a resume with the same sharding,
    without it.

    Args:
        index: the parsed ``.shards.json``.
        chunks: the chunks of the lines read (:func:`asyncckpt.format.shards.parse_chunks`),
            with the data file each lies in.
    """

    def __init__(self, index: ShardIndex, chunks: list[tuple[str, Chunk]]) -> None:
        self.index = index
        self._chunks = {(c[0], c[1]): (name, c[2], c[3], c[4]) for name, c in chunks}

    def entry(self, fqn: str) -> Any:
        """``(dtype, global shape)``, :data:`_BYTES` for a value, ``None``: not listed."""
        entry = self.index.entries.get(fqn, _MISSING)
        return None if entry is _MISSING else _BYTES if entry is None else entry

    def storage(
        self, fqn: str, offsets: tuple[int, ...] | None, sizes: tuple[int, ...] | None
    ) -> tuple[str, int, int] | None:
        """The file, offset and length of the chunk of ``fqn`` at ``offsets`` of
        ``sizes`` (``None``, ``None``: a value), or ``None`` if it is not known here."""
        record = self.index.records.get(fqn)
        if record is not None:
            whole = offsets is None or (not any(offsets) and sizes == record[4])
            return record[:3] if whole else None
        if offsets is None:
            return None
        found = self._chunks.get((fqn, offsets))
        if found is None or found[1] != sizes:
            return None
        return found[0], found[2], found[3]


#: :meth:`ShardCatalog.entry` of a non-tensor value.
_BYTES = object()
_MISSING = object()


class _MetadataCatalog:
    """:class:`ShardCatalog`'s two lookups over DCP ``Metadata`` (every rank's chunks)."""

    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata

    def entry(self, fqn: str) -> Any:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        md = self.metadata.state_dict_metadata.get(fqn)
        if type(md) is BytesStorageMetadata:
            return _BYTES
        if type(md) is TensorStorageMetadata:
            return md.properties.dtype, tuple(md.size)
        return None

    def storage(
        self, fqn: str, offsets: tuple[int, ...] | None, sizes: tuple[int, ...] | None
    ) -> tuple[str, int, int] | None:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        if offsets is None:
            index = MetadataIndex(fqn)
        else:
            md: Any = self.metadata.state_dict_metadata[fqn]
            if not any(tuple(c.offsets) == offsets and tuple(c.sizes) == sizes for c in md.chunks):
                return None
            index = MetadataIndex(fqn, torch.Size(offsets))
        info = self.metadata.storage_data.get(index)
        if info is None or not plain_storage(info):
            return None
        return info.relative_path, info.offset, info.length


def _plan_shards(
    state_dict: dict[str, Any], catalog: ShardCatalog | _MetadataCatalog, entries: int
) -> DirectPlan | None:
    """The direct plan of a sharded checkpoint loaded with the sharding it was saved
    with (a resume on the same world size and mesh): every DTensor's local shard is one
    saved chunk (the same global offsets and sizes), read into the shard itself; plain
    tensors and values are one record each, as :func:`_plan_direct` wants. ``None``
    for anything else (resharding, a shard that is several chunks or part of one, a
    chunk the catalog does not hold): DCP's planner handles it. ``catalog``: where the
    checkpoint's ``entries`` entries lie (``.metadata``, or this rank's shard index).
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state_dict)
    if len(flat) != entries or not any(local_shard(v) is not None for v in flat.values()):
        return None
    records: dict[str, Record] = {}
    # A shard's chunk depends on the global shape, the placements and the mesh only: an
    # LLM's thousand DTensors have a few dozen of them (torch computes each in ~60 us).
    chunk_of: dict[tuple[Any, ...], list[Any]] = {}
    for fqn, obj in flat.items():
        entry = catalog.entry(fqn)
        shard = local_shard(obj)
        offsets: tuple[int, ...] | None = None
        shape: tuple[int, ...] | None = None
        dtype = None
        if entry is _BYTES:
            pass
        elif entry is not None and isinstance(obj, torch.Tensor):
            dtype, size = entry
            if size != tuple(obj.shape) or dtype != obj.dtype:
                return None
            if shard is not None:
                key = (tuple(obj.shape), tuple(obj.placements), id(obj.device_mesh))  # type: ignore[attr-defined]
                chunks = chunk_of.get(key)
                if chunks is None:
                    chunks = chunk_of[key] = obj.__create_chunk_list__()  # type: ignore[attr-defined]
                if len(chunks) != 1:
                    return None
                offsets, shape = tuple(chunks[0].offsets), tuple(chunks[0].sizes)
                if tuple(shard.shape) != shape:
                    return None
            else:
                offsets, shape = (0,) * len(size), size
        else:
            return None
        where = catalog.storage(fqn, offsets, shape)
        if where is None:
            return None
        records[fqn] = (*where, dtype, shape)
    return _plan_direct(state_dict, records)


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
        shard = local_shard(obj)
        if shard is not None:  # (a DTensor: its record is its local shard's chunk, :func:`_plan_shards`)
            obj = shard
        if dtype is None:  # a value
            if isinstance(obj, torch.Tensor):
                return None
            framing = None
        else:
            if not _plain_tensor(obj) or obj.dtype != dtype or tuple(obj.shape) != shape:
                return None
            framing = writer_framing(dtype, shape)
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
        if any(a.offset + a.length > b.offset for a, b in itertools.pairwise(entries)):
            return None
    return DirectPlan(files, mappings, nbytes, state_dict)


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
                parts.append(piece[lo - start : hi - start])
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
            views.append(scratch[cursor : cursor + part])
            cursor += part
        else:
            views.append(part)
    return views


def _read_file(reader: FileReader, reads: list[tuple[_Unit, list[_Landing]]], note: str) -> None:
    """Read one file's ``reads`` in file order, on this thread: one sequential reader per
    file keeps the kernel's readahead going (several threads reading one file at
    different offsets defeat it). Consecutive reads are gathered into read calls
    (``reader.readinto``: one ``preadv`` locally, ranged GETs in parallel from an object
    store) of up to ``reader.batch_bytes``. With verification each call's bytes are checksummed
    on a helper thread (:class:`~asyncckpt.format.crc.CrcChain`), unit by unit, while
    the next call reads; the first mismatch stops the reads.

    Raises:
        CorruptCheckpointError: a read came short, or a unit's CRC-32 is not the
            manifest's (naming the bytes and the entries in them, plus ``note``).
    """

    path, read_bytes = reader.path, reader.batch_bytes or _READ_BYTES

    def mismatch(read: tuple[_Unit, list[_Landing]], crc: int) -> CorruptCheckpointError:
        unit, landings = read
        keys = [la.entry.fqn for la in landings]
        return CorruptCheckpointError(
            f"{path}: checksum mismatch in bytes [{unit.lo}, {unit.hi}) (crc32 {crc:08x}, "
            f"manifest {unit.crc:08x}), holding state_dict entries {keys[:4]}"
            + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
            + note,
            path,
        )

    lo = n = count = 0  # the call being gathered: file bytes [lo, lo + n) in count buffers
    # Its buffers, per read: (the read, its buffers in this call, whether it ends in it).
    parts: list[tuple[tuple[_Unit, list[_Landing]], list[memoryview], bool]] = []

    def flush(chain: CrcChain | None) -> None:
        nonlocal lo, n, count
        reader.readinto(lo, [v for _, views, _ in parts for v in views])
        if chain is not None:
            chain.feed(
                [
                    (views, (read, read[0].crc) if last else None)
                    for read, views, last in parts
                    if read[0].crc is not None
                ]
            )
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
                for piece in (
                    (v,) if len(v) <= read_bytes else (v[i : i + read_bytes] for i in range(0, len(v), read_bytes))
                ):
                    if n and (n + len(piece) > read_bytes or count >= _IOV_MAX):
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


def direct_load(
    plan: DirectPlan,
    root: str,
    manifest_files: dict[str, Any] | None,
    *,
    decode: Any,
    threads: int | None = None,
    storage: ReadableStorage = LOCAL,
) -> float:
    """Read ``plan``'s records into their targets: the direct path of ``asyncckpt.load``.

    Per data file, the records are read in file order with few large reads (``preadv``
    calls locally, parallel ranged GETs from an object store: the tier's
    :class:`~asyncckpt.io.storage.FileReader`)
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
        root: the checkpoint directory (or URL).
        manifest_files: the manifest's ``files`` to check every read against (sizes and
            the CRC-32 of each segment read); ``None`` reads without checking.
        decode: ``decode(fqn, value: io.BytesIO) -> object`` for non-tensor values.
        threads: files read at once (default: up to 4, at most the CPU count).
        storage: the tier the checkpoint is read from (its ``open_checkpoint(root)``).

    Returns:
        Seconds spent copying into the targets after the reads (temporaries: targets
        that are not contiguous CPU tensors, e.g. CUDA ones; the framing check).

    Raises:
        CorruptCheckpointError: a file is missing, not a regular file, of the wrong size,
            shorter than a record, or a segment's CRC-32 does not match (naming the
            file, the bytes and the entries in them; the tensors of those bytes may then
            hold the bad bytes).
        CheckpointError: from ``decode`` (a value that needs ``allow_pickle``).
    """
    if threads is None:
        threads = min(4, os.cpu_count() or 1)
    checkpoint = storage.open_checkpoint(root)
    fds: dict[str, FileReader] = {}
    try:
        value_work: list[tuple[int, str, _Unit, list[_Landing]]] = []  # (order, file, read, its landings)
        tensor_work: list[tuple[int, str, _Unit, list[_Landing]]] = []
        all_landings: list[tuple[str, _Landing]] = []
        for name in sorted(plan.files):
            entries = plan.files[name]
            reader = fds[name] = checkpoint.open(check_file_name(name, METADATA_NAME))
            path = reader.path
            size = reader.size
            segments = None if manifest_files is None else _checked_segments(manifest_files, name, path, size)
            last = entries[-1]
            if last.offset + last.length > size:
                raise CorruptCheckpointError(
                    f"{path}: entry {last.fqn!r} lies past the end of the file (up to byte "
                    f"{last.offset + last.length}, the file has {size} bytes)",
                    path,
                )
            units = _units(entries, segments)
            # The reads holding a value go first, before any target is written: the
            # tensors in them land in temporaries.
            value_units = {
                i
                for e in entries
                if e.framing is None
                for i, u in enumerate(units)
                if u.lo < e.offset + e.length and u.hi > e.offset
            }
            # The framing of all tensor records in one buffer (a slice each).
            frames = memoryview(
                bytearray(sum(len(e.framing.prefix) + len(e.framing.suffix) for e in entries if e.framing is not None))
            )
            landings = []
            pos = 0
            with gc_paused():  # thousands of ctypes views: no full collection in between
                for e in entries:
                    n = 0 if e.framing is None else len(e.framing.prefix) + len(e.framing.suffix)
                    direct = not any(units[i].lo < e.offset + e.length and units[i].hi > e.offset for i in value_units)
                    landings.append(_land(e, direct, frames[pos : pos + n]))
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
                _read_file(fds[name], reads, note)

            run_in_order(tasks, one, threads, "asyncckpt-load")

        # 1. Values (and the tensors sharing their reads, into temporaries), decoded.
        run(value_work)
        values = [
            (la.entry.fqn, decode(la.entry.fqn, io.BytesIO(la.head)))
            for _, la in all_landings
            if la.entry.framing is None
        ]
        # 2. Tensors, straight into their targets where they can.
        run(tensor_work, "; tensors of the state_dict may already hold bytes of this checkpoint")
        # 3. Framing check (a record not in our framing is read the general way);
        #    temporaries copied into their targets.
        copying = time.monotonic()
        for name, la in all_landings:
            e, f = la.entry, la.entry.framing
            if f is None:
                continue
            assert e.target is not None
            if la.head.tobytes() == f.prefix and suffix_matches(la.tail, f):
                if la.temp is not None:
                    e.target.detach().copy_(la.temp)
            else:
                e.target.detach().copy_(_load_foreign(fds[name], e))
    finally:
        for reader in fds.values():
            reader.close()
        checkpoint.close()
    for fqn, obj in values:
        set_value(plan.state_dict, plan.mappings[fqn], obj)
    return time.monotonic() - copying


def _load_foreign(reader: FileReader, entry: _Entry) -> torch.Tensor:
    """A tensor record that is not in our writer's framing: ``torch.load(weights_only=True)``
    of the record, as DCP's ``FileSystemReader`` reads it.

    Raises:
        CorruptCheckpointError: not a tensor archive, or not the target's dtype and shape.
    """
    path = reader.path
    tensor = torch_load_tensor(RecordStream(reader, entry.offset, entry.length), path, entry.fqn)
    assert entry.target is not None
    if tensor.size() != entry.target.size():
        raise CorruptCheckpointError(
            f"{path}: entry {entry.fqn!r} has size {tuple(tensor.size())}, expected {tuple(entry.target.size())}", path
        )
    return tensor
