"""The writer: runs in the background worker (or a forked child), without torch.

The training process stages each rank's data files, complete byte images of them,
into one shared host buffer (a "slab", see ``asyncckpt.saving.staging``). The writer maps
the slab by path, computes the CRC-32 of every tensor record and patches it into the
record's zip fields, then writes each file with large sequential ``os.write`` calls,
fsyncs it and the directory, and returns what the commit needs: per-file sizes and
checksummed segments for the manifest, bytes written, and the write time.

It never imports torch: a persistent worker that only writes starts fast, holds little
memory, and cannot initialize CUDA.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from typing import NamedTuple

from asyncckpt import _faults
from asyncckpt._fs import fsync_directory
from asyncckpt.format.crc import crc32
from asyncckpt.format.filespec import CrcPatch, FileSpec, unpack_patches

__all__ = ["SlabRef", "WriteTask", "FileResult", "RankWriteResult", "write_rank_files", "drop_cached_pages"]

#: Bytes per ``os.write`` call.
WRITE_CHUNK_BYTES = 64 << 20
#: Tensor records at least this large get a manifest segment of their own (their
#: CRC-32 is computed once, for the zip record and the manifest together).
BIG_SEGMENT_BYTES = 1 << 20
#: Runs of smaller records are cut into manifest segments of about this size, so that
#: ``verify_checkpoint`` can check them on several threads.
MAX_SEGMENT_BYTES = 16 << 20


class SlabRef(NamedTuple):
    """A shared host buffer, as the worker finds it.

    Attributes:
        slab_id: unique id (never reused).
        path: a path that opens it (``/proc/<pid>/fd/<fd>`` for a memfd).
        nbytes: its size in bytes.
    """

    slab_id: str
    path: str
    nbytes: int


class WriteTask(NamedTuple):
    """Everything one rank writes for one checkpoint (picklable, torch-free).

    Attributes:
        directory: the (temporary) checkpoint directory; created if missing.
        slab: the staged file images.
        files: the files to write.
        live_slab_ids: slabs the training process still owns; the worker unmaps others.
        fsync: fsync every file and the directory before returning.
        umask: the training process's umask at save time, applied by the writer
            (a long-lived worker would otherwise keep the umask it started with).
        threads: threads writing each file: the file image is cut into this many
            contiguous ranges, each written with large positioned writes
            (``os.pwrite``); 1 writes one sequential stream.
        drop_cache: after a file's fsync, drop its pages from the page cache
            (:func:`drop_cached_pages`; ``SaveOptions.drop_page_cache``). Only with
            ``fsync``: the pages of a file not yet on disk are dirty and stay.
        reuse: files of these names may exist in ``directory`` already (a tier's
            spare, :meth:`asyncckpt.io.local_tier.NodeLocalStorage.write_rank`): they
            are written over in place and cut to their size, so that their memory (a
            RAM tier's pages) is reused, not freed and allocated again. Without it,
            every file is created (``O_EXCL``).
    """

    directory: str
    slab: SlabRef
    files: tuple[FileSpec, ...]
    live_slab_ids: tuple[str, ...]
    fsync: bool = True
    umask: int | None = None
    threads: int = 1
    drop_cache: bool = False
    reuse: bool = False


class FileResult(NamedTuple):
    """A written file: its size and its checksummed segments.

    Attributes:
        name: file name.
        nbytes: size in bytes.
        segments: ``(offset, length, crc32)`` triples covering the file in order.
    """

    name: str
    nbytes: int
    segments: tuple[tuple[int, int, int], ...]


class RankWriteResult(NamedTuple):
    """What one rank's write produced.

    Attributes:
        files: one result per file.
        nbytes: bytes written by this rank.
        write_s: seconds from the first byte checksummed to the last fsync.
        pid: the process that wrote.
    """

    files: tuple[FileResult, ...]
    nbytes: int
    write_s: float
    pid: int


# Slabs mapped by this process, by slab_id. A persistent worker keeps them mapped
# across saves (no page-table rebuild per save) and drops those the trainer freed.
_mapped: dict[str, mmap.mmap] = {}


def _map_slab(slab: SlabRef, live: tuple[str, ...]) -> mmap.mmap:
    for slab_id in [s for s in _mapped if s not in live and s != slab.slab_id]:
        _mapped.pop(slab_id).close()
    mapped = _mapped.get(slab.slab_id)
    if mapped is None:
        fd = os.open(slab.path, os.O_RDWR | os.O_CLOEXEC)
        try:
            mapped = mmap.mmap(fd, slab.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        _mapped[slab.slab_id] = mapped
    return mapped


class _Progress:
    """How much of a file image is final: every CRC-32 field before ``final`` is patched.

    The checksum thread advances it; the writing thread writes up to it. Tensor data
    is final from the start, so a record's bytes are written while its CRC is still
    being computed; only its zip fields after the data wait for the CRC.
    """

    def __init__(self, patches: tuple[CrcPatch, ...], nbytes: int) -> None:
        limits = [nbytes] * (len(patches) + 1)
        for i in range(len(patches) - 1, -1, -1):
            limits[i] = patches[i].patch_offsets[0] if patches[i].patch_offsets else limits[i + 1]
        self.limits = limits
        self.final = limits[0]
        self.error: BaseException | None = None
        self._cond = threading.Condition()

    def advance(self, final: int) -> None:
        with self._cond:
            self.final = final
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self.error = error
            self._cond.notify_all()

    def wait_beyond(self, pos: int) -> int:
        with self._cond:
            self._cond.wait_for(lambda: self.final > pos or self.error is not None)
            if self.error is not None:
                raise self.error
            return self.final


#: Records with at least this many data bytes (and below ``BIG_SEGMENT_BYTES``) have
#: their CRC-32 merged into their segment's (:func:`crc32_combine`) instead of being
#: checksummed twice, once their size has been seen ``_TABLE_AFTER`` times (a table
#: costs 33 checksums of that many bytes) and while fewer than ``_MAX_TABLES``
#: sizes have tables (about 36 KB each).
COMBINE_MIN_BYTES = 64 << 10
_TABLE_AFTER = 33
_MAX_TABLES = 128
_seen_sizes: dict[int, int] = {}
_tables: dict[int, tuple[tuple[int, ...], ...]] = {}


def _combinable(n: int) -> bool:
    """Whether records of ``n`` data bytes merge their CRC (builds the table when due)."""
    if n in _tables:
        return True
    if n < COMBINE_MIN_BYTES or len(_tables) >= _MAX_TABLES:
        return False
    seen = _seen_sizes[n] = _seen_sizes.get(n, 0) + 1
    if seen < _TABLE_AFTER:
        return False
    _tables[n] = _shift_tables(n)
    return True


def _shift_tables(n: int) -> tuple[tuple[int, ...], ...]:
    """Four byte tables of the linear map ``A_n`` with ``crc32(B, c) = A_n(c) ^ crc32(B, 0)``
    for every ``B`` of ``n`` bytes (zlib's CRC-32 is affine in its start value).

    Column ``i`` of ``A_n`` is ``crc32(zeros(n), 1 << i) ^ crc32(zeros(n), 0)``: 33
    checksums of ``n`` zero bytes, at C speed. The writer keeps the tables of the sizes
    it merges in ``_tables`` (see :func:`_combinable`); other lengths build them anew."""
    zeros = bytes(n)
    base = crc32(zeros, 0)
    cols = [crc32(zeros, 1 << i) ^ base for i in range(32)]
    tables = []
    for k in range(4):
        t = [0] * 256
        for b in range(1, 256):
            low = (b & -b).bit_length() - 1
            t[b] = t[b & (b - 1)] ^ cols[8 * k + low]
        tables.append(tuple(t))
    return tuple(tables)


def crc32_combine(crc1: int, crc2: int, n2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and
    ``n2 = len(B)`` (zlib's ``crc32_combine``, which Python's :mod:`zlib` lacks): the
    start value ``crc1`` shifted through ``n2`` bytes, xor ``crc2``. Uses the writer's
    table for ``n2`` when it has one (:func:`_combinable`), else builds one (33 checksums
    of ``n2`` zero bytes)."""
    tables = _tables.get(n2)
    t0, t1, t2, t3 = tables if tables is not None else _shift_tables(n2)
    return t0[crc1 & 0xFF] ^ t1[(crc1 >> 8) & 0xFF] ^ t2[(crc1 >> 16) & 0xFF] ^ t3[crc1 >> 24] ^ crc2


def _checksum_and_patch(
    image: memoryview, patches: tuple[CrcPatch, ...], progress: _Progress | None = None
) -> tuple[tuple[int, int, int], ...]:
    """CRC every tensor record, patch the zip fields, and cut the file into segments.

    A record's data CRC (for its zip fields) is merged into its segment's with
    :func:`crc32_combine` when its size has a table (see ``COMBINE_MIN_BYTES``), so its
    bytes are checksummed once; other records are checksummed twice."""
    segments: list[tuple[int, int, int]] = []
    seg_start, seg_crc, pos = 0, 0, 0
    for i, patch in enumerate(patches):
        end = patch.data_offset + patch.data_nbytes
        data = image[patch.data_offset : end]
        crc = crc32(data)
        if patch.data_nbytes >= BIG_SEGMENT_BYTES:
            seg_crc = crc32(image[pos : patch.data_offset], seg_crc)
            if patch.data_offset > seg_start:
                segments.append((seg_start, patch.data_offset - seg_start, seg_crc))
            segments.append((patch.data_offset, patch.data_nbytes, crc))
            seg_start, seg_crc = end, 0
        else:
            if _combinable(patch.data_nbytes):
                seg_crc = crc32_combine(crc32(image[pos : patch.data_offset], seg_crc), crc, patch.data_nbytes)
            else:
                seg_crc = crc32(image[pos:end], seg_crc)
            if end - seg_start >= MAX_SEGMENT_BYTES:  # segments stay short enough to check in parallel
                segments.append((seg_start, end - seg_start, seg_crc))
                seg_start, seg_crc = end, 0
        for offset in patch.patch_offsets:
            struct.pack_into("<I", image, offset, crc)
        if progress is not None:
            progress.advance(progress.limits[i + 1])
        pos = end
    seg_crc = crc32(image[pos:], seg_crc)
    if len(image) > seg_start or not segments:
        segments.append((seg_start, len(image) - seg_start, seg_crc))
    return tuple(segments)


def _write_file(fd: int, image: memoryview, patches: tuple[CrcPatch, ...], first: bool, threads: int = 1) -> tuple:
    """Checksum (a helper thread) and write (``threads`` threads) one file image, overlapped.

    ``crc32``, ``os.write`` and ``os.pwrite`` release the GIL, so the checksum
    costs no write time as long as it is faster than the disk. Each writing thread
    owns a contiguous range of the file and writes it, in order, as far as the
    checksum thread has made it final.

    Returns:
        The file's checksummed segments.
    """
    progress = _Progress(patches, len(image))
    box: list = []

    def checksum() -> None:
        try:
            box.append(_checksum_and_patch(image, patches, progress))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the writing thread
            progress.fail(exc)
        else:
            progress.advance(len(image))

    half = len(image) // 2
    fault_pending = [first]

    def write_range(lo: int, hi: int, positioned: bool) -> None:
        pos = lo
        while pos < hi:
            final = progress.wait_beyond(pos)
            end = min(final, hi, pos + WRITE_CHUNK_BYTES)
            if fault_pending[0] and pos < half <= end:
                end = half
            if positioned:
                _pwrite_all(fd, image[pos:end], pos)
            else:
                _write_all(fd, image[pos:end])
            pos = end
            if fault_pending[0] and lo <= half <= pos:
                fault_pending[0] = False
                _faults.hit("mid_write")

    thread = threading.Thread(target=checksum, name="asyncckpt-crc", daemon=True)
    thread.start()
    try:
        if threads <= 1 or len(image) < 2 * WRITE_CHUNK_BYTES:
            write_range(0, len(image), positioned=False)
        else:
            bounds = [len(image) * k // threads for k in range(threads + 1)]
            errors: list[BaseException] = []

            def run(lo: int, hi: int) -> None:
                try:
                    write_range(lo, hi, positioned=True)
                except BaseException as exc:  # noqa: BLE001 - re-raised below
                    errors.append(exc)
                    progress.fail(exc)  # the other writers stop waiting

            writers = [
                threading.Thread(target=run, args=(bounds[k], bounds[k + 1]), name=f"asyncckpt-write-{k}", daemon=True)
                for k in range(threads)
            ]
            for w in writers:
                w.start()
            for w in writers:
                w.join()
            if errors:
                raise errors[0]
    finally:
        thread.join()
    if progress.error is not None:
        raise progress.error
    return box[0]


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    total = 0
    while total < len(data):
        n = os.pwrite(fd, data[total : total + WRITE_CHUNK_BYTES], offset + total)
        if n <= 0:
            raise OSError(f"os.pwrite wrote {n} bytes")
        total += n


def _write_all(fd: int, data: memoryview) -> None:
    view, total = data, 0
    while total < len(data):
        n = os.write(fd, view[total : total + WRITE_CHUNK_BYTES])
        if n <= 0:
            raise OSError(f"os.write wrote {n} bytes")
        total += n


def drop_cached_pages(fd: int) -> bool:
    """Ask the kernel to drop the clean cached pages of the open file ``fd``
    (``posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)``). Advice only: the file's
    contents are unchanged, and a failure is ignored.

    Returns:
        Whether the advice was given (False where ``posix_fadvise`` is missing or failed).
    """
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return False
    try:
        advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        return False
    return True


def write_rank_files(task: WriteTask) -> RankWriteResult:
    """Write one rank's staged data files into ``task.directory``.

    Files are created with ``O_EXCL`` (an existing file is never overwritten) and the
    process umask (with ``task.reuse``: a file there is written over and cut to its
    size). Raises ``OSError`` on any I/O failure (disk full, permission...).

    Returns:
        The files' sizes and checksummed segments, for the manifest.
    """
    started = time.monotonic()
    if task.umask is not None:
        os.umask(task.umask)
    os.makedirs(task.directory, exist_ok=True)
    mapped = _map_slab(task.slab, task.live_slab_ids)
    results: list[FileResult] = []
    created: list[str] = []
    total = 0
    try:
        with memoryview(mapped) as slab_view:
            for spec in task.files:
                image = slab_view[spec.slab_offset : spec.slab_offset + spec.nbytes]
                path = os.path.join(task.directory, spec.name)
                flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (0 if task.reuse else os.O_EXCL)
                fd = os.open(path, flags, 0o666)
                created.append(path)
                try:
                    segments = _write_file(
                        fd, image, tuple(unpack_patches(spec.patches)), first=not results, threads=task.threads
                    )
                    if task.reuse:
                        os.ftruncate(fd, spec.nbytes)  # (a longer file written over: its tail goes)
                    if task.fsync:
                        os.fsync(fd)
                        if task.drop_cache:
                            drop_cached_pages(fd)
                finally:
                    os.close(fd)
                    image.release()
                results.append(FileResult(spec.name, spec.nbytes, segments))
                total += spec.nbytes
        if task.fsync:
            fsync_directory(task.directory)
        _faults.hit("after_write")
    except BaseException:
        # Give the space back at once (a full disk must not stay full because of us).
        # The directory stays: other ranks may be about to create their files in it;
        # CheckpointManager removes such leftovers at its next commit.
        for path in created:
            try:
                os.unlink(path)
            except OSError:
                pass
        raise
    return RankWriteResult(tuple(results), total, time.monotonic() - started, os.getpid())
