"""The writer: checksums computed in a helper thread while the file is written."""

from __future__ import annotations

import io
import zipfile
import zlib
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.planner import WriteItemType

import asyncckpt
from asyncckpt.dist import SyncGroup
from asyncckpt.format.layout import build_layout
from asyncckpt.io import writer
from asyncckpt.saving.planning import plan_save
from asyncckpt.saving.staging import StagingBuffer


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunk", [4096, 1 << 20, 64 << 20])
def test_overlapped_checksums_give_valid_records_and_segments(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(writer, "WRITE_CHUNK_BYTES", chunk)
    gen = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {
        "big": torch.randn(3 << 18, generator=gen),  # 3 MiB: a segment of its own
        "empty": torch.zeros(0),
        "small": torch.randint(0, 100, (17,), generator=gen),
        "bf16": torch.randn(5, 7, generator=gen).to(torch.bfloat16),
        "big2": torch.randn(1 << 18, generator=gen),  # exactly 1 MiB
        "meta": {"step": 3},
    }
    planned, _ = plan_save(state, str(tmp_path / "x"), SyncGroup(None), 0)
    items = list(planned.plan.items)
    blobs = {i: len(d) for i, d in enumerate(planned.data) if isinstance(d, bytes)}
    layout = build_layout(0, items, blobs)
    slab = StagingBuffer(layout.slab_nbytes)
    try:
        for offset, framing in layout.static:
            slab.write_bytes(offset, framing)
        for slot in layout.tensors:
            if slot.nbytes:
                slab.u8[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape).copy_(
                    planned.data[slot.item]
                )
        for blob in layout.blobs:
            slab.write_bytes(blob.offset, planned.data[blob.item])
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
        assert zlib.crc32(data[offset : offset + length]) == crc
        pos += length
    assert pos == len(data)
    assert any(length == 3 << 20 for _, length, _ in result.files[0].segments)
    # Every tensor record is a valid zip (zipfile checks each CRC-32) that torch.load reads.
    for index, info in layout.storage_data.items():
        item = next(it for it in items if it.index == index)
        blob = data[info.offset : info.offset + info.length]
        if item.type == WriteItemType.BYTE_IO:
            continue
        assert zipfile.ZipFile(io.BytesIO(blob)).testzip() is None
        loaded = torch.load(io.BytesIO(blob), weights_only=True)
        assert torch.equal(loaded, state[index.fqn])


def _resident_pages(path) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages in all), by ``mincore`` on a mapping
    that touches none of them."""
    import ctypes
    import mmap
    import os

    size = os.path.getsize(path)
    page = mmap.PAGESIZE
    n = -(-size // page)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            vec = ctypes.create_string_buffer(n)
            assert libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
            return sum(b & 1 for b in vec.raw), n
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(__import__("os"), "posix_fadvise"), reason="no posix_fadvise on this platform")
@pytest.mark.parametrize("drop", [True, False])
def test_written_data_leaves_the_page_cache_unless_asked_to_stay(tmp_path, drop):
    """``SaveOptions.drop_page_cache`` (default True): once written and fsynced, a data
    file's pages are dropped from the page cache; with False they stay cached. Either
    way the checkpoint loads back exactly."""
    state = {f"t{i}": torch.randn(256, 1024) for i in range(8)}  # 8 MiB
    options = asyncckpt.SaveOptions(drop_page_cache=drop)
    assert asyncckpt.SaveOptions().drop_page_cache is True
    with asyncckpt.CheckpointManager(tmp_path / "root", options=options) as mgr:
        mgr.save(1, state).wait()
    step = tmp_path / "root" / "step_00000001"
    data = [p for p in step.iterdir() if p.suffix == ".distcp"]
    assert data
    resident = [_resident_pages(p) for p in data]
    cached, total = sum(r for r, _ in resident), sum(n for _, n in resident)
    assert total >= 2048
    if drop:
        assert cached <= total // 10, resident
    else:
        assert cached >= total * 9 // 10, resident
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    asyncckpt.load(out, step)
    assert all(torch.equal(out[k], v) for k, v in state.items())
