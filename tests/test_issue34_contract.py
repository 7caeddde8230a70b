"""Issue 34's defects (items 5-8) and issue 30's item 9, through the public API.

- Item 5, one error contract: every error asyncckpt raises derives from
  ``AsyncckptError`` and keeps its builtin base (a test per raise site).
- Item 6, memory held only while needed: a synchronous ``asyncckpt.save`` keeps no
  staging buffer nor copy thread; a queue keeps idle staging buffers for one
  ``SaveOptions`` only; the asynchronous steady state reuses its buffer.
- Item 7, a save that committed is never reported failed: a failure after the rename
  (failpoints ``after_rename`` and ``after_latest``) is a warning, on 1 and 2 ranks.
- Item 8 / issue 30 item 9, the default queue belongs to (this process, this
  incarnation of the process group): a new ``init_process_group`` after
  ``destroy_process_group`` and a fork-started child each get a queue of their own.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt import (
    AsyncCallsQueue,
    AsyncckptError,
    CheckpointManager,
    CheckpointTimeoutError,
    InvalidArgumentError,
    InvalidStateError,
    SaveOptions,
)
from asyncckpt.async_utils.callers import PersistentAsyncCaller
from asyncckpt.async_utils.request import AsyncRequest

from dist_utils import run_ranks

STATE = {"w": torch.arange(1000, dtype=torch.float32), "step": 3}


def _stage_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("asyncckpt-stage") and t.is_alive()}


def _memfds() -> int:
    """Staging memfds open in this process (``memfd:asyncckpt-...``)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("memfd:asyncckpt-")
        except OSError:
            pass
    return count


# ====================================================================== item 5: one error contract
def _error_of(call: Any) -> BaseException:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - returned to the test
        return exc
    raise AssertionError("no error was raised")


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda: SaveOptions(staging_buffers=0), id="options-count"),
        pytest.param(lambda: SaveOptions(copy_threads="2"), id="options-type"),  # type: ignore[arg-type]
        pytest.param(lambda: SaveOptions(plan_cache=1), id="options-bool"),  # type: ignore[arg-type]
        pytest.param(lambda: SaveOptions(staging_memory_limit=0), id="options-limit"),
        pytest.param(lambda: SaveOptions.resolve(SaveOptions(), overlap_staging=True), id="options-and-keyword"),
        pytest.param(lambda: SaveOptions.resolve({"copy_threads": 1}), id="options-not-options"),  # type: ignore[arg-type]
        pytest.param(lambda: AsyncCallsQueue(persistent=False, start_method="spawn"), id="queue-conflict"),
        pytest.param(lambda: PersistentAsyncCaller(start_method="fork"), id="caller-start-method"),
        pytest.param(lambda: asyncckpt.PreemptionSave(None, grace_s=-1), id="preemption-grace"),
        pytest.param(lambda: asyncckpt.PreemptionSave(None, signals=()), id="preemption-signals"),
    ],
)
def test_argument_errors_are_asyncckpt_errors_and_value_errors(call: Any) -> None:
    exc = _error_of(call)
    assert isinstance(exc, InvalidArgumentError), repr(exc)
    assert isinstance(exc, AsyncckptError) and isinstance(exc, ValueError)


def test_save_and_load_argument_errors(tmp_path: Path) -> None:
    """The raise sites of ``save``, ``load``, ``read_state_dict``: each an
    ``InvalidArgumentError`` (a ``ValueError``), before anything is written or read."""
    cases = {
        "sync overlap_staging": lambda: asyncckpt.save(STATE, tmp_path / "a", overlap_staging=True),
        "options and overlap_staging": lambda: asyncckpt.save(
            STATE, tmp_path / "a", async_op=True, options=SaveOptions(), overlap_staging=True
        ),
        "coordinator_rank": lambda: asyncckpt.save(STATE, tmp_path / "a", coordinator_rank=3),
    }
    for name, call in cases.items():
        exc = _error_of(call)
        assert isinstance(exc, InvalidArgumentError) and isinstance(exc, ValueError), (name, repr(exc))
    assert not (tmp_path / "a").exists()
    asyncckpt.save(STATE, tmp_path / "ok")
    reads: list[Callable[[], object]] = [
        lambda: asyncckpt.load({"w": torch.zeros(1000)}, tmp_path / "ok", verify="x"),  # type: ignore[arg-type]
        lambda: asyncckpt.load({"w": torch.zeros(1000)}, tmp_path / "missing", verify="x"),  # type: ignore[arg-type]
        lambda: asyncckpt.read_state_dict(tmp_path / "ok", verify="bogus"),  # type: ignore[arg-type]
    ]
    for read in reads:
        exc = _error_of(read)
        assert isinstance(exc, InvalidArgumentError) and "verify" in str(exc), repr(exc)
    # load's own value is accepted by read_state_dict too (it verifies, as True does)
    assert torch.equal(asyncckpt.read_state_dict(tmp_path / "ok", verify="inline")["w"], STATE["w"])  # type: ignore[arg-type]


def test_manager_errors_keep_their_builtin_base(tmp_path: Path) -> None:
    """Option conflicts are ``InvalidArgumentError`` s; a closed manager (``save``,
    ``prepare``) an ``InvalidStateError``, which is a ``RuntimeError``."""
    queue = AsyncCallsQueue(persistent=False)
    try:
        conflicts = [
            lambda: CheckpointManager(tmp_path / "r1", calls_queue=queue, persistent=True),
            lambda: CheckpointManager(tmp_path / "r2", read_only=True, keep_last=2),
            lambda: CheckpointManager(tmp_path / "r3", persistent=False, start_method="spawn"),
        ]
        for call in conflicts:
            exc = _error_of(call)
            assert isinstance(exc, InvalidArgumentError) and isinstance(exc, ValueError), repr(exc)
    finally:
        queue.close()
    manager = CheckpointManager(tmp_path / "root", persistent=False)
    manager.close()
    closed: list[Callable[[], object]] = [lambda: manager.save(1, STATE), lambda: manager.prepare(STATE)]
    for refused in closed:
        exc = _error_of(refused)
        assert isinstance(exc, InvalidStateError) and isinstance(exc, RuntimeError), repr(exc)
        assert isinstance(exc, AsyncckptError)


def test_framework_state_errors() -> None:
    """A closed queue and a frozen request: ``InvalidStateError`` (a ``RuntimeError``)."""
    queue = AsyncCallsQueue(persistent=False)
    queue.close()
    for call in (
        lambda: queue.schedule_async_request(AsyncRequest(print, ())),
        queue.start,
        lambda: AsyncRequest(print, ()).freeze().add_finalize_fn(print),
    ):
        exc = _error_of(call)
        assert isinstance(exc, InvalidStateError) and isinstance(exc, RuntimeError), repr(exc)


@pytest.mark.timeout(120)
def test_a_wait_that_times_out_is_an_asyncckpt_timeout_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``wait``, ``result`` and ``exception`` with a timeout that runs out: a
    ``CheckpointTimeoutError`` (a ``TimeoutError``); the save still commits."""
    monkeypatch.setenv("ASYNCCKPT_FAULT", "after_write:sleep=3")  # read by the forked writer
    queue = AsyncCallsQueue(persistent=False, background_finalize=True)
    try:
        handle = asyncckpt.save(STATE, tmp_path / "slow", async_op=True, calls_queue=queue)
        for call in (lambda: handle.wait(0.1), lambda: handle.result(0.1), lambda: handle.exception(0.1)):
            exc = _error_of(call)
            assert isinstance(exc, CheckpointTimeoutError) and isinstance(exc, TimeoutError), repr(exc)
        handle.wait()
    finally:
        queue.close()
    asyncckpt.verify(tmp_path / "slow")


def test_every_public_error_derives_from_the_base() -> None:
    names = [n for n in asyncckpt.__all__ if n.endswith(("Error", "Exception"))]
    assert "InvalidStateError" in names and "CheckpointTimeoutError" in names
    for name in names:
        assert issubclass(getattr(asyncckpt, name), AsyncckptError), name


# ====================================================================== item 7: committed is committed
def _save_with_faults(root: Path, rank: int) -> list[str]:
    """Steps 1 (sync, failpoint ``after_rename:raise``) and 2 (async, ``after_latest:raise``)
    on the coordinator; returns the warnings this rank saw."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager = CheckpointManager(root, keep_last=1)
        try:
            manager.save(0, {"w": torch.full((64,), float(rank))}, async_op=False)
            for step, point, async_op in ((1, "after_rename", False), (2, "after_latest", True)):
                if rank == 0:
                    os.environ["ASYNCCKPT_FAULT"] = f"{point}:raise"
                try:
                    handle = manager.save(step, {"w": torch.full((64,), float(step + rank))}, async_op=async_op)
                    handle.wait()  # committed: no exception
                finally:
                    os.environ.pop("ASYNCCKPT_FAULT", None)
        finally:
            manager.close()
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def _check_committed(root: Path) -> None:
    for step in (1, 2):
        asyncckpt.verify(root / f"step_{step:08d}")
        loaded = asyncckpt.read_state_dict(root / f"step_{step:08d}")
        assert loaded["w"].shape == (64,)
    assert (root / "latest").read_text().strip() == "step_00000002"
    # after_latest:raise stopped step 2's retention (a warning): step 1 is still there
    reader = CheckpointManager(root, read_only=True)
    assert reader.steps() == [1, 2]
    reader.close()


@pytest.mark.timeout(120)
def test_a_failure_after_the_commit_point_is_a_warning_one_rank(tmp_path: Path) -> None:
    seen = _save_with_faults(tmp_path, 0)
    assert any("step 1" in w and "is committed" in w and "after_rename" in w for w in seen), seen
    assert any("step 2" in w and "is committed" in w and "after_latest" in w for w in seen), seen
    _check_committed(tmp_path)


def _two_rank_faults(rank: int, world_size: int, root: str) -> list[str]:
    return _save_with_faults(Path(root), rank)


@pytest.mark.timeout(180)
def test_a_failure_after_the_commit_point_is_a_warning_two_ranks(tmp_path: Path) -> None:
    """On 2 gloo ranks the coordinator still broadcasts the outcome: both ranks return
    from the synchronous save and from ``wait`` of the asynchronous one."""
    seen = run_ranks(_two_rank_faults, 2, str(tmp_path), timeout=150)
    assert any("after_rename" in w for w in seen[0]) and any("after_latest" in w for w in seen[0]), seen
    assert seen[1] == [], seen  # nothing failed on rank 1
    _check_committed(tmp_path)
