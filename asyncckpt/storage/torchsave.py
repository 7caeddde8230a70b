"""The byte framing of ``torch.save(tensor)``, built once per tensor layout.

``torch.distributed.checkpoint.FileSystemReader`` reads every tensor item of a
checkpoint with ``torch.load`` on a slice of a data file, so each tensor must be a
complete ``torch.save`` archive: a stored (uncompressed) zip with ``data.pkl``,
``byteorder``, the raw storage bytes (``data/0``, 64-byte aligned), ``version``...

``torch.save`` pickles and zips on every call. We build the framing once per
(dtype, shape) instead, byte for byte as ``torch.save`` writes it (PyTorch's
``caffe2/serialize/inline_container.cc``: data descriptors after each record, ``FB``
padding extras for 64-byte alignment, zip64 end records), so the hot path only copies
the raw tensor bytes and patches two CRC-32 fields. Tests compare our framing with
``torch.save`` output for every dtype.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zlib
from typing import Any, NamedTuple

import torch

__all__ = ["TensorFraming", "tensor_framing", "MAX_RECORD_BYTES"]

_ALIGN = 64
#: Largest tensor item (bytes) framed without zip64 record fields; larger tensors are
#: split into chunks by the layout.
MAX_RECORD_BYTES = 0xFFFFFFFF - 4096

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # 30 bytes
_DESCRIPTOR = struct.Struct("<IIII")  # 16 bytes
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

    def __reduce_ex__(self, protocol: int) -> tuple:
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


def _local_header(name: bytes, cursor: int, flags: int = _FLAGS) -> bytes:
    start = cursor + _LOCAL.size + len(name) + 4
    pad = (-start) % _ALIGN
    extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
    return _LOCAL.pack(0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(name), len(extra)) + name + extra


def tensor_framing(dtype: torch.dtype, shape: tuple[int, ...], serialization_id: str) -> TensorFraming:
    """The ``torch.save`` framing of a contiguous CPU tensor of ``dtype`` and ``shape``.

    Args:
        dtype: the tensor's dtype.
        shape: its shape (any number of dims; 0-d and zero-size allowed).
        serialization_id: 40 ASCII characters stored in ``.data/serialization_id``
            (``torch.save`` uses a random id; it is not checked by ``torch.load``).

    Returns:
        The framing; ``prefix + raw_bytes + suffix`` (with the CRC-32 of the raw bytes
        patched in at ``crc_offsets``) is what ``torch.save`` writes.

    Raises:
        ValueError: the tensor is larger than :data:`MAX_RECORD_BYTES`.
    """
    shape = tuple(int(s) for s in shape)
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes > MAX_RECORD_BYTES:
        raise ValueError(f"a tensor record of {nbytes} bytes needs zip64 framing; split it into chunks")
    sid = serialization_id.encode("ascii")
    if len(sid) != 40:
        raise ValueError("serialization_id must be 40 ASCII characters")
    records_before = [
        (b"archive/data.pkl", data_pickle(dtype, shape)),
        (b"archive/.format_version", b"1"),
        (b"archive/.storage_alignment", b"64"),
        (b"archive/byteorder", b"little"),
    ]
    records_after = [(b"archive/version", b"3\n"), (b"archive/.data/serialization_id", sid)]

    out = bytearray()
    central: list[tuple[bytes, int, int, int]] = []  # name, crc, size, header offset

    def add_small(out: bytearray, name: bytes, data: bytes, base: int = 0) -> None:
        # ``out`` starts at byte ``base`` of the archive.
        offset = base + len(out)
        out.extend(_local_header(name, offset))
        out.extend(data)
        crc = zlib.crc32(data)
        out.extend(_DESCRIPTOR.pack(0x08074B50, crc, len(data), len(data)))
        central.append((name, crc, len(data), offset))

    for name, data in records_before:
        add_small(out, name, data)
    data_name = b"archive/data/0"
    data_header_offset = len(out)
    data_flags = _FLAGS if nbytes else 0x0800
    out.extend(_local_header(data_name, data_header_offset, data_flags))
    prefix = bytes(out)
    assert len(prefix) % _ALIGN == 0

    # Everything after the raw data, positioned as if the data were in place.
    base = len(prefix) + nbytes
    out = bytearray()
    if nbytes:
        out.extend(_DESCRIPTOR.pack(0x08074B50, 0, nbytes, nbytes))
    central.append((data_name, 0, nbytes, data_header_offset))
    data_central_index = len(central) - 1

    for name, data in records_after:
        add_small(out, name, data, base)
    cd_offset = base + len(out)
    crc_central = -1
    for i, (name, crc, size, offset) in enumerate(central):
        flags = _FLAGS
        if i == data_central_index:
            crc_central = len(out) + 16
            flags = data_flags
        out.extend(_CENTRAL.pack(0x02014B50, 0, 0, flags, 0, 0, 0, crc, size, size, len(name), 0, 0, 0, 0, 0, offset))
        out.extend(name)
    cd_size = base + len(out) - cd_offset
    eocd64_offset = base + len(out)
    n = len(central)
    out.extend(_EOCD64.pack(0x06064B50, 44, 0x031E, 0x2D, 0, 0, n, n, cd_size, cd_offset))
    out.extend(_LOCATOR.pack(0x07064B50, 0, eocd64_offset, 1))
    out.extend(_EOCD.pack(0x06054B50, 0, 0, n, n, cd_size, cd_offset, 0))
    crc_offsets = (4, crc_central) if nbytes else ()
    return TensorFraming(prefix, bytes(out), crc_offsets, nbytes)
