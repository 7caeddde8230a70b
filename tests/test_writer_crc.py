"""The writer's checksums: ``crc32_combine`` against zlib, and ``write_rank_files`` (the
segments cover the file and match zlib over its bytes; each record's CRC-32 is patched
into its zip fields) for records below, at and above the sizes where the writer merges
CRCs instead of checksumming twice, and where a record gets its own segment."""

from __future__ import annotations

import os
import random
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest

from asyncckpt.format import crc as crc_mod
from asyncckpt.format.filespec import CrcPatch, FileSpec, pack_patches
from asyncckpt.io import writer
from asyncckpt.io.writer import BIG_SEGMENT_BYTES, COMBINE_MIN_BYTES, WriteTask, crc32_combine, write_rank_files
from asyncckpt.saving.staging import StagingBuffer


def _write(image: bytes, patches: list[CrcPatch], out: Path) -> tuple[tuple[tuple[int, int, int], ...], bytes]:
    """Write ``image`` (its ``patches`` CRC-32 fields patched) as one data file in
    ``out``, as a rank's writer does from its staging buffer, in this process; returns
    the file's checksummed segments and its bytes."""
    buffer = StagingBuffer(len(image))
    try:
        buffer.write_bytes(0, image)
        spec = FileSpec("__0_0.distcp", 0, len(image), pack_patches(patches))
        result = write_rank_files(WriteTask(str(out), buffer.ref, (spec,), (buffer.slab_id,), fsync=False))
    finally:
        buffer.release()
    return result.files[0].segments, (out / spec.name).read_bytes()


@pytest.mark.timeout(60)
def test_crc32_combine_matches_zlib() -> None:
    rng = random.Random(3)
    for n1, n2 in [
        (0, 0),
        (0, 1),
        (1, 0),
        (7, 3),
        (100, COMBINE_MIN_BYTES),
        (5, COMBINE_MIN_BYTES + 1),
        (4096, BIG_SEGMENT_BYTES - 64),
        (3, 12345),
    ]:
        a, b = rng.randbytes(n1), rng.randbytes(n2)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), n2) == zlib.crc32(a + b), (n1, n2)
        start = rng.getrandbits(32)
        assert crc32_combine(start, zlib.crc32(b), n2) == zlib.crc32(b, start), (start, n2)


@pytest.mark.timeout(60)
def test_segments_and_patched_crcs_match_zlib(tmp_path: Path) -> None:
    rng = random.Random(5)
    # 70 KiB and 300 KiB repeat often enough to get tables (merged CRCs); the others not.
    sizes = [
        10,
        COMBINE_MIN_BYTES - 64,
        COMBINE_MIN_BYTES,
        200 << 10,
        BIG_SEGMENT_BYTES - 64,
        BIG_SEGMENT_BYTES,
        3 << 20,
    ] + rng.sample([64, 70 << 10, 300 << 10] * 40, 120)
    image = bytearray()
    patches = []
    for n in sizes:
        image += rng.randbytes(100)  # "framing" before the data
        data_offset = len(image)
        image += rng.randbytes(n)
        fields = (len(image) + 4, len(image) + 20)
        image += bytes(40)  # "framing" after, with two CRC fields
        patches.append(CrcPatch(data_offset, n, fields))
    image += rng.randbytes(77)
    segments, data = _write(bytes(image), patches, tmp_path)
    assert len(data) == len(image)
    pos = 0
    for offset, length, crc in segments:
        assert offset == pos and zlib.crc32(data[offset : offset + length]) == crc, (offset, length)
        pos = offset + length
    assert pos == len(image) and len(segments) > 3
    for p in patches:
        expected = zlib.crc32(image[p.data_offset : p.data_offset + p.data_nbytes])
        assert (
            data[p.data_offset : p.data_offset + p.data_nbytes] == image[p.data_offset : p.data_offset + p.data_nbytes]
        )
        for f in p.patch_offsets:
            assert struct.unpack_from("<I", data, f)[0] == expected


@pytest.mark.timeout(120)
def test_many_record_sizes_checksum_each_byte_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With more distinct record sizes than any small cache holds (20 here, each seen
    often enough to be merged), a steady file image is checksummed once per byte: the
    merge tables are built once per size and then read, never rebuilt per record."""
    rng = random.Random(11)
    sizes = [COMBINE_MIN_BYTES + i * 4096 for i in range(20)] * 34
    rng.shuffle(sizes)
    image = bytearray()
    patches = []
    for n in sizes:
        image += bytes(64)
        data_offset = len(image)
        image += rng.randbytes(n)
        patches.append(CrcPatch(data_offset, n, (len(image) + 4,)))
        image += bytes(16)
    checksummed = [0]
    real_crc32 = writer.crc32

    def counting_crc32(data, start=0):
        checksummed[0] += memoryview(data).nbytes
        return real_crc32(data, start)

    _write(bytes(image), patches, tmp_path / "first")  # the first image builds the tables
    monkeypatch.setattr(writer, "crc32", counting_crc32)
    segments, data = _write(bytes(image), patches, tmp_path / "steady")
    assert checksummed[0] == len(image), f"{checksummed[0] / len(image):.2f} checksums per byte"
    pos = 0
    for offset, length, crc in segments:
        assert offset == pos and zlib.crc32(data[offset : offset + length]) == crc
        pos = offset + length
    assert pos == len(image)


def test_crc_chain_equals_zlib_over_ranges() -> None:
    """The CRC of consecutive ranges, folded on the helper thread piece by piece, is
    zlib's CRC-32 of each range; the fast implementation (isal, a dependency) is in use."""
    assert crc_mod.IMPLEMENTATION == "isal"
    data = os.urandom(3 << 20)
    ranges = [(0, 1), (1, 70_000), (70_001, 1 << 20), ((1 << 20) + 70_001, len(data))]
    with crc_mod.CrcChain() as chain:
        for lo, hi in ranges:
            view = memoryview(data)[lo:hi]
            chain.update([view[: len(view) // 3], view[len(view) // 3 :]])
            chain.end((lo, hi))
        got = chain.take() + chain.close()
    assert got == [(((lo, hi), None), zlib.crc32(data[lo:hi])) for lo, hi in ranges]
    assert crc_mod.crc32(data[5:999], 12345) == zlib.crc32(data[5:999], 12345)
    # feed(): the same ranges handed over in two batches, one range split across them.
    mv = memoryview(data)
    with crc_mod.CrcChain() as chain:
        chain.feed([([mv[0:1]], ((0, 1), 5)), ([mv[1:30_000]], None)])
        chain.feed(
            [
                ([mv[30_000:70_000]], ((1, 70_000), zlib.crc32(data[1:70_000]))),
                ([mv[70_001 : 1 << 20]], ((70_001, 1 << 20), None)),
                ([], ((7, 7), 0)),
            ]
        )
        fed = chain.close()
    assert fed == [
        (((0, 1), 5), zlib.crc32(data[0:1])),
        (((1, 70_000), zlib.crc32(data[1:70_000])), zlib.crc32(data[1:70_000])),
        (((70_001, 1 << 20), None), zlib.crc32(data[70_001 : 1 << 20])),
        (((7, 7), 0), 0),
    ]


@pytest.mark.timeout(120)
def test_checkpoints_check_the_same_without_isal(tmp_path) -> None:
    """A checkpoint written with isal's CRC verifies and loads where only zlib's is
    available (a platform without an isal wheel), and the other way round."""
    import subprocess
    import sys

    import torch

    import asyncckpt

    state: dict[str, Any] = {"w": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(7), "step": 3}
    asyncckpt.save(state, tmp_path / "isal", async_op=False)
    script = (
        "import sys, torch\n"
        "sys.modules['isal'] = sys.modules['isal.isal_zlib'] = None\n"
        "import asyncckpt\n"
        "from asyncckpt.format import crc\n"
        "assert crc.IMPLEMENTATION == 'zlib', crc.IMPLEMENTATION\n"
        "out = {'w': torch.zeros(300_000), 'b': torch.zeros(7), 'step': 0}\n"
        "asyncckpt.verify(sys.argv[1] + '/isal')\n"
        "asyncckpt.load(out, sys.argv[1] + '/isal')\n"
        "assert torch.equal(out['w'], torch.arange(300_000, dtype=torch.float32)) and out['step'] == 3\n"
        "asyncckpt.save(out, sys.argv[1] + '/zlib', async_op=False)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    asyncckpt.verify(tmp_path / "zlib")
    out: dict[str, Any] = {"w": torch.zeros(300_000), "b": torch.zeros(7), "step": 0}
    asyncckpt.load(out, tmp_path / "zlib")
    assert torch.equal(out["w"], state["w"]) and out["step"] == 3
