"""The node-local tier (issue 31): save stall and restore times against their raw limits.

4 gloo ranks on this machine standing for 2 nodes of 2 ranks (``LocalTier(node=rank //
2)``, one tier directory per node, under ``/dev/shm`` by default), each with a state of
``--mb`` MB in ``--tensors`` tensors (LLM-shaped: a few large matrices). Ratios are taken
within one run, each against its limit measured in the same processes:

- local save stall (``manager.local.save``, steady state, median) / memcpy of the
  state into preallocated memory;
- local restore (every shard on its node: read + CRC-32 of every byte + load into the
  state) / memcpy of the same bytes;
- peer restore (node 1's tier wiped: ranks 2 and 3 receive their shards from node 0 over
  gloo, write them into their tier, check and load them) / the raw gloo transfer
  (isend/irecv of the same bytes between the same ranks);
- training slowdown: ``--train-steps`` steps (fixed compute, a small all-reduce, a
  write to the state) with a local save every step, and with a persistent save every 4
  steps, each / the same loop without checkpoints.

    python scripts/bench_local_tier.py --mb 64
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import asyncckpt

from .common import mutate
from .limits import bench_memcpy

WORLD = 4


def _state(mb: int, tensors: int, rank: int) -> dict[str, Any]:
    n = mb * (1 << 20) // 4 // tensors
    g = torch.Generator().manual_seed(rank)
    return {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(tensors)} | {"step": 0}


def _raw_transfer(nbytes: int, rank: int) -> float:
    """Seconds to send ``nbytes`` from rank r to rank r + 2 (r = 0, 1), all at once."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    dist.barrier()
    t0 = time.perf_counter()
    work = dist.isend(buf, rank + 2) if rank < 2 else dist.irecv(buf, rank - 2)
    assert work is not None
    work.wait()
    dist.barrier()
    return time.perf_counter() - t0


def _training(args: argparse.Namespace, sd: dict[str, Any], base: Path, rank: int, tier: Any) -> dict[str, float]:
    """Seconds of ``--train-steps`` training steps (a fixed compute, then an all-reduce
    of a small gradient, then a write to the state): without checkpoints, with a local
    save every step, with a persistent save every 4 steps (each in a root of its own)."""
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    grad = torch.zeros(1 << 16)

    def run(mode: str) -> float:
        root = base / f"train_{mode}"
        local = dataclasses.replace(tier, dir=str(base / f"train_{mode}_node{rank // 2}")) if mode == "local" else None
        with asyncckpt.CheckpointManager(root, local=local) as mgr:
            dist.barrier()
            t0 = time.perf_counter()
            for step in range(1, args.train_steps + 1):
                for _ in range(8):
                    torch.mm(a, b)
                dist.all_reduce(grad)
                mutate(sd)
                if mode == "local":
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
        return elapsed

    return {mode: run(mode) for mode in ("none", "local", "persistent")}


def _rank(rank: int, args: argparse.Namespace, store: str, out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300)
    )
    try:
        base = Path(args.dir)
        tier = asyncckpt.LocalTier(dir=str(base / f"node{rank // 2}"), every=1, replicas=1, node=rank // 2)
        sd = _state(args.mb, args.tensors, rank)
        nbytes = sum(t.numel() * t.element_size() for t in sd.values() if isinstance(t, torch.Tensor))
        memcpy = statistics.median(bench_memcpy(sd, args.reps))
        stalls = []
        with asyncckpt.CheckpointManager(base / "root", local=tier) as mgr:
            assert mgr.local is not None
            for step in range(1, args.saves + 1):
                for t in sd.values():
                    if isinstance(t, torch.Tensor):
                        t[0] += 1
                t0 = time.perf_counter()
                mgr.local.save(step, sd)
                stalls.append(time.perf_counter() - t0)
                mgr.local.maybe_finalize(blocking=True)  # the steady state: the previous save is done
        stall = statistics.median(stalls[1:])
        train = _training(args, sd, base, rank, tier)
        local_times, peer_times, raw_times = [], [], []
        for _ in range(args.reps):
            with asyncckpt.CheckpointManager(base / "root", local=tier) as mgr:
                dist.barrier()
                t0 = time.perf_counter()
                result = mgr.restore(sd)
                dist.barrier()
                local_times.append(time.perf_counter() - t0)
                assert result is not None and result.tier == "local" and not result.peers, result
            if rank == 2:
                shutil.rmtree(base / "node1")
            dist.barrier()
            with asyncckpt.CheckpointManager(base / "root", local=tier) as mgr:
                dist.barrier()
                t0 = time.perf_counter()
                result = mgr.restore(sd)
                dist.barrier()
                peer_times.append(time.perf_counter() - t0)
                assert result is not None and set(result.peers) == {2, 3}, result
            raw_times.append(_raw_transfer(nbytes, rank))
        if rank == 0:
            out.put(
                {
                    "bytes": nbytes,
                    "memcpy": memcpy,
                    "stall": stall,
                    "local": statistics.median(local_times),
                    "peer": statistics.median(peer_times),
                    "raw_gloo": statistics.median(raw_times),
                    "train": train,
                }
            )
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Run the local tier's rows; prints a markdown table. Returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=64, help="MB of state per rank (%(default)s)")
    p.add_argument("--tensors", type=int, default=8, help="tensors per rank (%(default)s)")
    p.add_argument("--saves", type=int, default=6, help="local saves (the first is cold) (%(default)s)")
    p.add_argument("--train-steps", type=int, default=16, help="steps of each training loop (%(default)s)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each restore (%(default)s)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a new one under /dev/shm)")
    args = p.parse_args(argv)
    made = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(
        prefix="bench-local-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    store = os.path.join(tempfile.mkdtemp(prefix="bench-local-store-"), "store")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    try:
        mp.start_processes(_rank, args=(args, store, out), nprocs=WORLD, start_method="spawn")
        r = out.get(timeout=5)
    finally:
        shutil.rmtree(os.path.dirname(store), ignore_errors=True)
        if made:
            shutil.rmtree(args.dir, ignore_errors=True)
    mb = r["bytes"] / 1e6
    print(f"| local tier, {WORLD} ranks on 2 nodes, {mb:.0f} MB per rank | time | limit | ratio |")
    print("|---|---|---|---|")
    rows = [
        ("local save stall (steady, median)", r["stall"], r["memcpy"], "memcpy"),
        ("local restore (own node, CRC-checked)", r["local"], r["memcpy"], "memcpy"),
        ("peer restore (node 1 wiped, from node 0)", r["peer"], r["raw_gloo"], "raw gloo transfer"),
    ]
    for name, t, limit, what in rows:
        print(f"| {name} | {t * 1e3:.1f} ms | {what} {limit * 1e3:.1f} ms | {t / limit:.2f}x |")
    t = r["train"]
    steps = args.train_steps
    print(
        f"| {steps} training steps, local save every step | {t['local']:.2f} s | none {t['none']:.2f} s | "
        f"{t['local'] / t['none']:.2f}x |"
    )
    print(
        f"| {steps} training steps, persistent save every 4 | {t['persistent']:.2f} s | none {t['none']:.2f} s | "
        f"{t['persistent'] / t['none']:.2f}x |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
