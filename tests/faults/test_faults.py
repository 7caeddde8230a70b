"""Fault injection on 1 rank (the test process), with the temporal and the persistent caller.

Each scenario of ``_scenarios.SCENARIOS`` commits step 1, injects a fault into the save
of step 2, and asserts (a) it ends within a bounded time, (b) the promised outcome: the
save raises a ``CheckpointException`` naming the rank and the cause (or, where stated,
commits completely, or is refused before anything is written), (c) nothing incomplete
is committed: ``latest`` and step 1 are untouched and verify, ``steps()`` lists no new
step, and (d) the next save commits. The interpreter-exit scenario runs a script in a
subprocess (plain interpreter, and a multiprocessing child rank as launched by
``torch.multiprocessing.spawn``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import asyncckpt
from asyncckpt import CheckpointManager

from . import _scenarios as S
from helpers import kill_session

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TESTS_DIR = str(Path(__file__).resolve().parents[1])
REPO_DIR = str(Path(__file__).resolve().parents[2])
ONE_RANK = [(name, caller) for name in S.SCENARIOS for caller in S.BOTH if S.applies(name, caller, 1)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name,caller", ONE_RANK, ids=[f"{n}-{c}" for n, c in ONE_RANK])
def test_fault_one_rank(tmp_path: Path, name: str, caller: str) -> None:
    spec = S.SCENARIOS[name]
    base = tmp_path / name
    workdir = tmp_path / "markers"
    workdir.mkdir()
    mount = S.small_tmpfs(base) if spec.get("mount") else contextlib.nullcontext(False)
    with mount as mounted:
        mechanism = None
        if name == "enospc":
            mechanism = S.disk_full_mechanism(mounted)
        elif name == "readonly":
            mechanism = S.read_only_mechanism(base, mounted)
        result = S.run_scenario(0, 1, name, caller == "persistent", str(base / "root"), str(workdir), mechanism)
    S.check_scenario(name, [result], 1)


def check_aborted_handle(state: dict) -> None:
    """The handle of a save dropped by ``close(abort=True)`` must not stay pending
    forever: ``done()`` is True, ``exception()`` says why, ``wait()`` raises it.
    (A loop ``while not handle.done()`` would otherwise never end.)"""
    assert state["done"], f"the aborted save's handle reports pending forever: {state}"
    assert state["exception"] == "CheckpointException", state
    assert state["wait"].startswith("CheckpointException"), state


@pytest.mark.timeout(60)
@pytest.mark.parametrize("caller", S.BOTH)
def test_handle_of_aborted_save_reports_failure(tmp_path: Path, caller: str) -> None:
    root = tmp_path / "root"
    marker = str(tmp_path / "mid_write")
    manager = CheckpointManager(root, persistent=caller == "persistent")
    try:
        manager.save(1, S.make_state(0, 1)).wait(timeout=S.WAIT_S)
        with S.armed(manager, f"mid_write:touch={marker};mid_write:sleep={S.FAILPOINT_SLEEP_S}", disarm=False):
            handle = manager.save(2, S.make_state(0, 2))
            assert S.wait_for_file(marker)
            manager.close(abort=True)
        state = S._handle_state(handle)
    finally:
        manager.close(abort=True)
    assert manager.steps() == [1]
    check_aborted_handle(state)


# ----------------------------------------------------------------------------- interpreter exit
EXIT_SCRIPT = """\
import json, multiprocessing as mp, os, sys, time
sys.path[:0] = [{repo_dir!r}, {tests_dir!r}]  # this checkout's asyncckpt and test helpers


def main(rank, world, port):
    from faults import _scenarios as S  # here: the mp launcher itself needs no torch

    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=world)
    S.exit_with_save_in_flight(rank, world, {root!r}, {persistent!r}, {marker!r})
    # no close(), no destroy_process_group(): the interpreter exits with the save in flight


if __name__ == "__main__":
    mode, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    if mode == "plain":
        main(rank, world, port)
    else:  # the rank is a multiprocessing child, as torch.multiprocessing.spawn starts it
        child = mp.get_context("spawn").Process(target=main, args=(rank, world, port))
        child.start()
        child.join({child_wait_s})
        alive = child.is_alive()
        print(json.dumps({{"child_exited": not alive, "exitcode": child.exitcode, "t": time.monotonic()}}),
              flush=True)
        if alive:  # do not leave it behind: the test reports the hang
            import psutil
            for p in psutil.Process(child.pid).children(recursive=True) + [psutil.Process(child.pid)]:
                p.kill()
            child.join()
"""
EXIT_BOUND_S = 10.0
CHILD_WAIT_S = EXIT_BOUND_S + 2.0


def start_exit_script(
    tmp_path: Path, root: Path, persistent: bool, mode: str, rank: int, world: int, port: int
) -> subprocess.Popen:
    script = tmp_path / "exit_with_save_in_flight.py"
    if not script.exists():
        script.write_text(
            EXIT_SCRIPT.format(
                repo_dir=REPO_DIR,
                tests_dir=TESTS_DIR,
                root=str(root),
                persistent=persistent,
                marker=str(tmp_path / "mid_write"),
                child_wait_s=CHILD_WAIT_S,
            )
        )
    # The exit waits for the save in flight (held at its failpoint for a minute) up to
    # this bound, then stops its writer: 1 s instead of the default 5 (the same path).
    env = dict(os.environ, OMP_NUM_THREADS="1", ASYNCCKPT_EXIT_TIMEOUT_S="1")
    env.pop(S.FAULT_ENV, None)
    return subprocess.Popen(
        [sys.executable, str(script), mode, str(rank), str(world), str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def finish_exit_scripts(procs: list[subprocess.Popen], timeout: float = 60.0) -> list[tuple[dict, float, str]]:
    """Wait for the scripts; returns (their JSON lines merged, when each ended, stderr)."""
    ended = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)  # also waits for the grandchildren's pipes
            t_end = time.monotonic()
            assert proc.returncode == 0, f"the script failed ({proc.returncode}):\n{err}"
            lines = {}
            for line in out.splitlines():
                if line.startswith("{"):
                    lines.update(
                        {("parent_" if "child_exited" in line else "") + k: v for k, v in json.loads(line).items()}
                    )
            ended.append((lines, t_end, err))
    finally:
        for proc in procs:
            if proc.poll() is None or proc.returncode is None:
                kill_session(proc)
    return ended


def check_after_exit(root: Path, world: int, persistent: bool, lines: list[dict]) -> None:
    """The save in flight is committed completely or absent; step 1 and latest intact;
    the writers are gone; the next save (here, one process) commits."""
    for line in lines:
        assert line["reached"], "the write never reached the failpoint"
        assert S.process_gone(line["writer"], timeout=5), f"writer {line['writer']} outlived the exit"
    snap = S.snapshot(root)
    assert sorted(snap["steps"]) in (["step_00000001"], ["step_00000001", "step_00000002"]), snap
    assert all(v is None for v in snap["verify"].values()), snap["verify"]
    assert snap["latest"].strip() in snap["steps"], snap
    assert [n for n in snap["visible"] if n.startswith("step_")] == sorted(snap["steps"]), snap
    manager = CheckpointManager(root, keep_last=S.KEEP_LAST, persistent=persistent)
    try:
        expected = {}
        for rank in range(world):
            expected.update(S.make_state(rank, 1))
        got = S.fresh_like(expected)
        manager.load(got, step=1)
        assert S.same_state(expected, got), "step 1 does not read back"
        state = S.make_state(0, 3)
        manager.save(3, state).wait(timeout=S.WAIT_S)
        assert manager.latest_step() == 3
        asyncckpt.verify(manager.step_dir(3))
    finally:
        manager.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("caller", S.BOTH)
def test_interpreter_exit_with_save_in_flight(tmp_path: Path, caller: str) -> None:
    persistent = caller == "persistent"
    root = tmp_path / "root"
    proc = start_exit_script(tmp_path, root, persistent, "plain", 0, 1, 0)
    [(lines, t_end, _err)] = finish_exit_scripts([proc])
    exit_s = t_end - lines["t"]
    assert exit_s < EXIT_BOUND_S, f"the script took {exit_s:.1f} s to exit with a save in flight"
    check_after_exit(root, 1, persistent, [lines])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("caller", S.BOTH)
def test_multiprocessing_child_rank_exit_with_save_in_flight(tmp_path: Path, caller: str) -> None:
    """The same, with the rank a multiprocessing (spawn) child, as launched by
    ``torch.multiprocessing.spawn``: such a child exits through multiprocessing's own
    exit path (no atexit handlers), which SIGTERMs daemonic children and joins them."""
    persistent = caller == "persistent"
    root = tmp_path / "root"
    proc = start_exit_script(tmp_path, root, persistent, "mp", 0, 1, 0)
    [(lines, _t_end, err)] = finish_exit_scripts([proc])
    assert "t" in lines, f"the child rank never reported:\n{err}"
    assert lines["parent_child_exited"], (
        f"the rank process did not exit within {CHILD_WAIT_S} s of returning with a save in flight "
        f"(it was killed by the test script); stderr:\n{err[-3000:]}"
    )
    exit_s = lines["parent_t"] - lines["t"]
    assert exit_s < EXIT_BOUND_S, f"the rank took {exit_s:.1f} s to exit with a save in flight"
    check_after_exit(root, 1, persistent, [lines])
