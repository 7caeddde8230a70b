"""LLM-shaped workloads of the benchmark: a GPT + AdamW state on one rank, and FSDP2.

``llm``: scripts/train.py's GPT at a size where the parameters and AdamW's ``exp_avg``
and ``exp_avg_sq`` are about 1 GiB (float32) in about 1170 tensors (:data:`LLM_FULL`:
24 blocks of width 560, 90.9 M parameters; 12 parameters per block + 5, and per
parameter the optimizer's ``exp_avg``, ``exp_avg_sq`` and ``step``), stepped once so
that AdamW's state exists, taken with ``get_state_dict(model, optim)`` as
``{"model": ..., "optim": ...}`` (nested dicts), as torchtitan saves it.

``fsdp2``: the same model under FSDP2 (``fully_shard`` per block, then the root) on
2 ranks (processes started by a forkserver, a gloo group on 127.0.0.1, CPU; NCCL + the model on the
rank's GPU where CUDA is present); each rank's state is DTensor shards. Every rank
measures its own stalls, commits and limits (memcpy and raw write + fsync of its
local bytes, both ranks copying / writing at once, as the systems do: every rank
stages and writes its shard at the same time; the memcpy of one rank alone is shown
beside it); the report takes, per figure, the largest of the ranks' medians. The ranks
start each save together (a barrier, untimed), as a training step's collectives leave
them, and as the memcpy limit starts each copy.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmark.common import GiB, log, med, state_bytes, tensors_of
from benchmark.figures import fmt_ms
from benchmark.harness import run_system
from benchmark.limits import bench_memcpy, raw_write
from benchmark.memory import MemorySampler
from benchmark.systems import Asyncckpt, all_systems

#: ~1.02 GiB of float32 state (params + exp_avg + exp_avg_sq) in 1172 tensors.
LLM_FULL = {"n_layer": 24, "n_head": 8, "n_embd": 560, "block_size": 128}
#: the same structure at a few MB (--quick).
LLM_TINY = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 32}


def llm_of_bytes(nbytes: float) -> dict[str, int]:
    """The 24-block config whose float32 state (weights, exp_avg, exp_avg_sq of about
    12 x 24 x width^2 parameters, 1172 tensors) is about ``nbytes`` bytes."""
    width = max(8, int((nbytes / (3 * 4 * 12 * 24)) ** 0.5) // 8 * 8)
    return {"n_layer": 24, "n_head": 8, "n_embd": width, "block_size": 32}


#: What the fsdp2 ranks import, once, in the forkserver they fork from.
RANK_PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "asyncckpt.manager",
    "asyncckpt.saving.saver",
    "asyncckpt.loading.api",
)

#: asyncckpt and DCP, the systems the LLM workloads compare (keys of benchmark.systems).
LLM_SYSTEMS = ("dcp-async-thread-stager", "ack-persistent", "ack-prepare")
#: the same on a GPU (issue 35's rows), with asyncckpt's overlapped staging and DCP with a
#: new DefaultStager per save (torch 2.11's reused one fails; see systems.DcpAsync).
LLM_GPU_SYSTEMS = (
    "dcp-async-thread-stager",
    "dcp-async-thread-stager-fresh",
    "ack-persistent",
    "ack-prepare",
    "ack-overlap",
)


def model_device(rank: int = 0) -> torch.device:
    """Where the model lives: the rank's GPU where CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def describe(cfg: dict[str, int]) -> str:
    return f"{cfg['n_layer']} blocks, width {cfg['n_embd']}, {cfg['n_head']} heads, context {cfg['block_size']}"


def build_llm(
    cfg: dict[str, int], fsdp: bool = False, rank: int = 0, device: str | None = None
) -> tuple[Any, Any, dict[str, Any]]:
    """scripts/train.py's GPT of ``cfg`` and AdamW stepped once, and their state.

    Args:
        cfg: ``n_layer``, ``n_head``, ``n_embd``, ``block_size`` (the vocabulary is
            train.py's, 256 bytes).
        fsdp: shard with FSDP2 (``fully_shard`` per block, then the root); needs an
            initialized process group.
        rank: picks the GPU where CUDA is present.
        device: ``"cpu"`` or ``"cuda"`` (the rank's GPU); ``None``: the rank's GPU where
            CUDA is present, else the CPU.

    Returns:
        ``(model, optimizer, {"model": model_sd, "optim": optim_sd})`` from
        ``torch.distributed.checkpoint.state_dict.get_state_dict`` (float32 tensors,
        DTensors under FSDP2; the optimizer's ``step`` entries are 0-dim tensors).
    """
    import train
    from torch.distributed.checkpoint.state_dict import get_state_dict

    dev = torch.device("cpu") if device == "cpu" else model_device(rank)
    torch.manual_seed(0)  # the same full weights on every rank; each keeps its shard
    model = train.GPT(train.GPTConfig(cfg["block_size"], cfg["n_layer"], cfg["n_head"], cfg["n_embd"], 0.0)).to(dev)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    vocab = getattr(train, "VOCAB", 256)
    gen = torch.Generator().manual_seed(1 + rank)
    w = torch.randint(0, vocab, (1, min(16, cfg["block_size"]) + 1), generator=gen).to(dev)
    loss = F.cross_entropy(model(w[:, :-1]).reshape(-1, vocab), w[:, 1:].reshape(-1))
    loss.backward()
    opt.step()  # AdamW's exp_avg / exp_avg_sq / step exist from here on
    opt.zero_grad(set_to_none=True)
    model_sd, optim_sd = get_state_dict(model, opt)
    return model, opt, {"model": model_sd, "optim": optim_sd}


def local_tensors(sd: Any) -> list[torch.Tensor]:
    """The rank's own bytes: DTensors' local shards, plain tensors as they are."""
    from torch.distributed.tensor import DTensor

    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors_of(sd)]


# ============================================================================ fsdp2 ranks


def _concurrent_raw_write(host: list[torch.Tensor], path: Path) -> float:
    """Both ranks write + fsync their local bytes at once (started by a barrier)."""
    import torch.distributed as dist

    dist.barrier()
    return raw_write(host, path)


def _memcpy_alone(local: list[torch.Tensor], rank: int, world_size: int) -> list[float]:
    """The memcpy of this rank's bytes while the other ranks wait (shown beside the
    limit, which is every rank copying at once, as every rank stages at once)."""
    import torch.distributed as dist

    times: list[float] = []
    for r in range(world_size):
        dist.barrier()
        if r == rank:
            times = bench_memcpy(local, 3)
    dist.barrier()
    return times


def fsdp_rank(
    rank: int, world_size: int, cfg: dict[str, int], reps: int, directory: str, systems: tuple[str, ...]
) -> dict[str, Any]:
    """One rank of the ``fsdp2`` workload: each system's saves, then its limits.

    Returns this rank's figures: ``bytes`` (local), ``limits`` (``memcpy_s`` best of
    6 with every rank copying at once, ``memcpy_alone_s`` best of 3 with the other
    ranks waiting, ``raw_write_fsync_s`` median), and per system :func:`harness.run_system`'s
    figures plus ``raw_write_adjacent_s`` (the mean of the raw writes right before
    and after that system's saves).
    """
    import torch.distributed as dist

    root = Path(directory)
    t0 = time.perf_counter()
    _, _, sd = build_llm(cfg, fsdp=True, rank=rank)
    build_s = time.perf_counter() - t0
    if rank == 0:
        log(f"  FSDP2 model + AdamW state built in {build_s:.1f} s")
    local = local_tensors(sd)
    host = [t.cpu() if t.is_cuda else t for t in local]  # raw writes go from host memory
    nbytes = state_bytes(local)
    memcpy_times = bench_memcpy(local, 3, before=dist.barrier)
    alone_times = _memcpy_alone(local, rank, world_size)
    raw_path = root / f"raw_rank{rank}.bin"
    _concurrent_raw_write(host, raw_path)  # warm-up (file system allocation), not reported
    raw_times = [_concurrent_raw_write(host, raw_path)]
    sampler = MemorySampler(enabled=False)
    out: dict[str, Any] = {"rank": rank, "bytes": nbytes, "tensors": len(local), "build_s": build_s, "systems": {}}
    by_key = {s.key: s for s in all_systems()}
    for key in systems:
        system = by_key[key]
        if isinstance(system, Asyncckpt):
            system.loadable = False
            if key == "ack-prepare":
                system.prepare_sd = sd
        if rank == 0:
            log(f"  {system.name} ({world_size} ranks)")
        dist.barrier()
        r = run_system(system, sd, root / key, reps + 1, sampler, nbytes, cleanup=False, before=dist.barrier)
        dist.barrier()  # every rank committed: the coordinator removes the steps
        if rank == 0:
            shutil.rmtree(root / key, ignore_errors=True)
        raw_times.append(_concurrent_raw_write(host, raw_path))
        r["raw_write_before_s"], r["raw_write_after_s"] = raw_times[-2], raw_times[-1]
        r["raw_write_adjacent_s"] = (raw_times[-2] + raw_times[-1]) / 2
        out["systems"][system.name] = r
    memcpy_times += bench_memcpy(local, 3, before=dist.barrier)
    raw_path.unlink(missing_ok=True)
    out["limits"] = {
        "memcpy_s": min(memcpy_times),
        "memcpy_all_s": memcpy_times,
        "memcpy_alone_s": min(alone_times),
        "raw_write_fsync_s": med(raw_times),
        "raw_write_fsync_all_s": raw_times,
    }
    return out


def _rank_entry(rank: int, world_size: int, port: int, args: tuple, out: Any) -> None:
    import torch.distributed as dist

    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)  # as torchrun sets it (all ranks on this node)
    try:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(model_device(rank))
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=300),
        )
        try:
            out.put((rank, True, fsdp_rank(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_fsdp(
    cfg: dict[str, int],
    reps: int,
    directory: Path,
    world_size: int = 2,
    systems: tuple[str, ...] = LLM_SYSTEMS,
    timeout_s: float = 1200.0,
) -> dict[str, Any]:
    """The ``fsdp2`` workload on ``world_size`` ranks (processes forked from a forkserver;
    gloo on 127.0.0.1, a free port).

    Returns ``{"ranks": [per-rank figures of fsdp_rank], "systems": {name: figures}}``
    where each figure is the largest over the ranks of the rank's median (``*_ratio``:
    the largest of the ranks' own ratios). Raises RuntimeError with every failed
    rank's traceback if a rank fails or the ranks exceed ``timeout_s`` seconds; the
    rank processes (and, through their process group, their workers) are killed
    on the way out.
    """
    directory.mkdir(parents=True, exist_ok=True)
    # Ranks fork from a forkserver that imported torch once (not each rank on its own,
    # as spawned ones do: seconds per rank on a small machine). Only the forkserver's
    # first start takes the preload list.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(RANK_PRELOAD))
    out = ctx.Queue()
    port = _free_port()
    env_threads = os.environ.get("OMP_NUM_THREADS")
    # Ranks share this machine's cores: one compute thread each (set before spawning,
    # inherited; restored below).
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // world_size))
    procs = [
        ctx.Process(target=_rank_entry, args=(r, world_size, port, (cfg, reps, str(directory), systems), out))
        for r in range(world_size)
    ]
    results: dict[int, tuple[bool, Any]] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while len(results) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, value = out.get(timeout=1.0)
                results[rank] = (ok, value)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    time.sleep(1.0)  # a failed rank's report may still be in flight
                    while True:
                        try:
                            rank, ok, value = out.get_nowait()
                            results[rank] = (ok, value)
                        except queue.Empty:
                            break
                    break
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()) + 10)
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
        for p in procs:
            if p.is_alive() and p.pid is not None:
                _kill_tree(p.pid)
                p.join(10)
        out.close()
        out.join_thread()
        shutil.rmtree(directory, ignore_errors=True)
    failed = {r: v for r, (ok, v) in results.items() if not ok}
    missing = [r for r in range(world_size) if r not in results]
    if failed or missing:
        details = "\n".join(f"--- rank {r} ---\n{v}" for r, v in sorted(failed.items()))
        raise RuntimeError(f"fsdp2 ranks failed: {sorted(failed)}, no result from {missing}\n{details}")
    ranks = [results[r][1] for r in range(world_size)]
    return {"ranks": ranks, "systems": aggregate(ranks)}


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants (a rank and the writer processes it started)."""
    import signal

    kids: list[int] = []
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    for k in f.read().split():
                        kids.append(int(k))
                        stack.append(int(k))
        except OSError:
            continue
    for p in [pid] + kids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def aggregate(ranks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per system, the largest over the ranks of each rank's median (and of each rank's
    ratio to its own limits: memcpy of its local bytes, raw write + fsync around it)."""
    out: dict[str, dict[str, Any]] = {}
    for name in ranks[0]["systems"]:
        per = [(r["systems"][name], r["limits"]) for r in ranks]
        out[name] = {
            "stall_s": max(s["stall_s"] for s, _ in per),
            "first_stall_s": max(s["first_stall_s"] for s, _ in per),
            "returns_s": max(s["returns_s"] for s, _ in per),
            "committed_s": max(s["committed_s"] for s, _ in per),
            "first_committed_s": max(s["first_committed_s"] for s, _ in per),
            "stall_memcpy_ratio": max(s["stall_s"] / lim["memcpy_s"] for s, lim in per),
            "committed_raw_ratio": max(s["committed_s"] / s["raw_write_adjacent_s"] for s, _ in per),
            "stall_by_rank_s": [s["stall_s"] for s, _ in per],
        }
    return out


def render_fsdp(f: dict[str, Any], reps: int) -> list[str]:
    """Markdown lines of the fsdp2 workload."""
    ranks = f["ranks"]
    L = [
        f"## fsdp2: the llm workload under FSDP2, {len(ranks)} ranks ({f['label']})\n",
        "Per rank: "
        + "; ".join(
            f"rank {r['rank']} {r['bytes'] / GiB:.3f} GiB local in {r['tensors']} tensors, memcpy "
            f"{fmt_ms(r['limits']['memcpy_s'])} ms (every rank at once; alone "
            f"{fmt_ms(r['limits'].get('memcpy_alone_s'))} ms), raw write+fsync "
            f"{fmt_ms(r['limits']['raw_write_fsync_s'])} ms"
            for r in ranks
        )
        + f". Medians of {reps} saves after the first, the ranks starting each save together (a barrier, "
        "as a training step's collectives leave them); every figure is the largest over the ranks of the "
        "rank's own median (ratios: of the rank's own ratio to its local memcpy / the raw writes right "
        "before and after the system, every rank copying / writing at once).\n",
        (
            "| system | stall (ms) | stall / memcpy | first stall (ms) | committed (ms) | committed / raw write "
            "around it | stall per rank (ms) |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in f["systems"].items():
        L.append(
            f"| {name} | {fmt_ms(s['stall_s'])} | {s['stall_memcpy_ratio']:.2f}x | {fmt_ms(s['first_stall_s'])} | "
            f"{fmt_ms(s['committed_s'])} | {s['committed_raw_ratio']:.2f}x | "
            + " / ".join(fmt_ms(x) for x in s["stall_by_rank_s"])
            + " |"
        )
    L.append("")
    return L
