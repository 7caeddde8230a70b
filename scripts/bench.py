"""Side-by-side checkpoint benchmark: asyncckpt against torch.save, DCP and the physical limits.

One command measures, in one run, on the same state dicts and in the same directory:

workloads  synthetic float32 state dicts (256 MiB and 1 GiB in 16 tensors, 1 GiB in 4096
           tensors; 4G/16 on request), the training example's model + AdamW state
           (scripts/train.py), and LLM-shaped states (scripts/bench_llm.py): ``llm``, a GPT
           whose parameters + AdamW state are ~1 GiB in 1172 tensors from get_state_dict,
           and ``fsdp2``, the same model under FSDP2 on 2 ranks (DTensor shards)
systems    torch.save (+ fsync), dcp.save, dcp.async_save (thread and process executors,
           each with DCP's default staging and with a reused DefaultStager), asyncckpt
           synchronous, temporal, persistent, persistent with overlapped staging, and
           persistent with prepare() before the first save; on llm and fsdp2 only
           dcp.async_save thread + DefaultStager and asyncckpt persistent (with and
           without prepare()), side by side
limits     memcpy of the same bytes into a preallocated buffer, raw sequential write +
           fsync and raw read of the same bytes in the same directory

Per system (medians over --reps saves after a first, cold, one that is reported apart):
stall (training thread blocked until the state may be mutated), committed (until durable),
write GB/s, peak extra memory (PSS of the process tree over the baseline before the
system was set up, sampled by a separate process) and the extra memory after the first
and the last save; load times (asyncckpt.load with and without verify, dcp.load,
torch.load) against a raw read, all from a cold page cache (posix_fadvise DONTNEED);
asyncckpt's techniques one at a time (buffer reuse, copy / write threads, plan cache,
staging buffers); the slowdown of the training example's loop with a checkpoint every
K = 1, 4 and 16 steps against no checkpoint; and, at the end, "Issue 11 targets": every
figure of issue 11's table as measured in this run, its goal and whether it is met.

    python scripts/bench.py                       # everything (about 25-30 min here)
    python scripts/bench.py --workloads llm,fsdp2 --no-train --techniques ""
    python scripts/bench.py --workloads 1G/16     # one workload
    python scripts/bench.py --quick               # smoke run (< 60 s)

Output: markdown on stdout (and --md), JSON (--json), a PNG chart (--png).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import inspect
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator


import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import asyncckpt  # noqa: E402
import asyncckpt.manager  # noqa: E402,F401 - imported before timing: not a save cost

MiB, GiB = 1 << 20, 1 << 30
DEFAULT_WORKLOADS = "256M/16,1G/16,1G/4096,llm,fsdp2,train"
QUICK_WORKLOADS = "4M/16,llm,fsdp2"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ============================================================================ state helpers

def tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a nested dict / list, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_of(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_of(v)


def state_bytes(sd: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(sd))


def as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def mutate(sd: Any) -> None:
    """What the trainer does after a save: write to its state (one element per tensor;
    of a DTensor, of its local shard)."""
    for t in tensors_of(sd):
        if hasattr(t, "to_local"):
            t = t.to_local()
        if t.numel() and t.is_floating_point():
            t.view(-1)[:1].add_(1.0)


def make_state(total_bytes: int, num_tensors: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``num_tensors`` float32 tensors totalling about ``total_bytes`` bytes."""
    gen = torch.Generator().manual_seed(seed)
    per = max(1, total_bytes // num_tensors // 4)
    return {f"layer{i}.weight": torch.randn(per, generator=gen) for i in range(num_tensors)}


def parse_size(s: str) -> int:
    mult = {"K": 1 << 10, "M": MiB, "G": GiB}
    return int(float(s[:-1]) * mult[s[-1].upper()]) if s[-1].upper() in mult else int(s)


def free_memory() -> None:
    gc.collect()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def drop_cache(path: Path) -> None:
    """Evict ``path`` (a file, or every file under a directory) from the page cache.

    Without root, /proc/sys/vm/drop_caches is out of reach; posix_fadvise(DONTNEED)
    drops the clean (already fsynced) pages of the files themselves.
    """
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ============================================================================ memory sampler

_SAMPLER = r"""
import os, select, sys
root, interval, me = int(sys.argv[1]), float(sys.argv[2]), os.getpid()
def tree():
    out, stack = [root], [root]
    while stack:
        p = stack.pop()
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tids:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            for k in kids:
                if k != me and k not in out:
                    out.append(k)
                    stack.append(k)
    return out
def status(pid):
    # Cheap O(1) kernel counters (no page-table walk, unlike PSS from smaps).
    out = {"RssAnon:": 0, "RssShmem:": 0}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(None, 1)[0]
                if key in out:
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out["RssAnon:"], out["RssShmem:"]
def sample():
    # Private memory of every process of the tree, plus shared memory counted once
    # (the staging buffers are mapped by the trainer and its writer process).
    anon = shmem = 0
    for p in tree():
        a, sh = status(p)
        anon += a
        shmem = max(shmem, sh)
    return anon + shmem
cur = peak = sample()
while True:
    ready, _, _ = select.select([sys.stdin], [], [], interval)
    cur = sample()
    peak = max(peak, cur)
    if ready:
        cmd = sys.stdin.readline().strip()
        if cmd in ("", "quit"):
            break
        if cmd == "reset":
            peak = cur
        sys.stdout.write(f"{cur} {peak}\n")
        sys.stdout.flush()
"""


class MemorySampler:
    """Samples the resident memory of this process and its children, recursively: the
    sum of their private memory (``RssAnon``) plus the largest shared memory
    (``RssShmem``; the staging buffers and DCP's shared-memory stager are mapped by
    the trainer and its writer, so it is counted once), every ``interval`` seconds,
    from a separate process. These are O(1) kernel counters: sampling PSS instead
    (a walk of every page table through smaps) took half a core here and slowed
    the systems under test. ``now()`` and ``peak()`` in bytes.
    """

    def __init__(self, interval: float = 0.05, enabled: bool = True) -> None:
        self.enabled = enabled
        self.proc = None
        if enabled:
            self.proc = subprocess.Popen([sys.executable, "-c", _SAMPLER, str(os.getpid()), str(interval)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _ask(self, cmd: str) -> tuple[int, int]:
        if self.proc is None:
            return 0, 0
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        cur, peak = self.proc.stdout.readline().split()
        return int(cur), int(peak)

    def now(self) -> int:
        return self._ask("now")[0]

    def reset(self) -> int:
        return self._ask("reset")[0]

    def peak(self) -> int:
        return self._ask("peak")[1]

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(Exception):
                self.proc.stdin.write("quit\n")  # type: ignore[union-attr]
                self.proc.stdin.flush()  # type: ignore[union-attr]
            with contextlib.suppress(Exception):
                self.proc.wait(timeout=5)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


# ============================================================================ physical limits

def bench_memcpy(sd: Any, reps: int, before: Callable[[], None] | None = None) -> list[float]:
    """Times (s) of copying every tensor of ``sd`` into preallocated host memory (the
    staging limit): D2H into pinned memory for GPU tensors; for CPU tensors the faster,
    in each repetition, of torch's ``copy_`` per tensor and libc ``memmove`` per
    tensor (through ctypes; torch's copy runs on its intra-op threads and is the slower
    of the two on a busy machine). ``before()`` runs before each timed copy (the
    fsdp2 workload passes a barrier, so that every rank copies at once)."""
    before = before or (lambda: None)
    import ctypes
    src = list(tensors_of(sd))
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in src]
    cuda = any(t.is_cuda for t in src)
    for d, s in zip(dst, src):
        d.copy_(s)  # warm: pages faulted in
    moves = [(d.data_ptr(), s.data_ptr(), s.numel() * s.element_size()) for d, s in zip(dst, src)
             if not cuda and s.is_contiguous()]
    times = []
    for _ in range(reps):
        before()
        t0 = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        if moves and len(moves) == len(src):
            before()
            t0 = time.perf_counter()
            for move in moves:
                ctypes.memmove(*move)
            elapsed = min(elapsed, time.perf_counter() - t0)
        times.append(elapsed)
    del dst
    free_memory()
    return times


def host_tensors(sd: Any) -> list[torch.Tensor]:
    """The state's tensors in host memory, for the raw write / read limits: the tensors
    themselves on CPU, a host copy (made here, untimed) of GPU ones."""
    return [t.detach().cpu() if t.is_cuda else t for t in tensors_of(sd)]


def raw_write(sd: Any, path: Path) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors_of(sd):
            mv = as_bytes(t)
            while mv:
                n = os.write(fd, mv[: 64 << 20])
                mv = mv[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def raw_read(sd: Any, path: Path) -> float:
    """Read the file back into the state's own tensors (readinto, sequential)."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        for t in tensors_of(sd):
            mv = as_bytes(t)
            while mv:
                n = f.readinto(mv[: 64 << 20])
                if not n:
                    raise EOFError(path)
                mv = mv[n:]
    return time.perf_counter() - t0


# ============================================================================ systems

class Pending:
    """One save in flight: ``staged()`` blocks until the state may be mutated,
    ``committed()`` until the checkpoint is durable and committed. For asyncckpt,
    ``poll`` is the training loop's ``maybe_finalize()`` and ``done`` the handle's
    ``done()``: the benchmark times ``poll`` while the commit is pending."""

    def __init__(self, path: Path, staged: Callable[[], Any] = lambda: None,
                 committed: Callable[[], Any] = lambda: None, poll: Callable[[], Any] | None = None,
                 done: Callable[[], bool] | None = None) -> None:
        self.path, self.staged, self.committed = path, staged, committed
        self.poll, self.done = poll, done


def manager_params() -> set[str]:
    return set(inspect.signature(asyncckpt.CheckpointManager).parameters)


def param_default(name: str) -> Any:
    p = inspect.signature(asyncckpt.CheckpointManager).parameters.get(name)
    return inspect.Parameter.empty if p is None else p.default


def terminate_dcp_daemon() -> None:
    """Stop DCP's process-executor daemon (a module global) so that the next system
    starts without it and its memory is freed."""
    import torch.distributed.checkpoint._async_process_executor as ape
    proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
    if proc is None:
        return
    with contextlib.suppress(Exception):
        proc._send(ape._CheckpointSaveProcessControlOpts.TERMINATE)
        proc._save_process.join(timeout=10)
    if proc._save_process.is_alive():
        proc._save_process.terminate()
        proc._save_process.join(timeout=10)
    ape._CHECKPOINT_PROCESS = None


class System:
    name = ""
    key = ""
    loadable = False  # its last checkpoint is kept for the load measurements

    def open(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def save(self, i: int, sd: Any) -> Pending:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TorchSave(System):
    name, key, loadable = "torch.save (sync)", "torch.save", True

    def save(self, i: int, sd: Any) -> Pending:
        path = self.root / f"ckpt_{i}.pt"
        with open(path, "wb") as f:  # committed = written and fsynced, as DCP does by default
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        return Pending(path)


class DcpSave(System):
    name, key, loadable = "dcp.save (sync)", "dcp", True

    def save(self, i: int, sd: Any) -> Pending:
        path = self.root / f"ckpt_{i}"
        dcp.save(sd, checkpoint_id=str(path))
        return Pending(path)


class DcpAsync(System):
    def __init__(self, process: bool, stager: bool) -> None:
        self.process, self.use_stager = process, stager
        self.name = (f"dcp.async_save {'process' if process else 'thread'}"
                     + (" + DefaultStager" if stager else ""))
        self.key = f"dcp-async-{'process' if process else 'thread'}" + ("-stager" if stager else "")
        self.stager = None

    def open(self, root: Path) -> None:
        super().open(root)
        if self.use_stager:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            # The best options on a CPU-only host: pinned memory and non-blocking copies
            # need an accelerator; shared memory hands the staged tensors to the
            # process executor without a copy; the copy runs in the stager's thread and
            # its buffers are cached across saves (same state dict objects).
            self.stager = DefaultStager(StagingOptions(
                use_pinned_memory=torch.cuda.is_available(), use_shared_memory=True,
                use_async_staging=True, use_non_blocking_copy=torch.cuda.is_available()))

    def save(self, i: int, sd: Any) -> Pending:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        path = self.root / f"ckpt_{i}"
        kind = AsyncCheckpointerType.PROCESS if self.process else AsyncCheckpointerType.THREAD
        r = dcp.async_save(sd, checkpoint_id=str(path), async_checkpointer_type=kind, async_stager=self.stager)
        if hasattr(r, "staging_completion"):  # AsyncSaveResponse (asynchronous staging)
            return Pending(path, r.staging_completion.result, r.upload_completion.result)
        return Pending(path, committed=r.result)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None
        if self.process and not SHARE_DCP_DAEMON:
            terminate_dcp_daemon()


class Asyncckpt(System):
    """asyncckpt through ``CheckpointManager`` (keep_last=None: old steps are removed by
    the benchmark, outside the timed region)."""

    def __init__(self, name: str, key: str, *, sync: bool = False, overlap: bool = False,
                 loadable: bool = False, **kwargs: Any) -> None:
        self.name, self.key, self.sync, self.overlap, self.loadable = name, key, sync, overlap, loadable
        self.kwargs = dict(kwargs)
        if overlap:
            self.kwargs["overlap_staging"] = True
        self.mgr: Any = None
        #: a state to ``CheckpointManager.prepare`` at open (untimed), or None
        self.prepare_sd: Any = None

    def missing(self) -> list[str]:
        return sorted(set(self.kwargs) - manager_params())

    def open(self, root: Path) -> None:
        super().open(root)
        self.mgr = asyncckpt.CheckpointManager(root, **self.kwargs)
        if self.prepare_sd is not None:
            self.mgr.prepare(self.prepare_sd)

    def save(self, i: int, sd: Any) -> Pending:
        mgr = self.mgr
        if self.sync:
            mgr.save(i, sd, async_op=False)
            return Pending(mgr.step_dir(i))
        handle = mgr.save(i, sd)
        staged = getattr(mgr, "synchronize_staging", None) or handle.synchronize_staging
        return Pending(mgr.step_dir(i), staged if self.overlap else (lambda: None), handle.wait,
                       poll=mgr.maybe_finalize, done=handle.done)

    def close(self) -> None:
        if self.mgr is not None:
            self.mgr.close()
            self.mgr = None


def all_systems() -> list[System]:
    return [
        TorchSave(),
        DcpSave(),
        DcpAsync(process=False, stager=False),
        DcpAsync(process=True, stager=False),
        DcpAsync(process=False, stager=True),
        DcpAsync(process=True, stager=True),
        Asyncckpt("asyncckpt sync", "ack-sync", sync=True, persistent=False),
        Asyncckpt("asyncckpt temporal", "ack-temporal", persistent=False),
        Asyncckpt("asyncckpt persistent", "ack-persistent", loadable=True),
        Asyncckpt("asyncckpt persistent overlapped", "ack-overlap", overlap=True),
        Asyncckpt("asyncckpt persistent + prepare()", "ack-prepare"),
    ]


SYSTEM_KEYS = [s.key for s in all_systems()]
#: the systems a workload runs unless --systems names them: every one on the synthetic
#: states (prepare() is among the techniques there), asyncckpt and DCP's best
#: asynchronous save on the LLM states (bench_llm.LLM_SYSTEMS).
DEFAULT_SYSTEM_KEYS = [k for k in SYSTEM_KEYS if k != "ack-prepare"]
SHARE_DCP_DAEMON = False


def run_system(system: System, sd: Any, root: Path, saves: int, sampler: MemorySampler, nbytes: int,
               keep_last: bool = False, interval_s: float | None = None, cleanup: bool = True,
               before: Callable[[], None] | None = None) -> dict[str, Any]:
    """``saves`` saves of ``sd`` (the first one cold) with one system.

    Default protocol: save, wait until staged (stall), mutate, wait until committed,
    sample memory, delete the files (unless ``cleanup`` is False: on several ranks, the
    caller removes them once every rank committed). With ``interval_s``: saves are issued every
    ``interval_s`` seconds without waiting for the previous commit (a sleeping trainer),
    all committed at the end. ``before()`` runs, untimed, before each save (the fsdp2
    workload passes a barrier: the ranks of a training step call save() together, as
    the step's collectives leave them, instead of as each saw the last commit).
    """
    free_memory()
    base = sampler.now()
    sampler.reset()
    system.open(root)
    returns, stalls, committed, after, polls = [], [], [], [], []
    pendings: list[Pending] = []
    try:
        for i in range(saves):
            if before is not None:
                before()
            t0 = time.perf_counter()
            p = system.save(i, sd)
            t1 = time.perf_counter()
            p.staged()
            t2 = time.perf_counter()
            mutate(sd)
            returns.append(t1 - t0)
            stalls.append(t2 - t0)
            if interval_s is None:
                while p.poll is not None and p.done is not None and not p.done():
                    t3 = time.perf_counter()
                    p.poll()  # the training loop's maybe_finalize() while the commit is pending
                    polls.append(time.perf_counter() - t3)
                    time.sleep(0.002)
                p.committed()
                committed.append(time.perf_counter() - t0)
                after.append(sampler.now() - base)
                if cleanup and not (keep_last and i == saves - 1):
                    remove(p.path)
            else:
                pendings.append(p)
                time.sleep(max(0.0, interval_s - (time.perf_counter() - t0)))
        t_end = time.perf_counter()
        for p in pendings:
            p.committed()
        drain_s = time.perf_counter() - t_end
        peak = sampler.peak() - base
        last_path = p.path
        for q in pendings:
            if cleanup:
                remove(q.path)
    finally:
        system.close()
    free_memory()
    out: dict[str, Any] = {
        "first_stall_s": stalls[0], "stall_s": med(stalls[1:]), "mean_stall_s": statistics.fmean(stalls[1:]),
        "returns_s": med(returns[1:]), "stalls_s": stalls,
        "maybe_finalize_s": med(polls) if polls else None, "maybe_finalize_max_s": max(polls) if polls else None,
        "maybe_finalize_calls": len(polls),
        "peak_extra_bytes": peak, "peak_extra_ratio": peak / nbytes,
    }
    if interval_s is None:
        out.update({
            "first_committed_s": committed[0], "committed_s": med(committed[1:]),
            "gbps": nbytes / med(committed[1:]) / 1e9, "committed_all_s": committed,
            "extra_after_first_bytes": after[0], "extra_after_last_bytes": after[-1],
            "extra_after_each_bytes": after,
        })
    else:
        out.update({"interval_s": interval_s, "drain_s": drain_s})
    if keep_last:
        out["_last_path"] = str(last_path)
    return out


# ============================================================================ loads

def bench_loads(sd: Any, kept: dict[str, Path], raw_path: Path, reps: int,
                host: list[torch.Tensor] | None = None) -> dict[str, dict[str, Any]]:
    """Load times, each from a cold page cache (the files' pages dropped before each).
    The raw read reads into ``host`` (default: the state's own tensors)."""
    host = list(tensors_of(sd)) if host is None else host
    loads: list[tuple[str, Path, Callable[[Path], Any]]] = [
        ("raw read (cold cache)", raw_path, lambda p: raw_read(host, p)),
    ]
    ack = kept.get("ack-persistent")
    if ack is not None:
        loads += [
            ("asyncckpt.load verify='inline'", ack, lambda p: asyncckpt.load(sd, p, verify="inline")),
            ("asyncckpt.load verify=True", ack, lambda p: asyncckpt.load(sd, p, verify=True)),
            ("asyncckpt.load verify=False", ack, lambda p: asyncckpt.load(sd, p, verify=False)),
            ("dcp.load (asyncckpt checkpoint)", ack, lambda p: dcp.load(sd, checkpoint_id=str(p))),
        ]
    if "dcp" in kept:
        loads.append(("dcp.load (dcp.save checkpoint)", kept["dcp"], lambda p: dcp.load(sd, checkpoint_id=str(p))))
    if "torch.save" in kept:
        loads.append(("torch.load (torch.save file)", kept["torch.save"],
                      lambda p: torch.load(p, weights_only=True, mmap=False)))
    times: dict[str, list[float]] = {name: [] for name, _, _ in loads}
    for _ in range(reps):  # round-robin: every method sees the same drift of the disk
        for name, path, fn in loads:
            drop_cache(path)
            t0 = time.perf_counter()
            r = fn(path)
            times[name].append(time.perf_counter() - t0)
            del r
    out: dict[str, dict[str, Any]] = {name: {"s": med(ts), "all_s": ts} for name, ts in times.items()}
    # The same raw read with the file in the page cache: if it is not much faster than
    # the cold one, DONTNEED did not take effect (or the disk is as fast as memory).
    raw_read(host, raw_path)
    warm = [raw_read(host, raw_path) for _ in range(reps)]
    out["raw read (warm cache)"] = {"s": med(warm), "all_s": warm}
    return out


# ============================================================================ techniques

def bench_techniques(sd: Any, root: Path, saves: int, sampler: MemorySampler, nbytes: int,
                     write_time: float) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """asyncckpt's techniques, one at a time, against the persistent default."""
    params = manager_params()
    out: dict[str, dict[str, Any]] = {}
    skipped: list[str] = []

    def variant(name: str, need: list[str], **kwargs: Any) -> None:
        missing = [n for n in need if n not in params]
        if missing:
            skipped.append(f"{name}: CheckpointManager has no {', '.join(missing)}")
            return
        log(f"  technique: {name}")
        sysm = Asyncckpt(name, name, **kwargs)
        out[name] = run_system(sysm, sd, root / "tech", saves, sampler, nbytes)

    defaults = {n: param_default(n) for n in ("staging_buffers", "copy_threads", "write_threads", "plan_cache")}
    variant("default (persistent, buffers reused; "
            + ", ".join(f"{k}={v}" for k, v in defaults.items() if v is not inspect.Parameter.empty) + ")", [])
    # (a) fresh staging buffers: a new manager for every save (its worker is started
    # before the save, as CheckpointManager does, so only the buffer is cold).
    log("  technique: fresh buffers (new CheckpointManager per save)")
    free_memory()
    base = sampler.now()
    sampler.reset()
    stalls, committed = [], []
    for i in range(saves):
        mgr = asyncckpt.CheckpointManager(root / "tech_fresh")
        try:
            t0 = time.perf_counter()
            h = mgr.save(i, sd)
            stalls.append(time.perf_counter() - t0)
            mutate(sd)
            h.wait()
            committed.append(time.perf_counter() - t0)
        finally:
            mgr.close()
        remove(mgr.step_dir(i))
    peak = sampler.peak() - base
    out["fresh buffers (new manager per save)"] = {
        "stall_s": med(stalls), "first_stall_s": stalls[0], "committed_s": med(committed),
        "peak_extra_bytes": peak, "peak_extra_ratio": peak / nbytes, "stalls_s": stalls}
    free_memory()
    # (b) copy threads, (c) writer threads: 1 and one per CPU, whichever is not the default
    for knob in ("copy_threads", "write_threads"):
        for value in sorted({1, os.cpu_count() or 1}):
            if value != defaults.get(knob):
                variant(f"{knob}={value}", [knob], **{knob: value})
    # (d) plan / metadata cache
    variant("plan_cache=False", ["plan_cache"], plan_cache=False)
    # (f) prepare(): plan and allocate the staging buffer before the first save
    if hasattr(asyncckpt.CheckpointManager, "prepare"):
        name = "prepare() before the first save"
        log(f"  technique: {name}")
        sysm = Asyncckpt(name, name)
        sysm.prepare_sd = sd
        out[name] = run_system(sysm, sd, root / "tech", saves, sampler, nbytes)
    else:
        skipped.append("prepare(): CheckpointManager has no prepare")
    # (e) staging buffers: saves every half write time, not waiting for the previous
    # commit (a burst): with 1 buffer a save waits for the previous write.
    interval = 0.5 * write_time
    for nbuf in (1, 2):
        name = f"staging_buffers={nbuf}, a save every {interval * 1e3:.0f} ms"
        log(f"  technique: {name}")
        sysm = Asyncckpt(name, name, staging_buffers=nbuf)
        out[name] = run_system(sysm, sd, root / "tech", saves + 1, sampler, nbytes, interval_s=interval)
    return out, skipped


# ============================================================================ training loop

def train_defaults() -> dict[str, Any]:
    import train
    try:
        a = train.parse_args([])
        return {"n_layer": a.n_layer, "n_head": a.n_head, "n_embd": a.n_embd, "block_size": a.block_size,
                "lr": a.lr, "weight_decay": a.weight_decay, "dropout": a.dropout}
    except Exception:  # the example's command line changed: its documented defaults
        return {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128, "lr": 1e-3,
                "weight_decay": 0.1, "dropout": 0.1}


class Trainer:
    """The training example's model (scripts/train.py's GPT) and AdamW, on random bytes."""

    def __init__(self, batch_size: int, seed: int = 1337, **overrides: Any) -> None:
        import train
        from torch.distributed.checkpoint.state_dict import get_state_dict
        self._get_state_dict = get_state_dict
        cfg = {**train_defaults(), **overrides}
        self.cfg = {**cfg, "batch_size": batch_size}
        torch.manual_seed(seed)
        self.model = train.GPT(train.GPTConfig(cfg["block_size"], cfg["n_layer"], cfg["n_head"], cfg["n_embd"],
                                               cfg["dropout"]))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95),
                                     weight_decay=cfg["weight_decay"])
        self.vocab = getattr(train, "VOCAB", 256)
        gen = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, self.vocab, (64, batch_size, cfg["block_size"] + 1), generator=gen)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.step_no = 0
        self.model.train()
        self.forward_backward()
        self.opt.step()  # AdamW's state exists from here on

    def forward_backward(self) -> None:
        w = self.data[self.step_no % len(self.data)]
        x, y = w[:, :-1], w[:, 1:]
        loss = F.cross_entropy(self.model(x).view(-1, self.vocab), y.reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)

    def optimizer_step(self) -> None:
        self.opt.step()
        self.step_no += 1

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = self._get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd, "step": self.step_no}


class TrainCkpt:
    """A checkpointing policy in the training loop: ``before_update`` runs between
    backward and optimizer.step(), ``after_update`` after it (where a checkpoint is
    due), ``drain`` at the end. Their time in the loop is the stall."""

    overlapped = False

    def open(self, root: Path, state: Callable[[], Any] | None = None) -> None:
        """Set up before the timed loop; ``state()`` gives the training state."""
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def before_update(self) -> None:
        pass

    def save(self, step: int, sd: Any) -> None:
        pass

    def poll(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class TrainTorchSave(TrainCkpt):
    def save(self, step: int, sd: Any) -> None:
        with open(self.root / f"step_{step}.pt", "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())


class TrainDcpAsync(TrainCkpt):
    """dcp.async_save, waiting for the previous save before the next (as torchtitan does)."""

    def __init__(self, stager: bool) -> None:
        self.use_stager, self.overlapped = stager, stager
        self.prev: Any = None
        self.staging: Any = None
        self.stager = None

    def open(self, root: Path, state: Callable[[], Any] | None = None) -> None:
        super().open(root)
        if self.use_stager:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            self.stager = DefaultStager(StagingOptions(False, True, True, False))

    def save(self, step: int, sd: Any) -> None:
        if self.prev is not None:
            self.prev.result()
        r = dcp.async_save(sd, checkpoint_id=str(self.root / f"step_{step}"), async_stager=self.stager)
        if hasattr(r, "staging_completion"):
            self.staging, self.prev = r.staging_completion, r.upload_completion
        else:
            self.prev = r

    def before_update(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def drain(self) -> None:
        self.before_update()
        if self.prev is not None:
            self.prev.result()
            self.prev = None

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


class TrainAsyncckpt(TrainCkpt):
    def __init__(self, overlap: bool) -> None:
        self.overlapped = overlap
        self.kwargs = {"overlap_staging": True} if overlap else {}
        self.mgr: Any = None
        self.pending = False

    def open(self, root: Path, state: Callable[[], Any] | None = None) -> None:
        super().open(root)
        self.mgr = asyncckpt.CheckpointManager(root, **self.kwargs)
        if state is not None:  # as the quick start does, after building model and optimizer
            self.mgr.prepare(state())

    def save(self, step: int, sd: Any) -> None:
        self.mgr.save(step, sd)
        self.pending = self.overlapped

    def before_update(self) -> None:
        if self.pending:
            self.mgr.synchronize_staging()
            self.pending = False

    def poll(self) -> None:
        self.mgr.maybe_finalize()

    def drain(self) -> None:
        self.before_update()
        self.mgr.maybe_finalize(blocking=True)

    def close(self) -> None:
        self.mgr.close()


def train_systems() -> list[tuple[str, Callable[[], TrainCkpt]]]:
    return [
        ("no checkpoint", TrainCkpt),
        ("torch.save (sync)", TrainTorchSave),
        ("dcp.async_save thread", lambda: TrainDcpAsync(False)),
        ("dcp.async_save thread + DefaultStager, overlapped", lambda: TrainDcpAsync(True)),
        ("asyncckpt persistent", lambda: TrainAsyncckpt(False)),
        ("asyncckpt persistent overlapped", lambda: TrainAsyncckpt(True)),
    ]


def train_run(tr: Trainer, ck: TrainCkpt, steps: int, every: int, root: Path) -> dict[str, Any]:
    ck.open(root, tr.state_dict)
    blocked = {"save": 0.0, "staging_wait": 0.0, "poll": 0.0}
    saves = 0
    try:
        t_start = time.perf_counter()
        for s in range(1, steps + 1):
            tr.forward_backward()
            t0 = time.perf_counter()
            ck.before_update()  # overlapped: the copy ran during this step's forward/backward
            blocked["staging_wait"] += time.perf_counter() - t0
            tr.optimizer_step()
            if every and s % every == 0:
                t0 = time.perf_counter()
                ck.save(tr.step_no, tr.state_dict())
                blocked["save"] += time.perf_counter() - t0
                saves += 1
            t0 = time.perf_counter()
            ck.poll()
            blocked["poll"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        ck.drain()  # the last save is committed inside the measured time
        drain = time.perf_counter() - t0
        total = time.perf_counter() - t_start
    finally:
        ck.close()
        shutil.rmtree(root, ignore_errors=True)
    return {"time_s": total, "saves": saves, "blocked_s": sum(blocked.values()), "drain_s": drain,
            **{f"blocked_{k}_s": v for k, v in blocked.items()}}


def bench_training(root: Path, steps: int, reps: int, every: list[int] | None, batch: int,
                   systems: set[str] | None, sparse_factor: int = 4, min_checkpoints: int = 24) -> dict[str, Any]:
    """The training loop with a checkpoint every K steps, for every K of ``every``
    (``None``: a calibrated K, where synchronous torch.save costs >= 50 %, and
    ``sparse_factor`` * K), against no checkpoint: interleaved runs, medians. Each K
    runs ``max(steps, min_checkpoints * K)`` steps (a whole number of checkpoints), its
    slowdown taken against no-checkpoint runs of the same length."""
    tr = Trainer(batch)
    sd = tr.state_dict()
    nbytes = state_bytes(sd)
    # Calibration: the step time, and the torch.save + fsync time of the training state.
    for _ in range(3):
        tr.forward_backward()
        tr.optimizer_step()
    step_times = []
    for _ in range(10 if every is None else 3):
        t0 = time.perf_counter()
        tr.forward_backward()
        tr.optimizer_step()
        step_times.append(time.perf_counter() - t0)
    save_times = []
    root.mkdir(parents=True, exist_ok=True)
    calib = TrainTorchSave()
    calib.open(root)
    for i in range(5 if every is None else 2):
        t0 = time.perf_counter()
        calib.save(i, tr.state_dict())
        save_times.append(time.perf_counter() - t0)
    shutil.rmtree(root, ignore_errors=True)
    sd_times = []
    for _ in range(10 if every is None else 3):
        t0 = time.perf_counter()
        tr.state_dict()
        sd_times.append(time.perf_counter() - t0)
    step_s, save_s = med(step_times), med(save_times)
    # Sync torch.save every K steps costs about save / (K * step): the largest K with >= 50 %.
    auto_k = max(1, math.floor(2 * save_s / step_s))
    if every:
        ks = sorted(set(every))
    else:
        # The calibrated K, and a sparser cadence (sparse_factor * K), where an
        # asynchronous write has time to finish between checkpoints.
        ks = [auto_k] + ([sparse_factor * auto_k] if sparse_factor > 1 else [])
    k = ks[0]
    # Every K runs at least ``steps`` steps and ``min_checkpoints`` checkpoints, in a whole
    # number of checkpoints: at K = 16, 96 steps held 6 checkpoints, whose cost (about
    # 7 % of the run for torch.save) was below the spread of the runs themselves (the
    # no-checkpoint runs alone spread +-9 %).
    steps_at = {kk: -(-max(steps, min_checkpoints * kk, 2 * kk) // kk) * kk for kk in ks}
    chosen = [(n, f) for n, f in train_systems() if systems is None or n in systems or n == "no checkpoint"]
    baselines = sorted(set(steps_at.values()))
    configs = ([("no checkpoint", f, 0, n_steps) for n, f in chosen if n == "no checkpoint" for n_steps in baselines]
               + [(n, f, kk, steps_at[kk]) for kk in ks for n, f in chosen if n != "no checkpoint"])
    runs: dict[tuple[str, int, int], list[dict[str, Any]]] = {(n, kk, st): [] for n, _, kk, st in configs}
    for rep in range(reps):
        for name, factory, kk, n_steps in configs:
            log(f"  training: {name}" + (f", every {kk}" if kk else "") + f", {n_steps} steps (rep {rep + 1}/{reps})")
            free_memory()
            runs[(name, kk, n_steps)].append(train_run(tr, factory(), n_steps, kk, root / "train_ckpt"))
    base = {n_steps: med([r["time_s"] for r in runs[("no checkpoint", 0, n_steps)]]) for n_steps in baselines}
    by_every: dict[int, dict[str, Any]] = {kk: {} for kk in ks}
    for (name, kk, n_steps), rs in runs.items():
        t = med([r["time_s"] for r in rs])
        per = {b: med([r[f"blocked_{b}_s"] / max(1, r["saves"]) for r in rs])
               for b in ("save", "staging_wait", "poll")}
        entry = {"time_s": t, "slowdown": t / base[n_steps] - 1, "saves": rs[0]["saves"], "steps": n_steps,
                 "blocked_per_save_s": med([r["blocked_s"] / max(1, r["saves"]) for r in rs]),
                 **{f"blocked_{b}_per_save_s": v for b, v in per.items()},
                 "drain_s": med([r["drain_s"] for r in rs]), "times_s": [r["time_s"] for r in rs]}
        for target in ([kk2 for kk2 in ks if steps_at[kk2] == n_steps] if kk == 0 else [kk]):
            by_every[target][name] = entry
    results = by_every[k]
    return {"config": tr.cfg, "params": tr.n_params, "state_bytes": nbytes, "steps": steps_at[k], "every": k,
            "auto_every": auto_k, "calib_step_s": step_s, "calib_torch_save_s": save_s,
            "state_dict_s": med(sd_times),
            "torch_save_target_met": results.get("torch.save (sync)", {}).get("slowdown", 0) >= 0.5,
            "systems": results, "every_list": ks, "every_calibrated": not every,
            "min_checkpoints": min_checkpoints,
            "sparser": [{"every": kk, "steps": steps_at[kk], "systems": by_every[kk]} for kk in ks[1:]]}


# ============================================================================ workloads

def make_workload(spec: str, train_batch: int, llm_cfg: dict[str, int] | None = None) -> tuple[Any, dict[str, Any]]:
    if spec == "llm":
        import bench_llm
        cfg = llm_cfg or bench_llm.LLM_FULL
        model, opt, sd = bench_llm.build_llm(cfg)
        n_params = sum(p.numel() for p in model.parameters())
        del model, opt  # the state's tensors are the parameters and the optimizer's state
        info = {"name": "llm", "label": (f"GPT {n_params / 1e6:.1f} M params + AdamW state from get_state_dict "
                                         f"({bench_llm.describe(cfg)}; model + optim nested dicts)"),
                "tensors": len(list(tensors_of(sd))), "config": cfg}
        return sd, info
    if spec == "train":
        tr = Trainer(train_batch)
        sd = tr.state_dict()
        info = {"name": "train", "label": (f"training example: GPT {tr.n_params / 1e6:.2f} M params + AdamW "
                                           f"({tr.cfg['n_layer']} layers, width {tr.cfg['n_embd']})"),
                "tensors": len(list(tensors_of(sd)))}
        del tr
        return sd, info
    size, _, n = spec.partition("/")
    n_tensors = int(n or 16)
    sd = make_state(parse_size(size), n_tensors)
    return sd, {"name": spec, "label": f"{size}B in {n_tensors} float32 tensors", "tensors": n_tensors}


# ============================================================================ reporting

def fmt_ms(s: float | None) -> str:
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return ""
    ms = s * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 1 else f"{ms:.2f}"


def fmt_x(x: float | None) -> str:
    return "" if x is None or math.isnan(x) else f"{x:.2f}x"


def committed_ratio(s: dict[str, Any], lim: dict[str, Any]) -> float:
    """Committed time over the mean of the raw writes + fsyncs measured right before and
    right after the system's saves (or the workload's median raw write)."""
    return s["committed_s"] / s.get("raw_write_adjacent_s", lim["raw_write_fsync_s"])


def render_markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    L: list[str] = []
    L.append("# Checkpoint benchmark\n")
    L.append(f"{m['date']} | {m['cpu_count']} CPUs ({m['cpu_model']}), torch {m['torch']} "
             f"({'CUDA' if m['cuda'] else 'CPU only'}), Python {m['python']}, {m['ram_gib']:.0f} GiB RAM, "
             f"{m['platform']}; directory on {m['fs']}; asyncckpt {m['asyncckpt']} (git {m.get('git_head', '?')}, "
             f"sources sha1 {m.get('asyncckpt_sources_sha1', '?')}); load average "
             f"{m['loadavg_start'][0]:.1f} at start, {m['loadavg_end'][0]:.1f} at end (a shared machine)\n")
    L.append(f"Medians of {res['args']['reps']} saves after a first (cold) one "
             f"({res['args']['big_reps']} for states >= 2 GiB, {res['args'].get('llm_reps', res['args']['reps'])} "
             f"on llm and fsdp2; {res['args'].get('load_reps', res['args']['reps'])} loads per method); the trainer "
             "mutates its state after every "
             "stall. **stall**: the training thread blocked until the state may be mutated; **returns**: "
             "the save call returned (for overlapped/asynchronous staging, before the copy is done); "
             "**committed**: durable (fsynced) and committed, from the call (torch.save: written + fsync), "
             "compared with the mean of the raw writes + fsyncs of the same bytes into the same directory made "
             "right before and right after the system's saves (the disk's speed drifts); **GB/s**: state bytes / committed; "
             "**peak extra**: peak over all saves of the resident memory of this process and its children (private memory summed, shared memory counted once) minus the "
             "baseline before the system was set up (workers included), as a multiple of the state bytes; "
             "**extra after #1 / last**: the same after the first and the last commit (flat = no leak). "
             "Loads start from a cold page cache (posix_fadvise DONTNEED on the fsynced files; no root for "
             "drop_caches) and load in place into the same state dict.\n")
    if res.get("skipped"):
        L.append("Skipped: " + "; ".join(res["skipped"]) + "\n")
    for w in res["workloads"]:
        lim = w["limits"]
        gib = w["bytes"] / GiB
        L.append(f"## {w['name']}: {w['label']}, {gib:.3f} GiB ({w['bytes'] / 1e6:.1f} MB)\n")
        rw = lim.get("raw_write_fsync_all_s") or [lim["raw_write_fsync_s"]]
        L.append(f"Limits: memcpy {fmt_ms(lim['memcpy_s'])} ms ({w['bytes'] / lim['memcpy_s'] / 1e9:.2f} GB/s; best of "
                 f"{len(lim.get('memcpy_all_s', [0]))}, before and after the systems), "
                 f"raw write+fsync {fmt_ms(lim['raw_write_fsync_s'])} ms "
                 f"({w['bytes'] / lim['raw_write_fsync_s'] / 1e9:.2f} GB/s; median of {len(rw)}, before, between and "
                 f"after the systems, range {fmt_ms(min(rw))}-{fmt_ms(max(rw))} ms), raw read "
                 f"{fmt_ms(lim['raw_read_cold_s'])} ms cold / {fmt_ms(lim['raw_read_warm_s'])} ms warm. "
                 f"Saves per system: {w['saves']}.\n")
        L.append("| system | stall (ms) | stall / memcpy | first stall (ms) | returns (ms) | committed (ms) | "
                 "committed / raw write around it | GB/s | peak extra | extra after #1 / last (MiB) |")
        L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        L.append(f"| *memcpy (limit)* | {fmt_ms(lim['memcpy_s'])} | 1.00x | | | | | | | |")
        L.append(f"| *raw write + fsync (limit)* | | | | | {fmt_ms(lim['raw_write_fsync_s'])} | 1.00x | "
                 f"{w['bytes'] / lim['raw_write_fsync_s'] / 1e9:.2f} | | |")
        for name, s in w["systems"].items():
            L.append(f"| {name} | {fmt_ms(s['stall_s'])} | {fmt_x(s['stall_s'] / lim['memcpy_s'])} | "
                     f"{fmt_ms(s['first_stall_s'])} | {fmt_ms(s['returns_s'])} | {fmt_ms(s['committed_s'])} | "
                     f"{fmt_x(committed_ratio(s, lim))} | {s['gbps']:.2f} | "
                     f"{s['peak_extra_ratio']:.2f}x | {s['extra_after_first_bytes'] / MiB:.0f} / "
                     f"{s['extra_after_last_bytes'] / MiB:.0f} |")
        polled = [(name, s) for name, s in w["systems"].items() if s.get("maybe_finalize_calls")]
        if polled:
            L.append("\nThe training thread's time in asyncckpt's `maybe_finalize()`, called every 2 ms while "
                     "the commit was pending (the commit runs in the finalizer thread): "
                     + "; ".join(f"{name}: median {fmt_ms(s['maybe_finalize_s'])} ms, max "
                                 f"{fmt_ms(s['maybe_finalize_max_s'])} ms over {s['maybe_finalize_calls']} calls"
                                 for name, s in polled) + ".")
        L.append("")
        if w.get("loads"):
            raw = w["loads"]["raw read (cold cache)"]["s"]
            ref = w["loads"].get("dcp.load (dcp.save checkpoint)", {}).get("s")
            L.append("| load | time (ms) | / raw read (cold) | / dcp.load |")
            L.append("|---|---:|---:|---:|")
            for name, l in w["loads"].items():
                L.append(f"| {name} | {fmt_ms(l['s'])} | {fmt_x(l['s'] / raw)} | "
                         f"{fmt_x(l['s'] / ref) if ref else ''} |")
            L.append("")
        if w.get("techniques"):
            L.append(f"asyncckpt techniques one at a time ({w['name']}):\n")
            L.append("| variant | stall (ms) | mean stall (ms) | first stall (ms) | committed (ms) | peak extra |")
            L.append("|---|---:|---:|---:|---:|---:|")
            for name, t in w["techniques"].items():
                L.append(f"| {name} | {fmt_ms(t['stall_s'])} | {fmt_ms(t.get('mean_stall_s'))} | "
                         f"{fmt_ms(t['first_stall_s'])} | {fmt_ms(t.get('committed_s'))} | "
                         f"{t['peak_extra_ratio']:.2f}x |")
            L.append("")
    tr = res.get("training")
    if tr:
        c = tr["config"]
        ks = tr.get("every_list") or [tr["every"]] + [x["every"] for x in tr.get("sparser", [])]
        L.append(f"## Training loop: checkpoint every K = {', '.join(map(str, ks))} steps\n")
        L.append(f"scripts/train.py's GPT ({c['n_layer']} layers, {c['n_head']} heads, width {c['n_embd']}, "
                 f"context {c['block_size']}, batch {c['batch_size']}; {tr['params'] / 1e6:.2f} M params) + AdamW, "
                 f"state {tr['state_bytes'] / 1e6:.1f} MB; {tr['steps']} steps per run at K = {tr['every']} (at "
                 f"least {tr.get('min_checkpoints', 0)} checkpoints per run: more steps at a sparser K, against "
                 "no-checkpoint runs of the same length), median of "
                 f"{res['args']['train_reps']} interleaved runs; the last save is committed inside the measured "
                 "time. asyncckpt's manager is made and prepare()d before the loop, as in the quick start (its "
                 "first save, planning and allocating, is in the first-save figures above). Overlapped: save after "
                 "optimizer.step() of step t, forward/backward of step t+1, then wait "
                 "for the staging before optimizer.step(). dcp.async_save waits for the previous save before the "
                 "next. **blocked**: the training thread's time in save(), the staging wait and (asyncckpt) "
                 "maybe_finalize(), per checkpoint; the rest of the slowdown is the background writer competing "
                 "with training for the same cores (and, for DCP's thread executor, the GIL). "
                 f"Calibration: step {fmt_ms(tr['calib_step_s'])} ms, torch.save+fsync "
                 f"{fmt_ms(tr['calib_torch_save_s'])} ms, so K = {tr['auto_every']} makes torch.save cost >= 50 %"
                 + (f"; get_state_dict() itself takes {fmt_ms(tr['state_dict_s'])} ms, inside every system's save()"
                    if "state_dict_s" in tr else "")
                 + ("" if tr["torch_save_target_met"] or not tr.get("every_calibrated", True)
                    else " (not reached in the measured runs)") + ".\n")
        for every, systems, n_steps in [(tr["every"], tr["systems"], None)] + [
                (x["every"], x["systems"], x.get("steps")) for x in tr.get("sparser", [])]:
            if every != tr["every"]:
                L.append(f"\nThe same with a checkpoint every K = {every} steps"
                         + (f" ({n_steps} steps per run)" if n_steps else "") + ":\n")
            L.append("| system | time (s) | slowdown | blocked per checkpoint (ms) | in save() | in staging wait | "
                     "in maybe_finalize() | final drain (ms) | checkpoints |")
            L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
            for name, s in systems.items():
                parts = [fmt_ms(s.get(f"blocked_{k}_per_save_s")) if s["saves"] else ""
                         for k in ("save", "staging_wait", "poll")]
                L.append(f"| {name} | {s['time_s']:.2f} | {100 * s['slowdown']:+.1f} % | "
                         f"{fmt_ms(s['blocked_per_save_s']) if s['saves'] else ''} | " + " | ".join(parts)
                         + f" | {fmt_ms(s.get('drain_s')) if s['saves'] else ''} | {s['saves']} |")
        L.append("")
    if res.get("fsdp2"):
        import bench_llm
        L += bench_llm.render_fsdp(res["fsdp2"], res["args"].get("llm_reps", res["args"]["reps"]))
    # Ratios summary
    names = list(dict.fromkeys(n for w in res["workloads"] for n in w["systems"]))
    if names:
        wl = res["workloads"]
        head = "| system | " + " | ".join(w["name"] for w in wl) + " |"
        sep = "|---|" + "---:|" * len(wl)
        L.append("## Ratios summary\n")
        for title, ratio in (
                ("stall / memcpy", lambda s, lim: s["stall_s"] / lim["memcpy_s"]),
                ("committed / raw write+fsync (mean of the ones right before and after the system)", committed_ratio)):
            L.append(f"{title}:\n")
            L.append(head)
            L.append(sep)
            for n in names:
                cells = [fmt_x(ratio(w["systems"][n], w["limits"])) if n in w["systems"] else "" for w in wl]
                L.append(f"| {n} | " + " | ".join(cells) + " |")
            L.append("")
        lnames = list(dict.fromkeys(n for w in wl for n in w.get("loads", {})))
        if lnames:
            L.append("load / raw read (cold), and / dcp.load of the dcp.save checkpoint:\n")
            L.append(head)
            L.append(sep)
            for n in lnames:
                cells = []
                for w in wl:
                    l = w.get("loads", {})
                    if n not in l:
                        cells.append("")
                        continue
                    ref = l.get("dcp.load (dcp.save checkpoint)", {}).get("s")
                    cells.append(fmt_x(l[n]["s"] / l["raw read (cold cache)"]["s"])
                                 + (f" / {fmt_x(l[n]['s'] / ref)}" if ref else ""))
                L.append(f"| {n} | " + " | ".join(cells) + " |")
            L.append("")
    if tr:
        for every, systems in [(tr["every"], tr["systems"])] + [(x["every"], x["systems"])
                                                               for x in tr.get("sparser", [])]:
            L.append(f"training-loop slowdown (checkpoint every {every} steps): " + ", ".join(
                f"{n} {100 * s['slowdown']:+.1f} %" for n, s in systems.items() if n != "no checkpoint") + "\n")
    targets = res.get("targets") or issue11_targets(res)
    if targets:
        L.append("## Issue 11 targets\n")
        L.append("Every figure of the issue's table, as measured in this run (asyncckpt: CheckpointManager, "
                 "persistent worker, default options; DCP: dcp.async_save thread + a reused DefaultStager; memcpy: "
                 "best of 6 copies of the same bytes into preallocated memory; raw write: the mean of the raw writes "
                 "+ fsyncs right before and after the system's saves; raw read: cold page cache).\n")
        L.append("| target | measured | goal | met |")
        L.append("|---|---|---|---|")
        for t in targets:
            met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
            L.append(f"| {t['target']} | {t['measured']} | {t['goal']} | {met} |")
        L.append("")
    if res.get("lightning_md"):
        L.append("## Lightning checkpoints\n")
        L.append(res["lightning_md"] + "\n")
    L.append(f"Total benchmark time: {res['total_s'] / 60:.1f} min.\n")
    return "\n".join(L)


ACK, ACK_PREP, DCP_STAGER = ("asyncckpt persistent", "asyncckpt persistent + prepare()",
                              "dcp.async_save thread + DefaultStager")


def issue11_targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of issue 11's table: ``target``, ``measured`` (text), ``goal`` and ``met``
    (True / False, None where this run did not measure it)."""
    wls = {w["name"]: w for w in res.get("workloads", [])}
    rows: list[dict[str, Any]] = []

    def row(target: str, goal: str, measured: str | None, met: bool | None) -> None:
        rows.append({"target": target, "goal": goal, "measured": measured or "not measured in this run",
                     "met": met if measured else None})

    def sys_of(wname: str, sname: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        w = wls.get(wname)
        return (w, w["systems"].get(sname)) if w else (None, None)

    # steady stall vs memcpy and vs DCP
    for wname, label in (("llm", "steady stall, LLM state"),):
        w, a = sys_of(wname, ACK)
        _, d = sys_of(wname, DCP_STAGER)
        if w and a:
            r = a["stall_s"] / w["limits"]["memcpy_s"]
            txt = f"{fmt_ms(a['stall_s'])} ms = {fmt_x(r)} memcpy ({fmt_ms(w['limits']['memcpy_s'])} ms)"
            if d:
                txt += f"; DCP {fmt_ms(d['stall_s'])} ms = {fmt_x(d['stall_s'] / w['limits']['memcpy_s'])}"
            row(label, "<= 1.3x memcpy and below DCP's", txt, r <= 1.3 and (d is None or a["stall_s"] < d["stall_s"]))
        else:
            row(label, "<= 1.3x memcpy and below DCP's", None, None)
    f = res.get("fsdp2")
    a = f["systems"].get(ACK) if f else None
    if a:
        d = f["systems"].get(DCP_STAGER)
        txt = f"{fmt_ms(a['stall_s'])} ms = {fmt_x(a['stall_memcpy_ratio'])} memcpy (max over ranks)"
        if d:
            txt += f"; DCP {fmt_ms(d['stall_s'])} ms = {fmt_x(d['stall_memcpy_ratio'])}"
        row("steady stall, FSDP2 (2 ranks)", "<= 1.3x memcpy and below DCP's", txt,
            a["stall_memcpy_ratio"] <= 1.3 and (d is None or a["stall_s"] < d["stall_s"]))
    else:
        row("steady stall, FSDP2 (2 ranks)", "<= 1.3x memcpy and below DCP's", None, None)
    w, a = sys_of("1G/4096", ACK)
    if w and a:
        r = a["stall_s"] / w["limits"]["memcpy_s"]
        row("steady stall, 1 GiB in 4096 tensors", "<= 1.5x memcpy",
            f"{fmt_ms(a['stall_s'])} ms = {fmt_x(r)} memcpy ({fmt_ms(w['limits']['memcpy_s'])} ms)", r <= 1.5)
    else:
        row("steady stall, 1 GiB in 4096 tensors", "<= 1.5x memcpy", None, None)
    for wname in ("1G/16", "1G/4096"):
        w, a = sys_of(wname, ACK)
        label = f"committed, {wname.split('/')[1]} tensors ({wname})"
        if w and a:
            r = committed_ratio(a, w["limits"])
            row(label, "<= 1.1x raw write + fsync",
                f"{fmt_ms(a['committed_s'])} ms = {fmt_x(r)} raw write+fsync", r <= 1.1)
        else:
            row(label, "<= 1.1x raw write + fsync", None, None)
    w, a = sys_of("llm", ACK)
    _, p = sys_of("llm", ACK_PREP)
    _, d = sys_of("llm", DCP_STAGER)
    for sysfig, label in ((a, "first save, LLM state (default)"), (p, "first save, LLM state (with prepare())")):
        if sysfig and d:
            row(label, "<= DCP's first async_save",
                f"{fmt_ms(sysfig['first_stall_s'])} ms; DCP {fmt_ms(d['first_stall_s'])} ms",
                sysfig["first_stall_s"] <= d["first_stall_s"])
        else:
            row(label, "<= DCP's first async_save", None, None)
    for wname in ("1G/4096", "llm"):
        w = wls.get(wname)
        loads = (w or {}).get("loads", {})
        # The default, verify='inline': every byte checked as it is read (one pass).
        l, raw = loads.get("asyncckpt.load verify='inline'"), loads.get("raw read (cold cache)")
        label = f"load (verify on), {wname}"
        if l and raw:
            r = l["s"] / raw["s"]
            txt = f"{fmt_ms(l['s'])} ms = {fmt_x(r)} raw read ({fmt_ms(raw['s'])} ms), verify='inline' (default)"
            first = loads.get("asyncckpt.load verify=True")
            if first:
                txt += f"; verify=True (checked first, two reads) {fmt_x(first['s'] / raw['s'])}"
            row(label, "<= 1.2x raw read (cold cache)", txt, r <= 1.2)
        else:
            row(label, "<= 1.2x raw read (cold cache)", None, None)
    tr = res.get("training")
    by_every = {}
    if tr:
        by_every = {tr["every"]: tr["systems"], **{x["every"]: x["systems"] for x in tr.get("sparser", [])}}
    for k in sorted(set(by_every) | {1, 4, 16}):
        sysk = by_every.get(k, {})
        a, t = sysk.get(ACK), sysk.get("torch.save (sync)")
        label = f"training loop, K = {k}"
        if a and t:
            o = sysk.get("asyncckpt persistent overlapped")
            row(label, "slowdown below synchronous torch.save's",
                f"{100 * a['slowdown']:+.1f} %" + (f" (overlapped {100 * o['slowdown']:+.1f} %)" if o else "")
                + f"; torch.save {100 * t['slowdown']:+.1f} %", a["slowdown"] < t["slowdown"])
        else:
            row(label, "slowdown below synchronous torch.save's", None, None)
    for wname in ("1G/16", "1G/4096", "llm"):
        w, a = sys_of(wname, ACK)
        label = f"staging memory, {wname}"
        if w and a and a.get("peak_extra_bytes"):
            drift = (a["extra_after_last_bytes"] - a["extra_after_first_bytes"]) / w["bytes"]
            flat = abs(drift) <= 0.05
            row(label, "<= 1.1x the state, flat",
                f"peak extra {fmt_x(a['peak_extra_ratio'])} the state (all processes); after #1 / last "
                f"{a['extra_after_first_bytes'] / MiB:.0f} / {a['extra_after_last_bytes'] / MiB:.0f} MiB "
                f"({'flat' if flat else f'{100 * drift:+.0f} % of the state'})",
                a["peak_extra_ratio"] <= 1.1 and flat)
        else:
            row(label, "<= 1.1x the state, flat", None, None)
    return rows


def render_png(res: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wl = res["workloads"]
    names = list(dict.fromkeys(n for w in wl for n in w["systems"]))
    fig, axes = plt.subplots(2, 1, figsize=(max(10, 2.4 * len(wl) + 5), 10))
    width = 0.8 / (len(names) + 1)
    cmap = plt.get_cmap("tab20")
    for ax, (key, limkey, title, limname, color) in zip(axes, (
            ("stall_s", "memcpy_s", "stall per save (training thread blocked)", "memcpy (limit)", "black"),
            ("committed_s", "raw_write_fsync_s", "time until committed (durable)", "raw write+fsync (limit)",
             "dimgray"))):
        xs = range(len(wl))
        ax.bar([x - 0.4 + width / 2 for x in xs], [w["limits"][limkey] * 1e3 for w in wl], width,
               color=color, hatch="//" if color != "black" else None, label=limname)
        for j, n in enumerate(names):
            vals = [w["systems"][n][key] * 1e3 if n in w["systems"] else 0 for w in wl]
            ax.bar([x - 0.4 + width * (j + 1.5) for x in xs], vals, width, color=cmap(j % 20), label=n)
        ax.set_yscale("log")
        ax.set_ylabel("ms (log scale)")
        ax.set_title(title)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{w['name']}\n" + (f"{w['bytes'] / GiB:.2f} GiB" if w["bytes"] >= GiB // 4
                                                 else f"{w['bytes'] / 1e6:.1f} MB") for w in wl])
        ax.grid(axis="y", which="both", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    h1, l1 = axes[1].get_legend_handles_labels()
    handles, labels = [h1[0]] + handles, [l1[0]] + labels
    fig.legend(handles, labels, fontsize=8, ncol=4, loc="lower center", frameon=False)
    m = res["machine"]
    fig.suptitle(f"Checkpoint saves: medians after the first save ({m['cpu_count']} CPUs, torch {m['torch']})")
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ============================================================================ main

def sources_sha1() -> str:
    """A hash of asyncckpt's sources as measured (the working tree may be uncommitted)."""
    import hashlib
    h = hashlib.sha1()
    pkg = Path(asyncckpt.__file__).parent
    for f in sorted(pkg.rglob("*.py")):
        h.update(str(f.relative_to(pkg)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def git_head() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "asyncckpt"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out + (" + uncommitted asyncckpt changes" if dirty else "")
    except Exception:
        return "?"


def machine_info(directory: Path) -> dict[str, Any]:
    cpu_model = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    fs = "?"
    with contextlib.suppress(OSError):
        best = ""
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, kind = line.split()[:3]
            if str(directory.resolve()).startswith(mnt) and len(mnt) >= len(best):
                best, fs = mnt, f"{kind} ({dev} at {mnt})"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu_count": os.cpu_count(),
            "cpu_model": cpu_model, "torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "python": platform.python_version(), "platform": platform.platform(), "ram_gib": ram, "fs": fs,
            "asyncckpt": asyncckpt.__version__, "torch_threads": torch.get_num_threads(),
            "loadavg_start": os.getloadavg(), "asyncckpt_sources_sha1": sources_sha1(),
            "git_head": git_head()}


def init_process_group() -> None:
    """A 1-rank gloo group on 127.0.0.1 (DCP's process executor needs one), for every
    system alike."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=None,
                   help=f"comma-separated: SIZE/NTENSORS or 'train' (default {DEFAULT_WORKLOADS})")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated keys of {SYSTEM_KEYS}, for every workload (default: all but "
                        "ack-prepare on the synthetic states and train; dcp-async-thread-stager, ack-persistent and "
                        "ack-prepare on llm and fsdp2)")
    p.add_argument("--llm-config", default=None,
                   help="the llm / fsdp2 GPT's size as n_layer=24,n_embd=560,n_head=8,block_size=128 (default those: "
                        "~1 GiB of params + AdamW state in 1172 tensors; --quick: a tiny one)")
    p.add_argument("--reps", type=int, default=3, help="saves after the first, per system (%(default)s)")
    p.add_argument("--big-reps", type=int, default=2, help="the same for states >= 2 GiB (%(default)s)")
    p.add_argument("--llm-reps", type=int, default=5,
                   help="saves after the first, per system, on llm and fsdp2 (%(default)s: their stalls vary "
                        "more on a shared machine)")
    p.add_argument("--load-reps", type=int, default=None,
                   help="loads per method (default: 5; cold reads of this disk vary up to 3x)")
    p.add_argument("--techniques", default="1G/16,1G/4096",
                   help="workloads on which asyncckpt's techniques are measured one by one ('' for none)")
    p.add_argument("--technique-reps", type=int, default=2, help="saves after the first, per variant (%(default)s)")
    p.add_argument("--train-steps", type=int, default=96,
                   help="steps per training run at least (%(default)s), rounded up to a whole number of "
                        "checkpoints at each K")
    p.add_argument("--train-min-checkpoints", type=int, default=24,
                   help="checkpoints per training run at least: a sparse K runs more steps (%(default)s: 384 "
                        "steps at K = 16, whose 6 checkpoints in 96 steps cost less than the runs' own spread)")
    p.add_argument("--train-reps", type=int, default=3, help="interleaved training runs per system (%(default)s)")
    p.add_argument("--train-every", default="1,4,16",
                   help="checkpoint every K steps, for each K of this comma-separated list (the issue's K = 1, 4, "
                        "16); 'auto': a calibrated K where torch.save costs >= 50 %% and FACTOR*K (%(default)s)")
    p.add_argument("--train-sparse-factor", type=int, default=4,
                   help="with --train-every auto: also measure a checkpoint every FACTOR*K steps (1: not) "
                        "(%(default)s)")
    p.add_argument("--train-batch", type=int, default=1,
                   help="sequences per step (%(default)s: the example's model at its default size, with a "
                        "batch small enough that torch.save can cost >= 50 %%)")
    p.add_argument("--no-train", action="store_true", help="skip the training-loop measurement")
    p.add_argument("--lightning-mb", type=int, default=256,
                   help="MiB of the Lightning checkpoint compared with Lightning's AsyncCheckpointIO "
                        "(scripts/bench_lightning.py; needs the lightning extra; 0 to skip) (%(default)s)")
    p.add_argument("--no-memory", action="store_true", help="do not sample memory")
    p.add_argument("--share-dcp-daemon", action="store_true",
                   help="keep DCP's process-executor daemon between systems (faster; its memory is then "
                        "counted only where it was started; default with --quick)")
    p.add_argument("--dir", default=None, help="directory to write into (default: a new temp dir under "
                                                 f"{tempfile.gettempdir()}, removed at the end)")
    p.add_argument("--json", default="bench_results.json", help="JSON output (%(default)s)")
    p.add_argument("--png", default=None, help="PNG chart (default: bench_results.png; '' for none)")
    p.add_argument("--md", default=None, help="also write the markdown here")
    p.add_argument("--quick", action="store_true", help="smoke run: a few MiB, 2 reps, tiny training run (< 60 s)")
    p.add_argument("--render", metavar="JSON", help="measure nothing: print the markdown (and --md, --png) of "
                                                    "an earlier run's JSON")
    args = p.parse_args(argv)
    if args.render:  # a chart only where asked for
        res = json.loads(Path(args.render).read_text())
        md = render_markdown(res)
        print(md)
        if args.md:
            Path(args.md).write_text(md)
        if args.png and res["workloads"]:
            render_png(res, Path(args.png))
        return 0
    args.png = "bench_results.png" if args.png is None else args.png
    if args.quick:
        args.workloads = args.workloads or QUICK_WORKLOADS
        args.reps = args.big_reps = args.llm_reps = 2
        args.techniques = "4M/16" if args.techniques == p.get_default("techniques") else args.techniques
        args.share_dcp_daemon = True
        args.train_steps, args.train_reps, args.train_sparse_factor = 4, 1, 2
        args.train_min_checkpoints = 2
        if args.train_every == p.get_default("train_every"):
            args.train_every = "1,2"
        if args.llm_config is None:
            import bench_llm
            args.llm_config = ",".join(f"{k}={v}" for k, v in bench_llm.LLM_TINY.items())
        args.technique_reps = 1
        if args.lightning_mb == p.get_default("lightning_mb"):
            args.lightning_mb = 8
    args.workloads = DEFAULT_WORKLOADS if args.workloads is None else args.workloads
    args.load_reps = args.load_reps or (args.reps if args.quick else 5)
    keys = args.systems.split(",") if args.systems else None
    unknown = set(keys or ()) - set(SYSTEM_KEYS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; known: {SYSTEM_KEYS}")
    technique_set = {t for t in args.techniques.split(",") if t}
    global SHARE_DCP_DAEMON
    SHARE_DCP_DAEMON = args.share_dcp_daemon

    t_total = time.perf_counter()
    # Scratch in the temp directory (/tmp here, the same disk), never in the working tree.
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_"))
    base.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"machine": machine_info(base), "args": vars(args), "workloads": [], "skipped": []}
    params = manager_params()
    missing = {s.key: s for s in all_systems() if isinstance(s, Asyncckpt) and s.missing()}
    for s in missing.values():
        res["skipped"].append(f"{s.name}: CheckpointManager has no {', '.join(s.missing())}")
    if not hasattr(asyncckpt.CheckpointManager, "prepare"):
        missing["ack-prepare"] = all_systems()[-1]
        res["skipped"].append("asyncckpt persistent + prepare(): CheckpointManager has no prepare")

    def systems_for(spec: str) -> list[System]:
        """Fresh system objects for a workload: --systems if given, else its defaults."""
        import bench_llm
        chosen = keys if keys is not None else (
            list(bench_llm.LLM_SYSTEMS) if spec in ("llm", "fsdp2") else DEFAULT_SYSTEM_KEYS)
        return [s for s in all_systems() if s.key in chosen and s.key not in missing]

    res["manager_params"] = sorted(params)
    llm_cfg = None
    if args.llm_config:
        import bench_llm
        llm_cfg = dict(bench_llm.LLM_FULL)
        for item in args.llm_config.split(","):
            k, _, v = item.partition("=")
            llm_cfg[k.strip()] = int(v)
    init_process_group()
    sampler = MemorySampler(enabled=not args.no_memory)
    try:
        for spec in [w for w in args.workloads.split(",") if w]:
            if spec == "fsdp2":
                import bench_llm
                cfg = llm_cfg or bench_llm.LLM_FULL
                log(f"workload fsdp2: 2 ranks ({bench_llm.describe(cfg)})")
                keys_f = [s.key for s in systems_for(spec)]
                f = bench_llm.run_fsdp(cfg, args.llm_reps, base / "fsdp2", systems=tuple(keys_f))
                f["label"] = bench_llm.describe(cfg)
                f["config"] = cfg
                res["fsdp2"] = f
                continue
            systems = systems_for(spec)
            sd, info = make_workload(spec, args.train_batch, llm_cfg)
            host = host_tensors(sd)  # the raw write / read limits' bytes
            nbytes = state_bytes(sd)
            reps = args.big_reps if nbytes >= 2 * GiB else args.llm_reps if spec == "llm" else args.reps
            saves = reps + 1
            log(f"workload {spec}: {nbytes / GiB:.3f} GiB, {info['tensors']} tensors")
            wdir = base / spec.replace("/", "_")
            wdir.mkdir(parents=True, exist_ok=True)
            memcpy_times = bench_memcpy(sd, 3)
            raw_path = wdir / "raw.bin"
            raw_write(host, raw_path)  # warm-up (file system allocation), not reported
            raw_times: list[float] = []
            w: dict[str, Any] = {**info, "bytes": nbytes, "saves": saves, "systems": {}, "limits": {}}
            kept: dict[str, Path] = {}
            # The disk's speed drifts on a shared machine: raw writes + fsyncs of the same
            # bytes right before and right after each system's saves are its reference.
            raw_times.append(raw_write(host, raw_path))
            for s in systems:
                log(f"  {s.name}")
                if s.key == "ack-prepare":
                    s.prepare_sd = sd  # type: ignore[attr-defined]
                r = run_system(s, sd, wdir / s.key, saves, sampler, nbytes, keep_last=s.loadable)
                raw_times.append(raw_write(host, raw_path))
                r["raw_write_before_s"], r["raw_write_after_s"] = raw_times[-2], raw_times[-1]
                r["raw_write_adjacent_s"] = (raw_times[-2] + raw_times[-1]) / 2
                if "_last_path" in r:
                    kept[s.key] = Path(r.pop("_last_path"))
                w["systems"][s.name] = r
            memcpy_times += bench_memcpy(sd, 3)
            w["limits"].update({
                "memcpy_s": min(memcpy_times), "memcpy_all_s": memcpy_times,
                "raw_write_fsync_s": med(raw_times), "raw_write_fsync_all_s": raw_times})
            log("  loads")
            w["loads"] = bench_loads(sd, kept, raw_path, min(args.load_reps, reps) if nbytes >= 2 * GiB
                                     else args.load_reps, host)
            w["limits"]["raw_read_cold_s"] = w["loads"]["raw read (cold cache)"]["s"]
            w["limits"]["raw_read_warm_s"] = w["loads"]["raw read (warm cache)"]["s"]
            for path in kept.values():
                remove(path)
            remove(raw_path)
            if spec in technique_set:
                ref = w["systems"].get("asyncckpt persistent", {}).get("committed_s", w["limits"]["raw_write_fsync_s"])
                w["techniques"], skipped = bench_techniques(sd, wdir, args.technique_reps + 1, sampler,
                                                            nbytes, ref)
                res["skipped"] += [f"{spec}: {s}" for s in skipped]
            shutil.rmtree(wdir, ignore_errors=True)
            res["workloads"].append(w)
            del sd, kept, host
            free_memory()
        if not args.no_train:
            log("training loop")
            every = (None if args.train_every.strip() == "auto"
                     else [int(k) for k in args.train_every.split(",") if k.strip()])
            res["training"] = bench_training(base / "train", args.train_steps, args.train_reps, every,
                                             args.train_batch, None, args.train_sparse_factor,
                                             args.train_min_checkpoints)
        if args.lightning_mb:
            try:
                import bench_lightning
            except ImportError as exc:  # no lightning installed
                res["skipped"].append(f"Lightning plugins: {exc}")
            else:
                log("Lightning: AsyncckptCheckpointIO against AsyncCheckpointIO")
                res["lightning"] = bench_lightning.run(reps=args.reps, size_mb=args.lightning_mb,
                                                       directory=base / "lightning")
                res["lightning_md"] = bench_lightning.render_markdown(res["lightning"])
    finally:
        sampler.close()
        terminate_dcp_daemon()
        if dist.is_initialized():
            dist.destroy_process_group()
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    res["total_s"] = time.perf_counter() - t_total
    res["targets"] = issue11_targets(res)
    res["machine"]["loadavg_end"] = os.getloadavg()
    md = render_markdown(res)
    print(md)
    if args.md:
        Path(args.md).write_text(md)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str))
    if args.png and res["workloads"]:
        render_png(res, Path(args.png))
    log(f"JSON: {out}" + (f", PNG: {args.png}" if args.png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
