"""The save handle as a future, one state machine per save, and issue 26's defect 7.

- ``SaveHandle`` is a ``concurrent.futures.Future`` completed by the saver; reading it
  (``done``, ``result(timeout=0)``) never commits.
- A fault while the saver settles a save (failpoint ``settle``) still completes the
  handle: ``wait`` raises, ``close`` returns.
- The persistent caller reaps a dead worker without holding its lock (defect 7a); a
  ``call_idx`` mismatch is a ``CheckpointError``, also under ``python -O`` (7b); a
  failure of a call that is not a save is raised, not swallowed (7c).
- The pickled ``.metadata`` cache is one per saver: two managers keep theirs.
"""

from __future__ import annotations

import concurrent.futures
import gc
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
import types
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import asyncckpt
from asyncckpt import AsyncCallsQueue, CheckpointException, CheckpointManager
from asyncckpt.async_utils.callers import PersistentAsyncCaller
from asyncckpt.async_utils.request import AsyncRequest

from helpers import closing_queue

STATE = {"w": torch.arange(1000, dtype=torch.float32), "meta": {"k": 1}}


def _fail() -> None:
    """An async_fn that fails (a call of the queue that is not a save)."""
    raise ValueError("not a save: boom")


def _break_result_pipe_then_linger(marker: str) -> None:
    """(in the persistent worker) Close the result pipe's write end, so that the trainer
    reads end of file, then stay alive: the trainer must join, then terminate it."""
    with open(os.devnull, "wb") as devnull:
        for obj in gc.get_objects():
            if isinstance(obj, Connection) and obj.writable and not obj.readable and not obj.closed:
                os.dup2(devnull.fileno(), obj.fileno())
    Path(marker).touch()
    time.sleep(60)


@pytest.fixture
def foreground_queue() -> Iterator[AsyncCallsQueue]:
    """A queue finalized in the training loop (Megatron's semantics), closed after."""
    with closing_queue(persistent=False) as queue:
        yield queue


# ---------------------------------------------------------------- the handle is a future
@pytest.mark.timeout(60)
def test_the_handle_is_a_future_completed_by_the_saver(tmp_path: Path) -> None:
    """result/exception/done/add_done_callback as for any future; cancel() is refused;
    the done callback runs once the save is committed (the directory exists)."""
    seen: list[tuple[bool, bool]] = []
    with CheckpointManager(tmp_path / "root", persistent=False) as mgr:
        handle = mgr.save(1, STATE)
        assert isinstance(handle, asyncckpt.SaveHandle) and issubclass(asyncckpt.SaveHandle, concurrent.futures.Future)
        assert handle.cancel() is False and not handle.cancelled()
        handle.add_done_callback(lambda f: seen.append((f.done(), (tmp_path / "root" / "step_00000001").is_dir())))
        result = handle.result(timeout=30)
        assert result.path == handle.checkpoint_dir == handle.path and result.step == 1 == handle.step
        assert result.timings == handle.timings and result.bytes == result.timings.bytes > 0
        assert handle.exception(timeout=0) is None and handle.wait(timeout=30) == result.timings
        done, _ = concurrent.futures.wait([handle], timeout=0)
        assert done == {handle}
        assert handle.cancel() is False
    assert seen == [(True, True)]


@pytest.mark.timeout(60)
def test_a_failed_save_is_the_futures_exception(tmp_path: Path) -> None:
    """A failed save: ``exception()`` is the CheckpointException that ``result()`` and
    ``wait()`` raise; ``timings`` is None."""
    (tmp_path / "blocker").write_text("a file where the checkpoint goes")
    with AsyncCallsQueue(persistent=False, background_finalize=True) as queue:
        handle = asyncckpt.save(STATE, tmp_path / "blocker" / "ckpt", async_op=True, calls_queue=queue)
        handle.exception(timeout=30)
    error = handle.exception(timeout=30)
    assert isinstance(error, CheckpointException) and str(tmp_path / "blocker") in str(error)
    with pytest.raises(CheckpointException) as info:
        handle.result(timeout=0)
    assert info.value is error and handle.timings is None
    with pytest.raises(CheckpointException):
        handle.wait(timeout=0)


@pytest.mark.timeout(60)
def test_done_and_result_zero_never_commit(tmp_path: Path, foreground_queue: AsyncCallsQueue) -> None:
    """On a queue finalized in the training loop, done() and result(timeout=0) only read
    the state: no commit, no file appears; wait() (the blocking path) commits. Before,
    done() ran the whole commit in the caller's thread."""
    handle = asyncckpt.save(STATE, tmp_path / "ckpt", async_op=True, calls_queue=foreground_queue)
    assert handle.call_idx is not None and foreground_queue.wait_local(handle.call_idx, timeout=30)
    for _ in range(5):
        assert not handle.done()
        with pytest.raises(TimeoutError):
            handle.result(timeout=0)
        with pytest.raises(TimeoutError):
            handle.exception(timeout=0)
    assert not (tmp_path / "ckpt").exists() and foreground_queue.is_pending(handle.call_idx)
    timings = handle.wait(timeout=30)
    assert handle.done() and timings.bytes > 0 and (tmp_path / "ckpt").is_dir()
    asyncckpt.verify(tmp_path / "ckpt")


@pytest.mark.timeout(60)
def test_result_with_a_timeout_drives_a_queue_finalized_in_the_loop(
    tmp_path: Path, foreground_queue: AsyncCallsQueue
) -> None:
    """result(timeout) is the blocking path, as wait(): it finalizes, in one process."""
    handle = asyncckpt.save(STATE, tmp_path / "ckpt", async_op=True, calls_queue=foreground_queue)
    assert handle.result(timeout=30).path == (tmp_path / "ckpt").absolute()


# ---------------------------------------------------------------- a fault while settling
@pytest.mark.timeout(90)
@pytest.mark.parametrize("caller", ["temporal", "persistent"])
def test_a_fault_while_settling_still_completes_the_handle(
    tmp_path: Path, caller: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The saver's settle step raises (failpoint ``settle:raise``, in the finalizer
    thread): the handle completes with a CheckpointException caused by that error,
    ``wait_all``/``close`` return instead of waiting forever, and ``close`` raises the
    failure not reported yet. Before, the handle stayed pending: ``wait`` timed out and
    ``close`` waited without a limit."""
    monkeypatch.setenv("ASYNCCKPT_FAULT", "settle:raise")
    mgr = CheckpointManager(tmp_path / "root", persistent=caller == "persistent")
    try:
        first = mgr.save(1, STATE)
        with pytest.raises(CheckpointException) as info:
            first.wait(timeout=30)
        assert isinstance(info.value.__cause__, OSError) and "settling the save" in str(info.value)
        assert first.done() and first.exception() is info.value
        second = mgr.save(2, STATE)
        done, _ = concurrent.futures.wait([second], timeout=30)
        assert done == {second}
    finally:
        raised: list[BaseException | None] = []

        def close() -> None:
            try:
                mgr.close()
            except BaseException as exc:  # noqa: BLE001 - checked below
                raised.append(exc)
            else:
                raised.append(None)

        closer = threading.Thread(target=close, daemon=True)
        closer.start()
        closer.join(30)
    assert not closer.is_alive(), "close() waited for a handle that never settles"
    assert len(raised) == 1 and isinstance(raised[0], CheckpointException), raised  # the second save's failure
    assert second.exception(timeout=0) is raised[0]


# ---------------------------------------------------------------- defect 7a
@pytest.mark.timeout(90)
def test_reaping_a_dead_worker_does_not_hold_the_callers_lock(tmp_path: Path) -> None:
    """The persistent worker's result pipe breaks while the process lingers: the thread
    that finds it (the finalizer) joins it, then terminates it (seconds). Another
    thread (the training thread) asking ``is_running`` meanwhile is answered at once
    (the call still counts as running), before the reap ends; the call then fails
    naming the worker. Before, poll() held the caller's lock across the join: the
    training thread waited for the whole reap."""
    marker = tmp_path / "pipe_broken"
    caller = PersistentAsyncCaller()
    try:
        caller.schedule(0, _break_result_pipe_then_linger, (str(marker),), {})
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert time.monotonic() < deadline, "the worker never ran the call"
            time.sleep(0.01)
        worker = psutil.Process(caller.worker_pid)
        reaper = threading.Thread(target=caller.poll)
        reaper.start()
        time.sleep(0.3)  # the reaper is inside its join (it lasts TERMINATE_GRACE_S: the worker lingers)
        running = caller.is_running(0)
        # Answered while the worker was still being reaped: it is still there.
        unreaped = worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE
        reaper.join(30)
        assert unreaped, "is_running() waited until the dead worker was reaped"
        assert running is True and not worker.is_running()
        outcome = caller.outcome(0)
        assert outcome is not None and not outcome.ok and "persistent worker" in str(outcome.error)
    finally:
        caller.close(abort=True)


# ---------------------------------------------------------------- defect 7b
class _RacingQueue(AsyncCallsQueue):
    """A queue on which another thread schedules a call just before each save's call
    (the injected fault: the saver's call_idx is then not the one assigned)."""

    def schedule_async_request(self, async_request: AsyncRequest, **kwargs: Any) -> int:
        super().schedule_async_request(AsyncRequest(None, (), []))
        return super().schedule_async_request(async_request, **kwargs)


_RACE_SCRIPT = textwrap.dedent("""
    import sys, torch, asyncckpt
    sys.path.insert(0, sys.argv[2])
    from test_handle_future import _RacingQueue
    queue = _RacingQueue(persistent=False)
    try:
        asyncckpt.save({"w": torch.ones(10)}, sys.argv[1], async_op=True, calls_queue=queue)
    except asyncckpt.CheckpointError as exc:
        print("RAISED", type(exc).__name__, exc)
    else:
        print("NOT RAISED")
    try:
        queue.close()
    except asyncckpt.CheckpointException as exc:
        print("CLOSE", exc)
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimize", [False, True], ids=["plain", "python-O"])
def test_a_call_idx_mismatch_is_a_checkpoint_error(tmp_path: Path, optimize: bool) -> None:
    """Another thread scheduled on the saver's queue between the saver reading the next
    call_idx and scheduling: save() raises CheckpointError naming the save (before: an
    ``assert``, gone under ``python -O``, and the save then committed with another
    call's result), and the save is not committed."""
    target = tmp_path / "ckpt"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(Path(asyncckpt.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    )
    cmd = (
        [sys.executable] + (["-O"] if optimize else []) + ["-c", _RACE_SCRIPT, str(target), str(Path(__file__).parent)]
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "RAISED CheckpointError" in proc.stdout and "another thread scheduled" in proc.stdout, proc.stdout
    assert str(target) in proc.stdout and not target.exists()


# ---------------------------------------------------------------- defect 7c
@pytest.mark.timeout(60)
def test_wait_raises_the_failure_of_an_earlier_call_that_is_not_a_save(
    tmp_path: Path, foreground_queue: AsyncCallsQueue
) -> None:
    """On a queue finalized in the training loop, ``wait()`` finalizes the calls before
    its save: the failure of one that is not a save (nobody else reports it) is raised
    (before: swallowed); the save itself still commits on the next wait."""
    foreground_queue.schedule_async_request(AsyncRequest(_fail, (), []))
    handle = asyncckpt.save(STATE, tmp_path / "ckpt", async_op=True, calls_queue=foreground_queue)
    with pytest.raises(CheckpointException) as info:
        handle.wait(timeout=30)
    assert info.value.call_idx == 0 and "boom" in str(info.value)
    assert handle.wait(timeout=30).bytes > 0
    asyncckpt.verify(tmp_path / "ckpt")


@pytest.mark.timeout(60)
def test_close_raises_the_failure_of_a_call_that_is_not_a_save(tmp_path: Path) -> None:
    """A call the user scheduled on a manager's own queue fails: ``close()`` raises it
    (before: swallowed, as if it were one of the manager's saves, reported already)."""
    mgr = CheckpointManager(tmp_path / "root", persistent=False)
    mgr.save(1, STATE).wait(timeout=30)
    mgr.queue.schedule_async_request(AsyncRequest(_fail, (), []))
    with pytest.raises(CheckpointException) as info:
        mgr.close()
    assert "boom" in str(info.value) and mgr.steps() == [1]


# ---------------------------------------------------------------- a cache per saver
@pytest.mark.timeout(120)
def test_two_managers_saving_alternately_keep_their_metadata_reuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model and an EMA manager save in turn: each reuses the ``.metadata`` bytes of
    its own previous commit, so only their first saves pickle it (the test hook: a spy
    on ``pickle.dumps`` of DCP ``Metadata`` in the commit). Before, one cache per
    process: each commit evicted the other's entry and every save pickled afresh."""
    from torch.distributed.checkpoint.metadata import Metadata

    from asyncckpt.saving import phases

    pickled: list[str] = []

    def dumps(obj: Any, *args: Any, **kwargs: Any) -> bytes:
        if isinstance(obj, Metadata):
            pickled.append(str(obj.storage_meta.checkpoint_id) if obj.storage_meta is not None else "?")
        return pickle.dumps(obj, *args, **kwargs)

    monkeypatch.setattr(phases, "pickle", types.SimpleNamespace(dumps=dumps))
    model = {f"layer{i}": torch.full((64,), float(i)) for i in range(50)}
    ema = {"ema": {f"p{i}": torch.zeros(32) for i in range(30)}, "decay": 0.999}
    with (
        CheckpointManager(tmp_path / "model", persistent=False) as m,
        CheckpointManager(tmp_path / "ema", persistent=False) as e,
    ):
        for step in range(1, 5):
            m.save(step, model).wait(timeout=30)
            e.save(step, ema).wait(timeout=30)
    assert len(pickled) == 2, pickled
    assert [Path(p).parent.name for p in pickled] == ["model", "ema"]
    for step in range(1, 5):
        asyncckpt.verify(tmp_path / "model" / f"step_{step:08d}")
        asyncckpt.verify(tmp_path / "ema" / f"step_{step:08d}")
