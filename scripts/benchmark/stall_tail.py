"""The tail of the save stall over many saves, and the garbage collections around it.

One process, the LLM-shaped state (scripts/train.py's GPT + AdamW, :mod:`benchmark.llm`,
about ``--mb`` MB in about 1170 tensors), ``--saves`` saves in a loop (a write to the
state, ``save``, then ``maybe_finalize(blocking=True)``: the steady state), for each
tier given: ``local`` (``manager.local.save``, a ``LocalTier`` under ``/dev/shm`` without
replicas) and ``persistent`` (``manager.save``). Per tier: the median, 99th percentile
and longest stall against memcpy of the same tensors (libc's ``memmove``, median of the
loop's), where the stall went (the medians of the save's ``SaveTimings.plan_s``, the
plan phase: validation, the structure's comparison with the cached plan, the
collective; and ``stage_s``, the staging copy), and CPython's cyclic garbage
collections (``gc.callbacks``): those that started
inside a ``save`` call, and all of the loop's (full ones counted apart; a full one walks
every object of the process).

    python scripts/bench.py stall-tail --saves 300
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

import asyncckpt

from .common import mutate, tensors_of


class _Collections:
    """Seconds and counts of the collections that start while ``inside`` is set, and of all."""

    def __init__(self) -> None:
        self.inside = False
        self.started = 0.0
        self.was_inside = False
        self.seconds = {"save": 0.0, "loop": 0.0}
        self.count = {"save": 0, "loop": 0}
        self.full = {"save": 0, "loop": 0}

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            self.was_inside = self.inside
            return
        took = time.perf_counter() - self.started
        for where in ("save", "loop") if self.was_inside else ("loop",):
            self.seconds[where] += took
            self.count[where] += 1
            self.full[where] += info["generation"] == 2


def _run(tier: str, sd: dict[str, Any], saves: int, base: str) -> dict[str, Any]:
    src = list(tensors_of(sd))
    dst = [torch.empty_like(t) for t in src]
    for d, t in zip(dst, src):
        d.copy_(t)  # (faulted in)
    local = None
    if tier == "local":
        local = asyncckpt.LocalTier(dir=os.path.join(base, f"{tier}-tier"), every=1, replicas=0)
    seen = _Collections()
    stalls, memcpys, plans, copies = [], [], [], []
    with asyncckpt.CheckpointManager(os.path.join(base, f"{tier}-root"), local=local, keep_last=2) as mgr:
        gc.collect()
        gc.callbacks.append(seen)
        try:
            for step in range(1, saves + 1):
                mutate(sd)
                t0 = time.perf_counter()
                for d, s in zip(dst, src):
                    ctypes.memmove(d.data_ptr(), s.data_ptr(), s.numel() * s.element_size())
                memcpys.append(time.perf_counter() - t0)
                seen.inside = True
                t0 = time.perf_counter()
                if mgr.local is not None:
                    handle = mgr.local.save(step, sd)
                else:
                    handle = mgr.save(step, sd)
                stalls.append(time.perf_counter() - t0)
                seen.inside = False
                if mgr.local is not None:
                    mgr.local.maybe_finalize(blocking=True)
                else:
                    mgr.maybe_finalize(blocking=True)
                if handle is not None:  # where the stall went: the plan phase, the staging copy
                    timings = handle.wait(timeout=60)
                    plans.append(timings.plan_s)
                    copies.append(timings.stage_s)
        finally:
            gc.callbacks.remove(seen)
    steady = sorted(stalls[1:])
    return {
        "median": statistics.median(steady),
        "p99": steady[min(len(steady) - 1, int(0.99 * len(steady)))],
        "max": steady[-1],
        "memcpy": statistics.median(memcpys[1:]),
        "plan": statistics.median(plans[1:] or plans or [float("nan")]),
        "copy": statistics.median(copies[1:] or copies or [float("nan")]),
        "gc": seen,
    }


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the rows; prints a markdown table. Returns the exit status."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=64, help="MB of state (%(default)s)")
    p.add_argument("--saves", type=int, default=300, help="saves per tier (%(default)s)")
    p.add_argument("--tiers", default="local,persistent", help="local, persistent or both (%(default)s)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a new one under /dev/shm)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from . import llm

    _, _, sd = llm.build_llm(llm.llm_of_bytes(args.mb * (1 << 20)), fsdp=False, rank=0, device="cpu")
    sd = {**sd, "step": 0}
    nbytes = sum(t.numel() * t.element_size() for t in tensors_of(sd))
    base = tempfile.mkdtemp(prefix="bench-stall-", dir=args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        rows = {tier: _run(tier, sd, args.saves, base) for tier in args.tiers.split(",")}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(
        f"| {args.saves} saves, LLM-shaped, {nbytes / 1e6:.0f} MB in {len(list(tensors_of(sd)))} tensors, "
        f"{len(gc.get_objects()):,} objects | median stall | p99 | longest | memcpy | of the stall: plan, copy "
        "(medians) | collections inside saves (full) | collections in the loop (full) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for tier, r in rows.items():
        seen = r["gc"]
        print(
            f"| {tier} | {r['median'] * 1e3:.1f} ms | {r['p99'] * 1e3:.1f} ms | {r['max'] * 1e3:.1f} ms | "
            f"{r['memcpy'] * 1e3:.1f} ms | {r['plan'] * 1e3:.1f} ms, {r['copy'] * 1e3:.1f} ms | "
            f"{seen.count['save']} ({seen.full['save']}), "
            f"{seen.seconds['save'] * 1e3:.1f} ms | {seen.count['loop']} ({seen.full['loop']}), "
            f"{seen.seconds['loop'] * 1e3:.1f} ms |"
        )
    return 0
