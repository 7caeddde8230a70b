"""Background callers: where ``async_fn`` runs.

Two implementations with Megatron-core's names and shape
(``dist_checkpointing.strategies.async_utils``), without its failure modes:

- :class:`TemporalAsyncCaller` forks one child process per call. The child sees a
  copy-on-write snapshot of the training process taken at schedule time. A child
  that exits non-zero, or exits without reporting a result, is a failure.
- :class:`PersistentAsyncCaller` runs one long-lived worker process, started with
  ``spawn`` (default) or ``forkserver``, and feeds it through one-way pipes. Every
  wait also watches the worker's sentinel: a worker that dies fails its in-flight
  calls (never a hang) and a new worker is started for the next call.

Results are keyed by ``call_idx``, never by position. This module does not import
torch, so a persistent worker that runs torch-free ``async_fn`` s starts in tens of
milliseconds and never initializes CUDA.
"""

from __future__ import annotations

import abc
import gc
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from asyncckpt.async_utils.processes import TERMINATE_GRACE_S
from asyncckpt.async_utils.processes import terminate as _terminate
from asyncckpt.async_utils.processes import terminate_many as _terminate_many
from asyncckpt.async_utils.processes import track as _track
from asyncckpt.async_utils.processes import untrack as _untrack
from asyncckpt.async_utils.worker import (
    _ABORT,
    _HEADER,
    _NO_MAIN_GUARD_EXIT,
    _STOP,
    _WORKER_NAME,
    CallOutcome,
    _exit_if_importing_main_in_worker,
    _format_exception,
    _main_module_hidden,
    _no_main_guard_failure,
    _persistent_worker_main,
    _temporal_child_main,
)
from asyncckpt.errors import InvalidArgumentError, RankFailure

_log = logging.getLogger("asyncckpt")

__all__ = ["AsyncCaller", "CallOutcome", "PersistentAsyncCaller", "TemporalAsyncCaller", "TERMINATE_GRACE_S"]

#: Longest single wait on a worker's pipe and sentinel in :meth:`AsyncCaller.wait`.
WAIT_SLICE_S = 0.05

#: Seconds a forked child (:class:`TemporalAsyncCaller`) may take to exit once it
#: reported its outcome (its work done: written, fsynced) before it is killed and its
#: outcome taken; ``ASYNCCKPT_CHILD_EXIT_GRACE_S`` overrides it.
CHILD_EXIT_GRACE_S = 30.0


def _child_exit_grace_s() -> float:
    try:
        return float(os.environ.get("ASYNCCKPT_CHILD_EXIT_GRACE_S", CHILD_EXIT_GRACE_S))
    except ValueError:
        return CHILD_EXIT_GRACE_S


def _describe_exit(pid: int | None, exitcode: int | None) -> str:
    if exitcode is None:
        return f"process {pid} is gone"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"process {pid} was killed by {name}"
    return f"process {pid} exited with code {exitcode}"


def _wait_handles(handles: list[Any], timeout: float | None) -> None:
    """Wait until one of ``handles`` (connections, sentinels) is ready, or ``timeout`` s.

    Another thread may close a connection meanwhile (a dead worker's pipes): that ends
    the wait, as readiness would; the caller then polls under its lock.
    """
    if not handles:
        return
    try:
        mp_connection.wait(handles, timeout)
    except (OSError, ValueError):
        pass


# --------------------------------------------------------------------------- base
class AsyncCaller(abc.ABC):
    """Runs ``async_fn`` calls in the background and reports their outcomes.

    Subclasses implement :meth:`schedule`, :meth:`poll`, :meth:`wait_any` and
    :meth:`close`. Thread-safe: the training thread schedules while a finalizer
    thread (``AsyncCallsQueue(background_finalize=True)``) waits for outcomes; the
    state is guarded by one re-entrant lock, never held while blocking.

    A caller that is dropped without :meth:`close` is closed with ``abort=True`` when
    it is garbage-collected (as Megatron-core and NVRx close in ``__del__``).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._outcomes: dict[int, CallOutcome] = {}
        self._abandoned: set[int] = set()
        #: The process that owns the background processes (a forked child never
        #: stops them: they are its parent's).
        self._pid = os.getpid()

    @property
    def foreign(self) -> bool:
        """True in a child of ``os.fork()``: this caller's processes belong to the parent."""
        return os.getpid() != self._pid

    def __del__(self) -> None:
        if getattr(self, "_lock", None) is None or self.foreign:
            return  # __init__ did not finish, or a forked child: not ours to stop
        try:
            self.close(abort=True)
        except Exception:  # noqa: BLE001 - nothing to report to at collection time
            pass

    @abc.abstractmethod
    def schedule(self, call_idx: int, async_fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        """Start ``async_fn(*args, **kwargs)`` in the background as call ``call_idx``.

        Never raises for a failure of the call itself: such failures are reported
        as a failed :class:`CallOutcome`.
        """

    @abc.abstractmethod
    def running(self) -> list[int]:
        """The calls whose ``async_fn`` may still be running in the background."""

    @abc.abstractmethod
    def poll(self) -> None:
        """Collect the outcomes of finished calls and detect dead processes (non-blocking)."""

    @abc.abstractmethod
    def wait_any(self, timeout: float | None) -> None:
        """Block until something may have changed (a result, a death) or ``timeout`` s."""

    @abc.abstractmethod
    def close(self, abort: bool = False) -> None:
        """Stop the background processes; ``abort`` kills in-flight calls."""

    # -- shared logic ------------------------------------------------------------
    def _record(self, outcome: CallOutcome) -> None:
        with self._lock:
            if outcome.call_idx in self._abandoned:
                self._abandoned.discard(outcome.call_idx)
                return
            self._outcomes[outcome.call_idx] = outcome

    def outcome(self, call_idx: int) -> CallOutcome | None:
        """The outcome of ``call_idx`` if it finished on this rank, else ``None``."""
        self.poll()  # not under the lock: it may reap a dead worker (seconds)
        with self._lock:
            return self._outcomes.get(call_idx)

    def pop_outcome(self, call_idx: int) -> CallOutcome | None:
        """Remove and return the outcome of ``call_idx`` (``None`` if not finished)."""
        self.poll()
        with self._lock:
            return self._outcomes.pop(call_idx, None)

    def abandon(self, call_idx: int) -> None:
        """Forget ``call_idx``: its outcome, now or when it arrives, is dropped."""
        with self._lock:
            self._outcomes.pop(call_idx, None)
            if call_idx in self.running():
                self._abandoned.add(call_idx)

    def is_running(self, call_idx: int) -> bool:
        """True while this rank's ``async_fn`` for ``call_idx`` may still be running."""
        self.poll()
        with self._lock:
            return call_idx in self.running()

    def wait(self, call_idx: int, timeout: float | None = None) -> bool:
        """Wait until ``call_idx`` no longer runs on this rank.

        Args:
            timeout: seconds, or ``None`` to wait as long as the call runs (a dead
                worker ends the wait: its calls fail).

        Returns:
            True if the call is no longer running, False on timeout.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_running(call_idx):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            # Short waits: another thread (a queue's finalizer) may read the result off
            # the pipe this thread is waiting on, and nothing more would arrive.
            self.wait_any(WAIT_SLICE_S if left is None else min(left, WAIT_SLICE_S))
        return True


class TemporalAsyncCaller(AsyncCaller):
    """Fork one child process per call (Megatron-core's ``TemporalAsyncCaller``).

    The child runs ``async_fn`` on a copy-on-write snapshot of this process taken at
    :meth:`schedule`, reports its outcome through a pipe and exits. A call succeeds
    only if the child reported success *and* exited with code 0.

    A child that reported its outcome but has not exited :data:`CHILD_EXIT_GRACE_S`
    seconds later is killed, and its reported outcome taken (a warning on logger
    ``asyncckpt`` names it): its work is done then, and the exit of a process forked
    from a multi-threaded one can block for ever on a lock that one of the parent's
    threads held at the fork (Python warns of such deadlocks at ``os.fork()``); the
    commit must not wait for it.

    Fork-safety: the child must not use locks or thread pools of the parent (e.g.
    torch intra-op parallelism, CUDA). asyncckpt's own writer uses only ``os`` I/O.
    Nor does it run the parent's finalizers: it is forked with the cyclic GC off and
    freezes what it inherited (``gc.freeze``) before turning the GC back on, so the
    trainer's garbage (a cycle holding a CUDA tensor, a socket, a store) is never
    collected in the child, where its destructor could wait forever on a lock that
    another thread of the trainer held at the fork.
    """

    def __init__(self) -> None:
        super().__init__()
        self._ctx = mp.get_context("fork")
        self._children: dict[int, tuple[Any, Any, CallOutcome | None]] = {}
        self._reported_at: dict[int, float] = {}  # when each running child reported (monotonic s)

    def schedule(self, call_idx: int, async_fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        with self._lock:
            self._schedule(call_idx, async_fn, args, kwargs)

    def _schedule(self, call_idx: int, async_fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        gc_enabled = gc.isenabled()
        gc.disable()  # the child starts with it off (see _temporal_child_main)
        try:
            reader, writer = self._ctx.Pipe(duplex=False)
            proc = self._ctx.Process(
                target=_temporal_child_main,
                args=(writer, call_idx, async_fn, args, kwargs, gc_enabled),
                name=f"asyncckpt-call-{call_idx}",
                daemon=True,
            )
            proc.start()
        except Exception as exc:  # noqa: BLE001 - e.g. fork failed (ENOMEM, EAGAIN)
            self._record(CallOutcome(call_idx, False, _format_exception(exc, "could not fork a child: ")))
            return
        finally:
            if gc_enabled:
                gc.enable()
        _track(proc)
        writer.close()
        self._children[call_idx] = (proc, reader, None)

    def running(self) -> list[int]:
        with self._lock:
            return list(self._children)

    @staticmethod
    def _read_report(reader: Any) -> CallOutcome | None:
        try:
            if reader.poll(0):
                return pickle.loads(reader.recv_bytes())
        except (EOFError, OSError):
            pass  # the child died before (or while) reporting
        return None

    def poll(self) -> None:
        with self._lock:
            self._poll()

    def _poll(self) -> None:
        now = time.monotonic()
        for call_idx, (proc, reader, reported) in list(self._children.items()):
            if reported is None:
                reported = self._read_report(reader)
                self._children[call_idx] = (proc, reader, reported)
                if reported is not None:
                    self._reported_at[call_idx] = now
            lingered = False
            if proc.is_alive():
                if reported is None or now - self._reported_at[call_idx] < _child_exit_grace_s():
                    continue
                _log.warning(
                    "asyncckpt: the forked child of call %d (pid %s) reported its outcome %.0f s ago and has not "
                    "exited (blocked in its exit, e.g. on a lock another thread of this process held when it was "
                    "forked): killed, its outcome taken",
                    call_idx,
                    proc.pid,
                    now - self._reported_at[call_idx],
                )
                proc.kill()
                lingered = True
            if reported is None:  # it may have reported just before exiting
                reported = self._read_report(reader)
            proc.join()
            _untrack(proc)
            reader.close()
            del self._children[call_idx]
            self._reported_at.pop(call_idx, None)
            exit_text = _describe_exit(proc.pid, proc.exitcode)
            if reported is None:
                outcome = CallOutcome(
                    call_idx, False, RankFailure(f"forked child {exit_text} without reporting a result")
                )
            elif proc.exitcode != 0 and reported.ok and not lingered:
                outcome = reported._replace(
                    ok=False, value=None, error=RankFailure(f"forked child reported success but {exit_text}")
                )
            else:
                outcome = reported
            self._record(outcome)

    def wait_any(self, timeout: float | None) -> None:
        handles = []
        with self._lock:
            for proc, reader, reported in self._children.values():
                handles.append(proc.sentinel)
                if reported is None:
                    handles.append(reader)
        _wait_handles(handles, timeout)

    def close(self, abort: bool = False) -> None:
        """Wait for the running children (``abort``: terminate them) and reap them."""
        if self.foreign:
            return
        if abort:
            with self._lock:
                children, self._children = dict(self._children), {}
            _terminate_many([proc for proc, _, _ in children.values()])
            for _, reader, _ in children.values():
                reader.close()
            return
        while self._children:
            self.wait_any(1.0)
            self.poll()


# --------------------------------------------------------------------------- persistent


class _Worker:
    """One incarnation of the persistent worker: process + its two pipes."""

    def __init__(self, ctx: Any, import_main: bool) -> None:
        task_r, self.task_w = ctx.Pipe(duplex=False)
        self.result_r, result_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_persistent_worker_main, args=(task_r, result_w), name=_WORKER_NAME, daemon=True)
        try:
            if import_main:
                self.proc.start()
            else:
                with _main_module_hidden():
                    self.proc.start()
        finally:
            # Only the worker holds these ends: its death is then seen as EOF here.
            task_r.close()
            result_w.close()
        _track(self.proc, self.send_abort)
        self.inflight: list[int] = []
        #: Whether a call was ever sent to it: one that never got one is stopped at
        #: once by :meth:`PersistentAsyncCaller.close`, however far its start-up got.
        self.used = False

    def send_abort(self) -> None:
        """Ask the worker to exit at once (its task reader calls ``os._exit``)."""
        self.task_w.send_bytes(_HEADER.pack(_ABORT))

    def close_pipes(self) -> None:
        for conn in (self.task_w, self.result_r):
            try:
                conn.close()
            except OSError:
                pass


class PersistentAsyncCaller(AsyncCaller):
    """One long-lived worker process that runs the calls in order.

    Args:
        start_method: ``"spawn"`` (default) or ``"forkserver"``. ``fork`` is refused:
            a forked long-lived worker would inherit the trainer's threads' locks.
        import_main: let the worker re-import the main script as
            ``multiprocessing`` does, so that ``async_fn`` s defined there unpickle
            (default ``None``: yes). ``False`` (spawn only) starts a lighter worker
            (no training script, no torch unless the calls need it) for calls
            defined in importable modules; a ``forkserver`` worker is forked from
            multiprocessing's fork server, which imported the main script already.

    Raises:
        InvalidArgumentError: (a ``ValueError``) an unknown ``start_method``, or ``import_main=False`` with
            ``start_method="forkserver"`` (it cannot be honoured).

    The worker ignores SIGINT and SIGTERM sent to the process group; see
    :meth:`close` for how it is stopped.

    The request ``(async_fn, args, kwargs)`` is pickled with plain :mod:`pickle` in
    :meth:`schedule`, in the training thread, so the worker sees the arguments as of
    the call (tensors in the arguments are copied by value, never moved to shared
    memory in place). Large data should be staged by a ``preload_fn`` into buffers
    the worker maps by name.
    """

    def __init__(self, start_method: str = "spawn", import_main: bool | None = None) -> None:
        super().__init__()
        if start_method not in ("spawn", "forkserver"):
            raise InvalidArgumentError(f"start_method must be 'spawn' or 'forkserver', not {start_method!r}")
        if import_main is False and start_method != "spawn":
            raise InvalidArgumentError(
                f"import_main=False cannot be honoured with start_method={start_method!r}: the "
                "fork server imports the main script itself; use start_method='spawn' for a "
                "worker without the main script, or leave import_main out"
            )
        self.start_method = start_method
        self.import_main = import_main is not False
        self._ctx = mp.get_context(start_method)
        self._worker: _Worker | None = None
        #: Workers found dead, being reaped (outside the lock): their calls still run.
        self._dying: list[_Worker] = []
        #: Set once a worker failed to start because the main script has no
        #: ``__main__`` guard: every later call fails at once with it (no restarts).
        self._start_failure: RankFailure | None = None
        #: How many workers were started (1 + the number of restarts).
        self.num_starts = 0

    @property
    def worker_pid(self) -> int | None:
        """The pid of the current worker process, or ``None`` if none runs."""
        worker = self._worker
        return worker.proc.pid if worker is not None and worker.proc.is_alive() else None

    def _ensure_worker(self) -> _Worker:
        """(after a :meth:`poll`) The running worker, started if none runs."""
        with self._lock:
            if self._start_failure is not None:  # restarting would fail the same way
                raise RuntimeError(self._start_failure)
            if self._worker is None:
                _exit_if_importing_main_in_worker()
                self._worker = _Worker(self._ctx, self.import_main)
                self.num_starts += 1
            return self._worker

    def start(self) -> None:
        """Start the worker now instead of at the first call (optional)."""
        self.poll()
        self._ensure_worker()

    def schedule(self, call_idx: int, async_fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        try:
            payload = pickle.dumps((async_fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - an unpicklable request fails its call
            self._record(
                CallOutcome(
                    call_idx, False, _format_exception(exc, "the request cannot be pickled for the persistent worker: ")
                )
            )
            return
        self.poll()  # reaps a dead worker (not under the lock)
        with self._lock:
            try:
                worker = self._ensure_worker()
            except Exception as exc:  # noqa: BLE001 - a worker that cannot start fails the call
                self._record(
                    CallOutcome(
                        call_idx, False, self._start_failure or _format_exception(exc, "could not start the worker: ")
                    )
                )
                return
            worker.inflight.append(call_idx)
            worker.used = True
            try:
                worker.task_w.send_bytes(_HEADER.pack(call_idx) + payload)
                return
            except (BrokenPipeError, OSError):
                self._detach(worker)
        self._reap(worker)  # fails call_idx with the worker's exit status

    def running(self) -> list[int]:
        with self._lock:
            workers = self._dying + ([self._worker] if self._worker is not None else [])
            return [call_idx for worker in workers for call_idx in worker.inflight]

    def _drain(self, worker: _Worker) -> bool:
        """Record every result waiting in the pipe; False if the pipe is closed."""
        try:
            while worker.result_r.poll(0):
                outcome: CallOutcome = pickle.loads(worker.result_r.recv_bytes())
                if outcome.call_idx in worker.inflight:
                    worker.inflight.remove(outcome.call_idx)
                self._record(outcome)
        except (EOFError, OSError):
            return False
        return True

    def poll(self) -> None:
        """Read the results waiting in the pipe; reap a worker found dead.

        The lock is held only to read and to record: a dead worker is joined (up to
        :data:`TERMINATE_GRACE_S` s) and terminated outside it, so a thread that
        schedules or asks :meth:`is_running` meanwhile is not held up by the one that
        reaps. Its calls count as running until they are recorded as failed; the next
        call starts a new worker at once. Do not call it holding the lock.
        """
        with self._lock:
            worker = self._worker
            if worker is None or (self._drain(worker) and worker.proc.is_alive()):
                return
            self._detach(worker)
        self._reap(worker)

    def _detach(self, worker: _Worker) -> None:
        """(holding the lock) ``worker`` is dead: the next call starts a new one."""
        if self._worker is worker:
            self._worker = None
        if worker not in self._dying:
            self._dying.append(worker)

    def _reap(self, worker: _Worker) -> None:
        """(not holding the lock) Join or terminate a detached worker, then fail its calls."""
        worker.proc.join(TERMINATE_GRACE_S)
        if worker.proc.is_alive():  # the pipe broke but the process lingers
            _terminate(worker.proc)
        with self._lock:
            if worker not in self._dying:
                return  # reaped by another thread
            # A result sent just before the worker exited may have arrived after the last
            # read: read everything left first; what is still in flight failed with it.
            self._drain(worker)
            _untrack(worker.proc)
            text = _describe_exit(worker.proc.pid, worker.proc.exitcode)
            if worker.proc.exitcode == _NO_MAIN_GUARD_EXIT and self.import_main:
                self._start_failure = _no_main_guard_failure()
            for call_idx in worker.inflight:
                self._record(
                    CallOutcome(
                        call_idx,
                        False,
                        self._start_failure
                        or RankFailure(
                            f"the persistent worker {text} while call {call_idx} was in flight (it is restarted for "
                            "the next call)"
                        ),
                    )
                )
            worker.inflight.clear()
            worker.close_pipes()
            self._dying.remove(worker)

    def wait_any(self, timeout: float | None) -> None:
        with self._lock:
            worker = self._worker
            handles = [] if worker is None else [worker.result_r, worker.proc.sentinel]
        _wait_handles(handles, timeout)

    def close(self, abort: bool = False, timeout: float | None = None) -> None:
        """Stop the worker.

        Args:
            abort: terminate it at once: an ABORT message and SIGTERM, then SIGKILL
                after :data:`TERMINATE_GRACE_S` seconds; in-flight calls are dropped.
                Otherwise ask it to stop after the calls it has, and wait up to
                ``timeout`` seconds (``None``: as long as they run) before
                terminating it. A worker that was never sent a call has nothing to
                finish: it is terminated at once, not waited for while it starts up
                (re-importing the training script and torch takes seconds on a busy
                node: a manager opened only to restore would pay them at close).
        """
        worker = self._worker
        if worker is None or self.foreign:
            return
        if not abort and worker.used:
            try:
                worker.task_w.send_bytes(_HEADER.pack(_STOP))
                deadline = None if timeout is None else time.monotonic() + timeout
                while worker.proc.is_alive():
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self.wait_any(1.0 if left is None else min(left, 1.0))
                    self.poll()
                    if self._worker is None:
                        break
            except (BrokenPipeError, OSError):
                pass
            self.poll()
        with self._lock:
            still_ours = self._worker is worker
            if still_ours:
                self._worker = None
        if still_ours:
            _terminate(worker.proc)  # ABORT message, SIGTERM, grace, SIGKILL
        worker.inflight.clear()
        worker.close_pipes()
