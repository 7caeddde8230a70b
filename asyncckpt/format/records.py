"""The records file (``.records.json``): where each entry of a checkpoint lies, as JSON.

``load``'s direct path needs, per entry of the state_dict, one record: its file, byte
offset and length, and (for a tensor) its dtype and shape. DCP keeps this in
``.metadata``, a pickle of tens of objects per entry, slow to unpickle and check for
thousands of entries. The coordinator
therefore writes the same facts beside it at commit, when every entry is one record
(one chunk covering the whole tensor, or one ``BYTE_IO`` value: any unsharded state;
a sharded layout, with several chunks per tensor, gets no records file, and stock
``dcp.save`` never writes one)::

    {"format": "asyncckpt.records", "version": 1, "metadata_crc32": <crc32 of .metadata>,
     "files": {"__0_0.distcp": [[fqn, offset, length, "torch.float32", [4096, 64]],
                                [fqn, offset, length, null, null], ...], ...}}

(``null`` dtype and shape: a non-tensor value.) It is a cache of ``.metadata``, never
an authority: it is used only when it names the CRC-32 of the ``.metadata`` bytes in the
directory, is well formed in every field, and names only plain file names the manifest
lists; anything else and ``load`` reads ``.metadata`` as before. Stock DCP ignores it.
It is listed in the manifest with its checksum, like every file.

Orbax likewise keeps a JSON description of the saved tree (its ``_METADATA`` file)
beside the array data.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.metadata import Metadata

from asyncckpt.format.manifest import RECORDS_NAME, is_plain_name

__all__ = [
    "RECORDS_NAME",
    "RECORDS_FORMAT",
    "Record",
    "records_from_metadata",
    "records_json",
    "records_file",
    "parse_records",
    "json_bound_to",
    "plain_storage",
    "records_of",
]

RECORDS_FORMAT = "asyncckpt.records"
RECORDS_VERSION = 1

#: One entry's record: (file name, offset, length, dtype, shape) in bytes; dtype and
#: shape are ``None`` for a non-tensor (``BYTE_IO``) value.
Record = tuple[str, int, int, torch.dtype | None, tuple[int, ...] | None]

#: ``str(dtype)`` -> dtype, for every dtype of this torch.
_DTYPES: dict[str, torch.dtype] = {str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


def plain_storage(info: Any) -> bool:
    """Whether a ``storage_data`` entry is a plain record: no stream transforms, a
    non-negative int offset and length (what the files that cache ``.metadata`` hold)."""
    return (
        not info.transform_descriptors
        and type(info.offset) is int
        and type(info.length) is int
        and info.offset >= 0
        and info.length >= 0
    )


def records_from_metadata(metadata: Metadata) -> dict[str, Record] | None:
    """Every entry's record (fqn -> :data:`Record`), or ``None`` if an entry is not one
    record: several chunks or a chunk that is not the whole tensor (a sharded save),
    stream transforms, an entry without storage, an unknown kind of entry.

    Costs a few attribute reads per entry (no I/O).
    """
    md_all = metadata.state_dict_metadata
    tensor_md, bytes_md = _md.TensorStorageMetadata, _md.BytesStorageMetadata
    out: dict[str, Record] = {}
    for index, info in metadata.storage_data.items():
        fqn, md = index.fqn, md_all.get(index.fqn)
        if fqn in out or not plain_storage(info):
            return None
        if type(md) is bytes_md:
            if index.offset is not None:
                return None
            out[fqn] = (info.relative_path, info.offset, info.length, None, None)
        elif type(md) is tensor_md:
            shape = tuple(md.size)
            chunks = md.chunks
            if (
                len(chunks) != 1
                or any(chunks[0].offsets)
                or tuple(chunks[0].sizes) != shape
                or index.offset is None
                or any(index.offset)
            ):
                return None
            out[fqn] = (info.relative_path, info.offset, info.length, md.properties.dtype, shape)
        else:
            return None
    return out if len(out) == len(md_all) else None


def records_json(records: Mapping[str, Record]) -> str:
    """The ``"files"`` value of the records file (compact JSON; each file's records in
    file order)."""
    files: dict[str, list[list[Any]]] = {}
    for fqn, (name, offset, length, dtype, shape) in records.items():
        files.setdefault(name, []).append(
            [fqn, offset, length, None if dtype is None else str(dtype), None if shape is None else list(shape)]
        )
    for rows in files.values():
        rows.sort(key=lambda row: row[1])
    return json.dumps(dict(sorted(files.items())), separators=(",", ":"))


def records_file(files_json: str, metadata_crc32: int) -> bytes:
    """The records file's bytes, bound to the ``.metadata`` whose CRC-32 is given."""
    return (
        f'{{"format":"{RECORDS_FORMAT}","version":{RECORDS_VERSION},'
        f'"metadata_crc32":{metadata_crc32},"files":{files_json}}}'
    ).encode()


def parse_records(data: bytes, metadata_crc32: int, listed: Mapping[str, Any]) -> dict[str, Record] | None:
    """The records of a records file's ``data``, or ``None`` when it cannot stand for the
    ``.metadata`` at hand: not JSON, another format or version, a ``metadata_crc32``
    other than ``metadata_crc32``, a file name that is not plain or not in ``listed``
    (the manifest's files), a malformed field, an fqn twice, an unknown dtype.
    Never raises on bad input (the caller then reads ``.metadata``)."""
    obj = json_bound_to(data, RECORDS_FORMAT, RECORDS_VERSION, metadata_crc32, ("files",))
    return None if obj is None else records_of(obj["files"], listed)


def json_bound_to(
    data: bytes, fmt: str, version: int, metadata_crc32: int, fields: tuple[str, ...]
) -> dict[str, Any] | None:
    """``data`` as a JSON object of format ``fmt`` and ``version`` that names
    ``metadata_crc32`` and has a JSON object at each of ``fields``; else ``None`` (also
    for bytes that are not JSON). Shared by the files that cache ``.metadata``."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if (
        type(obj) is not dict
        or obj.get("format") != fmt
        or obj.get("version") != version
        or type(obj.get("metadata_crc32")) is not int
        or obj["metadata_crc32"] != metadata_crc32
        or any(type(obj.get(f)) is not dict for f in fields)
    ):
        return None
    return obj


def records_of(files: Mapping[str, Any], listed: Mapping[str, Any]) -> dict[str, Record] | None:
    """The records of a records file's ``"files"`` value (file name -> rows ``[fqn,
    offset, length, dtype, shape]``), or ``None`` on a file name that is not plain or
    not in ``listed``, a malformed field, an fqn twice, an unknown dtype."""
    out: dict[str, Record] = {}
    for name, rows in files.items():
        if not is_plain_name(name) or name not in listed or type(rows) is not list:
            return None
        for row in rows:
            if type(row) is not list or len(row) != 5:
                return None
            fqn, offset, length, dtype, shape = row
            if (
                type(fqn) is not str
                or fqn in out
                or type(offset) is not int
                or type(length) is not int
                or offset < 0
                or length < 0
            ):
                return None
            if dtype is None:
                if shape is not None:
                    return None
                out[fqn] = (name, offset, length, None, None)
                continue
            dt = _DTYPES.get(dtype) if type(dtype) is str else None
            if dt is None or type(shape) is not list or not all(type(s) is int and s >= 0 for s in shape):
                return None
            out[fqn] = (name, offset, length, dt, tuple(shape))
    return out
