"""The shard index of a sharded checkpoint: where each rank finds its own chunks, as JSON.

A sharded save (FSDP2, tensor parallel: DTensors, several chunks per tensor) gets no
records file (:mod:`asyncckpt.format.records`): its entries are not one record each.
DCP keeps where every chunk lies in ``.metadata``, one pickle of every rank's chunks.
Every rank of a load unpickles all of it and plans over it, although a resume with the
sharding it was saved with reads only its own chunks: at W ranks and N tensors that is
W x N chunk objects on every rank (about 10 us each to unpickle: seconds, and gigabytes
of objects across a node, at a thousand ranks). The coordinator therefore writes the
same facts beside it at commit, cut so that a rank reads what it needs:

- ``.shards.json`` (:data:`SHARDS_NAME`), read whole by every rank, O(W + N)::

    {"format": "asyncckpt.shards", "version": 1, "metadata_crc32": <crc32 of .metadata>,
     "entries": {fqn: ["torch.float32", [4096, 64]] | null, ...},
     "records": {"__0_0.distcp": [[fqn, offset, length, dtype | null, shape | null], ...]},
     "chunks": {"__0_0.distcp": [start, length, crc32], ...},
     "peers": {"1": [0], ...}}

  ``entries``: every entry of the checkpoint, a tensor's dtype and global shape
  (``null``: a non-tensor value); ``records``: the entries stored as one record (values,
  and tensors saved whole, as in the records file); ``chunks``: per data file, the byte
  range and CRC-32 of its line in the chunk file; ``peers`` (optional, only ranks that
  have some): rank -> the other ranks whose files hold some of its chunks, where DCP
  wrote a chunk that several ranks hold once, in one of their files (HSDP: each shard
  on each of its replicas; :func:`asyncckpt.saving.planning.chunk_peers`).
- ``.shards.chunks.jsonl`` (:data:`CHUNKS_NAME`), one line per data file, each a JSON
  array of that file's chunks ``[fqn, offsets, sizes, offset, length]`` (the chunk's
  global offsets and sizes, the record's bytes in the file). A rank reads only the
  lines of its own data files (``__<rank>_*.distcp``) and of its ``peers``' files, O(N),
  with a ranged read each.

Like the records file it is a cache of ``.metadata``, never an authority: used only
when ``.shards.json`` has the size and CRC-32 the manifest lists, names the CRC-32 the
manifest lists for ``.metadata`` (so ``.metadata`` itself is not read), is well formed
in every field, and each line read has the CRC-32 the index gives it; anything else,
or a chunk that is not where the rank's shard needs it (another sharding, another
world size), and ``load`` reads ``.metadata`` as before. Stock DCP ignores both files;
both are in the manifest.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.metadata import Metadata

from asyncckpt.format.crc import crc32
from asyncckpt.format.manifest import CHUNKS_NAME, SHARDS_NAME, is_plain_name
from asyncckpt.format.records import _DTYPES, Record, json_bound_to, plain_storage, records_of

__all__ = ["SHARDS_NAME", "CHUNKS_NAME", "ShardIndex", "shard_files", "shards_file", "parse_shards", "parse_chunks"]

SHARDS_FORMAT = "asyncckpt.shards"
SHARDS_VERSION = 1
_MISSING = object()

#: One chunk of a data file: (fqn, global offsets, sizes, offset in the file, length).
Chunk = tuple[str, tuple[int, ...], tuple[int, ...], int, int]


def shard_files(metadata: Metadata, peers: Mapping[int, tuple[int, ...]] | None = None) -> tuple[str, bytes] | None:
    """The shard index of ``metadata`` without its binding to the ``.metadata`` bytes
    (``entries``, ``records``, ``chunks`` and ``peers`` as JSON, for :func:`shards_file`)
    and the chunk file's bytes; ``None`` when an entry cannot be described: stream transforms,
    an offset or length that is not a non-negative int, a chunk ``storage_data`` names
    that ``state_dict_metadata`` does not list, an entry without storage, an unknown kind.

    Costs a few attribute reads per chunk (no I/O).
    """
    md_all = metadata.state_dict_metadata
    tensor_md, bytes_md = _md.TensorStorageMetadata, _md.BytesStorageMetadata
    entries: dict[str, Any] = {}
    sizes_of: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}
    for fqn, md in md_all.items():
        if type(fqn) is not str:
            return None
        if type(md) is bytes_md:
            entries[fqn] = None
        elif type(md) is tensor_md:
            entries[fqn] = [str(md.properties.dtype), list(md.size)]
            sizes_of[fqn] = {tuple(c.offsets): tuple(c.sizes) for c in md.chunks}
        else:
            return None
    records: dict[str, list[list[Any]]] = {}
    chunks: dict[str, list[list[Any]]] = {}
    stored: set[str] = set()
    names: set[str] = set()  # checked once each (a file per rank, thousands of chunks each)
    for index, info in metadata.storage_data.items():
        fqn, name = index.fqn, info.relative_path
        if fqn not in entries or not plain_storage(info):
            return None
        if name not in names:
            if type(name) is not str or not is_plain_name(name):
                return None
            names.add(name)
        stored.add(fqn)
        entry = entries[fqn]
        if entry is None:
            if index.offset is not None:
                return None
            records.setdefault(name, []).append([fqn, info.offset, info.length, None, None])
            continue
        if index.offset is None:
            return None
        offsets = tuple(index.offset)
        sizes = sizes_of[fqn].get(offsets)
        if sizes is None:
            return None
        if len(sizes_of[fqn]) == 1 and not any(offsets) and list(sizes) == entry[1]:  # (saved whole)
            records.setdefault(name, []).append([fqn, info.offset, info.length, entry[0], entry[1]])
        else:
            chunks.setdefault(name, []).append([fqn, list(offsets), list(sizes), info.offset, info.length])
    if stored != entries.keys():
        return None
    lines, ranges, pos = [], {}, 0
    for name in sorted(chunks):
        rows = sorted(chunks[name], key=lambda row: row[3])
        line = (json.dumps(rows, separators=(",", ":")) + "\n").encode()
        ranges[name] = [pos, len(line), crc32(line)]
        lines.append(line)
        pos += len(line)
    for rows in records.values():
        rows.sort(key=lambda row: row[1])
    fields: dict[str, Any] = {"entries": entries, "records": dict(sorted(records.items())), "chunks": ranges}
    if peers:
        fields["peers"] = {str(rank): list(others) for rank, others in sorted(peers.items())}
    header = json.dumps(fields, separators=(",", ":"))
    return header[1:-1], b"".join(lines)


def shards_file(header: str, metadata_crc32: int) -> bytes:
    """``.shards.json``'s bytes: ``header`` (from :func:`shard_files`) bound to the
    ``.metadata`` whose CRC-32 is given."""
    return (
        f'{{"format":"{SHARDS_FORMAT}","version":{SHARDS_VERSION},"metadata_crc32":{metadata_crc32},{header}}}'
    ).encode()


@dataclass(frozen=True)
class ShardIndex:
    """A parsed ``.shards.json``.

    Attributes:
        entries: fqn -> ``(dtype, global shape)``, or ``None`` for a non-tensor value.
        records: fqn -> :data:`~asyncckpt.format.records.Record`, the entries stored
            as one record (a tensor's shape is then its global shape).
        chunks: data file name -> ``(start, length, crc32)`` of its line in the chunk file.
        peers: rank -> the other ranks whose files hold some of its chunks (only ranks
            that have some).
    """

    entries: dict[str, tuple[torch.dtype, tuple[int, ...]] | None]
    records: dict[str, Record]
    chunks: dict[str, tuple[int, int, int]]
    peers: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def files_of(self, rank: int) -> list[str]:
        """The data files whose lines hold ``rank``'s chunks: its own
        (``__<rank>_*.distcp``) and its peers', in name order."""
        prefixes = tuple(f"__{r}_" for r in (rank, *self.peers.get(rank, ())))
        return sorted(name for name in self.chunks if name.startswith(prefixes))


def _uint(v: Any) -> bool:
    return type(v) is int and v >= 0


def _shape(v: Any) -> tuple[int, ...] | None:
    return tuple(v) if type(v) is list and all(_uint(s) for s in v) else None


def parse_shards(data: bytes, metadata_crc32: int, listed: Mapping[str, Any]) -> ShardIndex | None:
    """The index in ``.shards.json``'s ``data``, or ``None`` when it cannot stand for the
    ``.metadata`` at hand: not JSON, another format or version, a ``metadata_crc32`` other
    than ``metadata_crc32``, a file name that is not plain or not in ``listed`` (the
    manifest's files), a malformed field, an fqn twice, an unknown dtype, a record of an
    entry not listed or of another dtype or shape. Never raises on bad input."""
    obj = json_bound_to(data, SHARDS_FORMAT, SHARDS_VERSION, metadata_crc32, ("entries", "records", "chunks"))
    if obj is None:
        return None
    entries: dict[str, tuple[torch.dtype, tuple[int, ...]] | None] = {}
    for fqn, entry in obj["entries"].items():
        if entry is None:
            entries[fqn] = None
            continue
        if type(entry) is not list or len(entry) != 2 or type(entry[0]) is not str:
            return None
        dtype, shape = _DTYPES.get(entry[0]), _shape(entry[1])
        if dtype is None or shape is None:
            return None
        entries[fqn] = (dtype, shape)
    records = records_of(obj["records"], listed)
    if records is None:
        return None
    for fqn, (_, _, _, dtype, shape) in records.items():  # (each of an entry, with its dtype and shape)
        entry = entries.get(fqn, _MISSING)
        if entry is _MISSING or entry != (None if dtype is None else (dtype, shape)):
            return None
    chunks: dict[str, tuple[int, int, int]] = {}
    for name, where in obj["chunks"].items():
        if not is_plain_name(name) or name not in listed or type(where) is not list or len(where) != 3:
            return None
        if not all(_uint(v) for v in where):
            return None
        chunks[name] = (where[0], where[1], where[2])
    peers: dict[int, tuple[int, ...]] = {}
    given = obj.get("peers", {})
    if type(given) is not dict:
        return None
    for rank, others in given.items():
        if (
            type(rank) is not str
            or not (rank.isascii() and rank.isdigit())
            or type(others) is not list
            or not all(_uint(r) for r in others)
        ):
            return None
        peers[int(rank)] = tuple(others)
    return ShardIndex(entries, records, chunks, peers)


def parse_chunks(line: bytes, index: ShardIndex) -> list[Chunk] | None:
    """The chunks of one line of the chunk file (its CRC-32 checked by the caller, against
    ``index.chunks``), or ``None`` when a row is malformed, names an entry that is not a
    tensor of the index, or does not fit inside that tensor's global shape. Never
    raises on bad input."""
    try:
        rows = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if type(rows) is not list:
        return None
    out: list[Chunk] = []
    for row in rows:
        if type(row) is not list or len(row) != 5:
            return None
        fqn, offsets, sizes, offset, length = row
        entry = index.entries.get(fqn) if type(fqn) is str else None
        at, size = _shape(offsets), _shape(sizes)
        if entry is None or at is None or size is None or not (_uint(offset) and _uint(length)):
            return None
        shape = entry[1]
        if len(at) != len(shape) or len(size) != len(shape) or any(a + s > g for a, s, g in zip(at, size, shape)):
            return None
        out.append((fqn, at, size, offset, length))
    return out
