"""What the writer writes: a data file as a range of the staged host buffer, and the
tensor records whose CRC-32 it patches in (``asyncckpt.format.layout`` builds them,
``asyncckpt.io.writer`` consumes them in the torch-free worker).

Torch-free.
"""

from __future__ import annotations

import array
from typing import NamedTuple

__all__ = ["CrcPatch", "pack_patches", "unpack_patches", "FileSpec"]


class CrcPatch(NamedTuple):
    """A tensor record's raw data and where its CRC-32 goes, in file coordinates.

    Attributes:
        data_offset: first byte of the raw tensor data (bytes from the file start).
        data_nbytes: length of the raw data in bytes.
        patch_offsets: offsets of the little-endian uint32 CRC-32 fields to fill in.
    """

    data_offset: int
    data_nbytes: int
    patch_offsets: tuple[int, ...]


def pack_patches(patches: list[CrcPatch]) -> bytes:
    """Pack patches as native int64 quadruples ``(data_offset, data_nbytes, field0,
    field1)``, ``-1`` for an absent field: pickled as one bytes object, thousands of
    records cost the hand-off to the worker a memcpy, not a pickle per record."""
    flat = array.array("q")
    for p in patches:
        fields = (tuple(p.patch_offsets) + (-1, -1))[:2]
        flat.extend((p.data_offset, p.data_nbytes, *fields))
    return flat.tobytes()


def unpack_patches(packed: bytes) -> list[CrcPatch]:
    """The inverse of :func:`pack_patches`."""
    flat = array.array("q")
    flat.frombytes(packed)
    return [
        CrcPatch(flat[i], flat[i + 1], tuple(f for f in flat[i + 2 : i + 4] if f >= 0)) for i in range(0, len(flat), 4)
    ]


class FileSpec(NamedTuple):
    """One data file: ``slab[slab_offset : slab_offset + nbytes]`` once patched.

    Attributes:
        name: file name inside the checkpoint directory (e.g. ``__0_0.distcp``).
        slab_offset: where the file image starts in the slab (bytes).
        nbytes: file size in bytes.
        patches: the tensor records in file order, packed by :func:`pack_patches`.
    """

    name: str
    slab_offset: int
    nbytes: int
    patches: bytes
