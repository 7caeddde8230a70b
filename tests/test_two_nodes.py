"""The training example on two "nodes": two torchrun agents on this machine, 2 ranks each.

The agents meet through a c10d rendezvous on 127.0.0.1 (as two nodes of a cluster would
through their head node), so the 4 ranks span two agents, each with its own
``LOCAL_RANK`` 0 and 1, ``GROUP_RANK`` and ``LOCAL_WORLD_SIZE``. An exact resume there
(from step 20, ``--resume`` to 40) must give bitwise the parameters of an
uninterrupted 40-step run. (It did not: DDP all-reduces a resumed process's first step
with its initial gradient bucket layout, an uninterrupted run's step 21 with the layout
repacked after its first backward, and on more than 2 ranks the all-reduce's order of
addition depends on the layout; scripts/train.py's ``settle_ddp_buckets``.)

Every agent runs in a session of its own; whatever of it is left (ranks, checkpoint
workers) is killed when the test ends, also on failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dist_utils import free_port
from helpers import started_session

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train.py"
# A tiny model on ~4 KB of text: 249 windows of 16 bytes, 7 steps of 4 x 8 windows per
# epoch, so the runs below cross epoch boundaries (the data position is checkpointed too).
TINY = [
    "--n-layer",
    "1",
    "--n-embd",
    "32",
    "--n-head",
    "2",
    "--block-size",
    "16",
    "--batch-size",
    "8",
    "--data-mb",
    "0.004",
    "--dropout",
    "0.1",
    "--lr",
    "3e-3",
    "--quiet",
]
# --temporal: a forked writer per save, no extra interpreter per rank to start.
RUN = [*TINY, "--temporal", "--steps", "40", "--ckpt-every", "20"]


def agent_cmd(port: int, max_restarts: int = 0) -> list[str]:
    """One of the two torchrun agents ("nodes") of 2 ranks each, meeting at 127.0.0.1:``port``,
    restarting its workers in place up to ``max_restarts`` times."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "two-nodes",
        "--rdzv-conf",
        "join_timeout=60",
        "--max-restarts",
        str(max_restarts),
    ]


def run_two_agents(args: list[str], cwd: Path, timeout: float = 60) -> str:
    """Run ``scripts/train.py args`` on two agents of 2 ranks each, in ``cwd``; check that
    both exit with 0 and return their output (agent A's, then agent B's)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for _attempt in range(3):  # the rendezvous port is chosen free, then bound: another process may take it first
        port = free_port()
        logs = [cwd / f"agent{i}.log" for i in range(2)]
        with contextlib.ExitStack() as stack:
            procs = []
            for log in logs:
                out = stack.enter_context(open(log, "w"))
                procs.append(
                    stack.enter_context(
                        started_session(
                            [*agent_cmd(port), str(SCRIPT), *args],
                            cwd=cwd,
                            env=env,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                        )
                    )
                )
            deadline = time.monotonic() + timeout
            for proc in procs:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    break  # the sessions are killed on the way out
        outs = [log.read_text() for log in logs]
        text = "\n".join(f"--- agent {i}:\n{out}" for i, out in enumerate(outs))
        if [p.returncode for p in procs] == [0, 0]:
            return text
        if "EADDRINUSE" not in text and "address already in use" not in text.lower():
            break
    pytest.fail(f"scripts/train.py {' '.join(args)} on two agents: exit codes {[p.returncode for p in procs]}\n{text}")


@pytest.mark.timeout(180)
def test_resume_on_two_nodes_is_bitwise_identical(tmp_path: Path) -> None:
    """The uninterrupted run's checkpoint of step 20 (what a run stopped there commits:
    ``--stop-at`` ends the loop after the save of its step; test_train.py's
    ``test_resume_is_bitwise_identical`` checks that a stopped run resumes bitwise), alone
    in a root of its own, resumed by two new agents to step 40."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir()
    resumed.mkdir()
    out_straight = run_two_agents([*RUN, "--save-final", "final.pt"], straight)
    assert "world size 4 | DDP" in out_straight, out_straight
    assert "checkpoint step 20 committed" in out_straight, out_straight
    shutil.copytree(straight / "checkpoints" / "step_00000020", resumed / "checkpoints" / "step_00000020")
    out = run_two_agents([*RUN, "--resume", "--save-final", "final.pt"], resumed)
    assert "resumed from step 20 in ./checkpoints" in out and "resharded" not in out, out
    a, b = torch.load(straight / "final.pt"), torch.load(resumed / "final.pt")
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"parameters differ after a resume on two nodes: {different}"
