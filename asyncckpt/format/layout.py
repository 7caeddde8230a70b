"""Layout: where every item of a rank's save plan lives in its data files and slab.

Given the rank's final ``SavePlan`` (from torch's ``DefaultSavePlanner``) and the
resolved data, a :class:`RankLayout` fixes, once per state structure, the byte
position of every record in the rank's data file ``__<rank>_0.distcp``: tensor
records first (their ``torch.save`` framing is static), non-tensor values (pickled per
save, sizes may vary) last. It gives the ``_StorageInfo`` of each item for the DCP
metadata, the framing bytes to write when a slab is formatted, and the copy plan.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from asyncckpt.errors import CheckpointError
from asyncckpt.format.filespec import CrcPatch, FileSpec, pack_patches
from asyncckpt.format.torchsave import TensorFraming, tensor_framing

__all__ = ["RankLayout", "build_layout", "layout_key"]

_ITEM_ALIGN = 64
_FILE_ALIGN = 4096
#: Largest data file (bytes): file offsets are signed 64-bit (``off_t``; the writer
#: packs CRC patches as int64).
_MAX_FILE_BYTES = (1 << 63) - 1
#: One fixed ``.data/serialization_id`` for all our records (torch.load ignores it),
#: so that framings can be shared by all tensors of one dtype and shape.
_SERIALIZATION_ID = "0" * 24 + "0a5c0c4b70000001"


@functools.lru_cache(maxsize=8192)
def record_framing(dtype: torch.dtype, shape: tuple[int, ...]) -> TensorFraming:
    """The framing our writer gives every tensor record of ``dtype`` and ``shape`` (cached).

    Records of 4 GiB and more get zip64 framing, as ``torch.save`` gives them.

    Raises:
        ValueError: the record is larger than ``torchsave.MAX_RECORD_BYTES``.
    """
    return tensor_framing(dtype, shape, _SERIALIZATION_ID)


class TensorSlot(NamedTuple):
    """Where one tensor item is staged: ``slab[offset : offset + nbytes]`` as ``dtype``/``shape``."""

    item: int
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class BytesSlot(NamedTuple):
    """Where one non-tensor item (``torch.save`` bytes) is staged."""

    item: int
    offset: int
    nbytes: int


class RankLayout(NamedTuple):
    """The byte layout of one rank's files in its slab.

    Attributes:
        key: identifies the layout (equal keys give equal layouts).
        slab_nbytes: slab bytes needed.
        files: the data files (writer specs, slab coordinates).
        tensors: tensor slots, in plan order.
        blobs: non-tensor slots.
        storage_data: ``MetadataIndex -> _StorageInfo`` for the DCP metadata.
        static: ``(slab_offset, bytes)`` framing to write when formatting a slab.
        nbytes: total file bytes.
    """

    key: Any
    slab_nbytes: int
    files: tuple[FileSpec, ...]
    tensors: tuple[TensorSlot, ...]
    blobs: tuple[BytesSlot, ...]
    storage_data: dict[MetadataIndex, _StorageInfo]
    static: tuple[tuple[int, bytes], ...]
    nbytes: int


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def _tensor_data(item: WriteItem) -> TensorWriteData:
    """The tensor data of a tensor write item.

    Raises:
        CheckpointError: the item has none (not a plan DCP's planner makes).
    """
    if item.tensor_data is None:
        raise CheckpointError(f"state_dict entry {item.index.fqn!r}: a tensor write item without tensor data")
    return item.tensor_data


def layout_key(rank: int, items: list[WriteItem], blobs: dict[int, int]) -> Any:
    """A hashable key of a plan's structure (tensor specs and non-tensor sizes)."""
    parts: list[tuple[Any, ...]] = []
    for i, item in enumerate(items):
        if item.type == WriteItemType.BYTE_IO:
            parts.append((item.index.fqn, blobs[i]))
        else:
            td = _tensor_data(item)
            parts.append((item.index.fqn, tuple(td.chunk.offsets), td.properties.dtype, tuple(td.chunk.sizes)))
    return (rank, tuple(parts))


def build_layout(rank: int, items: list[WriteItem], blobs: dict[int, int]) -> RankLayout:
    """Lay out the items of a rank's final save plan.

    Args:
        rank: the rank (names the file ``__<rank>_0.distcp``).
        items: the plan's write items.
        blobs: for each BYTE_IO item index, its size in bytes.

    Raises:
        CheckpointError: naming the state_dict entry, if a tensor is larger than one
            record can be (``torchsave.MAX_RECORD_BYTES``) or the file would be larger
            than a file offset can address.
    """
    name = f"__{rank}_0.distcp"
    order = [i for i, it in enumerate(items) if it.type != WriteItemType.BYTE_IO]
    order += [i for i, it in enumerate(items) if it.type == WriteItemType.BYTE_IO]
    pos = 0
    tensors, byte_slots, static, patches = [], [], [], []
    storage_data: dict[MetadataIndex, _StorageInfo] = {}
    for i in order:
        item = items[i]
        pos = _align(pos, _ITEM_ALIGN)
        if item.type == WriteItemType.BYTE_IO:
            n = blobs[i]
            byte_slots.append(BytesSlot(i, pos, n))
            storage_data[item.index] = _StorageInfo(name, pos, n)
            pos += n
            continue
        td = _tensor_data(item)
        shape = tuple(int(s) for s in td.chunk.sizes)
        try:
            framing = record_framing(td.properties.dtype, shape)
        except ValueError as exc:
            raise CheckpointError(f"state_dict entry {item.index.fqn!r} cannot be saved: {exc}") from None
        start = pos
        static.append((start, framing.prefix))
        data = start + len(framing.prefix)
        tensors.append(TensorSlot(i, data, framing.nbytes, td.properties.dtype, shape))
        end = data + framing.nbytes
        static.append((end, framing.suffix))
        patches.append(CrcPatch(data, framing.nbytes, tuple(end + o for o in framing.crc_offsets)))
        pos = end + len(framing.suffix)
        if pos > _MAX_FILE_BYTES:
            raise CheckpointError(
                f"state_dict entry {item.index.fqn!r} cannot be saved: {name} would be "
                f"{pos} bytes, more than a file offset addresses"
            )
        storage_data[item.index] = _StorageInfo(name, start, pos - start)
    files = (FileSpec(name, 0, pos, pack_patches(patches)),)
    return RankLayout(
        key=layout_key(rank, items, blobs),
        slab_nbytes=_align(max(pos, 1), _FILE_ALIGN),
        files=files,
        tensors=tuple(tensors),
        blobs=tuple(byte_slots),
        storage_data=storage_data,
        static=tuple(static),
        nbytes=pos,
    )
