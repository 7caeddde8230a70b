"""PreemptionSave: a real SIGTERM to a real training loop (a subprocess per rank).

Each script prints one JSON line of what it saw before it exits; the assertions on the
exit code, the committed steps and their contents run here. scripts/train.py's use of
it (1 and 2 ranks, bitwise resume) is in test_train.py.
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

from dist_utils import free_port
from helpers import process_group_gone, started_session

_SCRIPT = textwrap.dedent("""
    import json, logging, os, signal, sys, time
    import torch
    import torch.distributed as dist
    import asyncckpt
    root, kill_at, grace_s, fault = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    rank = int(os.environ.get("RANK", "0"))
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group("gloo")
    if fault != "-":
        os.environ["ASYNCCKPT_FAULT"] = fault  # the worker inherits it at its start
    mgr = asyncckpt.CheckpointManager(root)
    os.environ.pop("ASYNCCKPT_FAULT", None)
    state = {"w": torch.zeros(1 << 16), "step": 0}
    t_signal = None
    with asyncckpt.PreemptionSave(mgr, grace_s=grace_s) as preemption:
        for step in range(1, 1000):
            state["w"].fill_(step)
            state["step"] = step
            if step % 4 == 0:
                mgr.save(step, state)
            if step == kill_at and rank == int(os.environ.get("KILL_RANK", "0")):
                t_signal = time.monotonic()
                os.kill(os.getpid(), signal.SIGTERM)
            if preemption.reached(step):
                print(json.dumps({"stop": step, "rank": rank}), flush=True)
                try:
                    preemption.finish(step, state)
                finally:
                    print(json.dumps({"exit_after_s": time.monotonic() - (t_signal or time.monotonic()),
                                      "rank": rank}), flush=True)
            time.sleep(0.01)
""")


@contextlib.contextmanager
def _start(tmp_path: Path, args: list[str], env: dict[str, str] | None = None) -> Any:
    script = tmp_path / "preempt.py"
    script.write_text(_SCRIPT)
    with started_session(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, **(env or {})),
    ) as proc:
        yield proc


def _lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _saved_w(root: Path, step: int) -> float:
    state: dict[str, Any] = {"w": torch.zeros(1 << 16), "step": 0}
    asyncckpt.load(state, root / f"step_{step:08d}")
    assert state["step"] == step
    return float(state["w"][0])


@pytest.mark.timeout(90)
def test_sigterm_waits_for_the_save_in_flight_then_commits_the_stop_step(tmp_path: Path) -> None:
    """The save of step 4 is still writing (1 s) when SIGTERM arrives at step 6: both
    commit, step 6 holds step 6's values, the exit code is 143."""
    root = tmp_path / "root"
    with _start(tmp_path, [str(root), "6", "30", "mid_write:sleep=1"]) as proc:
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, f"{out}\n{err}"
    lines = _lines(out)
    assert lines[0] == {"stop": 6, "rank": 0}, out  # one rank: no agreement round
    assert "SIGTERM: step 6 committed" in err, err
    mgr_steps = sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step_"))
    assert mgr_steps == [4, 6], mgr_steps
    assert _saved_w(root, 4) == 4 and _saved_w(root, 6) == 6
    assert (root / "latest").read_text().strip() == "step_00000006"
    assert not [p for p in root.iterdir() if ".tmp-" in p.name]


@pytest.mark.timeout(90)
def test_past_the_grace_budget_the_save_is_aborted_and_the_process_exits(tmp_path: Path) -> None:
    """Every write takes 30 s, the grace budget is 2 s: the process exits 143 about 2 s
    after the signal, nothing is committed, nothing is left behind, the worker is gone."""
    root = tmp_path / "root"
    with _start(tmp_path, [str(root), "6", "2", "mid_write:sleep=30"]) as proc:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 143, f"{out}\n{err}"
        assert process_group_gone(proc.pid, 10), "the checkpoint worker outlived the process"
    exit_after = _lines(out)[-1]["exit_after_s"]
    assert 1.5 < exit_after < 2 + 5, out  # the budget, well before the 30 s write
    assert "the grace budget of 2 s ran out" in err, err
    assert not [p for p in root.iterdir() if p.name.startswith("step_")]
    assert not [p for p in root.iterdir() if ".tmp-" in p.name]


@pytest.mark.timeout(120)
def test_sigterm_on_one_rank_stops_both_at_the_same_step(tmp_path: Path) -> None:
    """Rank 1 alone receives SIGTERM at step 5: both ranks agree on one stop step (one
    step later: the agreement collective never blocks a step), commit it, exit 143."""
    root = tmp_path / "root"
    port = str(free_port())
    with contextlib.ExitStack() as stack:
        procs = [
            stack.enter_context(
                _start(
                    tmp_path,
                    [str(root), "5", "30", "-"],
                    {
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": port,
                        "RANK": str(r),
                        "WORLD_SIZE": "2",
                        "KILL_RANK": "1",
                        "OMP_NUM_THREADS": "1",
                    },
                )
            )
            for r in range(2)
        ]
        outs = [p.communicate(timeout=90) for p in procs]
        assert [p.returncode for p in procs] == [143, 143], outs
    stops = [_lines(out)[0]["stop"] for out, _ in outs]
    assert stops == [6, 6], outs
    assert _saved_w(root, 6) == 6 and _saved_w(root, 4) == 4


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="grace_s"):
        asyncckpt.PreemptionSave(object(), grace_s=0)
    with pytest.raises(ValueError, match="at least one signal"):
        asyncckpt.PreemptionSave(object(), signals=())
    previous = signal.getsignal(signal.SIGUSR1)
    p = asyncckpt.PreemptionSave(object(), signals=(signal.SIGUSR1,), grace_s=1)
    try:
        with pytest.raises(RuntimeError, match="after reached"):
            p.finish(1, {})
        assert not p.reached(1)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        assert p.signum == signal.SIGUSR1 and p.reached(2) and p.agreed_signum == signal.SIGUSR1
    finally:
        p.close()
    assert signal.getsignal(signal.SIGUSR1) == previous  # restored


_DATALOADER_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    import asyncckpt

    def main():
        mgr = asyncckpt.CheckpointManager(sys.argv[1])
        state = {"w": torch.zeros(1000), "step": 0}
        with asyncckpt.PreemptionSave(mgr, grace_s=30) as preemption:
            loader = DataLoader(TensorDataset(torch.randn(100_000, 8)), batch_size=4, num_workers=2,
                                persistent_workers=True, multiprocessing_context="fork",
                                worker_init_fn=asyncckpt.PreemptionSave.worker_init_fn)
            for step, (x,) in enumerate(loader, 1):
                state["w"].fill_(step)
                state["step"] = step
                time.sleep(0.01)
                if step % 20 == 0:
                    mgr.save(step, state)
                if step == 50:
                    print("ready", flush=True)
                if preemption.reached(step):
                    print(json.dumps({"stop": step}), flush=True)
                    preemption.finish(step, state)

    if __name__ == "__main__":
        main()
""")


@pytest.mark.timeout(90)
def test_sigterm_to_the_group_with_fork_started_dataloader_workers(tmp_path: Path) -> None:
    """The scheduler signals every process of the job, DataLoader workers included: with
    ``PreemptionSave.worker_init_fn`` they ignore it and keep feeding the loop, and no
    'DataLoader worker is killed by signal' error fails the final save."""
    root = tmp_path / "root"
    script = tmp_path / "loader.py"
    script.write_text(_DATALOADER_SCRIPT)
    with started_session(
        [sys.executable, str(script), str(root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("ready"):
                break
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 143, f"{out}\n{err}"
        assert process_group_gone(proc.pid, 10), "a DataLoader worker or the checkpoint worker outlived the run"
    stop = _lines(out)[0]["stop"]
    assert f"step {stop} committed" in err and "killed by signal" not in err, err
    state: dict[str, Any] = {"w": torch.zeros(1000), "step": 0}
    asyncckpt.load(state, root / f"step_{stop:08d}")
    assert state["step"] == stop and float(state["w"][0]) == stop
