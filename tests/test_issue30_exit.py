"""Issue 30, items 2, 4, 10 and 14: saves from atexit handlers, a wait inside a save's
own completion callback, the ``destroy_process_group`` wrapper on ``import asyncckpt``,
and the framework's names on ``asyncckpt.async_utils``. (Item 11, a second Ctrl-C
while the exit waits, is in ``tests/test_exit_order.py``.)

The scenarios that end a process run as real scripts in a subprocess of their own
(``start_new_session``: whatever they leave is killed), observed through their exit
status, their stderr and the files on disk (``asyncckpt.verify``, ``read_state_dict``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import asyncckpt

from helpers import finish_session, started_session


def _run_script(
    tmp_path: Path, source: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> tuple[int, str, str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    full_env = dict(os.environ)
    full_env.pop("ASYNCCKPT_FAULT", None)
    full_env.update(env or {})
    cmd = [sys.executable, str(script), *args]
    with started_session(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env) as proc:
        return finish_session(proc, timeout)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# ====================================================================== item 2: saves from atexit handlers
_ATEXIT_SAVES = """
    import atexit, json, os, sys
    root = sys.argv[1]
    managers = {}

    def final_saves(tag, step):
        import torch, asyncckpt
        state = {"w": torch.full((1 << 18,), float(step)), "tag": tag}
        done = []
        for threads, manager in sorted(managers.items()):
            done.append(manager.save(step, state).done())                    # async_op=True
            done.append(manager.save(step + 1, state, async_op=False).done())
        options = asyncckpt.SaveOptions(copy_threads=2)
        done.append(asyncckpt.save(state, os.path.join(root, "free_" + tag), async_op=True, options=options).done())
        print(json.dumps({tag: done}), flush=True)

    # Registered before asyncckpt's exit hook exists: runs after it (atexit is last in, first out).
    atexit.register(final_saves, "late", 20)
    import torch, asyncckpt
    for threads in (1, 2):
        managers[threads] = asyncckpt.CheckpointManager(
            os.path.join(root, f"threads{threads}"), copy_threads=threads, keep_last=None if threads == 1 else 2
        )
        managers[threads].save(1, {"w": torch.zeros(1 << 18), "tag": "first"}).wait()
    # Registered after it: runs before it.
    atexit.register(final_saves, "early", 10)
    print(json.dumps({"workers": [m.queue.caller.worker_pid for m in managers.values()]}), flush=True)
"""


@pytest.mark.timeout(180)
def test_saves_from_atexit_handlers_commit_whatever_the_registration_order(tmp_path: Path) -> None:
    """Item 2: a save from the user's own atexit handler commits, as a ``torch.save``
    there would: async and sync, ``copy_threads`` 1 and 2 (the staging pool refuses
    new work once the interpreter shuts down), a manager's and ``asyncckpt.save``'s,
    in a handler that runs before asyncckpt's exit hook and in one that runs after it.
    Each returns committed (``done()``); retention at exit leaves nothing behind; the
    workers are gone. (Before: the async saves were dropped silently or failed, and
    every save with two copy threads raised "cannot schedule new futures after
    shutdown".)"""
    root = tmp_path / "root"
    root.mkdir()
    code, out, err = _run_script(tmp_path, _ATEXIT_SAVES, str(root), env={"ASYNCCKPT_EXIT_TIMEOUT_S": "60"})
    assert code == 0, err
    for bad in ("Traceback", "lost", "failed", "Exception ignored"):
        assert bad not in err, err
    lines = [json.loads(line) for line in out.splitlines()]
    reported: dict[str, Any] = {k: v for line in lines for k, v in line.items()}
    assert reported["early"] == [True] * 5 and reported["late"] == [True] * 5, reported
    for pid in reported["workers"]:
        assert _gone(pid), f"worker {pid} left alive"
    for name in ("threads1", "threads2"):
        ckpts = root / name
        expected = [1, 10, 11, 20, 21] if name == "threads1" else [20, 21]
        assert sorted(e for e in os.listdir(ckpts) if e.startswith("step_")) == [f"step_{s:08d}" for s in expected]
        assert [e for e in os.listdir(ckpts) if ".tmp-" in e or ".deleting-" in e] == []
        assert (ckpts / "latest").read_text().strip() == "step_00000021"
        for step in expected:
            asyncckpt.verify(ckpts / f"step_{step:08d}")
        state = asyncckpt.read_state_dict(ckpts / "step_00000021")
        assert torch.equal(state["w"], torch.full((1 << 18,), 20.0)) and state["tag"] == "late"
    for tag, value in (("early", 10.0), ("late", 20.0)):
        state = asyncckpt.read_state_dict(root / f"free_{tag}")
        assert torch.equal(state["w"], torch.full((1 << 18,), value))


_FAILING_AT_EXIT = """
    import atexit, os, sys
    root = sys.argv[1]

    def failing_save():
        import torch, asyncckpt
        os.environ["ASYNCCKPT_FAULT"] = "stage:enospc"   # in this process: the save at exit stages here
        manager.save(2, {"w": torch.ones(1 << 16)})

    atexit.register(failing_save)   # runs after asyncckpt's exit hook
    import concurrent.futures
    import torch, asyncckpt
    os.environ["ASYNCCKPT_FAULT"] = "mid_write:enospc"   # the default queue's worker inherits it
    early = asyncckpt.save({"w": torch.ones(1 << 16)}, os.path.join(root, "early"), async_op=True)
    concurrent.futures.wait([early], 60)   # failed before the exit; nobody is told (no wait())
    os.environ["ASYNCCKPT_FAULT"] = "mid_write:sleep=1;mid_write:enospc"   # the manager's worker
    manager = asyncckpt.CheckpointManager(root)
    os.environ.pop("ASYNCCKPT_FAULT")
    manager.save(1, {"w": torch.ones(1 << 16)})   # pending at exit; fails while the exit waits
"""


@pytest.mark.timeout(120)
def test_a_save_failing_at_exit_is_named_with_its_cause(tmp_path: Path) -> None:
    """Item 2: a save pending at exit that fails there is named with its cause on
    stderr, in one line (before: "... failed on rank(s) 0:" and nothing after), and so
    is one that failed before the exit without anybody told (before: not named); a
    save from an atexit handler that fails raises there, its cause on stderr, and
    leaves nothing. (Python's exit status after an atexit handler raised stays 0, as with a
    ``torch.save`` that raises there.)"""
    root = tmp_path / "root"
    _, _, err = _run_script(tmp_path, _FAILING_AT_EXIT, str(root), env={"ASYNCCKPT_EXIT_TIMEOUT_S": "60"})
    named = [line for line in err.splitlines() if "the save of step 1 (" in line]
    assert len(named) == 1, err
    assert "pending at interpreter exit, failed: saving step 1 to" in named[0], err
    assert "No space left on device" in named[0], err
    early = [line for line in err.splitlines() if f"the save of {root / 'early'} failed" in line]
    assert len(early) == 1 and "(not reported before interpreter exit)" in early[0], err
    assert "No space left on device" in early[0], err
    assert "saving step 2 to" in err and err.count("No space left on device") >= 3, err
    assert sorted(e for e in os.listdir(root) if e.startswith(("step_", ".step_"))) == [], os.listdir(root)


# ====================================================================== item 4: wait() inside its own callback
_WAIT_IN_CALLBACK = """
    import json, os, sys, threading
    import torch, asyncckpt
    root = sys.argv[1]
    seen = []
    second_saved = threading.Event()

    def waiting_callback(handles, mode):
        def callback(result):
            handle = handles[result.step]
            for name, call in (("wait", handle.wait), ("result", lambda: handle.result(30)),
                               ("exception", lambda: handle.exception(30))):
                try:
                    call()
                    seen.append([mode, result.step, name, "returned"])
                except Exception as exc:
                    seen.append([mode, result.step, name, type(exc).__name__])
            if mode == "background" and result.step == 1:   # the next save, pending behind this callback
                second_saved.wait(30)
                try:
                    handles[2].wait()
                    seen.append([mode, 1, "wait for step 2", "returned"])
                except Exception as exc:
                    seen.append([mode, 1, "wait for step 2", type(exc).__name__])
        return callback

    state = {"w": torch.ones(1 << 16)}
    errors = []
    for mode in ("background", "foreground"):
        handles = {}
        queue = asyncckpt.AsyncCallsQueue(persistent=False, background_finalize=False) if mode == "foreground" else None
        manager = asyncckpt.CheckpointManager(
            os.path.join(root, mode), calls_queue=queue, callback=waiting_callback(handles, mode)
        )
        handles[1] = manager.save(1, state)   # its write sleeps 0.5 s: the handle is kept before the commit
        if queue is not None:
            manager.maybe_finalize(blocking=True)   # foreground: its callback runs here
        handles[2] = manager.save(2, state)   # a later save commits too
        second_saved.set()
        manager.maybe_finalize(blocking=True)
        errors += [repr(handles[step].exception(60)) for step in (1, 2)]
        if queue is not None:  # the background one is left to the exit: nothing must be named lost there
            manager.close()
            queue.close()
    print(json.dumps({"seen": seen, "errors": errors}), flush=True)
"""


@pytest.mark.timeout(150)
def test_wait_inside_the_saves_own_completion_callback_raises_at_once(tmp_path: Path) -> None:
    """Item 4: ``wait()``, ``result(timeout)`` and ``exception(timeout)`` inside a save's
    own completion callback (in the thread settling it: the queue's finalizer thread,
    or the training thread for a queue finalized in the training loop) raise
    ``SaveDeadlockError`` at once, instead of deadlocking that thread; so does a wait
    there for the next save, which that thread would settle; both saves commit;
    nothing is named lost at exit. (Before: the commit thread hung, every later save
    stayed pending, and the process never ended.)"""
    root = tmp_path / "root"
    code, out, err = _run_script(
        tmp_path, _WAIT_IN_CALLBACK, str(root), env={"ASYNCCKPT_FAULT": "mid_write:sleep=0.5"}, timeout=120
    )
    assert code == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    own = ("wait", "result", "exception")
    expected = [["background", 1, name, "SaveDeadlockError"] for name in own]
    expected += [["background", 1, "wait for step 2", "SaveDeadlockError"]]
    expected += [[mode, 2, name, "SaveDeadlockError"] for mode in ["background"] for name in own]
    expected += [["foreground", step, name, "SaveDeadlockError"] for step in (1, 2) for name in own]
    assert report["seen"] == expected, report
    assert report["errors"] == ["None"] * 4, report
    for mode in ("background", "foreground"):
        for step in (1, 2):
            asyncckpt.verify(root / mode / f"step_{step:08d}")
    assert "lost" not in err and "failed" not in err, err


# ====================================================================== item 10: the destroy_process_group wrapper
_DESTROY = """
    import json, os, sys
    root, store, order = sys.argv[1:4]
    if order == "asyncckpt_first":
        import asyncckpt
        assert "torch" not in sys.modules, "import asyncckpt imported torch"
        from torch.distributed import destroy_process_group
    else:
        import torch
        import asyncckpt
        from torch.distributed import destroy_process_group
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    os.environ["ASYNCCKPT_FAULT"] = "mid_write:sleep=1"   # the worker inherits it: pending at the destroy
    manager = asyncckpt.CheckpointManager(root)
    os.environ.pop("ASYNCCKPT_FAULT")
    handle = manager.save(1, {"w": torch.ones(1 << 16)})
    destroy_process_group()
    done = handle.done()
    print(json.dumps({
        "wrapper": getattr(destroy_process_group, "__asyncckpt_original__", None) is not None,
        "done_after_destroy": done,
        "error": repr(handle.exception(60)),
    }), flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", ["asyncckpt_first", "torch_first"])
def test_import_asyncckpt_installs_the_destroy_process_group_wrapper(tmp_path: Path, order: str) -> None:
    """Item 10: after ``import asyncckpt`` (before or after ``import torch``; the import
    itself imports no torch), ``from torch.distributed import destroy_process_group``
    binds asyncckpt's wrapper, and a save pending then is committed before the
    destroy returns. (Before: the package import installed nothing; the name bound
    torch's own function and the save settled only later, through the commit's
    fallback.)"""
    root = tmp_path / "root"
    code, out, err = _run_script(tmp_path, _DESTROY, str(root), str(tmp_path / "store"), order)
    assert code == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report == {"wrapper": True, "done_after_destroy": True, "error": "None"}, (report, err)
    asyncckpt.verify(root / "step_00000001")


# ====================================================================== item 14: asyncckpt.async_utils
def test_the_framework_names_import_from_async_utils(tmp_path: Path) -> None:
    """Item 14: ``from asyncckpt.async_utils import AsyncCallsQueue, AsyncRequest, ...``
    (what Megatron users write) gives the framework's classes, the same as on
    ``asyncckpt``; the worker-side names import no torch; a call scheduled through them
    runs and finalizes."""
    from asyncckpt.async_utils import (
        AsyncCaller,
        AsyncCallsQueue,
        AsyncRequest,
        CallOutcome,
        PersistentAsyncCaller,
        SettleCallback,
        TemporalAsyncCaller,
    )

    assert AsyncCallsQueue is asyncckpt.AsyncCallsQueue and AsyncRequest is asyncckpt.AsyncRequest
    assert (
        TemporalAsyncCaller is asyncckpt.TemporalAsyncCaller
        and PersistentAsyncCaller is asyncckpt.PersistentAsyncCaller
    )
    assert AsyncCaller is asyncckpt.AsyncCaller and CallOutcome._fields and SettleCallback is not None
    import asyncckpt.async_utils as async_utils

    assert sorted(async_utils.__all__) == sorted(
        [
            "AsyncCaller",
            "AsyncCallsQueue",
            "AsyncRequest",
            "CallOutcome",
            "PersistentAsyncCaller",
            "SettleCallback",
            "TemporalAsyncCaller",
        ]
    )
    with pytest.raises(AttributeError):
        async_utils.NoSuchName  # noqa: B018

    finalized: list[int] = []
    queue = AsyncCallsQueue(caller=TemporalAsyncCaller())
    try:
        queue.schedule_async_request(AsyncRequest(len, ([1, 2, 3],), [lambda: finalized.append(1)]))
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
        assert finalized == [1]
    finally:
        queue.close()

    probe = (
        "import sys\n"
        "from asyncckpt.async_utils import AsyncRequest, AsyncCaller, TemporalAsyncCaller\n"
        "from asyncckpt.async_utils import PersistentAsyncCaller, CallOutcome\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
