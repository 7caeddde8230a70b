"""Side-by-side checkpoint benchmark: asyncckpt against torch.save, DCP and the physical limits.

For each workload (a synthetic state dict of N tensors), in one run, on the same
state and directory, it measures per system the median over ``--reps`` saves of:

- stall: seconds the training thread is blocked by ``save`` (steady state: first
  save excluded; the first save's stall is reported separately),
- committed: seconds from the call until the checkpoint is durable and committed,
- write GB/s: bytes / committed time,

and the physical limits of this machine in the same run: a memcpy of the same bytes
into a preallocated buffer, and a raw sequential write + fsync of the same bytes into
the same directory. Results are printed as a markdown table and written as JSON.

    python scripts/bench.py                 # 256 MiB and 1 GiB, 16 tensors
    python scripts/bench.py --quick         # small smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import asyncckpt  # noqa: E402
import asyncckpt.checkpoint  # noqa: E402,F401 - imported before timing: not a save cost
import torch.distributed.checkpoint  # noqa: E402,F401


def make_state(total_bytes: int, num_tensors: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``num_tensors`` float32 tensors totalling about ``total_bytes`` bytes."""
    gen = torch.Generator().manual_seed(seed)
    per = max(1, total_bytes // num_tensors // 4)
    return {f"layer{i}.weight": torch.randn(per, generator=gen) for i in range(num_tensors)}


def state_bytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def bench_memcpy(sd: dict[str, torch.Tensor], reps: int) -> float:
    dst = {k: torch.empty_like(v) for k, v in sd.items()}
    for k in sd:
        dst[k].copy_(sd[k])  # warm: pages faulted in
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for k in sd:
            dst[k].copy_(sd[k])
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_raw_write(sd: dict[str, torch.Tensor], directory: Path, reps: int) -> float:
    times = []
    for i in range(reps):
        path = directory / f"raw_{i}.bin"
        t = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for v in sd.values():
                mv = memoryview(v.numpy()).cast("B")
                while mv:
                    n = os.write(fd, mv[: 64 << 20])
                    mv = mv[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        times.append(time.perf_counter() - t)
        path.unlink()
    return statistics.median(times)


def _run_saves(save_fn: Callable[[Path], Callable[[], None]], sd: dict, directory: Path, reps: int,
               mutate: bool = True) -> dict[str, float]:
    """``save_fn(path)`` blocks for the stall and returns a function that waits for commit."""
    stalls, committed = [], []
    for i in range(reps + 1):
        path = directory / f"ckpt_{i}"
        t0 = time.perf_counter()
        wait = save_fn(path)
        t1 = time.perf_counter()
        if mutate:
            next(iter(sd.values())).add_(1.0)  # the trainer goes on mutating its state
        wait()
        t2 = time.perf_counter()
        stalls.append(t1 - t0)
        committed.append(t2 - t0)
        shutil.rmtree(path, ignore_errors=True)
        if path.with_suffix(".pt").exists():
            path.with_suffix(".pt").unlink()
    return {
        "first_stall_s": stalls[0],
        "stall_s": statistics.median(stalls[1:]),
        "committed_s": statistics.median(committed[1:]),
    }


def bench_systems(sd: dict, directory: Path, reps: int, systems: list[str]) -> dict[str, dict[str, float]]:
    import torch.distributed.checkpoint as dcp

    out: dict[str, dict[str, float]] = {}
    if "torch.save" in systems:
        def torch_save(path: Path) -> Callable[[], None]:
            with open(path.with_suffix(".pt"), "wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())
            return lambda: None
        out["torch.save (sync)"] = _run_saves(torch_save, sd, directory, reps)
    if "dcp" in systems:
        def dcp_save(path: Path) -> Callable[[], None]:
            dcp.save(sd, checkpoint_id=str(path))
            return lambda: None
        out["dcp.save (sync)"] = _run_saves(dcp_save, sd, directory, reps)
    if "asyncckpt-sync" in systems:
        queue = asyncckpt.AsyncCallsQueue(persistent=True)
        try:
            def ack_sync(path: Path) -> Callable[[], None]:
                asyncckpt.save(sd, path, calls_queue=queue)
                return lambda: None
            out["asyncckpt (sync)"] = _run_saves(ack_sync, sd, directory, reps)
        finally:
            queue.close()
    for name, persistent in (("asyncckpt-temporal", False), ("asyncckpt-persistent", True)):
        if name not in systems:
            continue
        queue = asyncckpt.AsyncCallsQueue(persistent=persistent)
        try:
            def ack_async(path: Path) -> Callable[[], None]:
                handle = asyncckpt.save(sd, path, async_op=True, calls_queue=queue)
                return handle.wait
            out[f"asyncckpt {'persistent' if persistent else 'temporal'} (async)"] = _run_saves(
                ack_async, sd, directory, reps)
        finally:
            queue.close()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="256M,1G", help="comma-separated state sizes (K/M/G suffixes)")
    parser.add_argument("--tensors", type=int, default=16, help="tensors per state dict")
    parser.add_argument("--reps", type=int, default=3, help="repetitions after the first (cold) save")
    parser.add_argument("--dir", default=None, help="directory to write into (default: a temp dir under ./)")
    parser.add_argument("--systems", default="torch.save,dcp,asyncckpt-sync,asyncckpt-temporal,asyncckpt-persistent")
    parser.add_argument("--json", default="bench_results/bench.json", help="where to write the JSON results")
    parser.add_argument("--quick", action="store_true", help="small smoke run (16 MiB, 1 rep)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.reps = "16M", 1

    def parse_size(s: str) -> int:
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        return int(float(s[:-1]) * mult[s[-1].upper()]) if s[-1].upper() in mult else int(s)

    systems = args.systems.split(",")
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_", dir="."))
    base.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    try:
        for size_text in args.sizes.split(","):
            sd = make_state(parse_size(size_text), args.tensors)
            nbytes = state_bytes(sd)
            memcpy_s = bench_memcpy(sd, max(3, args.reps))
            raw_s = bench_raw_write(sd, base, max(1, args.reps))
            per_system = bench_systems(sd, base, args.reps, systems)
            results.append({"size": size_text, "tensors": args.tensors, "bytes": nbytes, "memcpy_s": memcpy_s,
                            "raw_write_fsync_s": raw_s, "systems": per_system})
            del sd
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)

    print(f"\ntorch {torch.__version__}, {os.cpu_count()} CPUs, medians of {args.reps} saves after the first\n")
    for r in results:
        gib = r["bytes"] / (1 << 30)
        print(f"### {r['size']} in {r['tensors']} tensors ({gib:.2f} GiB): memcpy {r['memcpy_s'] * 1e3:.0f} ms, "
              f"raw write+fsync {r['raw_write_fsync_s'] * 1e3:.0f} ms\n")
        print("| system | stall (ms) | stall / memcpy | first stall (ms) | committed (ms) | committed / raw write | GB/s |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, m in r["systems"].items():
            print(f"| {name} | {m['stall_s'] * 1e3:.1f} | {m['stall_s'] / r['memcpy_s']:.2f}x | "
                  f"{m['first_stall_s'] * 1e3:.1f} | {m['committed_s'] * 1e3:.0f} | "
                  f"{m['committed_s'] / r['raw_write_fsync_s']:.2f}x | {r['bytes'] / m['committed_s'] / 1e9:.2f} |")
        print()
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"torch": torch.__version__, "cpus": os.cpu_count(), "results": results}, indent=1))
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
