"""Staging: the host buffers the training process copies the state into (D2H).

One module over 600 lines, on purpose: the buffer, its pool, the copier and the
optimizer-step guard of overlapped copies share the buffers' memory invariants (who
may write a buffer, and when).

A save's data files are laid out, byte for byte, in one shared host *staging buffer*
per rank: the ``torch.save`` framing of every tensor record is written once when the
buffer is formatted for a layout, and each save only copies the tensors' bytes into
their places (device-to-host for CUDA tensors) and the few bytes of non-tensor
values. The background writer maps the buffer by path and writes it out.

Buffers are anonymous memory files (``memfd_create``): nothing appears in /dev/shm,
and the memory goes away with the last process that maps it, also after SIGKILL.
A :class:`StagingPool` allocates them once and reuses them across saves (the idea of
DCP's cached staging, ``torch.distributed.checkpoint.staging``), and never hands a
buffer out again while a write that reads it may still run (DESIGN.md: known
failure 5). A buffer is freed with its owner (the pool, and so the saver, manager or
queue that owns the pool), or when it is garbage-collected.

(The names follow the field: in DCP a "stager" is what copies a state_dict; the
buffers here are staging buffers, the pool that reuses them a buffer pool.)
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import functools
import mmap
import os
import threading
import uuid
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from asyncckpt import _faults
from asyncckpt.io import writer as _writer
from asyncckpt.io.writer import SlabRef

__all__ = ["StagingBuffer", "StagingPool", "StagingCopier", "watch_copy", "unwatch_copy", "order_pending_copies"]

_PAGE = mmap.PAGESIZE

#: Tensors of at least this many elements are copied with ``memmove`` instead of
#: torch: torch's own copy splits such a tensor across its intra-op (OpenMP) threads,
#: one fork/join per tensor, and when another process holds a core (the checkpoint
#: writer, DataLoader workers) every join waits for a time slice: a 1.3 ms copy of
#: 159 tensors then took 100-280 ms. 32768 is torch's ``at::internal::GRAIN_SIZE``:
#: below it torch copies serially, in one ``_foreach_copy_`` call for all of them.
MEMMOVE_MIN_NUMEL = 32768


#: ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14): allocate and map a range's pages for
#: writing, as the first writes would, in one call without a fault per 4 KiB page.
MADV_POPULATE_WRITE = 23
_madvise: Callable[[int, int, int], int] | None  # (address, bytes, advice) -> 0 or -1
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _madvise_fn = _libc.madvise
    _madvise_fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _madvise_fn.restype = ctypes.c_int
    _madvise = _madvise_fn
except (OSError, AttributeError):  # pragma: no cover - not Linux/glibc
    _madvise = None
#: Whether :func:`prefault` uses ``MADV_POPULATE_WRITE``; cleared when the kernel refuses
#: it (EINVAL: before 5.14). Set to ``False``, the buffers take the older kernels' path.
populate_write = _madvise is not None


def prefault(address: int, nbytes: int) -> bool:
    """Allocate and map the pages of ``[address, address + nbytes)`` (bytes, a range of a
    staging buffer's mapping) for writing, without holding the GIL.

    This is the allocation a new staging buffer costs: done by the copy threads piece
    by piece just before they copy into it, it runs on every core at once, where
    ``MAP_POPULATE`` at ``mmap`` time ran on one (measured here for 1 GiB: allocation +
    copy 888 ms with ``MAP_POPULATE``, 503 ms prefaulted in 8 MiB pieces by 2 threads).

    Returns:
        ``False`` when the kernel has no ``MADV_POPULATE_WRITE`` (before Linux 5.14):
        the pages are then faulted in by the first writes.

    Raises:
        OSError: the kernel refuses the memory (``ENOMEM``), where a write into the
            unallocated page would fault (``SIGBUS``, or the OOM killer).
    """
    global populate_write
    if not populate_write or _madvise is None or nbytes <= 0:
        return False
    lo = address - address % _PAGE
    hi = -(-(address + nbytes) // _PAGE) * _PAGE
    for _ in range(3):
        if _madvise(lo, hi - lo, MADV_POPULATE_WRITE) == 0:
            return True
        err = ctypes.get_errno()
        if err == errno.EINVAL:  # an older kernel: fault the pages in by writing
            populate_write = False
            return False
        if err not in (errno.EINTR, errno.EAGAIN):
            raise OSError(err, f"cannot allocate {hi - lo} bytes of staging memory: {os.strerror(err)}")
    return False


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class StagingBuffer:
    """One shared host staging buffer backed by a memfd.

    Args:
        nbytes: size in bytes (rounded up to a whole page).

    Attributes:
        ref: how the writer finds it (:class:`~asyncckpt.io.writer.SlabRef`).
        u8: a ``torch.uint8`` tensor of shape ``(nbytes,)`` over the whole buffer.
        layout_key: the layout the buffer is currently formatted for (or ``None``).

    Raises:
        OSError: the memory cannot be allocated.
    """

    def __init__(self, nbytes: int) -> None:
        nbytes = max(_PAGE, -(-int(nbytes) // _PAGE) * _PAGE)
        self.slab_id = uuid.uuid4().hex
        self._fd = os.memfd_create(f"asyncckpt-{self.slab_id[:8]}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, nbytes)
            # Not populated here: the first copy allocates the pages, piece by piece on
            # every copy thread (prefault), or populate() does before pinning / prepare().
            self._mm = mmap.mmap(self._fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self._fd)
            raise
        self.nbytes = nbytes
        self.u8 = torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes)
        self.layout_key: Any = None
        #: ``(item index, tensor view)`` per staged tensor of ``layout_key``.
        self.views: list[tuple[int, torch.Tensor]] = []
        #: The same, as two lists built once per layout: the items, and the views.
        self.items: list[int] = []
        self.dsts: list[torch.Tensor] = []
        #: How :attr:`dsts` are copied (:meth:`copy_program`); indices only, no views.
        self.program: CopyProgram | None = None
        self.ref = SlabRef(self.slab_id, f"/proc/{os.getpid()}/fd/{self._fd}", nbytes)
        self.pinned = False
        #: Whether the pages are allocated (by :meth:`populate` or a first copy).
        self.populated = False
        # Dropped without release(): the mapping goes with its last view, the fd here.
        # Not at interpreter exit (the kernel closes it then): weakref's own atexit
        # function would close it before a user's atexit handler that saves runs.
        self._fd_finalizer = weakref.finalize(self, _close_fd, self._fd)
        self._fd_finalizer.atexit = False

    def format(self, layout: Any) -> None:
        """Format the buffer for ``layout`` (a ``RankLayout``), once per layout.

        Writes the ``torch.save`` framing of every record and builds the tensor views
        the staging copies go through (reused by every later save of this layout).
        """
        if self.layout_key == layout.key:
            return
        for offset, framing in layout.static:
            self.write_bytes(offset, framing)
        u8 = self.u8
        self.views = [
            (slot.item, u8[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape))
            for slot in layout.tensors
            if slot.nbytes
        ]
        self.items = [item for item, _ in self.views]
        self.dsts = [view for _, view in self.views]
        self.program = None
        self.layout_key = layout.key

    def copy_program(self, copier: StagingCopier) -> CopyProgram:
        """How ``copier`` copies into :attr:`dsts`: made by the first save of the layout
        (:meth:`StagingCopier.program`), kept for the next ones (again if the copier's
        threads changed)."""
        if self.program is None or self.program.threads != copier.threads:
            self.program = copier.program(self.dsts)
        return self.program

    def populate(self, copier: StagingCopier) -> None:
        """Allocate every page of the buffer now, on ``copier``'s threads (once; keeps the
        bytes). ``prepare()`` and :meth:`pin` call it; a save's first copy allocates the
        pages it copies into itself.

        Raises:
            OSError: the memory cannot be allocated.
        """
        if self.populated:
            return
        fd = self._fd

        def one(lo: int, n: int) -> None:
            if not prefault(base + lo, n):  # an older kernel: a populating mapping of the range
                mmap.mmap(fd, n, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), offset=lo).close()

        base = self.u8.data_ptr()
        step = copier.PIECE_BYTES
        copier.run([(lo, min(step, self.nbytes - lo)) for lo in range(0, self.nbytes, step)], one)
        self.populated = True

    def pin(self) -> None:
        """Page-lock the slab for CUDA (``cudaHostRegister``), once.

        Device-to-host copies into pinned memory run asynchronously at full PCIe
        bandwidth; into pageable memory they are staged by the driver and block.
        The memfd stays shareable with the writer process: pinning changes nothing
        for the CPU side.

        Raises:
            RuntimeError: CUDA refused to register the memory.
        """
        if self.pinned:
            return
        err = torch.cuda.cudart().cudaHostRegister(self.u8.data_ptr(), self.nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of a {self.nbytes}-byte staging slab failed: {err}")
        self.pinned = True

    def write_bytes(self, offset: int, data: bytes | memoryview) -> None:
        """Copy ``data`` into the slab at ``offset`` (bytes)."""
        self._mm[offset : offset + len(data)] = data

    def release(self, free_memory: bool = True) -> None:
        """Unmap and close; with ``free_memory`` (only when no write reads the buffer any
        more) the memfd is truncated to 0 bytes first.

        Truncation frees the pages at once, also while other processes still map the
        buffer or hold its descriptor (children forked after it was allocated, e.g.
        DataLoader workers; a worker's cached mapping), which would otherwise keep the
        staging memory alive after ``close()``. Without it the memory goes with the
        last process that maps it.
        """
        if self._fd < 0:
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.u8.data_ptr())
            self.pinned = False
        self.u8 = None  # type: ignore[assignment]
        self.views, self.items, self.dsts, self.program = [], [], [], None
        writer_map = _writer._mapped.pop(self.slab_id, None)  # mapped here by a sync save
        if writer_map is not None:
            writer_map.close()
        try:
            self._mm.close()
        except BufferError:
            pass  # a view still exists; the mapping goes with the last reference
        else:
            if free_memory:
                try:
                    os.ftruncate(self._fd, 0)
                except OSError:
                    pass
        self._fd_finalizer()  # closes the fd, once
        self._fd = -1


class _Entry:
    __slots__ = ("slab", "call_idx")

    def __init__(self, slab: StagingBuffer) -> None:
        self.slab = slab
        self.call_idx: int | None = None  # the call whose write may read the slab


def _is_free(entry: _Entry, is_running: Callable[[int], bool]) -> bool:
    """Whether no running write reads ``entry``'s slab."""
    return entry.call_idx is None or not is_running(entry.call_idx)


class StagingPool:
    """A small pool of reusable staging buffers.

    Args:
        num_buffers: how many buffers may exist at once. 1 (default) bounds the extra
            host memory to one copy of the state: a save then waits until the
            previous write no longer reads the buffer. 2 double-buffers.
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
    def buffers(self) -> tuple[StagingBuffer, ...]:
        """The buffers the pool holds now, oldest first."""
        return tuple(e.slab for e in self._entries)

    def acquire(
        self,
        nbytes: int,
        layout_key: Any,
        is_running: Callable[[int], bool],
        wait: Callable[[int], Any],
    ) -> StagingBuffer:
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
        free = [e for e in self._entries if _is_free(e, is_running)]
        for e in free:
            e.call_idx = None
        fitting = [e for e in free if e.slab.nbytes >= nbytes]
        for e in fitting:
            if e.slab.layout_key == layout_key:
                return e.slab
        if fitting:
            return fitting[0].slab
        if len(self._entries) < self.num_buffers:
            entry = _Entry(StagingBuffer(nbytes))
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
        entry = _Entry(StagingBuffer(nbytes))
        self._entries.append(entry)
        return entry.slab

    def reserve(
        self,
        nbytes: int,
        layout_key: Any,
        is_running: Callable[[int], bool],
        wait: Callable[[int], Any],
    ) -> tuple[StagingBuffer, ...]:
        """Every buffer a steady state of saves of ``nbytes`` uses, allocated now (for
        ``prepare()``): :meth:`acquire`'s buffer; the free buffers too small for
        ``nbytes`` released; then new ones until the pool holds ``num_buffers``.
        Returns the buffers no running write reads, which the caller may format (a
        buffer a write still reads is left alone).

        Args:
            nbytes, layout_key, is_running, wait: as :meth:`acquire`.
        """
        self.acquire(nbytes, layout_key, is_running, wait)
        for e in [e for e in self._entries if e.slab.nbytes < nbytes and _is_free(e, is_running)]:
            self._entries.remove(e)
            e.slab.release()
        while len(self._entries) < self.num_buffers:
            self._entries.append(_Entry(StagingBuffer(nbytes)))
        return tuple(e.slab for e in self._entries if e.slab.nbytes >= nbytes and _is_free(e, is_running))

    def bytes_to_reserve(self, nbytes: int) -> int:
        """At most how many bytes :meth:`reserve` allocates for ``nbytes``: one buffer
        for each of the pool's ``num_buffers`` that no buffer of at least ``nbytes``
        holds yet (the memory guard's figure for ``prepare()``)."""
        return nbytes * max(0, self.num_buffers - sum(1 for e in self._entries if e.slab.nbytes >= nbytes))

    def bytes_to_allocate(self, nbytes: int, is_running: Callable[[int], bool]) -> int:
        """How many bytes :meth:`acquire` would allocate for ``nbytes`` now (0: it reuses
        a buffer). For the memory guard, which runs before the allocation."""
        free = [e for e in self._entries if _is_free(e, is_running)]
        if any(e.slab.nbytes >= nbytes for e in free):
            return 0
        if len(self._entries) < self.num_buffers:
            return nbytes
        victim = free[0] if free else self._oldest()
        return 0 if victim.slab.nbytes >= nbytes else nbytes

    def _oldest(self) -> _Entry:
        return min(self._entries, key=lambda e: -1 if e.call_idx is None else e.call_idx)

    def lease(self, slab: StagingBuffer, call_idx: int) -> None:
        """Mark ``slab`` as read by the write of ``call_idx``."""
        for e in self._entries:
            if e.slab is slab:
                e.call_idx = call_idx

    def release_all(self, is_running: Callable[[int], bool] | None = None) -> None:
        """Release every buffer; free the memory of those no write may still read.

        Args:
            is_running: ``is_running(call_idx)`` of the queue's writes; ``None``: no
                write runs any more.
        """
        for e in self._entries:
            busy = e.call_idx is not None and is_running is not None and is_running(e.call_idx)
            e.slab.release(free_memory=not busy)
        self._entries.clear()


class StagingCopier:
    """Copies a state's tensors into their staging views: the training thread's stall.

    CPU tensors: contiguous tensors of at least :data:`MEMMOVE_MIN_NUMEL` elements
    with the destination's dtype and shape are copied with libc ``memmove`` (through
    ctypes, without the GIL) and never through torch's intra-op threads, whose
    per-tensor fork/join stalls whenever another process holds a core; the others
    (small, strided, conjugate or negative views) with one ``torch._foreach_copy_``
    call, which copies them serially. ``threads > 1`` adds Python threads that take
    8 MiB pieces of the ``memmove`` work from a shared list (a thread on a busy core
    simply takes fewer) and their share of the small tensors (``SaveOptions``
    defaults to the CPUs available, at most 4; ``scripts/bench.py`` measures 1 and 2).

    CUDA tensors are copied device-to-host with ``non_blocking=True`` into the
    pinned slab (see :meth:`StagingBuffer.pin`) on a side stream that first waits for the
    current (compute) stream, so all copies overlap each other and later compute;
    one event marks their end and :meth:`synchronize` waits for it once (the
    overlapped transfers of JAX's ``async_serialize`` and DCP's pinned stager).

    Args:
        threads: Python threads for CPU copies (>= 1).
    """

    #: Tensors larger than this (bytes) are cut into chunks of about this size when
    #: the copies are spread across threads.
    CHUNK_BYTES = 32 << 20
    #: The pieces of ``memmove`` work threads take one at a time (bytes).
    PIECE_BYTES = 8 << 20

    def __init__(self, threads: int = 1) -> None:
        if threads < 1:
            raise ValueError("threads must be >= 1")
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._stream: Any = None
        self._event: Any = None

    def copy(
        self,
        dsts: Sequence[torch.Tensor],
        srcs: Sequence[torch.Tensor],
        *,
        cpu: bool = True,
        cuda: bool = True,
        populate: bool = False,
        program: CopyProgram | None = None,
    ) -> None:
        """Start copying ``srcs[i]`` into ``dsts[i]`` (equal shapes and dtypes).

        CPU copies are complete on return; CUDA copies may still run until
        :meth:`synchronize`. ``cpu``/``cuda`` select which sources to copy (the
        D2H copies must be issued from the training thread, whose current stream
        they are ordered after). ``populate``: the destination is a new staging
        buffer; each ``memmove`` piece allocates its pages first (:func:`prefault`).
        ``program``: :meth:`program` of ``dsts`` with this copier's threads, kept by the
        caller from copy to copy of the same destinations (:meth:`StagingBuffer.copy_program`;
        made here without it).

        Raises:
            RuntimeError: a copy failed (shape/dtype mismatch, CUDA error).
            OSError: ``populate`` and the staging memory cannot be allocated.
        """
        on_cuda = [i for i, s in enumerate(srcs) if s.is_cuda]
        cpu_d: Sequence[torch.Tensor] = dsts
        cpu_s: Sequence[torch.Tensor] = srcs
        cuda_d: list[torch.Tensor] = []
        cuda_s: list[torch.Tensor] = []
        if on_cuda:
            cuda_d, cuda_s = [dsts[i] for i in on_cuda], [srcs[i] for i in on_cuda]
            cpu = cpu and len(on_cuda) < len(srcs)
            program = None  # (it is the program of all of dsts)
            if cpu:
                host = set(on_cuda)
                cpu_d = [d for i, d in enumerate(dsts) if i not in host]
                cpu_s = [s for i, s in enumerate(srcs) if i not in host]
        # Sources may require grad (parameters, not detached): the copy is no autograd op.
        with torch.no_grad():
            if cuda_s and cuda:
                self._copy_d2h(cuda_d, cuda_s)
            if cpu_s and cpu:
                self._copy_cpu(cpu_d, cpu_s, populate, program)

    @property
    def event(self) -> Any:
        """The CUDA event that marks the end of the device-to-host copies started last
        (``None``: none pending). Any thread may wait for it."""
        return self._event

    def synchronize(self) -> None:
        """Wait for the device-to-host copies started by :meth:`copy` (no-op for CPU, and
        for copies polled over: no host synchronization then)."""
        if self._event is not None:
            if not self._event.query():
                self._event.synchronize()
            self._event = None

    def _copy_d2h(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        _faults.hit("d2h")  # (before any copy is issued: nothing is left in flight)
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for d, s in zip(dsts, srcs):
                d.copy_(s, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(stream)

    def run(
        self,
        items: list[Any],
        fn: Callable[..., None],
        first: Callable[[], None] | None = None,
        others: Sequence[Callable[[], None] | None] = (),
    ) -> None:
        """Call ``fn(*item)`` for every item, on this thread and the copy threads, which take
        the items one at a time from a shared list (a thread on a busy core simply takes
        fewer). ``first`` runs on this thread and each of ``others`` on a copy thread
        before they take items (``None``: nothing). Returns when all are done; raises the first error."""
        todo = list(reversed(items))  # pop() takes them in order

        def work(before: Callable[[], None] | None) -> None:
            if before is not None:
                before()
            while True:
                try:
                    item = todo.pop()  # atomic: each item is taken once
                except IndexError:
                    return
                fn(*item)

        if self.threads == 1:
            for before in (first, *others):
                if before is not None:
                    before()
            work(None)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="asyncckpt-stage")
        befores = list(others) + [None] * (self.threads - 1 - len(others))
        futures = []
        here: list[Callable[[], None] | None] = [first]
        for b in befores:
            try:
                futures.append(self._pool.submit(work, b))
            except RuntimeError:
                # The interpreter is shutting down (a save from an atexit handler):
                # thread pools take no new work then. This thread does it.
                here.append(b)
        error: BaseException | None = None
        try:
            for before in here:
                work(before)
        except BaseException as exc:  # noqa: BLE001 - the other threads are joined first
            error = exc
        for f in futures:
            try:
                f.result()
            except BaseException as exc:  # noqa: BLE001
                error = error or exc
        if error is not None:
            raise error

    def program(self, dsts: Sequence[torch.Tensor]) -> CopyProgram:
        """How ``dsts`` are copied by this copier: which destinations may take a
        ``memmove``, and how the others are shared out among the copy threads. A
        staging buffer keeps it for its layout (:meth:`StagingBuffer.copy_program`), so
        that a save does not derive it again tensor by tensor; what depends on the
        sources is still checked at each copy (:meth:`_copy_cpu`)."""
        large: list[int] = []
        small: list[int] = []
        for i, d in enumerate(dsts):
            (large if d.numel() >= MEMMOVE_MIN_NUMEL and d.is_contiguous() else small).append(i)
        groups = [small] if self.threads == 1 else _share_out(small, [dsts[i].nbytes for i in small], self.threads)
        return CopyProgram(self.threads, large, groups)

    def _copy_cpu(
        self,
        dsts: Sequence[torch.Tensor],
        srcs: Sequence[torch.Tensor],
        populate: bool = False,
        program: CopyProgram | None = None,
    ) -> None:
        if program is None:
            program = self.program(dsts)
        moves: list[tuple[int, int, int]] = []  # (dst address, src address, bytes)
        other_d: list[torch.Tensor] = []  # large destinations whose source memmove cannot copy
        other_s: list[torch.Tensor] = []
        for i in program.large:
            d, s = dsts[i], srcs[i]
            if s.dtype == d.dtype and s.shape == d.shape and s.is_contiguous() and not s.is_conj() and not s.is_neg():
                moves.append((d.data_ptr(), s.data_ptr(), d.nbytes))
            else:
                other_d.append(d)
                other_s.append(s)
        # libc memmove through ctypes: a foreign call that releases the GIL.
        move: Callable[[int, int, int], Any] = _memmove_populating if populate else ctypes.memmove
        if self.threads == 1 or len(srcs) == 0:
            small = program.groups[0]
            small_d = [dsts[i] for i in small] + other_d
            small_s = [srcs[i] for i in small] + other_s
            if small_s:
                torch._foreach_copy_(small_d, small_s)
            for piece in _pieces(moves, self.PIECE_BYTES) if populate else moves:
                move(*piece)
            return
        groups = [([dsts[i] for i in g], [srcs[i] for i in g]) for g in program.groups]
        if other_s:  # rare: strided, conjugate or negative views, or other dtypes: cut and shared out afresh
            for (gd, gs), (od, os_) in zip(groups, split_copies(other_d, other_s, self.threads, self.CHUNK_BYTES)):
                gd += od
                gs += os_
        copies = [functools.partial(_copy_no_grad, d, s) if s else None for d, s in groups]
        self.run(_pieces(moves, self.PIECE_BYTES), move, copies[0], copies[1:])

    def close(self) -> None:
        """Stop the copy threads, without joining them (they are idle between copies and
        exit on their own). Never blocks: it runs from ``weakref.finalize`` callbacks,
        which the garbage collector may run inside ``threading``'s own bookkeeping, with
        its shutdown lock held; a join there deadlocks (seen in the test suite)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def _memmove_populating(dst: int, src: int, nbytes: int) -> None:
    prefault(dst, nbytes)
    ctypes.memmove(dst, src, nbytes)


def _pieces(moves: list[tuple[int, int, int]], piece: int) -> list[tuple[int, int, int]]:
    """``moves`` cut into pieces of at most ``piece`` bytes, in order."""
    out = []
    for dst, src, nbytes in moves:
        for off in range(0, nbytes, piece):
            out.append((dst + off, src + off, min(piece, nbytes - off)))
    return out


def _copy_no_grad(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    with torch.no_grad():  # grad mode is per thread
        torch._foreach_copy_(dsts, srcs)


@dataclasses.dataclass(frozen=True)
class CopyProgram:
    """How a list of staging destinations is copied (:meth:`StagingCopier.program`) by
    ``threads`` copy threads: the indices of those a ``memmove`` may fill (contiguous,
    at least :data:`MEMMOVE_MIN_NUMEL` elements), and the others' indices in one group
    per copy thread, of about equal bytes, in order."""

    threads: int
    large: list[int]
    groups: list[list[int]]


def _share_out(indices: list[int], nbytes: list[int], n: int) -> list[list[int]]:
    """``indices`` in ``n`` groups of about equal bytes (``nbytes[j]`` for ``indices[j]``), in order."""
    total = sum(nbytes) or 1
    groups: list[list[int]] = [[] for _ in range(n)]
    acc = 0
    for i, b in zip(indices, nbytes):
        groups[min(n - 1, acc * n // total)].append(i)
        acc += b
    return groups


def split_copies(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], n: int, chunk: int
) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """The copies ``dsts[i] <- srcs[i]`` as ``n`` groups ``(dsts, srcs)`` of about equal
    bytes, one per copy thread, in order; contiguous pairs of more than ``chunk`` bytes
    are cut into flat chunks of ``chunk`` bytes (views of the same memory)."""
    pieces: list[tuple[torch.Tensor, torch.Tensor, int]] = []
    for d, s in zip(dsts, srcs):
        nbytes = s.numel() * s.element_size()
        if nbytes > chunk and s.is_contiguous() and d.is_contiguous():
            fd, fs = d.view(-1), s.view(-1)
            step = max(1, chunk // s.element_size())
            for i in range(0, fs.numel(), step):
                pieces.append((fd[i : i + step], fs[i : i + step], min(step, fs.numel() - i) * s.element_size()))
        else:
            pieces.append((d, s, nbytes))
    shares = _share_out(list(range(len(pieces))), [p[2] for p in pieces], n)
    return [([pieces[j][0] for j in g], [pieces[j][1] for j in g]) for g in shares]


# ====================================================================== the optimizer guard
# An overlapped staging copies the state while training goes on. Fused optimizer kernels
# (``AdamW(fused=True)``), updates through ``.data`` and parameters that are ``.data``
# views of one flat buffer change tensors without bumping their version counters, so
# the saver's version check cannot see them: a global optimizer step pre-hook orders
# every pending copy before any optimizer changes a parameter (the host joins the CPU
# copies; the device runs the D2H copies before the step's kernels). The hook is
# registered once per process, at the first overlapped save, and stays (with nothing
# pending it costs one truthiness test per step): removing it while another thread's
# ``optimizer.step()`` iterates torch's hook dict would break that step.

#: The overlapped copies in flight (objects with ``order_before_update()``), this process.
_pending_copies: set[Any] = set()
_pending_lock = threading.Lock()
_hook_handle: Any = None


def _optimizer_step_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    """``torch.optim`` global step pre-hook: order every pending overlapped copy before
    this step, so no optimizer changes a tensor a copy still reads. Any thread; takes no
    lock while it waits (a thread that holds a saver's lock never waits for an optimizer)."""
    if _pending_copies:
        order_pending_copies()
    return None


def order_pending_copies() -> None:
    """Order every overlapped staging copy in flight in this process before the calling
    thread's next changes of the state (``order_before_update``: the host joins the CPU
    copies, the current CUDA stream waits for the D2H copies on the device)."""
    with _pending_lock:
        pending = list(_pending_copies)
    for copy in pending:
        copy.order_before_update()


def watch_copy(copy: Any) -> None:
    """Register an overlapped copy in flight (an object with ``order_before_update()``,
    which must call :func:`unwatch_copy`); installs the optimizer step pre-hook once."""
    global _hook_handle
    with _pending_lock:
        _pending_copies.add(copy)
        if _hook_handle is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _hook_handle = register_optimizer_step_pre_hook(_optimizer_step_pre_hook)


def unwatch_copy(copy: Any) -> None:
    """The copy is done (or dropped): optimizers no longer wait for it."""
    with _pending_lock:
        _pending_copies.discard(copy)


def _forget_pending_copies() -> None:  # a forked child has none of its parent's copy threads
    global _pending_lock
    _pending_lock = threading.Lock()  # another thread of the parent may have held it
    _pending_copies.clear()


os.register_at_fork(after_in_child=_forget_pending_copies)
