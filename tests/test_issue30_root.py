"""A checkpoint root as a new user meets it (issue 30, items 1, 3, 5-8, 12, 13; issue 34
item 8's ``clean --yes`` on a root in use): retention that never removes a kept save
beside foreign names, no hang on a FIFO lock file, clear errors for read-only roots,
regular files and missing roots, a constructor that never leaves the root locked,
callbacks checked at the call, and the ``asyncckpt`` command's ``ls`` / ``clean`` /
``verify`` on such roots.

Everything runs through the public API, with real files, real managers and the real
``asyncckpt`` command in a subprocess; mounts and capabilities in a subprocess of their
own (``unshare -m``, ``setpriv``), skipped cleanly where the machine does not allow them.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt import CheckpointNotFoundError, CheckpointPathError, InvalidArgumentError, RootInUseError, testing

CMD = [sys.executable, "-m", "asyncckpt"]
CMD_TIMEOUT = 60


def state(value: float) -> dict[str, Any]:
    return {"w": torch.full((8,), float(value)), "step": int(value)}


def run(*args: Any, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The ``asyncckpt`` command in a subprocess (no failpoints unless ``env`` sets one)."""
    base = {k: v for k, v in os.environ.items() if k != "ASYNCCKPT_FAULT"}
    base["COLUMNS"] = "200"
    return subprocess.run(
        [*CMD, *map(str, args)], capture_output=True, text=True, timeout=CMD_TIMEOUT, env={**base, **(env or {})}
    )


def run_json(*args: Any, rc: int = 0) -> Any:
    proc = run(*args, "--json")
    assert proc.returncode == rc, (proc.stdout, proc.stderr)
    return json.loads(proc.stdout)


def lock_fds(under: Path) -> list[str]:
    """This process's open descriptors of files under ``under``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(under)):
            found.append(target)
    return found


# ----------------------------------------------------------------------------- item 1
def test_retention_keeps_its_own_steps_and_never_touches_foreign_names(tmp_path: Path) -> None:
    """The red team's root: a foreign committed ``step_6`` (``asyncckpt.save`` to
    ``root/step_6``), a committed ``step_000000009`` and an empty ``step_٤``. A manager
    with ``keep_last=2`` saves 5, 6, 7, 8: its own ``step_00000006`` stays until its turn,
    the foreign entries are never listed nor removed, and no commit warns "could not
    remove"."""
    root = tmp_path / "root"
    root.mkdir()
    asyncckpt.save(state(-6), root / "step_6", async_op=False, step=6)
    asyncckpt.save(state(-9), root / "step_000000009", async_op=False, step=9)
    (root / "step_\u0664").mkdir()
    foreign = sorted(["step_6", "step_000000009", "step_\u0664"])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with asyncckpt.CheckpointManager(root, keep_last=2, persistent=False) as mgr:
            for step in (5, 6, 7):
                mgr.save(step, state(step), async_op=False)
            assert mgr.steps() == [6, 7] and mgr.latest_step() == 7
            loaded = state(0)
            assert mgr.load(loaded, 6) == 6 and torch.equal(loaded["w"], state(6)["w"]) and loaded["step"] == 6
            mgr.save(8, state(8), async_op=False)
            assert mgr.steps() == [7, 8]
    assert not [str(w.message) for w in caught if "could not remove" in str(w.message)]
    names = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    assert names == sorted([*foreign, "latest", "step_00000007", "step_00000008"]), names
    for name in ("step_6", "step_000000009"):
        asyncckpt.verify(root / name)  # untouched

    # `asyncckpt ls` shows the foreign entries as foreign, in JSON and in text.
    doc = run_json("ls", root)
    by_name = {c["name"]: c for c in doc["checkpoints"]}
    assert {n for n, c in by_name.items() if c["foreign"]} == {"step_6", "step_000000009"}, doc
    assert not by_name["step_00000007"]["foreign"] and not by_name["step_00000008"]["foreign"]
    assert [(p["name"], p["kind"], p["step"]) for p in doc["partial"]] == [("step_\u0664", "foreign", None)]
    assert doc["newest_step"] == 8
    text = run("ls", root)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    for name in foreign:
        assert any(name in line and "foreign" in line for line in lines), (name, text.stdout)
    assert not any("step_00000008" in line and "foreign" in line for line in lines), text.stdout


def test_clean_dry_run_names_exactly_what_yes_removes(tmp_path: Path) -> None:
    """``asyncckpt clean``'s dry run says "would remove" for exactly the directories that
    ``--yes`` then removes: never for a manifest-less ``step_N``, a foreign name, or a
    committed checkpoint."""
    root = tmp_path / "root"
    with asyncckpt.CheckpointManager(root, persistent=False) as mgr:
        mgr.save(10, state(10), async_op=False)
    (root / ".step_00000030.tmp-0123abcd").mkdir()
    (root / ".step_00000030.tmp-0123abcd" / "__0_0.distcp").write_bytes(b"x" * 100)
    (root / ".step_00000005.deleting-a1b2c3").mkdir()
    (root / "step_00000040").mkdir()  # no manifest: not asyncckpt's
    (root / "step_6").mkdir()  # a foreign name
    asyncckpt.save(state(-1), root / "step_000000011", async_op=False)  # committed, foreign name

    dry = run_json("clean", root)
    would = {a["name"] for a in dry["partial"] if a["result"] == "would remove"}
    assert dry["dry_run"] and dry["removed"] == []
    assert would == {".step_00000030.tmp-0123abcd", ".step_00000005.deleting-a1b2c3"}, dry
    text = run("clean", root)
    assert text.returncode == 0, text.stderr
    assert {line.split()[0] for line in text.stdout.splitlines() if "would remove" in line} == would, text.stdout
    assert "remove these 2 directories" in text.stdout, text.stdout

    done = run_json("clean", "--yes", root)
    assert not done["dry_run"] and set(done["removed"]) == would, done
    left = {p.name for p in root.iterdir() if not p.name.startswith(".asyncckpt.")}  # the lock files stay
    assert left == {"latest", "step_00000010", "step_00000040", "step_6", "step_000000011"}, left
    asyncckpt.verify(root / "step_00000010")
    asyncckpt.verify(root / "step_000000011")


# ----------------------------------------------------------------------------- issue 34 item 8
def test_clean_yes_refuses_a_root_in_use_unless_force(tmp_path: Path) -> None:
    """``clean --yes`` while a manager holds the root: refused, naming the holder (a
    temporary directory may be its save in flight); the dry run warns; ``--force``
    removes; once the manager is closed ``--yes`` works."""
    root = tmp_path / "root"
    doomed = root / ".step_00000030.tmp-0123abcd"
    with asyncckpt.CheckpointManager(root, persistent=False) as mgr:
        mgr.save(1, state(1), async_op=False)
        doomed.mkdir()
        refused = run("clean", "--yes", root)
        assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
        assert f"process {os.getpid()}" in refused.stderr and "--force" in refused.stderr, refused.stderr
        assert doomed.is_dir()
        dry = run("clean", root)
        assert dry.returncode == 0 and f"process {os.getpid()}" in dry.stderr, dry.stderr
        assert run_json("clean", root)["in_use_by"] is not None
        forced = run_json("clean", "--force", root)
        assert forced["removed"] == [doomed.name] and not doomed.exists()
        doomed.mkdir()
    done = run_json("clean", "--yes", root)
    assert done["removed"] == [doomed.name] and done["in_use_by"] is None
    assert asyncckpt.CheckpointManager(root, read_only=True).steps() == [1]


# ----------------------------------------------------------------------------- item 3
def test_a_fifo_as_the_lock_or_owner_file_never_blocks(tmp_path: Path) -> None:
    """A FIFO at ``.asyncckpt.manager.lock``: the constructor (and ``clean --yes``) refuse
    it at once with a clear ``CheckpointPathError``; a FIFO at ``.asyncckpt.manager.owner``
    while the root is held: ``RootInUseError`` at once (holder unknown)."""
    root = tmp_path / "root"
    root.mkdir()
    os.mkfifo(root / ".asyncckpt.manager.lock")
    for _ in range(2):
        with pytest.raises(CheckpointPathError, match="not a regular file") as info:
            asyncckpt.CheckpointManager(root, persistent=False)
        assert not isinstance(info.value, RootInUseError)
    proc = run("clean", "--yes", root)
    assert proc.returncode == 1 and "not a regular file" in proc.stderr, proc.stderr
    proc = run("clean", root)  # the dry run lists, and warns
    assert proc.returncode == 0 and "not a regular file" in proc.stderr, proc.stderr
    os.unlink(root / ".asyncckpt.manager.lock")

    with asyncckpt.CheckpointManager(root, persistent=False):
        os.unlink(root / ".asyncckpt.manager.owner")
        os.mkfifo(root / ".asyncckpt.manager.owner")
        with pytest.raises(RootInUseError, match="holder unknown"):
            asyncckpt.CheckpointManager(root, persistent=False)
    assert not lock_fds(root)


# ----------------------------------------------------------------------------- item 5
_READ_ONLY_MOUNT = r"""
import errno, os, subprocess, sys
import torch
import asyncckpt

mnt = sys.argv[1]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", mnt], check=True)
try:
    root, empty = os.path.join(mnt, "root"), os.path.join(mnt, "empty")
    with asyncckpt.CheckpointManager(root, persistent=False) as mgr:
        mgr.save(1, {"w": torch.ones(4)}, async_op=False)
    os.mkdir(empty)
    subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
    for path in (root, empty):  # with and without a lock file from an earlier manager
        for attempt in range(2):  # a retry gets the same error, never RootInUseError
            try:
                asyncckpt.CheckpointManager(path, persistent=False)
            except asyncckpt.CheckpointPathError as exc:
                assert exc.errno == errno.EROFS, (path, exc)
            else:
                raise AssertionError(f"a writing manager was constructed on the read-only {path}")
        fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}")]
        assert not [t for t in fds if t.startswith(mnt)], fds
    reader = asyncckpt.CheckpointManager(root, read_only=True)
    got = {"w": torch.zeros(4)}
    assert reader.load(got) == 1 and torch.equal(got["w"], torch.ones(4))
    reader.close()
    subprocess.run(["mount", "-o", "remount,rw", mnt], check=True)
    with asyncckpt.CheckpointManager(root, persistent=False) as mgr:  # not RootInUseError
        mgr.save(2, {"w": torch.ones(4)}, async_op=False)
        assert mgr.steps() == [1, 2]
    print("OK")
finally:
    subprocess.run(["umount", "-l", mnt])
"""

_NO_WRITE_PERMISSION = r"""
import errno, os, sys
import torch
import asyncckpt

root = sys.argv[1]
for attempt in range(2):  # a retry gets the same error, never RootInUseError
    try:
        asyncckpt.CheckpointManager(root, persistent=False)
    except asyncckpt.CheckpointPathError as exc:
        assert isinstance(exc, PermissionError) and exc.errno == errno.EACCES, exc
    else:
        raise AssertionError("a writing manager was constructed on a root without write permission")
fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
       if os.path.exists(f"/proc/self/fd/{fd}")]
assert not [t for t in fds if t.startswith(root)], fds
os.chmod(root, 0o755)
with asyncckpt.CheckpointManager(root, persistent=False) as mgr:  # not RootInUseError
    mgr.save(2, {"w": torch.ones(4)}, async_op=False)
    assert mgr.steps() == [1, 2]
print("OK")
"""


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ASYNCCKPT_FAULT"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(asyncckpt.__file__).parents[1]), env.get("PYTHONPATH", "")])
    return env


def test_a_writing_manager_on_a_read_only_mount_raises_at_construction(tmp_path: Path) -> None:
    """A root on a read-only mount (a tmpfs remounted ``ro`` in a private mount
    namespace): ``CheckpointPathError`` with ``EROFS`` at construction, also when the
    lock file exists; no descriptor of the root left open; a retry gets the same error,
    a reader still loads, and after ``remount,rw`` a manager saves (no ``RootInUseError``)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a private mount namespace")
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"unshare -m is not allowed here: {probe.stderr.decode().strip()}")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", sys.executable, "-c", _READ_ONLY_MOUNT, str(mnt)],
        capture_output=True,
        text=True,
        timeout=180,
        env=_child_env(),
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (proc.stdout, proc.stderr)


def test_a_writing_manager_on_a_root_without_write_permission_raises_at_construction(tmp_path: Path) -> None:
    """``chmod 0555`` on a root that a manager used before (its lock file exists): a
    ``CheckpointPathError`` that is a ``PermissionError`` (``EACCES``) at construction,
    not a warning and a failed first save. As root (tests run as root here) the child
    drops ``CAP_DAC_OVERRIDE`` with ``setpriv``, so that the mode bits apply."""
    root = tmp_path / "root"
    with asyncckpt.CheckpointManager(root, persistent=False) as mgr:
        mgr.save(1, state(1), async_op=False)
    prefix: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv(1): the mode bits would not apply")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]
    os.chmod(root, 0o555)
    try:
        proc = subprocess.run(
            [*prefix, sys.executable, "-c", _NO_WRITE_PERMISSION, str(root)],
            capture_output=True,
            text=True,
            timeout=180,
            env=_child_env(),
        )
    finally:
        os.chmod(root, 0o755)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (proc.stdout, proc.stderr)


# ----------------------------------------------------------------------------- item 6
def test_a_constructor_that_raises_checks_before_locking_and_leaves_the_root_free(tmp_path: Path) -> None:
    """A refused argument (``start_method="fork"``, a bad ``keep_last``, a non-callable
    ``callback``) raises before the root is created or locked; a corrected retry inside
    the ``except`` block, while the traceback (and the failed object) lives, gets the
    root."""
    root = tmp_path / "root"
    for bad in ({"start_method": "fork"}, {"keep_last": 0}, {"callback": "not callable"}):
        try:
            asyncckpt.CheckpointManager(root, **bad)
        except ValueError:
            assert not root.exists(), bad  # checked before anything was created
            with asyncckpt.CheckpointManager(root, persistent=False) as mgr:  # not RootInUseError
                mgr.save(1, state(1), async_op=False)
        else:
            raise AssertionError(f"{bad} was accepted")
        shutil.rmtree(root)
    assert not lock_fds(tmp_path)


# ----------------------------------------------------------------------------- item 7
def test_a_regular_file_is_not_a_checkpoint_directory_everywhere(tmp_path: Path) -> None:
    """``load``, ``verify`` and ``read_state_dict`` of a ``torch.save`` file raise the
    same error: ``CheckpointPathError`` that is a ``NotADirectoryError`` (``ENOTDIR``),
    never ``CheckpointNotFoundError`` (which readers retry on) nor "corrupt"."""
    path = tmp_path / "model.pt"
    torch.save(state(1), path)
    calls = {
        "load": lambda: asyncckpt.load(state(0), path),
        "verify": lambda: asyncckpt.verify(path),
        "read_state_dict": lambda: asyncckpt.read_state_dict(path),
    }
    for name, call in calls.items():
        with pytest.raises(CheckpointPathError) as info:
            call()
        exc = info.value
        assert isinstance(exc, NotADirectoryError) and exc.errno == errno.ENOTDIR, (name, exc)
        assert not isinstance(exc, FileNotFoundError), name
        assert "not a checkpoint directory" in str(exc) and str(path) in str(exc), (name, exc)


# ----------------------------------------------------------------------------- item 8
def test_verify_root_skips_a_step_removed_by_retention_during_the_check(tmp_path: Path) -> None:
    """``asyncckpt verify ROOT`` lists steps 1 and 2; before it checks them, the job's
    retention (``keep_last=2``, a save of step 3) removes step 1. Step 1 is reported as
    removed, not damaged; step 2 verifies; exit status 0 (text and ``--json``)."""
    root = tmp_path / "root"
    reached_text, reached_json, go = tmp_path / "reached_text", tmp_path / "reached_json", tmp_path / "go"
    procs: list[subprocess.Popen] = []
    with asyncckpt.CheckpointManager(root, keep_last=2, persistent=False) as mgr:
        for step in (1, 2):
            mgr.save(step, state(step), async_op=False)
        try:
            for reached, extra in ((reached_text, []), (reached_json, ["--json"])):
                env = {k: v for k, v in os.environ.items() if k != "ASYNCCKPT_FAULT"}
                env["ASYNCCKPT_FAULT"] = f"verify_scanned:touch={reached};verify_scanned:wait={go}"
                procs.append(
                    subprocess.Popen(
                        [*CMD, "verify", str(root), *extra],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                        env=env,
                    )
                )
            deadline = time.monotonic() + CMD_TIMEOUT
            while not (reached_text.exists() and reached_json.exists()):
                assert time.monotonic() < deadline, "asyncckpt verify never reached its check"
                assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
                time.sleep(0.02)
            mgr.save(3, state(3), async_op=False)  # retention removes step 1
            mgr.close()
            assert not (root / "step_00000001").exists() and mgr.steps() == [2, 3]
            go.touch()
            (text_out, text_err), (json_out, json_err) = (p.communicate(timeout=CMD_TIMEOUT) for p in procs)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
    assert procs[0].returncode == 0, (text_out, text_err)
    assert any(line.startswith("REMOVED") and "step_00000001" in line for line in text_out.splitlines()), text_out
    assert any(line.startswith("OK") and "step_00000002" in line for line in text_out.splitlines()), text_out
    assert "FAILED" not in text_out
    assert procs[1].returncode == 0, (json_out, json_err)
    doc = json.loads(json_out)
    assert doc["ok"] and doc["failed"] == 0 and doc["removed"] == 1 and doc["checked"] == 1, doc
    assert [(Path(r["path"]).name, r["removed"], r["ok"]) for r in doc["results"]] == [
        ("step_00000001", True, False),
        ("step_00000002", False, True),
    ]


# ----------------------------------------------------------------------------- item 12
def test_a_read_only_manager_of_a_missing_root_creates_nothing(tmp_path: Path) -> None:
    """``CheckpointManager(typo, read_only=True)``: ``CheckpointNotFoundError`` and no
    directory created; a regular file as the root: ``NotADirectoryError``."""
    typo = tmp_path / "ckpts_typo" / "run1"
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint root"):
        asyncckpt.CheckpointManager(typo, read_only=True)
    assert not (tmp_path / "ckpts_typo").exists()
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(CheckpointPathError) as info:
        asyncckpt.CheckpointManager(tmp_path / "file", read_only=True)
    assert isinstance(info.value, NotADirectoryError)


# ----------------------------------------------------------------------------- item 13
def test_a_callback_that_is_not_callable_is_refused_at_the_call(tmp_path: Path) -> None:
    """``callback=`` not callable: ``InvalidArgumentError`` from ``manager.save``,
    ``asyncckpt.save`` and the constructor, before anything is staged or created."""
    root = tmp_path / "root"
    with pytest.raises(InvalidArgumentError, match="callback must be callable"):
        asyncckpt.CheckpointManager(root, callback=42)  # type: ignore[arg-type]
    assert not root.exists()
    with asyncckpt.CheckpointManager(root, persistent=False) as mgr:
        for bad in (42, "print", mgr.steps()):
            with pytest.raises(InvalidArgumentError, match="callback must be callable"):
                mgr.save(1, state(1), callback=bad)  # type: ignore[arg-type]
        assert not testing.staging_buffers(mgr) and not [p for p in root.iterdir() if "step" in p.name]
        mgr.save(1, state(1), async_op=False)  # the manager goes on
        assert mgr.steps() == [1]
    target = tmp_path / "one"
    with pytest.raises(InvalidArgumentError, match="callback must be callable"):
        asyncckpt.save(state(1), target, callback=object())  # type: ignore[arg-type]
    assert not target.exists()
