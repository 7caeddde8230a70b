"""Staging: host buffers the training process copies the state into.

A save's data files are laid out, byte for byte, in one shared host buffer per rank
(a *slab*): the ``torch.save`` framing of every tensor record is written once when
the slab is formatted for a layout, and each save only copies the tensors' bytes
into their places (device-to-host for CUDA tensors) and the few bytes of non-tensor
values. The background writer maps the slab by path and writes it out sequentially.

Slabs are anonymous memory files (``memfd_create``): nothing appears in /dev/shm, and
the memory goes away with the last process that maps it, also after SIGKILL. They are
allocated once and reused across saves (the idea of DCP's cached stager,
``torch.distributed.checkpoint.staging``), and a slab is never handed out again while
a write that reads it may still run (DESIGN.md: known failure 5).
"""

from __future__ import annotations

import mmap
import os
import uuid
from typing import Any, Callable

import torch

from .storage import writer as _writer
from .storage.writer import SlabRef

__all__ = ["HostSlab", "Stager"]

_PAGE = mmap.PAGESIZE


class HostSlab:
    """One shared host buffer backed by a memfd.

    Args:
        nbytes: size in bytes (rounded up to a whole page).

    Attributes:
        ref: how the writer finds it (:class:`~asyncckpt.storage.writer.SlabRef`).
        u8: a ``torch.uint8`` tensor of shape ``(nbytes,)`` over the whole slab.
        layout_key: the layout the slab is currently formatted for (or ``None``).

    Raises:
        OSError: the memory cannot be allocated.
    """

    def __init__(self, nbytes: int) -> None:
        nbytes = max(_PAGE, -(-int(nbytes) // _PAGE) * _PAGE)
        self.slab_id = uuid.uuid4().hex
        self._fd = os.memfd_create(f"asyncckpt-{self.slab_id[:8]}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, nbytes)
            self._mm = mmap.mmap(self._fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self._fd)
            raise
        self.nbytes = nbytes
        self.u8 = torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes)
        self.layout_key: Any = None
        #: ``(item index, tensor view)`` per staged tensor of ``layout_key``.
        self.views: list[tuple[int, torch.Tensor]] = []
        self.ref = SlabRef(self.slab_id, f"/proc/{os.getpid()}/fd/{self._fd}", nbytes)

    def write_bytes(self, offset: int, data: bytes | memoryview) -> None:
        """Copy ``data`` into the slab at ``offset`` (bytes)."""
        self._mm[offset:offset + len(data)] = data

    def release(self) -> None:
        """Unmap and close; the memory is freed once no other process maps it."""
        if self._fd < 0:
            return
        self.u8 = None  # type: ignore[assignment]
        self.views = []
        writer_map = _writer._mapped.pop(self.slab_id, None)  # mapped here by a sync save
        if writer_map is not None:
            writer_map.close()
        try:
            self._mm.close()
        except BufferError:
            pass  # a view still exists; the mapping goes with the last reference
        os.close(self._fd)
        self._fd = -1


class _Entry:
    __slots__ = ("slab", "call_idx")

    def __init__(self, slab: HostSlab) -> None:
        self.slab = slab
        self.call_idx: int | None = None  # the call whose write may read the slab


class Stager:
    """A small pool of reusable slabs.

    Args:
        num_buffers: how many slabs may exist at once. 1 (default) bounds the extra
            host memory to one copy of the state: a save then waits until the
            previous write no longer reads the slab. 2 double-buffers.
    """

    def __init__(self, num_buffers: int = 1) -> None:
        if num_buffers < 1:
            raise ValueError("num_buffers must be >= 1")
        self.num_buffers = num_buffers
        self._entries: list[_Entry] = []

    @property
    def live_slab_ids(self) -> tuple[str, ...]:
        return tuple(e.slab.slab_id for e in self._entries)

    @property
    def nbytes(self) -> int:
        """Host memory held, in bytes."""
        return sum(e.slab.nbytes for e in self._entries)

    def acquire(
        self,
        nbytes: int,
        layout_key: Any,
        is_running: Callable[[int], bool],
        wait: Callable[[int], Any],
    ) -> HostSlab:
        """A slab of at least ``nbytes`` that no running write reads.

        Prefers a free slab already formatted for ``layout_key``. If every slab may
        still be read and the pool is full, waits (``wait(call_idx)``) for the oldest
        write. A slab too small is replaced.

        Args:
            nbytes: bytes needed.
            layout_key: the layout to be staged (hashable).
            is_running: ``is_running(call_idx)``: may that call's write still run?
            wait: blocks until that call's write no longer runs.
        """
        free = [e for e in self._entries if e.call_idx is None or not is_running(e.call_idx)]
        for e in free:
            e.call_idx = None
        fitting = [e for e in free if e.slab.nbytes >= nbytes]
        for e in fitting:
            if e.slab.layout_key == layout_key:
                return e.slab
        if fitting:
            return fitting[0].slab
        if len(self._entries) < self.num_buffers:
            entry = _Entry(HostSlab(nbytes))
            self._entries.append(entry)
            return entry.slab
        victim = free[0] if free else self._oldest()
        if victim.call_idx is not None:
            wait(victim.call_idx)
            victim.call_idx = None
        if victim.slab.nbytes >= nbytes:
            return victim.slab
        self._entries.remove(victim)
        victim.slab.release()
        entry = _Entry(HostSlab(nbytes))
        self._entries.append(entry)
        return entry.slab

    def _oldest(self) -> _Entry:
        return min(self._entries, key=lambda e: -1 if e.call_idx is None else e.call_idx)

    def lease(self, slab: HostSlab, call_idx: int) -> None:
        """Mark ``slab`` as read by the write of ``call_idx``."""
        for e in self._entries:
            if e.slab is slab:
                e.call_idx = call_idx

    def release_all(self) -> None:
        """Free every slab (call only when no write runs any more)."""
        for e in self._entries:
            e.slab.release()
        self._entries.clear()
