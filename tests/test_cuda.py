"""The CUDA staging path: pinned slab, non-blocking D2H copies on a side stream.

Skipped without a CUDA device (CI has none); run on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch

import asyncckpt
from asyncckpt.testing import staging_buffers

from helpers import assert_same

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _cuda_state(seed: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "w": torch.randn(4096, 1024, device="cuda", generator=g),
        "h": torch.randn(1000, device="cuda", generator=g).half(),
        "cpu": torch.arange(10),
        "step": seed,
    }


def _reference(sd: dict) -> dict:
    return {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}


def test_cuda_save_copies_after_pending_compute(tmp_path):
    """The D2H copies wait for the compute stream: a tensor written by a kernel still
    running when save() is called is saved with the kernel's result."""
    sd = _cuda_state(0)
    with asyncckpt.CheckpointManager(tmp_path) as mgr:
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(4):
            torch.matmul(a, a[:, :1024], out=sd["w"])  # queued on the compute stream
        handle = mgr.save(1, sd)
        expected = _reference(sd)  # synchronizes: the kernel's result
        sd["w"].zero_()
        handle.wait()
        buffers = staging_buffers(mgr)
        assert buffers and all(b.pinned for b in buffers)  # D2H into page-locked memory
    out = {
        "w": torch.empty(4096, 1024),
        "h": torch.empty(1000, dtype=torch.half),
        "cpu": torch.empty(10, dtype=torch.long),
        "step": 0,
    }
    asyncckpt.load(out, tmp_path / "step_00000001")
    assert_same(expected, out)


def test_cuda_overlapped_staging(tmp_path):
    sd = _cuda_state(1)
    with asyncckpt.CheckpointManager(tmp_path, overlap_staging=True) as mgr:
        expected = _reference(sd)
        handle = mgr.save(1, sd)
        b = torch.randn(2048, 2048, device="cuda")
        for _ in range(8):
            b = b @ b.T / 2048  # the next forward/backward, overlapped with the D2H copies
        mgr.synchronize_staging()
        sd["w"].add_(1)  # optimizer.step()
        handle.wait()
    out = {
        "w": torch.empty(4096, 1024, device="cuda"),
        "h": torch.empty(1000, dtype=torch.half, device="cuda"),
        "cpu": torch.empty(10, dtype=torch.long),
        "step": 0,
    }
    asyncckpt.load(out, tmp_path / "step_00000001")
    assert_same(expected, {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in out.items()})
