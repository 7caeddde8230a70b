"""The save pipeline: commit off the training thread, one owner per resource, one error
funnel, options as data (the pipeline-redesign issue's acceptance items).

The two-rank scenarios run on real gloo ranks (one ``run_ranks`` run plays them all
in turn, the same order on both ranks); the ownership tests count real processes and
real memfd descriptors.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import os
import pickle
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch.distributed.checkpoint.planner import WriteItem

import asyncckpt
from asyncckpt import (
    AsyncCallsQueue,
    AsyncckptError,
    CallbackError,
    CheckpointError,
    CheckpointException,
    CheckpointManager,
    CorruptCheckpointError,
    RankFailure,
    SaveOptions,
)
from asyncckpt.format.layout import RankLayout
from asyncckpt.testing import pending_steps, staging_buffers

from dist_utils import run_ranks
from helpers import open_fd_targets


def _leftovers(root: Path) -> list[str]:
    return sorted(e for e in os.listdir(root) if ".tmp-" in e)


def _memfds() -> int:
    """Staging buffers this process holds open (distinct memfds; mmap keeps a dup of each)."""
    return len({target for target in open_fd_targets() if target.startswith("/memfd:asyncckpt")})


# --------------------------------------------------------------------------- two ranks
def _scenarios(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    import torch.distributed as dist

    import asyncckpt.saving.exchange as exchange

    out: dict[str, Any] = {}
    state = {"w": torch.full((4096,), float(rank)), "meta": {"rank": rank}}

    # 1. A DCP-style loop: `while not handle.done(): train_step()`, no maybe_finalize.
    root = Path(tmp) / "done_loop"
    mgr = CheckpointManager(root)
    spins = []
    for step in (1, 2, 3):
        handle = mgr.save(step, state)
        n = 0
        deadline = time.monotonic() + 30
        while not handle.done() and time.monotonic() < deadline:
            time.sleep(0.002 * (1 + rank))  # the ranks "train" at different speeds
            n += 1
        spins.append(n)
        assert handle.done(), f"step {step} never completed without maybe_finalize"
    out["done_loop_steps"] = mgr.steps()
    mgr.close()
    dist.barrier()

    # 2. Rank 0 never calls maybe_finalize, rank 1 calls it 100 times.
    mgr = CheckpointManager(Path(tmp) / "asymmetric")
    reported: list[int] = []
    for step in range(1, 6):
        mgr.save(step, state)
        if rank == 1:
            for _ in range(20):
                reported += mgr.maybe_finalize()
                time.sleep(0.002)
    mgr.close()
    out["asymmetric_steps"] = mgr.steps()
    out["asymmetric_reported"] = reported
    dist.barrier()

    # 3. A failed save (ENOSPC on rank 1 only) seen through wait(): the same exception
    # on both ranks, keeping type and errno; no temporary directory left on any rank.
    if rank == 1:
        os.environ["ASYNCCKPT_FAULT"] = "mid_write:enospc"
    root = Path(tmp) / "failed"
    mgr = CheckpointManager(root)  # its worker inherits the fault
    os.environ.pop("ASYNCCKPT_FAULT", None)
    try:
        mgr.save(7, state).wait(timeout=60)
    except CheckpointException as exc:
        out["failed_ranks"] = sorted(exc.failures)
        out["failed_errno"] = exc.failures[1].errno
        out["failed_type"] = exc.failures[1].exc_type
    out["failed_pending"] = pending_steps(mgr)
    mgr.close()
    dist.barrier()
    out["failed_leftovers"] = _leftovers(root)
    out["failed_steps"] = CheckpointManager(root).steps()
    dist.barrier()

    # 4. One error funnel: a failure laying out rank 1's file (after the last planning
    # collective) raises the same CheckpointError on both ranks; nothing is written.
    real_build = exchange.build_layout

    def failing_build(rank: int, items: list[WriteItem], blobs: dict[int, int]) -> RankLayout:
        # build_layout's signature; this rank is the one whose file is laid out
        if rank == 1:
            raise OverflowError("injected layout failure")
        return real_build(rank, items, blobs)

    exchange.build_layout = failing_build  # what the saver lays its files out with
    mgr = CheckpointManager(Path(tmp) / "funnel")
    try:
        mgr.save(1, state)
    except CheckpointError as exc:
        out["funnel"] = (type(exc).__name__, sorted(exc.failures), exc.failures[1].exc_type, str(exc))
    finally:
        exchange.build_layout = real_build
    out["funnel_then"] = mgr.save(2, state).wait(timeout=60).bytes > 0
    mgr.close()
    out["funnel_steps"] = mgr.steps()
    out["funnel_leftovers"] = _leftovers(Path(tmp) / "funnel")
    dist.barrier()

    # 5. handle.wait() on one rank while the other keeps "training", then both close.
    mgr = CheckpointManager(Path(tmp) / "one_waits")
    handle = mgr.save(1, state)
    if rank == 0:
        handle.wait(timeout=60)
        out["one_waits"] = handle.done()
    else:
        for _ in range(50):
            time.sleep(0.002)
        out["one_waits"] = None
    mgr.close()
    out["one_waits_steps"] = mgr.steps()
    dist.barrier()

    # 6. The memory guard, tripped on rank 1 only: the same error on both ranks, before
    # any staging buffer is allocated; nothing is written.
    limit = 1e-9 if rank == 1 else None
    mgr = CheckpointManager(Path(tmp) / "guard", options=SaveOptions(staging_memory_limit=limit))
    try:
        mgr.save(1, state)
    except CheckpointError as exc:
        out["guard"] = (sorted(exc.failures), "bytes of memory available" in str(exc))
    out["guard_buffers"] = len(staging_buffers(mgr))
    mgr.close()
    out["guard_steps"] = mgr.steps()
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("pipeline")
    return run_ranks(_scenarios, 2, str(tmp), timeout=150, start_method="forkserver")


@pytest.mark.timeout(180)
def test_done_turns_true_without_maybe_finalize(two_ranks: list[dict[str, Any]]) -> None:
    assert [r["done_loop_steps"] for r in two_ranks] == [[1, 2, 3], [1, 2, 3]]


@pytest.mark.timeout(180)
def test_ranks_call_maybe_finalize_different_numbers_of_times(two_ranks: list[dict[str, Any]]) -> None:
    assert [r["asymmetric_steps"] for r in two_ranks] == [[1, 2, 3, 4, 5]] * 2
    assert two_ranks[0]["asymmetric_reported"] == []  # it never asked
    assert two_ranks[1]["asymmetric_reported"] == sorted(set(two_ranks[1]["asymmetric_reported"]))


@pytest.mark.timeout(180)
def test_failed_save_seen_through_wait_leaves_nothing(two_ranks: list[dict[str, Any]]) -> None:
    for r in two_ranks:
        assert r["failed_ranks"] == [1]
        assert r["failed_errno"] == errno.ENOSPC and r["failed_type"] == "OSError"
        assert r["failed_pending"] == []  # the manager forgot it
        assert r["failed_leftovers"] == []  # its temporary directory is gone, on every rank
        assert r["failed_steps"] == []


@pytest.mark.timeout(180)
def test_an_error_after_planning_on_one_rank_raises_on_every_rank(two_ranks: list[dict[str, Any]]) -> None:
    for r in two_ranks:
        name, ranks, exc_type, text = r["funnel"]
        assert name == "CheckpointError" and ranks == [1] and exc_type == "OverflowError"
        assert "rank 1" in text and "injected layout failure" in text
        assert r["funnel_then"] and r["funnel_steps"] == [2] and r["funnel_leftovers"] == []


@pytest.mark.timeout(180)
def test_memory_guard_raises_on_every_rank_before_allocating(two_ranks: list[dict[str, Any]]) -> None:
    for r in two_ranks:
        assert r["guard"] == ([1], True) and r["guard_buffers"] == 0 and r["guard_steps"] == []


@pytest.mark.timeout(60)
def test_memory_guard_names_both_sizes_and_can_be_turned_off(tmp_path: Path) -> None:
    state = {"w": torch.ones(1 << 20)}
    with CheckpointManager(tmp_path / "a", options=SaveOptions(staging_memory_limit=1e-6)) as mgr:
        with pytest.raises(
            CheckpointError,
            match=r"new host buffer of 4,1\d\d,\d\d\d bytes, more than 1e-06 x the [\d,]+ bytes of memory available",
        ):
            mgr.save(1, state)
        with pytest.raises(CheckpointError, match="staging_memory_limit=None"):
            mgr.prepare(state)
        assert staging_buffers(mgr) == () and mgr.steps() == []
    with CheckpointManager(tmp_path / "b", options=SaveOptions(staging_memory_limit=None)) as mgr:
        mgr.save(1, state).wait(timeout=30)
        assert mgr.steps() == [1]
    with pytest.raises(ValueError):
        SaveOptions(staging_memory_limit=0)


@pytest.mark.timeout(180)
def test_wait_on_one_rank_while_the_other_trains(two_ranks: list[dict[str, Any]]) -> None:
    assert two_ranks[0]["one_waits"] is True
    assert [r["one_waits_steps"] for r in two_ranks] == [[1], [1]]


# --------------------------------------------------------------------------- one process
@pytest.mark.timeout(60)
def test_save_returns_before_the_commit_and_the_training_thread_does_no_commit_io(tmp_path: Path) -> None:
    """The commit (fsyncs, rename, `latest`) runs in the finalizer thread: a commit
    failpoint that sleeps 1 s does not delay save() nor maybe_finalize()."""
    mgr = CheckpointManager(tmp_path / "root")
    try:
        os.environ["ASYNCCKPT_FAULT"] = "commit:sleep=1"  # read by the coordinator's commit, in this process
        started = time.monotonic()
        handle = mgr.save(1, {"w": torch.ones(1000)})
        polled = [mgr.maybe_finalize() for _ in range(10)]
        blocked = time.monotonic() - started
        assert not handle.done() and polled == [[]] * 10
        assert blocked < 0.9, blocked  # the 1 s commit sleep ran elsewhere
        assert mgr.maybe_finalize(blocking=True) == [1]
        assert handle.timings is not None and handle.timings.finalize_s >= 1.0
    finally:
        os.environ.pop("ASYNCCKPT_FAULT", None)
        mgr.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tier", ["persistent", "local"])
def test_a_commit_slower_than_the_saves_holds_the_next_saves_back(tmp_path: Path, tier: str) -> None:
    """A commit of 0.3 s, saves every few milliseconds: at most staging_buffers + 1
    saves are written and not committed, so a tier holds a bounded number of steps
    (before, one more step's files per save, also on the local tier's RAM disk); every
    save commits, in order. The save waits instead (backpressure)."""
    local = asyncckpt.LocalTier(dir=tmp_path / "node", every=1, replicas=0) if tier == "local" else None
    base = tmp_path / ("node" if local is not None else "root")

    def steps_on_disk() -> int:  # step directories, committed or not (temporary, being removed)
        return sum(sum(1 for d in dirs if "step_" in d) for _, dirs, _ in os.walk(base))  # (walk: removals race)

    most = 0
    done: list[int] = []
    os.environ["ASYNCCKPT_FAULT"] = "commit:sleep=0.3"  # (read by the commit, in the finalizer thread)
    try:
        with CheckpointManager(tmp_path / "root", keep_last=2, local=local) as mgr:
            for step in range(1, 11):
                state = {"w": torch.full((1 << 18,), float(step))}
                if mgr.local is not None:
                    mgr.local.save(step, state)
                    done += mgr.local.maybe_finalize()
                else:
                    mgr.save(step, state)
                    done += mgr.maybe_finalize()
                most = max(most, steps_on_disk())
            done += mgr.local.maybe_finalize(blocking=True) if mgr.local is not None else mgr.maybe_finalize(True)
            kept = mgr.steps()
    finally:
        os.environ.pop("ASYNCCKPT_FAULT", None)
    room = asyncckpt.SaveOptions().staging_buffers + 1
    # the kept steps, those written and not committed, and one that retention is removing
    assert most <= 2 + room + 1, most
    assert done == list(range(1, 11))  # every save committed, in order
    if local is None:
        assert kept == [9, 10]


@pytest.mark.timeout(60)
def test_dropped_queue_and_caller_stop_their_worker() -> None:
    queue = AsyncCallsQueue(persistent=True, import_main=False, background_finalize=True)
    queue.start()
    assert isinstance(queue.caller, asyncckpt.PersistentAsyncCaller)  # persistent=True
    pid = queue.caller.worker_pid
    assert pid is not None and psutil.pid_exists(pid)
    del queue
    gc.collect()
    _assert_gone(pid, "the dropped queue's worker")
    caller = asyncckpt.PersistentAsyncCaller(import_main=False)
    caller.start()
    pid = caller.worker_pid
    assert pid is not None
    del caller
    gc.collect()
    _assert_gone(pid, "the dropped caller's worker")


def _assert_gone(pid: int, what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"{what} (pid {pid}) is still alive"
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_three_managers_on_one_queue_free_their_buffers(tmp_path: Path) -> None:
    before = _memfds()
    with AsyncCallsQueue(persistent=True, import_main=False, background_finalize=True) as queue:
        managers = [CheckpointManager(tmp_path / f"m{i}", calls_queue=queue) for i in range(3)]
        for i, mgr in enumerate(managers):
            mgr.save(1, {"w": torch.full((10000,), float(i))}).wait(timeout=30)
        assert _memfds() == before + 3
        for mgr in managers:
            mgr.close()
        assert _memfds() == before
        assert [m.steps() for m in managers] == [[1], [1], [1]]


@pytest.mark.timeout(60)
def test_dropped_manager_frees_its_buffers(tmp_path: Path) -> None:
    before = _memfds()
    mgr = CheckpointManager(tmp_path / "root")
    mgr.save(1, {"w": torch.ones(10000)}).wait(timeout=30)
    assert _memfds() == before + 1
    del mgr
    gc.collect()
    assert _memfds() == before


@pytest.mark.timeout(60)
def test_default_queue_is_public_and_closes(tmp_path: Path) -> None:
    queue = asyncckpt.default_calls_queue()
    handle = asyncckpt.save({"w": torch.ones(100)}, tmp_path / "ck", async_op=True)
    assert asyncckpt.default_calls_queue() is queue and queue.background_finalize
    queue.close()  # commits the pending save, stops the worker
    assert isinstance(queue.caller, asyncckpt.PersistentAsyncCaller)  # the default queue is persistent
    assert handle.done() and handle.exception() is None and queue.caller.worker_pid is None
    assert asyncckpt.default_calls_queue() is not queue  # a later save gets a new one
    asyncckpt.default_calls_queue().close()


@pytest.mark.timeout(60)
def test_failed_save_leaves_nothing_however_observed(tmp_path: Path) -> None:
    """ENOSPC in the writer: seen through maybe_finalize, a callback, close."""
    os.environ["ASYNCCKPT_FAULT"] = "mid_write:enospc"
    try:
        mgr = CheckpointManager(tmp_path / "root", callback=lambda outcome: seen.append(outcome))
    finally:
        os.environ.pop("ASYNCCKPT_FAULT")
    seen: list[Any] = []
    try:
        mgr.save(1, {"w": torch.ones(1 << 20)})
        with pytest.raises(CheckpointException) as info:
            mgr.maybe_finalize(blocking=True)
        assert info.value.failures[0].errno == errno.ENOSPC
        assert isinstance(info.value.failures[0].exception, OSError)
        assert len(seen) == 1 and seen[0] is info.value
        assert _leftovers(tmp_path / "root") == [] and pending_steps(mgr) == []
        mgr.save(2, {"w": torch.ones(1 << 20)})
    finally:
        with pytest.raises(CheckpointException):
            mgr.close()
    assert _leftovers(tmp_path / "root") == [] and mgr.steps() == []


def test_errors_share_one_base_class_and_pickle() -> None:
    failure = RankFailure.from_exception(OSError(errno.EACCES, "denied"), "write: ")
    for exc in (
        CheckpointException(3, {1: failure}),
        CheckpointError("bad", {0: failure}),
        CorruptCheckpointError("corrupt", "/x"),
        CallbackError("cb", [ValueError("v")]),
    ):
        assert isinstance(exc, AsyncckptError) and isinstance(exc, Exception)
        copy = pickle.loads(pickle.dumps(exc))
        assert type(copy) is type(exc) and str(copy) == str(exc)
    copy = pickle.loads(pickle.dumps(CheckpointException(3, {1: failure})))
    assert copy.failures[1].errno == errno.EACCES and copy.failures[1].exc_type == "PermissionError"
    assert "write: PermissionError" in copy.failures[1] and copy.call_idx == 3
    assert pickle.loads(pickle.dumps(CorruptCheckpointError("c", "/x"))).path == "/x"
    assert isinstance(CheckpointError("x"), RuntimeError)  # as before


def test_options_are_data_and_contradictions_raise(tmp_path: Path) -> None:
    opts = SaveOptions(staging_buffers=2, overlap_staging=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.staging_buffers = 3  # type: ignore[misc]
    bad: dict[str, Any]
    for bad in ({"staging_buffers": 0}, {"copy_threads": 1.5}, {"plan_cache": 1}, {"drop_page_cache": "yes"}):
        with pytest.raises(ValueError):
            SaveOptions(**bad)
    with pytest.raises(ValueError, match="either options= or staging_buffers="):
        CheckpointManager(tmp_path / "a", options=opts, staging_buffers=1)
    with AsyncCallsQueue(persistent=True) as queue:
        for bad in ({"persistent": True}, {"persistent": False}, {"start_method": "forkserver"}):
            with pytest.raises(ValueError, match="calls_queue= cannot be combined"):
                CheckpointManager(tmp_path / "b", calls_queue=queue, **bad)
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path / "c", keep_last=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        asyncckpt.save({"w": torch.ones(1)}, tmp_path / "d", async_op=True, options=opts, overlap_staging=False)
    os.environ["ASYNCCKPT_FAULT"] = "mid_write:sleep=1"  # the worker inherits it: each write takes > 1 s
    try:
        mgr = CheckpointManager(tmp_path / "e", options=opts)
    finally:
        os.environ.pop("ASYNCCKPT_FAULT")
    with mgr:
        assert mgr.overlap_staging
        first = mgr.save(1, {"w": torch.ones(10)})
        mgr.synchronize_staging()
        second = mgr.save(2, {"w": torch.ones(10)})  # the first write still reads its buffer
        mgr.synchronize_staging()
        assert not first.done() and len(staging_buffers(mgr)) == 2  # staging_buffers=2: a second one
        first.wait(timeout=30)
        second.wait(timeout=30)


@pytest.mark.timeout(60)
def test_the_queue_keeps_nothing_per_save_for_a_manager(tmp_path: Path) -> None:
    """Bounded memory over many saves: outcomes a manager reports through its handles
    are not also kept by its queue for maybe_finalize_async_calls."""
    with CheckpointManager(tmp_path / "root", keep_last=2) as mgr:
        for step in range(30):
            mgr.save(step, {"w": torch.full((1000,), float(step))})
        assert mgr.maybe_finalize(blocking=True) == list(range(30))
        book = mgr.queue._book
        assert not book.unharvested and not book.pending and not book.failures
        assert mgr._saver.pending_steps() == []


def test_default_copy_threads_is_this_ranks_share_of_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks of one node stage at once: each takes its share of the CPUs it may run on
    (LOCAL_WORLD_SIZE, as torchrun sets it), at least 1 and at most 4."""
    import os

    from asyncckpt.options import default_copy_threads

    cpus = len(os.sched_getaffinity(0))
    if cpus < (os.cpu_count() or 1):
        pytest.skip("this process is bound to fewer CPUs than the machine has: no division")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_copy_threads() == max(1, min(4, cpus))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert default_copy_threads() == max(1, min(4, cpus // 2))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(10 * cpus))
    assert default_copy_threads() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert default_copy_threads() == max(1, min(4, cpus))


@pytest.mark.timeout(30)
def test_copier_close_never_joins_its_threads() -> None:
    """``StagingCopier.close`` runs from finalizers, which the garbage collector may call
    inside ``threading`` with its shutdown lock held: a join there deadlocked a suite."""
    import threading

    from asyncckpt.saving.staging import StagingCopier

    copier = StagingCopier(threads=2)
    srcs = [torch.randn(1 << 16) for _ in range(4)]
    dsts = [torch.empty_like(s) for s in srcs]
    copier.copy(dsts, srcs)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    with threading._shutdown_locks_lock:  # type: ignore[attr-defined]  # where a GC finalizer may run
        copier.close()


def _allocated(buffer: Any) -> int:
    """Bytes of memory the staging buffer's memfd holds (tmpfs counts allocated pages),
    through the path the writer opens it by."""
    return os.stat(buffer.ref.path).st_blocks * 512


def _bytes_at(buffer: Any, lo: int, hi: int) -> bytes:
    return bytes(buffer.u8[lo:hi].tolist())


@pytest.mark.parametrize("madvise", [True, False], ids=["madv_populate_write", "older_kernel"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_new_buffer_is_allocated_by_its_first_copy_or_populate(
    monkeypatch: pytest.MonkeyPatch, madvise: bool, threads: int
) -> None:
    """A new staging buffer holds no memory until the copy threads allocate it (each
    piece just before copying into it) or ``populate()`` does (``prepare()``, pinning),
    keeping the bytes already there; the same without MADV_POPULATE_WRITE (before
    Linux 5.14: first-touch faults and a populating mapping)."""
    from asyncckpt.saving import staging

    if not madvise:
        monkeypatch.setattr(staging, "populate_write", False)
    copier = staging.StagingCopier(threads=threads)
    srcs = [torch.randn(3 << 20), torch.arange(1 << 16, dtype=torch.int64), torch.randn(5)]
    sizes = [s.numel() * s.element_size() for s in srcs]
    buf = staging.StagingBuffer(sum(sizes) + (64 << 10))
    other = staging.StagingBuffer(8 << 20)
    try:
        assert not buf.populated and _allocated(buf) == 0
        views, off = [], 0
        for s, n in zip(srcs, sizes):
            views.append(buf.u8[off : off + n].view(s.dtype))
            off += n
        buf.write_bytes(buf.nbytes - 4, b"tail")
        copier.copy(views, srcs, populate=True)
        assert all(torch.equal(v, s) for v, s in zip(views, srcs))
        assert _allocated(buf) >= sizes[0]  # the large tensor's pages, at least
        assert _bytes_at(buf, buf.nbytes - 4, buf.nbytes) == b"tail"

        other.write_bytes(4096 * 3 + 1, b"framing")
        other.populate(copier)
        assert other.populated and _allocated(other) == other.nbytes
        assert _bytes_at(other, 4096 * 3 + 1, 4096 * 3 + 8) == b"framing"  # populate keeps the bytes
        other.populate(copier)  # once
    finally:
        buf.release()
        other.release()
        copier.close()


def test_copy_threads_raise_the_first_error_after_joining_the_others() -> None:
    """An error in one copy thread (a failed allocation: prefault's OSError) reaches the
    caller once every thread has stopped."""
    from asyncckpt.saving.staging import StagingCopier

    copier = StagingCopier(threads=2)
    done: list[int] = []

    def fn(i: int) -> None:
        if i == 3:
            raise OSError(errno.ENOMEM, "cannot allocate")
        time.sleep(0.001)
        done.append(i)

    try:
        with pytest.raises(OSError, match="cannot allocate"):
            copier.run([(i,) for i in range(40)], fn)
        assert 3 not in done and len(done) == 39
    finally:
        copier.close()
