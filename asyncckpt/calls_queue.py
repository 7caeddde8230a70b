"""AsyncCallsQueue: schedule asynchronous calls and finalize them collectively.

The shape is Megatron-core's ``AsyncCallsQueue``; the behaviour follows the contracts
of DESIGN.md: per-rank failures (a raising ``preload_fn`` or ``async_fn``, a dead
worker, a forked child that exited non-zero) are recorded against the call and
reported by :meth:`AsyncCallsQueue.maybe_finalize_async_calls`, which raises the same
:class:`~asyncckpt.errors.CheckpointException` on every rank. Completion is agreed on
with one all_gather of per-rank status over a dedicated gloo group.
"""

from __future__ import annotations

import collections
import time
import traceback
from typing import Any

from .callers import AsyncCaller, PersistentAsyncCaller, TemporalAsyncCaller
from .dist import SyncGroup
from .errors import CheckpointException
from .request import AsyncRequest

__all__ = ["AsyncCallsQueue"]

_RUNNING, _OK, _FAILED = 0, 1, 2


class AsyncCallsQueue:
    """A FIFO of asynchronous calls, finalized in ``call_idx`` order.

    Args:
        persistent: use one long-lived worker (:class:`PersistentAsyncCaller`)
            instead of forking a child per call (:class:`TemporalAsyncCaller`).
        process_group: the ranks that schedule and finalize together (``None``: the
            default group, or a single process without ``torch.distributed``).
        start_method: ``"spawn"`` or ``"forkserver"`` for the persistent worker.
        import_main: (spawn) whether the persistent worker re-imports the main
            script, so that ``async_fn`` s defined there can be unpickled (see
            :class:`PersistentAsyncCaller`).
        caller: a caller instance to use instead (overrides ``persistent``).
        failures_kept: how many recent failures :meth:`get_failure` remembers.

    Collective contract: :meth:`schedule_async_request`,
    :meth:`maybe_finalize_async_calls` (unless ``no_dist=True``) and :meth:`close`
    are called by every rank of ``process_group`` in the same order.
    """

    def __init__(
        self,
        persistent: bool = False,
        *,
        process_group: Any = None,
        start_method: str = "spawn",
        import_main: bool = True,
        caller: AsyncCaller | None = None,
        failures_kept: int = 64,
    ) -> None:
        if caller is None:
            caller = PersistentAsyncCaller(start_method, import_main) if persistent else TemporalAsyncCaller()
        self.caller = caller
        self.persistent = isinstance(caller, PersistentAsyncCaller)
        self._process_group = process_group
        self._sync: SyncGroup | None = None
        self._next_call_idx = 0
        self._pending: dict[int, AsyncRequest] = {}
        self._preload_failures: dict[int, str] = {}
        self._results: dict[int, Any] = {}
        self._failures: collections.OrderedDict[int, CheckpointException] = collections.OrderedDict()
        self._failures_kept = failures_kept
        self._closed = False

    # ------------------------------------------------------------------ properties
    @property
    def sync(self) -> SyncGroup:
        """The ranks this queue synchronizes (created at first use)."""
        if self._sync is None:
            self._sync = SyncGroup(self._process_group)
        return self._sync

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ scheduling
    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Run ``preload_fn`` here, then start ``async_fn`` in the background.

        Args:
            async_request: the request; it is frozen and given its ``call_idx``.

        Returns:
            The ``call_idx`` of the call (0, 1, 2, ... per queue, equal on all ranks).

        Raises:
            RuntimeError: the queue is closed.

        A ``preload_fn`` that raises does not raise here (other ranks would go on and
        diverge): the failure is recorded and reported by
        :meth:`maybe_finalize_async_calls` on every rank.
        """
        if self._closed:
            raise RuntimeError("AsyncCallsQueue is closed")
        call_idx = self._next_call_idx
        self._next_call_idx += 1
        request = async_request._replace(call_idx=call_idx).freeze()
        self._pending[call_idx] = request
        args = request.async_fn_args
        if request.preload_fn is not None:
            try:
                args = (request.preload_fn(),) + tuple(args)
            except Exception as exc:
                self._preload_failures[call_idx] = "preload_fn raised " + "".join(
                    traceback.format_exception(type(exc), exc, exc.__traceback__))
                return call_idx
        if request.async_fn is not None:
            self.caller.schedule(call_idx, request.async_fn, tuple(args), dict(request.async_fn_kwargs or {}))
        return call_idx

    # ------------------------------------------------------------------ finalization
    def _local_status(self, call_idx: int, request: AsyncRequest, blocking: bool) -> tuple[int, str | None]:
        if call_idx in self._preload_failures:
            return _FAILED, self._preload_failures[call_idx]
        if request.async_fn is None:
            return _OK, None
        if blocking:
            self.caller.wait(call_idx)
        outcome = self.caller.outcome(call_idx)
        if outcome is None:
            return _RUNNING, None
        return (_OK, None) if outcome.ok else (_FAILED, outcome.error)

    def maybe_finalize_async_calls(
        self, blocking: bool = False, no_dist: bool = False, *, until: int | None = None
    ) -> list[int]:
        """Finalize the calls that finished on every rank, in ``call_idx`` order.

        For the oldest pending call, the ranks exchange their local status (running,
        succeeded, failed) in one all_gather. If it succeeded everywhere its
        ``finalize_fns`` run; if it failed anywhere, every rank raises; otherwise
        (still running somewhere) this returns, unless ``blocking``.

        Args:
            blocking: wait until every pending call (up to ``until``) is finalized.
            no_dist: decide on this rank's status alone, with no collective.
            until: finalize only calls with ``call_idx <= until``.

        Returns:
            The ``call_idx`` of each call finalized by this call, in order.

        Raises:
            CheckpointException: the oldest pending call failed on some rank; the same
                exception (``call_idx`` and per-rank causes) on every rank. The call is
                dropped without running its finalize_fns; later calls stay pending.
        """
        finalized: list[int] = []
        sync = None if no_dist else self.sync
        while self._pending:
            call_idx, request = next(iter(self._pending.items()))
            if until is not None and call_idx > until:
                break
            status, cause = self._local_status(call_idx, request, blocking)
            statuses = [status] if sync is None else [s[0] for s in sync.all_gather_ints([status])]
            if _FAILED in statuses:
                if sync is None:
                    failures = {self.sync.rank: cause}
                else:
                    causes = sync.all_gather_object(cause)
                    failures = {r: c for r, c in enumerate(causes) if c is not None}
                self._drop(call_idx)
                exc = CheckpointException(call_idx, failures)
                self._remember(exc)
                raise exc
            if all(s == _OK for s in statuses):
                outcome = self.caller.pop_outcome(call_idx)
                self._results[call_idx] = None if outcome is None else outcome.value
                del self._pending[call_idx]
                try:
                    for fn in request.finalize_fns:
                        fn()
                finally:
                    self._results.pop(call_idx, None)
                finalized.append(call_idx)
                continue
            if not blocking:
                break
            time.sleep(0.001)  # only reachable if a rank's status changed under us
        return finalized

    def _remember(self, exc: CheckpointException) -> None:
        self._failures[exc.call_idx] = exc
        while len(self._failures) > self._failures_kept:
            self._failures.popitem(last=False)

    def _drop(self, call_idx: int) -> None:
        self._pending.pop(call_idx, None)
        self._preload_failures.pop(call_idx, None)
        self.caller.abandon(call_idx)

    def get_result(self, call_idx: int) -> Any:
        """The return value of ``async_fn`` for ``call_idx``, on this rank.

        Available while the call's ``finalize_fns`` run (they take no arguments).

        Raises:
            KeyError: ``call_idx`` is not being finalized.
        """
        return self._results[call_idx]

    def get_failure(self, call_idx: int) -> CheckpointException | None:
        """The exception raised for ``call_idx``, if it failed recently, else ``None``."""
        return self._failures.get(call_idx)

    def is_pending(self, call_idx: int) -> bool:
        """True if ``call_idx`` was scheduled and is not finalized nor failed yet."""
        return call_idx in self._pending

    def wait_local(self, call_idx: int, timeout: float | None = None) -> bool:
        """Wait until this rank's ``async_fn`` for ``call_idx`` no longer runs.

        No collective. Used to reuse staging buffers only once the write that reads
        them is over (finished, failed, or its process died).

        Returns:
            True if it no longer runs, False on timeout (seconds).
        """
        return self.caller.wait(call_idx, timeout)

    def get_num_unfinalized_calls(self) -> int:
        """Number of scheduled calls not finalized yet (on this rank)."""
        return len(self._pending)

    # ------------------------------------------------------------------ shutdown
    def close(self, abort: bool = False) -> None:
        """Finalize pending calls (collectively, blocking) and stop the worker.

        Args:
            abort: do not finalize: terminate the worker or children at once (SIGTERM,
                grace period, SIGKILL) and drop the pending calls. No collective.

        Raises:
            CheckpointException: (``abort=False``) a pending call failed; the worker is
                stopped anyway and the remaining calls are still finalized.

        Idempotent: later calls do nothing.
        """
        if self._closed:
            return
        self._closed = True
        first_error: CheckpointException | None = None
        try:
            if not abort:
                while self._pending:
                    try:
                        self.maybe_finalize_async_calls(blocking=True)
                    except CheckpointException as exc:
                        first_error = first_error or exc
        finally:
            self.caller.close(abort=abort)
            rank = self._sync.rank if self._sync is not None else 0
            for call_idx in list(self._pending):
                self._drop(call_idx)
                self._remember(CheckpointException(
                    call_idx, {rank: "dropped by close(abort=True) before it was finalized"}))
        if first_error is not None:
            raise first_error

    def __enter__(self) -> "AsyncCallsQueue":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close(abort=exc_type is not None)
