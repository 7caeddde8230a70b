"""Reading one record of a data file: a tensor record of our writer recognised by its
framing and read raw, anything else with ``torch.load(..., weights_only=True)``.

Tensor records written by our writer (``asyncckpt.format.layout``: one fixed
``torch.save`` framing per dtype and shape, the zip64 one for records of 4 GiB and
more) are recognised byte for byte and their raw bytes copied directly, without a
``torch.load`` per tensor; any other record is read with ``torch.load(...,
weights_only=True)`` as DCP's ``FileSystemReader`` does, streamed from the file (no
copy of the whole record in memory). Shared by :mod:`asyncckpt.loading.dcp` and
:mod:`asyncckpt.loading.direct`.
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch

from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.layout import record_framing
from asyncckpt.format.torchsave import TensorFraming
from asyncckpt.io.storage import FileReader, pread_into

__all__ = [
    "pread_into",
    "pread",
    "RecordStream",
    "writer_framing",
    "suffix_matches",
    "tensor_from",
    "read_record",
    "torch_load_tensor",
]


class RecordStream(io.RawIOBase):
    """``length`` bytes of the file ``reader`` from ``offset``, as a seekable binary stream.

    ``torch.load`` reads a record that is not ours from it, as DCP's reader does from
    its file view: positioned reads (the reader is shared by the records of one file),
    storages read straight into their memory by ``readinto``. ``readinto`` fills the
    whole buffer unless the record (or the file) ends.
    """

    def __init__(self, reader: FileReader, offset: int, length: int) -> None:
        super().__init__()
        self._reader, self._offset, self._length, self._pos = reader, offset, length, 0

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
        start = self._offset + self._pos
        # The file may end inside the record: torch.load then fails on the short read.
        want = max(0, min(len(view), self._length - self._pos, self._reader.size - start))
        if want:
            self._reader.readinto(start, [view[:want]])
        self._pos += want
        return want


def pread(reader: FileReader, length: int, offset: int, path: str) -> bytearray:
    """``length`` bytes of the file ``reader`` at ``offset``.

    Raises:
        CorruptCheckpointError: the file ``path`` ends first.
    """
    buf = bytearray(length)
    if length:
        reader.readinto(offset, [memoryview(buf)])
    return buf


def writer_framing(dtype: torch.dtype, shape: tuple[int, ...]) -> TensorFraming | None:
    """The framing our writer puts around a record of ``dtype`` and ``shape``, or ``None``
    (no framing of ours for it)."""
    try:
        return record_framing(dtype, shape)  # what our writer puts around every record
    except ValueError:
        return None


def suffix_matches(tail: memoryview, framing: TensorFraming) -> bool:
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


def tensor_from(buf: bytearray, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` over ``buf[offset:offset + nbytes]`` (no copy)."""
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(dtype).view(shape)


def read_record(reader: FileReader, path: str, offset: int, framing: TensorFraming, dest: memoryview) -> bool:
    """Read one record of our writer at ``offset`` of the file ``reader``: its data
    into ``dest`` and its framing, in one read (one ``preadv`` locally). Returns
    whether the framing is ours.

    Raises:
        CorruptCheckpointError: the file ``path`` ends inside the record.
    """
    head, tail = bytearray(len(framing.prefix)), bytearray(len(framing.suffix))
    reader.readinto(offset, [memoryview(head), dest, memoryview(tail)])
    return bytes(head) == framing.prefix and suffix_matches(memoryview(tail), framing)


def torch_load_tensor(stream: Any, path: str, fqn: str) -> torch.Tensor:
    """``torch.load(stream, weights_only=True)`` of one tensor record.

    Raises:
        CorruptCheckpointError: not a tensor archive, or not a tensor.
    """
    try:
        tensor = torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CorruptCheckpointError(
            f"{path}: the record of {fqn!r} is not a tensor archive: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            path,
        ) from exc
    if not isinstance(tensor, torch.Tensor):
        raise CorruptCheckpointError(
            f"{path}: the record of {fqn!r} holds a {type(tensor).__name__}, not a tensor", path
        )
    return tensor
