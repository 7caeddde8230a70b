"""The byte framing of ``torch.save(tensor)``, built once per tensor layout.

``torch.distributed.checkpoint.FileSystemReader`` reads every tensor item of a
checkpoint with ``torch.load`` on a slice of a data file, so each tensor must be a
complete ``torch.save`` archive: a stored (uncompressed) zip with ``data.pkl``,
``byteorder``, the raw storage bytes (``data/0``, 64-byte aligned), ``version``...

``torch.save`` pickles and zips on every call. We build the framing once per
(dtype, shape) instead, byte for byte as ``torch.save`` writes it (PyTorch's
``caffe2/serialize/inline_container.cc`` over miniz, which it opens with
``MZ_ZIP_FLAG_WRITE_ZIP64``: data descriptors after each record, ``FB`` padding
extras for 64-byte alignment, zip64 end records), so the hot path only copies the raw
tensor bytes and patches two CRC-32 fields. Tests compare our framing with
``torch.save`` output for every dtype.

Records of 4 GiB and more (a large embedding, its Adam state) are framed as miniz
frames them, one record, no chunking (stock ``dcp.load`` reads each item with one
``torch.load``). A value that does not fit a 32-bit field, i.e. is at least
``0xFFFFFFFF`` (:data:`ZIP64_LIMIT`), moves into a zip64 extended-information extra
field (id ``0x0001``) of the record's local header and central directory entry:

- a size of ``0xFFFFFFFF`` bytes or more: the extra holds the uncompressed and the
  compressed size: in the central entry both the size (records are stored), in the
  local header the size and 0 (miniz writes that header before the data); the local
  header's 32-bit sizes stay 0 (as for every record: a data descriptor follows), the
  central entry's are ``0xFFFFFFFF``;
- a local header offset of ``0xFFFFFFFF`` or more (every record after a 4 GiB
  tensor): the extra holds the offset, the central entry's 32-bit offset is
  ``0xFFFFFFFF``;
- a record with a zip64 extra has the zip64 data descriptor (8-byte sizes, 24 bytes);
- the ``FB`` padding that aligns the data to 64 bytes follows the zip64 extra;
- the end of central directory record holds ``min(value, 0xFFFFFFFF)``; the zip64
  end record (always written) holds the real central directory offset.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
from typing import Any, NamedTuple, SupportsIndex

import torch

from asyncckpt.format.crc import crc32

__all__ = ["TensorFraming", "tensor_framing", "MAX_RECORD_BYTES", "ZIP64_LIMIT"]

_ALIGN = 64
#: miniz (``MZ_UINT32_MAX``): a size or offset at least this large does not go into
#: its 32-bit zip field but into the record's zip64 extra field.
ZIP64_LIMIT = 0xFFFFFFFF
#: Largest raw tensor record (bytes) we frame. Zip64 fields are 64-bit; the real
#: bound is that data file offsets are signed 64-bit (``off_t``, and the writer's
#: int64 CRC patch table), so the record and the framing around it must stay far
#: below ``2**63``.
MAX_RECORD_BYTES = 1 << 62

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # 30 bytes
_DESCRIPTOR = struct.Struct("<IIII")  # 16 bytes
_DESCRIPTOR64 = struct.Struct("<IIQQ")  # 24 bytes: zip64 data descriptor
_EXTRA_HEADER = struct.Struct("<HH")  # extra field id, data size
_ZIP64_EXTRA_ID = 0x0001
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_EOCD64 = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_LOCATOR = struct.Struct("<IIQI")  # 20 bytes
_EOCD = struct.Struct("<IHHHHIIH")  # 22 bytes
_FLAGS = 0x0808  # data descriptor follows + UTF-8 names


class TensorFraming(NamedTuple):
    """The bytes around one tensor's raw data in its ``torch.save`` archive.

    Attributes:
        prefix: every byte before the raw data (its length is a multiple of 64).
        suffix: every byte after the raw data, with zeros where the data's CRC-32 goes.
        crc_offsets: offsets in ``suffix`` of the little-endian uint32 CRC-32 fields
            of the data record (data descriptor, central directory entry); empty for
            zero bytes of data (written without a data descriptor, as miniz does).
        nbytes: the raw data size in bytes.
    """

    prefix: bytes
    suffix: bytes
    crc_offsets: tuple[int, ...]
    nbytes: int


class _Sentinel:
    pass


_STORAGE = _Sentinel()


class _Rebuild:
    def __init__(self, fn: Any, args: tuple) -> None:
        self.fn, self.args = fn, args

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple:
        return self.fn, self.args


class _Pickler(pickle.Pickler):
    def __init__(self, buf: io.BytesIO, storage_pid: tuple) -> None:
        super().__init__(buf, protocol=2)
        self._storage_pid = storage_pid

    def persistent_id(self, obj: Any) -> Any:
        return self._storage_pid if obj is _STORAGE else None


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def data_pickle(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """``data.pkl`` of ``torch.save`` for a contiguous CPU tensor, storage key ``"0"``."""
    numel = 1
    for size in shape:
        numel *= size
    itemsize = torch.empty((), dtype=dtype).element_size()
    hooks: collections.OrderedDict = collections.OrderedDict()
    stride = _contiguous_stride(shape)
    if dtype in torch.storage._new_dtypes():
        pid = ("storage", torch.storage.UntypedStorage, "0", "cpu", numel * itemsize)
        obj = _Rebuild(torch._utils._rebuild_tensor_v3, (_STORAGE, 0, shape, stride, False, hooks, dtype))
    else:
        storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])
        pid = ("storage", storage_type, "0", "cpu", numel)
        obj = _Rebuild(torch._utils._rebuild_tensor_v2, (_STORAGE, 0, shape, stride, False, hooks))
    buf = io.BytesIO()
    _Pickler(buf, pid).dump(obj)
    return buf.getvalue()


def _zip64_extra(size: int, offset: int, compressed: int) -> bytes:
    """miniz's zip64 extended-information extra field of a record of ``size`` bytes
    whose local header is at ``offset`` (empty if both fit 32-bit fields).

    ``mz_zip_writer_create_zip64_extra_data``: the uncompressed size and the compressed
    size ``compressed`` if ``size >= ZIP64_LIMIT``, then the local header offset if
    ``offset >= ZIP64_LIMIT``. miniz writes the local header's field before the data,
    with the compressed size still 0, and the central directory's after, with the
    compressed size (the size: records are stored)."""
    fields: list[int] = []
    if size >= ZIP64_LIMIT:
        fields += [size, compressed]
    if offset >= ZIP64_LIMIT:
        fields.append(offset)
    if not fields:
        return b""
    return _EXTRA_HEADER.pack(_ZIP64_EXTRA_ID, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q", *fields)


class _Record(NamedTuple):
    name: bytes
    size: int
    offset: int  # of the local header, from the start of the archive
    flags: int
    zip64: bool  # has a zip64 extra field (then a zip64 data descriptor)


class _Archive:
    """Lays out a stored zip as ``PyTorchStreamWriter::writeRecord`` does, record by
    record, with absolute offsets; the data of one record may be left out (a hole)."""

    def __init__(self) -> None:
        self.cursor = 0
        self.records: list[_Record] = []
        self.crcs: list[int] = []

    def header(self, name: bytes, size: int) -> bytes:
        """The local header of a record of ``size`` bytes at the cursor (advanced past it)."""
        offset = self.cursor
        flags = _FLAGS if size else 0x0800  # no data descriptor for an empty record
        zip64 = _zip64_extra(size, offset, 0)
        # getPadding(): the FB extra comes after the zip64 extra and pads the data
        # start to a multiple of 64.
        start = offset + _LOCAL.size + len(name) + len(zip64) + _EXTRA_HEADER.size
        pad = (-start) % _ALIGN
        extra = zip64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        out = _LOCAL.pack(0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(name), len(extra)) + name + extra
        self.records.append(_Record(name, size, offset, flags, bool(zip64)))
        self.cursor += len(out)
        return out

    def descriptor(self, crc: int) -> bytes:
        """The data descriptor of the last record, whose data the cursor has passed."""
        record = self.records[-1]
        self.crcs.append(crc)
        if not record.size:
            return b""
        if record.zip64:
            out = _DESCRIPTOR64.pack(0x08074B50, crc, record.size, record.size)
        else:
            out = _DESCRIPTOR.pack(0x08074B50, crc, record.size, record.size)
        self.cursor += len(out)
        return out

    def record(self, name: bytes, data: bytes) -> bytes:
        head = self.header(name, len(data))
        self.cursor += len(data)
        return head + data + self.descriptor(crc32(data))

    def central_directory(self) -> tuple[bytes, list[int]]:
        """The central directory and end records; and the offset, in them, of each
        record's CRC-32 field."""
        out = bytearray()
        crc_fields = []
        cd_offset = self.cursor
        for record, crc in zip(self.records, self.crcs):
            zip64 = _zip64_extra(record.size, record.offset, record.size)
            crc_fields.append(len(out) + 16)
            out += _CENTRAL.pack(
                0x02014B50,
                0,
                0,
                record.flags,
                0,
                0,
                0,
                crc,
                min(record.size, ZIP64_LIMIT),
                min(record.size, ZIP64_LIMIT),
                len(record.name),
                len(zip64),
                0,
                0,
                0,
                0,
                min(record.offset, ZIP64_LIMIT),
            )
            out += record.name + zip64
        cd_size = len(out)
        eocd64_offset = cd_offset + cd_size
        n = len(self.records)
        out += _EOCD64.pack(0x06064B50, 44, 0x031E, 0x2D, 0, 0, n, n, cd_size, cd_offset)
        out += _LOCATOR.pack(0x07064B50, 0, eocd64_offset, 1)
        out += _EOCD.pack(
            0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF), min(cd_size, ZIP64_LIMIT), min(cd_offset, ZIP64_LIMIT), 0
        )
        self.cursor += len(out)
        return bytes(out), crc_fields


def tensor_framing(dtype: torch.dtype, shape: tuple[int, ...], serialization_id: str) -> TensorFraming:
    """The ``torch.save`` framing of a contiguous CPU tensor of ``dtype`` and ``shape``.

    Args:
        dtype: the tensor's dtype.
        shape: its shape (any number of dims; 0-d and zero-size allowed).
        serialization_id: 40 ASCII characters stored in ``.data/serialization_id``
            (``torch.save`` uses a random id; it is not checked by ``torch.load``).

    Returns:
        The framing; ``prefix + raw_bytes + suffix`` (with the CRC-32 of the raw bytes
        patched in at ``crc_offsets``) is what ``torch.save`` writes. Records of
        :data:`ZIP64_LIMIT` bytes or more (and every record after them) carry zip64
        fields, as in ``torch.save`` output (see the module docstring).

    Raises:
        ValueError: the tensor is larger than :data:`MAX_RECORD_BYTES`, or
            ``serialization_id`` is not 40 ASCII characters.
    """
    shape = tuple(int(s) for s in shape)
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes > MAX_RECORD_BYTES:
        raise ValueError(
            f"a tensor of {nbytes} bytes is larger than the largest record asyncckpt writes ({MAX_RECORD_BYTES} bytes)"
        )
    sid = serialization_id.encode("ascii")
    if len(sid) != 40:
        raise ValueError("serialization_id must be 40 ASCII characters")

    zip_ = _Archive()
    out = bytearray()
    out += zip_.record(b"archive/data.pkl", data_pickle(dtype, shape))
    out += zip_.record(b"archive/.format_version", b"1")
    out += zip_.record(b"archive/.storage_alignment", b"64")
    out += zip_.record(b"archive/byteorder", b"little")
    out += zip_.header(b"archive/data/0", nbytes)
    prefix = bytes(out)
    assert len(prefix) % _ALIGN == 0

    # Everything after the raw data, positioned as if the data were in place.
    zip_.cursor += nbytes
    out = bytearray(zip_.descriptor(0))
    data_index = len(zip_.records) - 1
    out += zip_.record(b"archive/version", b"3\n")
    out += zip_.record(b"archive/.data/serialization_id", sid)
    directory_at = len(out)
    directory, crc_fields = zip_.central_directory()
    out += directory
    crc_offsets = (4, directory_at + crc_fields[data_index]) if nbytes else ()
    return TensorFraming(prefix, bytes(out), crc_offsets, nbytes)
