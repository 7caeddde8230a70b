"""The training thread's calls run with the cyclic garbage collector paused: no
collection starts inside a save's stall or a restore, and the collector is back on
after (also after a refusal), or stays off where the user turned it off.

Each test makes the collector run at (nearly) every allocation of a tracked object
(young generation only: cheap), so a call that builds its plan with the collector on
starts hundreds of collections; paused from its first line, none (a few are allowed
for the allocations of the call itself before the pause begins, and for the
background threads that run between the end of the pause and the end of the count).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import asyncckpt
from asyncckpt.errors import CheckpointError

#: Collections that may still start around a paused call (see the module's docstring).
_AROUND = 6


@contextlib.contextmanager
def _collections() -> Iterator[list[int]]:
    """The generations of the collections that start while the block runs, the
    collector made to collect its young generation at every other allocation."""
    starts: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            starts.append(info["generation"])

    threshold = gc.get_threshold()
    gc.collect()
    gc.set_threshold(1, 1 << 30, 1 << 30)
    gc.callbacks.append(seen)
    try:
        yield starts
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*threshold)


def _state(step: int) -> dict:
    # many small entries, as a model's: the plan builds objects for each
    return {"layers": {f"l{i}": {"w": torch.full((64,), float(step + i)), "b": torch.zeros(8)} for i in range(64)}}


def test_no_collection_starts_inside_a_save_or_a_restore(tmp_path: Path) -> None:
    tier = asyncckpt.LocalTier(dir=tmp_path / "node0", every=1, replicas=0)
    with asyncckpt.CheckpointManager(tmp_path / "root", local=tier) as mgr:
        assert mgr.local is not None
        mgr.save(1, _state(0))  # (the first save sizes the staging buffers)
        mgr.maybe_finalize(blocking=True)
        state, plain, where = _state(2), _state(3), tmp_path / "plain"
        save = asyncckpt.save  # (imported on first use: not inside the count)
        with _collections() as starts:
            mgr.save(2, state)
        assert len(starts) <= _AROUND, starts
        with _collections() as starts:
            mgr.local.save(2, state)
        assert len(starts) <= _AROUND, starts
        with _collections() as starts:
            handle = save(plain, where)
        assert len(starts) <= _AROUND, starts
        assert mgr.maybe_finalize(blocking=True) == [2]
        assert mgr.local.maybe_finalize(blocking=True) == [2]
        got = _state(-1)
        with _collections() as starts:
            result = mgr.restore(got)
        assert len(starts) <= _AROUND, starts
        assert result is not None and (result.step, result.tier) == (2, "local")
        assert torch.equal(got["layers"]["l5"]["w"], _state(2)["layers"]["l5"]["w"])
    handle.wait(timeout=60)
    asyncckpt.verify(where)
    assert gc.isenabled()


def test_the_collector_is_back_on_after_a_refused_save_and_stays_off_if_it_was(tmp_path: Path) -> None:
    with asyncckpt.CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(1, _state(1))
        mgr.maybe_finalize(blocking=True)
        with pytest.raises(CheckpointError, match="exists"):
            mgr.save(1, _state(1))  # (refused: the step is there)
        assert gc.isenabled()
        gc.disable()
        try:
            mgr.save(2, _state(2))
            mgr.maybe_finalize(blocking=True)
            assert not gc.isenabled()  # the user's choice stands
        finally:
            gc.enable()
