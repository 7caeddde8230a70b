"""Tensor records of 4 GiB and more: zip64 framing, as ``torch.save`` writes it.

The fast tests (always on) check the structure of the large framing without
allocating 4 GiB: the archive goes into a sparse file (prefix, a hole where the data
goes, suffix) that Python's :mod:`zipfile` and ``torch.load(mmap=True)`` (PyTorch's
own miniz reader) open. The tests that need real tensors of more than 4 GiB (byte
for byte against ``torch.save``; save / load / ``dcp.load`` round trips) run only with
``ASYNCCKPT_LONG=1``: they write about 4.3 GB per case to ``tmp_path`` (removed on the
way out) and hold at most two such tensors in memory at a time (about 9 GB).
"""

from __future__ import annotations

import gc
import os
import resource
import shutil
import struct
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp

import asyncckpt
from asyncckpt import CheckpointError, CorruptCheckpointError
from asyncckpt.dist import SyncGroup
from asyncckpt.format.layout import build_layout, record_framing
from asyncckpt.format.torchsave import MAX_RECORD_BYTES, ZIP64_LIMIT, TensorFraming, tensor_framing
from asyncckpt.io.storage import FileReader
from asyncckpt.io.writer import unpack_patches
from asyncckpt.loading import dcp as dcp_mod
from asyncckpt.loading import framing as framing_mod
from asyncckpt.loading.metadata import read_metadata
from asyncckpt.saving.planning import plan_save

from helpers import closing_queue, observing_loads

LONG = os.environ.get("ASYNCCKPT_LONG") == "1"
needs_long = pytest.mark.skipif(not LONG, reason="set ASYNCCKPT_LONG=1 (writes ~4.3 GB per case, ~9 GB of memory)")

NAMES = [
    b"archive/data.pkl",
    b"archive/.format_version",
    b"archive/.storage_alignment",
    b"archive/byteorder",
    b"archive/data/0",
    b"archive/version",
    b"archive/.data/serialization_id",
]
SID = "0123456789" * 4
START = bytes(range(1, 65))  # the first and last 64 data bytes of the sparse archives
END = bytes(range(201, 137, -1))

# (dtype, shape): around the limit, records cross 4 GiB in different places.
CASES = {
    "below": (torch.uint8, (ZIP64_LIMIT - 4096,)),  # no zip64 field anywhere
    "straddle": (torch.uint8, (ZIP64_LIMIT - 100,)),  # data plain; the records after it start past 4 GiB
    "limit": (torch.uint8, (ZIP64_LIMIT,)),  # miniz: sizes >= 0xFFFFFFFF are zip64
    "fp32-20GiB": (torch.float32, (5, (1 << 30) + 3)),
}


# ----------------------------------------------------------------------------- helpers
def _sparse_archive(path: Path, framing: TensorFraming) -> None:
    """prefix + data + suffix, the data a hole but for its first and last 64 bytes.

    The data's CRC-32 fields are left 0 (nothing here reads the data to its end); the
    long tests check them against torch.save."""
    with open(path, "wb") as f:
        f.write(framing.prefix)
        f.write(START)
        f.seek(len(framing.prefix) + framing.nbytes - len(END))
        f.write(END)
        f.write(framing.suffix)


def _extras(blob: bytes) -> dict[int, bytes]:
    out, pos = {}, 0
    while pos < len(blob):
        tag, n = struct.unpack_from("<HH", blob, pos)
        out[tag] = blob[pos + 4 : pos + 4 + n]
        pos += 4 + n
    assert pos == len(blob), "extra fields overrun"
    return out


def _zip64_fields(size: int, offset: int, compressed: int) -> bytes | None:
    fields = ([size, compressed] if size >= ZIP64_LIMIT else []) + ([offset] if offset >= ZIP64_LIMIT else [])
    return struct.pack(f"<{len(fields)}Q", *fields) if fields else None


# ----------------------------------------------------------------------------- fast, structural
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(CASES))
def test_large_framing_structure(tmp_path: Path, case: str) -> None:
    dtype, shape = CASES[case]
    framing = tensor_framing(dtype, shape, SID)
    nbytes = framing.nbytes
    assert len(framing.prefix) % 64 == 0 and len(framing.crc_offsets) == 2
    path = tmp_path / "archive.pt"
    _sparse_archive(path, framing)
    try:
        assert os.path.getsize(path) == len(framing.prefix) + nbytes + len(framing.suffix)
        with zipfile.ZipFile(path) as z, open(path, "rb") as f:
            infos = z.infolist()
            assert [i.filename.encode() for i in infos] == NAMES
            for info in infos:
                assert info.compress_type == zipfile.ZIP_STORED and info.compress_size == info.file_size
                # Central directory: zip64 extra iff a size or the offset does not fit 32 bits.
                central = _extras(info.extra)
                assert central.get(1) == _zip64_fields(info.file_size, info.header_offset, info.file_size), (
                    info.filename
                )
                # Local header: zip64 extra first (compressed size 0, as miniz writes it before
                # the data), then the FB padding; 32-bit sizes and CRC 0; data 64-byte aligned.
                f.seek(info.header_offset)
                local = f.read(30)
                sig, _, flags, _, _, _, crc, csize, usize, name_n, extra_n = struct.unpack("<IHHHHHIIIHH", local)
                assert sig == 0x04034B50 and (crc, csize, usize) == (0, 0, 0)
                assert f.read(name_n) == info.filename.encode()
                local_extra = f.read(extra_n)
                expected = _zip64_fields(info.file_size, info.header_offset, 0)
                if expected is not None:
                    assert local_extra[:4] == struct.pack("<HH", 1, len(expected))
                    assert local_extra[4 : 4 + len(expected)] == expected
                    assert local_extra[4 + len(expected) : 6 + len(expected)] == b"FB"
                else:
                    assert local_extra[:2] == b"FB"
                assert set(_extras(local_extra)) <= {1, 0x4246}
                data_at = f.tell()
                assert data_at % 64 == 0
                # Data descriptor: the zip64 form (8-byte sizes) iff the record has a zip64 extra.
                f.seek(data_at + info.file_size)
                if expected is not None:
                    sig, _, c64, u64 = struct.unpack("<IIQQ", f.read(24))
                    assert (sig, c64, u64) == (0x08074B50, info.file_size, info.file_size)
                else:
                    sig, _, c32, u32 = struct.unpack("<IIII", f.read(16))
                    assert (sig, c32, u32) == (0x08074B50, info.file_size, info.file_size)
                assert flags == 0x0808
            data = z.getinfo("archive/data/0")
            assert data.file_size == nbytes and data.header_offset < ZIP64_LIMIT
            assert (1 in _extras(data.extra)) == (nbytes >= ZIP64_LIMIT)
            after = z.getinfo("archive/version")
            assert (1 in _extras(after.extra)) == (after.header_offset >= ZIP64_LIMIT)
            # The small records are read (and CRC-checked) past the hole.
            assert z.read("archive/version") == b"3\n"
            assert z.read("archive/byteorder") == b"little"
            assert z.read("archive/.data/serialization_id") == SID.encode()
            with z.open("archive/data/0") as member:
                assert member.read(64) == START
            # End records: EOCD fields clamped to 0xFFFFFFFF, the zip64 end record exact.
            f.seek(-22, os.SEEK_END)
            eocd = struct.unpack("<IHHHHIIH", f.read(22))
            f.seek(-22 - 20 - 56, os.SEEK_END)
            eocd64 = struct.unpack("<IQHHIIQQQQ", f.read(56))
            cd_offset, cd_size = eocd64[9], eocd64[8]
            assert eocd[0] == 0x06054B50 and eocd64[0] == 0x06064B50
            assert cd_offset + cd_size + 56 + 20 + 22 == os.path.getsize(path)
            assert eocd[6] == min(cd_offset, ZIP64_LIMIT) and eocd[5] == cd_size
            assert (cd_offset >= ZIP64_LIMIT) == (case != "below")
        # PyTorch's own reader (miniz, zip64 aware) maps the hole; no 4 GiB read.
        t = torch.load(path, mmap=True, weights_only=True)
        assert t.dtype == dtype and tuple(t.shape) == shape
        u8 = t.view(-1).view(torch.uint8)
        assert bytes(u8[:64].tolist()) == START and bytes(u8[-64:].tolist()) == END
        del t, u8
    finally:
        path.unlink()


@pytest.mark.timeout(60)
def test_zip64_only_from_the_limit() -> None:
    """Below 0xFFFFFFFF bytes the data record has the 32-bit framing (byte-exact with
    torch.save in test_torchsave); from 0xFFFFFFFF on, the zip64 one."""
    for nbytes in (ZIP64_LIMIT - 1, ZIP64_LIMIT, ZIP64_LIMIT + 1):
        f = tensor_framing(torch.uint8, (nbytes,), SID)
        has_zip64 = b"archive/data/0\x01\x00\x10\x00" in f.prefix
        assert has_zip64 == (nbytes >= ZIP64_LIMIT)
        # The data descriptor follows the data: 24 bytes with 8-byte sizes, or 16.
        if has_zip64:
            assert f.suffix[:24] == struct.pack("<IIQQ", 0x08074B50, 0, nbytes, nbytes)
        else:
            assert f.suffix[:16] == struct.pack("<IIII", 0x08074B50, 0, nbytes, nbytes)


@pytest.mark.timeout(60)
def test_layout_places_records_after_a_zip64_record(tmp_path: Path) -> None:
    """The layout of a state with a >4 GiB tensor (an expanded view: nothing allocated)
    between small ones: each item is its own archive; the items after it start past 4 GiB."""
    big = (1 << 32) + 100
    state = {
        "a": torch.arange(5, dtype=torch.float32),
        "emb": torch.zeros(1, dtype=torch.uint8).expand(big),
        "z": torch.ones(3, dtype=torch.int64),
        "step": 7,
    }
    planned, _ = plan_save(state, str(tmp_path / "x"), SyncGroup(None), 0)
    items = list(planned.plan.items)
    blobs = {i: len(d) for i, d in enumerate(planned.data) if isinstance(d, bytes)}
    layout = build_layout(0, items, blobs)
    infos = {index.fqn: info for index, info in layout.storage_data.items()}
    framing = record_framing(torch.uint8, (big,))
    assert infos["emb"].length == len(framing.prefix) + big + len(framing.suffix)
    assert infos["z"].offset > ZIP64_LIMIT and infos["step"].offset > infos["z"].offset
    # The framing the layout writes is the one the reader recognises.
    assert framing_mod.writer_framing(torch.uint8, (big,)) is framing
    assert (infos["emb"].offset, framing.prefix) in layout.static
    slot = next(s for s in layout.tensors if s.nbytes == big)
    patch = next(p for p in unpack_patches(layout.files[0].patches) if p.data_nbytes == big)
    assert patch.data_offset == slot.offset == infos["emb"].offset + len(framing.prefix)
    assert patch.patch_offsets == tuple(slot.offset + big + o for o in framing.crc_offsets)
    assert layout.nbytes == layout.files[0].nbytes > big


@pytest.mark.timeout(60)
def test_too_large_record_names_the_entry(tmp_path: Path, temporal_queue) -> None:
    """Past MAX_RECORD_BYTES (2**62 bytes, far beyond any memory): CheckpointError naming
    the state_dict key, raised before anything is written."""
    huge = torch.zeros(1, dtype=torch.float64).expand(MAX_RECORD_BYTES // 8 + 1)
    with pytest.raises(ValueError):
        tensor_framing(torch.float64, tuple(huge.shape), SID)
    target = tmp_path / "ck"
    with pytest.raises(CheckpointError, match=r"'model\.emb'"):
        asyncckpt.save({"model": {"emb": huge}, "step": 1}, target, calls_queue=temporal_queue)
    assert not target.exists()
    assert framing_mod.writer_framing(torch.float64, tuple(huge.shape)) is None


# ----------------------------------------------------------------------------- reader fallback
def _tamper_padding(ckpt: Path, fqn: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Change one ``Z`` of the FB padding before ``fqn``'s data: torch.load ignores it,
    our reader no longer recognises the record as its own."""
    metadata = read_metadata(ckpt)
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)
    prefix = record_framing(dtype, shape).prefix
    at = prefix.rindex(b"FB") + 4
    assert prefix[at : at + 1] == b"Z"
    with open(ckpt / info.relative_path, "r+b") as f:
        f.seek(info.offset + at)
        f.write(b"Y")


@pytest.mark.timeout(60)
def test_records_not_ours_are_streamed_to_torch_load(tmp_path: Path, temporal_queue, monkeypatch) -> None:
    """A record whose framing is not ours is read by torch.load from a stream over the
    file (no copy of the record in memory), as DCP's FileSystemReader does."""
    state: dict[str, Any] = {"w": torch.randn(300, 7), "b": torch.arange(10), "step": 5}
    ckpt = tmp_path / "ck"
    asyncckpt.save(state, ckpt, calls_queue=temporal_queue)
    _tamper_padding(ckpt, "w", torch.float32, (300, 7))
    read: list[int] = []
    real = framing_mod.RecordStream.readinto

    def counting_readinto(self: framing_mod.RecordStream, b: Any) -> int:
        read.append(len(b))
        return real(self, b)

    monkeypatch.setattr(framing_mod.RecordStream, "readinto", counting_readinto)
    out: dict[str, Any] = {"w": torch.zeros(300, 7), "b": torch.zeros(10, dtype=torch.int64), "step": None}
    asyncckpt.load(out, ckpt, verify=False)  # the manifest's CRC no longer matches
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"]) and out["step"] == 5
    assert read, "the tampered record was not read through the fallback"
    # A record that is no archive at all: CorruptCheckpointError naming the entry.
    info = next(v for k, v in read_metadata(ckpt).storage_data.items() if k.fqn == "b")
    with open(ckpt / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(b"JUNK" * 16)
    with pytest.raises(CorruptCheckpointError, match=r"'b' is not a tensor archive"):
        asyncckpt.load({"b": torch.zeros(10, dtype=torch.int64)}, ckpt, verify=False)
    # And a stock dcp.save checkpoint (random serialization ids: nothing is ours).
    stock = tmp_path / "stock"
    dcp.save(state, checkpoint_id=str(stock))
    out = {"w": torch.zeros(300, 7), "b": torch.zeros(10, dtype=torch.int64), "step": None}
    dcp.load(out, storage_reader=dcp_mod.SafeFileSystemReader(stock), planner=dcp_mod.SafeLoadPlanner())
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"]) and out["step"] == 5


# ----------------------------------------------------------------------------- long: real tensors
_BLOCK = 64 << 20


def _block() -> torch.Tensor:
    return torch.randint(0, 256, (_BLOCK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(12))


def _fill(u8: torch.Tensor) -> None:
    """Random-looking bytes, cheap to regenerate: block ``k`` of 64 MiB is one random
    block XOR ``k``."""
    block = _block()
    for k, lo in enumerate(range(0, u8.numel(), _BLOCK)):
        hi = min(lo + _BLOCK, u8.numel())
        torch.bitwise_xor(block[: hi - lo], k & 0xFF, out=u8[lo:hi])


def _assert_filled(u8: torch.Tensor) -> None:
    block, expected = _block(), torch.empty(_BLOCK, dtype=torch.uint8)
    for k, lo in enumerate(range(0, u8.numel(), _BLOCK)):
        hi = min(lo + _BLOCK, u8.numel())
        torch.bitwise_xor(block[: hi - lo], k & 0xFF, out=expected[: hi - lo])
        assert torch.equal(u8[lo:hi], expected[: hi - lo]), f"bytes {lo}..{hi} differ"


def _crc_of_file_range(path: Path, offset: int, length: int) -> int:
    crc, buf = 0, bytearray(_BLOCK)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while length:
            n = f.readinto(memoryview(buf)[: min(length, _BLOCK)])
            assert n > 0
            crc = zlib.crc32(memoryview(buf)[:n], crc)
            length -= n
    return crc


@pytest.mark.slow
@needs_long
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", ["straddle", "limit", "above"])
def test_zip64_framing_is_torch_save_bytes(tmp_path: Path, case: str) -> None:
    """Our framing around a real ~4 GiB tensor is torch.save's, byte for byte."""
    nbytes = {"straddle": ZIP64_LIMIT - 100, "limit": ZIP64_LIMIT, "above": (1 << 32) + 100}[case]
    # torch.empty: untouched pages, read back as zeros without being allocated; the
    # "above" case gets content so that the CRC-32 fields matter.
    t = torch.empty(nbytes, dtype=torch.uint8)
    if case == "above":
        _fill(t)
    path = tmp_path / "archive.pt"  # torch.save names the archive's folder after the file
    try:
        started = time.monotonic()
        torch.save(t, path)
        save_s = time.monotonic() - started
        with zipfile.ZipFile(path) as z:
            sid = z.read("archive/.data/serialization_id").decode("ascii")
        framing = tensor_framing(torch.uint8, (nbytes,), sid)
        size = os.path.getsize(path)
        assert size == len(framing.prefix) + nbytes + len(framing.suffix)
        with open(path, "rb") as f:
            head = f.read(len(framing.prefix))
            f.seek(len(framing.prefix) + nbytes)
            tail = f.read()
        crc = _crc_of_file_range(path, len(framing.prefix), nbytes)
        assert crc == zlib.crc32(t.numpy().data)
        suffix = bytearray(framing.suffix)
        for offset in framing.crc_offsets:
            struct.pack_into("<I", suffix, offset, crc)
        assert head == framing.prefix
        assert tail == bytes(suffix)
        print(f"\n[zip64 torch.save {case}] {nbytes} data bytes, archive {size} bytes, torch.save {save_s:.1f} s")
    finally:
        del t
        if path.exists():
            path.unlink()


@pytest.mark.slow
@needs_long
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_zip64_round_trip(tmp_path: Path, mode: str) -> None:
    """A >4 GiB fp32 tensor (e.g. an unsharded embedding): asyncckpt.save, verify,
    asyncckpt.load (raw fast path) and stock dcp.load give it back bit for bit."""
    shape = ((1 << 20) + 1, 1024)  # 4 GiB + 4 KiB of float32
    nbytes = shape[0] * shape[1] * 4
    ckpt = tmp_path / "ck"
    figures: dict[str, float] = {}
    try:
        emb = torch.empty(shape, dtype=torch.float32)
        _fill(emb.view(-1).view(torch.uint8))
        state = {"model": {"emb": emb, "bias": torch.arange(7, dtype=torch.float32)}, "step": 3}
        with closing_queue(persistent=True) as queue:
            started = time.monotonic()
            handle = asyncckpt.save(state, ckpt, async_op=mode == "async", calls_queue=queue)
            figures["save_returned_s"] = time.monotonic() - started
            handle.wait(timeout=900)
            figures["committed_s"] = time.monotonic() - started
            timings = handle.timings
            assert timings is not None
            figures.update(stall_s=timings.stall_s, write_s=timings.write_s, gbps=timings.gbps)
            del handle
        del state, emb, queue
        gc.collect()  # frees the staging slab with the queue's saver
        figures["rss_after_save_gib"] = psutil.Process().memory_info().rss / 2**30

        started = time.monotonic()
        manifest = asyncckpt.verify(ckpt)
        figures["verify_s"] = time.monotonic() - started
        data_bytes = manifest["total_bytes"]
        assert data_bytes > nbytes

        # asyncckpt.load: the record is recognised as ours and read straight into the target.
        calls: list[bool] = []
        real_read_record = dcp_mod.read_record

        def spy(reader: FileReader, path: str, offset: int, framing: TensorFraming, dest: memoryview) -> bool:
            ok = real_read_record(reader, path, offset, framing, dest)
            calls.append(ok and framing.nbytes == nbytes)
            return ok

        out: dict[str, Any] = {
            "model": {"emb": torch.empty(shape, dtype=torch.float32), "bias": torch.zeros(7)},
            "step": None,
        }
        dcp_mod.read_record = spy
        try:
            started = time.monotonic()
            with observing_loads() as loads:
                asyncckpt.load(out, ckpt)
            figures["load_s"] = time.monotonic() - started
        finally:
            dcp_mod.read_record = real_read_record
        # The state is the checkpoint's, key for key, dtype and shape, in our writer's
        # zip64 framing: the direct load path reads it straight into the target (its
        # framing checked against ours), never DCP's path (whose raw record read the
        # spy sees).
        assert loads.paths() == {"direct": 1, "dcp": 0}, (
            f"the zip64 checkpoint was loaded by {loads.paths()}, not the direct path alone"
        )
        assert not calls, "DCP's path read records of the zip64 checkpoint"
        assert out["step"] == 3 and torch.equal(out["model"]["bias"], torch.arange(7, dtype=torch.float32))
        _assert_filled(out["model"]["emb"].view(-1).view(torch.uint8))
        del out
        gc.collect()

        # Stock DCP: FileSystemReader, one torch.load per item, into fresh tensors.
        out = {"model": {"emb": torch.zeros(shape, dtype=torch.float32), "bias": torch.zeros(7)}, "step": None}
        started = time.monotonic()
        dcp.load(out, checkpoint_id=str(ckpt))
        figures["dcp_load_s"] = time.monotonic() - started
        assert out["step"] == 3 and torch.equal(out["model"]["bias"], torch.arange(7, dtype=torch.float32))
        _assert_filled(out["model"]["emb"].view(-1).view(torch.uint8))
        del out
        gc.collect()

        if mode == "async":
            # A record that is not ours (one padding byte changed): streamed to torch.load.
            _tamper_padding(ckpt, "model.emb", torch.float32, shape)
            out = {"model": {"emb": torch.empty(shape, dtype=torch.float32), "bias": torch.zeros(7)}, "step": None}
            started = time.monotonic()
            asyncckpt.load(out, ckpt, verify=False)
            figures["fallback_load_s"] = time.monotonic() - started
            _assert_filled(out["model"]["emb"].view(-1).view(torch.uint8))
            del out
        figures["max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(
            f"\n[zip64 round trip {mode}] tensor {nbytes} bytes, data files {data_bytes} bytes; "
            + ", ".join(f"{k} {v:.2f}" for k, v in figures.items())
        )
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
        gc.collect()
