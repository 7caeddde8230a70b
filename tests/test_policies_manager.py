"""Retention policies and save decisions through CheckpointManager: which steps remain
over 100+ steps and across a restart; should_save agrees on 2 real gloo ranks."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import torch

import asyncckpt
from asyncckpt.policy import AnyOf, EveryNSteps, LatestN, SaveInterval

from dist_utils import run_ranks


def _state(step: int) -> dict:
    return {"w": torch.full((4,), float(step)), "step": step}


def test_a_policy_keeps_its_steps_over_120_steps_and_across_a_restart(tmp_path: Path) -> None:
    policy = AnyOf(LatestN(2), EveryNSteps(25))
    with asyncckpt.CheckpointManager(tmp_path, keep=policy, persistent=False) as manager:
        for step in range(0, 120, 3):  # 40 saves: 0, 3, ..., 117
            manager.save(step, _state(step), async_op=False)
        manager.close()
    # 0, 75 are multiples of 25 among the saved steps; 114, 117 the newest two
    assert asyncckpt.CheckpointManager(tmp_path, read_only=True).steps() == [0, 75, 114, 117]
    # A restart that reloads the root (keep_last=1 and the same every-25 rule): the root's
    # earlier steps are judged by the new policy after the next commit.
    with asyncckpt.CheckpointManager(tmp_path, keep_last=1, keep=EveryNSteps(25), persistent=False) as manager:
        state = _state(0)
        assert manager.load(state) == 117
        for step in range(118, 151):
            manager.save(step, _state(step), async_op=False)
        assert manager.steps() == [0, 75, 125, 150]
        loaded = _state(0)
        manager.load(loaded, 125)
        assert loaded["step"] == 125 and torch.equal(loaded["w"], torch.full((4,), 125.0))


def _should_save_rank(rank: int, world_size: int, root: str) -> list[int]:
    # Rank 1 is three times slower per step than rank 0; time-based decisions must
    # still agree (no collective per step).
    manager = asyncckpt.CheckpointManager(root, save_interval=SaveInterval(steps=20, seconds=0.25), persistent=False)
    saved = []
    try:
        for step in range(1, 50):
            time.sleep(0.01 if rank == 0 else 0.03)
            if manager.should_save(step):
                manager.save(step, _state(step))
                saved.append(step)
        manager.close()
    finally:
        manager.close(abort=True)
    return saved


def test_should_save_agrees_on_two_ranks_with_steps_and_seconds(tmp_path: Path) -> None:
    by_rank = run_ranks(_should_save_rank, 2, str(tmp_path), timeout=120, start_method="forkserver")
    assert by_rank[0] == by_rank[1]
    saved = by_rank[0]
    assert saved[0] == 1  # the clock starts with a save every rank took part in
    assert 20 in saved and 40 in saved  # the step interval
    # the time interval (0.25 s at the slowest rank's ~0.03 s a step: about every 9 steps)
    timed = [s for s in saved if s % 20]
    assert len(timed) >= 3 and all(b - a < 20 for a, b in itertools.pairwise(timed))
    assert asyncckpt.CheckpointManager(tmp_path, read_only=True).steps() == saved


def test_should_save_without_an_interval_is_false_and_checks_its_step(tmp_path: Path) -> None:
    import pytest

    with asyncckpt.CheckpointManager(tmp_path, persistent=False) as manager:
        assert not manager.should_save(10)
        with pytest.raises(asyncckpt.InvalidArgumentError):
            manager.should_save(-1)
    with pytest.raises(asyncckpt.InvalidArgumentError):
        asyncckpt.CheckpointManager(tmp_path, save_interval=20)  # type: ignore[arg-type]
    with pytest.raises(asyncckpt.InvalidArgumentError):
        asyncckpt.CheckpointManager(tmp_path, keep="latest")  # type: ignore[arg-type]
