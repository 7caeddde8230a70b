"""End-to-end tests of the example training script ``scripts/train.py``.

Each test runs the script in subprocesses with a tiny model and a tiny slice of the corpus,
so the whole file takes a minute or two on 2 CPU cores.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import queue
import re
import shutil
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt

from dist_utils import free_port
from helpers import kill_process_tree, process_group_gone, started_session

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train.py"
# ~2 KB of text in 16-byte windows = 124 windows = 15 steps per epoch at batch 8:
# the runs below cross epoch boundaries, so the data position is exercised too.
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
    "0.002",
    "--dropout",
    "0.1",
    "--lr",
    "3e-3",
]
STEPS, HALF = 24, 11  # "2K steps straight" vs "K steps, exit, resume to 2K"
COMMIT_RE = re.compile(
    r"^checkpoint step (\d+) committed \| \S+/step_\d{8} \| stall [\d.]+ ms \| write [\d.]+ s \| "
    r"[\d.]+ MB at [\d.]+ GB/s \| plan [\d.]+ ms, stage [\d.]+ ms, commit [\d.]+ ms, finalize [\d.]+ s$",
    re.M,
)
# One stall figure per checkpoint (the loop blocked in state_dict() + save()), printed
# when it is staged and again when it is committed, with the checkpoint's directory.
STAGED_STALL_RE = re.compile(
    r"^checkpoint step (\d+) staged in ([\d.]+) ms \(stall\), "
    r"writing (\S+) in the background$",
    re.M,
)
COMMIT_STALL_RE = re.compile(r"^checkpoint step (\d+) committed \| (\S+) \| stall ([\d.]+) ms \|", re.M)
# --log-every N: one line per N steps
STEP_RE = re.compile(r"^step\s+(\d+)/(\d+) \| loss \d+\.\d+ \| lr ", re.M)
# the default when stderr is not a terminal: one line per 10% of the steps
PROGRESS_RE = re.compile(
    r"^step (\d+)/(\d+) \((\d+)%\) \| loss \d+\.\d+ \| [\d.]+ steps/s"
    r"(?: \| last ckpt stall [\d.]+ ms)?$",
    re.M,
)


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@contextlib.contextmanager
def _popen(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Start ``cmd`` in its own process group. On exit, give the group (checkpoint worker,
    multiprocessing's resource tracker) a few seconds to finish, then kill what is left."""
    with started_session(cmd, cwd=cwd, env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        yield proc


def run(
    args: list[str], cwd: Path, *, timeout: float = 90, launcher: list[str] | None = None, expect_rc: int = 0
) -> str:
    """Run the script to completion, check its exit code and return its output."""
    cmd = [*(launcher or [sys.executable]), str(SCRIPT), *args]
    with _popen(cmd, cwd) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}")
        assert proc.returncode == expect_rc, f"exit code {proc.returncode}: {' '.join(cmd)}\n{out}"
    return out


def assert_same_params(a: Path, b: Path) -> None:
    sa, sb = torch.load(a), torch.load(b)
    assert sa.keys() == sb.keys()
    different = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not different, f"parameters differ after resume: {different}"


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One uninterrupted run of STEPS steps (default output): (final params, stdout)."""
    d = tmp_path_factory.mktemp("straight")
    out = run([*TINY, "--steps", str(STEPS), "--ckpt-every", "5", "--save-final", str(d / "final.pt")], d)
    return d / "final.pt", out


@pytest.mark.timeout(60)
def test_default_output(straight: tuple[Path, str]) -> None:
    _, out = straight
    # stdout and stderr are a pipe, not a terminal: a line each time another 10% is done
    progress = [(int(s), int(t), int(pct)) for s, t, pct in PROGRESS_RE.findall(out)]
    assert [s for s, _, _ in progress] == [3, 5, 8, 10, 12, 15, 17, 20, 22, 24], out
    assert all(t == STEPS and pct == 100 * s // STEPS for s, t, pct in progress), out
    assert not STEP_RE.search(out), out  # no line per step
    assert len(out.splitlines()) < 30, out
    # every 5 steps plus the final step, each committed once, printing stall / write time / GB/s
    assert sorted(int(s) for s in COMMIT_RE.findall(out)) == [5, 10, 15, 20, 24], out
    assert re.search(r"^summary: 24 steps in [\d.]+ s \([\d.]+ steps/s, [\d,]+ tokens/s\)", out, re.M), out
    assert re.search(r"checkpoints: 5 saved, 5 committed, kept \[15, 20, 24\]", out), out
    assert re.search(r"stall: median [\d.]+ ms", out), out
    assert (straight[0].parent / "checkpoints").is_dir()  # default --ckpt-dir is ./checkpoints


@pytest.mark.timeout(60)
def test_one_stall_figure_per_checkpoint_with_its_path(straight: tuple[Path, str]) -> None:
    """Each checkpoint's stall is printed once as measured (staged line = committed line =
    the summary's figures), and its lines name the step and its directory."""
    _, out = straight
    staged = {int(s): (float(ms), path) for s, ms, path in STAGED_STALL_RE.findall(out)}
    committed = {int(s): (float(ms), path) for s, path, ms in COMMIT_STALL_RE.findall(out)}
    assert sorted(staged) == [5, 10, 15, 20, 24], out
    assert committed == staged, out
    assert all(path == f"./checkpoints/step_{s:08d}" for s, (_, path) in staged.items()), out
    stalls = sorted(ms for ms, _ in staged.values())
    m = re.search(r"stall: median ([\d.]+) ms, max ([\d.]+) ms; training loop blocked ([\d.]+) s in all", out)
    assert m, out
    assert float(m.group(1)) == pytest.approx(stalls[2], abs=0.051), out  # 5 values: the median is the 3rd
    assert float(m.group(2)) == stalls[-1], out
    assert float(m.group(3)) == pytest.approx(sum(stalls) / 1e3, abs=0.006), out


@pytest.mark.timeout(60)
def test_progress_bar_on_a_terminal_and_fresh_starts_over(straight: tuple[Path, str], tmp_path: Path) -> None:
    """With stderr on a terminal: one tqdm bar there, the checkpoint lines and the summary
    on stdout. The run starts with ``--fresh`` over a checkpoint root (a copy of the
    straight run's): it removes the root and starts at step 0."""
    shutil.copytree(straight[0].parent / "checkpoints", tmp_path / "checkpoints")
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # 24 rows, 120 columns
    cmd = [sys.executable, str(SCRIPT), *TINY, "--steps", "6", "--ckpt-every", "3", "--fresh"]
    terminal: list[bytes] = []

    def read_terminal() -> None:
        with contextlib.suppress(OSError):  # EIO once the last writer closed the terminal
            while chunk := os.read(master, 4096):
                terminal.append(chunk)

    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=slave, text=True, start_new_session=True
    )
    os.close(slave)
    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    try:
        out, _ = proc.communicate(timeout=45)
        reader.join(10)
    finally:
        if proc.poll() is None or not process_group_gone(proc.pid, 10):
            kill_process_tree(proc)
        proc.wait()
        os.close(master)
    assert proc.returncode == 0, out
    bar = b"".join(terminal).decode(errors="replace")
    final = bar.replace("\r\n", "\r").split("\r")
    assert re.search(r"train: 100%\|.*\| 6/6 \[.*step/s, loss \d+\.\d+", bar), bar
    assert [line for line in final if line.strip()][-1].startswith("train: 100%"), bar  # the bar is left, once
    assert "checkpoint" not in bar and "summary" not in bar, bar
    assert sorted(int(s) for s in COMMIT_RE.findall(out)) == [3, 6], out
    assert not re.search(r"^step ", out, re.M), out  # nothing per step on stdout
    assert re.search(r"^summary: 6 steps", out, re.M), out
    # --fresh: the straight run's checkpoints (up to step 24) are gone; it started at step 0
    assert "resumed" not in out and "kept [3, 6] in ./checkpoints" in out, out
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000003", "step_00000006"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "caller",
    [
        "persistent",
        # the temporal writer's resume also runs in the SIGTERM-temporal test: here with ASYNCCKPT_LONG=1
        pytest.param(
            "temporal",
            marks=pytest.mark.skipif(os.environ.get("ASYNCCKPT_LONG") != "1", reason="ASYNCCKPT_LONG=1"),
        ),
    ],
)
def test_resume_is_bitwise_identical(straight: tuple[Path, str], tmp_path: Path, caller: str) -> None:
    extra = ["--temporal"] if caller == "temporal" else []
    common = [*TINY, *extra, "--steps", str(STEPS), "--ckpt-every", "5", "--quiet"]
    out = run([*common, "--stop-at", str(HALF)], tmp_path)
    assert sorted(int(s) for s in COMMIT_RE.findall(out)) == [5, 10, HALF], out
    assert not re.search(r"^step ", out, re.M), out  # --quiet: nothing per step
    out = run([*common, "--resume", "--save-final", str(tmp_path / "final.pt")], tmp_path)
    assert f"resumed from step {HALF}" in out, out
    assert_same_params(straight[0], tmp_path / "final.pt")


@pytest.mark.timeout(60)
def test_refuses_to_start_over_existing_checkpoints(straight: tuple[Path, str]) -> None:
    out = run([*TINY, "--steps", "2"], straight[0].parent, expect_rc=1)
    assert "already holds checkpoints (latest step 24); pass --resume to continue, --fresh to start over" in out, out


@pytest.mark.timeout(60)
def test_resume_with_nothing_left_to_train(straight: tuple[Path, str]) -> None:
    """--resume of a finished run (or one past --stop-at) says so, naming the step and
    its checkpoint; no loss is printed for steps that did not run."""
    d = straight[0].parent
    out = run([*TINY, "--steps", str(STEPS), "--resume"], d)
    assert f"resumed from step {STEPS} in ./checkpoints/step_{STEPS:08d}" in out, out
    assert f"nothing left to train: step {STEPS} (./checkpoints/step_{STEPS:08d}) is at --steps {STEPS}" in out, out
    assert f"summary: no step trained (at step {STEPS} of {STEPS})" in out, out
    assert "nan" not in out and "final loss" not in out, out
    out = run([*TINY, "--steps", "100", "--stop-at", "20", "--resume", "--quiet"], d)
    assert f"nothing left to train: step {STEPS} (./checkpoints/step_{STEPS:08d}) is at --stop-at 20" in out, out
    assert "nan" not in out, out


@pytest.mark.timeout(90)
def test_fresh_leaves_a_directory_holding_anything_else_alone(straight: tuple[Path, str], tmp_path: Path) -> None:
    """--fresh removes a checkpoint root (test_progress_bar_on_a_terminal_and_fresh_starts_over);
    a directory that holds anything else is left alone."""
    shutil.copytree(straight[0].parent / "checkpoints", tmp_path / "checkpoints")
    (tmp_path / "notes.txt").write_text("mine")
    out = run([*TINY, "--steps", "6", "--fresh", "--ckpt-dir", "."], tmp_path, expect_rc=1)
    assert "--fresh: . holds more than checkpoints (checkpoints, notes.txt); not removing it" in out, out
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "checkpoints").is_dir()


# The reference for the interrupted runs below: the same arguments, straight to step LONG.
LONG = 150
LONG_ARGS = [*TINY, "--steps", "1000000", "--ckpt-every", "20", "--log-every", "100"]


@pytest.fixture(scope="module")
def long_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("long")
    run([*LONG_ARGS, "--ckpt-every", "1000", "--stop-at", str(LONG), "--save-final", "final.pt"], d)
    return d / "final.pt"


def _run_until_signal(
    cmd: list[str], cwd: Path, sig: signal.Signals, to_group: bool, target: Any = None
) -> tuple[int, str, float]:
    """Start ``cmd``; once a checkpoint is committed, send ``sig`` (to the process group,
    or to ``target(proc)``'s pid, default the main process); return (exit code, output,
    seconds from the signal to the exit). The run's processes must all be gone."""
    lines: queue.Queue[str | None] = queue.Queue()
    with _popen(cmd, cwd) as proc:

        def pump() -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        out, deadline = "", time.monotonic() + 60

        def read_until(done: Any, what: str) -> None:
            nonlocal out
            while not done():
                try:
                    line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    pytest.fail(f"no {what} within 60 s:\n{out}")
                if line is None:
                    pytest.fail(f"exited early with {proc.wait()}:\n{out}")
                out += line

        read_until(lambda: COMMIT_RE.search(out), "checkpoint committed")
        # Let it run on to the next save, so that one is in flight when the signal arrives
        # (a fixed delay is hundreds of steps on a fast machine: past the reference's LONG).
        staged = len(STAGED_STALL_RE.findall(out))
        read_until(lambda: len(STAGED_STALL_RE.findall(out)) > staged, "next checkpoint staged")
        t0 = time.monotonic()
        if to_group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(target(proc) if target else proc.pid, sig)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 30 s after {sig.name}:\n{out}")
        elapsed = time.monotonic() - t0
        # the checkpoint writer (persistent worker) must not outlive the training process
        assert process_group_gone(proc.pid, 10), "processes of the run are still alive 10 s after it exited"
        while (line := lines.get(timeout=10)) is not None:
            out += line
    return rc, out, elapsed


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "sig,to_group,extra",
    [
        # Ctrl-C: the terminal signals the whole foreground process group; stop and abort
        (signal.SIGINT, True, []),
        # Slurm / systemd: every process of the job, the writer included; the opt-out
        (signal.SIGTERM, True, ["--no-preemption-save"]),
    ],
    ids=["SIGINT-to-group", "SIGTERM-no-preemption-save"],
)
def test_signal_stops_cleanly_and_resumes(
    tmp_path: Path, sig: signal.Signals, to_group: bool, extra: list[str]
) -> None:
    rc, out, elapsed = _run_until_signal([sys.executable, str(SCRIPT), *LONG_ARGS, *extra], tmp_path, sig, to_group)
    assert rc == 128 + sig, f"exit code {rc}\n{out}"
    assert f"received {sig.name}: stopping at step" in out, out
    m = re.search(r"aborted in-flight checkpoints; latest committed: step (\d+)", out)
    assert m, out
    latest, last_printed = int(m.group(1)), max(int(s) for s in COMMIT_RE.findall(out))
    assert latest >= last_printed > 0, out
    print(f"{sig.name}: stopped in {elapsed:.2f} s, latest committed step {latest}")

    out = run([*LONG_ARGS, *extra, "--resume", "--stop-at", str(latest + 3), "--log-every", "1"], tmp_path)
    assert f"resumed from step {latest}" in out, out
    assert re.search(rf"^step\s+{latest + 1}/1000000 \| loss", out, re.M), out
    assert f"checkpoint step {latest + 3} committed" in out, out


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "to_group,extra",
    [
        (True, []),  # Slurm / systemd: every process of the job, the writer included
        (False, ["--temporal"]),  # Kubernetes / docker stop: the main process only
    ],
    ids=["SIGTERM-to-group", "SIGTERM-temporal"],
)
def test_sigterm_is_a_preemption_save_and_resume_is_bitwise_identical(
    long_reference: Path, tmp_path: Path, to_group: bool, extra: list[str]
) -> None:
    """Issue 12: SIGTERM at step K commits step K (the ranks' agreed step), exit 143;
    --resume continues from K, bitwise equal to an uninterrupted run."""
    rc, out, elapsed = _run_until_signal(
        [sys.executable, str(SCRIPT), *LONG_ARGS, *extra], tmp_path, signal.SIGTERM, to_group
    )
    assert rc == 143, f"exit code {rc}\n{out}"
    m = re.search(r"^received SIGTERM: preemption save of step (\d+)$", out, re.M)
    assert m, out
    k = int(m.group(1))
    assert f"preemption checkpoint step {k} committed in" in out and f"latest committed: step {k}" in out, out
    assert k < LONG, f"stopped at {k}, after the reference's {LONG} steps"
    print(f"SIGTERM: step {k} committed, exit {elapsed:.2f} s after the signal")
    out = run([*LONG_ARGS, *extra, "--resume", "--stop-at", str(LONG), "--save-final", "final.pt"], tmp_path)
    assert f"resumed from step {k}" in out, out
    assert_same_params(long_reference, tmp_path / "final.pt")


@pytest.mark.timeout(180)
def test_sigterm_to_one_of_two_ranks_is_a_preemption_save_of_an_agreed_step(tmp_path: Path) -> None:
    """Issue 12: SIGTERM reaches rank 1 only (a signal to one node); both ranks stop at
    the same step K, commit it, exit 143; resuming from K is bitwise equal to a run
    without the interruption."""
    stop_at = 100
    args = [*TINY, "--batch-size", "4", "--steps", "1000000", "--ckpt-every", "10", "--log-every", "100"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    # the reference run writes with forked children (cheaper to start; the writer cannot change
    # the parameters, see test_resume_is_bitwise_identical), the interrupted one with the worker;
    # they are independent: the reference runs while the other is interrupted
    pool = ThreadPoolExecutor(1)
    reference = pool.submit(
        run,
        [*args, "--temporal", "--stop-at", str(stop_at), "--save-final", "final.pt"],
        tmp_path / "a",
        launcher=torchrun(2),
    )
    port = str(free_port())
    with pool, contextlib.ExitStack() as stack:
        ranks = []
        for rank in range(2):  # started directly, without torchrun: each rank's own exit code
            env = dict(
                _env(),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE="2",
                LOCAL_WORLD_SIZE="2",
            )
            ranks.append(stack.enter_context(_popen([sys.executable, str(SCRIPT), *args], tmp_path / "b", env)))
        out = ""
        for line in ranks[0].stdout:  # type: ignore[union-attr]
            out += line
            if COMMIT_RE.search(out):
                break
        ranks[1].send_signal(signal.SIGTERM)
        out += ranks[0].communicate(timeout=60)[0]
        out1 = ranks[1].communicate(timeout=60)[0]
        assert [r.returncode for r in ranks] == [143, 143], f"{out}\n--- rank 1:\n{out1}"
        ref = reference.result()
    assert "world size 2" in ref and f"summary: {stop_at} steps" in ref, ref
    assert len(re.findall(r"^checkpoint step 50 committed", ref, re.M)) == 1, ref  # rank 0 prints, once
    m = re.search(r"^received SIGTERM: preemption save of step (\d+)$", out, re.M)
    assert m, out
    k = int(m.group(1))
    assert f"preemption checkpoint step {k} committed in" in out and k < stop_at, out
    out = run(
        [*args, "--resume", "--stop-at", str(stop_at), "--save-final", "final.pt"], tmp_path / "b", launcher=torchrun(2)
    )
    assert f"resumed from step {k}" in out, out
    # per-rank dropout RNG streams differ; restoring the wrong one would change the parameters
    assert_same_params(tmp_path / "a" / "final.pt", tmp_path / "b" / "final.pt")


# ----------------------------------------------------------------------------- FSDP2 (--fsdp)
# No dropout: runs on different numbers of ranks then compute the same thing, up to the
# order of floating-point reductions, when the global batch is the same (6 = 2 x 3 = 1 x 6 = 3 x 2).
FSDP = [*TINY, "--fsdp", "--dropout", "0", "--steps", "12", "--ckpt-every", "3", "--log-every", "1"]
LOSS_RE = re.compile(r"^step\s+(\d+)/12 \| loss (\d+\.\d+) \|", re.M)


def torchrun(nproc: int) -> list[str]:
    # --standalone: the rendezvous store binds a free port itself (no race for a chosen one)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def losses(out: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in LOSS_RE.findall(out)}


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """On 2 ranks with --fsdp: a straight run of 12 steps (checkpoints 3, 6, 9, 12). The
    resumed runs below start from its checkpoint of step 6, alone in a root of their own
    (what a run stopped at step 6 leaves: test_resume_is_bitwise_identical checks that)."""
    straight_dir = tmp_path_factory.mktemp("fsdp_straight")
    straight_out = run(
        [*FSDP, "--batch-size", "3", "--temporal", "--save-final", "final.pt"], straight_dir, launcher=torchrun(2)
    )
    return {
        "final": straight_dir / "final.pt",
        "straight_out": straight_out,
        "straight_dir": straight_dir,
        "step6": straight_dir / "checkpoints" / "step_00000006",
    }


def _resume_dir(fsdp_runs: dict[str, Any], tmp_path: Path) -> Path:
    shutil.copytree(fsdp_runs["step6"], tmp_path / "checkpoints" / "step_00000006")
    return tmp_path


def assert_close_continuation(fsdp_runs: dict[str, Any], out: str, final: Path) -> None:
    """A run resumed at step 6 on another number of ranks continues the straight run:
    the same losses (printed: the mean over ranks) and, up to rounding, parameters."""
    straight = losses(fsdp_runs["straight_out"])
    resumed = losses(out)
    assert sorted(resumed) == list(range(7, 13)), out
    assert all(abs(resumed[s] - straight[s]) <= 2e-4 for s in resumed), (resumed, straight)
    sa, sb = torch.load(fsdp_runs["final"]), torch.load(final)
    assert sa.keys() == sb.keys()
    # Restoring the wrong AdamW state (or none) moves parameters by ~lr = 1e-3 per step.
    worst = max((sa[k] - sb[k]).abs().max().item() for k in sa)
    assert worst < 1e-5, f"parameters differ by up to {worst}"


@pytest.mark.timeout(120)
def test_fsdp_torchrun_resume_is_bitwise_identical(fsdp_runs: dict[str, Any], tmp_path: Path) -> None:
    out = fsdp_runs["straight_out"]
    assert "world size 2 | FSDP" in out and "summary: 12 steps" in out, out
    assert sorted(int(s) for s in COMMIT_RE.findall(out)) == [3, 6, 9, 12], out
    assert sorted(losses(out)) == list(range(1, 13)), out
    # Each rank wrote its own shards (DCP gives the small replicated entries, RNG states,
    # Adam's step counts, to the rank with fewer bytes so far): two data files of similar size.
    ckpt = fsdp_runs["straight_dir"] / "checkpoints" / "step_00000012"
    sizes = [(ckpt / f"__{r}_0.distcp").stat().st_size for r in range(2)]
    assert all(0.3 < size / sum(sizes) < 0.7 for size in sizes), sizes

    d = _resume_dir(fsdp_runs, tmp_path)
    out = run([*FSDP, "--batch-size", "3", "--resume", "--save-final", "final.pt"], d, launcher=torchrun(2))
    assert "resumed from step 6 in ./checkpoints/step_00000006" in out and "resharded" not in out, out
    assert sorted(int(s) for s in COMMIT_RE.findall(out)) == [9, 12], out
    assert_same_params(fsdp_runs["final"], d / "final.pt")


@pytest.mark.timeout(90)
def test_fsdp_resume_two_ranks_on_one(fsdp_runs: dict[str, Any], tmp_path: Path) -> None:
    d = _resume_dir(fsdp_runs, tmp_path)
    # Resumed and stopped at once: the parameters are exactly those the 2 ranks saved at
    # step 6 (the checkpoint's model entries, read whole).
    out = run([*FSDP, "--batch-size", "6", "--resume", "--stop-at", "6", "--save-final", "at6.pt"], d)
    assert "resumed from step 6 in ./checkpoints/step_00000006" in out, out
    assert "saved by 2 ranks, resharded to 1" in out, out
    saved, loaded = asyncckpt.read_state_dict(fsdp_runs["step6"])["model"], torch.load(d / "at6.pt")
    assert saved.keys() == loaded.keys()
    assert not [k for k in saved if not torch.equal(saved[k], loaded[k])], "parameters differ from step 6's"
    # Resumed to the end on one rank (a single-process group, no torchrun).
    out = run([*FSDP, "--batch-size", "6", "--resume", "--save-final", "final.pt"], d)
    assert "world size 1 | FSDP" in out and "resharded to 1" in out, out
    assert sorted(int(s) for s in COMMIT_RE.findall(out)) == [9, 12], out
    assert_close_continuation(fsdp_runs, out, d / "final.pt")
    assert sorted(p.name for p in (d / "checkpoints" / "step_00000012").glob("*.distcp")) == ["__0_0.distcp"]


@pytest.mark.timeout(90)
def test_fsdp_resume_two_ranks_on_three(fsdp_runs: dict[str, Any], tmp_path: Path) -> None:
    d = _resume_dir(fsdp_runs, tmp_path)
    out = run([*FSDP, "--batch-size", "2", "--resume", "--save-final", "final.pt"], d, launcher=torchrun(3))
    assert "world size 3 | FSDP" in out and "saved by 2 ranks, resharded to 3" in out, out
    assert sorted(int(s) for s in COMMIT_RE.findall(out)) == [9, 12], out
    assert_close_continuation(fsdp_runs, out, d / "final.pt")
    assert len(list((d / "checkpoints" / "step_00000012").glob("*.distcp"))) == 3
