"""Single-process tests of the framework layer: request, callers, calls_queue, dist, errors.

Every queue test runs with both callers: ``TemporalAsyncCaller`` (``persistent=False``,
one forked child per call) and ``PersistentAsyncCaller`` (``persistent=True``, one
spawned long-lived worker). Two-rank versions are in ``test_framework_dist.py``.

This module imports no torch at module level (``asyncckpt`` resolves its names lazily):
the persistent worker imports this module to unpickle the async functions below, and
``test_persistent_worker_never_imports_torch`` checks that the worker stays torch-free.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import live_children, new_shm_entries, shm_entries

import asyncckpt
from asyncckpt.async_utils.callers import TERMINATE_GRACE_S, PersistentAsyncCaller, TemporalAsyncCaller
from asyncckpt.async_utils.request import AsyncRequest
from asyncckpt.errors import CheckpointException

TESTS_DIR = Path(__file__).resolve().parent
#: A failed call must be reported within this many seconds (anchor failure 1: hang forever).
FAIL_DEADLINE_S = 10.0


# --------------------------------------------------------------------------- async functions
# Module level, so that the persistent worker can unpickle them by name.
def echo(*args, **kwargs):
    return args, kwargs


def sleep_then_return(seconds, value):
    time.sleep(seconds)
    return value


def return_pid():
    return os.getpid()


def torch_is_imported():
    return "torch" in sys.modules


def raise_value_error(message):
    raise ValueError(message)


def kill_self_with_sigkill():
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)


def exit_with_code_3():
    os._exit(3)


def _exit_soon(code, delay):
    time.sleep(delay)
    os._exit(code)


def succeed_then_exit_nonzero(code=5, delay=0.3):
    """Return normally, then let a non-daemon thread kill the process with ``code``."""
    threading.Thread(target=_exit_soon, args=(code, delay), daemon=False).start()
    return os.getpid()


def _write_pid(marker):
    tmp = f"{marker}.tmp"
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, marker)


def ignore_sigterm_and_sleep(seconds, marker):
    """Ignore SIGTERM, then write this process's pid to ``marker`` and sleep."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _write_pid(marker)
    time.sleep(seconds)


def mark_and_sleep(seconds, marker):
    _write_pid(marker)
    time.sleep(seconds)


def return_a_lock():
    return threading.Lock()  # cannot be pickled back to the trainer


def preload_staged():
    return "staged"


def preload_raises():
    raise RuntimeError("preload-bad")


# --------------------------------------------------------------------------- helpers
def record_result(queue, call_idx, into):
    """A finalize function: append ``(call_idx, queue.get_result(call_idx))`` to ``into``."""
    into.append((call_idx, queue.get_result(call_idx)))


def process_gone(pid, timeout=5.0):
    """True once ``pid`` does not exist (or is a zombie), waiting up to ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def wait_for_file(path, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.02)
    return Path(path).read_text()


@pytest.fixture(params=[False, True], ids=["temporal", "persistent"])
def persistent(request):
    return request.param


@pytest.fixture
def make_queue(persistent):
    """Make AsyncCallsQueues with the parametrized caller; all are aborted at teardown."""
    queues = []

    def make(**kwargs):
        q = asyncckpt.AsyncCallsQueue(persistent=persistent, **kwargs)
        queues.append(q)
        return q

    yield make
    for q in queues:
        q.close(abort=True)


# --------------------------------------------------------------------------- AsyncRequest
@pytest.mark.timeout(10)
def test_async_request_is_a_namedtuple_with_megatron_fields_and_defaults():
    assert AsyncRequest._fields == (
        "async_fn",
        "async_fn_args",
        "finalize_fns",
        "async_fn_kwargs",
        "preload_fn",
        "is_frozen",
        "call_idx",
    )
    req = AsyncRequest(echo)
    assert isinstance(req, tuple)
    assert req.async_fn is echo
    assert req.async_fn_args == ()
    assert list(req.finalize_fns) == []
    assert req.async_fn_kwargs is None
    assert req.preload_fn is None
    assert req.is_frozen is False
    assert req.call_idx == 0

    fin = lambda: None  # noqa: E731
    full = AsyncRequest(echo, (1, 2), [fin], {"k": 3}, preload_staged, False, 7)
    assert tuple(full) == (echo, (1, 2), [fin], {"k": 3}, preload_staged, False, 7)
    assert full._replace(call_idx=8).call_idx == 8
    assert type(full._replace(call_idx=8)) is AsyncRequest


@pytest.mark.timeout(10)
def test_async_request_add_finalize_fn_and_freeze():
    calls: list[Any] = []
    first = functools.partial(calls.append, "first")
    second = functools.partial(calls.append, "second")
    req = AsyncRequest(echo, finalize_fns=(first,))
    req.add_finalize_fn(second)
    assert list(req.finalize_fns) == [first, second]

    frozen = req.freeze()
    assert frozen.is_frozen is True
    assert tuple(frozen.finalize_fns) == (first, second)
    with pytest.raises(RuntimeError):
        frozen.add_finalize_fn(first)
    assert tuple(frozen.finalize_fns) == (first, second)
    with pytest.raises(RuntimeError):
        AsyncRequest(echo, is_frozen=True).add_finalize_fn(first)
    # freeze() returns a frozen copy: appending to the original does not change it
    req.add_finalize_fn(first)
    assert tuple(frozen.finalize_fns) == (first, second)


@pytest.mark.timeout(10)
def test_async_request_execute_sync_passes_preload_result_first():
    order: list[Any] = []
    req = AsyncRequest(echo, (1, 2), [functools.partial(order.append, "fin1")], {"k": 3}, preload_staged)
    req.add_finalize_fn(functools.partial(order.append, "fin2"))
    assert req.execute_sync() == (("staged", 1, 2), {"k": 3})
    assert order == ["fin1", "fin2"]
    assert AsyncRequest(echo).execute_sync() == ((), {})
    with pytest.raises(RuntimeError, match="preload-bad"):
        AsyncRequest(echo, preload_fn=preload_raises).execute_sync()


# --------------------------------------------------------------------------- scheduling, results
@pytest.mark.timeout(30)
def test_schedule_passes_preload_result_args_and_kwargs(make_queue):
    import torch.distributed as dist

    q = make_queue()
    assert not dist.is_initialized()
    assert (q.sync.rank, q.sync.world_size, q.sync.active) == (0, 1, False)
    got: list[Any] = []
    req = AsyncRequest(echo, (1, 2), async_fn_kwargs={"k": 3}, preload_fn=preload_staged)
    req.add_finalize_fn(functools.partial(record_result, q, 0, got))
    assert q.schedule_async_request(req) == 0
    assert q.schedule_async_request(AsyncRequest(echo, finalize_fns=[functools.partial(record_result, q, 1, got)])) == 1
    assert q.maybe_finalize_async_calls(blocking=True) == [0, 1]
    assert got == [(0, (("staged", 1, 2), {"k": 3})), (1, ((), {}))]
    # the caller's request is not frozen by scheduling (the queue keeps a frozen copy)
    assert req.is_frozen is False and req.call_idx == 0
    with pytest.raises(KeyError):
        q.get_result(0)  # results are available only while finalize_fns run
    q.close()


@pytest.mark.timeout(30)
def test_results_are_keyed_by_call_idx_and_finalized_in_order(make_queue, persistent):
    q = make_queue()
    got: list[Any] = []
    durations = [0.8, 0.05, 1.0]
    for i, seconds in enumerate(durations):
        req = AsyncRequest(
            sleep_then_return, (seconds, f"value-{i}"), finalize_fns=[functools.partial(record_result, q, i, got)]
        )
        assert q.schedule_async_request(req) == i
    assert q.get_num_unfinalized_calls() == 3
    assert q.wait_local(1, timeout=20)
    early = q.maybe_finalize_async_calls()
    if persistent:  # calls run one after the other: call 0 is done when call 1 is
        assert early == [0, 1]
    else:  # children run side by side: call 1 is done but call 0 is not, and 0 goes first
        assert early == []
    finalized = early + q.maybe_finalize_async_calls(blocking=True)
    assert finalized == [0, 1, 2]
    assert got == [(0, "value-0"), (1, "value-1"), (2, "value-2")]
    assert q.get_num_unfinalized_calls() == 0
    q.close()


@pytest.mark.timeout(30)
def test_nonblocking_finalize_returns_nothing_while_a_call_runs(make_queue):
    q = make_queue()
    ran: list[Any] = []
    q.schedule_async_request(
        AsyncRequest(sleep_then_return, (1.5, "late"), finalize_fns=[functools.partial(ran.append, 0)])
    )
    t0 = time.monotonic()
    assert q.maybe_finalize_async_calls() == []
    assert q.maybe_finalize_async_calls(blocking=False, no_dist=True) == []
    assert time.monotonic() - t0 < 1.0, "a non-blocking finalize waited"
    assert q.get_num_unfinalized_calls() == 1 and q.is_pending(0)
    assert ran == []
    assert q.maybe_finalize_async_calls(blocking=True) == [0]
    assert ran == [0]
    assert q.get_num_unfinalized_calls() == 0 and not q.is_pending(0)
    q.close()


@pytest.mark.timeout(30)
def test_until_limits_finalization_and_num_unfinalized_calls(make_queue):
    q = make_queue()
    got: list[Any] = []
    for i in range(3):
        q.schedule_async_request(
            AsyncRequest(sleep_then_return, (0.05, i), finalize_fns=[functools.partial(record_result, q, i, got)])
        )
    assert q.get_num_unfinalized_calls() == 3
    assert q.maybe_finalize_async_calls(blocking=True, until=1) == [0, 1]
    assert got == [(0, 0), (1, 1)]
    assert q.get_num_unfinalized_calls() == 1 and q.is_pending(2)
    assert q.maybe_finalize_async_calls(blocking=True, until=1) == []
    assert q.maybe_finalize_async_calls(blocking=True, no_dist=True) == [2]
    assert got[-1] == (2, 2)
    assert q.get_num_unfinalized_calls() == 0
    assert q.maybe_finalize_async_calls(blocking=True) == []
    q.close()


@pytest.mark.timeout(30)
def test_persistent_worker_never_imports_torch():
    q = asyncckpt.AsyncCallsQueue(persistent=True)
    try:
        assert "torch" in sys.modules  # the check means something only if the trainer has torch
        got: list[Any] = []
        q.schedule_async_request(
            AsyncRequest(torch_is_imported, finalize_fns=[functools.partial(record_result, q, 0, got)])
        )
        assert q.maybe_finalize_async_calls(blocking=True) == [0]
        assert got == [(0, False)], "the persistent worker imported torch for a torch-free async_fn"
        q.close()
    finally:
        q.close(abort=True)


# --------------------------------------------------------------------------- failures
FAILURES = {
    # mode: (request factory, texts expected in the cause, whether the persistent worker dies)
    "raises": (
        lambda: AsyncRequest(raise_value_error, ("boom-raise",)),
        ["ValueError: boom-raise", "Traceback", "raise_value_error"],
        False,
    ),
    "sigkill": (lambda: AsyncRequest(kill_self_with_sigkill), ["SIGKILL"], True),
    "exit3": (lambda: AsyncRequest(exit_with_code_3), ["exited with code 3"], True),
    "preload_raises": (
        lambda: AsyncRequest(echo, preload_fn=preload_raises),
        ["preload_fn", "RuntimeError: preload-bad", "Traceback"],
        False,
    ),
}


@pytest.mark.timeout(40)
@pytest.mark.parametrize("mode", sorted(FAILURES))
def test_failed_call_raises_checkpoint_exception_and_next_call_works(make_queue, persistent, mode):
    make_request, expected, worker_dies = FAILURES[mode]
    q = make_queue()
    got: list[Any] = []
    q.schedule_async_request(AsyncRequest(return_pid, finalize_fns=[functools.partial(record_result, q, 0, got)]))
    assert q.maybe_finalize_async_calls(blocking=True) == [0]
    pid_before = got[0][1]
    starts_before = q.caller.num_starts if persistent else None

    failed_finalize: list[Any] = []
    req = make_request()
    req.add_finalize_fn(functools.partial(failed_finalize.append, 1))
    t0 = time.monotonic()
    assert q.schedule_async_request(req) == 1
    with pytest.raises(CheckpointException) as info:
        q.maybe_finalize_async_calls(blocking=True)
    elapsed = time.monotonic() - t0
    assert elapsed < FAIL_DEADLINE_S, f"failure reported after {elapsed:.1f} s"
    exc = info.value
    assert exc.call_idx == 1
    assert list(exc.failures) == [0]
    for text in expected:
        assert text in exc.failures[0], exc.failures[0]
        assert text in str(exc)
    assert failed_finalize == [], "finalize_fns of a failed call ran"
    assert q.get_failure(1) is exc
    assert q.get_num_unfinalized_calls() == 0 and not q.is_pending(1)

    # The next request works and its finalize gets its own result.
    q.schedule_async_request(AsyncRequest(return_pid, finalize_fns=[functools.partial(record_result, q, 2, got)]))
    assert q.maybe_finalize_async_calls(blocking=True) == [2]
    assert got[-1][0] == 2
    pid_after = got[-1][1]
    assert isinstance(pid_after, int)
    if persistent:
        assert starts_before is not None  # read above for a persistent queue
        if worker_dies:
            assert q.caller.num_starts == starts_before + 1
            assert pid_after != pid_before
        else:
            assert q.caller.num_starts == starts_before
            assert pid_after == pid_before
        assert q.caller.worker_pid == pid_after
    q.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["raises", "sigkill"])
def test_failure_is_reported_by_nonblocking_polls(make_queue, mode):
    make_request, expected, _ = FAILURES[mode]
    q = make_queue()
    ran: list[Any] = []
    req = make_request()
    req.add_finalize_fn(functools.partial(ran.append, 0))
    q.schedule_async_request(req)
    t0 = time.monotonic()
    while True:
        try:
            assert q.maybe_finalize_async_calls() == []
        except CheckpointException as exc:
            assert exc.call_idx == 0 and list(exc.failures) == [0]
            assert all(text in exc.failures[0] for text in expected), exc.failures
            break
        assert time.monotonic() - t0 < FAIL_DEADLINE_S, "the failure was never reported"
        time.sleep(0.02)
    assert ran == []
    assert q.get_num_unfinalized_calls() == 0
    q.close()


def _slow_finalize(started: threading.Event, done: list) -> None:
    started.set()
    time.sleep(0.5)  # the commit of a large checkpoint
    done.append(True)


@pytest.mark.timeout(30)
def test_background_blocking_poll_waits_for_finalize_fns_that_run(make_queue):
    """Background finalize: a call whose finalize_fns (the commit) run is still pending:
    a blocking poll waits for them and reports the call; ``is_pending`` and
    ``get_num_unfinalized_calls`` count it. Before the fix the call was, while it was
    being committed, neither pending nor reported, and the poll returned ``[]``."""
    q = make_queue(background_finalize=True)
    q.start()
    started, done = threading.Event(), list[Any]()
    idx = q.schedule_async_request(
        AsyncRequest(echo, ("ok",), finalize_fns=[functools.partial(_slow_finalize, started, done)])
    )
    assert started.wait(timeout=FAIL_DEADLINE_S)
    assert q.is_pending(idx) and q.get_num_unfinalized_calls() == 1
    assert q.maybe_finalize_async_calls(blocking=True) == [idx]
    assert done == [True] and not q.is_pending(idx) and q.get_num_unfinalized_calls() == 0
    q.close()


@pytest.mark.timeout(30)
def test_background_blocking_poll_raises_a_failure_behind_finalized_calls(make_queue):
    """Background finalize: a blocking poll raises a failed call even when calls
    finalized before it are reported in the same poll (they are finalized: their
    finalize_fns ran); left to "the next poll", the failure could be lost at the end of
    training. A non-blocking poll returns the finalized calls first."""
    q = make_queue(background_finalize=True)
    q.start()
    for blocking in (True, False):
        ran: list[Any] = []
        ok = q.schedule_async_request(AsyncRequest(echo, ("ok",), finalize_fns=[functools.partial(ran.append, 1)]))
        bad = q.schedule_async_request(FAILURES["raises"][0]())
        if blocking:
            with pytest.raises(CheckpointException) as info:
                q.maybe_finalize_async_calls(blocking=True)
        else:
            deadline = time.monotonic() + FAIL_DEADLINE_S
            while q.is_pending(bad) and time.monotonic() < deadline:
                time.sleep(0.01)  # settled by the finalizer thread, not reported
            assert q.maybe_finalize_async_calls() == [ok]
            with pytest.raises(CheckpointException) as info:
                q.maybe_finalize_async_calls()
        assert info.value.call_idx == bad and "boom-raise" in info.value.failures[0]
        assert ran == [1]
        assert q.maybe_finalize_async_calls(blocking=True) == []
    q.close()


@pytest.mark.timeout(30)
def test_temporal_child_exiting_nonzero_after_reporting_success_is_a_failure():
    q = asyncckpt.AsyncCallsQueue(persistent=False)
    try:
        ran: list[Any] = []
        q.schedule_async_request(
            AsyncRequest(succeed_then_exit_nonzero, (5, 0.3), finalize_fns=[functools.partial(ran.append, 0)])
        )
        t0 = time.monotonic()
        with pytest.raises(CheckpointException) as info:
            q.maybe_finalize_async_calls(blocking=True)
        assert time.monotonic() - t0 < FAIL_DEADLINE_S
        assert info.value.call_idx == 0 and list(info.value.failures) == [0]
        assert "exited with code 5" in info.value.failures[0]
        assert ran == [], "a forked child that exited non-zero was finalized as a success"
        got: list[Any] = []
        q.schedule_async_request(
            AsyncRequest(echo, ("next",), finalize_fns=[functools.partial(record_result, q, 1, got)])
        )
        assert q.maybe_finalize_async_calls(blocking=True) == [1]
        assert got == [(1, (("next",), {}))]
        q.close()
    finally:
        q.close(abort=True)


@pytest.mark.timeout(30)
def test_persistent_worker_dying_between_calls_is_restarted():
    q = asyncckpt.AsyncCallsQueue(persistent=True)
    try:
        assert isinstance(q.caller, asyncckpt.PersistentAsyncCaller)  # persistent=True
        got: list[Any] = []
        q.schedule_async_request(
            AsyncRequest(
                succeed_then_exit_nonzero, (5, 0.3), finalize_fns=[functools.partial(record_result, q, 0, got)]
            )
        )
        assert q.maybe_finalize_async_calls(blocking=True) == [0]  # it returned before dying
        first_pid = got[0][1]
        deadline = time.monotonic() + FAIL_DEADLINE_S
        while q.caller.worker_pid is not None:
            assert time.monotonic() < deadline, "the worker did not exit"
            time.sleep(0.02)
        q.schedule_async_request(AsyncRequest(return_pid, finalize_fns=[functools.partial(record_result, q, 1, got)]))
        assert q.maybe_finalize_async_calls(blocking=True) == [1]
        assert got[1][0] == 1 and got[1][1] != first_pid
        assert q.caller.num_starts == 2
        q.close()
    finally:
        q.close(abort=True)


@pytest.mark.timeout(40)
def test_results_match_call_idx_across_a_failure(make_queue):
    q = make_queue()
    got: list[Any] = []
    plan: list[tuple[Callable[..., Any], tuple]] = [
        (sleep_then_return, (0.3, "a")),
        (raise_value_error, ("middle",)),
        (sleep_then_return, (0.05, "c")),
    ]
    for i, (fn, args) in enumerate(plan):
        q.schedule_async_request(AsyncRequest(fn, args, finalize_fns=[functools.partial(record_result, q, i, got)]))
    with pytest.raises(CheckpointException) as info:
        q.maybe_finalize_async_calls(blocking=True)
    assert info.value.call_idx == 1 and "ValueError: middle" in info.value.failures[0]
    assert got == [(0, "a")]  # call 0 was finalized before call 1 raised
    assert q.get_num_unfinalized_calls() == 1 and q.is_pending(2)
    assert q.maybe_finalize_async_calls(blocking=True) == [2]
    assert got == [(0, "a"), (2, "c")]
    q.schedule_async_request(
        AsyncRequest(sleep_then_return, (0.0, "d"), finalize_fns=[functools.partial(record_result, q, 3, got)])
    )
    assert q.maybe_finalize_async_calls(blocking=True) == [3]
    assert got[-1] == (3, "d")
    q.close()


@pytest.mark.timeout(30)
def test_unpicklable_request_or_result_fails_the_call_not_the_schedule(make_queue, persistent):
    q = make_queue()
    ran: list[Any] = []
    local = []
    # A lambda runs in a forked child but cannot be sent to the persistent worker.
    q.schedule_async_request(
        AsyncRequest(
            lambda: local.append(1) or "lambda ran",  # type: ignore[func-returns-value]
            finalize_fns=[functools.partial(record_result, q, 0, ran)],
        )
    )
    if persistent:
        with pytest.raises(CheckpointException, match="cannot be pickled") as info:
            q.maybe_finalize_async_calls(blocking=True)
        assert info.value.call_idx == 0 and ran == []
    else:
        assert q.maybe_finalize_async_calls(blocking=True) == [0]
        assert ran == [(0, "lambda ran")] and local == []  # it ran in the child, not here
    q.schedule_async_request(AsyncRequest(return_a_lock, finalize_fns=[functools.partial(ran.append, "lock")]))
    with pytest.raises(CheckpointException, match="cannot be pickled") as info:
        q.maybe_finalize_async_calls(blocking=True)
    assert info.value.call_idx == 1 and "lock" not in ran
    # a request without async_fn only runs its finalize_fns
    q.schedule_async_request(AsyncRequest(None, finalize_fns=[functools.partial(record_result, q, 2, ran)]))
    assert q.maybe_finalize_async_calls() == [2]
    assert ran[-1] == (2, None)
    q.close()


# --------------------------------------------------------------------------- close
@pytest.mark.timeout(30)
def test_close_finalizes_pending_calls_then_stops_the_worker(make_queue, persistent):
    q = make_queue()
    got: list[Any] = []
    for i in range(2):
        q.schedule_async_request(
            AsyncRequest(sleep_then_return, (0.3, f"v{i}"), finalize_fns=[functools.partial(record_result, q, i, got)])
        )
    q.close()
    assert got == [(0, "v0"), (1, "v1")]
    assert q.closed and q.get_num_unfinalized_calls() == 0
    if persistent:
        assert q.caller.worker_pid is None
    assert live_children() == []
    with pytest.raises(RuntimeError):
        q.schedule_async_request(AsyncRequest(echo))
    q.close()  # idempotent
    q.close(abort=True)  # abort after close does nothing
    assert got == [(0, "v0"), (1, "v1")]


@pytest.mark.timeout(30)
def test_close_raises_the_failure_of_a_pending_call_and_still_stops(make_queue, persistent):
    q = make_queue()
    got: list[Any] = []
    q.schedule_async_request(
        AsyncRequest(raise_value_error, ("at-close",), finalize_fns=[functools.partial(got.append, 0)])
    )
    q.schedule_async_request(AsyncRequest(echo, ("after",), finalize_fns=[functools.partial(record_result, q, 1, got)]))
    with pytest.raises(CheckpointException, match="at-close") as info:
        q.close()
    assert info.value.call_idx == 0
    assert got == [(1, (("after",), {}))]  # the remaining call is still finalized
    assert q.closed and q.get_num_unfinalized_calls() == 0
    if persistent:
        assert q.caller.worker_pid is None
    assert live_children() == []
    q.close()


@pytest.mark.timeout(40)
@pytest.mark.parametrize("ignore_sigterm", [False, True], ids=["plain", "ignores_sigterm"])
def test_close_abort_kills_the_worker_and_drops_pending_calls(make_queue, persistent, ignore_sigterm, tmp_path):
    """Two calls in flight (side by side in forked children; one running and one queued in
    the persistent worker): abort kills what runs within one grace period, even if it
    ignores SIGTERM, finalizes nothing and leaves no process or /dev/shm entry."""
    shm_before = shm_entries()
    q = make_queue()
    ran: list[Any] = []
    markers = [str(tmp_path / f"started-{i}") for i in range(2)]
    fn = ignore_sigterm_and_sleep if ignore_sigterm else mark_and_sleep
    for i, marker in enumerate(markers):
        q.schedule_async_request(AsyncRequest(fn, (60, marker), finalize_fns=[functools.partial(ran.append, i)]))
    # Wait until the calls run (and, if asked, already ignore SIGTERM).
    pids = [int(wait_for_file(m)) for m in (markers[:1] if persistent else markers)]
    assert q.maybe_finalize_async_calls() == []
    t0 = time.monotonic()
    q.close(abort=True)
    elapsed = time.monotonic() - t0
    limit = TERMINATE_GRACE_S + 2.0 if ignore_sigterm else TERMINATE_GRACE_S
    assert elapsed < limit, (
        f"close(abort=True) took {elapsed:.1f} s to stop {len(pids)} process(es) (grace period {TERMINATE_GRACE_S} s)"
    )
    for pid in pids:
        assert process_gone(pid, timeout=0.5), f"process {pid} that ran async_fn survived close(abort=True)"
    assert ran == [], "close(abort=True) finalized a call"
    assert q.closed and q.get_num_unfinalized_calls() == 0
    if persistent:
        assert q.caller.worker_pid is None
    assert live_children() == []
    assert new_shm_entries(shm_before) == set()
    q.close(abort=True)  # idempotent
    q.close()
    assert ran == []


@pytest.mark.timeout(30)
def test_context_manager_closes_and_aborts_on_error(persistent):
    got: list[Any] = []
    with asyncckpt.AsyncCallsQueue(persistent=persistent) as q:
        q.schedule_async_request(
            AsyncRequest(echo, ("ok",), finalize_fns=[functools.partial(record_result, q, 0, got)])
        )
    assert q.closed and got == [(0, (("ok",), {}))]

    ran: list[Any] = []
    with pytest.raises(KeyError):
        with asyncckpt.AsyncCallsQueue(persistent=persistent) as q2:
            q2.schedule_async_request(
                AsyncRequest(sleep_then_return, (60, "x"), finalize_fns=[functools.partial(ran.append, 0)])
            )
            raise KeyError("training failed")
    assert q2.closed and ran == []
    assert live_children() == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("caller_cls", [TemporalAsyncCaller, PersistentAsyncCaller], ids=["temporal", "persistent"])
def test_caller_close_keeps_the_outcome_of_a_finished_call(caller_cls):
    """Used on its own (as Megatron users do), close() without abort waits for the calls and
    keeps their outcomes: a call that succeeded must not be reported as failed."""
    caller = caller_cls()
    try:
        caller.schedule(0, echo, (1,), {"k": 2})
        caller.close()
        outcome = caller.outcome(0)
        assert outcome is not None, "the outcome of a finished call was lost by close()"
        assert outcome.ok, outcome.error
        assert outcome.value == ((1,), {"k": 2})
        assert live_children() == []
    finally:
        caller.close(abort=True)


# --------------------------------------------------------------------------- interpreter exit
EXIT_SCRIPT = """\
import os, sys, time
sys.path.insert(0, {tests_dir!r})
from asyncckpt.async_utils.calls_queue import AsyncCallsQueue
from asyncckpt.async_utils.request import AsyncRequest
import test_framework

if __name__ == "__main__":  # the spawned worker re-imports this script as __mp_main__
    marker = {marker!r}
    q = AsyncCallsQueue(persistent={persistent!r})
    q.schedule_async_request(AsyncRequest(test_framework.ignore_sigterm_and_sleep, (60, marker)))
    deadline = time.monotonic() + 30
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.02)
    print(open(marker).read(), time.monotonic(), flush=True)
    # no close(): the interpreter exits with the call in flight
"""


@pytest.mark.timeout(60)
def test_interpreter_exit_without_close_stops_the_worker(persistent, tmp_path):
    marker = str(tmp_path / "worker.pid")
    script = tmp_path / "exit_without_close.py"
    script.write_text(EXIT_SCRIPT.format(tests_dir=str(TESTS_DIR), marker=marker, persistent=persistent))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    worker_pid = None
    try:
        out, err = proc.communicate(timeout=45)
        t_end = time.monotonic()
        assert proc.returncode == 0, err
        pid_text, t_printed = out.split()
        worker_pid = int(pid_text)
        assert worker_pid != proc.pid
        exit_s = t_end - float(t_printed)
        assert exit_s < 6.0, f"the script took {exit_s:.1f} s to exit"
        assert process_gone(worker_pid, timeout=5.0), f"worker {worker_pid} outlived the script"
    finally:
        if proc.poll() is None:
            from helpers import kill_session  # here: this module is imported by the torch-free worker

            kill_session(proc)
        if worker_pid is not None and not process_gone(worker_pid, timeout=0):
            os.kill(worker_pid, signal.SIGKILL)


# --------------------------------------------------------------------------- races
def _slow_is_alive(monkeypatch, delay=1.0):
    """Make every ``multiprocessing`` process's ``is_alive()`` answer ``delay`` s late, as
    if the trainer were descheduled between its checks (the fault; undone by ``monkeypatch``)."""
    from multiprocessing.process import BaseProcess

    original = BaseProcess.is_alive

    def is_alive(self):
        time.sleep(delay)
        return original(self)

    monkeypatch.setattr(BaseProcess, "is_alive", is_alive)


@pytest.mark.timeout(30)
def test_result_sent_just_before_the_process_exits_is_not_lost(make_queue, persistent, monkeypatch):
    """A result that arrives between the check of the result pipe and the liveness check
    (the trainer was descheduled there, simulated by a slow ``is_alive``) must still
    count: a call that succeeded is never failed because its process exited right after
    reporting (the temporal child always does; here the persistent worker dies in the
    next call)."""
    q = make_queue()
    got: list[Any] = []
    if persistent:  # a warm worker, so that call 0 starts at once
        q.schedule_async_request(AsyncRequest(return_pid))
        assert q.maybe_finalize_async_calls(blocking=True) == [0]
    idx = 1 if persistent else 0
    assert (
        q.schedule_async_request(
            AsyncRequest(sleep_then_return, (0.3, "ok"), finalize_fns=[functools.partial(record_result, q, idx, got)])
        )
        == idx
    )
    if persistent:
        q.schedule_async_request(AsyncRequest(kill_self_with_sigkill))  # the worker dies after call 1
    _slow_is_alive(monkeypatch)
    try:
        finalized = q.maybe_finalize_async_calls(blocking=True, until=idx)
    except CheckpointException as exc:
        pytest.fail(f"a call that succeeded was reported as failed: {exc}")
    assert finalized == [idx] and got == [(idx, "ok")]
    monkeypatch.undo()
    if persistent:
        with pytest.raises(CheckpointException) as info:
            q.maybe_finalize_async_calls(blocking=True)
        assert info.value.call_idx == idx + 1 and "SIGKILL" in info.value.failures[0]
    q.close()


# --------------------------------------------------------------------------- worker signals / main
MAIN_SCRIPT = """\
import os, sys
sys.path.insert(0, {tests_dir!r})
import test_framework
from asyncckpt.async_utils.calls_queue import AsyncCallsQueue
from asyncckpt.async_utils.request import AsyncRequest

print("main module executed in pid", os.getpid(), flush=True)
if __name__ == "__main__":
    for import_main in (True, False):
        q = AsyncCallsQueue(persistent=True, import_main=import_main)
        seen = []
        q.schedule_async_request(AsyncRequest(test_framework.main_module_file, (),
                                 [lambda: seen.append(q.get_result(0))]))
        q.close()
        print("import_main", import_main, "worker saw", seen[0], flush=True)
"""


def main_module_file():
    main = sys.modules.get("__mp_main__") or sys.modules.get("__main__")
    return getattr(main, "__file__", None)


@pytest.mark.timeout(60)
def test_import_main_false_keeps_the_training_script_out_of_the_worker(tmp_path):
    script = tmp_path / "train_like.py"
    script.write_text(MAIN_SCRIPT.format(tests_dir=str(TESTS_DIR)))
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=50,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    # The script ran once in the trainer, once more in the import_main=True worker only.
    assert sum("main module executed" in line for line in lines) == 2, out.stdout
    assert f"import_main True worker saw {script}" in out.stdout
    assert "import_main False worker saw None" in out.stdout


@pytest.mark.timeout(60)
def test_persistent_worker_ignores_group_sigterm_but_abort_stops_it_fast(tmp_path):
    marker = str(tmp_path / "pid")
    q = asyncckpt.AsyncCallsQueue(persistent=True)
    try:
        assert isinstance(q.caller, asyncckpt.PersistentAsyncCaller)  # persistent=True
        q.schedule_async_request(AsyncRequest(mark_and_sleep, (1.0, marker)))
        wait_for_file(marker)
        pid = q.caller.worker_pid
        assert pid is not None  # the worker runs the call
        os.kill(pid, signal.SIGTERM)  # as a scheduler's notice to the whole process group would
        assert q.maybe_finalize_async_calls(blocking=True) == [0], "the write must survive SIGTERM"
        assert q.caller.worker_pid == pid
        q.schedule_async_request(AsyncRequest(ignore_sigterm_and_sleep, (60, marker + "2")))
        wait_for_file(marker + "2")
        t = time.monotonic()
        q.close(abort=True)
        assert time.monotonic() - t < TERMINATE_GRACE_S, "abort must not wait for the grace period"
        assert process_gone(pid, timeout=5.0)
    finally:
        q.close(abort=True)


@pytest.mark.timeout(60)
def test_temporal_child_does_not_inherit_the_trainers_sigterm_handler(tmp_path):
    marker = str(tmp_path / "pid")
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # a trainer's "stop" flag handler
    q = asyncckpt.AsyncCallsQueue(persistent=False)
    try:
        q.schedule_async_request(AsyncRequest(mark_and_sleep, (30, marker)))
        wait_for_file(marker)
        t = time.monotonic()
        q.close(abort=True)
        assert time.monotonic() - t < TERMINATE_GRACE_S, "the child must die on SIGTERM, not wait for SIGKILL"
    finally:
        signal.signal(signal.SIGTERM, previous)
        q.close(abort=True)


class _GarbageWithFinalizer:
    """A reference cycle whose ``__del__`` records the pid of the process that ran it."""

    def __init__(self, path):
        self.path = path
        self.cycle = self

    def __del__(self):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


def allocate_containers(n):
    """Make ``n`` short-lived dicts, which starts the cyclic GC if it is enabled; then
    report whether it is enabled and whether this process's GC is frozen."""
    import gc

    keep: dict[str, Any] | None = None
    for i in range(n):
        keep = {"i": i, "prev": keep} if i % 1000 else None
    return os.getpid(), gc.isenabled(), gc.get_freeze_count() > 0


@pytest.mark.timeout(30)
def test_temporal_child_never_runs_finalizers_of_the_parents_garbage(tmp_path):
    """The forked child must not collect the trainer's garbage: its finalizers (a CUDA or
    pinned-memory free, a socket's or a store's destructor) belong to the parent, and
    running them in a child forked from a multi-threaded process can deadlock it on a
    lock another thread held at the fork. The child's own garbage is still collected."""
    import gc

    marker = tmp_path / "finalized-by"
    q = asyncckpt.AsyncCallsQueue(persistent=False)
    try:
        gc.collect()  # empty generations, so that the parent does not collect it first
        _GarbageWithFinalizer(str(marker))  # garbage in generation 0 at the fork
        got: list[Any] = []
        q.schedule_async_request(
            AsyncRequest(allocate_containers, (200_000,), finalize_fns=[functools.partial(record_result, q, 0, got)])
        )
        assert gc.isenabled(), "the parent's GC must stay enabled"
        assert q.maybe_finalize_async_calls(blocking=True) == [0]
        child_pid, child_gc_enabled, child_frozen = got[0][1]
        assert child_pid != os.getpid()
        assert child_gc_enabled and child_frozen  # it collects its own garbage, not ours
        gc.collect()
        pids = marker.read_text().split() if marker.exists() else []
        assert pids == [str(os.getpid())], f"finalized in {pids} (child {child_pid}, parent {os.getpid()})"
        q.close()
    finally:
        q.close(abort=True)
