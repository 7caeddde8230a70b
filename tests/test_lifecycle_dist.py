"""A save's lifecycle on 2 real gloo ranks: one step saved twice while pending, a
manager dropped with a save in flight, a crash inside ``with CheckpointManager``.

The rank functions do every collective step on both ranks and return what they
observed; the assertions run here, so a failed check never leaves a rank waiting.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt

from dist_utils import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

WORLD = 2


def _manager(root: str, fault: str) -> asyncckpt.CheckpointManager:
    os.environ["ASYNCCKPT_FAULT"] = fault  # the persistent worker inherits it at its start
    try:
        return asyncckpt.CheckpointManager(root)
    finally:
        os.environ.pop("ASYNCCKPT_FAULT")


def _rank_lifecycle(rank: int, world: int, root: str) -> dict[str, Any]:
    state = {f"w{rank}": torch.full((1 << 16,), float(rank))}
    out: dict[str, Any] = {}

    # 1. save(10) again while it is pending: refused on every rank, before staging.
    mgr = _manager(os.path.join(root, "dup"), "mid_write:sleep=1")
    first = mgr.save(10, state)
    try:
        mgr.save(10, {f"w{rank}": torch.zeros(1 << 16)})
        out["refused"] = None
    except asyncckpt.CheckpointError as exc:
        out["refused"] = str(exc)
    first.wait(timeout=60)
    mgr.close()
    out["dup_steps"] = mgr.steps()

    # 2. a manager dropped with its save in flight: it commits on every rank.
    handle = _manager(os.path.join(root, "dropped"), "mid_write:sleep=1").save(1, state)
    gc.collect()
    handle.wait(timeout=60)
    out["dropped_committed"] = asyncckpt.format.manifest.is_committed(Path(root, "dropped", "step_00000001"))

    # 3. a crash inside `with`: the save staged before it commits on every rank.
    try:
        with _manager(os.path.join(root, "crash"), "mid_write:sleep=1") as crashing:
            crashing.save(5, state)
            raise ValueError("the training loop crashed")
    except ValueError:
        pass
    out["crash_steps"] = crashing.steps()

    # The thread that finishes the dropped manager closes its queue: let it end
    # before the process group goes.
    deadline = time.monotonic() + 30
    while any(t.name == "asyncckpt-dropped-manager" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return out


@pytest.mark.timeout(180)
def test_lifecycle_on_two_ranks(tmp_path: Path) -> None:
    results = run_ranks(_rank_lifecycle, WORLD, str(tmp_path), timeout=150, start_method="forkserver")
    for rank, out in enumerate(results):
        assert out["refused"] is not None and "step 10 is already being saved" in out["refused"], (rank, out)
        assert str(tmp_path / "dup" / "step_00000010") in out["refused"]
        assert out["dup_steps"] == [10], (rank, out)
        assert out["dropped_committed"], (rank, out)
        assert out["crash_steps"] == [5], (rank, out)
    for sub in ("dup", "dropped", "crash"):
        path = next((tmp_path / sub).glob("step_*"))
        sd = asyncckpt.read_state_dict(path)  # every rank's data, as of its first save
        assert sorted(sd) == [f"w{r}" for r in range(WORLD)], (sub, sorted(sd))
        for r in range(WORLD):
            assert torch.equal(sd[f"w{r}"], torch.full((1 << 16,), float(r))), (sub, r)
    for sub in ("dup", "dropped", "crash"):
        assert not [e for e in os.listdir(tmp_path / sub) if e.startswith(".step_")], sub


def _manager_and_save_on_one_queue(rank: int, world: int, base: str, background: bool) -> dict[str, Any]:
    """A manager and ``asyncckpt.save`` given the same queue: the manager's overlapped
    save ends its copy at different times on the two ranks (rank 1's copy thread
    sleeps at the ``stage`` failpoint), a ``maybe_finalize()`` between (with a
    background finalizer it hands rank 0's to the writer), then ``asyncckpt.save`` on
    the queue: both commit on both ranks."""
    if rank == 1:
        os.environ["ASYNCCKPT_FAULT"] = "stage:sleep=1.5"  # read by the copy thread (and the other save's stage)
    queue = asyncckpt.AsyncCallsQueue(persistent=True, background_finalize=background)
    try:
        with asyncckpt.CheckpointManager(os.path.join(base, "root"), calls_queue=queue, overlap_staging=True) as mgr:
            state = {f"w{rank}": torch.full((1 << 16,), float(rank))}
            mgr.save(2, state)
            time.sleep(0.5)  # rank 0's copy is over, rank 1's is not
            mgr.maybe_finalize()
            other = {f"v{rank}": torch.full((1 << 10,), 10.0 + rank)}
            handle = asyncckpt.save(other, os.path.join(base, "other"), async_op=True, calls_queue=queue)
            committed = mgr.maybe_finalize(blocking=True)
            result = handle.result(timeout=60)
        return {"committed": committed, "other": result.step is None and Path(result.path).name == "other"}
    finally:
        queue.close()


@pytest.mark.parametrize("background", [True, False], ids=["background-finalizer", "finalized-in-the-loop"])
def test_a_manager_and_asyncckpt_save_sharing_a_queue_schedule_in_call_order_on_every_rank(
    tmp_path: Path, background: bool
) -> None:
    # Every rank must schedule a queue's calls in the same order; an overlapped save is
    # handed to the writer when its copy is over, which differs between ranks. Before,
    # with a background finalizer, rank 0 scheduled the manager's save first and rank 1
    # asyncckpt.save's (which handed off only its own savers' overlapped saves): their
    # commits met each other's collectives (gloo aborted a rank). Finalized in the
    # loop, rank 0's maybe_finalize() handed the save off and finalized it (a
    # collective) alone.
    seen = run_ranks(_manager_and_save_on_one_queue, WORLD, str(tmp_path), background, timeout=120)
    assert seen == [{"committed": [2], "other": True}] * WORLD
    saved = asyncckpt.read_state_dict(tmp_path / "root" / "step_00000002")
    other = asyncckpt.read_state_dict(tmp_path / "other")
    assert sorted(saved) == ["w0", "w1"] and sorted(other) == ["v0", "v1"]
    for r in range(WORLD):
        assert torch.equal(saved[f"w{r}"], torch.full((1 << 16,), float(r)))
        assert torch.equal(other[f"v{r}"], torch.full((1 << 10,), 10.0 + r))
