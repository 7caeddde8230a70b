"""The node-local tier (issue 31): save stall and restore times against their raw limits.

2 x ``--ranks-per-node`` gloo ranks (default 4) on this machine standing for 2 nodes (``LocalTier(node=rank //
--ranks-per-node)``, one tier directory per node, under ``/dev/shm`` by default), each with a state of
about ``--mb`` MB: ``--workload uniform`` (``--tensors`` float32 tensors), ``llm``
(scripts/train.py's GPT + AdamW state from ``get_state_dict``, :mod:`benchmark.llm`, 24
layers, its width chosen for ``--mb``: about 1170 tensors in nested dicts) or ``fsdp2``
(the same model under FSDP2 on all the ranks, each holding about ``--mb`` MB of
DTensor shards; a rank's restore loads them through ``asyncckpt.load``). Ratios are
taken within one run, each against its limit measured by the same ranks, at the same
time (every rank at once, between two barriers, as the restores are timed), on the same
bytes, right next to it (``--reps`` rounds; the median of the ratios):

- local save stall (``manager.local.save``, steady state, median) / memcpy of the
  state into preallocated memory; with ``overlap_staging=True``, the time ``save()``
  takes to return (its large tensors then copied by a thread) and until its copy is
  over (``synchronize_staging()`` right after it), / the same memcpy;
- local restore (every shard on its node: read + CRC-32 of every byte + load into the
  state) / the raw read of the same files (``os.preadv`` of this rank's files of the
  restored step, 2 MiB per buffer, into preallocated memory), and / memcpy of the same
  bytes into preallocated memory;
- peer restore (node 1's tier wiped: ranks 2 and 3 receive their shards from node 0 over
  gloo straight into their state and check every byte; ranks 0 and 1 load theirs from
  their node meanwhile) / the raw gloo transfer (one isend/irecv of the same bytes
  between the same ranks into preallocated memory), and / the same transfer while
  node 0's ranks read their own files raw (the least their own restore adds on their
  cores);
- persistent tier restore (``asyncckpt.load`` of the root's copy of the same step,
  every byte CRC-checked) / the raw read of what a rank reads of it (the whole state's
  data files; ``fsdp2``: the rank's own file), every rank at once;
- the local and peer restores are timed on a manager whose persistent worker has
  started (:func:`_worker_started`): a manager starts its worker as it opens, and on 2
  cores that start-up (a process importing torch, per rank) takes about half the CPU
  from a restore timed right after. The rows "as the manager opens" time that first
  restore (the same manager, the same bytes), what a restart on a small machine sees;
- training slowdown: ``--train-steps`` steps (fixed compute, a small all-reduce, a
  write to the state) with a local save every step (also overlapped:
  ``synchronize_staging()`` before the write to the state), and with a persistent save
  every 4 steps, each / the same loop without checkpoints. The persistent tier's roots
  are beside the tiers (``--dir``) unless ``--root-dir`` puts them on another file
  system (a disk, standing for the shared storage the persistent tier is).

    python scripts/bench_local_tier.py --mb 64
    python scripts/bench.py local-tier --mb 64 --workload llm
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import asyncckpt
from asyncckpt.format.naming import step_dir_name
from asyncckpt.io.storage import preadv_all

from .common import mutate, tensors_of


def _state(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """This rank's state: ``--workload uniform``, ``llm`` or ``fsdp2`` (about ``--mb`` MB)."""
    if args.workload in ("llm", "fsdp2"):
        from . import llm

        # (under FSDP2 each rank holds 1 / world_size of the state)
        full = args.mb * (1 << 20) * (2 * args.ranks_per_node if args.workload == "fsdp2" else 1)
        cfg = llm.llm_of_bytes(full)
        model, opt, sd = llm.build_llm(cfg, fsdp=args.workload == "fsdp2", rank=rank, device="cpu")
        if args.workload == "fsdp2":
            _MODELS.append((model, opt))  # (the DTensors' module and optimizer live as long as the run)
        return {**sd, "step": 0}
    n = args.mb * (1 << 20) // 4 // args.tensors
    g = torch.Generator().manual_seed(rank)
    return {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(args.tensors)} | {"step": 0}


#: The fsdp2 workload's model and optimizer, kept while their DTensors are saved and restored.
_MODELS: list[tuple[Any, Any]] = []


def _local(sd: dict[str, Any]) -> list[torch.Tensor]:
    """The rank's own bytes: DTensors' local shards, plain tensors as they are."""
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors_of(sd)]


def _copy(src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
    """libc's memmove per tensor (torch's ``copy_`` wakes its intra-op threads for each
    tensor: milliseconds per call on this busy machine, seconds for an LLM state)."""
    for d, s in zip(dst, src):
        ctypes.memmove(d.data_ptr(), s.data_ptr(), s.numel() * s.element_size())


def _memcpy(src: list[torch.Tensor], dst: list[torch.Tensor]) -> float:
    """Seconds to copy ``src`` into ``dst`` (preallocated, faulted in) on every rank at
    once, between two barriers (as the restores are timed)."""
    dist.barrier()
    t0 = time.perf_counter()
    _copy(src, dst)
    dist.barrier()
    return time.perf_counter() - t0


def _own_files(base: Path, rank: int, per_node: int) -> list[Path]:
    """This rank's files of its restorable step in its node's tier directory (the bytes
    a local restore reads)."""
    shard = base / f"node{rank // per_node}" / f"rank_{rank:05d}"
    step = json.loads((shard / "restorable.json").read_bytes())["step"]
    return sorted(p for p in (shard / step_dir_name(step)).iterdir() if p.is_file())


def _raw_read(files: list[Path], buf: torch.Tensor, barriers: bool = True) -> float:
    """Seconds to read ``files`` with ``os.preadv`` (2 MiB per buffer, one call per
    1024 of them) into ``buf`` (preallocated, faulted in), on every rank at once,
    between two barriers (as the restores are timed; ``barriers=False``: this rank
    alone, no barrier)."""
    mem = memoryview(buf.numpy()).cast("B")  # type: ignore[arg-type]
    chunk = 2 << 20
    if barriers:
        dist.barrier()
    t0 = time.perf_counter()
    pos = 0
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            views = [mem[pos + o : pos + min(size, o + chunk)] for o in range(0, size, chunk)]
            preadv_all(fd, views, 0, str(path))
        finally:
            os.close(fd)
        pos += size
    if barriers:
        dist.barrier()
    elapsed = time.perf_counter() - t0
    mem.release()
    return elapsed


def _raw_transfer(buf: torch.Tensor, rank: int, per_node: int, meanwhile: Callable[[], Any] | None) -> float:
    """Seconds to send ``buf``'s bytes from node 0's rank r to node 1's rank r + ``per_node``, all at once,
    into preallocated memory (``buf``, faulted in), between two barriers; with
    ``meanwhile``, the senders call it while they send (the raw read of their own
    files: the least a restore of node 0's own shards adds while it serves node 1)."""
    dist.barrier()
    t0 = time.perf_counter()
    work = dist.isend(buf, rank + per_node) if rank < per_node else dist.irecv(buf, rank - per_node)
    assert work is not None
    if meanwhile is not None and rank < per_node:
        meanwhile()
    work.wait()
    dist.barrier()
    return time.perf_counter() - t0


def _worker_started(mgr: Any, timeout: float = 120.0) -> None:
    """Wait until ``mgr``'s persistent worker has finished starting (imported torch and
    the training script, then idle: its CPU time still over 0.1 s): a manager starts it
    when it opens, and on 2 cores its start-up would take half the CPU from a restore
    timed right after (the ``cold`` rows show that)."""
    import psutil

    pid = getattr(mgr.queue.caller, "worker_pid", None)
    if pid is None:
        return
    proc = psutil.Process(pid)
    deadline = time.monotonic() + timeout
    last = -1.0
    while time.monotonic() < deadline:
        cpu = sum(proc.cpu_times()[:2])
        if cpu == last:
            return
        last = cpu
        time.sleep(0.1)


def _training(
    args: argparse.Namespace, sd: dict[str, Any], base: Path, roots: Path, rank: int, tier: Any
) -> dict[str, float]:
    """Seconds of ``--train-steps`` training steps (a fixed compute, then an all-reduce
    of a small gradient, then a write to the state): without checkpoints, with a local
    save every step (``local-overlapped``: with ``overlap_staging=True``, the state
    released by ``synchronize_staging()`` before it is written to), with a persistent
    save every 4 steps (each in a root of its own)."""
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    grad = torch.zeros(1 << 16)

    def run(mode: str) -> float:
        root = roots / f"train_{mode}"
        overlap = mode == "local-overlapped"
        local = (
            dataclasses.replace(tier, dir=str(base / f"train_{mode}_node{rank // args.ranks_per_node}"))
            if mode.startswith("local")
            else None
        )
        with asyncckpt.CheckpointManager(root, local=local, overlap_staging=overlap or None) as mgr:
            dist.barrier()
            t0 = time.perf_counter()
            for step in range(1, args.train_steps + 1):
                for _ in range(8):
                    torch.mm(a, b)
                dist.all_reduce(grad)
                if overlap:
                    mgr.synchronize_staging()
                mutate(sd)
                if local is not None:
                    assert mgr.local is not None
                    mgr.local.save(step, sd)
                    mgr.local.maybe_finalize()
                elif mode == "persistent" and step % 4 == 0:
                    mgr.save(step, sd)
                    mgr.maybe_finalize()
            elapsed = time.perf_counter() - t0
            if mgr.local is not None:
                mgr.local.maybe_finalize(blocking=True)
            mgr.maybe_finalize(blocking=True)
        _remove(rank, args.ranks_per_node, root, None if local is None else Path(local.dir))
        return elapsed

    return {mode: run(mode) for mode in ("none", "local", "local-overlapped", "persistent")}


def _remove(rank: int, per_node: int, root: Path, tier_dir: Path | None) -> None:
    """Remove a closed manager's root (rank 0) and tier directory (each node's first
    rank), after a barrier: a large state's tiers would otherwise fill ``/dev/shm``."""
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    if tier_dir is not None and rank % per_node == 0:
        shutil.rmtree(tier_dir, ignore_errors=True)
    dist.barrier()


def _file_system(path: str) -> str:
    """The type and device of the file system that holds ``path`` (e.g. ``ext4 on /dev/vda``)."""
    import psutil

    real = os.path.realpath(path)
    holding = [p for p in psutil.disk_partitions(all=True) if os.path.commonpath([real, p.mountpoint]) == p.mountpoint]
    best = max(holding, key=lambda p: len(p.mountpoint), default=None)  # the innermost mount
    return "?" if best is None else f"{best.fstype} on {best.device}"


def _restore(mgr: Any, sd: dict[str, Any]) -> float:
    """Seconds of ``mgr.restore(sd)`` on every rank at once, between two barriers."""
    dist.barrier()
    t0 = time.perf_counter()
    assert mgr.restore(sd) is not None
    dist.barrier()
    return time.perf_counter() - t0


def _rank(rank: int, args: argparse.Namespace, store: str, out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=2 * args.ranks_per_node,
        timeout=timedelta(seconds=300),
    )
    try:
        base = Path(args.dir)
        roots = Path(args.root_dir)  # the persistent tier's roots (the tiers' directories are under base)
        node = rank // args.ranks_per_node
        tier = asyncckpt.LocalTier(dir=str(base / f"node{node}"), every=1, replicas=1, node=node)
        sd = _state(args, rank)
        src = _local(sd)
        assert all(t.is_contiguous() for t in src)
        nbytes = sum(t.numel() * t.element_size() for t in src)
        dst = [torch.empty_like(t) for t in src]
        for d, t in zip(dst, src):
            d.copy_(t)  # faulted in
        stalls, memcpys = [], []
        with asyncckpt.CheckpointManager(roots / "root", local=tier) as mgr:
            assert mgr.local is not None
            for step in range(1, args.saves + 1):
                mutate(sd)
                memcpys.append(_memcpy(src, dst))
                dist.barrier()
                t0 = time.perf_counter()
                mgr.local.save(step, sd)
                stalls.append(time.perf_counter() - t0)
                mgr.local.maybe_finalize(blocking=True)  # the steady state: the previous save is done
            mgr.save(args.saves, sd)  # the persistent tier's copy of the same step (a tie: the local tier restores)
            mgr.maybe_finalize(blocking=True)
        returns, copied = [], []  # the same saves overlapped, in a tier and root of their own
        overlapped_tier = dataclasses.replace(tier, dir=str(base / f"overlapped_node{node}"))
        with asyncckpt.CheckpointManager(roots / "root_overlapped", local=overlapped_tier, overlap_staging=True) as mgr:
            assert mgr.local is not None
            for step in range(1, args.saves + 1):
                mutate(sd)
                dist.barrier()
                t0 = time.perf_counter()
                mgr.local.save(step, sd)
                returns.append(time.perf_counter() - t0)
                mgr.synchronize_staging()
                copied.append(time.perf_counter() - t0)
                mgr.local.maybe_finalize(blocking=True)
        _remove(rank, args.ranks_per_node, roots / "root_overlapped", Path(overlapped_tier.dir))
        train = _training(args, sd, base, roots, rank, tier)
        if rank == args.ranks_per_node:  # node 1's first rank
            shutil.copytree(base / "node1", base / "node1.intact")
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        own = _own_files(base, rank, args.ranks_per_node)
        readbuf = torch.ones(sum(p.stat().st_size for p in own), dtype=torch.uint8)  # faulted in
        local_times, local_limits, read_limits, peer_times, peer_limits, busy_limits = [], [], [], [], [], []
        local_cold: list[float] = []
        peer_cold: list[float] = []
        step_dir = roots / "root" / step_dir_name(args.saves)
        # what a rank reads of the persistent step: its own shards (fsdp2), else the whole state
        if args.workload == "fsdp2":
            persisted = [step_dir / f"__{rank}_0.distcp"]
        else:
            persisted = sorted(step_dir.glob("*.distcp"))
        persist_buf = torch.ones(sum(p.stat().st_size for p in persisted), dtype=torch.uint8)  # faulted in
        persist_times, persist_limits = [], []
        for _ in range(args.reps):
            if rank == args.ranks_per_node:  # node 1 as it was saved
                shutil.rmtree(base / "node1", ignore_errors=True)
                shutil.copytree(base / "node1.intact", base / "node1")
            persist_limits.append(_raw_read(persisted, persist_buf))
            dist.barrier()
            t0 = time.perf_counter()
            asyncckpt.load(sd, step_dir)  # (every rank; CRC-checked as read)
            dist.barrier()
            persist_times.append(time.perf_counter() - t0)
            local_limits.append(_memcpy(src, dst))
            read_limits.append(_raw_read(own, readbuf))
            with asyncckpt.CheckpointManager(roots / "root", local=tier) as mgr:
                local_cold.append(_restore(mgr, sd))  # (its worker starting beside it)
                _worker_started(mgr)
                local_times.append(_restore(mgr, sd))
                assert mgr.local is not None and mgr.local.restored is not None
                assert mgr.local.restored.tier == "local" and not mgr.local.restored.peers, mgr.local.restored
            if rank == args.ranks_per_node:  # node 1's first rank
                shutil.rmtree(base / "node1")
            peer_limits.append(_raw_transfer(buf, rank, args.ranks_per_node, None))
            busy_limits.append(
                _raw_transfer(buf, rank, args.ranks_per_node, functools.partial(_raw_read, own, readbuf, False))
            )
            with asyncckpt.CheckpointManager(roots / "root", local=tier) as mgr:
                peer_cold.append(_restore(mgr, sd))
                _worker_started(mgr)
                peer_times.append(_restore(mgr, sd))
                result = mgr.local.restored if mgr.local is not None else None
                assert result is not None and set(result.peers) == set(
                    range(args.ranks_per_node, 2 * args.ranks_per_node)
                ), result
        if rank == 0:
            out.put(
                {
                    "bytes": nbytes,
                    "tensors": len(src),
                    "stall": (statistics.median(stalls[1:]), statistics.median(memcpys[1:])),
                    "overlapped": (statistics.median(returns[1:]), statistics.median(copied[1:])),
                    "local": (local_times, local_limits),
                    "local_read": (local_times, read_limits),
                    "peer": (peer_times, peer_limits),
                    "peer_busy": (peer_times, busy_limits),
                    "local_cold": (local_cold, read_limits),
                    "peer_cold": (peer_cold, peer_limits),
                    "persistent": (persist_times, persist_limits),
                    "train": train,
                }
            )
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the local tier's rows; prints a markdown table. Returns the exit status."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=64, help="MB of state per rank (%(default)s)")
    p.add_argument("--tensors", type=int, default=8, help="tensors per rank, uniform workload (%(default)s)")
    p.add_argument(
        "--workload",
        choices=("uniform", "llm", "fsdp2"),
        default="uniform",
        help="uniform: --tensors float32 tensors; llm: a GPT + AdamW state of about --mb MB; fsdp2: the "
        "same model under FSDP2 on all the ranks, about --mb MB of DTensor shards a rank (%(default)s)",
    )
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=2,
        help="ranks per node, 2 nodes (%(default)s; 1 gives each rank a core of a 2-core machine)",
    )
    p.add_argument("--saves", type=int, default=6, help="local saves (the first is cold) (%(default)s)")
    p.add_argument("--train-steps", type=int, default=16, help="steps of each training loop (%(default)s)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each restore (%(default)s)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a new one under /dev/shm)")
    p.add_argument(
        "--root-dir",
        default=None,
        help="where the persistent tier's roots go, a new directory under it (default: in --dir); a directory "
        "on a disk stands for the shared storage that the persistent tier is",
    )
    args = p.parse_args(argv)
    made = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(
        prefix="bench-local-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    roots_made = args.root_dir is not None
    args.root_dir = tempfile.mkdtemp(prefix="bench-local-roots-", dir=args.root_dir) if roots_made else args.dir
    store = os.path.join(tempfile.mkdtemp(prefix="bench-local-store-"), "store")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    try:
        mp.start_processes(_rank, args=(args, store, out), nprocs=2 * args.ranks_per_node, start_method="spawn")
        r = out.get(timeout=5)
    finally:
        shutil.rmtree(os.path.dirname(store), ignore_errors=True)
        if made:
            shutil.rmtree(args.dir, ignore_errors=True)
        if roots_made:
            shutil.rmtree(args.root_dir, ignore_errors=True)
    mb = r["bytes"] / 1e6
    what = {"llm": "LLM-shaped (GPT + AdamW)", "fsdp2": "FSDP2 shards of the LLM-shaped state"}.get(
        args.workload, "uniform"
    )
    print(
        f"| local tier, {2 * args.ranks_per_node} ranks on 2 nodes, {mb:.0f} MB per rank, {what}, "
        f"{r['tensors']} tensors "
        "| time | limit | ratio |"
    )
    print("|---|---|---|---|")
    stall, memcpy = r["stall"]
    print(
        f"| local save stall (steady, median) | {stall * 1e3:.1f} ms | memcpy {memcpy * 1e3:.1f} ms | "
        f"{stall / memcpy:.2f}x |"
    )
    for name, t in zip(("local save, overlapped: save() returns", "the same, until its copy is over"), r["overlapped"]):
        print(f"| {name} | {t * 1e3:.1f} ms | memcpy {memcpy * 1e3:.1f} ms | {t / memcpy:.2f}x |")
    rows = [
        ("local restore (own node, CRC-checked)", r["local_read"], "raw read (preadv)"),
        ("the same", r["local"], "memcpy"),
        ("peer restore (node 1 wiped, from node 0)", r["peer"], "raw gloo transfer"),
        ("the same", r["peer_busy"], "raw transfer + node 0's raw read meanwhile"),
        ("persistent tier restore (asyncckpt.load of the root's step)", r["persistent"], "raw read of what it reads"),
        ("local restore as the manager opens (its worker starting beside it)", r["local_cold"], "raw read (preadv)"),
        ("peer restore as the manager opens (its worker starting beside it)", r["peer_cold"], "raw gloo transfer"),
    ]
    for name, (times, limits), limit in rows:
        ratio = statistics.median(t / lim for t, lim in zip(times, limits))
        print(
            f"| {name} | {statistics.median(times) * 1e3:.1f} ms | {limit} {statistics.median(limits) * 1e3:.1f} ms "
            f"| {ratio:.2f}x |"
        )
    t = r["train"]
    steps = args.train_steps
    print(
        f"| {steps} training steps, local save every step | {t['local']:.2f} s | none {t['none']:.2f} s | "
        f"{t['local'] / t['none']:.2f}x |"
    )
    print(
        f"| {steps} training steps, local save every step, overlapped | {t['local-overlapped']:.2f} s | "
        f"none {t['none']:.2f} s | {t['local-overlapped'] / t['none']:.2f}x |"
    )
    print(
        f"| {steps} training steps, persistent save every 4 (its root on {_file_system(args.root_dir)}) "
        f"| {t['persistent']:.2f} s | none {t['none']:.2f} s | "
        f"{t['persistent'] / t['none']:.2f}x |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
