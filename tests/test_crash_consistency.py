"""Crash consistency: SIGKILL the training example's whole process group at random
moments of its saves and commits; what is on disk must always be a valid, resumable
state. The harness is ``scripts/crash_test.py`` (also a standalone script); see its
docstring for the phases aimed at and the invariants checked after every kill:

- ``latest`` (read directly) is absent or names a directory that ``asyncckpt.verify``
  passes; every step ``CheckpointManager.steps()`` lists verifies; no ``step_*`` entry
  is anything but a committed checkpoint; the newest committed step never goes back;
- ``--resume`` starts from the newest committed checkpoint (parsed from the output) and
  trains on; a last run resumes and finishes with exit code 0.

Trials are seeded (``random.Random(SEED)``) and chained: each run resumes from what the
killed one before it left. CI runs a few; ``ASYNCCKPT_LONG=1`` runs 20 + 4. Each trial's
record (writer, aimed and observed phase, committed step before / after, resume step)
is printed; run with ``-s`` to see them.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

LONG = os.environ.get("ASYNCCKPT_LONG") == "1"
SEED = int(os.environ.get("ASYNCCKPT_CRASH_SEED", "20240611"))
HARNESS = Path(__file__).resolve().parents[1] / "scripts" / "crash_test.py"


def _harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("asyncckpt_crash_test", HARNESS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ct = _harness()


def _run(tmp_path: Path, plan: list[tuple[str, str]]) -> list:
    lines: list[str] = []

    def log(msg: str) -> None:
        lines.append(msg)
        print(msg, flush=True)

    records = ct.run_trials(tmp_path, len(plan), SEED, plan=plan, log=log)
    print(ct.summarize(records))
    return records


def _assert_no_violations(records: list) -> None:
    failed = [r for r in records if r.violations]
    assert not failed, "\n".join([ct.summarize(records)] + [r.line() + "\n" + r.output_tail[-1500:] for r in failed])


@pytest.mark.timeout(1800 if LONG else 150)
def test_sigkill_during_saves_and_commits(tmp_path: Path) -> None:
    """Kills at random moments, and inside the write (mid-file, after fsync) and the commit
    (before the rename), widened by failpoints; persistent and temporal writers."""
    phases = ("random", "mid_write", "after_write", "commit")
    plan = ct.schedule(20 if LONG else 4, SEED, phases)
    records = _run(tmp_path, plan)
    assert len(records) == len(plan) + 1
    _assert_no_violations(records)
    kills = records[:-1]
    assert all(r.exit_code == -9 for r in kills)
    if LONG:
        assert {r.writer for r in kills} == set(ct.WRITERS)
        assert {r.phase for r in kills} == set(phases)
        # the kills landed in the phases aimed at, at least sometimes
        observed = {r.observed for r in kills}
        assert {"write", "commit, before rename"} <= observed, observed
    # each run resumed from the newest committed checkpoint and saved more
    for before, r in itertools.pairwise(records):
        assert r.resumed_from == (before.newest_after or 0)
    assert records[-1].exit_code == 0


@pytest.mark.timeout(600 if LONG else 120)
def test_sigkill_between_rename_and_latest(tmp_path: Path) -> None:
    """The window between a commit's rename (the step directory is committed) and the
    replacement of ``latest``: the harness holds the ``latest`` file lock so that the
    commit blocks right there, then kills. The newest committed step is the renamed one;
    ``--resume`` must start from it (and must not later collide with it)."""
    plan = [(w, "latest") for w in ct.WRITERS] * 2 if LONG else [("persistent", "latest")]
    records = _run(tmp_path, plan)
    kills = records[:-1]
    assert any(r.observed == "after rename, before latest" for r in kills), [r.line() for r in kills]
    _assert_no_violations(records)
