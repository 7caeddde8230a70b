"""Options: a call's ``options=`` never changes what another call gets, and options that
contradict each other, or that a path would ignore, raise ``ValueError`` naming both
(issue 26, defects 2 and 3)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import asyncckpt
from asyncckpt import (
    AsyncCallsQueue,
    CheckpointManager,
    PersistentAsyncCaller,
    SaveOptions,
    TemporalAsyncCaller,
)
from asyncckpt.options import default_copy_threads


def _stage_threads() -> set[threading.Thread]:
    """The staging copy threads alive in this process (named ``asyncckpt-stage*``)."""
    return {t for t in threading.enumerate() if t.name.startswith("asyncckpt-stage") and t.is_alive()}


# ====================================================================== defect 2
@pytest.mark.timeout(180)
def test_a_save_without_options_keeps_an_earlier_calls_options(tmp_path: Path) -> None:
    """``save(options=X)``, then ``save()``, then ``save(options=X)`` again, asynchronous:
    the second call does not change what the third gets. X's copy threads are the same
    threads (before, the second call made the one saver of the queue adopt the default
    options: X's copy threads were stopped, and its plan cache dropped). Synchronous
    saves release their copy threads when they return (tests/test_issue34_contract.py)."""
    threads = 3 if default_copy_threads() != 3 else 2
    mine = SaveOptions(copy_threads=threads)
    state = {"w": torch.randn(4 << 20), "b": torch.arange(1 << 20, dtype=torch.int64)}
    queue = AsyncCallsQueue(persistent=False)  # forked writer: nothing to start
    try:
        before = _stage_threads()
        asyncckpt.save(state, tmp_path / "a", calls_queue=queue, options=mine, async_op=True).wait()
        first = _stage_threads() - before
        assert first, "a save with copy_threads > 1 copies in threads"
        # no options=: the defaults, for this call
        asyncckpt.save(state, tmp_path / "b", calls_queue=queue, async_op=True).wait()
        asyncckpt.save(state, tmp_path / "c", calls_queue=queue, options=mine, async_op=True).wait()
        gone = [t.name for t in first if not t.is_alive()]
        assert gone == [], f"the copy threads of options= were stopped by a call without options=: {gone}"
    finally:
        queue.close()
    for name in ("a", "b", "c"):
        loaded = {"w": torch.zeros(4 << 20), "b": torch.zeros(1 << 20, dtype=torch.int64)}
        asyncckpt.load(loaded, tmp_path / name)
        assert all(torch.equal(loaded[k], state[k]) for k in state)


# ====================================================================== defect 3
def _names_both(exc: pytest.ExceptionInfo[ValueError], *names: str) -> None:
    for name in names:
        assert name in str(exc.value), (name, str(exc.value))


@pytest.mark.parametrize(
    "given", [{"start_method": "forkserver"}, {"start_method": "spawn"}, {"import_main": False}, {"import_main": True}]
)
def test_worker_options_without_a_worker_raise(given: dict) -> None:
    """``start_method`` / ``import_main`` with ``persistent=False`` (a child forked per
    call: there is no worker to start) were ignored."""
    with pytest.raises(ValueError) as exc:
        AsyncCallsQueue(persistent=False, **given)
    _names_both(exc, next(iter(given)), "persistent")


def test_worker_options_with_a_caller_raise() -> None:
    with pytest.raises(ValueError) as exc:
        AsyncCallsQueue(caller=TemporalAsyncCaller(), start_method="spawn")
    _names_both(exc, "start_method", "caller")


def test_import_main_false_with_forkserver_raises() -> None:
    """A forkserver worker is forked from multiprocessing's fork server, which imported
    the main script itself: ``import_main=False`` was silently turned into True."""
    with pytest.raises(ValueError) as exc:
        PersistentAsyncCaller(start_method="forkserver", import_main=False)
    _names_both(exc, "import_main", "forkserver")
    with pytest.raises(ValueError) as exc:
        AsyncCallsQueue(persistent=True, start_method="forkserver", import_main=False)
    _names_both(exc, "import_main", "forkserver")
    # Left out, each start method gets what it can do.
    assert PersistentAsyncCaller(start_method="forkserver").import_main is True
    assert PersistentAsyncCaller(start_method="spawn", import_main=False).import_main is False


def test_no_dist_with_the_background_finalizer_raises() -> None:
    """``maybe_finalize_async_calls(no_dist=True)`` on a queue finalized in the
    background: the finalizer decides collectively, so no_dist was ignored."""
    queue = AsyncCallsQueue(persistent=False, background_finalize=True)
    try:
        with pytest.raises(ValueError) as exc:
            queue.maybe_finalize_async_calls(no_dist=True)
        _names_both(exc, "no_dist", "background_finalize")
        assert queue.maybe_finalize_async_calls() == []  # without it: fine
    finally:
        queue.close()


@pytest.mark.timeout(120)
def test_manager_start_method_without_a_worker_raises_before_taking_the_root(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as exc:
        CheckpointManager(tmp_path, persistent=False, start_method="forkserver")
    _names_both(exc, "start_method", "persistent")
    with CheckpointManager(tmp_path, persistent=False) as manager:  # the root was not taken
        manager.save(1, {"x": torch.ones(3)}, async_op=False)
        assert manager.steps() == [1]


@pytest.mark.parametrize(
    "given", [{"keep_last": 2}, {"options": SaveOptions()}, {"copy_threads": 2}, {"callback": print}]
)
def test_read_only_manager_with_save_options_raises(tmp_path: Path, given: dict) -> None:
    """A read-only manager never saves nor removes checkpoints: ``keep_last``, save
    options and ``callback`` were ignored."""
    with pytest.raises(ValueError) as exc:
        CheckpointManager(tmp_path, read_only=True, persistent=False, **given)
    _names_both(exc, "read_only", next(iter(given)))
