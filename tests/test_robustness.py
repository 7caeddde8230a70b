"""Real-world robustness: Ctrl-C at named moments, os.fork() during a save, a
synchronous save behind pending ones, a load of a key the checkpoint lacks.

Signals and forks run in a subprocess of their own (a real SIGINT to a real training
script; a real ``os.fork()`` whose child exits through the interpreter's normal exit
path), which prints one JSON line of what it saw; the assertions run here.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt import CheckpointError, CheckpointManager
from asyncckpt.testing import staging_buffers

from helpers import finish_session

_PRELUDE = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    import torch
    import asyncckpt
    root = sys.argv[1]
    state = {"w": torch.ones(1 << 20), "step": 0}
    # Ctrl-C as in a terminal, also when the test run was started in the background
    # (a shell's "cmd &" starts it with SIGINT ignored, and children inherit that).
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def interrupt_in(seconds):
        threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT)).start()

    def leftovers():
        return sorted(e for e in os.listdir(root) if ".tmp-" in e)

    def worker_with_fault(spec):
        os.environ["ASYNCCKPT_FAULT"] = spec   # the worker inherits it at its start
        try:
            return asyncckpt.CheckpointManager(root)
        finally:
            os.environ.pop("ASYNCCKPT_FAULT")
""")


def run_script(body: str, root: Path, timeout: float = 90) -> dict[str, Any]:
    """Run the prelude + ``body`` in a new Python process; return its JSON line."""
    script = root.parent / "script.py"
    script.write_text(_PRELUDE + textwrap.dedent(body))
    root.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    rc, out, err = finish_session(proc, timeout)
    assert rc == 0, f"exit {rc}\n{out}\n{err}"
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.timeout(120)
def test_ctrl_c_during_staging_drops_that_save_only(tmp_path: Path) -> None:
    """Row 1: SIGINT while save() copies the state; the user catches it and trains on."""
    out = run_script(
        """
        mgr = asyncckpt.CheckpointManager(root)
        mgr.save(1, state).wait(timeout=30)
        os.environ["ASYNCCKPT_FAULT"] = "stage:sleep=5"   # the staging copy, in this process
        interrupt_in(0.5)
        t = time.monotonic()
        try:
            mgr.save(2, state)
            out = {"interrupted": False}
        except KeyboardInterrupt:
            out = {"interrupted": True, "after_s": time.monotonic() - t}
        os.environ.pop("ASYNCCKPT_FAULT")
        mgr.save(3, state).wait(timeout=30)
        try:
            mgr.maybe_finalize(blocking=True)
        except asyncckpt.CheckpointException as exc:
            out["reported"] = [str(exc.failures[0]).splitlines()[0], exc.failures[0].exc_type]
        t = time.monotonic()
        mgr.close()
        out.update(close_s=time.monotonic() - t, steps=mgr.steps(), leftovers=leftovers())
        print(json.dumps(out))
    """,
        tmp_path / "root",
    )
    assert out["interrupted"] and out["after_s"] < 3, out
    assert out["steps"] == [1, 3] and out["leftovers"] == [], out
    assert out["reported"] == ["preload_fn raised KeyboardInterrupt: ", "KeyboardInterrupt"], out
    assert out["close_s"] < 5, out


@pytest.mark.timeout(120)
def test_ctrl_c_during_close_aborts_within_a_second(tmp_path: Path) -> None:
    """Row 2: SIGINT during close() while a write of 8 s runs."""
    out = run_script(
        """
        mgr = worker_with_fault("mid_write:sleep=8")
        pid = mgr.queue.caller.worker_pid
        mgr.save(1, state)
        time.sleep(0.5)
        interrupt_in(0.5)
        t = time.monotonic()
        try:
            mgr.close()
            out = {"interrupted": False}
        except KeyboardInterrupt:
            out = {"interrupted": True}
        out["after_s"] = time.monotonic() - t
        try:
            os.kill(pid, 0)
            out["worker_alive"] = True
        except ProcessLookupError:
            out["worker_alive"] = False
        out.update(steps=mgr.steps(), leftovers=leftovers())
        print(json.dumps(out))
    """,
        tmp_path / "root",
    )
    assert out["interrupted"] and out["after_s"] < 2.5, out
    assert not out["worker_alive"] and out["steps"] == [] and out["leftovers"] == [], out


@pytest.mark.timeout(120)
def test_ctrl_c_while_the_commit_runs_settles_the_handle(tmp_path: Path) -> None:
    """Row 3: SIGINT during maybe_finalize(blocking=True) while the commit runs: the
    commit runs in the finalizer thread and completes; the handle settles."""
    out = run_script(
        """
        mgr = asyncckpt.CheckpointManager(root)
        os.environ["ASYNCCKPT_FAULT"] = "commit:sleep=2"   # the coordinator's commit, in this process
        handle = mgr.save(1, state)
        interrupt_in(0.5)
        try:
            mgr.maybe_finalize(blocking=True)
            out = {"interrupted": False}
        except KeyboardInterrupt:
            out = {"interrupted": True, "done_then": handle.done()}
        handle.wait(timeout=30)
        os.environ.pop("ASYNCCKPT_FAULT")
        out.update(done=handle.done(), steps=mgr.steps(), leftovers=leftovers())
        mgr.close()
        print(json.dumps(out))
    """,
        tmp_path / "root",
    )
    assert out["interrupted"] and not out["done_then"], out
    assert out["done"] and out["steps"] == [1] and out["leftovers"] == [], out


@pytest.mark.timeout(120)
def test_fork_during_a_save_leaves_the_parent_unaffected(tmp_path: Path) -> None:
    """Row 4: user code forks while a save is written; the child exits normally (its
    exit hooks and garbage collection run): the parent's save still commits."""
    out = run_script(
        """
        mgr = worker_with_fault("mid_write:sleep=2")
        handle = mgr.save(1, state)
        time.sleep(0.5)
        child = os.fork()
        if child == 0:
            del handle, mgr
            sys.exit(0)   # the interpreter's normal exit path in the child
        _, status = os.waitpid(child, 0)
        out = {"child_status": status}
        try:
            handle.wait(timeout=30)
            out["committed"] = True
        except asyncckpt.CheckpointException as exc:
            out["committed"] = str(exc)
        mgr.save(2, state).wait(timeout=30)
        mgr.close()
        out.update(steps=mgr.steps(), leftovers=leftovers())
        print(json.dumps(out))
    """,
        tmp_path / "root",
    )
    assert out["child_status"] == 0 and out["committed"] is True, out
    assert out["steps"] == [1, 2] and out["leftovers"] == [], out


@pytest.mark.timeout(60)
def test_sync_save_behind_pending_saves_keeps_latest_monotonic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Row 9: a synchronous save while an asynchronous one is pending commits after it."""
    monkeypatch.setenv("ASYNCCKPT_FAULT", "mid_write:sleep=1")
    mgr = CheckpointManager(tmp_path / "root")
    monkeypatch.delenv("ASYNCCKPT_FAULT")
    try:
        pending = mgr.save(1, {"w": torch.ones(1000)})
        mgr.save(2, {"w": torch.ones(1000)}, async_op=False)
        assert pending.done()
        assert (tmp_path / "root" / "latest").read_text().strip() == "step_00000002"
        assert mgr.steps() == [1, 2]
    finally:
        mgr.close()


@pytest.mark.timeout(90)
def test_rollback_resumes_from_the_newest_save_and_retention_keeps_it(tmp_path: Path) -> None:
    """Row 8: keep_last=2, steps 10 and 20 saved, load(10), save 11, 12, 13: the newest
    save wins, in this manager and in a new one (a restarted run)."""
    root = tmp_path / "root"
    with CheckpointManager(root, keep_last=2) as mgr:
        for step in (10, 20):
            mgr.save(step, {"w": torch.full((64,), float(step))}, async_op=False)
        state = {"w": torch.zeros(64)}
        assert mgr.load(state, 10) == 10 and state["w"][0] == 10
        for step in (11, 12, 13):
            mgr.save(step, {"w": torch.full((64,), float(step))})
            if step == 11:
                mgr.maybe_finalize(blocking=True)
                # 10 was the oldest save: removed; 20 is one of the two newest saves
                assert mgr.steps() == [11, 20], mgr.steps()
                assert mgr.latest_step() == 11
        mgr.maybe_finalize(blocking=True)
        assert mgr.steps() == [12, 13]
        assert mgr.latest_step() == 13
    assert (root / "latest").read_text().strip() == "step_00000013"
    with CheckpointManager(root, keep_last=2) as again:
        state = {"w": torch.zeros(64)}
        assert again.latest_step() == 13 and again.load(state) == 13
        assert torch.equal(state["w"], torch.full((64,), 13.0))
        again.save(14, {"w": torch.full((64,), 14.0)}, async_op=False)
        assert again.steps() == [13, 14] and again.latest_step() == 14


def test_checkpoints_without_a_commit_sequence_order_by_step_before_the_others(tmp_path: Path) -> None:
    """Row 8, upgrade: steps committed by a version that recorded no commit sequence are
    older than any that did, among themselves ordered by step."""
    root = tmp_path / "root"
    with CheckpointManager(root) as mgr:
        for step in (5, 30, 7):
            mgr.save(step, {"w": torch.ones(4)}, async_op=False)
    for step in (5, 30):  # as an older asyncckpt wrote them
        manifest = root / f"step_{step:08d}" / ".manifest.json"
        data = json.loads(manifest.read_text())
        del data["commit_seq"]
        manifest.write_text(json.dumps(data))
    with CheckpointManager(root) as mgr:
        assert mgr.latest_step() == 7
        mgr.save(6, {"w": torch.ones(4)}, async_op=False)
        assert mgr.latest_step() == 6
        assert json.loads((root / "step_00000006" / ".manifest.json").read_text())["commit_seq"] == 4  # after 7's 3


@pytest.mark.timeout(90)
def test_inodes_running_out_after_the_commit_point_is_a_warning_on_a_committed_save(tmp_path: Path) -> None:
    """Row 6: a real tmpfs without a free inode for the new ``latest`` file, after the
    checkpoint's rename: the save is committed, reported so with a RuntimeWarning,
    and resumed from; never a failed save that is committed anyway."""
    from helpers import small_tmpfs

    root = tmp_path / "mnt"
    with small_tmpfs(root, size="64m", nr_inodes=64) as mounted:
        if not mounted:
            pytest.skip("mounting a tmpfs needs root")
        mgr = CheckpointManager(root)
        try:
            mgr.save(1, {"w": torch.ones(1000)}, async_op=False)
            free_before = os.statvfs(root).f_ffree
            mgr.save(2, {"w": torch.full((1000,), 2.0)}, async_op=False)
            per_checkpoint = free_before - os.statvfs(root).f_ffree  # its directory and files
            fillers = root / "fill"
            fillers.mkdir()
            n = 0
            while os.statvfs(root).f_ffree > per_checkpoint:
                (fillers / str(n)).touch()
                n += 1
            # exactly enough inodes for step 3's directory and files, none for `latest`'s new file
            with pytest.warns(
                RuntimeWarning,
                match="step_00000003 is committed, but `latest` could not be updated.*No space left on device",
            ):
                handle = mgr.save(3, {"w": torch.full((1000,), 3.0)})
                assert handle.wait().bytes > 0 and handle.exception() is None  # a success
            assert os.statvfs(root).f_ffree == 0
            assert mgr.steps() == [1, 2, 3] and mgr.latest_step() == 3
            assert (root / "latest").read_text().strip() == "step_00000002"  # lags, never leads
            asyncckpt.verify(root / "step_00000003")
            state = {"w": torch.zeros(1000)}
            assert mgr.load(state) == 3 and torch.equal(state["w"], torch.full((1000,), 3.0))
            shutil.rmtree(fillers)
            mgr.save(4, {"w": torch.ones(1000)}, async_op=False)
            assert (root / "latest").read_text().strip() == "step_00000004"
        finally:
            mgr.close()


def test_load_of_a_key_the_checkpoint_lacks_is_an_ordinary_error(tmp_path: Path) -> None:
    """Row 13: DCP's CheckpointException (a BaseException) never escapes."""
    asyncckpt.save({"a": torch.ones(3)}, tmp_path / "ck")
    with pytest.raises(CheckpointError, match="Missing key in checkpoint state_dict: b"):
        asyncckpt.load({"a": torch.zeros(3), "b": torch.zeros(2)}, tmp_path / "ck")


def _staging_bytes_held(pid: int, slab_ids: tuple[str, ...]) -> int:
    """Bytes of the staging memfds ``slab_ids`` that process ``pid`` holds open (their sizes)."""
    names = tuple(f"/memfd:asyncckpt-{slab_id[:8]}" for slab_id in slab_ids)
    sizes: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        try:
            target = os.readlink(path)
            if target.startswith(names):
                sizes[target] = os.stat(path).st_size
        except OSError:
            pass
    return sum(sizes.values())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("freed_by", ["close", "a-larger-state"])
def test_fork_started_dataloader_workers_do_not_keep_staging_memory(tmp_path: Path, freed_by: str) -> None:
    """Row 5: DataLoader(num_workers=2, persistent_workers=True) forked after the first
    save inherits the staging buffer; manager.close() still frees its memory, and so
    does a save of a larger state, which needs a larger buffer in its place."""
    import psutil
    from torch.utils.data import DataLoader, TensorDataset

    mgr = CheckpointManager(tmp_path / "root")
    mgr.save(1, {"w": torch.ones(4 << 20)}).wait(timeout=30)  # a 16 MiB staging buffer
    loader = DataLoader(
        TensorDataset(torch.arange(64)),
        batch_size=8,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="fork",
    )
    me = psutil.Process()
    children = {p.pid for p in me.children()}
    batches = iter(loader)
    pids: list[int] = []
    try:
        next(batches)  # the workers are forked now
        pids = sorted(p.pid for p in me.children() if p.pid not in children)
        ids = tuple(b.slab_id for b in staging_buffers(mgr))
        assert len(pids) == 2 and len(ids) == 1
        assert all(_staging_bytes_held(pid, ids) >= 16 << 20 for pid in pids)  # they did inherit it
        if freed_by == "close":
            mgr.close()
        else:
            mgr.save(2, {"w": torch.ones(8 << 20)}).wait(timeout=30)
            assert not set(ids) & {b.slab_id for b in staging_buffers(mgr)}  # the pool replaced it
        assert [_staging_bytes_held(pid, ids) for pid in pids] == [0, 0]
        assert _staging_bytes_held(os.getpid(), ids) == 0
        assert len(list(batches)) == 7  # the loader itself is unaffected
    finally:
        mgr.close(abort=True)
        workers = []
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                workers.append(psutil.Process(pid))
        del batches, loader  # the last references to the iterator (persistent workers): it stops them
        gc.collect()
        for p in psutil.wait_procs(workers, timeout=10)[1]:  # still alive: killed
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


@pytest.mark.timeout(90)
def test_load_racing_retention_raises_not_found(tmp_path: Path) -> None:
    """Row 14: retention removes a step while another reader loads it: the reader gets a
    FileNotFoundError (CheckpointNotFoundError) it can retry, never a corruption error."""
    import threading

    from asyncckpt import CheckpointNotFoundError, CorruptCheckpointError

    root = tmp_path / "root"
    writer = CheckpointManager(root, keep_last=1)
    state = {f"t{i}": torch.full((2048,), float(i)) for i in range(64)}
    writer.save(0, state).wait(timeout=30)
    stop = threading.Event()

    def train() -> None:
        step = 1
        while not stop.is_set():
            writer.save(step, state).wait(timeout=30)
            step += 1

    trainer = threading.Thread(target=train)
    trainer.start()
    outcomes = {"loaded": 0, "not_found": 0}
    try:
        reader = CheckpointManager(root, persistent=False, read_only=True)  # a second job: no lock
        target = {k: torch.empty_like(v) for k, v in state.items()}
        for _ in range(150):
            steps = reader.steps()
            try:
                reader.load(target, steps[-1] if steps else None)
                outcomes["loaded"] += 1
            except CheckpointNotFoundError as exc:
                assert isinstance(exc, FileNotFoundError) and not isinstance(exc, CorruptCheckpointError)
                outcomes["not_found"] += 1
        reader.close()
    finally:
        stop.set()
        trainer.join()
        writer.close()
    print("retention race:", outcomes)
    assert outcomes["loaded"] > 0, outcomes
    with pytest.raises(FileNotFoundError, match="does not exist, or was removed"):
        asyncckpt.load(target, root / "step_99999999")


@pytest.mark.timeout(120)
def test_overlapped_staging_never_commits_a_torn_batchnorm(tmp_path: Path) -> None:
    """Row 18: BatchNorm's running stats change in the next forward, before
    synchronize_staging(), while large tensors earlier in the state are still being
    copied: the checkpoint holds the values as of save()."""
    torch.manual_seed(0)
    big = {f"big{i}": torch.randn(16 << 20) for i in range(4)}  # 4 x 64 MiB first: the copy is still running
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    with CheckpointManager(tmp_path / "root", overlap_staging=True) as mgr:
        for step in range(3):
            state = {**big, "model": model.state_dict()}
            expected = {k: v.clone() for k, v in model.state_dict().items()}
            mgr.save(step, state)
            model(torch.randn(32, 8))  # the next forward updates the running stats in place
            mgr.synchronize_staging()
            mgr.maybe_finalize(blocking=True)
            out = {k: torch.empty_like(v) for k, v in expected.items()}
            mgr.load({"model": out}, step)
            for k in expected:
                assert torch.equal(out[k], expected[k]), (step, k)


@pytest.mark.timeout(120)
def test_overlapped_staging_refuses_a_large_tensor_changed_during_its_copy(tmp_path: Path) -> None:
    """Row 18: a large tensor changed in place before synchronize_staging() fails the
    save, naming the key; nothing torn is committed; the next save commits."""
    state = {"weights": torch.zeros(8 << 20), "bias": torch.zeros(10)}
    with CheckpointManager(tmp_path / "root", overlap_staging=True) as mgr:
        mgr.save(1, state)
        state["weights"].add_(1.0)  # in place, while (or before) the thread copies it
        mgr.synchronize_staging()
        with pytest.raises(asyncckpt.CheckpointException, match="'weights' changed in place"):
            mgr.maybe_finalize(blocking=True)
        assert mgr.steps() == [] and not any(".tmp-" in e for e in os.listdir(tmp_path / "root"))
        mgr.save(2, state)
        mgr.synchronize_staging()
        assert mgr.maybe_finalize(blocking=True) == [2]


@pytest.mark.timeout(60)
def test_load_waits_for_an_overlapped_staging_copy(tmp_path: Path) -> None:
    """Row 10: manager.load into the same tensors before synchronize_staging() waits for
    the copy: the checkpoint holds the values as of save()."""
    state = {"w": torch.arange(8 << 20, dtype=torch.float32)}
    expected = state["w"].clone()
    with CheckpointManager(tmp_path / "root", overlap_staging=True) as mgr:
        mgr.save(1, {"w": torch.full((8 << 20,), -1.0)}, async_op=False)
        mgr.save(2, state)
        mgr.load(state, 1)  # overwrites the tensors the overlapped save copies
        mgr.maybe_finalize(blocking=True)
        out = {"w": torch.empty(8 << 20)}
        mgr.load(out, 2)
        assert torch.equal(out["w"], expected)


class _Counter:
    """A ``Stateful`` object (``state_dict()`` / ``load_state_dict()``), not picklable."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.lock = __import__("threading").Lock()  # makes pickling it fail

    def state_dict(self) -> dict[str, Any]:
        return {"n": torch.tensor(self.n)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = int(sd["n"])


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_stateful_objects_use_the_protocol_on_both_sides(tmp_path: Path, async_op: bool) -> None:
    """Row 17: save calls state_dict(), load calls load_state_dict(), as DCP does."""
    import torch.distributed.checkpoint as dcp

    try:
        handle = asyncckpt.save({"counter": _Counter(7), "w": torch.ones(3)}, tmp_path / "ck", async_op=async_op)
        handle.wait(timeout=30)
    finally:
        asyncckpt.default_calls_queue().close()  # stops the worker of the async save
    restored = _Counter(0)
    asyncckpt.load({"counter": restored, "w": torch.zeros(3)}, tmp_path / "ck")
    assert restored.n == 7
    stock = _Counter(0)
    dcp.load({"counter": stock}, checkpoint_id=str(tmp_path / "ck"))
    assert stock.n == 7


@pytest.mark.timeout(120)
def test_pending_saves_commit_at_interpreter_exit(tmp_path: Path) -> None:
    """Row 11: three asyncckpt.save(..., async_op=True) whose handles are dropped, then a
    normal exit: all three are committed."""
    out = run_script(
        """
        for i in range(3):
            asyncckpt.save(state, os.path.join(root, f"ck{i}"), async_op=True)
        print(json.dumps({}))
    """,
        tmp_path / "root",
    )
    assert out == {}
    for i in range(3):
        asyncckpt.verify(tmp_path / "root" / f"ck{i}")


@pytest.mark.timeout(120)
def test_a_save_lost_at_exit_is_named(tmp_path: Path) -> None:
    """Row 11: a save that cannot commit within the exit bound is named on stderr; it
    leaves nothing that looks committed; the exit is bounded."""
    root = tmp_path / "root"
    root.mkdir()
    script = tmp_path / "script.py"
    script.write_text(
        _PRELUDE
        + textwrap.dedent("""
        os.environ["ASYNCCKPT_FAULT"] = "mid_write:sleep=30"   # the default queue's worker inherits it
        asyncckpt.save(state, os.path.join(root, "held"), async_op=True)
        time.sleep(0.5)
    """)
    )
    env = dict(os.environ, ASYNCCKPT_EXIT_TIMEOUT_S="1")
    import time

    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), str(root)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started < 20
    assert f"the save of {root / 'held'} was still pending at interpreter exit and is lost" in proc.stderr
    assert not (root / "held").exists()


@pytest.mark.timeout(60)
def test_a_forked_child_whose_exit_blocks_after_reporting_is_killed_and_its_save_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # persistent=False forks a child per save from this multi-threaded process; its exit
    # can block for ever on a lock another thread held at the fork. Once it reported its
    # outcome (written, fsynced), it gets ASYNCCKPT_CHILD_EXIT_GRACE_S to exit, then it is
    # killed and its outcome taken: the save commits, nothing waits for ever.
    import psutil

    monkeypatch.setenv("ASYNCCKPT_FAULT", "child_exit:sleep=600")  # read by the child, after it reported
    monkeypatch.setenv("ASYNCCKPT_CHILD_EXIT_GRACE_S", "1")
    state: dict[str, Any] = {"w": torch.arange(1000, dtype=torch.float32), "step": 1}
    before = {c.pid for c in psutil.Process().children()}  # (the suite's own: a forkserver, ...)
    with caplog.at_level("WARNING", logger="asyncckpt"), CheckpointManager(tmp_path, persistent=False) as mgr:
        mgr.save(1, state).wait(timeout=30)
        assert mgr.latest_step() == 1
    assert any("has not exited" in r.getMessage() and "killed" in r.getMessage() for r in caplog.records)
    out: dict[str, Any] = {"w": torch.zeros(1000), "step": 0}
    asyncckpt.load(out, tmp_path / "step_00000001")
    assert torch.equal(out["w"], state["w"]) and out["step"] == 1
    left = [c for c in psutil.Process().children() if c.pid not in before and c.status() != psutil.STATUS_ZOMBIE]
    assert not left, left
