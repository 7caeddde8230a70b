"""Helpers shared by the tests: bitwise comparison of state structures, snapshots,
processes started for a test (and killed on failure), call counters."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as integers of the same width (bitwise comparison, NaN-safe)."""
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    if t.dtype == torch.bool:
        return t
    if t.is_complex():
        t = torch.view_as_real(t).contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same(expected: Any, got: Any, path: str = "state_dict") -> None:
    """Recursive comparison of two state structures; tensors bitwise (dtype, shape, bits)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: expected a tensor, got {type(got).__name__}"
        assert got.dtype == expected.dtype, f"{path}: dtype {got.dtype} != {expected.dtype}"
        assert tuple(got.shape) == tuple(expected.shape), f"{path}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
        assert torch.equal(bits(got), bits(expected)), f"{path}: values differ"
    elif isinstance(expected, dict):
        assert isinstance(got, dict), f"{path}: expected a dict, got {type(got).__name__}"
        assert set(got) == set(expected), f"{path}: keys {sorted(got)[:5]}... != {sorted(expected)[:5]}..."
        if len(expected) > 1000 and all(
            type(v) is torch.Tensor and v.dtype == torch.float32 and v.shape == (2,)
            for d in (expected, got)
            for v in d.values()
        ):
            # Many tiny tensors: one stacked bitwise comparison instead of one per entry.
            keys = list(expected)
            assert torch.equal(
                torch.stack([got[k] for k in keys]).view(torch.int32),
                torch.stack([expected[k] for k in keys]).view(torch.int32),
            ), f"{path}: values differ"
            return
        for k in expected:
            assert_same(expected[k], got[k], f"{path}[{k!r}]")
    elif isinstance(expected, list):
        assert isinstance(got, list), f"{path}: expected a list, got {type(got).__name__}"
        assert len(got) == len(expected), f"{path}: length {len(got)} != {len(expected)}"
        for i, (e, g) in enumerate(zip(expected, got)):
            assert_same(e, g, f"{path}[{i}]")
    else:
        assert type(got) is type(expected) and got == expected, f"{path}: {got!r} != {expected!r}"


def zeroed(state: Any) -> Any:
    """The same structure with every tensor zeroed and every other leaf ``None``: a
    template an in-place load must fill."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeroed(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeroed(v) for v in state]
    return None


def clone_state(sd: Any, copy_leaves: bool = True) -> Any:
    """The values as of now: tensors cloned (detached), containers copied, other leaves
    deep-copied (or shared with ``copy_leaves=False``)."""
    if isinstance(sd, torch.Tensor):
        return sd.detach().clone()
    if isinstance(sd, dict):
        return {k: clone_state(v, copy_leaves) for k, v in sd.items()}
    if isinstance(sd, list):
        return [clone_state(v, copy_leaves) for v in sd]
    return copy.deepcopy(sd) if copy_leaves else sd


@contextlib.contextmanager
def closing_queue(persistent: bool) -> Iterator[Any]:
    """An ``AsyncCallsQueue`` closed on the way out; a failure a test injected into its
    last call is not raised again by ``close`` (the worker is stopped anyway)."""
    from asyncckpt import AsyncCallsQueue, CheckpointException

    queue = AsyncCallsQueue(persistent=persistent)
    try:
        yield queue
    finally:
        try:
            queue.close()
        except CheckpointException:
            pass


def kill_process_tree(proc: Any) -> None:
    """SIGKILL ``proc``'s process group and every descendant still alive (torchrun starts
    each rank in a session of its own, so the group alone does not cover them)."""
    import os
    import signal

    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for p in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def kill_session(proc: Any) -> None:
    """SIGKILL the session of ``proc`` (a ``Popen`` started with ``start_new_session=True``:
    its process group and every descendant left), then reap it and read its pipes."""
    kill_process_tree(proc)
    proc.communicate()


def finish_session(proc: Any, timeout: float = 90) -> tuple[int, Any, Any]:
    """Wait up to ``timeout`` s for ``proc`` (a ``Popen`` started with
    ``start_new_session=True``) and return ``(returncode, stdout, stderr)``. If it does not
    end in time, or the wait is interrupted, its whole session is killed (:func:`kill_session`)
    and the error goes on."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        kill_session(proc)
        raise
    return proc.returncode, out, err


class CallCounter:
    """The calls :func:`count_calls` saw: ``n`` (how many), ``calls`` (what ``keep`` made
    of each one's arguments)."""

    def __init__(self, owner: Any, name: str) -> None:
        self.calls: list[Any] = []
        self.owner, self.name, self.original = owner, name, getattr(owner, name)

    @property
    def n(self) -> int:
        return len(self.calls)

    def restore(self) -> None:
        """Put the original function back."""
        setattr(self.owner, self.name, self.original)


def count_calls(
    owner: Any,
    name: str,
    when: Callable[..., bool] | None = None,
    this_thread: bool = False,
    keep: Callable[..., Any] | None = None,
) -> CallCounter:
    """Count the calls of ``owner.name`` (a function or method of a module or class, run
    unchanged) from now until :meth:`CallCounter.restore`: those for which
    ``when(*args, **kwargs)`` is true (all without ``when``), made from any thread or,
    with ``this_thread``, from the calling one; ``keep(*args, **kwargs)`` of each is kept
    in ``calls`` (the arguments themselves are not: they may pin buffers). An observation
    of code (e.g. how often DCP's planner planned), not a replacement of it."""
    import threading

    counter = CallCounter(owner, name)
    real = counter.original
    thread = threading.current_thread()

    def spy(*args: Any, **kwargs: Any) -> Any:
        if (not this_thread or threading.current_thread() is thread) and (when is None or when(*args, **kwargs)):
            counter.calls.append(keep(*args, **kwargs) if keep is not None else None)
        return real(*args, **kwargs)

    setattr(owner, name, spy)
    return counter


@contextlib.contextmanager
def counting_calls(
    owner: Any,
    name: str,
    when: Callable[..., bool] | None = None,
    this_thread: bool = False,
    keep: Callable[..., Any] | None = None,
) -> Iterator[CallCounter]:
    """:func:`count_calls` while the block runs (restored on the way out)."""
    counter = count_calls(owner, name, when, this_thread, keep)
    try:
        yield counter
    finally:
        counter.restore()


def count_plans() -> CallCounter:
    """:func:`count_calls` of DCP's ``DefaultSavePlanner.create_local_plan``: the saves
    (of this process) that DCP planned, not reusing a cached plan."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    return count_calls(DefaultSavePlanner, "create_local_plan")


@contextlib.contextmanager
def counting_plans() -> Iterator[CallCounter]:
    """:func:`count_plans` while the block runs."""
    counter = count_plans()
    try:
        yield counter
    finally:
        counter.restore()


class LoadCounts:
    """What the ``asyncckpt.load`` calls inside :func:`observing_loads` did: how many took
    the direct path (``direct``) or DCP's (``dcp``, stock ``dcp.load`` with our reader and
    planner), and where the direct path's plans found the records: the records file
    (``records``), a sharded checkpoint's shard index (``shards``) or the unpickled
    ``.metadata`` (``metadata``)."""

    def __init__(self, direct: CallCounter, dcp: CallCounter, plans: CallCounter) -> None:
        self.direct_calls, self.dcp_calls, self.plan_calls = direct, dcp, plans

    @property
    def direct(self) -> int:
        return self.direct_calls.n

    @property
    def dcp(self) -> int:
        return self.dcp_calls.n

    @property
    def records(self) -> int:
        return self.plan_calls.calls.count("records")

    @property
    def metadata(self) -> int:
        return self.plan_calls.calls.count("metadata")

    @property
    def shards(self) -> int:
        return self.plan_calls.calls.count("shards")

    def paths(self) -> dict[str, int]:
        """``{"direct": ..., "dcp": ...}``."""
        return {"direct": self.direct, "dcp": self.dcp}


@contextlib.contextmanager
def observing_loads() -> Iterator[LoadCounts]:
    """Observe the loads of this process while the block runs (:class:`LoadCounts`): the
    calls of the direct path's reader (``asyncckpt.loading.api.direct_load``), of stock
    ``torch.distributed.checkpoint.load``, and of the direct path's planner with records
    (a dict), a rank's shard index or ``.metadata``; all run unchanged."""
    import torch.distributed.checkpoint as dcp

    from asyncckpt.loading import api
    from asyncckpt.loading.direct import ShardCatalog

    counters = [
        count_calls(api, "direct_load"),
        count_calls(dcp, "load"),
        count_calls(
            api,
            "plan_direct_load",
            keep=lambda _sd, source, *a, **k: (
                "records" if isinstance(source, dict) else "shards" if isinstance(source, ShardCatalog) else "metadata"
            ),
        ),
    ]
    try:
        yield LoadCounts(*counters)
    finally:
        for counter in counters:
            counter.restore()


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str, nr_inodes: int | None = None) -> Iterator[bool]:
    """Mount a tmpfs of ``size`` (and at most ``nr_inodes`` inodes) at ``path`` for the
    block; yields False (and mounts nothing) where mounting is not possible. Unmounted
    on the way out, also on failure.

    ``ASYNCCKPT_FAULTS_NO_MOUNT=1`` forces the fallbacks.
    """
    import os
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    mounted = False
    if os.environ.get("ASYNCCKPT_FAULTS_NO_MOUNT") != "1" and hasattr(os, "geteuid") and os.geteuid() == 0:
        try:
            options = f"size={size},mode=0755" + (f",nr_inodes={nr_inodes}" if nr_inodes else "")
            mounted = (
                subprocess.run(
                    ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, timeout=30
                ).returncode
                == 0
            )
        except (OSError, subprocess.SubprocessError):
            mounted = False
    try:
        yield mounted
    finally:
        if mounted:
            if subprocess.run(["umount", str(path)], capture_output=True, timeout=30).returncode != 0:
                subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def _group_has_live_process(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running: one that has exited and waits
    to be reaped (a zombie) is not (it holds no memory, file or segment any more)."""
    import os

    import psutil

    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) != pgid:
                continue
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE or proc.num_threads() > 1:  # threads still exiting
                return True
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return False


def process_group_gone(pgid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` s for every process of group ``pgid`` to exit.

    An exited process not reaped yet (a zombie) counts as gone, as everywhere in the
    tests: the children of a process that exited (multiprocessing's resource tracker, a
    worker) are orphans that the machine's init reaps, and an init may do that seconds
    later (a container's: ~2 s per orphan on the CI machine).
    """
    import time

    deadline = time.monotonic() + timeout
    while True:
        if not _group_has_live_process(pgid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def open_fd_targets() -> list[str]:
    """What this process's open descriptors point to (``/proc/self/fd``: a path, with
    `` (deleted)`` for a removed file, or ``/memfd:NAME``), skipping one closed meanwhile."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return targets


def flip_byte(path: Any, offset: int) -> None:
    """Invert the bits of the byte at ``offset`` of file ``path`` (a corruption)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@contextlib.contextmanager
def started_session(cmd: list[str], **popen_kwargs: Any) -> Iterator[Any]:
    """``subprocess.Popen(cmd, start_new_session=True, text=True, **popen_kwargs)``; on
    the way out (also on failure) the session gets 10 s to end, then whatever is left
    of its process tree is killed, and the process is reaped."""
    import subprocess

    proc = subprocess.Popen(cmd, start_new_session=True, text=True, **popen_kwargs)
    try:
        yield proc
    finally:
        if proc.poll() is None or not process_group_gone(proc.pid, 10):
            kill_process_tree(proc)
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream:
                stream.close()


def resign(ckpt: Path, extra: dict[str, Path] | None = None) -> None:
    """Recompute every manifest entry (size, one CRC-32 segment) from the files as they
    are now; ``extra`` adds entries (name -> file whose bytes to describe)."""
    manifest_path = ckpt / ".manifest.json"
    manifest = json.loads(manifest_path.read_text())
    sources = {name: ckpt / name for name in manifest["files"]}
    sources.update(extra or {})
    files = {}
    for name, source in sources.items():
        data = source.read_bytes()
        files[name] = {"size": len(data), "segments": [[0, len(data), zlib.crc32(data)]]}
    manifest["files"] = files
    manifest_path.write_text(json.dumps(manifest))


class LogLines(logging.Handler):
    """A logging handler that keeps each record's message (``lines``), from ``level`` on."""

    def __init__(self, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
