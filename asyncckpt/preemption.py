"""Preemption save: on SIGTERM, a final checkpoint at a step all ranks agree on, then exit.

A cluster that preempts a job sends SIGTERM and gives it a grace period (Slurm's
``KillWait``, Kubernetes' ``terminationGracePeriodSeconds``, torchrun's 30 s) before
SIGKILL. Without this, the newest checkpoint can be up to ``ckpt_every`` steps old.
With it, every rank stops at the same step, waits for the save in flight, saves and
commits that step, and exits with ``128 + signum``, within ``grace_s``; past the
budget, the save is aborted (nothing partial is committed) and the process exits.

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

import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from ._check import check_step
from .dist import SyncGroup
from .errors import AsyncckptError

__all__ = ["PreemptionSave"]

_log = logging.getLogger("asyncckpt.preemption")

#: The signals of the PreemptionSave objects alive in this process (inherited by
#: forked DataLoader workers, read by :meth:`PreemptionSave.worker_init_fn`).
_ACTIVE_SIGNALS: set[int] = set()

#: After the grace budget, the abort itself gets this long before the process exits
#: without cleaning up (``os._exit``): a collective blocked on a dead peer cannot be
#: interrupted by a Python signal handler.
HARD_EXIT_SLACK_S = 5.0


class _GraceExpired(BaseException):
    """Raised in the main thread when the grace budget is spent (an interrupt, as
    ``KeyboardInterrupt``: the library's waits treat it as one)."""


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
            agreement) until the save must be committed; after that, the save is
            aborted and the process exits all the same (``HARD_EXIT_SLACK_S`` later
            it exits without cleanup, should the abort itself hang).
        exit: :meth:`finish` exits the process (``SystemExit(128 + signum)``); with
            ``False`` it returns instead.

    Raises:
        ValueError: ``grace_s`` is not positive, or ``signals`` is empty.
        RuntimeError: constructed outside the main thread.
    """

    def __init__(self, manager: Any, *, signals: Iterable[int] = (signal.SIGTERM,), grace_s: float = 30.0,
                 exit: bool = True) -> None:
        self._signals = tuple(signal.Signals(s) for s in signals)
        if not self._signals:
            raise ValueError("signals must name at least one signal")
        if not (isinstance(grace_s, (int, float)) and grace_s > 0):
            raise ValueError(f"grace_s must be a positive number of seconds, not {grace_s!r}")
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionSave installs signal handlers: construct it in the main thread")
        self.manager = manager
        self.grace_s = float(grace_s)
        self.exit = exit
        #: the signal this rank received first (0: none), and when (time.monotonic())
        self.signum = 0
        self.received_at: float | None = None
        #: the signal the ranks agreed on (0 until :meth:`reached` returned True)
        self.agreed_signum = 0
        self._sync = SyncGroup(getattr(manager, "process_group", None))
        self._pending: tuple[Any, list[torch.Tensor]] | None = None
        self._previous: dict[int, Any] = {}
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        _ACTIVE_SIGNALS.update(s for s in self._signals if s != signal.SIGINT)
        self._closed = False

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
        _log.warning("asyncckpt: received %s: a final checkpoint at the next agreed step, then exit",
                     signal.Signals(signum).name)

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
            RuntimeError: :meth:`reached` has not returned True.
            InvalidArgumentError: (a ``ValueError`` and ``TypeError``) ``step`` is not a
                non-negative int; raised before anything is saved or closed.
        """
        step = check_step(step, hint="; the call is finish(step, state_dict)")
        if not self.agreed_signum:
            raise RuntimeError("finish() is for after reached() returned True")
        signum = self.agreed_signum
        assert self.received_at is not None
        deadline = self.received_at + self.grace_s
        t0 = time.monotonic()
        committed: int | None = None
        hard_exit = threading.Timer(max(deadline - t0, 0.0) + HARD_EXIT_SLACK_S, self._hard_exit, (signum,))
        hard_exit.daemon = True
        hard_exit.start()
        try:
            with _alarm_at(deadline):
                try:
                    self.manager.maybe_finalize(blocking=True)  # the save in flight
                except AsyncckptError as exc:
                    _log.error("asyncckpt: the save in flight failed: %s", str(exc).splitlines()[0])
                if step not in self.manager.steps():
                    self.manager.save(step, state_dict() if callable(state_dict) else state_dict, async_op=False)
                self.manager.close()
            committed = step
            _log.warning("asyncckpt: %s: step %d committed in %.2f s (%.1f s of the %.0f s grace left)",
                         signal.Signals(signum).name, step, time.monotonic() - t0, deadline - time.monotonic(),
                         self.grace_s)
        except (_GraceExpired, AsyncckptError) as exc:
            reason = (f"the grace budget of {self.grace_s:.0f} s ran out" if isinstance(exc, _GraceExpired)
                      else str(exc))
            if "DataLoader worker" in reason:
                reason += ("\n(DataLoader workers died of the signal: pass "
                           "worker_init_fn=asyncckpt.PreemptionSave.worker_init_fn to the DataLoader)")
            _log.error("asyncckpt: %s: the final checkpoint of step %d was aborted: %s; newest committed: %s",
                       signal.Signals(signum).name, step, reason, _newest(self.manager))
            self.manager.close(abort=True)
        finally:
            hard_exit.cancel()
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
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending[0].wait()
            except Exception:  # noqa: BLE001 - the group may be gone at shutdown
                pass
        self._restore_handlers()
        _ACTIVE_SIGNALS.difference_update(self._signals)

    def __enter__(self) -> "PreemptionSave":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


def _newest(manager: Any) -> Any:
    try:
        return manager.latest_step()
    except Exception:  # noqa: BLE001 - only for the log line
        return "unknown"


class _alarm_at:
    """Raise :class:`_GraceExpired` in the main thread at ``deadline`` (time.monotonic()),
    with SIGALRM (a real signal: it also ends a blocking wait)."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.previous: Any = None

    def __enter__(self) -> None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise _GraceExpired
        self.previous = signal.signal(signal.SIGALRM, self._expire)
        signal.setitimer(signal.ITIMER_REAL, remaining)

    @staticmethod
    def _expire(signum: int, frame: FrameType | None) -> None:
        raise _GraceExpired

    def __exit__(self, *_: Any) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.previous if self.previous is not None else signal.SIG_DFL)
