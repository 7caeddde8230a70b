#!/usr/bin/env python
"""Crash-consistency harness: SIGKILL the training example at random moments of its
checkpoints and check that what is on disk is always a valid, resumable state.

    python scripts/crash_test.py --trials 20 --seed 0        # prints a summary, exit 1 on a violation

Each trial runs ``scripts/train.py --resume`` (small model, a checkpoint every 2 steps,
``--keep-last 2``; the persistent or the ``--temporal`` writer) in a session of its own,
waits until that run has resumed and staged its first checkpoint, then SIGKILLs the whole
process group (and every descendant) at a seeded random moment. Some trials aim at a
phase, widened with the failpoints of ``asyncckpt._faults`` (``ASYNCCKPT_FAULT``, which the
writer inherits):

- ``random``: no failpoint, a uniform random delay;
- ``mid_write`` / ``after_write``: in the writer, half-way through the first data file /
  after every file is fsynced (``POINT:touch=MARKER;POINT:sleep=S``: the kill lands in
  the sleep, once the marker appears);
- ``commit``: in the trainer's commit, metadata and manifest written, before the rename;
- ``latest``: after the rename, before ``latest`` is replaced: the harness holds the
  ``latest`` file lock (``.asyncckpt.lock``), so the commit blocks right there.

After each kill:

- ``latest``, read directly, is either absent or names a directory that exists and that
  :func:`asyncckpt.verify` passes;
- every step :meth:`asyncckpt.CheckpointManager.steps` lists verifies, and no ``step_*``
  entry exists that is not a committed checkpoint;
- the newest committed step never goes back;
- the next trial's ``--resume`` starts from the newest committed step (parsed from its
  output) and trains on past it.

A last run resumes and finishes (``--stop-at``) with exit code 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from filelock import FileLock, Timeout  # noqa: E402

import asyncckpt  # noqa: E402

TRAIN = REPO / "scripts" / "train.py"
# 0.47 M parameters + AdamW state: 5.8 MB per checkpoint, written in some tens of ms;
# a step takes 15-40 ms on 2 cores, so with --ckpt-every 2 a save is nearly always in flight.
MODEL = [
    "--n-layer",
    "2",
    "--n-embd",
    "128",
    "--n-head",
    "2",
    "--block-size",
    "32",
    "--batch-size",
    "4",
    "--data-mb",
    "0.05",
]
PHASES = ("random", "mid_write", "after_write", "commit", "latest")
WRITERS = ("persistent", "temporal")
FAULT_SLEEP_S = 0.25
STEP_RE = re.compile(r"^step_(\d{8})$")
RESUMED_RE = re.compile(r"^resumed from step (\d+) in ", re.M)
FRESH_RE = re.compile(r"^no checkpoint in .*: starting from step 0$", re.M)
STAGED_RE = re.compile(r"^checkpoint step (\d+) staged in ", re.M)
COMMITTED_RE = re.compile(r"^checkpoint step (\d+) committed \|", re.M)


@dataclasses.dataclass
class Trial:
    """The record of one trial (kill) or of the final run."""

    index: int
    writer: str
    phase: str  # aimed phase
    seed_delay_s: float = 0.0
    newest_before: int | None = None  # newest committed step before the run
    resumed_from: int | None = None  # parsed from the run's output (0: fresh start)
    first_step_after_resume: int | None = None
    staged: list[int] = dataclasses.field(default_factory=list)  # printed by the run
    committed_printed: list[int] = dataclasses.field(default_factory=list)
    observed: str = ""  # what the disk shows about where the kill landed
    latest_after: str | None = None
    steps_after: list[int] = dataclasses.field(default_factory=list)
    newest_after: int | None = None
    leftovers: dict[str, int] = dataclasses.field(default_factory=dict)  # hidden dirs/files, cumulative
    exit_code: int | None = None
    violations: list[str] = dataclasses.field(default_factory=list)
    duration_s: float = 0.0
    output_tail: str = ""

    def line(self) -> str:
        ok = "ok" if not self.violations else "FAIL: " + "; ".join(self.violations)
        return (
            f"trial {self.index:2d} {self.writer:10s} aim={self.phase:11s} observed={self.observed:28s} "
            f"newest before={_s(self.newest_before):>4s} resumed={_s(self.resumed_from):>4s} "
            f"staged={self.staged[-1] if self.staged else '-'!s:>4s} newest after={_s(self.newest_after):>4s} "
            f"latest={self.latest_after or '-'} ({self.duration_s:.1f} s) {ok}"
        )


def _s(v: Any) -> str:
    return "-" if v is None else str(v)


# ----------------------------------------------------------------------------- processes


class Run:
    """The training script in a session of its own, its output pumped into a queue."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(TRAIN), *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.out = ""
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._eof = False
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def drain(self, timeout: float = 0.0) -> bool:
        """Append what the process printed, waiting up to ``timeout`` s for one line;
        False once its output ended."""
        deadline = time.monotonic() + timeout
        while not self._eof:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return True
            if line is None:
                self._eof = True
                break
            self.out += line
            timeout, deadline = 0.0, time.monotonic()
        return False

    def wait_for(self, pattern: re.Pattern[str], timeout: float, start: int = 0) -> re.Match[str] | None:
        """The first match of ``pattern`` in the output from ``start`` on, waiting up to ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            m = pattern.search(self.out, start)
            if m:
                return m
            if not self.drain(min(0.2, max(0.0, deadline - time.monotonic()))) or time.monotonic() > deadline:
                m = pattern.search(self.out, start)
                return m

    def sleep(self, seconds: float) -> None:
        """Sleep, reading output meanwhile."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if not self.drain(min(left, 0.05)):
                time.sleep(max(0.0, deadline - time.monotonic()))
                return

    def kill(self) -> None:
        """SIGKILL the process group and every descendant (a process that left the group too)."""
        kill_tree(self.proc)

    def finish(self, timeout: float = 20) -> int:
        """Reap the process and read the rest of its output."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = self.proc.wait()
        gone = group_gone(self.proc.pid, 10)
        if not gone:
            self.kill()
        deadline = time.monotonic() + 10
        while self.drain(0.2) and time.monotonic() < deadline:
            pass
        if self.proc.stdout:
            self.proc.stdout.close()
        return rc


def kill_tree(proc: subprocess.Popen) -> None:
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for p in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def group_gone(pgid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` s until no process of group ``pgid`` runs (zombies count as
    gone: the killed run's orphans, its worker and multiprocessing's resource tracker, are
    reaped by the machine's init, and a container's init may take seconds per orphan).
    The tests' own rule (``tests/helpers.py``), so that both agree on when a run is gone."""
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from helpers import process_group_gone
    finally:
        sys.path.remove(str(REPO / "tests"))
    return process_group_gone(pgid, timeout)


# ----------------------------------------------------------------------------- disk checks


@dataclasses.dataclass
class DiskState:
    latest: str | None  # the raw content of ``latest`` (stripped), None if absent
    steps: list[int]  # CheckpointManager.steps()
    step_entries: list[str]  # every ``step_*`` entry
    hidden: list[str]  # ``.step_*.tmp-*``, ``.step_*.deleting-*``, ``.latest.tmp-*``

    @property
    def newest(self) -> int | None:
        return self.steps[-1] if self.steps else None


def disk_state(root: Path) -> DiskState:
    if not root.exists():
        return DiskState(None, [], [], [])
    try:
        latest: str | None = (root / "latest").read_text()
    except FileNotFoundError:
        latest = None
    mgr = asyncckpt.CheckpointManager(root, persistent=False, read_only=True)  # a reader: no lock, no process
    try:
        steps = mgr.steps()
    finally:
        mgr.close(abort=True)
    names = sorted(os.listdir(root))
    return DiskState(
        latest if latest is None else latest.strip(),
        steps,
        [n for n in names if n.startswith("step_")],
        [n for n in names if n.startswith(".") and (".tmp-" in n or ".deleting-" in n)],
    )


def check_disk(root: Path, state: DiskState) -> list[str]:
    """The crash-consistency invariants; returns the violations."""
    bad = []
    if state.latest is not None:
        target = root / state.latest
        if not STEP_RE.match(state.latest):
            bad.append(f"latest holds {state.latest!r}, not a step directory name")
        elif not target.is_dir():
            bad.append(f"latest names {state.latest}, which does not exist")
        else:
            try:
                asyncckpt.verify(target)
            except Exception as exc:  # noqa: BLE001
                bad.append(f"latest names {state.latest}, which does not verify: {exc}")
            if int(state.latest[5:]) not in state.steps:
                bad.append(f"latest names {state.latest}, which steps() does not list")
    for step in state.steps:
        try:
            manifest = asyncckpt.verify(root / f"step_{step:08d}")
        except Exception as exc:  # noqa: BLE001
            bad.append(f"step {step} is listed by steps() but does not verify: {exc}")
        else:
            if manifest.get("step") != step:
                bad.append(f"step {step}: its manifest says step {manifest.get('step')}")
    listed = {f"step_{s:08d}" for s in state.steps}
    for name in state.step_entries:
        if name not in listed:
            bad.append(f"{name} exists under a committed name but is not a committed checkpoint")
    return bad


def observe(root: Path, before: DiskState, after: DiskState) -> str:
    """Where the kill landed, as far as the disk tells."""
    new_hidden = set(after.hidden) - set(before.hidden)
    tmp = [n for n in new_hidden if ".tmp-" in n and n.startswith(".step_")]
    if any(".deleting-" in n for n in new_hidden):
        return "retention (mid-delete)"
    newest = after.newest
    if newest is not None and newest != before.newest and after.latest != f"step_{newest:08d}":
        return "after rename, before latest"
    if tmp:
        if any((root / n / ".manifest.json").exists() for n in tmp):
            return "commit, before rename"
        return "write"
    if any(".latest.tmp-" in n for n in new_hidden):
        return "writing latest"
    return "between saves"


# ----------------------------------------------------------------------------- trials


def _env(fault: str | None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("ASYNCCKPT_FAULT", None)
    if fault:
        env["ASYNCCKPT_FAULT"] = fault
    return env


def _train_args(root: Path, writer: str, *extra: str) -> list[str]:
    return [
        *MODEL,
        "--steps",
        "1000000",
        "--ckpt-every",
        "2",
        "--keep-last",
        "2",
        "--log-every",
        "1",
        "--ckpt-dir",
        str(root),
        "--resume",
        *(["--temporal"] if writer == "temporal" else []),
        *extra,
    ]


def _check_resume(run: Run, trial: Trial, expected: int | None, timeout: float) -> bool:
    """Parse where the run resumed; record a violation unless it is the newest committed step."""
    m = run.wait_for(re.compile(f"{RESUMED_RE.pattern}|{FRESH_RE.pattern}", re.M), timeout)
    if m is None:
        trial.violations.append(
            f"--resume printed neither 'resumed from step' nor 'no checkpoint' (exit code {run.proc.poll()})"
        )
        return False
    got = RESUMED_RE.search(m.group(0))
    trial.resumed_from = int(got.group(1)) if got else 0
    if (expected or 0) != trial.resumed_from:
        trial.violations.append(
            f"--resume started from step {trial.resumed_from}, the newest committed checkpoint is step {expected}"
        )
    s = run.wait_for(re.compile(r"^step\s+(\d+)/", re.M), timeout, m.end())
    if s is None:
        trial.violations.append(f"no training step after resuming (exit code {run.proc.poll()})")
        return False
    trial.first_step_after_resume = int(s.group(1))
    if trial.first_step_after_resume != trial.resumed_from + 1:
        trial.violations.append(
            f"resumed from {trial.resumed_from} but trained step {trial.first_step_after_resume} first"
        )
    return True


def _aim_and_kill(
    run: Run,
    trial: Trial,
    root: Path,
    rng: random.Random,
    phase: str,
    point: str | None,
    marker: Path,
    startup_timeout: float,
) -> None:
    """Wait until the run resumed and staged a checkpoint, then until the aimed moment;
    the caller kills it right after (also when this raises or gives up)."""
    if not _check_resume(run, trial, trial.newest_before, startup_timeout):
        return
    if run.wait_for(STAGED_RE, startup_timeout) is None:
        trial.violations.append(f"no checkpoint staged after resuming (exit code {run.proc.poll()})")
        return
    if phase == "random":
        trial.seed_delay_s = rng.uniform(0.0, 1.2)
        run.sleep(trial.seed_delay_s)
    elif point is not None:
        # the point may have been hit already: wait for a fresh hit, then kill inside its sleep
        marker.unlink(missing_ok=True)
        trial.seed_delay_s = rng.uniform(0.0, FAULT_SLEEP_S * 1.1)
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline and run.drain(0.01):
            pass
        if not marker.exists():
            trial.violations.append(f"failpoint {point} not reached within 60 s (exit code {run.proc.poll()})")
            return
        run.sleep(trial.seed_delay_s)
    else:  # latest: hold the lock write_latest takes, so that a commit blocks after its rename
        run.sleep(rng.uniform(0.0, 0.3))
        lock = FileLock(str(root / ".asyncckpt.lock"))
        try:
            lock.acquire(timeout=30)
        except Timeout:
            trial.violations.append("could not take the latest lock within 30 s")
            return
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and run.drain(0.02):
                state = disk_state(root)
                if state.newest is not None and state.latest != f"step_{state.newest:08d}":
                    break  # a step was renamed into place; its commit now waits for the lock
            trial.seed_delay_s = rng.uniform(0.0, 0.1)
            run.sleep(trial.seed_delay_s)
            if run.proc.poll() is None:
                run.kill()  # while the lock is still held
        finally:
            lock.release(force=True)
    if run.proc.poll() is not None and run.proc.returncode != -signal.SIGKILL:
        trial.violations.append(f"the run exited by itself with code {run.proc.returncode} before the kill")


def run_trial(
    index: int, root: Path, rng: random.Random, writer: str, phase: str, startup_timeout: float = 120.0
) -> Trial:
    """One run of the training example, SIGKILLed at a random moment; checks the disk."""
    t0 = time.monotonic()
    trial = Trial(index, writer, phase)
    before = disk_state(root)
    trial.newest_before = before.newest
    marker = root.parent / f"marker-{index}"
    point = phase if phase in ("mid_write", "after_write", "commit") else None
    fault = f"{point}:touch={marker};{point}:sleep={FAULT_SLEEP_S}" if point else None
    run = Run(_train_args(root, writer), _env(fault), root.parent)
    try:
        _aim_and_kill(run, trial, root, rng, phase, point, marker, startup_timeout)
    finally:
        run.kill()
        trial.exit_code = run.finish()
        marker.unlink(missing_ok=True)
    trial.staged = [int(s) for s in STAGED_RE.findall(run.out)]
    trial.committed_printed = [int(s) for s in COMMITTED_RE.findall(run.out)]
    after = disk_state(root)
    trial.latest_after, trial.steps_after, trial.newest_after = after.latest, after.steps, after.newest
    trial.leftovers = {
        "tmp": sum(".tmp-" in n for n in after.hidden),
        "deleting": sum(".deleting-" in n for n in after.hidden),
    }
    trial.observed = observe(root, before, after)
    trial.violations += check_disk(root, after)
    if before.newest is not None and (after.newest is None or after.newest < before.newest):
        trial.violations.append(f"the newest committed step went back from {before.newest} to {after.newest}")
    printed = max(trial.committed_printed, default=None)
    if printed is not None and (after.newest is None or after.newest < printed):
        trial.violations.append(f"step {printed} was reported committed but the newest on disk is {after.newest}")
    if trial.exit_code != -signal.SIGKILL:
        trial.violations.append(f"exit code {trial.exit_code}, expected -9 (SIGKILL)")
    trial.duration_s = time.monotonic() - t0
    trial.output_tail = run.out[-3000:]
    return trial


def final_run(index: int, root: Path, writer: str, timeout: float = 180.0) -> Trial:
    """Resume once more and finish cleanly (--stop-at), checking the result."""
    t0 = time.monotonic()
    trial = Trial(index, writer, "final (no kill)")
    before = disk_state(root)
    trial.newest_before = before.newest
    stop_at = (before.newest or 0) + 5
    run = Run(_train_args(root, writer, "--stop-at", str(stop_at)), _env(None), root.parent)
    deadline = time.monotonic() + timeout
    try:
        _check_resume(run, trial, before.newest, timeout)
        while run.drain(0.2) and time.monotonic() < deadline:
            pass
    finally:
        trial.exit_code = run.finish(timeout=max(1.0, deadline - time.monotonic()))
    trial.staged = [int(s) for s in STAGED_RE.findall(run.out)]
    trial.committed_printed = [int(s) for s in COMMITTED_RE.findall(run.out)]
    after = disk_state(root)
    trial.latest_after, trial.steps_after, trial.newest_after = after.latest, after.steps, after.newest
    trial.leftovers = {
        "tmp": sum(".tmp-" in n for n in after.hidden),
        "deleting": sum(".deleting-" in n for n in after.hidden),
    }
    trial.observed = "completed" if trial.exit_code == 0 else f"exit code {trial.exit_code}"
    trial.violations += check_disk(root, after)
    if trial.exit_code != 0:
        trial.violations.append(f"the final run exited with code {trial.exit_code}")
    if after.newest != stop_at or after.latest != f"step_{stop_at:08d}":
        trial.violations.append(
            f"after the final run the newest step is {after.newest} and latest names "
            f"{after.latest}, expected step {stop_at}"
        )
    trial.duration_s = time.monotonic() - t0
    trial.output_tail = run.out[-3000:]
    return trial


def schedule(trials: int, seed: int, phases: tuple[str, ...] = PHASES) -> list[tuple[str, str]]:
    """(writer, phase) per trial: every combination once per round, in a seeded order."""
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    while len(out) < trials:
        combos = [(w, p) for p in phases for w in WRITERS]
        rng.shuffle(combos)
        out += combos
    return out[:trials]


def run_trials(
    workdir: Path, trials: int, seed: int, *, log: Any = print, plan: list[tuple[str, str]] | None = None
) -> list[Trial]:
    """Run the kill trials of ``plan`` (default: ``trials`` of :func:`schedule`) one after
    the other in one checkpoint root under ``workdir`` (each run resumes from what the
    previous one left), then a final clean run; returns every record (the final run last).
    After a trial with violations the next one starts in a fresh root, so that one
    failure does not hide how the others fare."""
    generation = 0
    root = workdir / "ckpt0"
    rng = random.Random(seed)
    plan = plan or schedule(trials, seed)
    records = []
    for i, (writer, phase) in enumerate(plan):
        rec = run_trial(i, root, rng, writer, phase)
        records.append(rec)
        log(rec.line())
        if rec.violations:
            log(rec.output_tail[-1500:])
            generation += 1
            root = workdir / f"ckpt{generation}"
            log(f"(continuing in a fresh checkpoint root {root})")
    rec = final_run(len(plan), root, plan[-1][0] if plan else "persistent")
    records.append(rec)
    log(rec.line())
    if rec.violations:
        log(rec.output_tail[-1500:])
    return records


def summarize(records: list[Trial]) -> str:
    kills = [r for r in records if r.phase != "final (no kill)"]
    observed: dict[str, int] = {}
    for r in kills:
        observed[r.observed] = observed.get(r.observed, 0) + 1
    failed = [r for r in records if r.violations]
    last = records[-1] if records else None
    return (
        f"crash consistency: {len(kills)} kill trials + final run, {len(failed)} with violations; "
        f"writers {sorted({r.writer for r in kills})}; killed at (observed): "
        + ", ".join(f"{k}: {v}" for k, v in sorted(observed.items()))
        + (f"; leftovers on disk at the end: {last.leftovers}" if last else "")
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, help="(default: a new temporary directory)")
    p.add_argument(
        "--phases",
        default=",".join(PHASES),
        help="comma-separated phases to aim at, of " + ", ".join(PHASES) + " (all)",
    )
    p.add_argument("--json", type=Path, help="write every trial record here")
    args = p.parse_args(argv)
    phases = tuple(args.phases.split(","))
    if not phases or set(phases) - set(PHASES):
        p.error(f"--phases: choose from {', '.join(PHASES)}")
    import tempfile

    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="crash-test-")))
        workdir.mkdir(parents=True, exist_ok=True)
        records = run_trials(workdir, args.trials, args.seed, plan=schedule(args.trials, args.seed, phases))
    print(summarize(records))
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in records], indent=1))
    return 1 if any(r.violations for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
