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
import subprocess
import struct
import sys
import termios
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from dist_utils import free_port
from helpers import kill_process_tree, process_group_gone
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train.py"
# ~2 KB of text in 16-byte windows = 124 windows = 15 steps per epoch at batch 8:
# the runs below cross epoch boundaries, so the data position is exercised too.
TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
        "--batch-size", "8", "--data-mb", "0.002", "--dropout", "0.1", "--lr", "3e-3"]
STEPS, HALF = 24, 11  # "2K steps straight" vs "K steps, exit, resume to 2K"
COMMIT_RE = re.compile(r"^checkpoint step (\d+) committed \| stall [\d.]+ ms \| write [\d.]+ s \| "
                       r"[\d.]+ MB at [\d.]+ GB/s$", re.M)
# --log-every N: one line per N steps
STEP_RE = re.compile(r"^step\s+(\d+)/(\d+) \| loss \d+\.\d+ \| lr ", re.M)
# the default when stderr is not a terminal: one line per 10% of the steps
PROGRESS_RE = re.compile(r"^step (\d+)/(\d+) \((\d+)%\) \| loss \d+\.\d+ \| [\d.]+ steps/s"
                         r"(?: \| last ckpt stall [\d.]+ ms)?$", re.M)


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@contextlib.contextmanager
def _popen(cmd: list[str], cwd: Path) -> Iterator[subprocess.Popen]:
    """Start ``cmd`` in its own process group. On exit, give the group (checkpoint worker,
    multiprocessing's resource tracker) a few seconds to finish, then kill what is left."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None or not process_group_gone(proc.pid, 10):
            kill_process_tree(proc)
        proc.wait()
        if proc.stdout:
            proc.stdout.close()


def run(args: list[str], cwd: Path, *, timeout: float = 90, launcher: list[str] | None = None,
        expect_rc: int = 0) -> str:
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
def test_progress_bar_on_a_terminal(tmp_path: Path) -> None:
    """With stderr on a terminal: one tqdm bar there, the checkpoint lines and the summary on stdout."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # 24 rows, 120 columns
    cmd = [sys.executable, str(SCRIPT), *TINY, "--steps", "6", "--ckpt-every", "3"]
    terminal: list[bytes] = []

    def read_terminal() -> None:
        with contextlib.suppress(OSError):  # EIO once the last writer closed the terminal
            while chunk := os.read(master, 4096):
                terminal.append(chunk)

    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=slave, text=True,
                            start_new_session=True)
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


@pytest.mark.timeout(90)
@pytest.mark.parametrize("caller", ["persistent", "temporal"])
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
    assert "already holds checkpoints (latest step 24); pass --resume" in out, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig,to_group,temporal", [
    (signal.SIGINT, True, False),  # Ctrl-C: the terminal signals the whole foreground process group
    (signal.SIGTERM, True, False),  # Slurm / systemd: every process of the job, the writer included
    (signal.SIGTERM, False, True),  # Kubernetes / docker stop: the main process only
], ids=["SIGINT-to-group", "SIGTERM-to-group", "SIGTERM-temporal"])
def test_signal_stops_cleanly_and_resumes(tmp_path: Path, sig: signal.Signals, to_group: bool,
                                          temporal: bool) -> None:
    extra = ["--temporal"] if temporal else []
    cmd = [sys.executable, str(SCRIPT), *TINY, *extra, "--steps", "1000000", "--ckpt-every", "20",
           "--log-every", "100"]
    lines: queue.Queue[str | None] = queue.Queue()
    with _popen(cmd, tmp_path) as proc:
        def pump() -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                lines.put(line)
            lines.put(None)
        threading.Thread(target=pump, daemon=True).start()
        out, deadline = "", time.monotonic() + 60
        while not COMMIT_RE.search(out):
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no checkpoint committed within 60 s:\n{out}")
            if line is None:
                pytest.fail(f"exited early with {proc.wait()}:\n{out}")
            out += line
        time.sleep(0.3)  # let it run on, so a save may be in flight when the signal arrives
        t0 = time.monotonic()
        (os.killpg if to_group else os.kill)(proc.pid, sig)
        try:
            rc = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 15 s after {sig.name}")
        elapsed = time.monotonic() - t0
        # the checkpoint writer (persistent worker) must not outlive the training process
        assert process_group_gone(proc.pid, 10), "processes of the run are still alive 10 s after it exited"
        while (line := lines.get(timeout=10)) is not None:
            out += line
        assert rc == 128 + sig, f"exit code {rc}\n{out}"
    assert f"received {sig.name}: stopping at step" in out, out
    m = re.search(r"latest committed: step (\d+)", out)
    assert m, out
    latest, last_printed = int(m.group(1)), max(int(s) for s in COMMIT_RE.findall(out))
    assert latest >= last_printed > 0, out
    print(f"{sig.name}: stopped in {elapsed:.2f} s, latest committed step {latest}")

    out = run([*TINY, *extra, "--steps", "1000000", "--ckpt-every", "20", "--resume",
               "--stop-at", str(latest + 3), "--log-every", "1"], tmp_path)
    assert f"resumed from step {latest}" in out, out
    assert re.search(rf"^step\s+{latest + 1}/1000000 \| loss", out, re.M), out
    assert f"checkpoint step {latest + 3} committed" in out, out


@pytest.mark.timeout(150)
def test_torchrun_two_ranks_resume_is_bitwise_identical(tmp_path: Path) -> None:
    def torchrun() -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(free_port())]

    args = [*TINY, "--batch-size", "4", "--steps", "12", "--ckpt-every", "4", "--log-every", "1"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    # the reference run writes with forked children (cheaper to start; the writer cannot change
    # the parameters, see test_resume_is_bitwise_identical), the interrupted one with the worker
    out = run([*args, "--temporal", "--save-final", "final.pt"], tmp_path / "a", launcher=torchrun())
    assert "world size 2" in out and "summary: 12 steps" in out, out
    assert sorted(int(s) for s in COMMIT_RE.findall(out)) == [4, 8, 12], out
    assert len(re.findall(r"^step\s+5/12 \| loss", out, re.M)) == 1, out  # rank 0 prints, once

    out = run([*args, "--stop-at", "6"], tmp_path / "b", launcher=torchrun())
    assert sorted(int(s) for s in COMMIT_RE.findall(out)) == [4, 6], out
    out = run([*args, "--resume", "--save-final", "final.pt"], tmp_path / "b", launcher=torchrun())
    assert "resumed from step 6" in out, out
    # per-rank dropout RNG streams differ; restoring the wrong one would change the parameters
    assert_same_params(tmp_path / "a" / "final.pt", tmp_path / "b" / "final.pt")


# ----------------------------------------------------------------------------- FSDP2 (--fsdp)
# No dropout: runs on different numbers of ranks then compute the same thing, up to the
# order of floating-point reductions, when the global batch is the same (6 = 2 x 3 = 1 x 6 = 3 x 2).
FSDP = [*TINY, "--fsdp", "--dropout", "0", "--steps", "12", "--ckpt-every", "4", "--log-every", "1"]
LOSS_RE = re.compile(r"^step\s+(\d+)/12 \| loss (\d+\.\d+) \|", re.M)


def torchrun(nproc: int) -> list[str]:
    # --standalone: the rendezvous store binds a free port itself (no race for a chosen one)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def losses(out: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in LOSS_RE.findall(out)}


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """On 2 ranks with --fsdp: a straight run of 12 steps, and a run stopped at step 6."""
    straight_dir, stopped_dir = tmp_path_factory.mktemp("fsdp_straight"), tmp_path_factory.mktemp("fsdp_stopped")
    straight_out = run([*FSDP, "--batch-size", "3", "--temporal", "--save-final", "final.pt"], straight_dir,
                       launcher=torchrun(2))
    stopped_out = run([*FSDP, "--batch-size", "3", "--stop-at", "6", "--save-final", "at6.pt"], stopped_dir,
                      launcher=torchrun(2))
    return {"final": straight_dir / "final.pt", "straight_out": straight_out, "straight_dir": straight_dir,
            "at6": stopped_dir / "at6.pt", "ckpts": stopped_dir / "checkpoints", "stopped_out": stopped_out}


def _resume_dir(fsdp_runs: dict[str, object], tmp_path: Path) -> Path:
    shutil.copytree(fsdp_runs["ckpts"], tmp_path / "checkpoints")  # type: ignore[arg-type]
    return tmp_path


def assert_close_continuation(fsdp_runs: dict[str, object], out: str, final: Path) -> None:
    """A run resumed at step 6 on another number of ranks continues the straight run:
    the same losses (printed: the mean over ranks) and, up to rounding, parameters."""
    straight = losses(fsdp_runs["straight_out"])  # type: ignore[arg-type]
    resumed = losses(out)
    assert sorted(resumed) == list(range(7, 13)), out
    assert all(abs(resumed[s] - straight[s]) <= 2e-4 for s in resumed), (resumed, straight)
    sa, sb = torch.load(fsdp_runs["final"]), torch.load(final)  # type: ignore[arg-type]
    assert sa.keys() == sb.keys()
    # Restoring the wrong AdamW state (or none) moves parameters by ~lr = 1e-3 per step.
    worst = max((sa[k] - sb[k]).abs().max().item() for k in sa)
    assert worst < 1e-5, f"parameters differ by up to {worst}"


@pytest.mark.timeout(120)
def test_fsdp_torchrun_resume_is_bitwise_identical(fsdp_runs: dict[str, object], tmp_path: Path) -> None:
    out = fsdp_runs["straight_out"]
    assert "world size 2 | FSDP" in out and "summary: 12 steps" in out, out
    assert sorted(int(s) for s in COMMIT_RE.findall(out)) == [4, 8, 12], out  # type: ignore[arg-type]
    assert sorted(losses(out)) == list(range(1, 13)), out  # type: ignore[arg-type]
    # Each rank wrote its own shards (DCP gives the small replicated entries, RNG states,
    # Adam's step counts, to the rank with fewer bytes so far): two data files of similar size.
    ckpt = fsdp_runs["straight_dir"] / "checkpoints" / "step_00000012"  # type: ignore[operator]
    sizes = [(ckpt / f"__{r}_0.distcp").stat().st_size for r in range(2)]
    assert all(0.3 < size / sum(sizes) < 0.7 for size in sizes), sizes

    d = _resume_dir(fsdp_runs, tmp_path)
    out = run([*FSDP, "--batch-size", "3", "--resume", "--save-final", "final.pt"], d, launcher=torchrun(2))
    assert "resumed from step 6 in ./checkpoints" in out and "resharded" not in out, out
    assert sorted(int(s) for s in COMMIT_RE.findall(out)) == [8, 12], out
    assert_same_params(fsdp_runs["final"], d / "final.pt")  # type: ignore[arg-type]


@pytest.mark.timeout(90)
def test_fsdp_resume_two_ranks_on_one(fsdp_runs: dict[str, object], tmp_path: Path) -> None:
    d = _resume_dir(fsdp_runs, tmp_path)
    # Resumed and stopped at once: the parameters are exactly those saved at step 6.
    out = run([*FSDP, "--batch-size", "6", "--resume", "--stop-at", "6", "--save-final", "at6.pt"], d)
    assert "resumed from step 6 in ./checkpoints" in out and "saved by 2 ranks, resharded to 1" in out, out
    assert_same_params(fsdp_runs["at6"], d / "at6.pt")  # type: ignore[arg-type]
    # Resumed to the end on one rank (a single-process group, no torchrun).
    out = run([*FSDP, "--batch-size", "6", "--resume", "--save-final", "final.pt"], d)
    assert "world size 1 | FSDP" in out and "resharded to 1" in out, out
    assert sorted(int(s) for s in COMMIT_RE.findall(out)) == [8, 12], out
    assert_close_continuation(fsdp_runs, out, d / "final.pt")
    assert sorted(p.name for p in (d / "checkpoints" / "step_00000012").glob("*.distcp")) == ["__0_0.distcp"]


@pytest.mark.timeout(90)
def test_fsdp_resume_two_ranks_on_three(fsdp_runs: dict[str, object], tmp_path: Path) -> None:
    d = _resume_dir(fsdp_runs, tmp_path)
    out = run([*FSDP, "--batch-size", "2", "--resume", "--save-final", "final.pt"], d, launcher=torchrun(3))
    assert "world size 3 | FSDP" in out and "saved by 2 ranks, resharded to 3" in out, out
    assert sorted(int(s) for s in COMMIT_RE.findall(out)) == [8, 12], out
    assert_close_continuation(fsdp_runs, out, d / "final.pt")
    assert len(list((d / "checkpoints" / "step_00000012").glob("*.distcp"))) == 3
