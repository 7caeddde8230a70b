"""A save's lifecycle at the edges: a manager dropped with saves in flight, a ``with``
block that ends in an exception, a step saved twice, Ctrl-C inside a synchronous save,
an exit without ``close()`` while retention removes an old checkpoint.

Signals and exits run in a child process of their own (a real SIGINT, a real
interpreter exit), which prints one JSON line of what it saw; the assertions run here.
Faults are injected through ``ASYNCCKPT_FAULT`` only.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import asyncckpt
from asyncckpt import CheckpointError, CheckpointException, CheckpointManager

from helpers import finish_session

CALLERS = ["persistent", "temporal"]

_PRELUDE = textwrap.dedent("""
    import json, os, signal, sys, time
    import torch
    import asyncckpt
    root = sys.argv[1]
    # Ctrl-C as in a terminal, also when the test run was started in the background.
    signal.signal(signal.SIGINT, signal.default_int_handler)
""")


def _start(tmp_path: Path, body: str, root: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    script = tmp_path / "script.py"
    script.write_text(_PRELUDE + textwrap.dedent(body))
    return subprocess.Popen(
        [sys.executable, str(script), str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**{k: v for k, v in os.environ.items() if k != "ASYNCCKPT_FAULT"}, **(env or {})},
    )


def _hidden(root: Path) -> list[str]:
    """The leftovers `asyncckpt ls` would list as partial (``.step_N.tmp-*``, ``.deleting-*``)."""
    return sorted(e for e in os.listdir(root) if e.startswith(".step_"))


def _ls_partial(root: Path) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "asyncckpt", "ls", str(root), "--json"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return [p["name"] for p in json.loads(proc.stdout)["partial"]]


def _wait_committed(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not asyncckpt.format.manifest.is_committed(path):
        assert time.monotonic() < deadline, f"{path} was not committed within {timeout} s"
        time.sleep(0.05)


def _loaded(path: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    asyncckpt.load(out, path)
    return out


# ------------------------------------------------------------------ a dropped manager (issue 24.2, 25.7)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("caller", CALLERS)
def test_a_dropped_managers_handle_settles_committed(
    tmp_path: Path, caller: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`h = CheckpointManager(root).save(1, sd); h.wait()`: the manager is collected at
    once; the save still commits and the handle settles (it used to block forever)."""
    monkeypatch.setenv("ASYNCCKPT_FAULT", "mid_write:sleep=1")  # the manager is gone long before the commit
    state = {"w": torch.randn(1 << 18)}
    handle = CheckpointManager(tmp_path / "root", persistent=caller == "persistent").save(1, state)
    gc.collect()
    timings = handle.wait(timeout=60)
    assert handle.done() and handle.exception() is None and timings.bytes > 0
    assert torch.equal(_loaded(tmp_path / "root" / "step_00000001", state)["w"], state["w"])
    assert _hidden(tmp_path / "root") == []


@pytest.mark.timeout(120)
def test_a_save_of_a_dropped_manager_commits_without_its_handle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A manager and the handle both dropped with the save in flight: it commits (nothing
    is "aborted"), and the worker is stopped afterwards (conftest's no_leaks)."""
    monkeypatch.setenv("ASYNCCKPT_FAULT", "mid_write:sleep=1")
    state = {"w": torch.randn(1 << 18)}
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        CheckpointManager(tmp_path / "root").save(7, state)
        gc.collect()
        _wait_committed(tmp_path / "root" / "step_00000007")
    assert torch.equal(_loaded(tmp_path / "root" / "step_00000007", state)["w"], state["w"])
    assert not [r for r in caplog.records if "abort" in r.getMessage()], caplog.text


@pytest.mark.timeout(120)
def test_a_dropped_managers_overlapped_save_is_handed_to_the_writer(tmp_path: Path) -> None:
    """Overlapped staging, the manager dropped before synchronize_staging(): the copy is
    finished and written; the handle settles committed."""
    state = {"w": torch.randn(4 << 20)}
    expected = state["w"].clone()
    handle = CheckpointManager(tmp_path / "root", overlap_staging=True).save(1, state)
    gc.collect()
    handle.wait(timeout=60)
    assert torch.equal(_loaded(tmp_path / "root" / "step_00000001", state)["w"], expected)


@pytest.mark.timeout(120)
def test_a_failed_save_of_a_dropped_manager_settles_and_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The write of a dropped manager's save fails: its handle settles with the failure
    (no hang) and a warning names the step and its path."""
    monkeypatch.setenv("ASYNCCKPT_FAULT", "mid_write:raise")
    root = tmp_path / "root"
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        handle = CheckpointManager(root).save(3, {"w": torch.randn(1 << 18)})
        gc.collect()
        with pytest.raises(CheckpointException, match="injected I/O error"):
            handle.wait(timeout=60)
        deadline = time.monotonic() + 30
        while "step 3" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)  # the warning comes from the thread that finishes the dropped manager
    assert f"the save of step 3 ({root / 'step_00000003'})" in caplog.text and "failed" in caplog.text
    assert not (root / "step_00000003").exists() and _hidden(root) == []


@pytest.mark.timeout(60)
def test_an_overlapped_save_dropped_by_abort_settles_failed(tmp_path: Path) -> None:
    """close(abort=True) before synchronize_staging(): the overlapped save is dropped and
    its handle fails at once, naming the step (it used to block wait() forever)."""
    manager = CheckpointManager(tmp_path / "root", overlap_staging=True)
    handle = manager.save(5, {"w": torch.randn(4 << 20)})
    manager.close(abort=True)
    with pytest.raises(CheckpointError, match="step 5"):
        handle.wait(timeout=10)
    assert handle.done() and not (tmp_path / "root" / "step_00000005").exists()


# ------------------------------------------------------------------ a crash inside `with` (issue 25.4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("caller", CALLERS)
def test_an_exception_in_the_with_block_keeps_the_staged_saves(
    tmp_path: Path, caller: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training loop that crashes inside `with CheckpointManager(...)`: every save
    staged before the crash commits; the user's exception is the one raised."""
    monkeypatch.setenv("ASYNCCKPT_FAULT", "mid_write:sleep=0.5")  # both still writing at the crash
    root = tmp_path / "root"
    states = {step: {"w": torch.full((1 << 18,), float(step))} for step in (1, 2)}
    with pytest.raises(ZeroDivisionError):
        with CheckpointManager(root, persistent=caller == "persistent", staging_buffers=2) as manager:
            for step, state in states.items():
                manager.save(step, state)
            raise ZeroDivisionError
    assert manager.steps() == [1, 2] and manager.latest_step() == 2
    for step, state in states.items():
        assert torch.equal(_loaded(manager.step_dir(step), state)["w"], state["w"])
    assert _hidden(root) == []


@pytest.mark.timeout(120)
def test_an_exception_in_the_with_block_names_a_save_it_must_drop(tmp_path: Path) -> None:
    """A save that cannot commit within the bound (ASYNCCKPT_EXIT_TIMEOUT_S) after the
    crash is named (step and path) on stderr and dropped; the exit from the block is
    bounded; the crash's own exception reaches the user (a real process)."""
    root = tmp_path / "root"
    proc = _start(
        tmp_path,
        """
        os.environ["ASYNCCKPT_FAULT"] = "mid_write:sleep=60"   # a temporal caller's child inherits it
        with asyncckpt.CheckpointManager(root + "/slow", persistent=False) as slow:
            slow.save(2, {"w": torch.ones(1 << 18)})
            started = time.monotonic()
            try:
                raise RuntimeError("the training loop crashed")
            finally:
                print(json.dumps({"started": started}), flush=True)
    """,
        root,
        env={"ASYNCCKPT_EXIT_TIMEOUT_S": "1"},
    )
    rc, _out, err = finish_session(proc)
    assert rc == 1 and "RuntimeError: the training loop crashed" in err, err
    assert (
        f"the save of step 2 ({root / 'slow' / 'step_00000002'}) was still pending when the "
        f"`with CheckpointManager` block of {root / 'slow'} ended with RuntimeError and is lost"
    ) in err, err
    assert not (root / "slow" / "step_00000002").exists() and _hidden(root / "slow") == []


@pytest.mark.timeout(60)
def test_ctrl_c_in_the_with_block_still_drops_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """KeyboardInterrupt keeps its documented behaviour: the pending saves are dropped at
    once (no wait for the write), nothing partial is left."""
    monkeypatch.setenv("ASYNCCKPT_FAULT", "mid_write:sleep=30")
    root = tmp_path / "root"
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with CheckpointManager(root, persistent=False) as manager:
            handle = manager.save(1, {"w": torch.ones(1 << 18)})
            raise KeyboardInterrupt
    assert time.monotonic() - started < 25, "Ctrl-C must not wait for the write"
    assert handle.done() and handle.exception() is not None
    assert manager.steps() == [] and _hidden(root) == []


@pytest.mark.timeout(120)
def test_sys_exit_in_the_with_block_keeps_the_staged_saves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`sys.exit()` inside the block is an ending like a crash, not an interrupt: the
    save staged before it commits, and the SystemExit goes on."""
    monkeypatch.setenv("ASYNCCKPT_FAULT", "mid_write:sleep=0.5")
    state = {"w": torch.full((1 << 18,), 3.0)}
    with pytest.raises(SystemExit) as exited:
        with CheckpointManager(tmp_path / "root") as manager:
            manager.save(3, state)
            sys.exit(4)
    assert exited.value.code == 4
    assert manager.steps() == [3] and torch.equal(_loaded(manager.step_dir(3), state)["w"], state["w"])


@pytest.mark.timeout(60)
def test_the_preemption_budget_ending_the_with_block_drops_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interrupt of a spent preemption budget (a SystemExit subclass) is treated as
    Ctrl-C, not as a crash: the block does not wait the crash bound for a write that
    cannot finish in time; nothing partial is left."""
    monkeypatch.setenv("ASYNCCKPT_FAULT", "mid_write:sleep=30")
    monkeypatch.setenv("ASYNCCKPT_EXIT_TIMEOUT_S", "20")
    root = tmp_path / "root"
    started = time.monotonic()
    with pytest.raises(asyncckpt.errors.PreemptionBudgetExpired):
        with CheckpointManager(root, persistent=False) as manager:
            handle = manager.save(1, {"w": torch.ones(1 << 18)})
            raise asyncckpt.errors.PreemptionBudgetExpired(143)
    assert time.monotonic() - started < 15, "the budget's interrupt must not wait for the crash bound"
    assert handle.done() and handle.exception() is not None
    assert manager.steps() == [] and _hidden(root) == []


@pytest.mark.timeout(120)
def test_a_dropped_managers_root_stays_locked_until_its_save_settles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manager dropped with a save in flight keeps its root locked while that save may
    still commit (another job must not take the root then), and lets it go afterwards."""
    monkeypatch.setenv("ASYNCCKPT_FAULT", "mid_write:sleep=2")
    root = tmp_path / "root"
    handle = CheckpointManager(root).save(1, {"w": torch.randn(1 << 18)})
    gc.collect()
    with pytest.raises(asyncckpt.RootInUseError):
        CheckpointManager(root)
    handle.wait(timeout=60)
    deadline = time.monotonic() + 30
    while True:  # released by the thread that finishes the dropped manager, after the settle
        try:
            successor = CheckpointManager(root)
            break
        except asyncckpt.RootInUseError:
            assert time.monotonic() < deadline, "the root stayed locked after the dropped manager's save settled"
            time.sleep(0.05)
    try:
        assert successor.steps() == [1]
    finally:
        successor.close()


# ------------------------------------------------------------------ one step saved twice (issue 25.8)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("caller", CALLERS)
def test_a_step_saved_again_while_pending_is_refused_at_once(
    tmp_path: Path, caller: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """save(10) while save(10) is pending: CheckpointError naming step 10 at once, before
    anything is staged; the first commits and close() raises nothing (it used to raise
    FileNotFoundError/FileExistsError after the first commit removed the second's files)."""
    monkeypatch.setenv("ASYNCCKPT_FAULT", "mid_write:sleep=1")
    root = tmp_path / "root"
    first = {"w": torch.full((1 << 18,), 1.0)}
    manager = CheckpointManager(root, persistent=caller == "persistent")
    try:
        handle = manager.save(10, first)
        with pytest.raises(CheckpointError, match=r"step 10 is already being saved") as info:
            manager.save(10, {"w": torch.full((1 << 18,), 2.0)})
        assert str(root / "step_00000010") in str(info.value)
        handle.wait(timeout=60)
        # A committed step is refused too (stock behaviour, kept: never overwritten).
        with pytest.raises(CheckpointError, match="exists"):
            manager.save(10, {"w": torch.full((1 << 18,), 3.0)})
        manager.save(11, first)
    finally:
        manager.close()
    assert manager.steps() == [10, 11]
    assert torch.equal(_loaded(root / "step_00000010", first)["w"], first["w"])
    assert _hidden(root) == []


# ------------------------------------------------------------------ leftovers (issue 24.8)
@pytest.mark.timeout(120)
def test_ctrl_c_during_a_synchronous_save_leaves_no_temporary_directory(tmp_path: Path) -> None:
    """A real SIGINT while a synchronous save writes (in the training process): the
    KeyboardInterrupt reaches the script, the committed step is intact, and no
    `.step_N.tmp-*` directory is left (`asyncckpt ls` lists nothing partial)."""
    root = tmp_path / "root"
    reached = tmp_path / "reached"
    proc = _start(
        tmp_path,
        f"""
        mgr = asyncckpt.CheckpointManager(root)
        mgr.save(1, {{"w": torch.ones(1 << 18)}}, async_op=False)
        os.environ["ASYNCCKPT_FAULT"] = "mid_write:touch={reached};mid_write:sleep=60"
        try:
            mgr.save(2, {{"w": torch.ones(1 << 18)}}, async_op=False)
        except KeyboardInterrupt:
            print(json.dumps({{"interrupted": True, "steps": mgr.steps()}}), flush=True)
            raise
    """,
        root,
    )
    deadline = time.monotonic() + 60
    while not reached.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reached.exists(), "the synchronous save never reached its write"
    proc.send_signal(signal.SIGINT)
    rc, out, err = finish_session(proc)
    assert rc != 0 and "KeyboardInterrupt" in err, err
    assert json.loads(out.strip().splitlines()[-1]) == {"interrupted": True, "steps": [1]}
    assert _hidden(root) == [] and _ls_partial(root) == []
    asyncckpt.verify(root / "step_00000001")


@pytest.mark.timeout(120)
def test_ctrl_c_after_the_commit_point_of_a_synchronous_save_reports_it_committed(tmp_path: Path) -> None:
    """SIGINT during a synchronous save after its directory was renamed (the commit
    point): the interrupt is raised, and the save is reported as what the disk holds,
    committed (its handle and callback), not as failed."""
    root = tmp_path / "root"
    marker = tmp_path / "renamed"
    proc = _start(
        tmp_path,
        f"""
        outcomes = []
        manager = asyncckpt.CheckpointManager(root, callback=outcomes.append)
        handle = None
        try:
            os.environ["ASYNCCKPT_FAULT"] = "after_rename:touch={marker};after_rename:sleep=60"
            handle = manager.save(1, {{"w": torch.ones(1 << 16)}}, async_op=False)
        except KeyboardInterrupt:
            os.environ.pop("ASYNCCKPT_FAULT")
            print(json.dumps({{"interrupted": True, "steps": manager.steps(),
                              "callback": [type(o).__name__ for o in outcomes]}}), flush=True)
        manager.close()
    """,
        root,
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the commit point was never reached"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
    finally:
        rc, out, err = finish_session(proc)
    assert rc == 0, err
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen == {"interrupted": True, "steps": [1], "callback": ["SaveResult"]}, (seen, err)
    assert asyncckpt.verify(root / "step_00000001") and _hidden(root) == []


@pytest.mark.timeout(120)
def test_an_exit_without_close_finishes_the_retention_removal(tmp_path: Path) -> None:
    """keep_last=1 and an exit without close(): the commit at exit starts the removal of
    the old step; the exit lets it finish, so no `.step_N.deleting-*` directory is left.
    (The old step holds many files, as a checkpoint of many ranks does, so that its
    removal takes longer than the rest of the exit.)"""
    root = tmp_path / "root"
    proc = _start(
        tmp_path,
        """
        mgr = asyncckpt.CheckpointManager(root, keep_last=1)
        mgr.save(1, {"w": torch.ones(1 << 10)}).wait(timeout=60)
        extra = mgr.step_dir(1) / "extra"
        extra.mkdir()
        for i in range(20000):
            open(extra / str(i), "w").close()
        mgr.save(2, {"w": torch.ones(1 << 10)})
        print(json.dumps({}), flush=True)
    """,
        root,
        env={"ASYNCCKPT_EXIT_TIMEOUT_S": "60"},
    )
    rc, _out, err = finish_session(proc)
    assert rc == 0, err
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_00000002"]
    assert _hidden(root) == [] and _ls_partial(root) == []


@pytest.mark.timeout(120)
def test_an_exception_in_the_with_block_names_an_earlier_unreported_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A save that failed before the crash and was never reported (no maybe_finalize
    since) is named when the block ends, step and path; the crash's exception is raised."""
    monkeypatch.setenv("ASYNCCKPT_FAULT", "mid_write:raise")
    root = tmp_path / "root"
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        with pytest.raises(ZeroDivisionError):
            with CheckpointManager(root, persistent=False) as manager:
                handle = manager.save(4, {"w": torch.ones(1 << 18)})
                deadline = time.monotonic() + 60
                while not handle.done() and time.monotonic() < deadline:
                    time.sleep(0.05)  # failed in the background, not reported to the loop
                raise ZeroDivisionError
    assert handle.exception() is not None
    assert f"the save of step 4 ({root / 'step_00000004'}) failed" in caplog.text, caplog.text
    assert manager.steps() == [] and _hidden(root) == []


@pytest.mark.timeout(120)
def test_an_aborted_manager_on_a_shared_queue_leaves_its_handles_settling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close(abort=True) of a manager whose queue was passed in (and stays open): its
    save still pending on that queue settles with its real outcome (it used to be
    forgotten by the manager, and wait() blocked forever)."""
    monkeypatch.setenv("ASYNCCKPT_FAULT", "mid_write:sleep=1")
    queue = asyncckpt.AsyncCallsQueue(persistent=False, background_finalize=True)
    try:
        manager = CheckpointManager(tmp_path / "root", calls_queue=queue)
        state = {"w": torch.randn(1 << 18)}
        handle = manager.save(1, state)
        manager.close(abort=True)
        handle.wait(timeout=60)
        assert torch.equal(_loaded(tmp_path / "root" / "step_00000001", state)["w"], state["w"])
    finally:
        queue.close()


# ------------------------------------------------------------------ a worker that was never used
@pytest.mark.timeout(120)
def test_closing_a_manager_that_saved_nothing_does_not_wait_for_its_worker_to_start(tmp_path: Path) -> None:
    """A manager opened to restore (nothing saved) and closed: its persistent worker, still
    starting up (here it never finishes: the ``worker_start`` failpoint sleeps), is
    stopped at once; the close does not wait for the start-up."""
    root = tmp_path / "ckpt"
    proc = _start(
        tmp_path,
        """
        if __name__ == "__main__":
            state = {"w": torch.ones(4)}
            manager = asyncckpt.CheckpointManager(root)
            pid = manager.queue.caller.worker_pid
            restored = manager.restore(state)
            manager.close()
            try:
                os.kill(pid, 0)
                alive = True
            except ProcessLookupError:
                alive = False
            print(json.dumps({"pid": pid, "restored": restored is not None, "alive": alive}))
        """,
        root,
        env={"ASYNCCKPT_FAULT": "worker_start:sleep=600"},
    )
    code, out, err = finish_session(proc, timeout=60)
    assert code == 0, err
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["pid"] is not None and not seen["restored"]
    assert not seen["alive"], "the worker outlived close()"


# ------------------------------------------------------------------ saves never harvested
def test_saves_never_harvested_keep_bounded_records_and_their_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop that never calls ``maybe_finalize`` (here with a bound of 8 instead of
    1024): the manager keeps only the newest committed saves to report, not one per
    save; a failed save among them is kept, and raised by the first call."""
    import asyncckpt.saving.saver as saver_module

    monkeypatch.setattr(saver_module, "MAX_UNHARVESTED", 8)
    state = {"w": torch.ones(16)}
    with CheckpointManager(tmp_path / "ckpt", keep_last=2) as mgr:
        for step in range(1, 41):
            if step == 3:
                monkeypatch.setenv("ASYNCCKPT_FAULT", "commit:raise")
            handle = mgr.save(step, state)
            # each save settled before the next (not counted as reported): only settled ones are forgotten
            assert (handle.exception(timeout=60) is not None) == (step == 3)
            if step == 3:
                monkeypatch.delenv("ASYNCCKPT_FAULT")
        with pytest.raises(CheckpointException) as info:
            mgr.maybe_finalize(blocking=True)
        assert info.value.step == 3
        reported = mgr.maybe_finalize(blocking=True)
        assert 4 <= len(reported) <= 8 and reported == list(range(41 - len(reported), 41)), reported
    assert mgr.steps() == [39, 40]
