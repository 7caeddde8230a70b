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
