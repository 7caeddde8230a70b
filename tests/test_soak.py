"""Soak: many consecutive asynchronous saves of a 64 MiB state leak nothing.

Each soak saves the same (mutated in place) 64 MiB state over and over, through
``CheckpointManager(keep_last=2)`` and through ``asyncckpt.save(..., calls_queue=...)``,
with the persistent worker and with forked (temporal) children. After a warm-up
(``WARMUP`` saves) and at the end, with no write in flight, it measures with psutil:

- resident memory (RSS) of the test process and of the persistent worker;
- open file descriptors of both;
- child processes (pids; the persistent worker must be the same process throughout);
- ``/dev/shm`` entries (shared-memory segments; ``sem.*`` excluded, see conftest);

and asserts, between warm-up and end:

- RSS growth < ``RSS_TOLERANCE`` (32 MiB = half a state copy: a leak of one staging
  buffer or one state copy per N saves shows; allocator noise does not);
- file descriptors within +-``FD_TOLERANCE`` (2);
- the same child processes, the same ``/dev/shm`` entries;
- no warning emitted (``warnings.catch_warnings(record=True)`` + ``simplefilter("always")``)
  and nothing written to stderr by the test process or the worker (fd-level capture).

The disk stays bounded: keep_last=2 (manager) or the test deleting old checkpoints
(free ``save``). The last checkpoint is loaded and compared with the state.

``ASYNCCKPT_LONG=1``: 500 saves per soak (the issue's figure), else 40.
The figures (RSS / fds at start, after warm-up, at the end; stall and write medians)
are printed; run with ``-s`` to see them.
"""

from __future__ import annotations

import collections
import gc
import os
import shutil
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from conftest import shm_entries

import asyncckpt
from asyncckpt import AsyncCallsQueue, CheckpointManager, PersistentAsyncCaller

LONG = os.environ.get("ASYNCCKPT_LONG") == "1"
SAVES = 500 if LONG else 40
#: The temporal caller's soaks (a fork per save) run with ``ASYNCCKPT_LONG=1`` only (the
#: suite's time); the persistent worker's run always.
TEMPORAL = pytest.param(False, marks=pytest.mark.skipif(not LONG, reason="ASYNCCKPT_LONG=1: the temporal soaks"))
WARMUP = 5
STATE_BYTES = 64 << 20
RSS_TOLERANCE = 32 << 20
FD_TOLERANCE = 2
MiB = 1 << 20


def make_state() -> dict[str, Any]:
    """64 MiB of float32 in four 16 MiB tensors, plus small tensors and Python values."""
    g = torch.Generator().manual_seed(0)
    n = STATE_BYTES // 4 // 4
    return {
        "model": {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(4)},
        "extra": {"bias": torch.zeros(1000), "step": torch.zeros((), dtype=torch.int64)},
        "step": 0,
        "note": "soak",
    }


def mutate(state: dict[str, Any], i: int) -> None:
    """Change every tensor in place (what a training step does) and the Python values."""
    for t in state["model"].values():
        t.add_(1.0)
    state["extra"]["bias"].fill_(float(i))
    state["extra"]["step"].fill_(i)
    state["step"] = i


def children() -> set[int]:
    """Pids of this process's live (or zombie) descendants."""
    return {p.pid for p in psutil.Process().children(recursive=True)}


@dataclass
class Probe:
    """One measurement, taken with no write in flight."""

    label: str
    save: int
    rss: int
    fds: int
    worker_pid: int | None
    worker_rss: int | None
    worker_fds: int | None
    children: set[int]
    shm: set[str]

    def line(self) -> str:
        w = (
            f"worker pid {self.worker_pid} RSS {self.worker_rss / MiB:.1f} MiB fds {self.worker_fds}"
            if self.worker_rss is not None
            else "no worker"
        )
        return (
            f"{self.label:>9s} (save {self.save:3d}): RSS {self.rss / MiB:7.1f} MiB, fds {self.fds:3d} | {w} | "
            f"children {len(self.children)}, /dev/shm entries {len(self.shm)}"
        )


def probe(label: str, save: int, caller: Any) -> Probe:
    me = psutil.Process()
    pid = caller.worker_pid if isinstance(caller, PersistentAsyncCaller) else None
    w_rss = w_fds = None
    if pid is not None:
        w = psutil.Process(pid)
        w_rss, w_fds = w.memory_info().rss, w.num_fds()
    return Probe(label, save, me.memory_info().rss, me.num_fds(), pid, w_rss, w_fds, children(), shm_entries())


@dataclass
class SoakResult:
    probes: list[Probe] = field(default_factory=list)
    stalls: list[float] = field(default_factory=list)  # seconds the caller was blocked in save()
    writes: list[float] = field(default_factory=list)  # SaveTimings.write_s
    totals: list[float] = field(default_factory=list)  # SaveTimings.total_s
    wall_s: float = 0.0
    max_dirs: int = 0  # most checkpoint directories seen on disk at once

    def report(self, title: str) -> str:
        lines = [
            (
                f"{title}: {SAVES} saves of {STATE_BYTES / MiB:.0f} MiB in {self.wall_s:.1f} s "
                f"({self.wall_s / SAVES:.3f} s per save); stall median {statistics.median(self.stalls) * 1e3:.1f} ms "
                f"(max {max(self.stalls) * 1e3:.1f}); write median {statistics.median(self.writes) * 1e3:.1f} ms; "
                f"save-to-commit median {statistics.median(self.totals) * 1e3:.1f} ms; "
                f"at most {self.max_dirs} checkpoint directories on disk"
            )
        ]
        lines += ["  " + p.line() for p in self.probes]
        return "\n".join(lines)


def assert_flat(res: SoakResult, warm: Probe, end: Probe) -> None:
    msg = "\n" + res.report("soak")
    assert end.rss - warm.rss < RSS_TOLERANCE, f"RSS grew by {(end.rss - warm.rss) / MiB:.1f} MiB{msg}"
    assert abs(end.fds - warm.fds) <= FD_TOLERANCE, f"fds {warm.fds} -> {end.fds}{msg}"
    assert end.children == warm.children, f"child processes changed: {warm.children} -> {end.children}{msg}"
    assert end.shm == warm.shm, f"/dev/shm changed: {sorted(warm.shm ^ end.shm)}{msg}"
    if warm.worker_rss is not None and warm.worker_fds is not None:
        assert end.worker_pid == warm.worker_pid, f"the worker was restarted{msg}"
        assert end.worker_rss is not None and end.worker_fds is not None
        assert end.worker_rss - warm.worker_rss < RSS_TOLERANCE, (
            f"worker RSS grew by {(end.worker_rss - warm.worker_rss) / MiB:.1f} MiB{msg}"
        )
        assert abs(end.worker_fds - warm.worker_fds) <= FD_TOLERANCE, (
            f"worker fds {warm.worker_fds} -> {end.worker_fds}{msg}"
        )


def check_last(path: Path, state: dict[str, Any]) -> None:
    """The last checkpoint verifies and holds the state's values as of its save."""
    asyncckpt.verify(path)
    loaded = make_state()
    asyncckpt.load(loaded, path)
    for k, t in state["model"].items():
        assert torch.equal(loaded["model"][k], t), k
    assert torch.equal(loaded["extra"]["bias"], state["extra"]["bias"])
    assert loaded["step"] == state["step"] == SAVES - 1


def count_dirs(root: Path) -> int:
    return sum(1 for e in os.scandir(root) if e.is_dir())


@pytest.mark.timeout(3600 if LONG else 150)
@pytest.mark.parametrize("persistent", [True, TEMPORAL], ids=["persistent", "temporal"])
def test_soak_checkpoint_manager(tmp_path: Path, capfd: pytest.CaptureFixture[str], persistent: bool) -> None:
    state = make_state()
    res = SoakResult()
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, keep_last=2, persistent=persistent)
    try:
        res.probes.append(probe("start", 0, mgr.queue.caller))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            handles = []
            for i in range(SAVES):
                mutate(state, i)
                t1 = time.perf_counter()
                handles.append(mgr.save(i, state))
                res.stalls.append(time.perf_counter() - t1)
                mgr.maybe_finalize()
                res.max_dirs = max(res.max_dirs, count_dirs(root))
                if i + 1 == WARMUP or (i + 1) % 100 == 0 or i + 1 == SAVES:
                    mgr.maybe_finalize(blocking=True)
                    gc.collect()  # garbage of earlier tests (their fds) is not this soak's
                    res.probes.append(
                        probe(
                            "warm-up" if i + 1 == WARMUP else "end" if i + 1 == SAVES else "progress",
                            i + 1,
                            mgr.queue.caller,
                        )
                    )
            res.wall_s = time.perf_counter() - t0
            assert mgr.steps() == [SAVES - 2, SAVES - 1]
            for h in handles:
                assert h.timings is not None, h
                res.writes.append(h.timings.write_s)
                res.totals.append(h.timings.total_s)
            del handles
            check_last(mgr.step_dir(SAVES - 1), state)
            mgr.close()
        warm = next(p for p in res.probes if p.label == "warm-up")
        end = next(p for p in res.probes if p.label == "end")
        print("\n" + res.report(f"CheckpointManager, {'persistent' if persistent else 'temporal'} caller"))
        assert not [str(w.message) for w in caught], [f"{w.category.__name__}: {w.message}" for w in caught]
        assert_flat(res, warm, end)
        # keep_last=2, one save being written, one written whose commit is still running in
        # the finalizer thread (the next write overlaps it), and one old checkpoint being
        # removed in the background (a new removal waits for the previous one).
        assert res.max_dirs <= 5, f"keep_last=2 but {res.max_dirs} directories were on disk at once"
    finally:
        mgr.close(abort=True)
        shutil.rmtree(root, ignore_errors=True)
    out, err = capfd.readouterr()
    assert not err.strip(), f"stderr (test process or worker) was not empty:\n{err}"
    print(out)


@pytest.mark.timeout(3600 if LONG else 150)
@pytest.mark.parametrize("persistent", [True, TEMPORAL], ids=["persistent", "temporal"])
def test_soak_save_with_explicit_queue(tmp_path: Path, capfd: pytest.CaptureFixture[str], persistent: bool) -> None:
    state = make_state()
    res = SoakResult()
    root = tmp_path / "ckpt"
    root.mkdir()
    queue = AsyncCallsQueue(persistent=True, import_main=False) if persistent else AsyncCallsQueue(persistent=False)
    try:
        res.probes.append(probe("start", 0, queue.caller))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            pending: collections.deque = collections.deque()
            committed: collections.deque = collections.deque()
            last = None
            for i in range(SAVES):
                mutate(state, i)
                t1 = time.perf_counter()
                last = asyncckpt.save(state, root / f"save_{i:05d}", async_op=True, calls_queue=queue)
                res.stalls.append(time.perf_counter() - t1)
                pending.append(last)
                queue.maybe_finalize_async_calls()
                blocking = i + 1 == WARMUP or (i + 1) % 100 == 0 or i + 1 == SAVES
                if blocking:
                    queue.maybe_finalize_async_calls(blocking=True)
                while pending and pending[0].done():
                    h = pending.popleft()
                    assert h.timings is not None, h.exception()
                    res.writes.append(h.timings.write_s)
                    res.totals.append(h.timings.total_s)
                    committed.append(h)
                res.max_dirs = max(res.max_dirs, count_dirs(root))
                while len(committed) > 2:  # keep the newest two, like keep_last=2
                    shutil.rmtree(committed.popleft().checkpoint_dir)
                if blocking:
                    gc.collect()  # garbage of earlier tests (their fds) is not this soak's
                    res.probes.append(
                        probe(
                            "warm-up" if i + 1 == WARMUP else "end" if i + 1 == SAVES else "progress",
                            i + 1,
                            queue.caller,
                        )
                    )
            res.wall_s = time.perf_counter() - t0
            assert not pending and len(res.totals) == SAVES
            assert last is not None
            check_last(last.checkpoint_dir, state)
            queue.close()
        warm = next(p for p in res.probes if p.label == "warm-up")
        end = next(p for p in res.probes if p.label == "end")
        print(
            "\n" + res.report(f"asyncckpt.save + explicit queue, {'persistent' if persistent else 'temporal'} caller")
        )
        assert not [str(w.message) for w in caught], [f"{w.category.__name__}: {w.message}" for w in caught]
        assert_flat(res, warm, end)
        assert res.max_dirs <= 4
    finally:
        queue.close(abort=True)
        shutil.rmtree(root, ignore_errors=True)
    out, err = capfd.readouterr()
    assert not err.strip(), f"stderr (test process or worker) was not empty:\n{err}"
    print(out)


@pytest.mark.timeout(120)
def test_explicit_queues_release_their_staging_buffers(tmp_path: Path) -> None:
    """A queue passed to ``asyncckpt.save`` and closed leaves nothing behind: a program
    that uses one queue per phase (or per save) must not grow by a staging buffer
    (one state copy, two fds) per queue."""
    state = {"w": torch.randn(4 << 20)}  # 16 MiB
    me = psutil.Process()

    def measure() -> tuple[int, int]:
        gc.collect()
        return me.memory_info().rss, me.num_fds()

    figures = []
    for k in range(6):
        queue = AsyncCallsQueue(persistent=False)
        try:
            asyncckpt.save(state, tmp_path / f"c{k}", async_op=True, calls_queue=queue).wait()
        finally:
            queue.close()
        del queue
        figures.append(measure())
        if k == 1:
            base = figures[-1]
    rss, fds = figures[-1]
    text = ", ".join(f"{r / MiB:.0f} MiB/{f} fds" for r, f in figures)
    assert fds - base[1] <= FD_TOLERANCE, f"fds grow with every closed queue: {text}"
    assert rss - base[0] < 32 * MiB, f"RSS grows with every closed queue: {text}"
