"""Multi-rank mistakes and endings on real ranks (issue 25, items 1, 2 and 6).

Each scenario runs real processes (``_multirank_worker.py``, one per rank, a gloo group
over a file store), which end as a user's script does: ``destroy_process_group()`` and
the interpreter's exit. The assertions read what each rank reported and what is on
disk, here, after the processes are gone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

import asyncckpt
from asyncckpt.io import commit as _commit

WORKER = Path(__file__).with_name("_multirank_worker.py")
REPO = Path(__file__).resolve().parent.parent


def _run(
    tmp_path: Path,
    scenario: str,
    *args: str,
    env: dict[int, dict[str, str]] | None = None,
    world: int = 2,
    timeout: float = 150.0,
) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world`` real rank processes; return each rank's report.

    Every process (and what it started: the background writers) is killed if the
    scenario runs past ``timeout`` seconds or a rank fails; a rank's stderr is part
    of the failure message.
    """
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    store = str(tmp_path / "store")
    procs: list[subprocess.Popen] = []
    logs = []
    base = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1"
    )
    base.pop("ASYNCCKPT_FAULT", None)
    try:
        for rank in range(world):
            log = open(tmp_path / f"rank{rank}.log", "w+")
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), scenario, str(rank), str(world), store, str(out), *args],
                    env={**base, **((env or {}).get(rank, {}))},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        codes: list[int | None] = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=timeout))
            except subprocess.TimeoutExpired:
                codes.append(None)
                break
    finally:
        for p in procs:
            try:
                victims = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for v in victims:
                try:
                    v.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(victims, timeout=10)
        texts = []
        for log in logs:
            log.seek(0)
            texts.append(log.read())
            log.close()
    reports = []
    for rank in range(world):
        path = out / f"rank{rank}.json"
        if not path.exists():
            raise AssertionError(
                f"rank {rank} reported nothing (exit codes {codes}):\n"
                + "\n".join(f"--- rank {r} ---\n{t}" for r, t in enumerate(texts))
            )
        reports.append({**json.loads(path.read_text()), "log": texts[rank]})
    return reports


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".step_"))


# ----------------------------------------------------------------------------- item 1: ranks disagree
@pytest.mark.timeout(180)
def test_ranks_passing_different_steps_are_refused_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "root"
    reports = _run(tmp_path, "different_steps", str(root))
    for rank, report in enumerate(reports):
        assert report["outcome"] == "CheckpointError", (rank, report)
        # each rank's step is named, on every rank
        assert "rank 0: step 5" in report["error"] and "rank 1: step 6" in report["error"], report["error"]
    # nothing of steps 5 and 6 was written; the ranks went on and saved step 7 together
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_00000007"]
    assert _leftovers(root) == []
    asyncckpt.verify(root / "step_00000007")


@pytest.mark.timeout(180)
def test_commit_refuses_a_checkpoint_missing_a_listed_file(tmp_path: Path) -> None:
    root = tmp_path / "root"
    reached = tmp_path / "commit-reached"
    fault = {0: {"ASYNCCKPT_FAULT": f"commit:touch={reached};commit:sleep=2"}}
    reports = _run(tmp_path, "missing_file", str(root), str(reached), env=fault)
    assert reports[1]["removed"] == ["__1_0.distcp"], reports[1]
    for rank, report in enumerate(reports):
        assert report["outcome"] == "CheckpointException", (rank, report)
        assert "__1_0.distcp" in report["error"] and "missing" in report["error"], report["error"]
    assert not (root / "step_00000003").exists()
    assert _commit.read_latest(root) is None
    assert _leftovers(root) == []


# ----------------------------------------------------------------------------- item 2: destroy_process_group
def _check_destroy_outcomes(root: Path, reports: list[dict[str, Any]], loops: int) -> list[str]:
    """Every committed step verifies, ``latest`` names a complete step, and each rank's
    reported outcome of step 2 matches the disk. Returns the states seen (for the test)."""
    seen = []
    for loop in range(loops):
        loop_root = root / f"loop{loop}"
        committed = []
        for step_dir in sorted(loop_root.glob("step_*")):
            asyncckpt.verify(step_dir)  # a renamed step is complete
            committed.append(step_dir.name)
        latest = _commit.read_latest(loop_root)
        assert latest in committed, (loop, latest, committed)
        on_disk = "committed" if "step_00000002" in committed else "failed"
        for rank, report in enumerate(reports):
            state = report["outcomes"][loop]["state"]
            assert state == on_disk, (loop, rank, report["outcomes"][loop], committed, report["log"])
            seen.append(state)
    return seen


@pytest.mark.timeout(300)
def test_destroy_process_group_with_a_save_pending_commits_it_first(tmp_path: Path) -> None:
    loops = 8
    root = tmp_path / "root"
    reports = _run(tmp_path, "destroy_pending", str(root), str(loops), timeout=280)
    seen = _check_destroy_outcomes(root, reports, loops)
    assert seen == ["committed"] * (2 * loops), seen


@pytest.mark.timeout(180)
def test_destroy_process_group_while_the_coordinator_commits(tmp_path: Path) -> None:
    """Rank 1 destroys its groups while rank 0 is at its commit point: rank 1 waits for
    the commit (the hook), and no rank removes what the coordinator commits."""
    root = tmp_path / "root"
    reached = tmp_path / "commit-reached"
    fault = {0: {"ASYNCCKPT_FAULT": f"commit:touch={reached};commit:sleep=2"}}
    reports = _run(tmp_path, "destroy_pending", str(root), "1", str(reached), env=fault)
    seen = _check_destroy_outcomes(root, reports, 1)
    assert seen == ["committed", "committed"], seen


@pytest.mark.timeout(180)
def test_a_commit_collective_broken_on_one_rank_reports_what_is_on_disk(tmp_path: Path) -> None:
    """Rank 1 destroys its groups with a ``destroy_process_group`` taken before asyncckpt
    was imported (no hook) while rank 0 is at its commit point: rank 1's collective
    breaks; it removes nothing, and reports the coordinator's commit, as on disk."""
    root = tmp_path / "root"
    reached = tmp_path / "commit-reached"
    fault = {0: {"ASYNCCKPT_FAULT": f"commit:touch={reached};commit:sleep=2"}}
    reports = _run(tmp_path, "destroy_unhooked", str(root), str(reached), env=fault)
    seen = _check_destroy_outcomes(root, reports, 1)
    assert seen == ["committed", "committed"], seen


@pytest.mark.timeout(120)
def test_a_save_that_cannot_commit_at_destroy_process_group_is_named_as_lost(tmp_path: Path) -> None:
    root = tmp_path / "root"
    [report] = _run(tmp_path, "destroy_foreground", str(root), world=1)
    assert report["outcomes"] == [{"state": "pending"}], report
    lost = [line for line in report["log"].splitlines() if "destroy_process_group()" in line]
    assert lost and "step 2" in lost[0] and str(root / "step_00000002") in lost[0] and "lost" in lost[0], report["log"]


@pytest.mark.timeout(180)
def test_a_rank_that_aborts_while_the_coordinator_commits_removes_nothing(tmp_path: Path) -> None:
    """Rank 1 drops the save (``close(abort=True)``) while rank 0 is at its commit point:
    only the coordinator removes a step's files, so rank 0 commits a complete step."""
    root = tmp_path / "root"
    reached = tmp_path / "commit-reached"
    fault = {0: {"ASYNCCKPT_FAULT": f"commit:touch={reached};commit:sleep=2"}}
    reports = _run(tmp_path, "abort_mid_commit", str(root / "loop0"), str(reached), env=fault)
    assert reports[0]["outcomes"] == [{"state": "committed"}], reports[0]
    asyncckpt.verify(root / "loop0" / "step_00000002")
    assert _commit.read_latest(root / "loop0") == "step_00000002"


# ----------------------------------------------------------------------------- item 6: a rank that does not save
@pytest.mark.timeout(180)
@pytest.mark.parametrize("first", [False, True], ids=["steady", "first-save"])
def test_a_rank_that_does_not_save_fails_the_save_after_the_group_timeout(tmp_path: Path, first: bool) -> None:
    """The user's ``init_process_group(timeout=3 s)``: rank 0 saves, rank 1 stays away
    until rank 0 has reported. Steady: the groups exist (step 1 was saved together), the
    plan's all_gather fails; first save: the creation of our gloo group fails."""
    root = tmp_path / "root"
    reports = _run(tmp_path, "absent_rank", str(root), "3", "1" if first else "0")
    r0, r1 = reports
    # rank 0 did not wait for rank 1 (which stayed away until rank 0 had reported)
    assert r1["rank0_reported_while_busy"] is True, reports
    assert r0["outcome"] == "CheckpointError", r0
    if first:
        assert "gloo group" in r0["error"], r0["error"]
    else:
        assert "the plan of the save of step 4" in r0["error"] and "all_gather" in r0["error"], r0["error"]
    assert "did not arrive: rank 1" in r0["error"], r0["error"]
    assert "timeout is 3 s" in r0["error"], r0["error"]
    # rank 1, late, is told that rank 0 gave up
    assert r1["outcome"] == "CheckpointError", r1
    assert "gave up: rank 0" in r1["error"], r1["error"]
    assert not (root / "step_00000004").exists()
