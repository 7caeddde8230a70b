"""Export to Hugging Face safetensors (issue 33): the LLM-shaped state's model, three ways.

- **asyncckpt export**: ``asyncckpt.export_safetensors`` of a committed checkpoint of the
  state (``{"model", "optim"}``, saved once, untimed) into a fresh directory: read tensor
  by tensor (CRC-32s checked against the manifest), written with the ``safetensors``
  library, each file fsynced and renamed (a reader thread reads the next shard while one
  is written). The checkpoint's pages were dropped from the
  page cache by the save (asyncckpt's default), so its reads come from the disk.
- **DCP HuggingFaceStorageWriter**: ``dcp.save(model_state_dict,
  storage_writer=HuggingFaceStorageWriter(out, save_distributed=True,
  enable_consolidation=True))`` from the state in memory: DCP's per-rank safetensors,
  then ``consolidate_safetensors_files`` into the HF layout (torch's own route).
- **raw write + fsync**: the model's tensor bytes written to one file and fsynced (the
  floor of any export of those bytes).

Both exports write :data:`SHARDS` shards of the same sizes (a large model's export is
sharded: 5 GB files). Interleaved, ``reps`` times each; the peak memory of each is the growth of this
process's high-water RSS during it (``VmHWM``, reset through ``/proc/self/clear_refs``
before each run; ``None`` where the kernel does not allow the reset).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import asyncckpt
from benchmark import llm
from benchmark.common import MiB, log, med, state_bytes
from benchmark.limits import host_tensors, raw_write

#: Output shards of every route (the model's bytes split evenly, greedily).
SHARDS = 4
ROUTES = ("asyncckpt export", "DCP HuggingFaceStorageWriter + consolidation", "raw write + fsync")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _timed(fn: Any) -> tuple[float, int | None]:
    """(seconds, bytes the high-water RSS grew by) of ``fn()``."""
    reset = _reset_peak()
    base = _status("VmRSS")
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    return seconds, (_status("VmHWM") - base) if reset else None


def run(cfg: dict[str, int], reps: int, directory: Path) -> dict[str, Any]:
    """Measure the three routes on scripts/train.py's GPT of ``cfg`` (see the module
    docstring); ``directory`` is scratch space, removed at the end."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    directory.mkdir(parents=True, exist_ok=True)
    _, _, sd = llm.build_llm(cfg)
    model_sd = sd["model"]
    nbytes = state_bytes(model_sd)
    log(f"export: {llm.describe(cfg)}: model {nbytes / MiB:.1f} MiB in {len(model_sd)} tensors")
    ckpt = directory / "ckpt"
    asyncckpt.save(sd, ckpt).result()
    host = host_tensors(model_sd)
    raw_path = directory / "raw.bin"
    raw_write(host, raw_path)  # warm-up (file system allocation), not reported

    # The same layout both ways: SHARDS shards of at most shard_bytes (huggingface_hub's
    # greedy rule), as a large model's export has (5 GB shards).
    shard_bytes = -(-nbytes // SHARDS)
    mapping: dict[str, int] = {}
    index, filled = 1, 0
    for fqn, t in model_sd.items():
        size = t.numel() * t.element_size()
        if filled and filled + size > shard_bytes:
            index, filled = index + 1, 0
        mapping[fqn] = index
        filled += size

    def ours(out: Path) -> None:
        asyncckpt.export_safetensors(ckpt, out, max_shard_size=shard_bytes)

    def dcp_route(out: Path) -> None:
        writer = HuggingFaceStorageWriter(
            str(out), fqn_to_index_mapping=mapping, save_distributed=True, enable_consolidation=True
        )
        dcp.save(model_sd, storage_writer=writer)

    def raw(out: Path) -> None:
        raw_write(host, raw_path)

    fns = dict(zip(ROUTES, (ours, dcp_route, raw)))
    times: dict[str, list[float]] = {r: [] for r in ROUTES}
    peaks: dict[str, list[int]] = {r: [] for r in ROUTES}
    for rep in range(reps):
        for route in ROUTES:
            out = directory / f"out_{rep}_{ROUTES.index(route)}"
            seconds, peak = _timed(lambda fn=fns[route], out=out: fn(out))
            times[route].append(seconds)
            if peak is not None:
                peaks[route].append(peak)
            shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(directory, ignore_errors=True)
    raw_s = med(times["raw write + fsync"])
    return {
        "label": llm.describe(cfg),
        "config": cfg,
        "bytes": nbytes,
        "tensors": len(model_sd),
        "reps": reps,
        "shards": max(mapping.values()),
        "routes": {
            r: {
                "s": med(times[r]),
                "all_s": times[r],
                "vs_raw": med(times[r]) / raw_s if raw_s else None,
                "peak_rss_growth_bytes": max(peaks[r]) if peaks[r] else None,
            }
            for r in ROUTES
        },
    }


def render_markdown(res: dict[str, Any]) -> str:
    """The export section of the report."""
    lines = [
        (
            f"The model of {res['label']}: {res['bytes'] / MiB:.1f} MiB in {res['tensors']} tensors, "
            f"{res['shards']} safetensors shards; median of {res['reps']} interleaved runs each. asyncckpt "
            "reads a committed checkpoint (CRC-checked) and fsyncs its files; DCP's route writes from the "
            "state in memory.\n"
        ),
        "| route | time (s) | x raw write | peak RSS growth (MiB) |",
        "|---|---|---|---|",
    ]
    for name, r in res["routes"].items():
        peak = r["peak_rss_growth_bytes"]
        vs = f"{r['vs_raw']:.2f}x" if r["vs_raw"] is not None else "-"
        lines.append(f"| {name} | {r['s']:.3f} | {vs} | {'-' if peak is None else f'{peak / MiB:.1f}'} |")
    return "\n".join(lines)
