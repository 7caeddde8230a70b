"""Fault scenarios of the fault-injection suite, run on 1 rank or on every rank of a group.

A scenario runs in the test process (1 rank, no process group) or on each rank of a
real gloo group (``dist_utils.run_ranks``) and returns what the rank saw; the
assertions run in the test process (``check_scenario``), so that a failed check never
leaves another rank waiting in a collective. Every scenario follows one script, on a
root directory of its own:

1. ``CheckpointManager(root, keep_last=2, persistent=...)`` commits step 1;
2. the faulty save of step 2: the fault is injected on the ranks the scenario names,
   the save is finalized (``maybe_finalize(blocking=True)``) and timed;
3. a snapshot of the root: ``latest``, the committed steps with the bytes of every file
   (hashed) and whether they ``verify``, hidden (temporary) entries;
4. the next save, step 3, on the same manager (a new one if the scenario closed it),
   loaded back and compared.

Faults are injected with real mechanisms where the machine allows (SIGKILL, a full
tmpfs, a read-only mount, file-descriptor exhaustion) and with the library's
failpoints (``ASYNCCKPT_FAULT``, see ``asyncckpt._faults``) to stop a writer at a known
point. A failpoint is armed for the next writes of one rank only:

- temporal caller: ``os.environ`` of the training process while the save forks its
  child (the child inherits it), restored afterwards;
- persistent caller: the running worker's own environment, set by a call scheduled on
  the manager's queue (``_worker_side.set_env``) and reset the same way afterwards.
  A worker restarted after a death inherits the training process's clean environment.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import resource
import signal
import subprocess
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

import asyncckpt
from asyncckpt import AsyncRequest, CheckpointError, CheckpointException, CheckpointManager
from asyncckpt._faults import ENV as FAULT_ENV

import helpers
from . import _worker_side

#: Seconds a failpoint sleeps to hold a writer at a known point. Longer than
#: TIME_BOUND_S: a save that waited for the sleep instead of failing fails the bound.
FAILPOINT_SLEEP_S = 60
#: (a) A faulty save must end (raise or commit) within this many seconds.
TIME_BOUND_S = 30.0
#: close(abort=True) must return within this many seconds.
ABORT_BOUND_S = 10.0
#: Seconds to wait for a failpoint to be reached, a process to die, a save to commit.
WAIT_S = 30.0
KEEP_LAST = 2
SMALL = 128 << 10  # bytes of rank-private tensor data in a normal save
BIG = 4 << 20  # bytes of the save that fills the small file system
TMPFS_SIZE = "2m"  # the small file system of the disk-full and read-only scenarios
FSIZE_LIMIT = 1 << 20  # RLIMIT_FSIZE of the disk-full fallback


# ----------------------------------------------------------------------------- small helpers
def barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def make_state(rank: int, step: int, nbytes: int = SMALL) -> dict[str, Any]:
    n = nbytes // 4
    return {
        f"rank{rank}": torch.arange(n, dtype=torch.float32) + (1000.0 * step + rank),
        "shared": torch.full((16,), float(step), dtype=torch.float64),
        "meta": {"step": step},
    }


def fresh_like(state: dict[str, Any]) -> dict[str, Any]:
    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": -1}) for k, v in state.items()}


def same_state(expected: dict[str, Any], got: dict[str, Any]) -> bool:
    if set(expected) != set(got):
        return False
    for k, v in expected.items():
        if isinstance(v, torch.Tensor):
            if not (isinstance(got[k], torch.Tensor) and got[k].dtype == v.dtype and torch.equal(got[k], v)):
                return False
        elif got[k] != v:
            return False
    return True


def wait_for_file(path: str, timeout: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _dead(pid: int) -> bool:
    # A child of ours: dead once waitable (WNOWAIT: leave the reaping to its owner).
    # Its main thread shows as a zombie in /proc while its other threads still exit
    # (and still hold its pipes): that is not dead yet.
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # not our child, or already reaped
        pass
    try:
        proc = psutil.Process(pid)
        return proc.status() == psutil.STATUS_ZOMBIE and proc.num_threads() <= 1
    except psutil.NoSuchProcess:
        return True


def process_gone(pid: int, timeout: float = WAIT_S) -> bool:
    """True once ``pid`` is dead: gone, or an exited child waiting to be reaped."""
    deadline = time.monotonic() + timeout
    while True:
        if _dead(pid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def _is_mp_infrastructure(p: psutil.Process) -> bool:
    """multiprocessing's resource tracker or forkserver. A process forked from a forkserver
    (a rank of ``run_ranks(start_method="forkserver")``), and what it forks (a temporal
    save's writer), show the forkserver's command line too: a forkserver is one whose
    parent does not (as in tests/conftest.py)."""
    try:
        cmd = " ".join(p.cmdline())
        if "multiprocessing.forkserver" in cmd:
            parent = p.parent()
            return parent is None or "multiprocessing.forkserver" not in " ".join(parent.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return True
    return "multiprocessing.resource_tracker" in cmd


def forked_children() -> dict[int, float]:
    """This process's live children (pid -> start time), multiprocessing helpers excepted."""
    found = {}
    for p in psutil.Process().children(recursive=False):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and not _is_mp_infrastructure(p):
                found[p.pid] = p.create_time()
        except psutil.NoSuchProcess:
            pass
    return found


def persistent_caller(manager: CheckpointManager) -> asyncckpt.PersistentAsyncCaller:
    """The manager's caller, which the scenario knows to be persistent."""
    caller = manager.queue.caller
    assert isinstance(caller, asyncckpt.PersistentAsyncCaller), type(caller).__name__
    return caller


def writer_pid(manager: CheckpointManager) -> int | None:
    """The process that runs this rank's writes: the persistent worker, or the newest
    forked child (the temporal caller's only children are its write children)."""
    if manager.queue.persistent:
        return persistent_caller(manager).worker_pid
    children = forked_children()
    return max(children, key=lambda pid: children[pid]) if children else None


def run_in_worker(manager: CheckpointManager, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` in the persistent worker, as one call of the manager's queue
    (collective: every rank calls it, in the same order)."""
    queue = manager.queue
    queue.schedule_async_request(AsyncRequest(fn, args))
    queue.maybe_finalize_async_calls(blocking=True)


@contextlib.contextmanager
def armed(manager: CheckpointManager, spec: str | None, disarm: bool = True) -> Iterator[None]:
    """Failpoints ``spec`` active for this rank's writes inside the block (``None``: no
    fault on this rank). Collective for the persistent caller (every rank enters it)."""
    old = os.environ.get(FAULT_ENV)
    persistent = manager.queue.persistent
    if persistent:
        run_in_worker(manager, _worker_side.set_env, FAULT_ENV, spec)
    elif spec is not None:
        os.environ[FAULT_ENV] = spec  # the child forked by save() inherits it
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(FAULT_ENV, None)
        else:
            os.environ[FAULT_ENV] = old
        if persistent and disarm and not manager.queue.closed:
            run_in_worker(manager, _worker_side.set_env, FAULT_ENV, None)


def _lowest_free_fd() -> int:
    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    os.close(fd)
    return fd


def _staging_fds() -> list[int]:
    """This process's memfd descriptors (asyncckpt's staging buffers among them)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:"):
                found.append(int(name))
    return found


@contextlib.contextmanager
def no_new_file_descriptors() -> Iterator[None]:
    """Real file-descriptor exhaustion inside the block: ``RLIMIT_NOFILE`` is lowered to
    the lowest free descriptor (and below the staging buffers' own, which staging may
    close and reopen), so any new descriptor fails with EMFILE ("Too many open files")
    while the open ones keep working.

    The collector runs first and is off inside the block: a descriptor below the limit
    freed by a collection there (an object of an earlier test holding one) would be
    handed out again, and the allocation would succeed (seen once in a full suite)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = min([_lowest_free_fd()] + _staging_fds())
    assert limit >= 3, limit  # poll() needs nfds <= the limit
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def fsize_limited(manager: CheckpointManager, nbytes: int, active: bool) -> Iterator[None]:
    """``RLIMIT_FSIZE`` (SIGXFSZ ignored) in the process that writes, inside the block.

    Temporal: set in this process only for the duration of ``save()`` (the fork
    happens there), see :func:`fsize_limited_trainer`. Persistent: in the worker.
    """
    persistent = manager.queue.persistent
    if persistent:
        run_in_worker(manager, _worker_side.set_fsize_limit, nbytes if active else None)
    try:
        yield
    finally:
        if persistent and not manager.queue.closed:
            run_in_worker(manager, _worker_side.set_fsize_limit, None)


@contextlib.contextmanager
def fsize_limited_trainer(nbytes: int, active: bool) -> Iterator[None]:
    if not active:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)


# ----------------------------------------------------------------------------- mounts (parent side)
def small_tmpfs(path: Path, size: str = TMPFS_SIZE, nr_inodes: int | None = None) -> Any:
    """:func:`helpers.small_tmpfs`, by default of :data:`TMPFS_SIZE`."""
    return helpers.small_tmpfs(path, size, nr_inodes)


def remount(path: str | Path, mode: str) -> bool:
    """Remount the file system at ``path`` read-only (``"ro"``) or read-write (``"rw"``)."""
    try:
        return (
            subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], capture_output=True, timeout=30).returncode
            == 0
        )
    except (OSError, subprocess.SubprocessError):
        return False


def disk_full_mechanism(mounted: bool) -> str:
    """``tmpfs`` (a real full file system), else ``fsize`` (RLIMIT_FSIZE in the writer),
    else ``injected`` (the ``enospc`` failpoint)."""
    if mounted:
        return "tmpfs"
    try:
        resource.getrlimit(resource.RLIMIT_FSIZE)
        return "fsize"
    except (OSError, ValueError, AttributeError):
        return "injected"


def read_only_mechanism(mount_point: Path, mounted: bool) -> str:
    """``ro_mount`` if the tmpfs at ``mount_point`` can be remounted read-only (tried
    once here), else ``injected`` (the ``raise`` failpoint: an EIO)."""
    if mounted and remount(mount_point, "ro") and remount(mount_point, "rw"):
        return "ro_mount"
    return "injected"


# ----------------------------------------------------------------------------- scenarios (rank side)
class Ctx:
    """What a scenario function gets: this rank, its manager, whether it injects."""

    def __init__(
        self, rank: int, world: int, persistent: bool, root: Path, workdir: Path, faulty: bool, mechanism: str | None
    ) -> None:
        self.rank, self.world, self.persistent = rank, world, persistent
        self.root, self.workdir = root, workdir
        self.faulty = faulty
        self.mechanism = mechanism
        self._manager: CheckpointManager | None = None
        self.closed = False  # the scenario closed the manager: step 4 uses a new one
        self.info: dict[str, Any] = {}

    @property
    def manager(self) -> CheckpointManager:
        """This rank's manager (the runner sets it before a scenario runs)."""
        if self._manager is None:
            raise RuntimeError("no manager yet")
        return self._manager

    @manager.setter
    def manager(self, manager: CheckpointManager) -> None:
        self._manager = manager

    def marker(self, what: str) -> str:
        return str(self.workdir / f"{self.root.parent.name}.{what}.rank{self.rank}")

    def save2(self, nbytes: int = SMALL) -> asyncckpt.SaveHandle:
        handle = self.manager.save(2, make_state(self.rank, 2, nbytes))
        self.info["call_idx"] = handle.call_idx
        return handle

    def finalize(self) -> None:
        self.manager.maybe_finalize(blocking=True)

    def kill_writer(self) -> None:
        pid = writer_pid(self.manager)
        self.info["killed_pid"] = pid
        if pid is not None:
            os.kill(pid, signal.SIGKILL)


def _hold_at(point: str, ctx: Ctx) -> str | None:
    return f"{point}:touch={ctx.marker(point)};{point}:sleep={FAILPOINT_SLEEP_S}" if ctx.faulty else None


def _child_pids() -> set[int]:
    """This process's children, read from /proc at once (no scan of every process: the
    hand-off kill must follow the fork within microseconds)."""
    pids: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            with open(f"/proc/self/task/{tid}/children") as f:
                pids.update(int(p) for p in f.read().split())
    return pids


def sc_kill_handoff(ctx: Ctx) -> None:
    """SIGKILL the writer the moment it is handed the staged request: right after the
    persistent worker was sent it, or right after the temporal child was forked.

    The writer may (rarely) finish a write in the microseconds before the signal lands:
    then that rank's write succeeded and the save commits if every rank's did, or
    fails naming only the ranks whose writer died ("either" in SCENARIOS).
    """
    caller = ctx.manager.queue.caller
    real = caller.schedule

    def schedule(call_idx: int, fn: Any, args: tuple, kwargs: dict) -> None:
        before = _child_pids()
        real(call_idx, fn, args, kwargs)
        if ctx.faulty:
            if ctx.persistent:
                pid = persistent_caller(ctx.manager).worker_pid
            else:
                new = _child_pids() - before
                pid = max(new) if new else None
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
            ctx.info["killed_pid"] = pid

    caller.schedule = schedule  # type: ignore[method-assign, assignment]
    try:
        ctx.save2(nbytes=BIG)  # a write that takes a while: the kill lands before it ends
    finally:
        del caller.schedule
    ctx.finalize()


def sc_kill_before_save(ctx: Ctx) -> None:
    """(persistent) The idle worker was SIGKILLed (and is dead) before save(): no call
    was in flight, so the save restarts it transparently and commits."""
    caller = persistent_caller(ctx.manager)
    starts = caller.num_starts
    if ctx.faulty:
        pid = caller.worker_pid
        assert pid is not None  # the manager's worker starts with the manager
        ctx.info["killed_pid"] = pid
        os.kill(pid, signal.SIGKILL)
        ctx.info["dead_before_save"] = process_gone(pid)
    ctx.save2()
    ctx.finalize()
    ctx.info["restarts"] = caller.num_starts - starts


def sc_kill_during_staging(ctx: Ctx) -> None:
    """(persistent) SIGKILL the idle worker while save() stages (inside preload_fn),
    without waiting for it to die: the request is then sent to a dead or dying worker.
    The library must either notice the death and restart it transparently (the save
    commits) or fail the call on every rank; never hang ("either" in SCENARIOS)."""
    queue = ctx.manager.queue
    real = queue.schedule_async_request

    def schedule(request: AsyncRequest, **kwargs: Any) -> int:
        staging = request.preload_fn

        def preload() -> Any:
            pid = persistent_caller(ctx.manager).worker_pid
            ctx.info["killed_pid"] = pid
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
            return staging()

        return real(request._replace(preload_fn=preload) if ctx.faulty and staging else request, **kwargs)

    queue.schedule_async_request = schedule  # type: ignore[method-assign, assignment]
    try:
        ctx.save2(nbytes=BIG)
    finally:
        del queue.schedule_async_request
    ctx.finalize()


def sc_kill_mid_write(ctx: Ctx) -> None:
    with armed(ctx.manager, _hold_at("mid_write", ctx)):
        ctx.save2()
        if ctx.faulty:
            ctx.info["point_reached"] = wait_for_file(ctx.marker("mid_write"))
            ctx.kill_writer()
        ctx.finalize()


def sc_kill_after_write(ctx: Ctx) -> None:
    """SIGKILL after every file was written and fsynced, before the result was sent."""
    with armed(ctx.manager, _hold_at("after_write", ctx)):
        ctx.save2()
        if ctx.faulty:
            ctx.info["point_reached"] = wait_for_file(ctx.marker("after_write"))
            ctx.kill_writer()
        ctx.finalize()


def sc_kill_after_result(ctx: Ctx) -> None:
    """(persistent) SIGKILL the worker after it delivered the write's result (the files
    are durable), before finalize. Committing is then honest; failing would be too."""
    handle = ctx.save2()
    assert handle.call_idx is not None  # an async save is scheduled at once
    ctx.info["write_done"] = ctx.manager.queue.wait_local(handle.call_idx, timeout=WAIT_S)
    if ctx.faulty:
        pid = persistent_caller(ctx.manager).worker_pid
        ctx.info["killed_pid"] = pid
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            ctx.info["dead_before_finalize"] = process_gone(pid)
    ctx.finalize()


def sc_raise(ctx: Ctx) -> None:
    with armed(ctx.manager, "mid_write:raise" if ctx.faulty else None):
        ctx.save2()
        ctx.finalize()


def sc_exit3(ctx: Ctx) -> None:
    """The writer exits with code 3 mid-write (temporal: the forked child; persistent:
    the worker, with os._exit)."""
    with armed(ctx.manager, "mid_write:exit=3" if ctx.faulty else None):
        ctx.save2()
        ctx.finalize()


def sc_preload(ctx: Ctx) -> None:
    """preload_fn (staging) raises: the host buffer for a larger state cannot be
    allocated because the process has no file descriptor left (real EMFILE from
    memfd_create). Only the fd limit is changed, only during this rank's preload_fn."""
    queue = ctx.manager.queue
    real = queue.schedule_async_request

    def schedule(request: AsyncRequest, **kwargs: Any) -> int:
        staging = request.preload_fn

        def preload() -> Any:
            with no_new_file_descriptors():
                return staging()

        return real(request._replace(preload_fn=preload) if ctx.faulty and staging else request, **kwargs)

    queue.schedule_async_request = schedule  # type: ignore[method-assign, assignment]
    try:
        ctx.save2(nbytes=4 * SMALL)  # larger than step 1: a new host buffer is needed
    finally:
        del queue.schedule_async_request
    ctx.finalize()


def sc_enospc(ctx: Ctx) -> None:
    """Disk full: a save larger than the free space of a 2 MiB tmpfs (fallbacks:
    RLIMIT_FSIZE in the writer, then the injected ENOSPC)."""
    if ctx.mechanism == "tmpfs":
        ctx.save2(nbytes=BIG)
        ctx.finalize()
    elif ctx.mechanism == "fsize":
        with fsize_limited(ctx.manager, FSIZE_LIMIT, ctx.faulty):
            with fsize_limited_trainer(FSIZE_LIMIT, ctx.faulty and not ctx.persistent):
                ctx.save2(nbytes=BIG)
            ctx.finalize()
    else:
        with armed(ctx.manager, "mid_write:enospc" if ctx.faulty else None):
            ctx.save2(nbytes=BIG)
            ctx.finalize()


def sc_readonly(ctx: Ctx) -> None:
    """The target file system is read-only (root ignores permission bits; a read-only
    mount stops root too). Fallback: the injected EIO."""
    if ctx.mechanism != "ro_mount":
        with armed(ctx.manager, "mid_write:raise" if ctx.faulty else None):
            ctx.save2()
            ctx.finalize()
        return
    mount_point = ctx.root.parent
    if ctx.rank == 0:
        ctx.info["remounted_ro"] = remount(mount_point, "ro")
    barrier()
    try:
        ctx.save2()
        ctx.finalize()
    finally:
        barrier()
        if ctx.rank == 0:
            ctx.info["remounted_rw"] = remount(mount_point, "rw")
        barrier()


def sc_target_is_file(ctx: Ctx) -> None:
    """The target path of step 2 is an existing regular file before the save."""
    if ctx.rank == 0:
        ctx.manager.step_dir(2).write_bytes(b"a regular file, not a checkpoint\n")
    barrier()
    ctx.save2()
    ctx.finalize()


def sc_target_becomes_file(ctx: Ctx) -> None:
    """The target path of step 2 becomes a regular file while the save is written."""
    ctx.save2()
    barrier()
    if ctx.rank == 0:
        ctx.manager.step_dir(2).write_bytes(b"a regular file, not a checkpoint\n")
    barrier()
    ctx.finalize()


def _handle_state(handle: asyncckpt.SaveHandle) -> dict[str, Any]:
    state: dict[str, Any] = {
        "done": handle.done(),
        "exception": type(handle.exception(timeout=0) if handle.done() else None).__name__,
        "repr": repr(handle),
    }
    try:
        handle.wait(timeout=5)
        state["wait"] = "returned"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        state["wait"] = f"{type(exc).__name__}: {exc}"
    return state


def sc_abort(ctx: Ctx) -> str:
    """close(abort=True) while the write is held mid-way; then close() again."""
    manager = ctx.manager
    old = os.environ.get(FAULT_ENV)
    with armed(manager, _hold_at("mid_write", ctx), disarm=False):
        handle = ctx.save2()
        ctx.info["point_reached"] = wait_for_file(ctx.marker("mid_write"))
        pid = writer_pid(manager)
        started = time.monotonic()
        manager.close(abort=True)
        ctx.info["abort_s"] = time.monotonic() - started
    ctx.closed = True
    ctx.info["writer_gone"] = pid is not None and process_gone(pid, timeout=5)
    try:
        manager.close()
        ctx.info["second_close"] = None
    except Exception as exc:  # noqa: BLE001
        ctx.info["second_close"] = f"{type(exc).__name__}: {exc}"
    try:
        manager.save(4, make_state(ctx.rank, 4))
        ctx.info["save_after_close"] = None
    except Exception as exc:  # noqa: BLE001
        ctx.info["save_after_close"] = type(exc).__name__
    ctx.info["handle"] = _handle_state(handle)
    assert os.environ.get(FAULT_ENV) == old
    return "aborted"


def sc_close_raises(ctx: Ctx) -> None:
    """close() with a pending save that fails: raises on every rank; close() again is a
    no-op; the manager refuses new saves; a new manager saves."""
    manager = ctx.manager
    with armed(manager, "mid_write:raise" if ctx.faulty else None, disarm=False):
        ctx.save2()
        first: CheckpointException | None = None
        try:
            manager.close()
        except CheckpointException as exc:
            first = exc
    ctx.closed = True
    try:
        manager.close()
        ctx.info["second_close"] = None
    except Exception as exc:  # noqa: BLE001
        ctx.info["second_close"] = f"{type(exc).__name__}: {exc}"
    try:
        manager.save(4, make_state(ctx.rank, 4))
        ctx.info["save_after_close"] = None
    except Exception as exc:  # noqa: BLE001
        ctx.info["save_after_close"] = type(exc).__name__
    ctx.info["worker_left"] = persistent_caller(manager).worker_pid if ctx.persistent else None
    if first is not None:
        raise first


BOTH = ("temporal", "persistent")

#: name -> fn, where the fault is injected ("all" ranks, "rank1" only, "coord": the
#: coordinator's commit), the callers and world sizes it runs with, the promised
#: outcome ("CheckpointException", "CheckpointError", "committed", "either": committed
#: completely or the same exception everywhere, "aborted"), and the words every
#: failing rank's cause must contain (by mechanism where it matters).
SCENARIOS: dict[str, dict[str, Any]] = {
    "kill_handoff": dict(fn=sc_kill_handoff, where="all", expect="either", needles=["SIGKILL"]),
    "kill_before_save": dict(fn=sc_kill_before_save, where="all", expect="committed", callers=("persistent",)),
    "kill_during_staging": dict(
        fn=sc_kill_during_staging, where="all", expect="either", needles=["SIGKILL"], callers=("persistent",)
    ),
    "kill_mid_write": dict(fn=sc_kill_mid_write, where="all", expect="CheckpointException", needles=["SIGKILL"]),
    "kill_after_write": dict(fn=sc_kill_after_write, where="all", expect="CheckpointException", needles=["SIGKILL"]),
    "kill_after_result": dict(
        fn=sc_kill_after_result, where="all", expect="either", needles=["SIGKILL"], callers=("persistent",)
    ),
    "raise": dict(fn=sc_raise, where="all", expect="CheckpointException", needles=["OSError", "injected I/O error"]),
    "exit3": dict(fn=sc_exit3, where="all", expect="CheckpointException", needles=["exited with code 3"]),
    "preload": dict(
        fn=sc_preload, where="all", expect="CheckpointException", needles=["preload_fn raised", "Too many open files"]
    ),
    "one_rank_raise": dict(
        fn=sc_raise, where="rank1", expect="CheckpointException", needles=["injected I/O error"], worlds=(2,)
    ),
    "one_rank_kill": dict(
        fn=sc_kill_mid_write, where="rank1", expect="CheckpointException", needles=["SIGKILL"], worlds=(2,)
    ),
    "one_rank_preload": dict(
        fn=sc_preload,
        where="rank1",
        expect="CheckpointException",
        needles=["preload_fn raised", "Too many open files"],
        worlds=(2,),
    ),
    "enospc": dict(
        fn=sc_enospc,
        where="all",
        expect="CheckpointException",
        mount=True,
        needles={
            "tmpfs": ["No space left on device"],
            "fsize": ["File too large"],
            "injected": ["No space left on device"],
        },
    ),
    "readonly": dict(
        fn=sc_readonly,
        where="all",
        expect="CheckpointException",
        mount=True,
        needles={"ro_mount": ["Read-only file system"], "injected": ["injected I/O error"]},
    ),
    "target_is_file": dict(
        fn=sc_target_is_file, where="coord", expect="CheckpointError", needles=["exists and is not an empty directory"]
    ),
    "target_becomes_file": dict(
        fn=sc_target_becomes_file,
        where="coord",
        expect="CheckpointException",
        needles=["commit failed", "Not a directory"],
    ),
    "abort": dict(fn=sc_abort, where="all", expect="aborted"),
    "close_raises": dict(fn=sc_close_raises, where="all", expect="CheckpointException", needles=["injected I/O error"]),
}


def applies(name: str, caller: str, world: int) -> bool:
    spec = SCENARIOS[name]
    return caller in spec.get("callers", BOTH) and world in spec.get("worlds", (1, 2))


def failing_ranks(name: str, world: int) -> list[int]:
    where = SCENARIOS[name]["where"]
    return {"all": list(range(world)), "rank1": [1], "coord": [0]}[where]


# ----------------------------------------------------------------------------- driver (rank side)
def snapshot(root: Path) -> dict[str, Any]:
    """``latest``, committed steps (file -> sha1 of its bytes) and whether they verify,
    and the visible and hidden entry names of ``root``."""
    out: dict[str, Any] = {"latest": None, "steps": {}, "verify": {}, "visible": [], "hidden": []}
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.name.startswith("."):
            out["hidden"].append(entry.name)
            continue
        out["visible"].append(entry.name)
        path = Path(entry.path)
        if entry.name == "latest":
            out["latest"] = path.read_text()
        elif entry.is_dir() and (path / ".manifest.json").is_file() and (path / ".metadata").is_file():
            out["steps"][entry.name] = {
                f.name: hashlib.sha1(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())
            }
            try:
                asyncckpt.verify(path)
                out["verify"][entry.name] = None
            except Exception as exc:  # noqa: BLE001
                out["verify"][entry.name] = f"{type(exc).__name__}: {exc}"
    return out


def run_scenario(
    rank: int, world: int, name: str, persistent: bool, root: str, workdir: str, mechanism: str | None = None
) -> dict[str, Any]:
    """Run scenario ``name`` on this rank (see the module docstring); returns what it saw."""
    spec = SCENARIOS[name]
    faulty = rank in failing_ranks(name, world) if spec["where"] != "coord" else True
    ctx = Ctx(rank, world, persistent, Path(root), Path(workdir), faulty, mechanism)
    out: dict[str, Any] = {"rank": rank, "name": name, "mechanism": mechanism}
    managers: list[CheckpointManager] = []
    env_before = os.environ.get(FAULT_ENV)
    completed = False

    def new_manager() -> CheckpointManager:
        manager = CheckpointManager(root, keep_last=KEEP_LAST, persistent=persistent)
        managers.append(manager)
        ctx.manager = manager
        ctx.closed = False
        return manager

    try:
        manager = new_manager()
        manager.save(1, make_state(rank, 1)).wait(timeout=WAIT_S)
        barrier()
        out["before"] = snapshot(ctx.root)
        out["steps_before"] = manager.steps()
        started = time.monotonic()
        try:
            kind = spec["fn"](ctx) or "committed"
            out["outcome"] = {"kind": kind}
        except CheckpointException as exc:
            out["outcome"] = {"kind": "CheckpointException", "call_idx": exc.call_idx, "failures": dict(exc.failures)}
        except CheckpointError as exc:
            out["outcome"] = {"kind": "CheckpointError", "type": type(exc).__name__, "message": str(exc)}
        out["elapsed_s"] = time.monotonic() - started
        out["info"] = ctx.info
        out["env_restored"] = os.environ.get(FAULT_ENV) == env_before
        barrier()
        out["after"] = snapshot(ctx.root)
        out["steps_after"] = ctx.manager.steps()
        out["latest_after"] = ctx.manager.latest_step()

        # (d) the next save commits (on a new manager if the scenario closed this one).
        if ctx.closed:
            new_manager()
        state = make_state(rank, 3)
        try:
            ctx.manager.save(3, state).wait(timeout=WAIT_S)
            got = fresh_like(state)
            loaded = ctx.manager.load(got, step=3)
            out["next"] = {
                "ok": True,
                "loaded": loaded,
                "same": same_state(make_state(rank, 3), got),
                "steps": ctx.manager.steps(),
                "latest": ctx.manager.latest_step(),
            }
        except (CheckpointException, CheckpointError) as exc:
            out["next"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        barrier()
        out["final"] = snapshot(ctx.root)
        completed = True
    except Exception:  # noqa: BLE001 - reported to the test
        out["error"] = traceback.format_exc()
    finally:
        for manager in managers:  # abort on any failure, a pytest timeout included
            try:
                manager.close(abort=not completed)
            except Exception as exc:  # noqa: BLE001
                out.setdefault("close_errors", []).append(f"{type(exc).__name__}: {exc}")
        if env_before is None:
            os.environ.pop(FAULT_ENV, None)
        else:
            os.environ[FAULT_ENV] = env_before
    return out


def run_group(
    rank: int, world: int, names: list[str], persistent: bool, base: str, mechanisms: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """``run_ranks`` entry: run several scenarios one after the other on this rank."""
    results = {}
    workdir = Path(base) / "markers"
    for name in names:
        root = Path(base) / name / "root"
        results[name] = run_scenario(rank, world, name, persistent, str(root), str(workdir), mechanisms.get(name))
        barrier()
    return results


def exit_with_save_in_flight(rank: int, world: int, root: str, persistent: bool, marker_prefix: str) -> None:
    """For the interpreter-exit tests: commit step 1, start the save of step 2 and hold
    its write mid-way, print what the test needs (one JSON line) and return without
    ``close()``, so that the interpreter exits with the save in flight."""
    manager = CheckpointManager(root, keep_last=KEEP_LAST, persistent=persistent)
    manager.save(1, make_state(rank, 1)).wait(timeout=WAIT_S)
    marker = f"{marker_prefix}.rank{rank}"
    spec = f"mid_write:touch={marker};mid_write:sleep={FAILPOINT_SLEEP_S}"
    if persistent:
        run_in_worker(manager, _worker_side.set_env, FAULT_ENV, spec)
    else:
        os.environ[FAULT_ENV] = spec
    manager.save(2, make_state(rank, 2))
    reached = wait_for_file(marker)
    pid = writer_pid(manager)
    barrier()
    print(
        json.dumps({"rank": rank, "pid": os.getpid(), "writer": pid, "reached": reached, "t": time.monotonic()}),
        flush=True,
    )


# ----------------------------------------------------------------------------- checks (test side)
def check_scenario(name: str, results: list[dict[str, Any]], world: int) -> None:
    """Assert the four outcomes (a)-(d) on the results of every rank."""
    spec = SCENARIOS[name]
    for r in results:
        assert "error" not in r, f"rank {r['rank']} failed in the test harness:\n{r['error']}"
    mechanism = results[0]["mechanism"]
    where = f"{name} ({world} rank(s), mechanism {mechanism})"

    # (a) bounded time, no hang (pytest-timeout bounds the whole test as well).
    for r in results:
        assert r["elapsed_s"] < TIME_BOUND_S, f"{where}: rank {r['rank']} took {r['elapsed_s']:.1f} s"
        assert r["env_restored"]
        assert r["info"].get("point_reached", True), f"{where}: rank {r['rank']} never reached the failpoint"

    # (b) the same outcome on every rank; an exception names the failing ranks and cause.
    outcome = results[0]["outcome"]
    for r in results[1:]:
        assert r["outcome"] == outcome, f"{where}: ranks disagree:\n{outcome}\n{r['outcome']}"
    allowed = {"either": ("committed", "CheckpointException")}.get(spec["expect"], (spec["expect"],))
    assert outcome["kind"] in allowed, f"{where}: expected {allowed}, got {outcome}"
    needles = spec.get("needles", [])
    if isinstance(needles, dict):
        needles = needles[mechanism]
    if outcome["kind"] == "CheckpointException":
        for r in results:
            assert outcome["call_idx"] == r["info"]["call_idx"], f"{where}: {outcome} is not the faulty save"
        if spec["expect"] == "either":  # a rank whose write won the race with the kill succeeded
            assert outcome["failures"] and set(outcome["failures"]) <= set(failing_ranks(name, world)), where
        else:
            assert sorted(outcome["failures"]) == failing_ranks(name, world), f"{where}: {outcome['failures']}"
        for rank, cause in outcome["failures"].items():
            for needle in needles:
                assert needle in cause, f"{where}: rank {rank}'s cause does not say {needle!r}:\n{cause}"
    if outcome["kind"] == "CheckpointError":
        for needle in needles:
            assert needle in outcome["message"], f"{where}: {outcome['message']}"

    # (c) nothing incomplete committed; latest and step 1 untouched and verified.
    committed = outcome["kind"] == "committed"
    before, after = results[0]["before"], results[0]["after"]
    assert list(before["steps"]) == ["step_00000001"] and before["verify"] == {"step_00000001": None}
    assert after["steps"]["step_00000001"] == before["steps"]["step_00000001"], f"{where}: step 1 changed"
    assert sorted(after["steps"]) == ["step_00000001"] + (["step_00000002"] if committed else []), where
    assert all(v is None for v in after["verify"].values()), f"{where}: {after['verify']}"
    assert after["latest"] == ("step_00000002\n" if committed else before["latest"]), where
    extra_visible = {"step_00000002"} if committed or name in ("target_is_file", "target_becomes_file") else set()
    assert set(after["visible"]) == set(before["visible"]) | extra_visible, f"{where}: {after['visible']}"
    for r in results:
        assert r["steps_after"] == ([1, 2] if committed else [1]), f"{where}: steps() {r['steps_after']}"
        assert r["latest_after"] == (2 if committed else 1), where
    if name == "target_is_file":  # refused before anything was written
        assert after["hidden"] == before["hidden"], f"{where}: something was written: {after['hidden']}"

    # (d) the next save commits and reads back.
    for r in results:
        nxt = r["next"]
        assert nxt["ok"], (
            f"{where}: rank {r['rank']}: the next save failed: {nxt.get('error')}\n"
            f"left in the root by the failed save: {after['hidden']}"
        )
        assert nxt["same"] and nxt["loaded"] == 3 and nxt["latest"] == 3, f"{where}: {nxt}"
        assert nxt["steps"] == ([2, 3] if committed else [1, 3]), f"{where}: {nxt}"
    final = results[0]["final"]
    assert all(v is None for v in final["verify"].values()), f"{where}: {final['verify']}"
    assert final["latest"] == "step_00000003\n"
    for r in results:
        assert not r.get("close_errors"), f"{where}: {r['close_errors']}"

    # Scenario-specific promises.
    info = [r["info"] for r in results]
    if name in (
        "kill_handoff",
        "kill_during_staging",
        "kill_mid_write",
        "kill_after_write",
        "kill_after_result",
        "one_rank_kill",
    ):
        for rank in failing_ranks(name, world):
            assert info[rank].get("killed_pid"), f"{where}: rank {rank} killed nothing: {info[rank]}"
    if name == "kill_before_save":
        for i in info:
            assert i["dead_before_save"] and i["restarts"] == 1, f"{where}: {i}"
    if name == "abort":
        for i in info:
            assert i["abort_s"] < ABORT_BOUND_S, f"{where}: close(abort=True) took {i['abort_s']:.1f} s"
            assert i["writer_gone"], f"{where}: the writer outlived close(abort=True)"
            assert i["second_close"] is None and i["save_after_close"] == "InvalidStateError", f"{where}: {i}"
    if name == "close_raises":
        for i in info:
            assert i["second_close"] is None and i["save_after_close"] == "InvalidStateError", f"{where}: {i}"
            assert i["worker_left"] is None, f"{where}: the worker outlived close()"
