"""The ``asyncckpt`` command line, run as a real subprocess on real checkpoints.

Checkpoints are made in this process with ``CheckpointManager(..., persistent=False)``
and synchronous saves (no worker process); the tool runs as ``python -m asyncckpt``
and, once, as the installed console script. ``ls``, ``verify`` and ``clean`` do not
import torch (fast); ``inspect`` and ``convert`` do (seconds per run), so each runs in
a subprocess once or twice and its other variants through ``cli.main`` in this process.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import asyncckpt
from asyncckpt import cli
from asyncckpt.format import manifest as commit
from asyncckpt.io.commit import write_latest

from helpers import assert_same, flip_byte

pytestmark = pytest.mark.timeout(90)

CMD_TIMEOUT = 60
PY = [sys.executable, "-m", "asyncckpt"]
DATA = "__0_0.distcp"


def console_script() -> str:
    """The installed ``asyncckpt`` console script of this interpreter's environment."""
    script = Path(sys.executable).parent / "asyncckpt"
    found = str(script) if script.exists() else shutil.which("asyncckpt")
    if found is None:
        pytest.fail("the asyncckpt console script is not installed (pip install -e .)")
    return found


def run(*args: Any, cmd: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ASYNCCKPT_FAULT"}
    env["COLUMNS"] = "200"
    return subprocess.run([*(cmd or PY), *map(str, args)], capture_output=True, text=True, timeout=CMD_TIMEOUT, env=env)


def run_json(*args: Any, rc: int = 0) -> Any:
    proc = run(*args, "--json")
    assert proc.returncode == rc, proc.stderr
    return json.loads(proc.stdout)


def main_here(capsys: pytest.CaptureFixture, *args: Any) -> tuple[int, str, str]:
    """``cli.main`` in this process (torch already imported): exit status, stdout, stderr."""
    capsys.readouterr()
    rc = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit status 1, an ``asyncckpt: error:`` line, no traceback."""
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "asyncckpt: error:" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    for needle in needles:
        assert needle in proc.stdout + proc.stderr, (needle, proc.stdout, proc.stderr)


def make_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "weight": torch.randn(4, 3, generator=g),
            "bias": torch.arange(5, dtype=torch.int64) + seed,
            "half": torch.randn(2, 6, generator=g).to(torch.bfloat16),
        },
        "scalar": torch.tensor(3.5 + seed, dtype=torch.float64),
        "flags": torch.tensor([True, False, True]),
        "hist": [torch.full((2,), float(seed)), 7],
        "step": seed,
        "lr": 0.01,
        "name": "run-1",
    }


TENSORS = {  # fqn -> (dtype, shape) of make_state
    "model.weight": ("float32", [4, 3]),
    "model.bias": ("int64", [5]),
    "model.half": ("bfloat16", [2, 6]),
    "scalar": ("float64", []),
    "flags": ("bool", [3]),
    "hist.0": ("float32", [2]),
}
VALUES = {"hist.1", "step", "lr", "name"}


def make_root(tmp_path: Path, steps: tuple[int, ...] = (10, 20)) -> Path:
    root = tmp_path / "root"
    with asyncckpt.CheckpointManager(root, persistent=False) as manager:
        for step in steps:
            manager.save(step, make_state(step), async_op=False)
    return root


def add_partial(root: Path) -> dict[str, str]:
    """Fabricate the leftovers a crashed job leaves; returns name -> kind."""
    tmp = root / ".step_00000030.tmp-0123abcd"
    tmp.mkdir()
    (tmp / DATA).write_bytes(b"x" * 100)
    deleting = root / ".step_00000005.deleting-a1b2c3"
    deleting.mkdir()
    (deleting / DATA).write_bytes(b"y" * 10)
    (root / "step_00000040").mkdir()  # no manifest: not asyncckpt's, never removed
    return {tmp.name: "temporary", deleting.name: "deleting", "step_00000040": "foreign"}


# ----------------------------------------------------------------------------- help, usage
def test_help_for_every_subcommand() -> None:
    top = run("--help")
    assert top.returncode == 0 and top.stdout.startswith("usage: asyncckpt")
    for sub in ("ls", "inspect", "verify", "convert", "clean"):
        assert sub in top.stdout
        proc = run(sub, "--help")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(f"usage: asyncckpt {sub}"), proc.stdout
        assert "--json" in proc.stdout
    assert "--progress" in run("verify", "--help").stdout
    convert_help = run("convert", "--help").stdout
    assert "--force" in convert_help and "--allow-pickle" in convert_help
    assert "--yes" in run("clean", "--help").stdout
    # Usage errors: argparse's exit status 2.
    for bad in ([], ["bogus"], ["verify"], ["ls", "a", "b"]):
        proc = run(*bad)
        assert proc.returncode == 2, (bad, proc.stderr)
        assert "usage:" in proc.stderr and "Traceback" not in proc.stderr


def test_console_script_is_installed_and_runs(tmp_path: Path) -> None:
    root = make_root(tmp_path, steps=(3,))
    script = console_script()
    proc = run("--help", cmd=[script])
    assert proc.returncode == 0 and "SUBCOMMAND" in proc.stdout
    proc = run("ls", root, "--json", cmd=[script])
    assert proc.returncode == 0, proc.stderr
    assert [c["step"] for c in json.loads(proc.stdout)["checkpoints"]] == [3]
    proc = run("verify", root / "step_00000003", cmd=[script])
    assert proc.returncode == 0 and proc.stdout.startswith("OK"), proc.stdout


# ----------------------------------------------------------------------------- ls
def test_ls_lists_steps_latest_and_partial(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    partial = add_partial(root)

    proc = run("ls", root)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    row20 = next(line for line in lines if "step_00000020" in line and "latest" in line)
    assert "newest" in row20
    assert any("step_00000010" in line and "latest" not in line for line in lines)
    assert "latest: step_00000020" in proc.stdout
    for name in partial:
        assert name in proc.stdout

    doc = run_json("ls", root)
    assert doc["latest"] == "step_00000020" and doc["latest_is_committed"] and doc["newest_step"] == 20
    assert [(c["step"], c["name"], c["latest"]) for c in doc["checkpoints"]] == [
        (10, "step_00000010", False),
        (20, "step_00000020", True),
    ]
    for c in doc["checkpoints"]:
        manifest = commit.read_manifest(c["path"])
        assert c["bytes"] == manifest["total_bytes"] > 0
        assert c["world_size"] == 1 and c["error"] is None
        assert datetime.datetime.fromisoformat(c["committed_at"]).timestamp() == pytest.approx(
            os.stat(Path(c["path"]) / commit.MANIFEST_NAME).st_mtime, abs=1
        )
        assert re.fullmatch(r"[\d.]+ (B|KiB|MiB)", c["size"])
    assert {p["name"]: p["kind"] for p in doc["partial"]} == partial
    assert {p["name"]: p["bytes"] for p in doc["partial"]}[".step_00000030.tmp-0123abcd"] == 100

    # latest lagging behind the newest committed step (a crash between rename and latest).
    write_latest(root, "step_00000010")
    doc = run_json("ls", root)
    assert doc["latest"] == "step_00000010" and doc["newest_step"] == 20

    # A single checkpoint directory is listed as itself.
    doc = run_json("ls", root / "step_00000020")
    assert doc["is_checkpoint"] and [c["step"] for c in doc["checkpoints"]] == [20] and doc["partial"] == []

    # An empty directory: nothing to list, not an error.
    (tmp_path / "empty").mkdir()
    proc = run("ls", tmp_path / "empty")
    assert proc.returncode == 0 and "no committed checkpoints" in proc.stdout


# ----------------------------------------------------------------------------- inspect
def test_inspect_entries_dtypes_shapes_totals(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = make_root(tmp_path, steps=(20,))
    ckpt = root / "step_00000020"

    rc, stdout, stderr = main_here(capsys, "inspect", ckpt)  # the table (--json runs in a subprocess below)
    assert rc == 0, stderr
    rows = {line.split()[0]: line for line in stdout.splitlines() if line.split()}
    for fqn, (dtype, _shape) in TENSORS.items():
        assert fqn in rows, stdout
        assert re.search(rf"\btensor\s+{dtype}\b", rows[fqn]), rows[fqn]
        assert DATA in rows[fqn]
    assert "(4, 3)" in rows["model.weight"] and "(5,)" in rows["model.bias"] and "()" in rows["scalar"]
    for fqn in VALUES:
        assert re.search(r"\bbytes\b", rows[fqn]), rows[fqn]
    assert f"entries: {len(TENSORS) + len(VALUES)} ({len(TENSORS)} tensors, {len(VALUES)} other values)" in stdout
    assert "world_size: 1  step: 20" in stdout

    doc = run_json("inspect", ckpt)
    entries = {e["fqn"]: e for e in doc["entries"]}
    assert set(entries) == set(TENSORS) | VALUES
    state = make_state(20)
    for fqn, (dtype, shape) in TENSORS.items():
        e = entries[fqn]
        assert (e["kind"], e["dtype"], e["shape"]) == ("tensor", dtype, shape)
        tensor: Any = state
        for key in e["path"]:
            tensor = tensor[key]
        assert e["bytes"] == tensor.numel() * tensor.element_size()
        assert [r["file"] for r in e["files"]] == [DATA] and e["stored_bytes"] >= e["bytes"]
    for fqn in VALUES:
        assert entries[fqn]["kind"] == "bytes" and entries[fqn]["dtype"] is None
        assert entries[fqn]["bytes"] == entries[fqn]["stored_bytes"] > 0
    assert entries["model.half"]["path"] == ["model", "half"] and entries["hist.1"]["path"] == ["hist", 1]
    manifest = commit.read_manifest(ckpt)
    totals = doc["totals"]
    assert totals["entries"] == len(entries) and totals["tensors"] == len(TENSORS)
    assert totals["tensor_bytes"] == sum(e["bytes"] for e in entries.values() if e["kind"] == "tensor")
    assert totals["files"] == 1 and totals["file_sizes"] == {DATA: manifest["files"][DATA]["size"]}
    assert (doc["world_size"], doc["step"], doc["committed"]) == (1, 20, True)


def test_inspect_refuses_unsafe_or_corrupt_metadata(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = make_root(tmp_path, steps=(1,))
    ckpt = root / "step_00000001"
    # A root is not a checkpoint: say which one to inspect (no torch import needed).
    assert_clean_error(run("inspect", root), "not a checkpoint directory", "step_00000001")
    # .metadata that would run code if unpickled with pickle.load.
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    os.chmod(ckpt / commit.METADATA_NAME, 0o644)
    (ckpt / commit.METADATA_NAME).write_bytes(pickle.dumps(Evil()))
    rc, stdout, stderr = main_here(capsys, "inspect", ckpt)
    assert rc == 1 and stderr.startswith("asyncckpt: error:") and "not allowed" in stderr, stderr
    assert not marker.exists()
    rc, stdout, stderr = main_here(capsys, "convert", ckpt, tmp_path / "out.pt")
    assert rc == 1 and "not allowed" in stderr, stderr
    assert not marker.exists() and not (tmp_path / "out.pt").exists()
    (ckpt / commit.METADATA_NAME).write_bytes(b"\x80\x04garbage")
    rc, stdout, stderr = main_here(capsys, "inspect", "--json", ckpt)
    assert rc == 1 and "cannot be read safely" in json.loads(stdout)["error"], stdout


# ----------------------------------------------------------------------------- verify
def test_verify_ok_and_corrupted_byte(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    good, other = root / "step_00000020", root / "step_00000010"
    proc = run("verify", good, other)
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[:2] for line in proc.stdout.splitlines()] == [["OK", str(good)], ["OK", str(other)]]
    # A root stands for all its committed checkpoints.
    doc = run_json("verify", root)
    assert doc["ok"] and doc["checked"] == 2

    flip_byte(other / DATA, 700)
    for extra in ((), ("--progress",)):  # commit.verify_checkpoint, and the loop with a progress bar
        proc = run("verify", good, other, *extra)
        assert_clean_error(proc, "FAILED", f"{other / DATA}: checksum mismatch")
        assert f"OK      {good}" in proc.stdout
    doc = run_json("verify", other, rc=1)
    assert not doc["ok"] and doc["results"][0]["file"] == str(other / DATA)

    with open(good / DATA, "r+b") as f:  # truncated: the size check names the file
        f.truncate(100)
    assert_clean_error(run("verify", good), f"{good / DATA} has 100 bytes")


def test_missing_path_is_a_clean_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    assert_clean_error(run("verify", missing), "FAILED", "no such file or directory")
    doc = run_json("verify", missing, rc=1)
    assert not doc["ok"] and "no such file" in doc["results"][0]["error"]
    for args in (("ls", missing), ("inspect", missing), ("clean", missing), ("convert", missing, tmp_path / "out.pt")):
        assert_clean_error(run(*args), str(missing))
    doc = run_json("ls", missing, rc=1)
    assert "no such file" in doc["error"]
    # A directory that is not a committed checkpoint.
    (tmp_path / "empty").mkdir()
    assert_clean_error(run("verify", tmp_path / "empty"), "FAILED", "not a committed checkpoint")


def test_verify_progress_bar(tmp_path: Path) -> None:
    ckpt = make_root(tmp_path, steps=(1,)) / "step_00000001"
    proc = run("verify", "--progress", ckpt)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"step_00000001:\s+\d+%\|", proc.stderr), proc.stderr
    for args in (("--no-progress",), ()):  # small checkpoint, stderr not a terminal: no bar
        proc = run("verify", *args, ckpt)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert run("verify", "--progress", "--no-progress", ckpt).returncode == 2


def test_verify_progress_hook_counts_every_byte(tmp_path: Path, temporal_queue: Any) -> None:
    # The progress bar of `verify` is fed by commit.verify_checkpoint(on_bytes=...).
    ckpt = tmp_path / "ck"
    asyncckpt.save(
        {"w": torch.randn(300), "b": torch.arange(7), "n": 3}, ckpt, async_op=False, calls_queue=temporal_queue
    )
    seen: list[int] = []
    commit.verify_checkpoint(ckpt, on_bytes=seen.append)
    assert sum(seen) == sum(e["size"] for e in commit.read_manifest(ckpt)["files"].values())


# ----------------------------------------------------------------------------- convert
def test_convert_round_trip_and_refuse_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ckpt = make_root(tmp_path, steps=(20,)) / "step_00000020"
    out = tmp_path / "model.pt"
    proc = run("convert", ckpt, out)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out}" in proc.stdout
    got = torch.load(out, weights_only=True)
    assert_same(make_state(20), got)
    # The same structure as stock DCP's converter gives.
    reference = tmp_path / "reference.pt"
    dcp_to_torch_save(ckpt, reference)
    assert_same(torch.load(reference, weights_only=True), got)

    before = out.read_bytes()
    assert_clean_error(run("convert", ckpt, out), "exists", "--force")
    assert out.read_bytes() == before
    rc, stdout, stderr = main_here(capsys, "convert", "--force", "--json", ckpt, out)
    assert rc == 0, stderr
    doc = json.loads(stdout)
    assert doc["output"] == str(out) and doc["bytes"] == out.stat().st_size and doc["entries"] == 10
    assert_same(make_state(20), torch.load(out, weights_only=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "reference.pt", "root"]  # no temp file


def test_convert_refuses_pickled_objects_without_allow_pickle(
    tmp_path: Path, temporal_queue: Any, capsys: pytest.CaptureFixture
) -> None:
    ckpt = tmp_path / "ck"
    state = {"w": torch.ones(3), "when": datetime.date(2024, 5, 6)}
    asyncckpt.save(state, ckpt, async_op=False, calls_queue=temporal_queue)
    out = tmp_path / "out.pt"
    assert_clean_error(run("convert", ckpt, out), "'when'", "--allow-pickle")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    rc, _stdout, stderr = main_here(capsys, "convert", "--allow-pickle", ckpt, out)
    assert rc == 0, stderr
    assert_same(state, torch.load(out, weights_only=False))


# ----------------------------------------------------------------------------- clean
def test_clean_dry_run_then_yes_removes_only_partial(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    partial = add_partial(root)
    committed = sorted(p.name for p in root.iterdir() if p.name not in partial)
    latest = (root / "latest").read_bytes()

    proc = run("clean", root)
    assert proc.returncode == 0, proc.stderr
    assert "dry run" in proc.stdout
    for name in partial:
        assert name in proc.stdout and (root / name).is_dir()
    doc = run_json("clean", root)
    assert doc["dry_run"] and doc["removed"] == [] and {p["name"] for p in doc["partial"]} == set(partial)

    proc = run("clean", "--yes", root)
    assert proc.returncode == 0, proc.stderr
    assert "dry run" not in proc.stdout
    assert sorted(p.name for p in root.iterdir()) == sorted(committed + ["step_00000040"])
    assert (root / "latest").read_bytes() == latest
    for step in ("step_00000010", "step_00000020"):
        commit.verify_checkpoint(root / step)
    doc = run_json("clean", "--force", root)
    assert [p["result"] for p in doc["partial"]] == ["kept: not an asyncckpt leftover"] and not doc["dry_run"]


def test_clean_never_removes_a_stock_dcp_checkpoint(tmp_path: Path) -> None:
    """A complete stock-DCP checkpoint named like a step is not asyncckpt's leftover."""
    import torch.distributed.checkpoint as dcp

    root = make_root(tmp_path, steps=(10,))
    dcp.save({"w": torch.arange(10)}, checkpoint_id=str(root / "step_00000005"))
    files = sorted(p.name for p in (root / "step_00000005").iterdir())
    proc = run("clean", "--yes", root)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (root / "step_00000005").iterdir()) == files
    assert "never removed" in proc.stdout


def test_ls_marks_as_newest_the_step_a_run_resumes_from_after_a_rollback(tmp_path: Path) -> None:
    """Steps 10 and 20 saved, then a rollback to 10 and a save of 11: a manager resumes
    from 11 (the newest save wins), and `ls` marks 11 as the newest, not 20."""
    root = tmp_path / "root"
    with asyncckpt.CheckpointManager(root, persistent=False) as mgr:
        for step in (10, 20):
            mgr.save(step, {"w": torch.full((8,), float(step))}, async_op=False)
        state = {"w": torch.zeros(8)}
        mgr.load(state, 10)
        mgr.save(11, {"w": torch.full((8,), 11.0)}, async_op=False)
        assert mgr.latest_step() == 11
    listed = run_json("ls", root)
    assert listed["newest_step"] == 11, listed
    proc = run("ls", root)
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    newest = [row[1] for row in rows if "newest" in row[-1]]
    assert newest == ["step_00000011"], proc.stdout
