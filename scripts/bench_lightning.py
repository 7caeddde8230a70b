"""Lightning checkpoint stall: asyncckpt's plugin against Lightning's own AsyncCheckpointIO.

Both plugins get the same Lightning-shaped checkpoint dict (a model's ``state_dict``,
AdamW ``exp_avg`` / ``exp_avg_sq`` and the usual small values: about ``size_mb`` MiB of
float32 tensors) and the same directory. Per save, in alternation:

- **stall**: the seconds ``save_checkpoint`` blocks the calling (training) thread: what
  Lightning's ``ModelCheckpoint`` costs the training loop per checkpoint.
  ``AsyncckptCheckpointIO``: planning + a copy into a reused host buffer;
  ``lightning.pytorch.plugins.io.AsyncCheckpointIO`` (wrapping ``TorchCheckpointIO``):
  a ``clone()`` of every tensor on the calling thread, then ``torch.save`` in a thread.
- **until on disk**: from the call until the checkpoint is complete (asyncckpt: written,
  fsynced and committed; Lightning: ``torch.save`` returned: its ``_atomic_save`` does
  not fsync).

Medians over ``reps`` saves after a first (cold) save per plugin, reported apart (it
starts asyncckpt's writer process and allocates its buffer; Lightning's thread pool).
Each save waits for the previous one to finish first, so the stall of one save is not
inflated by the backlog of the last. Checkpoints are removed as the run goes.

    python scripts/bench_lightning.py                     # 5 saves of 256 MiB each
    python scripts/bench_lightning.py --reps 9 --size-mb 128

From another script: ``from bench_lightning import run; run(reps=5, size_mb=256)``.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

SYSTEMS = ("asyncckpt AsyncckptCheckpointIO", "Lightning AsyncCheckpointIO(TorchCheckpointIO)")


def make_checkpoint(size_mb: int, layers: int = 8) -> dict[str, Any]:
    """A Lightning-shaped checkpoint dict with about ``size_mb`` MiB of float32 tensors:
    ``layers`` square linear layers (weight + bias) and AdamW state (2 tensors per
    parameter), so the parameters are a third of the bytes."""
    param_bytes = size_mb * (1 << 20) // 3
    dim = max(1, int((param_bytes / 4 / layers) ** 0.5))
    g = torch.Generator().manual_seed(0)
    state_dict: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
    for i in range(layers):
        state_dict[f"layers.{i}.weight"] = torch.randn(dim, dim, generator=g)
        state_dict[f"layers.{i}.bias"] = torch.randn(dim, generator=g)
    optim_state = {
        i: {"step": torch.tensor(100.0), "exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)}
        for i, p in enumerate(state_dict.values())
    }
    return {
        "epoch": 3,
        "global_step": 1000,
        "pytorch-lightning_version": "bench",
        "state_dict": state_dict,
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 4, "completed": 3}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_path": "", "dirpath": "/tmp"}},
        "optimizer_states": [
            {
                "state": optim_state,
                "param_groups": [
                    {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.01, "params": list(range(len(state_dict)))}
                ],
            }
        ],
        "lr_schedulers": [],
        "hparams_name": "kwargs",
        "hyper_parameters": {"dim": dim, "layers": layers, "lr": 1e-3},
    }


def tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class _Plugin:
    """One plugin under test: save (timed), wait until on disk, remove."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == SYSTEMS[0]:
            from asyncckpt.lightning import AsyncckptCheckpointIO

            self.io: Any = AsyncckptCheckpointIO()
        else:
            from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

            self.io = AsyncCheckpointIO(TorchCheckpointIO())

    def save(self, checkpoint: dict[str, Any], path: Path) -> tuple[float, float]:
        """Returns (stall, until on disk) in seconds."""
        started = time.perf_counter()
        self.io.save_checkpoint(checkpoint, path)
        stall = time.perf_counter() - started
        if self.name == SYSTEMS[0]:
            self.io.wait(path)
        else:
            self.io.teardown()  # joins the thread (the next save starts a new pool)
        return stall, time.perf_counter() - started

    def remove(self, path: Path) -> None:
        self.io.remove_checkpoint(path)

    def close(self) -> None:
        self.io.teardown()


def run(reps: int = 5, size_mb: int = 256, directory: str | Path | None = None) -> dict[str, Any]:
    """Measure both plugins on the same checkpoint; print a markdown table.

    Args:
        reps: timed saves per plugin (after one cold save each).
        size_mb: tensor bytes of the checkpoint, in MiB.
        directory: where to write (default: a temporary directory under the
            repository, removed afterwards).

    Returns:
        ``{"size_mb", "bytes", "reps", "versions", "systems": {name: {"stall_s",
        "stall_s_all", "first_stall_s", "on_disk_s", "on_disk_s_all",
        "first_on_disk_s"}}}`` (seconds; ``stall_s`` and ``on_disk_s`` are medians).
    """
    import lightning

    warnings.filterwarnings("ignore", category=UserWarning)
    checkpoint = make_checkpoint(size_mb)
    nbytes = tensor_bytes(checkpoint)
    own_dir = directory is None
    root = Path(tempfile.mkdtemp(prefix="bench_lightning_", dir=ROOT)) if directory is None else Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    plugins = [_Plugin(name) for name in SYSTEMS]
    times: dict[str, list[tuple[float, float]]] = {p.name: [] for p in plugins}
    try:
        for rep in range(reps + 1):  # rep 0: the cold save
            for i, plugin in enumerate(plugins):
                path = root / f"sys{i}-rep{rep}.ckpt"
                times[plugin.name].append(plugin.save(checkpoint, path))
                plugin.remove(path)
    finally:
        for plugin in plugins:
            plugin.close()
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)

    systems = {}
    for name, samples in times.items():
        warm = samples[1:]
        systems[name] = {
            "stall_s": statistics.median(s for s, _ in warm),
            "stall_s_all": [s for s, _ in warm],
            "first_stall_s": samples[0][0],
            "on_disk_s": statistics.median(d for _, d in warm),
            "on_disk_s_all": [d for _, d in warm],
            "first_on_disk_s": samples[0][1],
        }
    result = {
        "size_mb": size_mb,
        "bytes": nbytes,
        "reps": reps,
        "versions": {"torch": torch.__version__, "lightning": lightning.__version__},
        "systems": systems,
    }
    print(render_markdown(result))
    return result


def render_markdown(result: dict[str, Any]) -> str:
    """The result of :func:`run` as a small markdown table."""
    mib = result["bytes"] / (1 << 20)
    lines = [
        (
            f"Lightning save_checkpoint stall: {mib:.0f} MiB of tensors, median of {result['reps']} saves "
            f"(torch {result['versions']['torch']}, lightning {result['versions']['lightning']})"
        ),
        "",
        "| plugin | stall per save (median) | first save stall | until on disk (median) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, s in result["systems"].items():
        lines.append(
            f"| {name} | {s['stall_s'] * 1e3:.1f} ms | {s['first_stall_s'] * 1e3:.1f} ms | {s['on_disk_s']:.2f} s |"
        )
    a, b = (result["systems"][n]["stall_s"] for n in SYSTEMS)
    if a > 0:
        lines += [
            "",
            (
                f"Stall ratio (Lightning AsyncCheckpointIO / asyncckpt): {b / a:.1f}x. "
                "'until on disk': asyncckpt written, fsynced and committed; Lightning's torch.save "
                "returned (no fsync)."
            ),
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5, help="timed saves per plugin (after one cold save)")
    p.add_argument("--size-mb", type=int, default=256, help="tensor MiB of the checkpoint")
    p.add_argument("--dir", default=None, help="directory to write into (default: a temp dir under ./)")
    p.add_argument("--json", default=None, help="also write the result as JSON to this file")
    args = p.parse_args(argv)
    result = run(args.reps, args.size_mb, args.dir)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
