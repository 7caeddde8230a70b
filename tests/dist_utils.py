"""Run a function on N real ranks: spawned processes with a gloo group on 127.0.0.1."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, out: Any) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=60))
        try:
            result = fn(rank, world_size, *args)
            out.put((rank, True, result))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 90.0,
              start_method: str = "spawn") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be a module-level function (it is pickled for spawn). Raises
    AssertionError with every rank's traceback if a rank fails or the run exceeds
    ``timeout`` seconds; all rank processes are killed on the way out.
    ``start_method="forkserver"`` (see :func:`preload_forkserver`) starts ranks faster.
    """
    ctx = mp.get_context(start_method)
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, out), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, tuple[bool, Any]] = {}
    try:
        import queue as _queue
        import time

        deadline = time.monotonic() + timeout
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, value = out.get(timeout=min(left, 1.0))
                results[rank] = (ok, value)
            except _queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and out.empty():
                    time.sleep(0.5)
                    if out.empty():
                        break
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()) + 5)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        out.close()
        out.join_thread()
    failed = {r: v for r, (ok, v) in results.items() if not ok}
    missing = [r for r in range(world_size) if r not in results]
    if failed or missing:
        details = "\n".join(f"--- rank {r} ---\n{v}" for r, v in sorted(failed.items()))
        codes = {r: procs[r].exitcode for r in range(world_size)}
        raise AssertionError(f"ranks failed: {sorted(failed)}, no result from: {missing}, exit codes {codes}\n{details}")
    return [results[r][1] for r in range(world_size)]


#: What ranks of the sharded-state tests import (torch alone takes seconds per process).
TORCH_PRELOAD = ("torch", "torch.distributed.checkpoint.state_dict", "torch.distributed.fsdp",
                 "torch.nn.parallel", "asyncckpt.saving", "asyncckpt.manager")


def preload_forkserver(modules: tuple[str, ...] = TORCH_PRELOAD) -> None:
    """Have multiprocessing's forkserver import ``modules`` once when it starts, so that
    ranks run with ``run_ranks(..., start_method="forkserver")`` fork from it with them
    already imported (a few seconds saved per rank on a small machine).

    The forkserver is one per interpreter, started on first use and kept until exit;
    if it already runs, this has no effect (ranks then import as spawned ones do).
    """
    mp.set_forkserver_preload(list(modules))
