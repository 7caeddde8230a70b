"""Helpers every part of the benchmark uses: sizes, logging, walking a state's tensors,
scratch files and the page cache."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import shutil
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

#: The repository; its root (``asyncckpt``) and ``scripts/`` (``train``, ``bench_lightning``)
#: are importable from here on, as when ``scripts/bench.py`` runs from a checkout.
ROOT = Path(__file__).resolve().parent.parent.parent
for _p in (str(ROOT / "scripts"), str(ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def log(msg: str) -> None:
    """A progress line on stderr (stdout carries the markdown)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a nested dict / list, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_of(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_of(v)


def to_device(obj: Any, device: str) -> Any:
    """A nested dict / list with every tensor moved to ``device`` (``"cpu"``: as it is)."""
    if device == "cpu":
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def state_bytes(sd: Any) -> int:
    """Bytes of every tensor of ``sd`` (local shards' bytes for a list of them)."""
    return sum(t.numel() * t.element_size() for t in tensors_of(sd))


def as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def mutate(sd: Any) -> None:
    """What the trainer does after a save: write to its state (one element per tensor;
    of a DTensor, of its local shard)."""
    for t in tensors_of(sd):
        if hasattr(t, "to_local"):
            t = t.to_local()
        if t.numel() and t.is_floating_point():
            t.view(-1)[:1].add_(1.0)


def parse_size(s: str) -> int:
    """``"256M"`` -> bytes (suffixes K, M, G: powers of 1024; none: bytes)."""
    mult = {"K": KiB, "M": MiB, "G": GiB}
    return int(float(s[:-1]) * mult[s[-1].upper()]) if s[-1].upper() in mult else int(s)


def free_memory() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc), between systems."""
    gc.collect()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def drop_cache(path: Path) -> None:
    """Evict ``path`` (a file, or every file under a directory) from the page cache.

    Without root, /proc/sys/vm/drop_caches is out of reach; posix_fadvise(DONTNEED)
    drops the clean (already fsynced) pages of the files themselves.
    """
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def remove(path: Path) -> None:
    """Remove a file or a directory tree, if present."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def error_line(exc: BaseException, limit: int = 300) -> str:
    """An error on one line (a table cell), at most ``limit`` characters: ``Type: the
    message's first line``, and where the message has more lines, `` ... `` and its last
    (a remote traceback's cause)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    if len(lines) > 1:
        text += f" ... {lines[-1]}"
    text = text.replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def med(xs: list[float]) -> float:
    """The median, NaN for no values."""
    return statistics.median(xs) if xs else float("nan")
