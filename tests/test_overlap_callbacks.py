"""Overlapped staging (synchronize_staging), completion callbacks, copy and write threads."""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import asyncckpt
from asyncckpt.errors import CallbackError, CheckpointException
from asyncckpt.io import writer
from asyncckpt.testing import staging_buffers

from helpers import assert_same, clone_state, count_calls, counting_calls, counting_plans

pytestmark = pytest.mark.timeout(120)


def _state(seed: int = 0, n: int = 6, numel: int = 50_000) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {f"w{i}": torch.randn(numel, generator=g) for i in range(n)},
        "half": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "t": torch.randn(64, 32, generator=g).t(),  # not contiguous
        "step": seed,
    }


def _load(path, like: dict) -> dict:
    out = {k: (v.clone().zero_() if isinstance(v, torch.Tensor) else v) for k, v in like.items()}
    out["model"] = {k: torch.zeros_like(v) for k, v in like["model"].items()}
    dcp.load(out, checkpoint_id=str(path))
    return out


# ------------------------------------------------------------------ overlapped staging
def test_overlap_staging_snapshot_after_synchronize(tmp_path):
    """The checkpoint holds the values at save(); mutation after synchronize_staging is invisible."""
    sd = _state(1)
    expected = clone_state(sd)
    with asyncckpt.CheckpointManager(tmp_path, overlap_staging=True) as mgr:
        handle = mgr.save(1, sd)
        assert handle.call_idx is None  # the write starts at synchronize_staging
        mgr.synchronize_staging()
        assert handle.call_idx is not None
        for t in sd["model"].values():
            t.add_(1.0)  # optimizer.step()
        sd["half"].fill_(3)
        timings = handle.wait()
    assert timings.stall_s > 0 and timings.bytes > 0
    assert_same(expected, _load(tmp_path / "step_00000001", expected))


def test_overlap_staging_implicit_synchronize(tmp_path):
    """A later save, maybe_finalize, handle.wait and close all synchronize first."""
    states = [_state(s) for s in range(4)]
    with asyncckpt.CheckpointManager(tmp_path, overlap_staging=True, staging_buffers=2) as mgr:
        h0 = mgr.save(0, states[0])
        h1 = mgr.save(1, states[1])  # synchronizes save 0
        assert h0.call_idx is not None and h1.call_idx is None
        mgr.maybe_finalize(blocking=True)  # synchronizes save 1, commits both
        assert h1.done() and h0.done()
        h2 = mgr.save(2, states[2])
        h2.wait()  # synchronizes and commits
        mgr.save(3, states[3])  # committed by close
    assert mgr.steps() == [0, 1, 2, 3]
    for s in range(4):
        assert_same(states[s], _load(tmp_path / f"step_{s:08d}", states[s]))


def test_overlap_staging_with_save_function(tmp_path, temporal_queue):
    sd = _state(2)
    expected = clone_state(sd)
    handle = asyncckpt.save(sd, tmp_path / "ckpt", async_op=True, overlap_staging=True, calls_queue=temporal_queue)
    handle.synchronize_staging()
    sd["model"]["w0"].zero_()
    handle.wait()
    assert_same(expected, _load(tmp_path / "ckpt", expected))
    with pytest.raises(ValueError, match="async_op"):
        asyncckpt.save(sd, tmp_path / "other", overlap_staging=True, calls_queue=temporal_queue)


def test_overlap_staging_abort_drops_the_save(tmp_path):
    """close(abort=True) with a staging in flight: nothing is committed, nothing leaks;
    the handle fails at once and the callback is called once, with that failure."""
    results: list[Any] = []
    mgr = asyncckpt.CheckpointManager(tmp_path, overlap_staging=True, callback=results.append)
    handle = mgr.save(5, _state(5))
    mgr.close(abort=True)
    assert mgr.steps() == []
    assert handle.done() and results == [handle.exception()]
    assert isinstance(results[0], asyncckpt.CheckpointError) and "step 5" in str(results[0])


# ------------------------------------------------------------------ callbacks
def test_callback_called_once_with_result_in_the_finalizer_thread(tmp_path):
    """In this process, after the commit, in the queue's finalizer thread (documented:
    a callback must be thread-safe), so it runs without any call by the training loop."""
    calls: list[Any] = []

    def callback(result):
        calls.append((result, os.getpid(), threading.current_thread().name == "asyncckpt-finalizer"))

    with asyncckpt.CheckpointManager(tmp_path, callback=callback) as mgr:
        h1 = mgr.save(1, _state(1))
        h2 = mgr.save(2, _state(2), callback=lambda r: calls.append(("own", getattr(r, "step", r))))
        assert mgr.maybe_finalize(blocking=True) == [1, 2]
        h1.wait()
        h2.wait()
    assert len(calls) == 2
    result, pid, main = calls[0]
    assert isinstance(result, asyncckpt.SaveResult)
    assert pid == os.getpid() and main  # main: in the finalizer thread
    assert result.path == tmp_path / "step_00000001" and result.step == 1
    assert result.bytes == result.timings.bytes > 0 and result.timings is h1.timings
    assert (result.path / ".metadata").exists()  # called after the commit
    assert calls[1] == ("own", 2)


def test_callback_with_save_function_sync_and_async(tmp_path, temporal_queue):
    got: list[Any] = []
    asyncckpt.save(_state(1), tmp_path / "a", callback=got.append, calls_queue=temporal_queue)
    handle = asyncckpt.save(_state(2), tmp_path / "b", async_op=True, callback=got.append, calls_queue=temporal_queue)
    handle.wait()
    assert [r.path.name for r in got] == ["a", "b"]
    assert got[1].step is None


def test_callback_gets_the_exception_of_a_failed_save(tmp_path, monkeypatch):
    got: list[Any] = []
    with asyncckpt.CheckpointManager(tmp_path, persistent=False, callback=got.append) as mgr:
        monkeypatch.setenv("ASYNCCKPT_FAULT", "after_write:raise")
        mgr.save(1, _state(1))
        with pytest.raises(CheckpointException) as info:
            mgr.maybe_finalize(blocking=True)
        monkeypatch.delenv("ASYNCCKPT_FAULT")
        assert len(got) == 1 and got[0] is info.value
        mgr.save(2, _state(2))
        mgr.maybe_finalize(blocking=True)
    assert len(got) == 2 and isinstance(got[1], asyncckpt.SaveResult)
    assert mgr.steps() == [2]


def test_callback_errors_are_raised_not_swallowed_and_the_queue_goes_on(tmp_path, caplog):
    def bad(result):
        raise ValueError(f"upload of {result.step} failed")

    with asyncckpt.CheckpointManager(tmp_path, callback=bad) as mgr:
        mgr.save(1, _state(1))
        with pytest.raises(CallbackError, match="upload of 1 failed") as info:
            mgr.maybe_finalize(blocking=True)
        assert isinstance(info.value.__cause__, ValueError)
        assert mgr.steps() == [1]  # the checkpoint itself committed
        assert "upload of 1 failed" in caplog.text  # logged when it happened
        handle = mgr.save(2, _state(2), callback=lambda r: None)
        assert handle.wait().bytes > 0  # the queue is not broken
        handle = mgr.save(3, _state(3))
        with pytest.raises(CallbackError):
            handle.wait()
        mgr.save(4, _state(4))
        with pytest.raises(CallbackError, match="upload of 4"):
            mgr.close()
    assert mgr.steps() == [1, 2, 3, 4]


def test_callback_error_during_a_failed_save_is_attached_to_the_exception(tmp_path, monkeypatch):
    def bad(outcome):
        raise RuntimeError("alerting is down")

    with asyncckpt.CheckpointManager(tmp_path, persistent=False, callback=bad) as mgr:
        monkeypatch.setenv("ASYNCCKPT_FAULT", "after_write:raise")
        mgr.save(1, _state(1))
        with pytest.raises(CheckpointException) as info:
            mgr.maybe_finalize(blocking=True)
        monkeypatch.delenv("ASYNCCKPT_FAULT")
    assert any("alerting is down" in note for note in info.value.__notes__)


# ------------------------------------------------------------------ copy and write threads
@pytest.mark.parametrize("copy_threads", [1, 2])
def test_a_source_that_changes_its_layout_between_saves_is_staged_as_it_is_now(tmp_path, copy_threads):
    """The copier keeps how a layout's tensors are copied (``memmove`` or torch, which
    thread) from save to save; a source that becomes a strided, conjugate or negative
    view of the same shape and dtype (the plan stays) must still be copied as it is now."""
    g = torch.Generator().manual_seed(3)
    sd: dict[str, Any] = {
        "small": {f"b{i}": torch.randn(100, generator=g) for i in range(40)},
        "square": torch.randn(256, 256, generator=g),  # >= MEMMOVE_MIN_NUMEL elements
        "z": torch.randn(40_000, dtype=torch.complex64, generator=g),
        "neg": torch.randn(40_000, generator=g),
        "big": torch.randn(70_000, generator=g),
    }
    with asyncckpt.CheckpointManager(tmp_path, copy_threads=copy_threads) as mgr:
        for step, change in enumerate(
            (
                lambda: None,
                lambda: setattr(sd["square"], "data", sd["square"].data.t()),  # strided
                lambda: setattr(sd["z"], "data", sd["z"].data.conj()),  # conjugate view
                lambda: setattr(sd["neg"], "data", torch._neg_view(sd["neg"].data)),  # negative view
                lambda: setattr(sd["square"], "data", sd["square"].data.t()),  # contiguous again
            ),
            start=1,
        ):
            change()
            for t in sd["small"].values():
                t.add_(step)
            mgr.save(step, sd)
            expected = clone_state(sd)
            mgr.maybe_finalize(blocking=True)
            got = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
            got["small"] = {k: torch.zeros_like(v) for k, v in sd["small"].items()}
            dcp.load(got, checkpoint_id=str(tmp_path / f"step_{step:08d}"))
            assert_same(
                {k: v.resolve_conj().resolve_neg() if isinstance(v, torch.Tensor) else v for k, v in expected.items()},
                got,
            )


@pytest.mark.parametrize("copy_threads,write_threads", [(2, 1), (1, 3), (3, 2)])
def test_threads_write_the_same_bytes(tmp_path, monkeypatch, copy_threads, write_threads):
    """Copies spread across threads and files written by several threads give the
    same files, byte for byte, as one thread each (small chunks force the paths)."""
    from asyncckpt.saving import staging

    monkeypatch.setattr(writer, "WRITE_CHUNK_BYTES", 64 << 10)  # sync saves write in this process
    monkeypatch.setattr(staging.StagingCopier, "CHUNK_BYTES", 48 << 10)
    monkeypatch.setattr(staging.StagingCopier, "PIECE_BYTES", 40 << 10)
    sd = _state(7, n=5, numel=300_000)
    files, used = {}, {}
    for name, kw in (
        ("one", dict(copy_threads=1, write_threads=1)),
        ("many", dict(copy_threads=copy_threads, write_threads=write_threads)),
    ):
        # Observed: the writer's threads write with pwrite (one thread: write), and the
        # copy threads' work is shared out by _share_out.
        with (
            asyncckpt.CheckpointManager(tmp_path / name, **kw) as mgr,
            counting_calls(os, "pwrite") as pwrite,
            counting_calls(staging, "_share_out") as split,
        ):
            mgr.save(1, sd, async_op=False)
        used[name] = (pwrite.n > 0, split.n > 0)
        files[name] = (tmp_path / name / "step_00000001" / "__0_0.distcp").read_bytes()
        asyncckpt.verify(tmp_path / name / "step_00000001")
    assert len(files["one"]) > 5 << 20
    assert used == {"one": (False, False), "many": (write_threads > 1, copy_threads > 1)}
    assert files["one"] == files["many"]
    assert_same(sd, _load(tmp_path / "many" / "step_00000001", sd))


@pytest.mark.parametrize("threads", [1, 3])
def test_copier_memmoves_what_it_may_and_copies_the_rest_exactly(threads, monkeypatch):
    """Large contiguous tensors go through memmove (no intra-op threads); strided,
    conjugate, negative, small and dtype-converting copies through torch; every
    destination ends bitwise equal to what ``copy_`` gives."""
    from asyncckpt.saving import staging

    monkeypatch.setattr(staging.StagingCopier, "PIECE_BYTES", 40 << 10)
    memmoves = count_calls(ctypes, "memmove", keep=lambda dst, src, n: n)  # observed, not replaced
    g = torch.Generator().manual_seed(0)
    big = staging.MEMMOVE_MIN_NUMEL
    srcs = [
        torch.randn(big * 3, generator=g),  # memmove
        torch.randn(big, 2, generator=g).t(),  # strided: torch
        torch.randn(big, dtype=torch.complex64, generator=g).conj(),  # conjugate view: torch
        torch.randn(big, dtype=torch.complex64, generator=g).conj().imag,  # negative view: torch
        torch.randn(7, generator=g),  # small: torch
        torch.randint(0, 100, (big,), generator=g, dtype=torch.int64),  # memmove
        torch.randn(big, dtype=torch.float64, generator=g),  # into float32: torch
        torch.randn(big * 5, generator=g).view(5, big).requires_grad_(),  # memmove, requires grad
    ]
    dsts = [torch.zeros_like(s, dtype=torch.float32 if s.dtype == torch.float64 else None).contiguous() for s in srcs]
    expected = [torch.empty_like(d).copy_(s.detach()) for d, s in zip(dsts, srcs)]
    copier = staging.StagingCopier(threads)
    try:
        copier.copy(dsts, srcs)
    finally:
        copier.close()
        memmoves.restore()
    moved = memmoves.calls
    for i, (d, e) in enumerate(zip(dsts, expected)):
        assert torch.equal(
            d.view(torch.uint8) if d.is_complex() else d, e.view(torch.uint8) if e.is_complex() else e
        ), i
    assert sum(moved) == (big * 3 + big * 5) * 4 + big * 8
    assert len(moved) == 3 if threads == 1 else len(moved) > 3  # threads take pieces


def test_write_threads_failure_removes_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "WRITE_CHUNK_BYTES", 64 << 10)
    monkeypatch.setenv("ASYNCCKPT_FAULT", "mid_write:enospc")
    with asyncckpt.CheckpointManager(tmp_path, write_threads=4) as mgr:
        with pytest.raises(CheckpointException, match="No space left"):
            mgr.save(1, _state(3, n=4, numel=200_000), async_op=False)
    assert mgr.steps() == []
    assert not any(p.name.endswith(".distcp") for p in tmp_path.rglob("*"))


def test_staging_copier_splits_by_bytes():
    from asyncckpt.saving.staging import StagingCopier, split_copies

    srcs = [torch.randn(1000), torch.randn(10), torch.randn(5000).view(50, 100).t()]
    dsts = [torch.empty(1000), torch.empty(10), torch.empty(100, 50)]
    groups = split_copies(dsts, srcs, 3, 400)
    assert sum(len(d) for d, _ in groups) > 3  # the contiguous 1000 was cut
    copier = StagingCopier(threads=3)
    copier.CHUNK_BYTES = 400
    try:
        copier.copy(dsts, srcs)
    finally:
        copier.close()
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s)
    with pytest.raises(ValueError):
        StagingCopier(0)


def test_prepare_also_readies_the_local_tiers_buffer(tmp_path):
    """With a local tier, prepare() plans and allocates its staging buffer too: the
    first local save then reuses both (it stalled as a first save did before)."""
    sd = _state(4)
    tier = asyncckpt.LocalTier(dir=tmp_path / "node0", every=1, replicas=0)
    with asyncckpt.CheckpointManager(tmp_path / "root") as plain:
        alone = plain.prepare(sd)
    with asyncckpt.CheckpointManager(tmp_path / "root", local=tier) as mgr:
        assert mgr.local is not None
        nbytes = mgr.prepare(sd)
        assert nbytes >= 2 * alone - 2 * (64 << 10)  # (each buffer rounds up to whole pages)
        buffers = staging_buffers(mgr)
        assert len(buffers) == 2
        assert not (tmp_path / "node0" / "rank_00000").exists() or not any(
            p.name.startswith("step_") for p in (tmp_path / "node0" / "rank_00000").iterdir()
        )  # nothing written
        with counting_plans() as plans:
            mgr.local.save(1, sd)
            assert mgr.local.maybe_finalize(blocking=True) == [1]
        assert staging_buffers(mgr) == buffers  # the prepared buffer was used
        assert plans.n == 0  # and the prepared plan
        got = _state(0)
        result = mgr.restore(got)
    assert result is not None and (result.step, result.tier) == (1, "local")
    assert_same(sd, got)


def test_prepare_allocates_every_staging_buffer_so_no_later_save_allocates_one(tmp_path, monkeypatch):
    """With staging_buffers=2, prepare() allocates and formats both buffers: the saves
    after it, two of them in flight at once (the writes held by a failpoint), reuse
    them and allocate nothing on the training thread."""
    sd = _state(4)
    with asyncckpt.CheckpointManager(tmp_path / "one") as one:
        single = one.prepare(sd)
    gate = tmp_path / "gate"
    monkeypatch.setenv("ASYNCCKPT_FAULT", f"after_write:wait={gate}")
    with asyncckpt.CheckpointManager(tmp_path / "two", staging_buffers=2) as mgr:
        nbytes = mgr.prepare(sd)
        buffers = staging_buffers(mgr)
        assert len(buffers) == 2 and nbytes == 2 * single
        first = mgr.save(1, sd)
        sd2 = clone_state(sd)
        sd2["model"]["w0"].add_(1)
        second = mgr.save(2, sd2)  # the first write still reads its buffer
        assert not first.done()
        assert staging_buffers(mgr) == buffers
        gate.touch()
        first.wait()
        second.wait()
        mgr.save(3, sd).wait()
        assert staging_buffers(mgr) == buffers
        bigger = _state(5, numel=100_000)  # prepared again for a larger state: both buffers grow
        mgr.prepare(bigger)
        grown = staging_buffers(mgr)
        assert len(grown) == 2 and all(b.nbytes > max(x.nbytes for x in buffers) for b in grown)
        mgr.save(4, bigger).wait()
        assert staging_buffers(mgr) == grown
    assert_same(sd2, _load(tmp_path / "two" / "step_00000002", sd2))
    assert_same(sd, _load(tmp_path / "two" / "step_00000003", sd))


def test_prepare_formats_the_buffer_without_writing(tmp_path):
    """prepare() plans and allocates; the first save then reuses both."""
    sd = _state(4)
    with asyncckpt.CheckpointManager(tmp_path) as mgr:
        nbytes = mgr.prepare(sd)
        assert nbytes >= sum(t.numel() * t.element_size() for t in sd["model"].values())
        # nothing written (but the manager's lock of its root)
        assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".asyncckpt.manager.")] == []
        buffers = staging_buffers(mgr)
        assert len(buffers) == 1 and buffers[0].nbytes >= nbytes
        with counting_plans() as plans:
            mgr.save(1, sd).wait()
        assert staging_buffers(mgr) == buffers  # the prepared buffer was used
        assert plans.n == 0  # and the prepared plan
    assert_same(sd, _load(tmp_path / "step_00000001", sd))
