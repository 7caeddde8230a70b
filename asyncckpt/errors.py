"""Errors raised by asyncckpt: one base class, and per-rank causes that keep their type.

Every error the library raises on purpose derives from :class:`AsyncckptError` (an
``Exception``), so ``except asyncckpt.AsyncckptError`` catches them all:

- :class:`CheckpointException`: an asynchronous call (a save) failed on at least one
  rank; raised identically on every rank. The shape is
  ``torch.distributed.checkpoint.api.CheckpointException`` (``failures`` keyed by
  rank), extended with the ``call_idx`` the failure belongs to.
- :class:`CheckpointError` (also a ``RuntimeError``): a checkpoint cannot be saved or
  loaded as asked; input errors found before the write are gathered from every rank
  and raised, the same on every rank, with ``failures`` keyed by rank.
- :class:`CorruptCheckpointError`, :class:`CallbackError`,
  :class:`UnverifiableCheckpointError`: subclasses of it.
- Errors that replace a builtin keep its type: :class:`CheckpointNotFoundError` (a
  ``FileNotFoundError``), :class:`CheckpointPathError` (the ``OSError`` subclass of the
  cause: ``PermissionError``, ``NotADirectoryError``, ...), :class:`InvalidArgumentError`
  (a ``ValueError`` and a ``TypeError``), :class:`RootInUseError` and
  :class:`InvalidStateError` (``RuntimeError`` s), :class:`CheckpointTimeoutError` (a
  ``TimeoutError``).

Which of the two checkpoint errors: a :class:`CheckpointException` is a save that was
started and failed on some rank (its write or its commit: raised by ``wait``,
``maybe_finalize``, ``close``, or a synchronous ``save``); a :class:`CheckpointError` is
a save or a load refused or impossible as asked (bad input or target, found before
anything is written, or a checkpoint that cannot be read). They are not merged:
``CheckpointException`` keeps the shape (and name) of DCP's, whose users catch it, while
``CheckpointError`` is a ``RuntimeError``.

A rank's cause is a :class:`RankFailure`: the text (it *is* a ``str``, so existing
code that searches it keeps working) plus the exception's type name, its ``errno``
and the exception itself when it survives pickling, so that a caller can tell ENOSPC
from EACCES. Like filelock's ``Timeout``, every error here pickles losslessly.

This module does not import torch (the background worker uses it).
"""

from __future__ import annotations

import os
import pickle
import traceback
from collections.abc import Mapping
from typing import Any

__all__ = [
    "AsyncckptError",
    "RankFailure",
    "CheckpointException",
    "CheckpointError",
    "CorruptCheckpointError",
    "CallbackError",
    "CheckpointNotFoundError",
    "CheckpointPathError",
    "InvalidArgumentError",
    "InvalidStateError",
    "CheckpointTimeoutError",
    "RootInUseError",
    "LocalTierInUseError",
    "UnverifiableCheckpointError",
    "SaveDeadlockError",
    "RemoteStorageError",
    "UploadError",
]


class AsyncckptError(Exception):
    """Base class of every error asyncckpt raises on purpose."""


class RankFailure(str):
    """One rank's cause of a failure: its text, plus what a program needs to act on it.

    A ``str`` subclass: ``str(failure)`` and ``"ENOSPC" in failure`` see the text
    (exception type, message and the remote traceback, or a dead process's status).

    Attributes:
        exc_type: the exception's class name, qualified by its module unless it is a
            builtin (``"OSError"``, ``"asyncckpt.errors.CheckpointError"``), or ``None``
            when there was no exception (e.g. a process killed by a signal).
        errno: the exception's ``errno`` (an ``OSError``), else ``None``.
        exception: the exception itself, without its traceback, if it could be
            pickled (it crossed a process boundary), else ``None``.
    """

    exc_type: str | None
    errno: int | None
    exception: BaseException | None

    def __new__(
        cls, text: str, exc_type: str | None = None, errno: int | None = None, exception: BaseException | None = None
    ) -> RankFailure:
        self = super().__new__(cls, text)
        self.exc_type = exc_type
        self.errno = errno
        self.exception = exception
        return self

    @classmethod
    def from_exception(cls, exc: BaseException, context: str = "") -> RankFailure:
        """The failure for ``exc``: ``context``, type, message, and the traceback (with the
        pid of the process that raised it) as text.

        Args:
            exc: the exception.
            context: a prefix saying where it happened (e.g. ``"preload_fn raised "``).
        """
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        name = type(exc).__qualname__
        module = type(exc).__module__
        if module not in ("builtins", "__main__"):
            name = f"{module}.{name}"
        kept: BaseException | None
        try:
            kept = pickle.loads(pickle.dumps(exc))
            kept.__traceback__ = None
        except Exception:  # noqa: BLE001 - an exception that does not pickle keeps its text only
            kept = None
        code = getattr(exc, "errno", None)
        return cls(
            f"{context}{type(exc).__name__}: {exc}\nTraceback (pid {os.getpid()}):\n{text}",
            name,
            code if isinstance(code, int) else None,
            kept,
        )

    def __reduce__(self) -> tuple:
        return (RankFailure, (str(self), self.exc_type, self.errno, self.exception))


def _as_failures(failures: Mapping[int, Any]) -> dict[int, RankFailure]:
    return {int(k): v if isinstance(v, RankFailure) else RankFailure(str(v)) for k, v in sorted(failures.items())}


def _format_failures(head: str, failures: Mapping[int, RankFailure]) -> str:
    lines = [head]
    for rank, cause in failures.items():
        body = cause.rstrip().replace("\n", "\n    ")
        lines.append(f"  [rank {rank}] {body}")
    return "\n".join(lines)


class CheckpointException(AsyncckptError):
    """An asynchronous call (a save) failed on at least one rank.

    Raised on every rank of the process group with the same content, so that
    collective code never diverges. For a checkpoint save the message names the step
    and the checkpoint directory (``saving step 10 to /ckpt/step_00000010 failed on
    rank(s) 1: ...``); a call of the framework API (``AsyncCallsQueue``, Megatron's
    ``async_utils`` shape) that is not a save is named by its ``call_idx``.

    Args:
        call_idx: the ``call_idx`` of the failed call (see ``AsyncRequest``; ``-1``
            for a synchronous save).
        failures: each failing rank's cause (a :class:`RankFailure`, or text).
        step: the step of the save (``CheckpointManager`` saves), else ``None``.
        checkpoint_dir: the checkpoint directory of the save, else ``None`` (a call
            that is not a save).

    Attributes:
        call_idx, step, checkpoint_dir: as above.
        failures: ``rank -> RankFailure``, ascending ranks.
    """

    def __init__(
        self,
        call_idx: int,
        failures: Mapping[int, Any],
        step: int | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
    ) -> None:
        self.call_idx = int(call_idx)
        self.failures = _as_failures(failures)
        self.step = step
        self.checkpoint_dir = None if checkpoint_dir is None else str(checkpoint_dir)
        ranks = ", ".join(str(r) for r in self.failures)
        if self.checkpoint_dir is None:
            head = f"async call {self.call_idx} failed on rank(s) {ranks}:"
        elif step is None:
            head = f"saving {self.checkpoint_dir} failed on rank(s) {ranks}:"
        else:
            head = f"saving step {step} to {self.checkpoint_dir} failed on rank(s) {ranks}:"
        super().__init__(_format_failures(head, self.failures))

    def for_save(self, step: int | None, checkpoint_dir: str | os.PathLike) -> CheckpointException:
        """This failure, described as the save of ``step`` to ``checkpoint_dir`` (itself
        when it already names a checkpoint directory)."""
        if self.checkpoint_dir is not None:
            return self
        exc = type(self)(self.call_idx, self.failures, step, checkpoint_dir)
        exc.__cause__, exc.__context__ = self.__cause__, self.__context__
        exc.__suppress_context__ = self.__suppress_context__
        for note in getattr(self, "__notes__", ()):
            exc.add_note(note)
        return exc

    def __reduce__(self) -> tuple:  # keep pickling (e.g. across processes) lossless
        return (type(self), (self.call_idx, self.failures, self.step, self.checkpoint_dir))


class CheckpointError(AsyncckptError, RuntimeError):
    """A checkpoint cannot be saved or loaded as asked (bad input or bad target).

    Args:
        message: what is wrong, naming the entry or path.
        failures: for an error found on several ranks before the write, each
            failing rank's cause (raised the same on every rank).

    Attributes:
        failures: ``rank -> RankFailure`` (empty when raised by one process alone).
    """

    def __init__(self, message: str, failures: Mapping[int, Any] | None = None) -> None:
        super().__init__(message)
        self.failures = _as_failures(failures or {})

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.failures))


class CorruptCheckpointError(CheckpointError):
    """A checkpoint on disk is missing files or does not match its manifest.

    Attributes:
        path: the file (or directory) that is missing or wrong.
    """

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.path))


class CheckpointNotFoundError(AsyncckptError, FileNotFoundError):
    """There is no such checkpoint, or it was removed (e.g. by retention) while it was
    being loaded. A ``FileNotFoundError``: a job that reads checkpoints another job
    writes can retry with a newer step.

    Args:
        message: what is missing.
        path: the checkpoint directory.
    """

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(2, message, path)  # errno.ENOENT

    def __str__(self) -> str:
        return str(self.strerror) if self.filename is None else f"{self.strerror}: {self.filename}"

    def __reduce__(self) -> tuple:
        return (type(self), (self.strerror, self.filename))


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

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.errors))


class UnverifiableCheckpointError(CheckpointError):
    """A checkpoint has no manifest, so its sizes and checksums cannot be verified: a
    stock ``torch.distributed.checkpoint`` directory (``dcp.save``). Not a
    :class:`CorruptCheckpointError`: nothing is known to be wrong with it
    (``asyncckpt.load`` and ``read_state_dict`` read it, with a warning).

    Attributes:
        path: the checkpoint directory.
    """

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.path))


class InvalidArgumentError(AsyncckptError, ValueError, TypeError):
    """An argument of a public call has the wrong type or value (e.g. a negative or
    non-integer step, arguments given in the wrong order). Both a ``ValueError`` and a
    ``TypeError`` (like numpy's ``AxisError``), so that either builtin catches it.
    Raised before anything is staged or written."""


class InvalidStateError(AsyncckptError, RuntimeError):
    """An object is used in a state that does not allow the call: a closed
    ``CheckpointManager`` or ``AsyncCallsQueue``, a frozen ``AsyncRequest``,
    ``PreemptionSave`` outside the main thread or ``finish()`` before ``reached()``.
    A ``RuntimeError``: the builtin error these calls raised before, still caught by
    ``except RuntimeError``."""


class CheckpointTimeoutError(AsyncckptError, TimeoutError):
    """A wait with a ``timeout`` (seconds) ran out: ``SaveHandle.wait(timeout)`` /
    ``result(timeout)`` before the save settled. A ``TimeoutError`` (which is also
    ``concurrent.futures.TimeoutError``), as the ``Future`` contract asks; the save goes on."""


class RootInUseError(AsyncckptError, RuntimeError):
    """Another ``CheckpointManager`` (of this or another process, perhaps on another
    host) holds the lock of this checkpoint root.

    Attributes:
        path: the root directory.
        pid: the process id of the holder, if known.
        host: the host name of the holder, if known.
    """

    def __init__(self, message: str, path: str | None = None, pid: int | None = None, host: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.pid = pid
        self.host = host

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.path, self.pid, self.host))


class LocalTierInUseError(RootInUseError):
    """A node-local tier's directory (``LocalTier.dir``) belongs to another job that is
    running (its ranks hold the tier's lock): two jobs in one tier would remove each
    other's shards. Give each job its own directory. (A tier of a job that is not
    running is taken over instead: its shards are removed.)

    Attributes:
        path: the tier's directory.
        owner: the persistent root of the job that holds it, if recorded.
    """

    def __init__(self, message: str, path: str | None = None, owner: str | None = None) -> None:
        super().__init__(message, path)
        self.owner = owner

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.path, self.owner))


class SaveDeadlockError(AsyncckptError, RuntimeError):
    """Waiting for a save here would never return: this thread is the one that must
    settle it. Raised at once by ``SaveHandle.wait()``, and by ``result()`` /
    ``exception()`` with a timeout other than 0, on a save not settled yet, when they
    are called in its own completion callback (which runs before its handle is
    completed), or in the background finalizer thread of its queue (a completion
    callback or ``add_done_callback`` function of another save waiting for it). As
    ``threading.Thread.join()`` of the current thread raises a ``RuntimeError``.
    The save itself goes on: it commits (or fails) as if nobody had waited."""


_PATH_ERROR_CLASSES: dict[type, type] = {}


class CheckpointPathError(AsyncckptError, OSError):
    """A path given to asyncckpt cannot be used (no permission, read-only, not a
    directory, ...). :meth:`of` makes one that is also an instance of the builtin
    ``OSError`` subclass of the cause (``PermissionError``, ``NotADirectoryError``,
    ``FileExistsError``, ...), so ``except PermissionError`` keeps working.

    Attributes:
        errno, strerror, filename: as ``OSError``'s.
    """

    def __str__(self) -> str:
        return str(self.strerror) if self.filename is None else f"{self.strerror}: {self.filename}"

    @staticmethod
    def of(code: int | None, message: str, path: str | os.PathLike | None = None) -> CheckpointPathError:
        """A ``CheckpointPathError`` that is also the builtin ``OSError`` subclass that
        ``code`` (an ``errno``) maps to."""
        builtin = type(OSError(code, "")) if code is not None else OSError
        cls = _PATH_ERROR_CLASSES.get(builtin)
        if cls is None:
            if builtin is OSError:
                cls = CheckpointPathError
            else:
                cls = type(
                    f"CheckpointPathError[{builtin.__name__}]",
                    (CheckpointPathError, builtin),
                    {"__module__": __name__, "__doc__": CheckpointPathError.__doc__},
                )
            _PATH_ERROR_CLASSES[builtin] = cls
        return cls(code, message, None if path is None else str(path))

    def __reduce__(self) -> tuple:
        return (CheckpointPathError.of, (self.errno, self.strerror, self.filename))


class PreemptionBudgetExpired(SystemExit):
    """Raised in the main thread when a :class:`~asyncckpt.PreemptionSave` grace budget
    is spent, wherever the training thread waits. A ``SystemExit(128 + signum)``:
    uncaught, the process exits with that code. Not an :class:`AsyncckptError`: like
    ``KeyboardInterrupt``, it is an interrupt, and every wait of the library treats it
    as one (pending saves are dropped at once, nothing partial is committed)."""


class RemoteStorageError(AsyncckptError, OSError):
    """An object store (``s3://`` URLs, :mod:`asyncckpt.io.s3`) refused or failed a
    request: wrong credentials, a bucket that does not exist, a server that cannot be
    reached (after the client library's retries with backoff), or the ``s3`` extra
    (boto3) is not installed. An ``OSError``: code written for I/O errors keeps working.

    Attributes:
        url: the URL of the request (``s3://bucket/key``).
        code: the server's error code (``"SignatureDoesNotMatch"``, ``"NoSuchBucket"``,
            ...), or the client's exception name when no response came.
    """

    def __init__(self, message: str, url: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.code = code

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.url, self.code))


class UploadError(AsyncckptError):
    """The upload of a committed step to a remote tier failed (``CheckpointManager(...,
    upload_to=...)``). The local checkpoint is intact; the remote step has no commit
    marker (it is absent remotely) and is uploaded again when a manager opens the root.

    Attributes:
        step: the step.
        url: the remote step's URL.
    """

    def __init__(self, message: str, step: int | None = None, url: str | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.url = url

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.step, self.url))
