"""Preemption save: on SIGTERM, a final checkpoint at a step all ranks agree on, then exit.

A cluster that preempts a job sends SIGTERM and gives it a grace period (Slurm's
``KillWait``, Kubernetes' ``terminationGracePeriodSeconds``, torchrun's 30 s) before
SIGKILL. Without this, the newest checkpoint can be up to ``ckpt_every`` steps old.
With it, every rank stops at the same step, waits for the save in flight, saves and
commits that step, and exits with ``128 + signum``, within ``grace_s``; past the
budget, the save is aborted (nothing partial is committed) and the process exits.

The budget starts at the signal, whatever the training thread is doing then (waiting
in ``save()`` for a staging buffer, in :meth:`PreemptionSave.reached`, in
``maybe_finalize``): at its end the main thread is interrupted (SIGALRM), saves
already fully written get a short time to commit, the others are aborted, and the
process exits with ``128 + signum``.

The anchors: Megatron-LM's exit-signal handler (a ``DistributedSignalHandler`` whose
flags are all_gathered each iteration; a checkpoint is saved before exiting) and
Orbax's preemption checkpointing (``CheckpointManager.reached_preemption(step)``: the
hosts agree on the step to save at).

Usage, on every rank::

    with asyncckpt.PreemptionSave(manager, grace_s=30) as preemption:
        for step in range(start, steps):
            train_step()
            if step % every == 0:
                manager.save(step, state_dict())
            if preemption.reached(step):         # collective, never blocks a step
                preemption.finish(step, state_dict())   # commits `step`, exits 128+signum
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from asyncckpt._check import check_step
from asyncckpt.dist import SyncGroup
from asyncckpt.errors import AsyncckptError, InvalidArgumentError, InvalidStateError, PreemptionBudgetExpired

__all__ = ["PreemptionSave"]

_log = logging.getLogger("asyncckpt.preemption")

#: The signals of the PreemptionSave objects alive in this process (inherited by
#: forked DataLoader workers, read by :meth:`PreemptionSave.worker_init_fn`).
_ACTIVE_SIGNALS: set[int] = set()

#: After the grace budget, the abort itself gets this long before the process exits
#: without cleaning up (``os._exit``): a collective blocked on a dead peer cannot be
#: interrupted by a Python signal handler.
HARD_EXIT_SLACK_S = 5.0

#: After the grace budget, saves whose data files are fully written get up to this
#: long (seconds, within ``HARD_EXIT_SLACK_S``) to commit before the rest is aborted:
#: a commit is a rename and a few fsyncs, and a written save is worth keeping.
WRITTEN_COMMIT_S = 3.0

#: How often a wait for the agreement collective wakes up (seconds): a Python signal
#: handler (the grace budget's alarm) runs only between waits.
_POLL_S = 0.005


#: The interrupt raised when the grace budget is spent (a ``SystemExit(128 + signum)``).
_GraceExpired = PreemptionBudgetExpired


class PreemptionSave:
    """Opt-in: on a signal (SIGTERM), all ranks save a final checkpoint, then exit.

    Construct it on every rank, in the main thread (it installs signal handlers),
    after the process group (collective: it may create a gloo group). Its handlers
    only record the signal; the training loop calls :meth:`reached` once per step on
    every rank, and :meth:`finish` when it returns True.

    Agreement (all ranks): :meth:`reached` starts a non-blocking all_gather of each
    rank's received signal (8 bytes) and reads the one started at the previous call,
    which completed during the step in between. So every rank reads the same result
    at the same call and stops at the same step, one step after the first rank saw
    the signal, without ever blocking a step on the collective. Ranks that received
    no signal (a signal sent to one node only) stop too. With one rank, no collective.

    Signals: a repeated signal of ``signals`` is ignored (torchrun forwards the
    scheduler's SIGTERM, so ranks often receive it twice), except SIGINT: a second
    Ctrl-C raises ``KeyboardInterrupt`` as usual.

    DataLoader workers: a scheduler signals every process of the job, and torch's
    DataLoader workers die of SIGTERM; the loader's SIGCHLD handler then raises
    ``RuntimeError: DataLoader worker ... is killed by signal`` at a random point of
    the main thread, which can fail the final save. Pass
    ``worker_init_fn=asyncckpt.PreemptionSave.worker_init_fn`` (or call it from
    yours): the workers then ignore the preemption signals and keep feeding the last
    steps; they still exit with the training process.

    Args:
        manager: the ``CheckpointManager`` that saves the final checkpoint.
        signals: the signals that request a preemption save (default SIGTERM).
        grace_s: seconds from the signal (on ranks without the signal: from the
            agreement) until the save must be committed, whatever the training
            thread waits on meanwhile. At its end the main thread is interrupted
            (SIGALRM, wherever it is: in :meth:`finish`, ``save()``, :meth:`reached`,
            ``maybe_finalize``, or the training step), saves already fully written
            get up to ``WRITTEN_COMMIT_S`` more to commit, the others are aborted
            (nothing partial is committed), and ``SystemExit(128 + signum)`` is
            raised (from :meth:`finish`, or out of the ``with`` block, which does the
            abort); ``HARD_EXIT_SLACK_S`` after the budget the process exits without
            cleanup (``os._exit``), should the main thread be stuck where no signal
            handler runs.
        exit: :meth:`finish` exits the process (``SystemExit(128 + signum)``); with
            ``False`` it returns instead (the budget's end interrupts all the same).

    Raises:
        InvalidArgumentError: (a ``ValueError``) ``grace_s`` is not positive, or ``signals`` is empty.
        InvalidStateError: (a ``RuntimeError``) constructed outside the main thread.
    """

    def __init__(
        self, manager: Any, *, signals: Iterable[int] = (signal.SIGTERM,), grace_s: float = 30.0, exit: bool = True
    ) -> None:
        self._signals = tuple(signal.Signals(s) for s in signals)
        if not self._signals:
            raise InvalidArgumentError("signals must name at least one signal")
        if not (isinstance(grace_s, (int, float)) and grace_s > 0):
            raise InvalidArgumentError(f"grace_s must be a positive number of seconds, not {grace_s!r}")
        if threading.current_thread() is not threading.main_thread():
            raise InvalidStateError("PreemptionSave installs signal handlers: construct it in the main thread")
        self.manager = manager
        if hasattr(manager, "preemption"):  # CheckpointManager.should_save says True once the ranks agreed
            manager.preemption = self
        self.grace_s = float(grace_s)
        self.exit = exit
        #: the signal this rank received first (0: none), and when (time.monotonic())
        self.signum = 0
        self.received_at: float | None = None
        #: the signal the ranks agreed on (0 until :meth:`reached` returned True)
        self.agreed_signum = 0
        self._sync = SyncGroup(getattr(manager, "process_group", None))
        self._pending: tuple[Any, list[torch.Tensor]] | None = None
        #: the end of the grace budget (time.monotonic()), once armed
        self.deadline: float | None = None
        self._alarm: tuple[Any, float, tuple[float, float]] | None = None  # (SIGALRM handler, armed at, itimer)
        self._aborted = False
        self._closed = False
        # The hard exit's watchdog: started here, not in the signal handler (a thread
        # started there could wait for a lock the interrupted main thread holds).
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="asyncckpt-preemption", daemon=True)
        self._watchdog.start()
        self._previous: dict[int, Any] = {}
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        _ACTIVE_SIGNALS.update(s for s in self._signals if s != signal.SIGINT)

    @staticmethod
    def worker_init_fn(worker_id: int) -> None:
        """A DataLoader ``worker_init_fn``: the worker ignores the preemption signals.

        The signals are those of the ``PreemptionSave`` objects of the process that
        forked the worker (SIGTERM for spawn-started workers); SIGINT is left to torch,
        whose workers already ignore Ctrl-C. See the class docstring.

        Args:
            worker_id: the DataLoader worker's index (unused).
        """
        for sig in _ACTIVE_SIGNALS or {signal.SIGTERM}:
            signal.signal(sig, signal.SIG_IGN)

    # ------------------------------------------------------------------ signals
    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.signum:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.signum, self.received_at = signum, time.monotonic()
        _log.warning(
            "asyncckpt: received %s: a final checkpoint at the next agreed step, then exit", signal.Signals(signum).name
        )
        self._arm(signum)  # the budget starts now, whatever the training thread waits on

    # ------------------------------------------------------------------ the budget
    def _watch(self) -> None:
        """The watchdog thread: exits the process ``HARD_EXIT_SLACK_S`` after the budget."""
        while not self._stop.wait(0.2):
            deadline = self.deadline
            if deadline is not None and time.monotonic() >= deadline + HARD_EXIT_SLACK_S:
                self._hard_exit(self.agreed_signum or self.signum or signal.SIGTERM)

    def _arm(self, signum: int) -> None:
        """Start the grace budget (once): a SIGALRM at its end raises :class:`_GraceExpired`
        in the main thread, and the watchdog exits the process ``HARD_EXIT_SLACK_S``
        later. Runs in the signal handler: no lock, no thread started here."""
        if self.deadline is not None or self._closed:
            return
        assert self.received_at is not None
        self.deadline = self.received_at + self.grace_s
        remaining = max(self.deadline - time.monotonic(), 1e-3)
        if threading.current_thread() is threading.main_thread():
            handler = signal.signal(signal.SIGALRM, self._expire)
            previous_timer = signal.setitimer(signal.ITIMER_REAL, remaining)
            self._alarm = (handler, time.monotonic(), previous_timer)

    def _expire(self, signum: int, frame: FrameType | None) -> None:
        if self._aborted or self._closed:
            return
        raise _GraceExpired(128 + (self.agreed_signum or self.signum or signal.SIGTERM))

    def _disarm_alarm(self) -> None:
        """Stop the budget's alarm and give SIGALRM back (its handler, and a timer that
        was running, e.g. pytest-timeout's, with what is left of it). Main thread."""
        alarm, self._alarm = self._alarm, None
        if alarm is None or threading.current_thread() is not threading.main_thread():
            return
        handler, armed_at, (delay, interval) = alarm
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, handler if handler is not None else signal.SIG_DFL)
        if delay > 0:
            signal.setitimer(signal.ITIMER_REAL, max(delay - (time.monotonic() - armed_at), 1e-3), interval)

    def _abort(self, step: int | None, reason: str) -> None:
        """Past the budget (or after a failure): let fully written saves commit (for up to
        ``WRITTEN_COMMIT_S``), abort the rest, log what is committed."""
        self._aborted = True
        self._disarm_alarm()
        kept = _commit_written(self.manager, WRITTEN_COMMIT_S)
        signum = self.agreed_signum or self.signum or signal.SIGTERM
        if step is not None and step in self.manager.steps():  # the interrupt came after its commit point
            what = f"step {step} is committed, but the end of its commit was cut short"
        else:
            what = f"the final checkpoint of step {step} was aborted" if step is not None else "no final checkpoint"
        if kept:
            reason += f" (step(s) {', '.join(map(str, kept))}, fully written, committed after the budget)"
        _log.error(
            "asyncckpt: %s: %s: %s; newest committed: %s",
            signal.Signals(signum).name,
            what,
            reason,
            _newest(self.manager),
        )
        try:
            self.manager.close(abort=True)
        except Exception as exc:  # noqa: BLE001 - exiting anyway; only for the log
            _log.error("asyncckpt: the abort failed: %s", exc)

    def _restore_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    # ------------------------------------------------------------------ agreement
    def reached(self, step: int) -> bool:
        """(all ranks, once per step) True when the ranks agreed to stop at ``step``.

        Collective on the manager's process group (non-blocking; see the class).

        Args:
            step: the step just completed (only used in the log).

        Returns:
            True on every rank at the same call, once any rank received a signal.

        Raises:
            InvalidArgumentError: (a ``ValueError`` and ``TypeError``) ``step`` is not a
                non-negative int (numpy / torch integer scalars are fine, ``bool`` is not).
        """
        step = check_step(step)
        if self.agreed_signum:
            return True
        if not self._sync.active:
            agreed = self.signum
        else:
            agreed = 0
            if self._pending is not None:
                work, out = self._pending
                while not work.is_completed():  # a short sleep: the budget's alarm can end it
                    time.sleep(_POLL_S)
                self._pending = None
                work.wait()
                agreed = max(int(t.item()) for t in out)
            if not agreed:
                local = torch.tensor([self.signum], dtype=torch.int64)
                out = [torch.empty_like(local) for _ in range(self._sync.world_size)]
                self._pending = (dist.all_gather(out, local, group=self._sync.gloo, async_op=True), out)
        if agreed:
            self.agreed_signum = agreed
            if self.received_at is None:
                self.received_at = time.monotonic()
            self._arm(agreed)
            _log.info("asyncckpt: %s: the ranks stop at step %d", signal.Signals(agreed).name, step)
        return bool(agreed)

    # ------------------------------------------------------------------ the final save
    def finish(self, step: int, state_dict: dict[str, Any] | Callable[[], dict[str, Any]]) -> int | None:
        """(all ranks) Wait for the save in flight, save and commit ``step``, then exit.

        Call it on every rank when :meth:`reached` returned True. If ``step`` is
        committed already (the loop saved it just before), it is not saved again.
        Within the grace budget the final save is synchronous (staged, written,
        committed); past it, it is aborted and nothing partial is committed.

        Args:
            step: the step to checkpoint (the one :meth:`reached` was called with).
            state_dict: the state to save, or a function returning it (called only
                if ``step`` still needs saving).

        Returns:
            (only with ``exit=False``) ``step`` if it is committed, else ``None``.

        Raises:
            SystemExit: with ``128 + signum``, unless ``exit=False``.
            InvalidStateError: (a ``RuntimeError``) :meth:`reached` has not returned True.
            InvalidArgumentError: (a ``ValueError`` and ``TypeError``) ``step`` is not a
                non-negative int; raised before anything is saved or closed.
        """
        step = check_step(step, hint="; the call is finish(step, state_dict)")
        if not self.agreed_signum:
            raise InvalidStateError("finish() is for after reached() returned True")
        signum = self.agreed_signum
        self._arm(signum)
        assert self.deadline is not None
        deadline = self.deadline
        t0 = time.monotonic()
        committed: int | None = None
        try:
            try:
                if time.monotonic() >= deadline:
                    raise _GraceExpired(128 + signum)
                try:
                    self.manager.maybe_finalize(blocking=True)  # the save in flight
                except AsyncckptError as exc:
                    _log.error("asyncckpt: the save in flight failed: %s", str(exc).splitlines()[0])
                if step not in self.manager.steps():
                    self.manager.save(step, state_dict() if callable(state_dict) else state_dict, async_op=False)
                self.manager.close()
                committed = step
                self._disarm_alarm()
            except (_GraceExpired, AsyncckptError) as exc:
                if committed is None:
                    reason = (
                        f"the grace budget of {self.grace_s:.0f} s ran out"
                        if isinstance(exc, _GraceExpired)
                        else str(exc)
                    )
                    if "DataLoader worker" in reason:
                        reason += (
                            "\n(DataLoader workers died of the signal: pass "
                            "worker_init_fn=asyncckpt.PreemptionSave.worker_init_fn to the DataLoader)"
                        )
                    self._abort(step, reason)
                    if step in self.manager.steps():  # renamed before the interrupt: it is the disk's
                        committed = step
            if committed is not None:
                _log.warning(
                    "asyncckpt: %s: step %d committed in %.2f s (%.1f s of the %.0f s grace left)",
                    signal.Signals(signum).name,
                    step,
                    time.monotonic() - t0,
                    deadline - time.monotonic(),
                    self.grace_s,
                )
        finally:
            self.close()
        if self.exit:
            raise SystemExit(128 + signum)
        return committed

    @staticmethod
    def _hard_exit(signum: int) -> None:
        _log.error("asyncckpt: the abort after the grace budget did not finish; exiting now")
        logging.shutdown()
        os._exit(128 + signum)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Complete the agreement collective in flight and restore the signal handlers.

        (all ranks, if any rank has a collective in flight: every rank has.) Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        self._disarm_alarm()
        pending, self._pending = self._pending, None
        if pending is not None and not self._aborted:  # aborted: a peer may never join it
            try:
                pending[0].wait()
            except Exception:  # noqa: BLE001 - the group may be gone at shutdown
                pass
        self._stop.set()  # the watchdog exits (it watched the wait above)
        self._restore_handlers()
        _ACTIVE_SIGNALS.difference_update(self._signals)

    def __enter__(self) -> PreemptionSave:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        """Past the budget (:class:`_GraceExpired` out of the block: the training thread was
        still waiting, e.g. in ``save()`` for a staging buffer): the abort of
        :meth:`finish`, then the ``SystemExit(128 + signum)`` goes on."""
        try:
            if isinstance(exc, _GraceExpired) and not self._aborted:
                self._abort(
                    None,
                    f"the grace budget of {self.grace_s:.0f} s ran out before finish() (the "
                    "training thread was still busy or waiting, e.g. in save() for a staging buffer)",
                )
        finally:
            self.close()


def _newest(manager: Any) -> Any:
    try:
        return manager.latest_step()
    except Exception:  # noqa: BLE001 - only for the log line
        return "unknown"


def _commit_written(manager: Any, timeout: float) -> list[int]:
    """Wait up to ``timeout`` s for ``manager``'s pending saves whose data files are fully
    written (on this rank) to settle; the steps of those that committed."""
    saver = getattr(manager, "_saver", None)
    queue = getattr(manager, "queue", None)
    if saver is None or queue is None or queue.closed or not queue.background_finalize:
        return []
    deadline = time.monotonic() + timeout
    kept = []
    for record in saver.pending_records():
        idx = record.handle.call_idx
        if idx is None or not _fully_written(queue, idx):
            continue  # still staging or writing: aborted
        concurrent.futures.wait([record.handle], max(0.0, deadline - time.monotonic()))
        if record.handle.done() and record.handle.exception(timeout=0) is None:
            kept.append(record.step)
    return kept


def _fully_written(queue: Any, call_idx: int) -> bool:
    """Whether this rank's data files of ``call_idx`` are written and fsynced: its write
    returned (its outcome is waiting for the finalizer, or the commit runs now)."""
    outcome = queue.caller.outcome(call_idx)
    if outcome is not None:
        return bool(outcome.ok)
    try:
        queue.get_result(call_idx)  # being committed now
    except KeyError:
        return False
    return True
