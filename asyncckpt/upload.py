"""The upload tier of a :class:`~asyncckpt.CheckpointManager`: committed local steps,
copied to object storage in the background (``CheckpointManager(...,
upload_to="s3://bucket/prefix")``).

One :class:`Uploader` per manager, one thread of its own (``asyncckpt-upload``), so
that an upload never runs on the training thread nor in the queue's finalizer thread
(which commits the next save), and never delays a save's stall: the training thread
only appends to a list. The bytes themselves go up from a process of its own, the
upload agent (:mod:`asyncckpt.io.s3_agent`, started by the upload thread on the first
upload), so that the requests' Python work (botocore) never competes with the training
thread for its GIL; the upload thread sends it each step's open files and waits. The
tier and its remote commit protocol are :mod:`asyncckpt.io.s3`.

The life of a step's upload (each rank; no collective):

1. (the queue's finalizer thread, in the save's completion callback, after the local
   commit and its retention) :meth:`Uploader.after_commit` opens this rank's files of
   the step (its data files; on the coordinator also the metadata files and the
   manifest) and queues the job. The open descriptors keep the bytes readable even if
   local retention (``keep_last``) removes the directory before the upload ends. If
   the uploads fell behind the saves (decided by all ranks in the save's plan,
   :meth:`Uploader.ticket`), the steps waiting are dropped for this one first
   (:class:`UploadSkipped`): the backlog, and the bytes it holds, stay bounded.
2. (the upload agent, for the upload thread) each rank uploads its files (multipart,
   CRC32 per part); the coordinator waits until every rank's objects carry the save's
   token, writes the commit marker, then ``latest``; then (the coordinator's upload
   thread) remote retention (``keep_remote``: the oldest uploads go first; objects of
   unmarked steps that are not committed locally are leftovers of failed uploads and
   go too).
3. The outcome, an :class:`UploadResult` or an :class:`~asyncckpt.errors.UploadError`,
   goes to the save's completion callback, and to the next
   :meth:`CheckpointManager.maybe_finalize` (``upload_failure="warn"``: an
   :class:`UploadWarning`; ``"raise"``: the error). One outcome per step and rank.

At start (the first thing the thread does), the committed local steps newer, in the
root's commit order, than the newest one committed remotely are queued again: uploads
cut short by a crash, a server down, a ``close()`` past its bound, are resumed.

The end: :meth:`Uploader.close` (``upload_timeout_s``), or, for a process that exits
without it, the exit phase ``FINISH_UPLOADS`` (:mod:`asyncckpt._exit`,
``ASYNCCKPT_EXIT_TIMEOUT_S``), waits for the queue, then :meth:`Uploader.give_up`
names every step not uploaded, cancels the one in flight (no marker) and stops the
agent: bounded, and nothing dropped without a word. The upload thread and the agent
run at nice 10 (Linux).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from asyncckpt import _exit, _faults
from asyncckpt.errors import (
    AsyncckptError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    RemoteStorageError,
    UploadError,
)
from asyncckpt.format import manifest as _manifest
from asyncckpt.io import s3 as _s3
from asyncckpt.io import s3_agent as _s3_agent
from asyncckpt.root import CheckpointRoot
from asyncckpt.saving.handle import SaveResult

__all__ = ["Uploader", "UploadResult", "UploadSkipped", "UploadTicket", "UploadWarning", "UploadOutcome"]

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


@dataclass(frozen=True)
class UploadSkipped:
    """A committed step whose upload this rank dropped because the uploads fell behind
    the saves (see :meth:`Uploader.ticket`): a newer step superseded it. Not a
    failure: the local step is intact (until local retention), the remote tier gets
    the newer step instead, and the step is not uploaded later (a newer one is).

    Attributes:
        step: the step not uploaded.
        url: where it would have gone.
        superseded_by: the step whose save found the uploads behind; it is uploaded.
    """

    step: int
    url: str
    superseded_by: int


#: What an upload's completion callback receives.
UploadOutcome = UploadResult | UploadSkipped | UploadError

#: How many committed steps may wait, on any rank, behind the upload in flight before
#: the uploads count as behind the saves. Each waiting step holds its files open (their
#: bytes stay on disk after local retention removed them), so a backlog that grew with
#: every save would fill the disk and the process's descriptors (found with an upload
#: slower than the saves: 4 descriptors and one step's bytes more per save).
MAX_WAITING_UPLOADS = 3


class UploadTicket:
    """A save's part in the decision whether the uploads are behind the saves, taken by
    every rank together in the save's first collective (the plan's, no collective of
    its own; :meth:`Uploader.ticket`).

    Attributes:
        share: this rank's ``(steps waiting, the step the coordinator is uploading or -1)``.
        behind: (after :meth:`decide`) some rank has :data:`MAX_WAITING_UPLOADS` steps
            waiting: when this save commits, the waiting steps are dropped for it.
        keep: the step the coordinator is uploading (``-1``: none), which every rank
            keeps: the coordinator waits for every rank's objects of it.
    """

    __slots__ = ("share", "behind", "keep")

    def __init__(self, share: tuple[int, int]) -> None:
        self.share = share
        self.behind = False
        self.keep = -1

    def decide(self, shares: list[list[int]]) -> None:
        """Every rank's :attr:`share` (by rank, the same list on every rank)."""
        self.behind = max(s[0] for s in shares) >= MAX_WAITING_UPLOADS
        self.keep = max(s[1] for s in shares)


@dataclass
class _Job:
    step: int
    files: dict[str, int]  # name -> an open read-only descriptor
    manifest: dict[str, Any]
    callback: Callable[[Any], None] | None
    resumed: bool = False
    queued: float = field(default_factory=time.monotonic)
    cancel: threading.Event = field(default_factory=threading.Event)
    settled: bool = False  # its outcome was reported (close() or the exit may report it first)

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
        process: upload the bytes from a process of its own
            (:class:`asyncckpt.io.s3_agent.UploadProcess`, the default), so that the
            upload's Python work never takes the training process's GIL; ``False``: in
            this process's upload thread (no extra process).

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
        process: bool = True,
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
        self._skipped = 0  # steps dropped because the uploads fell behind (UploadSkipped)
        self._current: _Job | None = None
        #: This job's name in the prefix's lease (see "Whose prefix" in :mod:`asyncckpt.io.s3`).
        self._lease_root = str(root.path)  # (absolute: CheckpointRoot makes it so)
        #: When the lease was last found this job's (or free), by ``time.monotonic()``;
        #: re-read after a quarter of ``LEASE_TTL_S`` (the coordinator renews it then).
        self._lease_checked: float | None = None
        self._thread: threading.Thread | None = None
        self._agent = _s3_agent.UploadProcess(self.tier) if process and not read_only else None
        if not read_only:
            _live.add(self)
            _exit.arm()
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
        job = _Job(step, fds, manifest, callback, resumed)
        with self._cond:
            closing = self._closing
            if not closing:
                self._jobs.append(job)
                self._cond.notify_all()
        if closing:  # queued after give_up() (a resume at start still listing): reported, not dropped
            job.close()
            url = self.tier.step_url(step)
            self._settle(
                UploadError(f"upload of step {step} to {url} did not start: the uploads were stopped", step, url),
                callback,
            )

    def after_commit(
        self, outcome: Any, callback: Callable[[Any], None] | None, ticket: UploadTicket | None = None
    ) -> None:
        """(the thread that settled a save) Queue the upload of a committed save
        (``outcome`` a :class:`SaveResult` with a step); failures are not uploaded.
        With a ``ticket`` that found the uploads behind, the steps waiting are dropped
        first (:meth:`_supersede`)."""
        if self.read_only or self._closing or not isinstance(outcome, SaveResult) or outcome.step is None:
            return
        callback = callback if callback is not None else self.callback
        if ticket is not None and ticket.behind:
            self._supersede(outcome.step, ticket.keep)
        self._enqueue(outcome.step, callback, False)

    def ticket(self) -> UploadTicket:
        """(the training thread, in ``save``) This rank's share of the decision whether
        the uploads fell behind the saves: the steps waiting here, and on the
        coordinator the step it is uploading. The save's plan gathers every rank's
        (:func:`~asyncckpt.saving.planning.plan_save`'s ``share``), so that every rank
        decides the same: when some rank has :data:`MAX_WAITING_UPLOADS` steps
        waiting, every rank drops its waiting steps once this save commits, but the one
        the coordinator is uploading, and uploads this save's step next. So the backlog
        (and the files it holds open) stays bounded, the newest step always goes up,
        and no rank drops a step the coordinator waits for (it would wait until
        ``timeout_s``); a rank uploads a dropped step in vain only where it had started
        it before the decision reached it (its objects are never marked)."""
        with self._cond:
            current = self._current.step if self.coordinator and self._current is not None else -1
            return UploadTicket((len(self._jobs), current))

    def wrap(self, callback: Callable[[Any], None] | None, ticket: UploadTicket | None = None) -> Callable[[Any], None]:
        """A save's completion callback that queues its upload, then calls ``callback``."""

        def on_saved(outcome: Any) -> None:
            self.after_commit(outcome, callback, ticket)
            if callback is not None:
                callback(outcome)

        return on_saved

    def _supersede(self, by: int, keep: int) -> None:
        """(the thread that settled step ``by``) The uploads are behind the saves: drop
        every step waiting but ``keep`` (the one the coordinator is uploading); on the
        coordinator, cancel the upload in flight unless it is ``keep`` (it started
        after the decision, and the other ranks drop it). Each is reported as
        :class:`UploadSkipped`."""
        with self._cond:
            if self._closing:
                return
            dropped = [job for job in self._jobs if job.step != keep]
            self._jobs = collections.deque(job for job in self._jobs if job.step == keep)
            current = self._current
            if self.coordinator and current is not None and current.step != keep and not current.settled:
                current.settled = True
                current.cancel.set()  # its descriptors are closed by the upload thread, once it stops
                dropped.append(current)
        for job in dropped:
            if job is not current:
                job.close()
            self._settle(UploadSkipped(job.step, self.tier.step_url(job.step), by), job.callback)

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

    # ------------------------------------------------------------------ the lease
    def _renewal_in(self) -> float | None:
        """(holding the condition) Seconds until the coordinator renews the lease it
        holds, or ``None`` (not the coordinator, or no lease taken yet)."""
        if not self.coordinator or self._lease_checked is None:
            return None
        return max(0.0, self._lease_checked + _s3.LEASE_TTL_S / 4 - time.monotonic())

    def _lease(self, renew: bool = False, cancel: threading.Event | None = None) -> _s3.Lease | None:
        """(upload thread) Before an upload: the prefix is this job's or free, read at
        most every ``LEASE_TTL_S / 4`` seconds (``renew``: now). The coordinator then
        writes the lease, on the condition that it is still as read (a takeover of a
        lease that no longer holds is logged); another writer first: read again. The
        other ranks wait (``cancel``, at most ``timeout_s``) until the lease is their
        coordinator's. Returns the lease of the other job that holds the prefix (the
        upload must not start), or ``None``.

        Raises:
            RemoteStorageError: the lease cannot be read or written, or the
                coordinator's lease did not come within ``timeout_s``.
        """
        if not renew and self._lease_checked is not None:
            if time.monotonic() - self._lease_checked < _s3.LEASE_TTL_S / 4:
                return None
        deadline = time.monotonic() + self.timeout_s
        delay, raced, waiting = 0.05, 0, False
        while True:
            lease = self.tier.read_lease()
            if lease is not None and lease.root != self._lease_root and lease.holds():
                self._lease_checked = None
                return lease
            if self.coordinator:
                if lease is not None and lease.root != self._lease_root:
                    _log.warning("asyncckpt: %s is taken over from %s: that lease no longer holds", self.url, lease)
                _faults.hit("lease")
                if not self.tier.write_lease(self._lease_root, replaces=lease):
                    raced += 1  # (another job wrote it since: whose it is now decides)
                    if raced >= 100:  # (bounded: a server that refuses every condition)
                        raise RemoteStorageError(f"the lease of {self.url} changed at each of {raced} writes")
                    continue
            elif lease is None or lease.root != self._lease_root:
                # Not yet taken by this job's coordinator: nothing goes up before it is.
                if not waiting:
                    waiting = True
                    _log.info(
                        "asyncckpt: rank %d waits for its coordinator's lease of %s (found: %s)",
                        self.rank,
                        self.url,
                        lease or "none",
                    )
                if time.monotonic() > deadline:
                    raise RemoteStorageError(
                        f"the coordinator's lease of {self.url} did not come within {self.timeout_s:g} s "
                        f"(found: {lease or 'none'})"
                    )
                if (cancel or threading.Event()).wait(delay):
                    raise RemoteStorageError(f"cancelled while waiting for the coordinator's lease of {self.url}")
                delay = min(1.0, delay * 2)
                continue
            self._lease_checked = time.monotonic()
            return None

    def _release_lease(self, bound_s: float = 2.0) -> None:
        """(coordinator, at the end) Delete the lease if it is still this job's, within
        ``bound_s`` seconds (a server that does not answer: it lapses by itself, and
        this root's next manager takes it over at once). The upload thread ends first
        (within the same bound): a renewal it had under way would write the lease
        again after the deletion."""
        if not self.coordinator or self._lease_checked is None:
            return
        deadline = time.monotonic() + bound_s
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(bound_s)

        def release() -> None:
            try:
                lease = self.tier.read_lease()
                if lease is not None and lease.root == self._lease_root:
                    self.tier.remove_lease(lease)  # (if it is still the one read)
            except Exception as exc:  # noqa: BLE001 - it lapses by itself
                _log.info("asyncckpt: the lease of %s was not removed: %s", self.url, exc)

        self._lease_checked = None
        worker = threading.Thread(target=release, name="asyncckpt-lease", daemon=True)
        try:
            worker.start()
        except RuntimeError:  # (no new thread this late in the interpreter's exit: it lapses)
            return
        worker.join(max(0.1, deadline - time.monotonic()))

    def _run(self) -> None:
        _s3.lower_thread_priority()
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
                    wait = self._renewal_in()
                    if wait == 0.0:
                        break
                    self._cond.wait(wait)
                if not self._jobs:
                    if self._closing:
                        return
                    renew = True  # (between uploads: the coordinator's lease is renewed)
                else:
                    renew = False
                    job = self._jobs.popleft()
                    self._busy = True
                    self._current = job
            if renew:
                try:
                    self._lease(renew=True)
                except Exception as exc:  # noqa: BLE001 - the next upload tries again, and fails if it must
                    _log.warning("asyncckpt: the lease of %s was not renewed: %s", self.url, exc)
                    with self._cond:
                        self._lease_checked = time.monotonic()  # (tried again after a quarter of its life)
                continue
            try:
                outcome = self._upload(job)
                with self._cond:
                    first, job.settled = not job.settled, True
                if first:
                    self._settle(outcome, job.callback)
                else:  # close() or the exit gave up on it and reported it: one outcome per step
                    _log.info(
                        "the upload of step %s ended after it was reported as not finished: %s", job.step, outcome
                    )
            finally:
                job.close()
                with self._cond:
                    self._busy = False
                    self._current = None
                    self._cond.notify_all()

    def _upload(self, job: _Job) -> UploadResult | UploadError:
        url = self.tier.step_url(job.step)
        start = time.monotonic()
        try:
            other = self._lease(cancel=job.cancel)
            if other is not None:
                return UploadError(
                    f"upload of step {job.step} to {url} refused: {self.url} is in use by {other}, whose steps this "
                    f"job's uploads would overwrite and whose retention would remove this job's; give each job a "
                    f"prefix of its own (the local checkpoint is intact and is uploaded when a manager of this root "
                    f"opens with the prefix free)",
                    job.step,
                    url,
                )
            upload: Callable[..., int]
            files: dict[str, Any]
            if self._agent is not None:  # the bytes go up from the upload process (its own GIL)
                upload, files = self._agent.upload_step, dict(job.files)
            else:
                upload = self.tier.upload_step
                files = {name: f"/proc/self/fd/{fd}" for name, fd in job.files.items()}
            sent = upload(
                job.step,
                files,
                job.manifest,
                rank=self.rank,
                coordinator=self.coordinator,
                timeout=self.timeout_s,
                cancel=job.cancel,
            )
        except CorruptCheckpointError as exc:  # the local files differ from their manifest's CRC-32s
            return UploadError(
                f"upload of step {job.step} to {url} failed: {exc} (the local checkpoint is damaged: `asyncckpt "
                "verify` names it; the remote step has no commit marker)",
                job.step,
                url,
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

    def _settle(self, outcome: UploadOutcome, callback: Callable[[Any], None] | None) -> None:
        if isinstance(outcome, UploadSkipped):
            first, self._skipped = self._skipped == 0, self._skipped + 1
            _log.log(
                logging.WARNING if first else logging.INFO,
                "the uploads to %s are behind the saves: step %s is not uploaded, step %s (saved since) is "
                "uploaded instead%s",
                self.url,
                outcome.step,
                outcome.superseded_by,
                f" (this happens whenever {MAX_WAITING_UPLOADS} steps wait for their upload; save less often, or "
                "give the uploads more bandwidth; later steps skipped so are logged at INFO)"
                if first
                else "",
            )
        elif isinstance(outcome, UploadError):
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

    def close(self, timeout: float | None = None, *, bound: str | None = None) -> None:
        """Wait, at most ``timeout`` seconds (default ``timeout_s``), for the uploads
        queued, then stop (see :meth:`give_up`; ``bound`` names the bound in its
        reports, default ``upload_timeout_s``)."""
        if self._thread is None:
            return
        seconds = self.timeout_s if timeout is None else timeout
        self.wait(seconds)
        self.give_up(bound or f"upload_timeout_s={seconds:g} s of close()")

    def give_up(self, within: str) -> list[int]:
        """Stop: each step not uploaded yet is reported (its callback, and
        :meth:`report`) as an :class:`UploadError` that names it and ``within`` (the
        bound that ran out): the one uploading is cancelled (it stops before its next
        part, its multipart uploads are aborted, its commit marker is not written),
        the queued ones are dropped. Every one of them is uploaded again when a
        manager next opens the root (the resume at start). Returns their steps."""
        with self._cond:
            self._closing = True
            left, self._jobs = list(self._jobs), collections.deque()
            current = self._current
            if current is not None and not current.settled:
                current.settled = True
                current.cancel.set()
            else:
                current = None
            self._cond.notify_all()
        _live.discard(self)
        if current is not None:  # its descriptors are closed by the upload thread, once it stops
            url = self.tier.step_url(current.step)
            self._settle(
                UploadError(
                    f"upload of step {current.step} to {url} did not finish within {within}: cancelled, no commit "
                    "marker (the step is absent remotely); it is uploaded again when a manager opens the root",
                    current.step,
                    url,
                ),
                current.callback,
            )
        for job in left:
            job.close()
            self._settle(
                UploadError(
                    f"upload of step {job.step} to {self.tier.step_url(job.step)} did not start within {within}; "
                    "it is uploaded again when a manager opens the root",
                    job.step,
                    self.tier.step_url(job.step),
                ),
                job.callback,
            )
        if self._agent is not None:  # after the cancel: its multipart uploads aborted, bounded
            self._agent.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(0.1)
        self._release_lease()
        return ([] if current is None else [current.step]) + [job.step for job in left]

    # ------------------------------------------------------------------ restore
    def newest(self, local_latest: int | None) -> tuple[int, str] | None:
        """The step to restore from over both tiers: ``(step, where)`` with ``where``
        ``"local"`` or the remote step's URL; ``None`` when neither has one.

        Each tier's newest save is its last in its own commit order (the local root's
        ``commit_seq``, the bucket's upload sequence); of the two, the one committed
        last wins, by the wall-clock time each manifest records at its commit
        (``created_unix_s``): after a rollback (step 20 saved, then 11 from a restart
        at step 10) the newer save 11 wins over 20, whichever tier holds it, and a
        fresh machine (an empty root, or one behind the bucket) takes the bucket's.
        Orbax and NVRx compare step numbers instead, which resumes the abandoned branch
        after such a rollback. Wall clocks of different hosts agree to far less than
        the time between two saves of one run (NTP). The same save in both tiers (the
        same save token) is read locally. When a time is missing (a manifest of an
        older version), the step numbers decide, as before. A remote tier that cannot
        be reached is skipped with a warning.
        """
        try:
            remote = self.tier.latest()
            marker = None if remote is None else _s3.read_marker(self.tier, _s3.parse_url(self.tier.step_url(remote)))
        except (AsyncckptError, OSError) as exc:
            _log.warning("the remote tier %s cannot be listed (%s): restoring from the local root", self.url, exc)
            remote, marker = None, None
        if remote is None or marker is None:
            return None if local_latest is None else (local_latest, "local")
        remote_url = self.tier.step_url(remote)
        if local_latest is None:
            return remote, remote_url
        try:
            local = _manifest.read_manifest(self.root.step_dir(local_latest))
        except (AsyncckptError, OSError):  # removed meanwhile (retention): the bucket's
            return remote, remote_url
        if local.get("save_token") is not None and local.get("save_token") == marker.manifest.get("save_token"):
            return local_latest, "local"  # the same save
        local_t, remote_t = local.get("created_unix_s"), marker.manifest.get("created_unix_s")
        if isinstance(local_t, (int, float)) and isinstance(remote_t, (int, float)):
            newer_remote = remote_t > local_t
        else:
            newer_remote = remote > local_latest and remote not in self.root.steps()
        if newer_remote and remote in self.root.steps():
            try:  # the step is also local: read it there when it is the same save
                if _manifest.read_manifest(self.root.step_dir(remote)).get("save_token") == marker.manifest.get(
                    "save_token"
                ):
                    return remote, "local"
            except (AsyncckptError, OSError):
                pass
        return (remote, remote_url) if newer_remote else (local_latest, "local")

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


#: The uploaders running in this process (the exit phase ``FINISH_UPLOADS``).
_live: weakref.WeakSet[Uploader] = weakref.WeakSet()


def _finish_uploads_at_exit() -> None:
    """The exit phase ``FINISH_UPLOADS`` (a process that exits without ``close()``):
    the uploads queued or in flight get ``ASYNCCKPT_EXIT_TIMEOUT_S`` seconds (default
    5) in all; each step not uploaded then is named (a warning on logger
    ``asyncckpt``, and an :class:`UploadError` to its callback) and cancelled, and is
    uploaded again at the next start. Interrupted (Ctrl-C), they are named at once."""
    uploaders = list(_live)
    if not uploaders:
        return
    bound = 0.0 if _exit.interrupted() else _exit.exit_timeout()
    deadline = time.monotonic() + bound
    for uploader in uploaders:
        uploader.wait(max(0.0, deadline - time.monotonic()))
    for uploader in uploaders:
        uploader.give_up(f"the exit's bound ({_exit.EXIT_TIMEOUT_ENV}={bound:g} s)")


_exit.register(_exit.FINISH_UPLOADS, _finish_uploads_at_exit, forget=_live.clear)
