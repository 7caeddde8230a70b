"""The writer: checksums computed in a helper thread while the file is written."""

from __future__ import annotations

import io
import zipfile
import zlib

import pytest
import torch
from torch.distributed.checkpoint.planner import WriteItemType

import asyncckpt
from asyncckpt.planning import plan_save
from asyncckpt.dist import SyncGroup
from asyncckpt.staging import HostSlab
from asyncckpt.storage import writer
from asyncckpt.storage.layout import build_layout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunk", [4096, 1 << 20, 64 << 20])
def test_overlapped_checksums_give_valid_records_and_segments(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(writer, "WRITE_CHUNK_BYTES", chunk)
    gen = torch.Generator().manual_seed(0)
    state = {
        "big": torch.randn(3 << 18, generator=gen),        # 3 MiB: a segment of its own
        "empty": torch.zeros(0),
        "small": torch.randint(0, 100, (17,), generator=gen),
        "bf16": torch.randn(5, 7, generator=gen).to(torch.bfloat16),
        "big2": torch.randn(1 << 18, generator=gen),       # exactly 1 MiB
        "meta": {"step": 3},
    }
    planned, _ = plan_save(state, str(tmp_path / "x"), SyncGroup(None), 0)
    items = list(planned.plan.items)
    blobs = {i: len(d) for i, d in enumerate(planned.data) if isinstance(d, bytes)}
    layout = build_layout(0, items, blobs)
    slab = HostSlab(layout.slab_nbytes)
    try:
        for offset, framing in layout.static:
            slab.write_bytes(offset, framing)
        for slot in layout.tensors:
            if slot.nbytes:
                slab.u8[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape).copy_(
                    planned.data[slot.item])
        for slot in layout.blobs:
            slab.write_bytes(slot.offset, planned.data[slot.item])
        task = writer.WriteTask(str(tmp_path / "out"), slab.ref, layout.files, (slab.slab_id,))
        result = writer.write_rank_files(task)
    finally:
        slab.release()
    data = (tmp_path / "out" / layout.files[0].name).read_bytes()
    assert len(data) == layout.files[0].nbytes == result.nbytes
    # Segments cover the file and match its bytes.
    pos = 0
    for offset, length, crc in result.files[0].segments:
        assert offset == pos
        assert zlib.crc32(data[offset:offset + length]) == crc
        pos += length
    assert pos == len(data)
    assert any(length == 3 << 20 for _, length, _ in result.files[0].segments)
    # Every tensor record is a valid zip (zipfile checks each CRC-32) that torch.load reads.
    for index, info in layout.storage_data.items():
        item = next(it for it in items if it.index == index)
        blob = data[info.offset:info.offset + info.length]
        if item.type == WriteItemType.BYTE_IO:
            continue
        assert zipfile.ZipFile(io.BytesIO(blob)).testzip() is None
        loaded = torch.load(io.BytesIO(blob), weights_only=True)
        assert torch.equal(loaded, state[index.fqn])
