"""One rank of a multi-rank scenario of tests/test_multirank.py, run as a real process.

Usage: ``python _multirank_worker.py SCENARIO RANK WORLD_SIZE STORE_FILE OUT_DIR [ARGS...]``

Each rank joins a gloo group through the file store ``STORE_FILE`` (no port to pick),
runs the scenario, and writes what it observed to ``OUT_DIR/rank<RANK>.json``; the test
reads the files (and the checkpoint root) after the processes exited. A scenario ends
as a user's script does (``destroy_process_group()``, then the interpreter's exit),
never through a test harness's cleanup.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

#: As a script that did ``from torch.distributed import destroy_process_group`` before
#: asyncckpt was imported (``import asyncckpt`` wraps it; a name bound before stays torch's).
EARLY_DESTROY = dist.destroy_process_group

import asyncckpt  # noqa: E402


def _report(out_dir: Path, rank: int, result: dict[str, Any]) -> None:
    tmp = out_dir / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out_dir / f"rank{rank}.json")


def _outcome(handle: Any) -> dict[str, Any]:
    """What the handle reports now: ``committed``, ``failed`` (with the text) or ``pending``."""
    if not handle.done():
        return {"state": "pending"}
    exc = handle.exception()
    return {"state": "committed"} if exc is None else {"state": "failed", "error": str(exc)}


def _init(rank: int, world: int, store: str, timeout_s: float) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )


def _state(rank: int, mib: int = 4) -> dict[str, Any]:
    n = (mib << 20) // 4
    return {f"w{rank}": torch.arange(n, dtype=torch.float32) + rank, "shared": torch.ones(1000), "step": 2}


def destroy_pending(
    rank: int, world: int, store: str, out_dir: Path, root: str, loops: str, wait_for: str = ""
) -> None:
    """Save step 1 (waited), then step 2 (left pending), then ``destroy_process_group()``
    without ``close()``; repeated ``loops`` times with fresh groups and roots. With
    ``wait_for``, rank 1 calls ``destroy_process_group()`` only once that file exists
    (the coordinator's commit point failpoint touches it)."""
    results = []
    managers = []  # never closed, as in the user's script; kept so that no __del__ aborts them
    for loop in range(int(loops)):
        _init(rank, world, f"{store}.{loop}", 60)
        manager = asyncckpt.CheckpointManager(os.path.join(root, f"loop{loop}"))
        managers.append(manager)
        manager.save(1, _state(rank)).wait(timeout=60)
        handle = manager.save(2, _state(rank))
        if wait_for and rank == 1:
            deadline = time.monotonic() + 60
            while not os.path.exists(wait_for) and time.monotonic() < deadline:
                time.sleep(0.01)
        dist.destroy_process_group()
        results.append(_outcome(handle))
    _report(out_dir, rank, {"outcomes": results})


def destroy_unhooked(rank: int, world: int, store: str, out_dir: Path, root: str, reached: str) -> None:
    """As ``destroy_pending`` (one loop, rank 1 destroys once the coordinator is at its
    commit point), but rank 1 calls a ``destroy_process_group`` taken before asyncckpt
    was imported: nothing waits, rank 1's commit collective breaks."""
    _init(rank, world, store, 60)
    manager = asyncckpt.CheckpointManager(os.path.join(root, "loop0"))
    manager.save(1, _state(rank)).wait(timeout=60)
    handle = manager.save(2, _state(rank))
    if rank == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(reached) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert getattr(EARLY_DESTROY, "__asyncckpt_original__", None) is None  # not the wrapper
        EARLY_DESTROY()
    else:
        dist.destroy_process_group()
    concurrent.futures.wait([handle], 90)  # the background commit settles it, whatever the groups
    _report(out_dir, rank, {"outcomes": [_outcome(handle)]})


def destroy_foreground(rank: int, world: int, store: str, out_dir: Path, root: str) -> None:
    """A save pending on a queue finalized in the training loop at ``destroy_process_group()``:
    it cannot commit there, and is named as lost (the log, read by the test)."""
    _init(rank, world, store, 60)
    queue = asyncckpt.AsyncCallsQueue(background_finalize=False)
    manager = asyncckpt.CheckpointManager(root, calls_queue=queue)
    handle = manager.save(2, _state(rank, 1))
    dist.destroy_process_group()
    _report(out_dir, rank, {"outcomes": [_outcome(handle)]})
    queue.close(abort=True)


def abort_mid_commit(rank: int, world: int, store: str, out_dir: Path, root: str, reached: str) -> None:
    """Both ranks save step 2; rank 1 drops it (``close(abort=True)``) while the
    coordinator is at its commit point (failpoint ``commit`` on rank 0 touches
    ``reached`` and sleeps). Rank 0 reports its outcome of step 2."""
    _init(rank, world, store, 60)
    manager = asyncckpt.CheckpointManager(root)
    handle = manager.save(2, _state(rank))
    result: dict[str, Any] = {}
    if rank == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(reached) and time.monotonic() < deadline:
            time.sleep(0.01)
        manager.close(abort=True)
    else:
        try:
            handle.wait(timeout=60)
        except asyncckpt.AsyncckptError:
            pass
        manager.close()
    result["outcomes"] = [_outcome(handle)]
    _report(out_dir, rank, result)
    dist.destroy_process_group()


def different_steps(rank: int, world: int, store: str, out_dir: Path, root: str) -> None:
    """Every rank saves, but each passes its own step (``5 + rank``)."""
    _init(rank, world, store, 60)
    manager = asyncckpt.CheckpointManager(root)
    result: dict[str, Any] = {}
    try:
        manager.save(5 + rank, _state(rank, 1)).wait(timeout=60)
        result["outcome"] = "committed"
    except asyncckpt.AsyncckptError as exc:
        result["outcome"] = type(exc).__name__
        result["error"] = str(exc)
    # The ranks go on together: a save of one step by every rank still commits.
    manager.save(7, _state(rank, 1)).wait(timeout=60)
    manager.close()
    _report(out_dir, rank, result)
    dist.destroy_process_group()


def missing_file(rank: int, world: int, store: str, out_dir: Path, root: str, reached: str) -> None:
    """Both ranks save step 3; rank 1 removes its own data file from the temporary
    directory while the coordinator is at its commit point (failpoint ``commit``, given
    to rank 0 only: it touches ``reached`` and sleeps)."""
    _init(rank, world, store, 60)
    manager = asyncckpt.CheckpointManager(root)
    handle = manager.save(3, _state(rank, 1))
    removed = []
    if rank == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(reached) and time.monotonic() < deadline:
            time.sleep(0.01)
        for tmp in Path(root).glob(".step_00000003.tmp-*"):
            for f in tmp.glob("__1_*.distcp"):
                f.unlink()
                removed.append(f.name)
    result: dict[str, Any] = {"removed": removed}
    try:
        handle.wait(timeout=60)
        result["outcome"] = "committed"
    except asyncckpt.AsyncckptError as exc:
        result["outcome"] = type(exc).__name__
        result["error"] = str(exc)
    manager.close()
    _report(out_dir, rank, result)
    dist.destroy_process_group()


def absent_rank(rank: int, world: int, store: str, out_dir: Path, root: str, timeout_s: str, first: str = "0") -> None:
    """Rank 0 saves step 4; rank 1 does not (busy), until rank 0 reported, then it saves
    late. Unless ``first`` is ``"1"``, both ranks first save step 1 together (the groups
    exist: the plan's all_gather waits; else the creation of the groups does).

    Rank 1 records whether rank 0's report appeared while it was busy (at most 60 s),
    so the test sees that rank 0 did not wait for rank 1."""
    _init(rank, world, store, float(timeout_s))
    manager = asyncckpt.CheckpointManager(root)
    result: dict[str, Any] = {}
    if first != "1":
        manager.save(1, _state(rank, 1)).wait(timeout=60)
    if rank != 0:
        deadline = time.monotonic() + 60
        while not (out_dir / "rank0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # "busy": not in any call of asyncckpt
        result["rank0_reported_while_busy"] = (out_dir / "rank0.json").exists()
    try:
        manager.save(4, _state(rank, 1)).wait(timeout=120)
        result["outcome"] = "committed"
    except asyncckpt.AsyncckptError as exc:
        result["outcome"] = type(exc).__name__
        result["error"] = str(exc)
    _report(out_dir, rank, result)
    manager.close(abort=True)
    dist.destroy_process_group()


SCENARIOS = {
    f.__name__: f
    for f in (
        destroy_pending,
        destroy_unhooked,
        destroy_foreground,
        abort_mid_commit,
        different_steps,
        missing_file,
        absent_rank,
    )
}


def main() -> None:
    scenario, rank, world, store, out_dir, *args = sys.argv[1:]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        SCENARIOS[scenario](int(rank), int(world), store, Path(out_dir), *args)
    except BaseException:
        (Path(out_dir) / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
