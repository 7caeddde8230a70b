"""Timing: a system's saves of one state (:func:`run_system`), the loads of the kept
checkpoints (:func:`bench_loads`) and asyncckpt's techniques one at a time
(:func:`bench_techniques`)."""

from __future__ import annotations

import inspect
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import asyncckpt
from benchmark.common import drop_cache, free_memory, log, med, mutate, remove, tensors_of
from benchmark.limits import raw_read
from benchmark.memory import MemorySampler
from benchmark.systems import Asyncckpt, Pending, System, manager_params, param_default


def run_system(
    system: System,
    sd: Any,
    root: Path,
    saves: int,
    sampler: MemorySampler,
    nbytes: int,
    keep_last: bool = False,
    interval_s: float | None = None,
    cleanup: bool = True,
    before: Callable[[], None] | None = None,
    warmup: int = 0,
    interleave: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """``saves`` saves of ``sd`` (the first one cold) with one system.

    Default protocol: save, wait until staged (stall), mutate, wait until committed,
    sample memory, delete the files (unless ``cleanup`` is False: on several ranks, the
    caller removes them once every rank committed). With ``interval_s``: saves are issued every
    ``interval_s`` seconds without waiting for the previous commit (a sleeping trainer),
    all committed at the end. ``before()`` runs, untimed, before each save (the fsdp2
    workload passes a barrier: the ranks of a training step call save() together, as
    the step's collectives leave them, instead of as each saw the last commit).

    The medians are over the saves after the first and after ``warmup`` more (saves
    that bring the system to its steady state; their figures are in the per-save
    lists, ``*_all_s`` and ``stalls_s``). ``interleave()``, where given, runs after
    each measured save's files are removed, outside the save's timing: a reference
    measured between the saves (the raw write + fsync of the same bytes), its returned
    seconds in ``interleaved_all_s`` and their median in ``interleaved_s``.

    Returns the figures in seconds (``*_s``), bytes (``*_bytes``) and GB/s (``gbps``);
    for asyncckpt also its own phases (``write_s``, ``finalize_s``, ``total_s``:
    medians; ``phases_all``: per save) and ``saved_bytes`` (its data files).
    """
    if interval_s is not None and (warmup or interleave is not None):
        raise ValueError("warmup and interleave apply to the default protocol, not to saves every interval_s")
    if saves < warmup + 2:
        raise ValueError(f"{saves} saves leave none measured after the first and {warmup} warm-up saves")
    m = 1 + warmup  # the first measured save
    free_memory()
    base = sampler.now()
    sampler.reset()
    system.open(root)
    returns: list[float] = []
    stalls: list[float] = []
    committed: list[float] = []
    after: list[int] = []
    polls: list[float] = []
    interleaved: list[float] = []
    phases: list[dict[str, float]] = []
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
                ph = p.phases()
                if ph is not None:
                    phases.append(ph)
                if cleanup and not (keep_last and i == saves - 1):
                    remove(p.path)
                if interleave is not None and i >= m:
                    interleaved.append(interleave())
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
        "first_stall_s": stalls[0],
        "stall_s": med(stalls[m:]),
        "mean_stall_s": statistics.fmean(stalls[m:]),
        "returns_s": med(returns[m:]),
        "stalls_s": stalls,
        "warmup_saves": warmup,
        "maybe_finalize_s": med(polls) if polls else None,
        "maybe_finalize_max_s": max(polls) if polls else None,
        "maybe_finalize_calls": len(polls),
        "peak_extra_bytes": peak,
        "peak_extra_ratio": peak / nbytes,
    }
    if interval_s is None:
        out.update(
            {
                "first_committed_s": committed[0],
                "committed_s": med(committed[m:]),
                "gbps": nbytes / med(committed[m:]) / 1e9,
                "committed_all_s": committed,
                "extra_after_first_bytes": after[0],
                "extra_after_last_bytes": after[-1],
                "extra_after_each_bytes": after,
            }
        )
        if len(phases) == saves:  # asyncckpt: its own account of each save
            out.update({k: med([ph[k] for ph in phases[m:]]) for k in ("write_s", "finalize_s", "total_s")})
            out["phases_all"] = phases
            out["saved_bytes"] = int(phases[-1]["bytes"])
        if interleave is not None:
            out.update({"interleaved_s": med(interleaved), "interleaved_all_s": interleaved})
    else:
        out.update({"interval_s": interval_s, "drain_s": drain_s})
    if keep_last:
        out["_last_path"] = str(last_path)
    return out


# ============================================================================ loads


def bench_loads(
    sd: Any, kept: dict[str, Path], raw_path: Path, reps: int, host: list[torch.Tensor] | None = None
) -> dict[str, dict[str, Any]]:
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
        loads.append(
            ("torch.load (torch.save file)", kept["torch.save"], lambda p: torch.load(p, weights_only=True, mmap=False))
        )
    on_gpu = next((t.device for t in tensors_of(sd) if t.is_cuda), None)
    gpu_file = raw_path.with_name(raw_path.name + ".torch_save_cuda.pt")
    if on_gpu is not None:  # issue 35: asyncckpt.load into the CUDA tensors in place (H2D) against torch.load
        try:
            with open(gpu_file, "wb") as f:  # the same state's bytes, written once (not timed)
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())
        except Exception as exc:  # noqa: BLE001 - a row that cannot be measured is left out, and said
            log(f"  torch.load into CUDA: not measured ({type(exc).__name__}: {exc})")
        else:
            loads.append(
                (
                    "torch.load map_location='cuda' (torch.save file)",
                    gpu_file,
                    lambda p: torch.load(p, map_location=on_gpu, weights_only=True, mmap=False),
                )
            )
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
    remove(gpu_file)
    return out


# ============================================================================ techniques


def bench_techniques(
    sd: Any, root: Path, saves: int, sampler: MemorySampler, nbytes: int, write_time: float
) -> tuple[dict[str, dict[str, Any]], list[str]]:
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
    variant(
        "default (persistent, buffers reused; "
        + ", ".join(f"{k}={v}" for k, v in defaults.items() if v is not inspect.Parameter.empty)
        + ")",
        [],
    )
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
        "stall_s": med(stalls),
        "first_stall_s": stalls[0],
        "committed_s": med(committed),
        "peak_extra_bytes": peak,
        "peak_extra_ratio": peak / nbytes,
        "stalls_s": stalls,
    }
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
