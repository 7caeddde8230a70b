"""The local tier through the restart users run: two torchrun agents ("nodes") on this
machine, 2 ranks each, a c10d rendezvous on 127.0.0.1, each node with its own
``--local-dir`` (issue 31).

A worker of node 1 is SIGKILLed (``TRAIN_KILL``: rank 2 kills itself after step 11,
once local step 10 is restorable), so the job fails as on a node loss; node 1's local
directory is wiped (a replaced node) and the persistent root removed; the job is
started again with the same command lines and ``--resume``. It must restore local step
10 (newer than the persistent step 8), ranks 2 and 3's shards sent by node 0, and its
``--save-final`` must be bitwise the parameters of an uninterrupted run. That job is
README's walk-through ("Fast recovery: the local tier"), run here as written, with
``--save-final final.pt`` added to its ``TRAIN`` and a free rendezvous port (README's
test leaves it to this one); every job here trains with README's ``TRAIN`` arguments.

The same job restarted in place: both agents with ``--max-restarts 1``, rank 2 killed
after step 11; torchrun restarts the workers of both nodes, with the same command lines
(``--resume``), and they resume from local step 10, each shard on its own node.
``scripts/train.py`` names each attempt's store keys by a count of the worker's starts
(torch's own prefix, ``TORCHELASTIC_RESTART_COUNT``, differs between agents: see its
``init_process_group``). That test runs behind ``ASYNCCKPT_LONG=1``, for the suite's
time (the one-agent test below takes the same path): in about 15 runs of this module,
twice a two-agent ``--temporal`` run hung at its end (the one kept: the uninterrupted
run with ``--resume``, local step 14 and persistent step 16 written on every rank,
neither committed), not reproduced since (16 runs of this module and 101 of that run
with ``--resume`` outside pytest, on 2026-11-28). A forked writer whose exit blocks
after it reported would leave that shape; such a child is now killed after
``ASYNCCKPT_CHILD_EXIT_GRACE_S`` and its outcome taken. The last test restarts the
workers of one agent in place.

Every agent runs in a session of its own, killed when the test ends, also on failure.
"""

from __future__ import annotations

import ast
import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_readme import code_blocks, make_workdir, run_in
from test_two_nodes import SCRIPT, agent_cmd

from dist_utils import _py_spy_dump, free_port
from helpers import started_session

#: README's walk-through of the local tier (a python block).
WALK_THROUGH = next(b for b in code_blocks() if b.heading == "Fast recovery: the local tier" and b.lang == "python")


def _train_list(tree: ast.Module) -> ast.List:
    """The list the walk-through assigns to ``TRAIN`` (``scripts/train.py`` and its arguments)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["TRAIN"]:
            assert isinstance(node.value, ast.List)
            return node.value
    raise AssertionError("README's local tier walk-through no longer assigns TRAIN")


def _readme_train_args() -> list[str]:
    """The walk-through's ``TRAIN``, as written."""
    return list(ast.literal_eval(_train_list(ast.parse(WALK_THROUGH.code))))


def _without(args: list[str], flag: str) -> list[str]:
    i = args.index(flag)
    return args[:i] + args[i + 2 :]


#: README's arguments (a tiny model, 16 steps, a local step every 2 with 1 replica, a
#: persistent one every 4, ``--temporal``), in the default ``--ckpt-dir``.
RUN = _without(_readme_train_args()[1:], "--ckpt-dir")


def run_agents(
    args: list[list[str]], cwd: Path, env: dict[str, str] | None = None, timeout: float = 150, max_restarts: int = 0
) -> list:
    """Run ``scripts/train.py args[i]`` on agent ``i`` (two agents, 2 ranks each, each
    restarting its workers in place up to ``max_restarts`` times) in ``cwd``.

    Returns:
        ``[(exit code, output)]`` per agent. An agent still running ``timeout`` seconds
        after the start, or 30 s after the other one failed, is killed (exit code None).
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    logs = [cwd / f"agent{i}.log" for i in range(len(args))]
    for _attempt in range(3):  # the rendezvous port is chosen free, then bound: another process may take it first
        port = free_port()
        with contextlib.ExitStack() as stack:
            procs = []
            for log, a in zip(logs, args):
                out = stack.enter_context(open(log, "w"))
                cmd = [*agent_cmd(port, max_restarts), str(SCRIPT), *a]
                procs.append(
                    stack.enter_context(started_session(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT))
                )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                if any(p.poll() not in (None, 0) for p in procs):  # the job failed: the rest follow soon
                    deadline = min(deadline, time.monotonic() + 30)
                time.sleep(0.2)
            codes = [p.poll() for p in procs]
            stacks = [_stacks(p) if code is None else "" for p, code in zip(procs, codes)]
        results = [(code, log.read_text() + stack) for code, log, stack in zip(codes, logs, stacks)]
        taken = ("EADDRINUSE" in text or "address already in use" in text.lower() for c, text in results if c != 0)
        if not any(taken):
            break
    return results


def _stacks(agent: subprocess.Popen) -> str:
    """Every thread's Python stack of the training processes under a still running
    ``agent`` (py-spy, where installed), for the failure message of a run that hung."""
    import psutil

    out = []
    for child in psutil.Process(agent.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "train.py" in " ".join(child.cmdline()):
                out.append(f"\n--- stacks of {child.pid} ({child.status()}):{_py_spy_dump(child.pid)}")
    return "".join(out)


def _ok(results: list) -> str:
    text = "\n".join(f"--- agent {i} (exit {c}):\n{out}" for i, (c, out) in enumerate(results))
    assert [c for c, _ in results] == [0, 0], text
    return text


def _args(extra: list[str]) -> list[list[str]]:
    return [[*RUN, "--local-dir", f"local{i}", *extra] for i in range(2)]


def _same_as(straight: Path, final: Path) -> None:
    a, b = torch.load(straight), torch.load(final)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert a.keys() == b.keys() and not different, f"{final}: parameters differ from the uninterrupted run: {different}"


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run's ``--save-final`` (without ``--resume``: the in-place job's
    first attempt takes ``--resume`` with nothing to restore, which must train alike)."""
    d = tmp_path_factory.mktemp("straight")
    out = _ok(run_agents(_args(["--save-final", "final.pt"]), d))
    assert "local checkpoint step 16 restorable" in out, out
    return d / "final.pt"


def _walk_through(save_final: str, port: int) -> str:
    """README's walk-through with ``--save-final save_final`` added to ``TRAIN`` and
    ``port`` for its rendezvous (README's is fixed: another process may hold it here)."""
    tree = ast.parse(WALK_THROUGH.code)
    _train_list(tree).elts += [ast.Constant("--save-final"), ast.Constant(save_final)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("127.0.0.1:"):
            node.value = f"127.0.0.1:{port}"
    return ast.unparse(tree)


@pytest.mark.timeout(600)
def test_node_replaced_restores_from_peers_bitwise(straight: Path, tmp_path: Path) -> None:
    """README's walk-through, as written (``--save-final`` added): rank 2 (node 1) is
    killed after step 11, the job fails; node 1's local tier and the persistent root
    are removed; the same command lines with ``--resume`` restore step 10 from the
    local tier, ranks 2 and 3's shards sent by node 0, bitwise where an uninterrupted
    run ends."""
    for attempt in range(3):  # the rendezvous port is chosen free, then bound: another process may take it first
        job = tmp_path / f"job{attempt}"
        make_workdir(job)
        (job / "walk_through.py").write_text(_walk_through("final.pt", free_port()))
        code, out = run_in(job, [".venv/bin/python", "walk_through.py"], timeout=300)
        logs = "".join(p.read_text() for p in sorted(job.glob("local_node*.log")))
        if "address already in use" not in logs.lower() and "EADDRINUSE" not in logs:
            break
    assert code == 0, out + logs
    failed, resumed = (line for line in out.splitlines() if line.startswith("exit codes: "))
    assert failed != "exit codes: [0, 0]" and resumed == "exit codes: [0, 0]", out + logs
    assert "restored step 10 from the local tier (fetched from peers: rank 2 from rank 0, rank 3 from rank 1)" in out, (
        out + logs
    )
    _same_as(straight, job / "final.pt")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ASYNCCKPT_LONG") != "1", reason="4 two-agent runs (~100 s): ASYNCCKPT_LONG=1")
@pytest.mark.timeout(600)
def test_intact_nodes_restore_locally_and_a_flipped_byte_takes_the_replica(straight: Path, tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
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
    for final in (tmp_path / "first.pt", job / "final.pt"):
        _same_as(straight, final)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("ASYNCCKPT_LONG") != "1",
    reason="4 two-agent runs; the one-agent in-place test takes the same path (see the module docstring): "
    "ASYNCCKPT_LONG=1",
)
@pytest.mark.timeout(600)
def test_torchrun_restarts_the_workers_of_both_nodes_in_place_from_the_local_tier(
    straight: Path, tmp_path: Path
) -> None:
    """Two agents, ``--max-restarts 1``: rank 2 (node 1) is killed after step 11; both
    agents restart their workers in place, with the same command lines (``--resume``),
    and they resume from local step 10 (newer than the persistent step 8), every shard
    on its own node, bitwise equal to an uninterrupted run at the end."""
    job = tmp_path / "job"
    job.mkdir()
    args = _args(["--resume", "--save-final", "final.pt"])
    out = _ok(run_agents(args, job, env={"TRAIN_KILL": "2:11"}, max_restarts=1))
    assert "TRAIN_KILL at step 11" in out and "nothing to restore" in out, out  # the first attempt
    assert "restored step 10 from the local tier (every shard on its own node)" in out, out  # the second
    _same_as(straight, job / "final.pt")


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
    uninterrupted run at the end (one without ``--resume``: the first attempt's
    ``--resume`` with nothing to restore must train as a fresh start)."""
    args = [*RUN, "--replicas", "0", "--local-dir", "local", "--resume", "--save-final", "final.pt"]
    straight, job = tmp_path / "straight", tmp_path / "job"
    straight.mkdir()
    job.mkdir()
    run_one_agent([a for a in args if a != "--resume"], straight)  # --resume with nothing to restore trains alike
    out = run_one_agent(args, job, env={"TRAIN_KILL": "1:11"})
    assert "TRAIN_KILL at step 11" in out and "nothing to restore" in out, out  # the first attempt
    assert "restored step 10 from the local tier (every shard on its own node)" in out, out  # the second
    a, b = torch.load(straight / "final.pt"), torch.load(job / "final.pt")
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert a.keys() == b.keys() and not different, f"parameters differ after the restart: {different}"
