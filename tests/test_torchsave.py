"""``tensor_framing`` is byte-for-byte ``torch.save(tensor)``.

For each dtype and shape we take a real ``torch.save`` archive, read its random
``archive/.data/serialization_id``, build our framing with that id, put the raw tensor
bytes between prefix and suffix, patch the CRC-32 of the raw bytes into the suffix at
``crc_offsets``, and compare the result with the reference bytes.
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib

import pytest
import torch

from asyncckpt.format.torchsave import TensorFraming, tensor_framing

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
]
SHAPES = [(), (0,), (3, 5), (2, 0, 3), (1, 1, 1, 7)]


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor with non-trivial content (so that the CRC-32 matters)."""
    g = torch.Generator().manual_seed(1234)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    # integers (incl. the unsigned ones without arange/randint kernels): go through int64
    return torch.randint(0, 100, shape, generator=g, dtype=torch.int64).to(dtype)


def _raw_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    if t.numel() == 0:
        return b""
    return bytes(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def _torch_save_bytes(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _assemble(framing: TensorFraming, raw: bytes) -> bytes:
    suffix = bytearray(framing.suffix)
    crc = zlib.crc32(raw)
    for offset in framing.crc_offsets:
        struct.pack_into("<I", suffix, offset, crc)
    return framing.prefix + raw + bytes(suffix)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_framing_is_torch_save_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = _sample(dtype, shape)
    reference = _torch_save_bytes(t)
    sid = zipfile.ZipFile(io.BytesIO(reference)).read("archive/.data/serialization_id").decode("ascii")

    framing = tensor_framing(dtype, shape, sid)
    raw = _raw_bytes(t)

    assert framing.nbytes == len(raw) == t.numel() * t.element_size()
    assert len(framing.prefix) % 64 == 0, "raw data must start 64-byte aligned"
    if raw:
        assert len(framing.crc_offsets) == 2
    else:
        assert framing.crc_offsets == ()
    assembled = _assemble(framing, raw)
    assert len(assembled) == len(reference)
    assert assembled == reference

    # And torch.load reads it back bit for bit.
    loaded = torch.load(io.BytesIO(assembled), weights_only=True)
    assert loaded.dtype == dtype and tuple(loaded.shape) == tuple(shape)
    assert _raw_bytes(loaded) == raw


@pytest.mark.timeout(60)
def test_framing_does_not_depend_on_tensor_values() -> None:
    """The framing is static per (dtype, shape): different values only change the raw
    bytes and the patched CRC fields."""
    sid = "1" * 40
    a = torch.arange(15, dtype=torch.float32).reshape(3, 5)
    b = -a
    f = tensor_framing(torch.float32, (3, 5), sid)
    assert f == tensor_framing(torch.float32, (3, 5), sid)
    for t in (a, b):
        out = _assemble(f, _raw_bytes(t))
        assert torch.equal(torch.load(io.BytesIO(out), weights_only=True), t)
        # The zip is valid (CRCs checked by zipfile on read).
        with zipfile.ZipFile(io.BytesIO(out)) as z:
            assert z.testzip() is None


@pytest.mark.timeout(60)
def test_framing_rejects_bad_serialization_id() -> None:
    with pytest.raises(ValueError):
        tensor_framing(torch.float32, (2,), "too-short")
