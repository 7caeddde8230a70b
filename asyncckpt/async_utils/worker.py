"""The worker side of the callers: what runs in a persistent worker or a forked child.

- :func:`_persistent_worker_main`: the persistent worker's main loop (one call after
  the other, results back through a pipe), and how it is started without
  re-importing the training script (:func:`_main_module_hidden`).
- :func:`_temporal_child_main`: a forked child's one call.
- :class:`CallOutcome`: what a call did, sent back pickled.

Torch-free, like :mod:`asyncckpt.async_utils.callers`.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import pickle
import queue
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from asyncckpt import _faults
from asyncckpt.errors import RankFailure

__all__ = ["CallOutcome"]

_HEADER = struct.Struct("<q")
_STOP = -1
_ABORT = -2
_WORKER_NAME = "asyncckpt-worker"
#: Exit status of a persistent worker whose start-up, re-importing the main script,
#: ran that script's code as far as starting a worker again (no ``__main__`` guard).
_NO_MAIN_GUARD_EXIT = 87


class CallOutcome(NamedTuple):
    """What one call did in the background, on this rank.

    Attributes:
        call_idx: the call.
        ok: True if ``async_fn`` returned normally and the process that ran it is
            healthy.
        error: on failure, the cause (a ``str`` subclass: exception type, message,
            remote traceback, or the exit status of a dead process; with the
            exception's type name and errno); else ``None``.
        value: the return value of ``async_fn`` (``None`` on failure).
        started: ``time.monotonic()`` when ``async_fn`` started (system-wide clock,
            comparable across processes on one host), or ``None``.
        finished: ``time.monotonic()`` when it finished, or ``None``.
    """

    call_idx: int
    ok: bool
    error: RankFailure | None
    value: Any = None
    started: float | None = None
    finished: float | None = None


def _format_exception(exc: BaseException, context: str = "") -> RankFailure:
    return RankFailure.from_exception(exc, context)


def _run_call(call_idx: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> CallOutcome:
    started = time.monotonic()
    try:
        value = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - SystemExit from async_fn is a failure too
        return CallOutcome(call_idx, False, _format_exception(exc), None, started, time.monotonic())
    return CallOutcome(call_idx, True, None, value, started, time.monotonic())


def _dump_outcome(outcome: CallOutcome) -> bytes:
    try:
        return pickle.dumps(outcome)
    except Exception as exc:  # noqa: BLE001 - the return value of async_fn is not picklable
        bad = CallOutcome(
            outcome.call_idx,
            False,
            _format_exception(exc, "the return value of async_fn cannot be pickled: "),
            None,
            outcome.started,
            outcome.finished,
        )
        return pickle.dumps(bad)


def _temporal_child_main(
    conn: Any, call_idx: int, fn: Callable[..., Any], args: tuple, kwargs: dict, gc_enabled: bool
) -> None:
    # Forked with the cyclic GC off (TemporalAsyncCaller._schedule): every object this
    # child inherited goes to the permanent generation before it is turned back on, so
    # that it collects only its own garbage, never the trainer's (whose finalizers free
    # the parent's resources, and may wait on a lock that a thread held at the fork).
    gc.freeze()
    if gc_enabled:
        gc.enable()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides about Ctrl-C
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the trainer's inherited handler
    outcome = _run_call(call_idx, fn, args, kwargs)
    conn.send_bytes(_dump_outcome(outcome))
    conn.close()
    _faults.hit("child_exit")  # (its outcome reported: a child that does not exit from here is killed)
    if not outcome.ok:
        os._exit(1)


def _persistent_worker_main(task_conn: Any, result_conn: Any) -> None:
    """Main loop of the persistent worker process.

    Ctrl-C and SIGTERM sent to the whole process group (a terminal, a scheduler's
    preemption notice) are ignored: the training process decides, e.g. to finish a
    last checkpoint. The worker stops on a STOP message (after the calls it has),
    at once on an ABORT message or when the training process is gone (end of file on
    the task pipe), or on SIGKILL.
    """
    _faults.hit("worker_start")  # (where its imports end: a start-up still under way)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tasks: queue.SimpleQueue = queue.SimpleQueue()

    def read_tasks() -> None:
        # Read eagerly so that the trainer never blocks on a full pipe while a long
        # write runs. End of file means the trainer is gone: a write in flight can
        # never be committed, so exit at once, as on ABORT.
        while True:
            try:
                data = task_conn.recv_bytes()
            except (EOFError, OSError):
                os._exit(0)
            call_idx = _HEADER.unpack_from(data)[0]
            if call_idx == _ABORT:
                os._exit(0)
            tasks.put(data)
            if call_idx == _STOP:
                return

    threading.Thread(target=read_tasks, name="asyncckpt-task-reader", daemon=True).start()
    while True:
        data = tasks.get()
        (call_idx,) = _HEADER.unpack_from(data)
        if call_idx == _STOP:
            break
        try:
            fn, args, kwargs = pickle.loads(memoryview(data)[_HEADER.size :])
        except BaseException as exc:  # noqa: BLE001
            outcome = CallOutcome(
                call_idx, False, _format_exception(exc, "the worker could not unpickle the request: ")
            )
        else:
            del data
            outcome = _run_call(call_idx, fn, args, kwargs)
            del fn, args, kwargs
        try:
            result_conn.send_bytes(_dump_outcome(outcome))
        except (BrokenPipeError, OSError):
            os._exit(0)
    result_conn.close()


_main_lock = threading.Lock()


def _exit_if_importing_main_in_worker() -> None:
    """Exit at once if this process is a persistent worker still re-importing the main script.

    A spawned worker with ``import_main=True`` runs the main script as ``__mp_main__``
    before it reads its first call (multiprocessing's bootstrap, where
    ``current_process()._inheriting`` is set). A script without an
    ``if __name__ == "__main__":`` guard then runs its training code in the worker,
    which starts a worker of its own: multiprocessing refuses with its bootstrapping
    ``RuntimeError``. Exit instead, with a status the training process recognizes.
    """
    proc = mp.current_process()
    if getattr(proc, "_inheriting", False) and proc.name == _WORKER_NAME:
        os._exit(_NO_MAIN_GUARD_EXIT)


def _no_main_guard_failure() -> RankFailure:
    main = getattr(sys.modules.get("__main__"), "__file__", None) or "the main module"
    return RankFailure(
        f"the persistent worker could not start: it re-imports {main} (import_main=True), whose "
        "top-level code started a worker again; put the script's code that runs (training, "
        "saving) under 'if __name__ == \"__main__\":'"
    )


@contextlib.contextmanager
def _main_module_hidden() -> Any:
    """Start a spawn child without re-importing the training script as ``__mp_main__``.

    ``multiprocessing.spawn.get_preparation_data`` finds the main module through
    ``__main__.__spec__`` and ``__main__.__file__``; hidden, the child skips it and
    imports only what unpickling the calls needs (our writer imports no torch).
    """
    main = sys.modules.get("__main__")
    with _main_lock:
        saved: dict[str, Any] = {
            k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__
        }
        try:
            if main is not None:
                main.__dict__.pop("__file__", None)
                main.__dict__["__spec__"] = None
            yield
        finally:
            if main is not None:
                main.__dict__.pop("__spec__", None)
                main.__dict__.update(saved)
