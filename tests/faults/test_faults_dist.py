"""Fault injection on 2 real gloo ranks, with the temporal and the persistent caller.

The scenarios of ``_scenarios.SCENARIOS`` run in groups: one ``run_ranks`` call per
(group, caller) runs every scenario of the group on both ranks, one after the other,
each on its own root, and returns what each rank saw; each scenario is then asserted by
its own test (the group's run is shared, module-scoped). A fault is injected on every
rank, on rank 1 only (``one_rank_*``), or at the coordinator (rank 0) commit, as the
scenario says; the assertions are those of the 1-rank suite, plus the agreement of the
ranks: the same outcome, the same ``call_idx`` and the same per-rank causes everywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from . import _scenarios as S
from .test_faults import EXIT_BOUND_S, check_aborted_handle, check_after_exit, finish_exit_scripts, start_exit_script
from dist_utils import free_port, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

WORLD = 2
GROUPS = {
    "kills": [
        "kill_handoff",
        "kill_before_save",
        "kill_during_staging",
        "kill_mid_write",
        "kill_after_write",
        "kill_after_result",
        "one_rank_kill",
        "exit3",
    ],
    "errors": [
        "raise",
        "preload",
        "one_rank_raise",
        "one_rank_preload",
        "enospc",
        "readonly",
        "target_is_file",
        "target_becomes_file",
        "abort",
        "close_raises",
    ],
}
GROUP_TIMEOUT_S = 180.0
assert sorted(n for names in GROUPS.values() for n in names) == sorted(S.SCENARIOS)


def _run_group(group: str, caller: str, base: Path) -> dict[str, Any]:
    names = [n for n in GROUPS[group] if S.applies(n, caller, WORLD)]
    mechanisms: dict[str, str] = {}
    (base / "markers").mkdir(parents=True)
    with contextlib.ExitStack() as mounts:  # unmounted on the way out, also on failure
        for name in names:
            if S.SCENARIOS[name].get("mount"):
                mounted = mounts.enter_context(S.small_tmpfs(base / name))
                mechanisms[name] = (
                    S.disk_full_mechanism(mounted) if name == "enospc" else S.read_only_mechanism(base / name, mounted)
                )
        try:
            results = run_ranks(
                S.run_group,
                WORLD,
                names,
                caller == "persistent",
                str(base),
                mechanisms,
                timeout=GROUP_TIMEOUT_S,
                start_method="forkserver",  # forked from the preloaded forkserver: no torch import per rank
            )
        except AssertionError as exc:  # a rank failed or hung: every test of the group reports it
            return {"error": str(exc)}
    return {"results": results}


@pytest.fixture(scope="module")
def group_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str, str], dict[str, Any]]]:
    """``group_run(group, caller)``: the results of that group's 2-rank run (run once)."""
    cache: dict[tuple[str, str], dict[str, Any]] = {}

    def get(group: str, caller: str) -> dict[str, Any]:
        if (group, caller) not in cache:
            cache[(group, caller)] = _run_group(group, caller, tmp_path_factory.mktemp(f"{group}-{caller}"))
        run = cache[(group, caller)]
        assert "error" not in run, f"the 2-rank run of group {group!r} ({caller}) failed:\n{run['error']}"
        return run

    yield get


TWO_RANKS = [
    (group, name, caller)
    for group, names in GROUPS.items()
    for caller in S.BOTH
    for name in names
    if S.applies(name, caller, WORLD)
]


@pytest.mark.timeout(GROUP_TIMEOUT_S + 60)
@pytest.mark.parametrize("group,name,caller", TWO_RANKS, ids=[f"{n}-{c}" for _, n, c in TWO_RANKS])
def test_fault_two_ranks(group_run: Callable[[str, str], dict[str, Any]], group: str, name: str, caller: str) -> None:
    run = group_run(group, caller)
    S.check_scenario(name, [run["results"][rank][name] for rank in range(WORLD)], WORLD)


@pytest.mark.timeout(GROUP_TIMEOUT_S + 60)
@pytest.mark.parametrize("caller", S.BOTH)
def test_handle_of_aborted_save_reports_failure_two_ranks(
    group_run: Callable[[str, str], dict[str, Any]], caller: str
) -> None:
    run = group_run("errors", caller)
    for rank in range(WORLD):
        check_aborted_handle(run["results"][rank]["abort"]["info"]["handle"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("caller", S.BOTH)
def test_interpreter_exit_with_save_in_flight_two_ranks(tmp_path: Path, caller: str) -> None:
    """Two plain interpreters (as torchrun starts ranks), each exiting with its write
    held mid-way and without close(): both exit within seconds; the save is committed
    completely or absent."""
    persistent = caller == "persistent"
    root = tmp_path / "root"
    port = free_port()
    procs = [start_exit_script(tmp_path, root, persistent, "plain", rank, WORLD, port) for rank in range(WORLD)]
    ended = finish_exit_scripts(procs)
    for lines, t_end, _ in ended:
        exit_s = t_end - lines["t"]
        assert exit_s < EXIT_BOUND_S, f"rank {lines['rank']} took {exit_s:.1f} s to exit with a save in flight"
    check_after_exit(root, WORLD, persistent, [lines for lines, _, _ in ended])
