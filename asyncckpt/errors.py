"""Errors raised by asyncckpt.

The framework layer reports every failure of an asynchronous call (a raising
``preload_fn`` or ``async_fn``, a worker that died, a forked child that exited
non-zero) through :class:`CheckpointException`, raised identically on every rank
by ``AsyncCallsQueue.maybe_finalize_async_calls``. The shape follows
``torch.distributed.checkpoint.api.CheckpointException`` (``failures`` keyed by
rank), extended with the ``call_idx`` the failure belongs to.
"""

from __future__ import annotations

__all__ = ["CheckpointException", "CheckpointError", "CorruptCheckpointError", "CallbackError"]


class CheckpointException(Exception):
    """An asynchronous call failed on at least one rank.

    Raised on every rank of the process group with the same content, so that
    collective code never diverges.

    Attributes:
        call_idx: the ``call_idx`` of the failed call (see ``AsyncRequest``).
        failures: maps each failing rank to its cause: exception type, message
            and the remote traceback (or the worker's exit status), as text.
    """

    def __init__(self, call_idx: int, failures: dict[int, str]) -> None:
        self.call_idx = int(call_idx)
        self.failures = {int(k): str(v) for k, v in sorted(failures.items())}
        super().__init__(self._format())

    def _format(self) -> str:
        ranks = ", ".join(str(r) for r in self.failures)
        lines = [f"async call {self.call_idx} failed on rank(s) {ranks}:"]
        for rank, cause in self.failures.items():
            body = cause.rstrip().replace("\n", "\n    ")
            lines.append(f"  [rank {rank}] {body}")
        return "\n".join(lines)

    def __reduce__(self):  # keep pickling (e.g. across processes) lossless
        return (type(self), (self.call_idx, self.failures))


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded as asked (bad input or bad target)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint on disk is missing files or does not match its manifest.

    Attributes:
        path: the file (or directory) that is missing or wrong.
    """

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class CallbackError(CheckpointError):
    """A save's completion callback raised.

    The save itself committed (or its own failure is reported separately); the
    error is raised by the next ``SaveHandle.wait``, ``CheckpointManager.maybe_finalize``
    or ``CheckpointManager.close`` of that process, after the queue has moved on, and
    logged (logger ``asyncckpt``) when it happens.

    Attributes:
        errors: the exceptions the callbacks raised, oldest first.
    """

    def __init__(self, message: str, errors: list[BaseException] | None = None) -> None:
        super().__init__(message)
        self.errors = list(errors or [])
