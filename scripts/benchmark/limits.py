"""The physical limits a save is compared with, measured on the same bytes: memcpy into
preallocated memory (the staging limit), a raw sequential write + fsync (the commit
limit) and a raw read (the load limit)."""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmark.common import as_bytes, free_memory, tensors_of


def bench_memcpy(sd: Any, reps: int, before: Callable[[], None] | None = None) -> list[float]:
    """Times (s) of copying every tensor of ``sd`` into preallocated host memory (the
    staging limit): D2H into pinned memory for GPU tensors; for CPU tensors the faster,
    in each repetition, of torch's ``copy_`` per tensor and libc ``memmove`` per
    tensor (through ctypes; torch's copy runs on its intra-op threads and is the slower
    of the two on a busy machine). ``before()`` runs before each timed copy (the
    fsdp2 workload passes a barrier, so that every rank copies at once)."""
    before = before or (lambda: None)
    src = list(tensors_of(sd))
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in src]
    cuda = any(t.is_cuda for t in src)
    for d, s in zip(dst, src):
        d.copy_(s)  # warm: pages faulted in
    moves = [
        (d.data_ptr(), s.data_ptr(), s.numel() * s.element_size())
        for d, s in zip(dst, src)
        if not cuda and s.is_contiguous()
    ]
    times = []
    for _ in range(reps):
        before()
        t0 = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        if moves and len(moves) == len(src):
            before()
            t0 = time.perf_counter()
            for move in moves:
                ctypes.memmove(*move)
            elapsed = min(elapsed, time.perf_counter() - t0)
        times.append(elapsed)
    del dst
    free_memory()
    return times


def host_tensors(sd: Any) -> list[torch.Tensor]:
    """The state's tensors in host memory, for the raw write / read limits: the tensors
    themselves on CPU, a host copy (made here, untimed) of GPU ones."""
    return [t.detach().cpu() if t.is_cuda else t for t in tensors_of(sd)]


def raw_write(sd: Any, path: Path) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors_of(sd):
            mv = as_bytes(t)
            while mv:
                n = os.write(fd, mv[: 64 << 20])
                mv = mv[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def raw_read(sd: Any, path: Path) -> float:
    """Read the file back into the state's own tensors (readinto, sequential)."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        for t in tensors_of(sd):
            mv = as_bytes(t)
            while mv:
                n = f.readinto(mv[: 64 << 20])
                if not n:
                    raise EOFError(path)
                mv = mv[n:]
    return time.perf_counter() - t0
