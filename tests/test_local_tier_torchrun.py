"""The local tier through the restart users run: two torchrun agents ("nodes") on this
machine, 2 ranks each, a c10d rendezvous on 127.0.0.1, each node with its own
``--local-dir`` (issue 31).

A worker of node 1 is SIGKILLed (``TRAIN_KILL``: rank 2 kills itself after step 11,
once local step 10 is restorable), so the job fails as on a node loss; node 1's local
directory is wiped (a replaced node) and the persistent root moved away; the job is
started again with the same command lines and ``--resume``. It must restore local step
10 (newer than the persistent step 8), ranks 2 and 3's shards sent by node 0, and its
``--save-final`` must be bitwise the parameters of an uninterrupted run.

Two agents restart the whole job, as a scheduler's requeue does: torchrun's in-place
restart (``--max-restarts``) of a 2-agent job fails with torch 2.13 and gloo. The
workers of every attempt share the agent's store, whose keys outlive the attempt, so a
restarted gloo group reads a dead worker's address ("Gloo connectFullMesh failed ...
Connection refused"; pytorch#147064 looks related). A per-attempt key prefix cannot
help across agents: ``TORCHELASTIC_RESTART_COUNT`` differs between them (an agent whose
workers did not fail restarts them without counting). With one agent it names the
attempt, and ``scripts/train.py`` prefixes the group's keys with it: the last test
restarts workers in place on one node.

Every agent runs in a session of its own, killed when the test ends, also on failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_two_nodes import SCRIPT, TINY, agent_cmd

from dist_utils import free_port
from helpers import started_session

RUN = [*TINY, "--temporal", "--steps", "16", "--ckpt-every", "4", "--local-every", "2", "--replicas", "1"]


def run_agents(args: list[list[str]], cwd: Path, env: dict[str, str] | None = None, timeout: float = 150) -> list:
    """Run ``scripts/train.py args[i]`` on agent ``i`` (two agents, 2 ranks each) in ``cwd``.

    Returns:
        ``[(exit code, output)]`` per agent. An agent still running ``timeout`` seconds
        after the start, or 30 s after the other one failed, is killed (exit code None).
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    port = free_port()
    logs = [cwd / f"agent{i}.log" for i in range(len(args))]
    codes: list[int | None] = [None] * len(args)
    with contextlib.ExitStack() as stack:
        procs = []
        for log, a in zip(logs, args):
            out = stack.enter_context(open(log, "w"))
            cmd = [*agent_cmd(port), str(SCRIPT), *a]
            procs.append(
                stack.enter_context(started_session(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT))
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):  # the job failed: the rest follow soon
                deadline = min(deadline, time.monotonic() + 30)
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
    return [(code, log.read_text()) for code, log in zip(codes, logs)]


def _ok(results: list) -> str:
    text = "\n".join(f"--- agent {i} (exit {c}):\n{out}" for i, (c, out) in enumerate(results))
    assert [c for c, _ in results] == [0, 0], text
    return text


def _args(extra: list[str]) -> list[list[str]]:
    return [[*RUN, "--local-dir", f"local{i}", *extra] for i in range(2)]


@pytest.mark.timeout(600)
def test_node_replaced_restores_from_peers_bitwise(tmp_path: Path) -> None:
    straight, job = tmp_path / "straight", tmp_path / "job"
    straight.mkdir()
    job.mkdir()
    out = _ok(run_agents(_args(["--save-final", "final.pt"]), straight))
    assert "local checkpoint step 16 restorable" in out, out
    # the job: rank 2 (node 1) is killed after step 11; the job fails
    failed = run_agents(_args([]), job, env={"TRAIN_KILL": "2:11"})
    text = "\n".join(out for _, out in failed)
    assert failed[1][0] not in (0, None) and "TRAIN_KILL at step 11" in text, text
    for node in (0, 1):  # step 10 is restorable on both nodes; the persistent tier's newest is 8
        assert json.loads((job / f"local{node}" / "rank_00000" / "restorable.json").read_text())["step"] == 10
    assert (job / "checkpoints" / "step_00000008" / ".manifest.json").is_file(), text
    shutil.rmtree(job / "local1")  # node 1 replaced: an empty local tier
    os.rename(job / "checkpoints", job / "checkpoints.away")  # no persistent tier to read
    out = _ok(run_agents(_args(["--resume", "--save-final", "final.pt"]), job))
    assert "restored step 10 from the local tier (fetched from peers: rank 2 from rank 0, rank 3 from rank 1)" in out, (
        out
    )
    a, b = torch.load(straight / "final.pt"), torch.load(job / "final.pt")
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert a.keys() == b.keys() and not different, f"parameters differ after the restore: {different}"


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ASYNCCKPT_LONG") != "1", reason="4 two-agent runs (~100 s): ASYNCCKPT_LONG=1")
@pytest.mark.timeout(600)
def test_intact_nodes_restore_locally_and_a_flipped_byte_takes_the_replica(tmp_path: Path) -> None:
    straight, job = tmp_path / "straight", tmp_path / "job"
    straight.mkdir()
    job.mkdir()
    _ok(run_agents(_args(["--save-final", "final.pt"]), straight))
    run_agents(_args([]), job, env={"TRAIN_KILL": "2:11"})
    # the killed job as it was, to resume it twice (put back where it was: a tier is the
    # job's whose root's path it records; a copy elsewhere would be another job's)
    backup = tmp_path / "backup"
    shutil.copytree(job, backup)
    out = _ok(run_agents(_args(["--resume", "--save-final", "final.pt"]), job))
    assert "restored step 10 from the local tier (every shard on its own node)" in out, out
    os.rename(job / "final.pt", tmp_path / "first.pt")
    shutil.rmtree(job)
    shutil.copytree(backup, job)
    # a flipped byte in node 0's copy of rank 1's shard: rank 1 takes its replica from rank 3
    data = job / "local0" / "rank_00001" / "step_00000010" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    out = _ok(run_agents(_args(["--resume", "--save-final", "final.pt"]), job))
    assert "fetched from peers: rank 1 from rank 3" in out and "checksum mismatch" in out, out
    a = torch.load(straight / "final.pt")
    for final in (tmp_path / "first.pt", job / "final.pt"):
        b = torch.load(final)
        assert not [k for k in a if not torch.equal(a[k], b[k])], final


def run_one_agent(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    """``scripts/train.py args`` on one torchrun agent (2 ranks, ``--max-restarts 1``) in
    the empty directory ``cwd``; checks that it exits with 0 and returns its output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    for _attempt in range(3):  # the rendezvous port is chosen free, then bound: another process may take it first
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--monitor-interval",
            "0.2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}",
            str(SCRIPT),
            *args,
        ]
        log = cwd.parent / f"{cwd.name}.log"
        with (
            open(log, "w") as out,
            started_session(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT) as proc,
        ):
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                code = None
        text = log.read_text()
        if code == 0:
            return text
        if "EADDRINUSE" not in text and "address already in use" not in text.lower():
            break
        for leftover in cwd.iterdir():  # (nothing ran: the agent could not start)
            if leftover.is_dir():
                shutil.rmtree(leftover)
            else:
                leftover.unlink()
    pytest.fail(f"exit {code}:\n{text}")


@pytest.mark.timeout(300)
def test_torchrun_restarts_workers_in_place_from_the_local_tier(tmp_path: Path) -> None:
    """One node, ``--max-restarts 1``: rank 1 is killed after step 11; torchrun restarts
    both workers in place, with the same command line (``--resume``), and they resume from
    local step 10 on their node (newer than the persistent step 8), bitwise equal to an
    uninterrupted run at the end."""
    args = [*RUN, "--replicas", "0", "--local-dir", "local", "--resume", "--save-final", "final.pt"]
    straight, job = tmp_path / "straight", tmp_path / "job"
    straight.mkdir()
    job.mkdir()
    run_one_agent(args, straight)
    out = run_one_agent(args, job, env={"TRAIN_KILL": "1:11"})
    assert "TRAIN_KILL at step 11" in out and "nothing to restore" in out, out  # the first attempt
    assert "restored step 10 from the local tier (every shard on its own node)" in out, out  # the second
    a, b = torch.load(straight / "final.pt"), torch.load(job / "final.pt")
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert a.keys() == b.keys() and not different, f"parameters differ after the restart: {different}"
