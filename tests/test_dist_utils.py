"""The multi-rank test harness itself: a rank that hangs is reported, shown and cleaned up."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from dist_utils import run_ranks


def _rank_hangs_with_a_child(rank, world_size, pid_file):
    """Rank 1 forks a child, records both pids, and never returns; rank 0 returns."""
    import multiprocessing as mp

    if rank == 0:
        return "fine"
    child = mp.get_context("fork").Process(target=time.sleep, args=(600,), daemon=True)
    child.start()
    with open(pid_file, "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    _never_returns()


def _never_returns():
    while True:
        time.sleep(0.1)


@pytest.mark.timeout(60)
def test_a_hanging_rank_is_reported_with_its_stack_and_killed_with_its_children(tmp_path, capfd):
    pid_file = tmp_path / "pids"
    with pytest.raises(AssertionError) as info:
        run_ranks(_rank_hangs_with_a_child, 2, str(pid_file), timeout=12)
    text = str(info.value)
    assert "no result from: [1]" in text
    rank_pid, child_pid = map(int, pid_file.read_text().split())
    assert str(rank_pid) in text and str(child_pid) in text  # listed as still running
    for pid in (rank_pid, child_pid):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    # the rank printed where it was (faulthandler), before it was killed
    assert "_never_returns" in capfd.readouterr().err
