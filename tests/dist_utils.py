"""Run a function on N real ranks: spawned processes with a gloo group (its rendezvous a file store)."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

#: After a rank reported a failure, seconds the others get to report before they are killed.
FAILED_RANK_GRACE_S = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    fn: Callable[..., Any], rank: int, world_size: int, init_method: str, args: tuple, out: Any, dump_at: float
) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A rank still running shortly before run_ranks gives up prints every thread's stack
    # (to the test's captured stderr), so that a hang in CI says where it is.
    faulthandler.dump_traceback_later(max(0.5, dump_at - time.time()), exit=False)
    try:
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
        )
        try:
            result = fn(rank, world_size, *args)
            out.put((rank, True, result))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _kernel_wait(pid: int) -> str:
    """Where the kernel has ``pid`` waiting (``/proc/PID/wchan``: futex, pipe, poll...)."""
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"


def _py_spy_dump(pid: int) -> str:
    """Every thread's Python stack of ``pid`` (a forked child too, which faulthandler's
    timer does not follow) if py-spy is installed beside this interpreter; else ``""``."""
    exe = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    if exe is None:
        return ""
    try:
        done = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"\n  (py-spy: {exc})"
    return "\n" + (done.stdout + done.stderr).strip()


def _kill_with_descendants(procs: list[Any]) -> list[str]:
    """SIGKILL ``procs`` and every process they started (a rank's forked writer, its
    worker), reap the ranks; return what was running, for the failure message."""
    import psutil

    seen: list[str] = []
    victims: list[psutil.Process] = []
    for p in procs:
        try:
            top = psutil.Process(p.pid)
            victims += [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for v in victims:
        try:
            seen.append(f"{v.pid} {v.name()} ({v.status()}, in {_kernel_wait(v.pid)}){_py_spy_dump(v.pid)}")
        except psutil.NoSuchProcess:
            pass
    for v in victims:
        try:
            v.kill()
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        p.join(5)
    psutil.wait_procs(victims, timeout=5)
    return seen


def run_ranks(
    fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 90.0, start_method: str = "spawn"
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be a module-level function (it is pickled for spawn). Raises
    AssertionError with every rank's traceback if a rank fails or the run exceeds
    ``timeout`` seconds; all rank processes are killed on the way out.
    ``start_method="forkserver"`` starts ranks faster: they fork from multiprocessing's
    forkserver, which imported :data:`TORCH_PRELOAD` once when it started (see
    :func:`preload_forkserver`). Such a rank inherits the environment of the process when
    its forkserver started, not ``os.environ`` as it is now: a test that changes the
    environment for its ranks spawns them.
    """
    if start_method == "forkserver":
        preload_forkserver()
    ctx: Any = mp.get_context(start_method)  # typeshed's BaseContext has no Process; every real one has
    out = ctx.Queue()
    # Rendezvous through a file, not a TCP port picked beforehand: another process can
    # take a free port between free_port() and rank 0's bind, and the other ranks then
    # wait for a store that never comes up.
    store_dir = tempfile.mkdtemp(prefix="asyncckpt-ranks-")
    init_method = f"file://{os.path.join(store_dir, 'store')}"
    # Wall-clock time of the stack dump, 3 s before the deadline whatever the ranks'
    # imports took (one clock for all processes of this machine).
    dump_at = time.time() + max(1.0, timeout - 3.0)
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, init_method, args, out, dump_at), daemon=False)
        for r in range(world_size)
    ]
    results: dict[int, tuple[bool, Any]] = {}
    left_running: list[str] = []
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, value = out.get(timeout=min(left, 1.0))
                results[rank] = (ok, value)
                if not ok:  # the others may wait for it in a collective: not for long
                    deadline = min(deadline, time.monotonic() + FAILED_RANK_GRACE_S)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and out.empty():
                    time.sleep(0.5)
                    if out.empty():
                        break
        if len(results) == world_size:  # every rank reported: let them exit
            for p in procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()) + 5)
    finally:
        left_running = _kill_with_descendants([p for p in procs if p.is_alive()])
        out.close()
        out.join_thread()
        shutil.rmtree(store_dir, ignore_errors=True)
    codes = {r: p.exitcode for r, p in enumerate(procs)}
    # The error's traceback keeps this frame: drop the queue (its named semaphores) now,
    # not whenever the test lets go of the error.
    del out, procs
    failed = {r: v for r, (ok, v) in results.items() if not ok}
    missing = [r for r in range(world_size) if r not in results]
    if failed or missing:
        details = "\n".join(f"--- rank {r} ---\n{v}" for r, v in sorted(failed.items()))
        running = "".join(f"\n{line}" for line in left_running)
        raise AssertionError(
            f"ranks failed: {sorted(failed)}, no result from: {missing}, exit codes {codes}\n"
            f"still running when killed:{running or ' nothing'}\n{details}"
        )
    return [results[r][1] for r in range(world_size)]


#: What ranks of the sharded-state tests import (torch alone takes seconds per process).
TORCH_PRELOAD = (
    "torch",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.nn.parallel",
    "asyncckpt.saving.saver",
    "asyncckpt.manager",
)


def preload_forkserver(modules: tuple[str, ...] = TORCH_PRELOAD) -> None:
    """Have multiprocessing's forkserver import ``modules`` once when it starts, so that
    ranks run with ``run_ranks(..., start_method="forkserver")`` fork from it with them
    already imported (a few seconds saved per rank on a small machine).

    The forkserver is one per interpreter, started on first use and kept until exit;
    if it already runs, this has no effect (ranks then import as spawned ones do).
    """
    mp.set_forkserver_preload(list(modules))
