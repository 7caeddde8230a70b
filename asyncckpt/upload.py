"""The upload tier of a :class:`~asyncckpt.CheckpointManager`: committed local steps,
copied to object storage in the background (``CheckpointManager(...,
upload_to="s3://bucket/prefix")``).

One :class:`Uploader` per manager, one thread of its own (``asyncckpt-upload``), so
that an upload never runs on the training thread nor in the queue's finalizer thread
(which commits the next save), and never delays a save's stall: the training thread
only appends to a list. The tier and its remote commit protocol are
:mod:`asyncckpt.io.s3`.

The life of a step's upload (each rank; no collective):

1. (the queue's finalizer thread, in the save's completion callback, after the local
   commit and its retention) :meth:`Uploader.after_commit` opens this rank's files of
   the step (its data files; on the coordinator also the metadata files and the
   manifest) and queues the job. The open descriptors keep the bytes readable even if
   local retention (``keep_last``) removes the directory before the upload ends.
2. (the upload thread) each rank uploads its files (multipart, CRC32 per part); the
   coordinator waits until every rank's objects carry the save's token, writes the
   commit marker, then ``latest``, then runs remote retention (``keep_remote``: the
   oldest uploads go first; objects of unmarked steps that are not committed locally
   are leftovers of failed uploads and go too).
3. The outcome, an :class:`UploadResult` or an :class:`~asyncckpt.errors.UploadError`,
   goes to the save's completion callback, and to the next
   :meth:`CheckpointManager.maybe_finalize` (``upload_failure="warn"``: an
   :class:`UploadWarning`; ``"raise"``: the error). One outcome per step and rank.

At start (the first thing the thread does), the committed local steps newer, in the
root's commit order, than the newest one committed remotely are queued again: uploads
cut short by a crash, a server down, a ``close()`` past its bound, are resumed.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from asyncckpt.errors import AsyncckptError, CheckpointNotFoundError, InvalidArgumentError, UploadError
from asyncckpt.format import manifest as _manifest
from asyncckpt.io import s3 as _s3
from asyncckpt.root import CheckpointRoot
from asyncckpt.saving.handle import SaveResult

__all__ = ["Uploader", "UploadResult", "UploadWarning", "UploadOutcome"]

_log = logging.getLogger("asyncckpt")


class UploadWarning(UserWarning):
    """An upload to the remote tier failed (``upload_failure="warn"``, the default):
    training goes on, the local step is intact, and it is uploaded again when a manager
    next opens the root."""


@dataclass(frozen=True)
class UploadResult:
    """A step uploaded by this rank (and, on the coordinator, committed remotely).

    Attributes:
        step: the step.
        url: the remote step (``s3://bucket/prefix/step_%08d``).
        bytes: bytes this rank uploaded.
        seconds: wall-clock seconds of this rank's upload.
        resumed: queued at start (a local step not uploaded before), not by a save.
    """

    step: int
    url: str
    bytes: int
    seconds: float
    resumed: bool = False


#: What an upload's completion callback receives.
UploadOutcome = UploadResult | UploadError


@dataclass
class _Job:
    step: int
    files: dict[str, int]  # name -> an open read-only descriptor
    manifest: dict[str, Any]
    callback: Callable[[Any], None] | None
    resumed: bool = False
    queued: float = field(default_factory=time.monotonic)

    def close(self) -> None:
        for fd in self.files.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.files = {}


class Uploader:
    """Uploads a manager's committed steps to ``url`` (see the module docstring).

    Args:
        root: the manager's local root.
        url: ``s3://bucket/prefix``.
        keep_remote: keep this many newest uploaded steps remotely (``None``: all).
        failure: ``"warn"`` or ``"raise"`` (see :meth:`report`).
        timeout_s: seconds :meth:`close` waits for uploads in flight, and the
            coordinator for the other ranks' objects of a step.
        rank, coordinator: this process's rank, and whether it commits remotely.
        callback: the default callback of an upload's outcome.
        read_only: only read the remote tier (no thread, no uploads).
        tier: the remote tier (default ``S3Tier(url)``).

    Raises:
        InvalidArgumentError: a bad ``url``, ``keep_remote``, ``failure`` or ``timeout_s``.
        RemoteStorageError: boto3 (the ``s3`` extra) is not installed.
    """

    def __init__(
        self,
        root: CheckpointRoot,
        url: str,
        *,
        keep_remote: int | None = None,
        failure: Literal["warn", "raise"] = "warn",
        timeout_s: float = 600.0,
        rank: int = 0,
        coordinator: bool = True,
        callback: Callable[[Any], None] | None = None,
        read_only: bool = False,
        tier: _s3.S3Tier | None = None,
    ) -> None:
        self.check_options(url, keep_remote, failure, timeout_s)
        self.root = root
        self.tier = tier or _s3.S3Tier(url)
        self.url = self.tier.url
        self.keep_remote = keep_remote
        self.failure = failure
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self.coordinator = coordinator
        self.callback = callback
        self.read_only = read_only
        self._cond = threading.Condition()
        self._jobs: collections.deque[_Job] = collections.deque()
        self._busy = not read_only  # until the resume at start has queued its steps
        self._closing = False
        self._failures: list[UploadError] = []
        self._thread: threading.Thread | None = None
        if not read_only:
            self._thread = threading.Thread(target=self._run, name="asyncckpt-upload", daemon=True)
            self._thread.start()

    @staticmethod
    def check_options(url: Any, keep_remote: Any, failure: Any, timeout_s: Any) -> None:
        """Check the options of an upload tier, before anything starts.

        Raises:
            InvalidArgumentError: a bad ``url``, ``keep_remote``, ``failure`` or ``timeout_s``.
            RemoteStorageError: boto3 (the ``s3`` extra) is not installed: a setup
                error, raised now rather than once per step.
        """
        if not _s3.is_url(url):
            raise InvalidArgumentError(f"upload_to must be an s3://bucket/prefix URL, not {url!r}")
        if keep_remote is not None and (
            not isinstance(keep_remote, int) or isinstance(keep_remote, bool) or keep_remote < 1
        ):
            raise InvalidArgumentError(f"keep_remote must be an int >= 1 or None, not {keep_remote!r}")
        if failure not in ("warn", "raise"):
            raise InvalidArgumentError(f"upload_failure must be 'warn' or 'raise', not {failure!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise InvalidArgumentError(f"upload_timeout_s must be a number of seconds > 0, not {timeout_s!r}")
        _s3.require_client()

    # ------------------------------------------------------------------ queueing
    def _open(self, step: int, step_dir: Path) -> tuple[dict[str, int], dict[str, Any]]:
        manifest = _manifest.read_manifest(step_dir)
        names = _s3.rank_files(manifest["files"], self.rank, self.coordinator)
        if self.coordinator:
            names.append(_manifest.MANIFEST_NAME)
        fds: dict[str, int] = {}
        try:
            dir_fd = os.open(step_dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                for name in names:
                    fds[name] = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        return fds, manifest

    def _enqueue(self, step: int, callback: Callable[[Any], None] | None, resumed: bool) -> None:
        try:
            fds, manifest = self._open(step, self.root.step_dir(step))
        except (OSError, AsyncckptError) as exc:
            self._settle(
                UploadError(
                    f"upload of step {step} to {self.tier.step_url(step)} failed: its local files cannot be "
                    f"read: {exc}",
                    step,
                    self.tier.step_url(step),
                ),
                callback,
            )
            return
        with self._cond:
            self._jobs.append(_Job(step, fds, manifest, callback, resumed))
            self._cond.notify_all()

    def after_commit(self, outcome: Any, callback: Callable[[Any], None] | None) -> None:
        """(the thread that settled a save) Queue the upload of a committed save
        (``outcome`` a :class:`SaveResult` with a step); failures are not uploaded."""
        if self.read_only or self._closing or not isinstance(outcome, SaveResult) or outcome.step is None:
            return
        self._enqueue(outcome.step, callback if callback is not None else self.callback, False)

    def wrap(self, callback: Callable[[Any], None] | None) -> Callable[[Any], None]:
        """A save's completion callback that queues its upload, then calls ``callback``."""

        def on_saved(outcome: Any) -> None:
            self.after_commit(outcome, callback)
            if callback is not None:
                callback(outcome)

        return on_saved

    # ------------------------------------------------------------------ the thread
    def _resume(self) -> None:
        """Queue the committed local steps newer than the newest one committed remotely."""
        order = self.root.commit_order()
        if not order:
            return
        remote = set(self.tier.steps())
        last = max((i for i, step in enumerate(order) if step in remote), default=-1)
        for step in order[last + 1 :]:
            self._enqueue(step, self.callback, True)

    def _run(self) -> None:
        try:
            self._resume()
        except Exception as exc:  # noqa: BLE001 - reported as the failure of the resume, training goes on
            self._settle(UploadError(f"resuming the uploads to {self.url} failed: {exc}", None, self.url), None)
        with self._cond:
            self._busy = False
            self._cond.notify_all()
        while True:
            with self._cond:
                while not self._jobs and not self._closing:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                self._settle(self._upload(job), job.callback)
            finally:
                job.close()
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _upload(self, job: _Job) -> UploadResult | UploadError:
        url = self.tier.step_url(job.step)
        start = time.monotonic()
        try:
            sent = self.tier.upload_step(
                job.step,
                {name: f"/proc/self/fd/{fd}" for name, fd in job.files.items()},
                job.manifest,
                rank=self.rank,
                coordinator=self.coordinator,
                timeout=self.timeout_s,
            )
        except Exception as exc:  # noqa: BLE001 - any failure is this step's upload failure; training goes on
            return UploadError(
                f"upload of step {job.step} to {url} failed: {type(exc).__name__}: {exc} (the local checkpoint is "
                "intact; the remote step has no commit marker and is uploaded again when a manager opens the root)",
                job.step,
                url,
            )
        if self.coordinator:
            try:
                self._retention(job.step)
            except Exception as exc:  # noqa: BLE001 - the step is uploaded; retention is retried after the next
                _log.warning("remote retention in %s after step %s failed: %s", self.url, job.step, exc)
        return UploadResult(job.step, url, sent, time.monotonic() - start, job.resumed)

    def _retention(self, just_uploaded: int) -> None:
        """(coordinator) Remove the oldest uploads beyond ``keep_remote``, and the objects
        of unmarked steps that are not committed locally (failed uploads)."""
        committed, unmarked = self.tier.scan()
        local = set(self.root.steps())
        with self._cond:
            queued = {job.step for job in self._jobs}
        for step in sorted(unmarked - local - queued - {just_uploaded}):
            self.tier.remove_step(step)
        if self.keep_remote is not None and len(committed) > self.keep_remote:
            order = self.tier.commit_order()
            for step in order[: max(0, len(order) - self.keep_remote)]:
                if step != just_uploaded:
                    self.tier.remove_step(step)

    def _settle(self, outcome: UploadResult | UploadError, callback: Callable[[Any], None] | None) -> None:
        if isinstance(outcome, UploadError):
            _log.warning("%s", outcome)
            with self._cond:
                self._failures.append(outcome)
        if callback is not None:
            try:
                callback(outcome)
            except Exception as exc:  # noqa: BLE001 - a user's callback: logged, the uploads go on
                _log.error("the completion callback of the upload of step %s raised", outcome.step, exc_info=exc)

    # ------------------------------------------------------------------ reporting
    def report(self) -> None:
        """Report the upload failures since the last call: with ``failure="warn"`` an
        :class:`UploadWarning` each; with ``"raise"`` the first is raised (the rest by
        the next calls).

        Raises:
            UploadError: ``failure="raise"`` and an upload failed.
        """
        while True:
            with self._cond:
                if not self._failures:
                    return
                error = self._failures.pop(0)
            if self.failure == "raise":
                raise error
            warnings.warn(str(error), UploadWarning, stacklevel=3)

    def pending(self) -> list[int]:
        """The steps queued or uploading."""
        with self._cond:
            return [job.step for job in self._jobs]

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or uploading; ``False`` on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._jobs or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = None) -> None:
        """Wait, at most ``timeout`` seconds (default ``timeout_s``), for the uploads
        queued, then stop. Steps not uploaded by then are reported as failed (they are
        resumed when a manager opens the root again); an upload still running goes on
        in its daemon thread and commits nothing if the process exits first."""
        if self._thread is None:
            return
        self.wait(self.timeout_s if timeout is None else timeout)
        with self._cond:
            self._closing = True
            left, self._jobs = list(self._jobs), collections.deque()
            self._cond.notify_all()
        for job in left:
            job.close()
            self._settle(
                UploadError(
                    f"upload of step {job.step} to {self.tier.step_url(job.step)} did not start within "
                    f"upload_timeout_s={self.timeout_s:g} s of close(); it is resumed when a manager opens the root",
                    job.step,
                    self.tier.step_url(job.step),
                ),
                job.callback,
            )
        self._thread.join(0.1)

    # ------------------------------------------------------------------ restore
    def newest(self, local_latest: int | None) -> tuple[int, str] | None:
        """The step to restore from over both tiers: ``(step, where)`` with ``where``
        ``"local"`` or the remote step's URL; ``None`` when neither has one.

        The local tier's newest save, unless the remote tier's newest upload is not a
        local step and has a larger step number (a fresh machine, or a root behind the
        bucket). A remote tier that cannot be reached is skipped with a warning.
        """
        try:
            remote = self.tier.latest()
        except (AsyncckptError, OSError) as exc:
            _log.warning("the remote tier %s cannot be listed (%s): restoring from the local root", self.url, exc)
            remote = None
        if remote is not None and (local_latest is None or (remote > local_latest and remote not in self.root.steps())):
            return remote, self.tier.step_url(remote)
        return None if local_latest is None else (local_latest, "local")

    def remote_url(self, step: int) -> str | None:
        """The URL of step ``step`` when it is committed remotely, else ``None``.

        Raises:
            RemoteStorageError: the remote tier cannot be reached.
        """
        head = self.tier.head(step, _manifest.MANIFEST_NAME)
        return None if head is None else self.tier.step_url(step)


def not_found(step: int | None, where: str) -> CheckpointNotFoundError:
    """The error of a restore that finds no step."""
    what = "no committed checkpoint" if step is None else f"step {step} has no committed checkpoint"
    return CheckpointNotFoundError(what, where)
