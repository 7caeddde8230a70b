"""Checkpoints written before a change load after it.

``tests/data/v0_1_root`` was committed by asyncckpt 0.1.0 as it stood before the
issue-26 restructure (``tests/data/make_v0_1_checkpoint.py`` wrote it, once). Every read
path of the current code must read it bitwise: ``asyncckpt.load``, ``read_state_dict``,
``verify``, ``CheckpointManager`` (resume and a new save next to the old steps), stock
``torch.distributed.checkpoint`` and the command line.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import asyncckpt

from helpers import assert_same, zeroed

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A copy of the committed root (a manager takes a lock and writes next to it)."""
    dst = tmp_path / "v0_1_root"
    shutil.copytree(DATA / "v0_1_root", dst)
    return dst


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    return torch.load(DATA / "v0_1_expected.pt", weights_only=False)


def test_read_state_dict_and_verify(root: Path, expected: dict[str, Any]) -> None:
    step = root / "step_00000002"
    report = asyncckpt.verify(step)
    assert report["step"] == 2 and report["world_size"] == 1 and "__0_0.distcp" in report["files"]
    got = asyncckpt.read_state_dict(step, allow_pickle=True)
    assert_same(expected, got)
    assert 0 in got and 3 in got["extra"] and 0 in got["optim"]["state"]


def test_load_in_place(root: Path, expected: dict[str, Any]) -> None:
    target = zeroed(expected)
    asyncckpt.load(target, root / "step_00000002")
    assert_same(expected, target)


def test_manager_resumes_and_saves_beside_the_old_steps(root: Path, expected: dict[str, Any]) -> None:
    with asyncckpt.CheckpointManager(root, keep_last=2) as mgr:
        assert mgr.steps() == [1, 2]
        assert mgr.latest_step() == 2
        target = zeroed(expected)
        mgr.load(target)
        assert_same(expected, target)
        expected["extra"]["epoch"] = 3
        mgr.save(3, expected).wait()
        assert mgr.steps() == [2, 3]
    again = zeroed(expected)
    asyncckpt.load(again, root / "step_00000003")
    assert_same(expected, again)


def test_stock_dcp_loads_the_tensors(root: Path, expected: dict[str, Any]) -> None:
    tensors = {
        "model": {k: torch.zeros_like(v) for k, v in expected["model"].items()},
        "tensors": {k: torch.zeros_like(v) for k, v in expected["tensors"].items()},
    }
    dcp.load(tensors, checkpoint_id=str(root / "step_00000002"))
    assert_same({"model": expected["model"], "tensors": expected["tensors"]}, tensors)


def test_cli_lists_and_verifies(root: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "asyncckpt", *args], capture_output=True, text=True, timeout=120)

    ls = cli("ls", str(root))
    assert ls.returncode == 0, ls.stderr
    assert "step_00000001" in ls.stdout and "step_00000002" in ls.stdout
    ver = cli("verify", str(root / "step_00000002"))
    assert ver.returncode == 0, ver.stdout + ver.stderr
