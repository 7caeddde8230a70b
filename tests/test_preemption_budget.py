"""PreemptionSave's grace budget starts at the signal (issue 25, item 5).

Real processes and real signals: a child python process trains, the test sends it
SIGTERM with ``os.kill`` at a chosen point, and checks the exit code, the time from the
signal to the exit, and what is committed on disk. Slow writes and commits come from
``ASYNCCKPT_FAULT`` failpoints (``mid_write:sleep``, ``commit:sleep``); the ``touch``
actions and marker files tell the test where the child is.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt.preemption import HARD_EXIT_SLACK_S

from dist_utils import free_port
from helpers import process_group_gone, started_session

_SCRIPT = textwrap.dedent("""
    import json, os, pathlib, sys, time
    import torch
    import torch.distributed as dist
    import asyncckpt
    root, grace_s, worker_fault, main_fault, mode = sys.argv[1], float(sys.argv[2]), *sys.argv[3:6]
    marker = pathlib.Path(sys.argv[6])
    rank = int(os.environ.get("RANK", "0"))
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group("gloo")
    buffers = int(os.environ.get("STAGING_BUFFERS", "1"))
    if worker_fault != "-":
        os.environ["ASYNCCKPT_FAULT"] = worker_fault  # the worker inherits it at its start
    mgr = asyncckpt.CheckpointManager(root, staging_buffers=buffers)
    os.environ.pop("ASYNCCKPT_FAULT", None)
    if main_fault != "-":
        os.environ["ASYNCCKPT_FAULT"] = main_fault  # this process: the commit (finalizer thread)
    state = {"w": torch.zeros(1 << 16), "step": 0}

    def set_state(step):
        state["w"].fill_(step)
        state["step"] = step

    def train():
        with asyncckpt.PreemptionSave(mgr, grace_s=grace_s) as preemption:
            set_state(1)
            mgr.save(1, state)
            step = 1
            if mode == "save_again":
                set_state(2)
                if rank == 0:
                    (marker.parent / ("saving2." + str(rank))).touch()
                mgr.save(2, state)  # one staging buffer: waits for the write of step 1
                step = 2
                (marker.parent / ("saved2." + str(rank))).touch()
            while True:
                if preemption.reached(step):
                    print(json.dumps({"stop": step, "rank": rank}), flush=True)
                    preemption.finish(step, state)
                time.sleep(0.01)
                step += 1
                set_state(step)

    try:
        train()
    finally:  # the training script's end (then the interpreter's teardown, not timed)
        print(json.dumps({"done_at": time.monotonic(), "rank": rank}), flush=True)
""")


@contextlib.contextmanager
def _start(tmp_path: Path, args: list[str], env: dict[str, str] | None = None) -> Any:
    script = tmp_path / "budget.py"
    script.write_text(_SCRIPT)
    with started_session(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, **(env or {})),
    ) as proc:
        yield proc


def _wait_for(path: Path, proc: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the child exited ({proc.returncode}) before {path.name}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} did not appear within {timeout} s")
        time.sleep(0.02)


def _committed(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step_"))


def _saved_w(root: Path, step: int) -> float:
    state: dict[str, Any] = {"w": torch.zeros(1 << 16), "step": 0}
    asyncckpt.load(state, root / f"step_{step:08d}")
    assert state["step"] == step
    return float(state["w"][0])


def _done_after(out: str, t_signal: float) -> float:
    """Seconds from the signal to the end of the child's training script (its last
    ``finally``; time.monotonic() is one clock for every process of the machine). The
    interpreter's teardown after it is not the budget's: it takes seconds on a loaded
    machine, and SIGKILL during it loses nothing."""
    done = [json.loads(line)["done_at"] for line in out.splitlines() if line.startswith('{"done_at"')]
    assert done, out
    return done[-1] - t_signal


def _terminate(proc: Any, timeout: float) -> tuple[str, str, float]:
    """SIGTERM to ``proc``; its output and the seconds from the signal to the end of its
    script (it must exit within ``timeout`` s: else the test fails, and started_session
    kills it)."""
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the process did not exit within {timeout} s of SIGTERM (the grace budget was overrun)")
    return out, err, _done_after(out, t0)


@pytest.mark.timeout(120)
def test_sigterm_while_save_waits_for_the_staging_buffer_exits_within_the_budget(tmp_path: Path) -> None:
    """One staging buffer, every write takes 30 s: SIGTERM arrives while save(2) waits
    for the write of step 1; grace_s=2. The process exits 143 within the budget (plus
    the abort's slack), not after the 30 s write; nothing partial is committed or left
    behind; the checkpoint worker is gone."""
    root = tmp_path / "root"
    marker = tmp_path / "m"
    with _start(tmp_path, [str(root), "2", "mid_write:sleep=30", "-", "save_again", str(marker)]) as proc:
        _wait_for(tmp_path / "saving2.0", proc)
        time.sleep(0.5)  # inside save(2)'s wait
        assert not (tmp_path / "saved2.0").exists()
        out, err, elapsed = _terminate(proc, 20)
        assert proc.returncode == 143, f"{out}\n{err}"
        assert process_group_gone(proc.pid, 10), "the checkpoint worker outlived the process"
    print(f"the script ended {elapsed:.2f} s after SIGTERM")
    assert elapsed < 2 + HARD_EXIT_SLACK_S, (elapsed, err)
    assert "the grace budget of 2 s ran out" in err, err
    assert _committed(root) == [], err
    assert not [p for p in root.iterdir() if ".tmp-" in p.name]


@pytest.mark.timeout(120)
def test_a_fully_written_save_is_committed_when_the_budget_runs_out_during_its_commit(tmp_path: Path) -> None:
    """Step 1 is fully written (the worker touched the marker after its fsyncs), its
    commit takes 3 s (a slow file system), grace_s=1: the final save cannot be made,
    but step 1 is committed, not dropped, and ``latest`` names it; exit 143 within the
    budget plus the abort's slack."""
    root = tmp_path / "root"
    marker = tmp_path / "written"
    with _start(
        tmp_path, [str(root), "1", f"after_write:touch={marker}", "commit:sleep=3", "loop", str(marker)]
    ) as proc:
        _wait_for(marker, proc)
        out, err, elapsed = _terminate(proc, 20)
        assert proc.returncode == 143, f"{out}\n{err}"
    print(f"the script ended {elapsed:.2f} s after SIGTERM")
    assert elapsed < 1 + HARD_EXIT_SLACK_S, (elapsed, err)
    assert "the grace budget of 1 s ran out" in err, err
    assert _committed(root) == [1], err
    assert (root / "latest").read_text().strip() == "step_00000001"
    assert _saved_w(root, 1) == 1
    assert not [p for p in root.iterdir() if ".tmp-" in p.name]


@pytest.mark.timeout(180)
def test_two_ranks_one_waiting_in_save_the_other_in_reached_both_exit_within_the_budget(tmp_path: Path) -> None:
    """Two ranks, every write 30 s. Rank 0 (one staging buffer) waits in save(2) for the
    write of step 1; rank 1 (two buffers) goes on and waits in reached() for rank 0's
    part of the agreement. SIGTERM to both, grace_s=2: both exit 143 within the budget
    plus the abort's slack; nothing is committed."""
    root = tmp_path / "root"
    marker = tmp_path / "m"
    port = str(free_port())
    with contextlib.ExitStack() as stack:
        procs = [
            stack.enter_context(
                _start(
                    tmp_path,
                    [str(root), "2", "mid_write:sleep=30", "-", "save_again", str(marker)],
                    {
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": port,
                        "RANK": str(r),
                        "WORLD_SIZE": "2",
                        "OMP_NUM_THREADS": "1",
                        "STAGING_BUFFERS": str(1 + r),
                    },
                )
            )
            for r in range(2)
        ]
        _wait_for(tmp_path / "saved2.1", procs[1])  # rank 1 went on to reached()
        time.sleep(0.5)
        assert not (tmp_path / "saved2.0").exists()  # rank 0 still waits for its buffer
        t0 = time.monotonic()
        for p in procs:
            os.kill(p.pid, signal.SIGTERM)
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=max(1.0, 25 - (time.monotonic() - t0))))
            except subprocess.TimeoutExpired:
                pytest.fail("a rank did not exit within 25 s of SIGTERM (the grace budget was overrun)")
        assert [p.returncode for p in procs] == [143, 143], outs
    elapsed = [_done_after(out, t0) for out, _ in outs]
    print(f"the ranks' scripts ended {elapsed[0]:.2f} s, {elapsed[1]:.2f} s after SIGTERM")
    assert max(elapsed) < 2 + HARD_EXIT_SLACK_S, (elapsed, outs)
    assert all("the grace budget of 2 s ran out" in err for _, err in outs), outs
    assert _committed(root) == []
