"""Observability (issue 34 item 4): per-phase timings of saves and loads, one INFO line
per save on the coordinator, and the timings hooks for metrics systems."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

import asyncckpt

from dist_utils import run_ranks

SAVED = "asyncckpt: saved step"


def _state() -> dict[str, Any]:
    return {"model": {"w": torch.randn(256, 64), "b": torch.arange(64)}, "opt": {"lr": 0.1}}


def _tensor_bytes(state: dict[str, Any]) -> int:
    m = state["model"]
    return sum(t.numel() * t.element_size() for t in (m["w"], m["b"]))


def _check_consistent(t: asyncckpt.SaveTimings) -> None:
    assert min(t.plan_s, t.stage_s, t.stall_s, t.write_s, t.commit_s, t.finalize_s, t.total_s) >= 0
    assert t.plan_s > 0 and t.stage_s > 0 and t.write_s > 0 and t.commit_s > 0  # measured, not defaults
    assert t.plan_s + t.stage_s <= t.stall_s <= t.total_s
    assert t.commit_s <= t.finalize_s <= t.total_s
    assert t[:6] == (t.stall_s, t.write_s, t.finalize_s, t.total_s, t.bytes, t.gbps)  # positional order kept


def test_save_timings_have_every_phase_and_add_up(tmp_path: Path) -> None:
    state = _state()
    with asyncckpt.CheckpointManager(tmp_path) as manager:
        for step in (1, 2):
            timings = manager.save(step, state).wait()
            _check_consistent(timings)
            assert timings.bytes >= _tensor_bytes(state)
        manager.save(3, state, async_op=False)
        sync = manager.last_committed_timings
        assert sync is not None
        _check_consistent(sync)
        assert sync.write_s <= sync.stall_s  # a synchronous save blocks through its write


def test_one_info_line_per_save_on_the_coordinator(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = _state()
    assert not logging.getLogger("asyncckpt").isEnabledFor(logging.INFO)  # off by default
    with asyncckpt.CheckpointManager(tmp_path) as manager:
        manager.save(1, state).wait()
        assert not [r for r in caplog.records if r.getMessage().startswith(SAVED)]
        caplog.set_level(logging.INFO, logger="asyncckpt")
        for step in (2, 3):
            manager.save(step, state).wait()
    lines = [r for r in caplog.records if r.getMessage().startswith(SAVED)]
    assert [r.levelno for r in lines] == [logging.INFO, logging.INFO]
    assert "step 2" in lines[0].getMessage() and "step 3" in lines[1].getMessage()
    for phase in ("plan", "stage", "stall", "write", "commit", "finalize", "total", "bytes"):
        assert phase in lines[1].getMessage()


def test_hook_receives_each_record_and_its_error_is_only_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = _state()
    seen: list[tuple[Any, int | None, Path]] = []

    def broken(record: Any, step: int | None, path: Path) -> None:
        raise RuntimeError("metrics backend down")

    handles = [asyncckpt.add_timings_hook(lambda r, s, p: seen.append((r, s, p))), asyncckpt.add_timings_hook(broken)]
    try:
        with asyncckpt.CheckpointManager(tmp_path) as manager:
            timings = [manager.save(step, state).wait() for step in (1, 2)]
            assert [(r, s, p) for r, s, p in seen] == [
                (timings[0], 1, manager.step_dir(1)),
                (timings[1], 2, manager.step_dir(2)),
            ]
            assert manager.steps() == [1, 2]  # the raising hook failed no save
            errors = [r for r in caplog.records if "timings hook" in r.getMessage()]
            assert len(errors) == 2 and all(r.levelno == logging.ERROR for r in errors)
            assert manager.load(_state(), 2) == 2
            assert isinstance(seen[-1][0], asyncckpt.LoadTimings) and seen[-1][2] == manager.step_dir(2)
            assert seen[-1][0] == manager.last_load_timings
    finally:
        for handle in handles:
            handle.remove()
    count = len(seen)
    asyncckpt.load(_state(), tmp_path / "step_00000002")
    assert len(seen) == count  # removed: not called again


@pytest.mark.parametrize("verify", ["inline", True, False])
def test_load_returns_its_timings(tmp_path: Path, verify: Literal["inline"] | bool) -> None:
    state = _state()
    with asyncckpt.CheckpointManager(tmp_path) as manager:
        manager.save(1, state, async_op=False)
    target = _state()
    timings = asyncckpt.load(target, tmp_path / "step_00000001", verify=verify)
    assert isinstance(timings, asyncckpt.LoadTimings)
    torch.testing.assert_close(target["model"], state["model"])
    assert timings.bytes == _tensor_bytes(state)
    assert timings.read_s > 0 and timings.verify_s >= 0 and timings.copy_s >= 0
    assert timings.read_s + timings.verify_s + timings.copy_s <= timings.total_s
    if verify is True:
        assert timings.verify_s > 0  # the files are checked before the reads


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _two_ranks(rank: int, world_size: int, root: str) -> tuple[int, int]:
    logger = logging.getLogger("asyncckpt")
    handler = _Collect()
    records = handler.records
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        seen: list[Any] = []
        hook = asyncckpt.add_timings_hook(lambda r, s, p: seen.append(r))
        with asyncckpt.CheckpointManager(root) as manager:
            for step in (1, 2):
                t = manager.save(step, {"w": torch.full((1024,), float(rank))}).wait()
                assert (t.commit_s > 0) == (rank == 0)  # the coordinator's storage.commit alone
        hook.remove()
        return sum(r.getMessage().startswith(SAVED) for r in records), len(seen)
    finally:
        logger.removeHandler(handler)


def test_only_the_coordinator_logs_with_two_ranks(tmp_path: Path) -> None:
    assert run_ranks(_two_ranks, 2, str(tmp_path), start_method="forkserver") == [(2, 2), (0, 2)]
