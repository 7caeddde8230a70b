"""The workloads: the state dicts a run saves and loads, named by a spec.

``SIZE/N``     N float32 tensors totalling SIZE (``1G/4096``; N defaults to 16)
``sizesN``     N float32 tensors of N distinct sizes between 64 KiB and 1 MiB
               (``sizes200``: 106 MiB), or between LO and HI with ``sizesN:LO-HI``
``llm``        scripts/train.py's GPT + AdamW state from get_state_dict (:mod:`benchmark.llm`)
``fsdp2``      the same under FSDP2 on 2 ranks (run by :func:`benchmark.llm.run_fsdp`)
``train``      the training example's model + AdamW state

The ``sizes`` workloads measure the commit of many distinct record sizes: asyncckpt's
writer merges the CRC-32 of a 64 KiB-1 MiB record into its segment's through a table
per record size (built once a size has been seen 33 times, for at most 128 sizes), and
the time until committed should stay near a raw write + fsync of the same bytes
however many sizes there are. Their measured saves come after :data:`SIZES_WARMUP`
saves (past the tables' build), and a raw write + fsync of the same bytes runs between
the measured saves, so that each commit has its limit measured next to it.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from benchmark.common import KiB, MiB, parse_size, tensors_of, to_device
from benchmark.llm import LLM_GPU_SYSTEMS, LLM_SYSTEMS
from benchmark.systems import DEFAULT_SYSTEM_KEYS

DEFAULT_WORKLOADS = "256M/16,1G/16,1G/4096,sizes200,llm,fsdp2,train"
QUICK_WORKLOADS = "4M/16,sizes24:64K-96K,llm,fsdp2"
#: Saves after the first and before the measured ones on the ``sizes`` workloads.
SIZES_WARMUP = 40
#: The systems of the ``sizes`` workloads unless --systems names others: asyncckpt and
#: DCP's best asynchronous save.
SIZES_SYSTEMS = ("dcp-async-thread-stager", "ack-persistent")

_SIZES = re.compile(r"sizes(\d+)(?::(\w+)-(\w+))?$")


def sizes_spec(spec: str) -> tuple[int, int, int] | None:
    """``(n, lo, hi)`` (bytes) of a ``sizesN[:LO-HI]`` spec, ``None`` for another spec."""
    m = _SIZES.match(spec)
    if m is None:
        return None
    return int(m[1]), parse_size(m[2] or "64K"), parse_size(m[3] or "1M")


def distinct_sizes(n: int, lo: int, hi: int, itemsize: int = 4) -> list[int]:
    """``n`` distinct sizes in bytes, multiples of ``itemsize``, spread evenly over
    ``[lo, hi]`` (both ends included).

    Raises:
        ValueError: fewer than ``n`` multiples of ``itemsize`` lie in ``[lo, hi]``.
    """
    first, last = -(-lo // itemsize), hi // itemsize
    if n < 1 or last - first + 1 < n:
        raise ValueError(f"{n} distinct sizes of {itemsize}-byte elements do not fit in [{lo}, {hi}] bytes")
    if n == 1:
        return [first * itemsize]
    return [(first + (i * (last - first)) // (n - 1)) * itemsize for i in range(n)]


def make_state(total_bytes: int, num_tensors: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``num_tensors`` float32 tensors totalling about ``total_bytes`` bytes."""
    gen = torch.Generator().manual_seed(seed)
    per = max(1, total_bytes // num_tensors // 4)
    return {f"layer{i}.weight": torch.randn(per, generator=gen) for i in range(num_tensors)}


def make_sizes_state(n: int, lo: int, hi: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``n`` float32 tensors of the ``n`` sizes of :func:`distinct_sizes`."""
    gen = torch.Generator().manual_seed(seed)
    return {
        f"layer{i}.weight": torch.randn(size // 4, generator=gen) for i, size in enumerate(distinct_sizes(n, lo, hi))
    }


def default_systems(spec: str, device: str = "cpu") -> list[str]:
    """The keys of the systems a workload on ``device`` runs unless --systems names them."""
    if spec == "llm" and device == "cuda":
        return list(LLM_GPU_SYSTEMS)
    if spec in ("llm", "fsdp2"):
        return list(LLM_SYSTEMS)
    if sizes_spec(spec) is not None:
        return list(SIZES_SYSTEMS)
    return list(DEFAULT_SYSTEM_KEYS)


def _size_label(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes % MiB == 0 else f"{nbytes / KiB:g} KiB"


def make_workload(
    spec: str,
    train_batch: int,
    llm_cfg: dict[str, int] | None = None,
    sizes_warmup: int = SIZES_WARMUP,
    device: str = "cpu",
) -> tuple[Any, dict[str, Any]]:
    """The state of ``spec`` on ``device`` (``"cpu"`` or ``"cuda"``) and what the report
    says of it: ``name``, ``label``, ``tensors``, ``device``; ``warmup`` (saves after the
    first and before the measured ones) and ``interleave_raw`` (a raw write + fsync
    between the measured saves) where not 0 / False.

    Raises:
        ValueError: a malformed spec.
    """
    sd, info = _make_workload(spec, train_batch, llm_cfg, sizes_warmup, device)
    return (sd if spec == "llm" else to_device(sd, device)), {**info, "device": device}


def _make_workload(
    spec: str, train_batch: int, llm_cfg: dict[str, int] | None, sizes_warmup: int, device: str
) -> tuple[Any, dict[str, Any]]:
    if spec == "llm":
        from benchmark import llm

        cfg = llm_cfg or llm.LLM_FULL
        model, opt, sd = llm.build_llm(cfg, device=device)
        n_params = sum(p.numel() for p in model.parameters())
        del model, opt  # the state's tensors are the parameters and the optimizer's state
        info = {
            "name": "llm",
            "label": (
                f"GPT {n_params / 1e6:.1f} M params + AdamW state from get_state_dict "
                f"({llm.describe(cfg)}; model + optim nested dicts)"
            ),
            "tensors": len(list(tensors_of(sd))),
            "config": cfg,
        }
        return sd, info
    if spec == "train":
        from benchmark.training import Trainer

        tr = Trainer(train_batch)
        sd = tr.state_dict()
        info = {
            "name": "train",
            "label": (
                f"training example: GPT {tr.n_params / 1e6:.2f} M params + AdamW "
                f"({tr.cfg['n_layer']} layers, width {tr.cfg['n_embd']})"
            ),
            "tensors": len(list(tensors_of(sd))),
        }
        del tr
        return sd, info
    sizes = sizes_spec(spec)
    if sizes is not None:
        n, lo, hi = sizes
        sd = make_sizes_state(n, lo, hi)
        return sd, {
            "name": spec,
            "label": (f"{n} float32 tensors of {n} distinct sizes, {_size_label(lo)} to {_size_label(hi)}"),
            "tensors": n,
            "distinct_sizes": n,
            "warmup": sizes_warmup,
            "interleave_raw": True,
        }
    if spec.startswith("sizes"):
        raise ValueError(f"workload {spec!r}: expected sizesN or sizesN:LO-HI (e.g. sizes200, sizes24:64K-96K)")
    size, _, n_str = spec.partition("/")
    n_tensors = int(n_str or 16)
    sd = make_state(parse_size(size), n_tensors)
    return sd, {"name": spec, "label": f"{size}B in {n_tensors} float32 tensors", "tensors": n_tensors}
