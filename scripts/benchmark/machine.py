"""What a run records about the machine and the code measured, and the 1-rank process group."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import asyncckpt
from benchmark.common import ROOT, GiB
from benchmark.gpu import gpu_info


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
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "asyncckpt"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return out + (" + uncommitted asyncckpt changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):  # no git, or not a checkout
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
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model,
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "ram_gib": ram,
        "fs": fs,
        "asyncckpt": asyncckpt.__version__,
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": os.getloadavg(),
        "asyncckpt_sources_sha1": sources_sha1(),
        "git_head": git_head(),
        "gpu": gpu_info(),
    }


def init_process_group() -> None:
    """A 1-rank gloo group on 127.0.0.1 (DCP's process executor needs one), for every
    system alike."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
