#!/usr/bin/env python
"""Train a small byte-level GPT on the Python standard library's own source code,
checkpointing asynchronously with :class:`asyncckpt.CheckpointManager`.

One file over 600 lines, on purpose: it is the example users read and copy whole.

    python scripts/train.py                              # about 2 minutes on 2 CPU cores
    python scripts/train.py --resume                     # continue from ./checkpoints
    python scripts/train.py --fresh                      # start over: remove ./checkpoints first
    torchrun --standalone --nproc-per-node 2 scripts/train.py         # DDP (gloo on CPU)
    torchrun --standalone --nproc-per-node 2 scripts/train.py --fsdp  # FSDP2: parameters, AdamW state sharded

Without --resume or --fresh it refuses to start over checkpoints in --ckpt-dir.

Per step it shows one progress bar on stderr when that is a terminal (step, loss, steps/s,
the last checkpoint's stall), else one line per 10% of the steps; --log-every N prints a
line every N steps instead, --quiet nothing per step. Every checkpoint prints its lines,
and the run ends with a summary. With several ranks only rank 0 prints. A checkpoint's
*stall* is how long it blocked the training loop: building the state dict (with the
all_gather of the RNG states) and ``save()`` staging it; this one figure is printed per
checkpoint, on the progress line and in the summary. The committed line also gives the
save's phases from its ``asyncckpt.SaveTimings`` (plan, stage, commit, finalize).

Everything needed for a bitwise-exact resume is checkpointed: model, AdamW state,
LR schedule, data position and every RNG (per rank). SIGTERM (a cluster's preemption
notice) is a preemption save (:class:`asyncckpt.PreemptionSave`): the ranks agree on a
step, wait for the save in flight, checkpoint that step and exit with code 143 within
--grace-s seconds; --resume then continues from exactly there. SIGINT (Ctrl-C), and
SIGTERM with --no-preemption-save, stop at the next step boundary, abort in-flight saves
and exit with code 128+signum; the newest committed checkpoint can be resumed.

With --fsdp (``fully_shard`` per block, then the root) every rank saves and stages only
its shards (DTensors from ``get_state_dict``), and --resume also works with a different
number of ranks: the checkpoint is resharded on load. The data order stays the same if
the global batch (--batch-size times the number of ranks) does; dropout streams of ranks
that did not exist in the checkpoint start from their seeds.

With --local-dir DIR (a node-local directory, e.g. under /dev/shm) every --local-every
steps also go to the node-local tier (:class:`asyncckpt.LocalTier`), replicated to
--replicas peer nodes; --resume restores the newest step of either tier (a rank whose
shard is not on its node fetches it from a peer) and prints where it came from. The
environment variable ``TRAIN_KILL=RANK:STEP`` (a test's stand-in for a node loss) makes
that rank SIGKILL itself after that step, once its local saves are restorable (in the
first attempt only, under torchrun's ``--max-restarts``).

torchrun's in-place restart works with gloo too, on one node or several
(``--max-restarts N`` with ``--resume``: the restarted workers resume from the newest
step of either tier): see :func:`init_process_group`.
"""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import functools
import logging
import math
import os
import random
import shutil
import signal
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

import asyncckpt

VOCAB = 256  # bytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--steps", type=int, default=600, help="total optimizer steps, the LR schedule's length (%(default)s)")
    a(
        "--stop-at",
        type=int,
        metavar="STEP",
        help="stop after this step, checkpointed, as if preempted; --resume then continues to --steps",
    )
    a("--ckpt-every", type=int, default=100, metavar="N", help="checkpoint every N steps (%(default)s)")
    a("--ckpt-dir", default="./checkpoints", help="checkpoint root directory (%(default)s)")
    a("--keep-last", type=int, default=3, metavar="N", help="keep the newest N checkpoints (%(default)s)")
    a(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --ckpt-dir (or --upload-to, or the local tier)",
    )
    a(
        "--upload-to",
        metavar="URL",
        help="also upload each committed checkpoint to s3://bucket/prefix in the background (the s3 extra; "
        "AWS_ENDPOINT_URL for S3-compatible stores); --resume restores from there when --ckpt-dir is behind",
    )
    a("--keep-remote", type=int, metavar="N", help="with --upload-to: keep the newest N uploaded (default: all)")
    a("--local-dir", default=None, metavar="DIR", help="node-local tier directory (e.g. /dev/shm/...): see above")
    a("--local-every", type=int, default=1, metavar="N", help="save to the local tier every N steps (%(default)s)")
    a("--replicas", type=int, default=1, metavar="R", help="local tier copies on other nodes (%(default)s)")
    a(
        "--grace-s",
        type=float,
        default=25.0,
        metavar="S",
        help="on SIGTERM, checkpoint the step the ranks agree on and exit within S seconds (%(default)s)",
    )
    a(
        "--no-preemption-save",
        action="store_true",
        help="on SIGTERM, abort in-flight checkpoints and exit at the next step boundary instead",
    )
    a(
        "--fresh",
        action="store_true",
        help="start at step 0 even if --ckpt-dir holds checkpoints: remove it first (only if it holds nothing else)",
    )
    a(
        "--temporal",
        action="store_true",
        help="write each checkpoint from a forked child instead of the persistent worker",
    )
    a(
        "--fsdp",
        action="store_true",
        help="shard parameters and optimizer state with FSDP2 (fully_shard per block + root) instead of DDP",
    )
    a("--seed", type=int, default=1337, help="(%(default)s)")
    a("--n-layer", type=int, default=4, help="transformer blocks (%(default)s)")
    a("--n-head", type=int, default=4, help="attention heads (%(default)s)")
    a("--n-embd", type=int, default=128, help="model width (%(default)s)")
    a("--block-size", type=int, default=128, help="context length in bytes (%(default)s)")
    a("--batch-size", type=int, default=16, help="sequences per step and rank (%(default)s)")
    a("--dropout", type=float, default=0.1, help="(%(default)s)")
    a("--lr", type=float, default=1e-3, help="peak learning rate of AdamW (%(default)s)")
    a("--warmup", type=int, help="linear warmup steps, then cosine decay (default: 5%% of --steps)")
    a("--weight-decay", type=float, default=0.1, help="(%(default)s)")
    a("--data-mb", type=float, default=4.0, help="cap on the training text, in MB (%(default)s)")
    a("--device", default="auto", choices=["auto", "cpu", "cuda"], help="(%(default)s)")
    a(
        "--log-every",
        type=int,
        default=0,
        metavar="N",
        help="print a line every N steps (loss, LR, step time) instead of the progress bar (default 0: off)",
    )
    a("--quiet", action="store_true", help="nothing per step, only checkpoints and the summary")
    a("--save-final", metavar="PATH", help="torch.save the final model state_dict to PATH (rank 0)")
    args = p.parse_args(argv)
    if args.n_embd % args.n_head:
        p.error("--n-embd must be divisible by --n-head")
    if min(args.steps, args.ckpt_every) < 1:
        p.error("--steps and --ckpt-every must be positive")
    if args.log_every < 0:
        p.error("--log-every must be 0 (off) or positive")
    if args.keep_remote is not None and args.upload_to is None:
        p.error("--keep-remote needs --upload-to")
    if args.fresh and args.resume:
        p.error("--fresh starts over, --resume continues: pass one of them")
    if args.warmup is None:
        args.warmup = max(1, args.steps // 20)
    return args


def remove_checkpoint_dir(ckpt_dir: str, remove: bool) -> None:
    """``--fresh``: remove ``ckpt_dir`` if it exists (when ``remove``; every rank checks).

    Raises:
        SystemExit: it holds something that is not part of a checkpoint root (a name
            other than ``step_*``, ``latest`` and hidden ones): nothing is removed.
    """
    root = Path(ckpt_dir)
    if not root.exists():
        return
    others = sorted(e.name for e in root.iterdir() if not (e.name.startswith((".", "step_")) or e.name == "latest"))
    if not root.is_dir() or others:
        raise SystemExit(
            f"--fresh: {ckpt_dir} holds more than checkpoints ({', '.join(others[:3]) or 'a file'}); "
            "not removing it: choose another --ckpt-dir"
        )
    if remove:
        shutil.rmtree(root)


# ----------------------------------------------------------------------------- data


def load_corpus(max_bytes: int) -> torch.Tensor:
    """Concatenate the stdlib's ``*.py`` files, sorted by path, into a uint8 tensor of at most ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for top, dirs, names in os.walk(root):  # installed packages pruned, not walked (13,000 paths: 0.5 s a process)
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages")]
        found += [Path(top, name) for name in names if name.endswith(".py")]
    files = sorted(found, key=lambda p: p.relative_to(root).as_posix())
    buf = bytearray()
    for f in files:
        if len(buf) >= max_bytes:
            break
        buf += f.read_bytes() + b"\n"
    del buf[max_bytes:]
    return torch.frombuffer(buf, dtype=torch.uint8).clone()


class WindowSampler:
    """Shuffled, non-overlapping ``block_size + 1``-byte windows, drawn without replacement per epoch.

    All ranks share one permutation (drawn from a dedicated ``torch.Generator``) and take
    disjoint slices of it. The state (epoch, position, generator state at the epoch's start)
    is identical on every rank and fully determines the remaining batches.
    """

    def __init__(
        self, data: torch.Tensor, block_size: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1
    ) -> None:
        self.data, self.block, self.batch, self.rank, self.world = data, block_size, batch_size, rank, world_size
        self.n_windows = (len(data) - 1) // block_size
        if self.n_windows < batch_size * world_size:
            raise ValueError(f"corpus too small: {self.n_windows} windows < {batch_size * world_size} per step")
        self.gen = torch.Generator().manual_seed(seed)
        self.epoch, self.pos = 0, 0
        self._start_epoch()

    def _start_epoch(self) -> None:
        self.epoch_gen_state = self.gen.get_state()
        self.perm = torch.randperm(self.n_windows, generator=self.gen)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return this rank's (inputs, targets), each of shape (batch, block) and dtype int64."""
        per_step = self.batch * self.world
        if self.pos + per_step > self.n_windows:
            self.epoch, self.pos = self.epoch + 1, 0
            self._start_epoch()
        lo = self.pos + self.rank * self.batch
        starts = self.perm[lo : lo + self.batch] * self.block
        self.pos += per_step
        w = self.data[starts[:, None] + torch.arange(self.block + 1)].long()
        return w[:, :-1], w[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos, "gen_state": self.epoch_gen_state.clone()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.gen.set_state(sd["gen_state"])
        self._start_epoch()  # re-draws the epoch's permutation; leaves the generator as it was
        self.epoch, self.pos = int(sd["epoch"]), int(sd["pos"])


# ----------------------------------------------------------------------------- model


@dataclass
class GPTConfig:
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention + MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.ln1, self.ln2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + F.dropout(self.proj(y.transpose(1, 2).reshape(B, T, C)), self.dropout, self.training)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A minimal GPT over bytes."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, VOCAB, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:  # GPT-2 init, with scaled residual projections
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine decay to 0.1 at ``total`` steps (multiplier for LambdaLR)."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t))

    return f


def settle_ddp_buckets(model: DistributedDataParallel, batch_shape: tuple[int, int], device: torch.device) -> None:
    """One forward and backward of ``model`` on a dummy batch of ``batch_shape`` (bytes of
    value 0), leaving parameters, gradients and every RNG as they were, so that every
    training step all-reduces its gradients with the same bucket layout.

    DDP packs gradients into buckets in reverse parameter order when constructed, and
    repacks them once, in the order they became ready, after a process's first backward.
    On more than 2 ranks an all-reduce adds the ranks' values in an order that depends on
    where an element lies in its bucket (the ring's chunks), so the first step after
    ``--resume``, all-reduced with the initial layout, would differ in the last bits from
    the same step of an uninterrupted run, all-reduced with the repacked one. After this,
    every step, of a fresh or a resumed process, uses the repacked layout.
    """
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # dropout draws
        model(torch.zeros(batch_shape, dtype=torch.long, device=device)).float().sum().backward()
    model.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------- RNG state


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's RNG states (torch CPU, Python ``random``, CUDA) as CPU tensors.

    Nothing here draws from Python's ``random``; it is saved anyway, like every RNG a
    training loop might touch (augmentations, samplers, user code).
    """
    _, internal, gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor(internal, dtype=torch.int64),
        "python_gauss": torch.tensor([math.nan if gauss is None else gauss], dtype=torch.float64),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Inverse of :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    gauss = float(state["python_gauss"][0])
    internal = tuple(state["python"].tolist())
    random.setstate((random.Random.VERSION, internal, None if math.isnan(gauss) else gauss))
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def all_rng_states(device: torch.device, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    """Every rank's RNG states under ``rank{i}`` keys, identical on all ranks (one all_gather)."""
    mine = rng_state(device)
    if world_size == 1:
        return {"rank0": mine}
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine)
    return {f"rank{i}": s for i, s in enumerate(gathered)}


# ----------------------------------------------------------------------------- output


class Progress:
    """What rank 0 prints per step, and every other line it prints.

    Modes: ``"bar"``, one tqdm bar on stderr (step, loss, steps/s, the last checkpoint's
    stall) with the other lines printed above it; ``"lines"``, one line on stdout each
    time another 10% of the steps is done; ``"off"``, nothing per step (--quiet,
    --log-every, ranks other than 0).
    """

    def __init__(self, mode: str, total: int) -> None:
        self.mode, self.total = mode, total
        self.bar: tqdm | None = None
        self.stall_s: float | None = None
        self.mark = self.mark_step = 0
        self.mark_t = 0.0

    @staticmethod
    def choose(rank: int, args: argparse.Namespace) -> str:
        """The mode for this rank and command line."""
        if rank != 0 or args.quiet or args.log_every:
            return "off"
        return "bar" if sys.stderr.isatty() else "lines"

    def start(self, step: int) -> None:
        """Training starts (or resumes) after ``step`` steps."""
        self.mark, self.mark_step, self.mark_t = step * 10 // self.total, step, time.perf_counter()
        if self.mode == "bar":
            self.bar = tqdm(
                total=self.total, initial=step, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True
            )

    def print(self, msg: str) -> None:
        """Print a line on stdout (above the bar, if there is one)."""
        if self.bar is not None:
            self.bar.write(msg, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(msg, flush=True)

    def step(self, step: int, loss: float | torch.Tensor) -> None:
        """Step ``step`` is done, with this loss (a tensor is read only when shown)."""
        stall = "" if self.stall_s is None else f"last ckpt stall {self.stall_s * 1e3:.1f} ms"
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {float(loss):.4f}" + (f", {stall}" if stall else ""), refresh=False)
            self.bar.update(1)
        elif self.mode == "lines" and step * 10 // self.total > self.mark:
            now = time.perf_counter()
            rate = (step - self.mark_step) / max(now - self.mark_t, 1e-9)
            self.print(
                f"step {step}/{self.total} ({100 * step // self.total}%) | loss {float(loss):.4f} | "
                f"{rate:.2f} steps/s" + (f" | {stall}" if stall else "")
            )
            self.mark, self.mark_step, self.mark_t = step * 10 // self.total, step, now

    def checkpoint(self, stall_s: float) -> None:
        """A checkpoint was committed; it blocked the loop ``stall_s`` seconds."""
        self.stall_s = stall_s

    def close(self) -> None:
        """Leave the bar (at its last state) on the terminal."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


# ----------------------------------------------------------------------------- training


class StopFlag:
    """Signal handlers that only record the signal; a second signal kills the process."""

    def __init__(self, signals: tuple[int, ...]) -> None:
        self.signum = 0
        for sig in signals:
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signum:  # second Ctrl-C: give up on a clean exit
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.signum = signum

    def agreed(self, distributed: bool) -> int:
        """The signal number any rank received (0 if none); a collective when ``distributed``."""
        if not distributed:
            return self.signum
        t = torch.tensor([self.signum], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())


def init_process_group(backend: str) -> int:
    """``dist.init_process_group(backend)`` from torchrun's environment, with the group's
    store keys under a prefix of their own per attempt; returns the attempt (0 first).

    Why: torchrun's workers of every attempt share the agent's store (torch 2.13), whose
    keys outlive the attempt. torch prefixes them with ``TORCHELASTIC_RESTART_COUNT``,
    but with several agents ("nodes") that count differs between them: an agent whose
    own workers did not fail restarts them without counting. So after an in-place
    restart (``--max-restarts``) the ranks of different nodes meet under different
    prefixes, and a restarted gloo group reads a dead worker's address ("Gloo
    connectFullMesh failed ... Connection refused"; pytorch#147064 looks related).

    Here each worker counts its own starts in the agent's store, by world size and
    rank: every attempt starts every rank once, so each rank's count names the
    attempt, on every node alike. (A worker killed before it counted, within its first
    seconds, would leave its rank one behind: later in-place restarts then fail at
    once, and a requeue of the whole job, with a new store, starts afresh.)
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False)
    attempt = agent_store.add(f"train/starts/{world_size}/{rank}", 1) - 1
    store = dist.PrefixStore(f"train/attempt_{world_size}_{attempt}", agent_store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    return attempt


def main(argv: list[str] | None = None) -> int:
    """Train; return the process exit code (0, or 128+signum when stopped by a signal)."""
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    distributed = world_size > 1
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    # FSDP needs a process group even on one rank (without torchrun: an in-process store).
    use_pg = distributed or args.fsdp
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun's attempt (0: the first)
    if use_pg:
        faulthandler.enable()  # a fatal signal shows each thread's Python stack
        _USED_GLOO[0] = True  # (a CUDA run has a gloo backend for CPU tensors too)
        backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
        if "MASTER_ADDR" in os.environ:
            attempt = init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rank = dist.get_rank() if use_pg else 0
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    progress = Progress(Progress.choose(rank, args), args.steps)

    def log(msg: str) -> None:
        if rank == 0:
            progress.print(msg)

    # SIGTERM: a preemption save (the ranks agree on a step, checkpoint it, exit 143);
    # SIGINT: stop at the next step boundary and abort in-flight saves.
    stop = StopFlag((signal.SIGINT,) if not args.no_preemption_save else (signal.SIGINT, signal.SIGTERM))
    data = load_corpus(int(args.data_mb * 1e6))
    torch.manual_seed(args.seed)  # same initial weights on every rank
    cfg = GPTConfig(args.block_size, args.n_layer, args.n_head, args.n_embd, args.dropout)
    raw_model = GPT(cfg).to(device)
    if args.fsdp:
        # Every rank built the same full weights; each keeps its shard (dim 0) of them.
        from torch.distributed.fsdp import fully_shard

        for block in raw_model.blocks:
            fully_shard(block)
        fully_shard(raw_model)
    torch.manual_seed(args.seed + 1 + rank)  # per-rank dropout streams
    if use_cuda:
        torch.cuda.manual_seed(args.seed + 1 + rank)
    random.seed(args.seed + rank)
    optimizer = torch.optim.AdamW(raw_model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup, args.steps))
    sampler = WindowSampler(data, args.block_size, args.batch_size, args.seed, rank, world_size)

    def state_dict(step: int, rng_ranks: int | None = None) -> dict[str, Any]:
        """The checkpointed state (with --fsdp, model and optimizer values are DTensor shards).
        ``rng_ranks``: build a load template for a checkpoint saved by that many ranks."""
        model_sd, optim_sd = get_state_dict(raw_model, optimizer)
        rng = (
            all_rng_states(device, world_size)
            if rng_ranks is None
            else {f"rank{i}": rng_state(device) for i in range(rng_ranks)}
        )
        return {
            "model": model_sd,
            "optim": optim_sd,
            "sched": scheduler.state_dict(),
            "data": sampler.state_dict(),
            "rng": rng,
            "step": step,
            "world_size": world_size,
        }

    def global_loss(loss: torch.Tensor) -> float:
        """The loss to print: with --fsdp the mean over all ranks (comparable across world sizes)."""
        if not (args.fsdp and distributed):
            return loss.item()
        t = loss.detach().clone()
        dist.all_reduce(t)
        return t.item() / world_size

    n_params = sum(p.numel() for p in raw_model.parameters())
    log(
        f"corpus {len(data) / 1e6:.2f} MB of stdlib source | model {n_params / 1e6:.2f} M params | "
        f"world size {world_size} | {'FSDP' if args.fsdp else 'DDP' if distributed else 'single process'} | "
        f"device {device} | "
        f"{'temporal' if args.temporal else 'persistent'} checkpoint writer"
    )
    if args.fresh:
        remove_checkpoint_dir(args.ckpt_dir, remove=rank == 0)
        if use_pg:
            dist.barrier()

    def on_upload(outcome: Any) -> None:  # --upload-to: in the upload thread, once per checkpoint
        if isinstance(outcome, asyncckpt.UploadResult):
            log(
                f"checkpoint step {outcome.step} uploaded | {outcome.url} | "
                f"{outcome.bytes / 1e6:.1f} MB in {outcome.seconds:.2f} s"
            )
        elif isinstance(outcome, asyncckpt.UploadSkipped):  # the uploads fell behind the saves
            log(f"checkpoint step {outcome.step} not uploaded: superseded by step {outcome.superseded_by}")

    upload: dict[str, Any] = {}
    if args.upload_to:
        upload = {"upload_to": args.upload_to, "keep_remote": args.keep_remote, "callback": on_upload}
    local = (
        asyncckpt.LocalTier(dir=args.local_dir, every=args.local_every, replicas=args.replicas)
        if args.local_dir
        else None
    )
    mgr = asyncckpt.CheckpointManager(
        args.ckpt_dir, keep_last=args.keep_last, persistent=not args.temporal, local=local, **upload
    )
    kill = os.environ.get("TRAIN_KILL", "") if attempt == 0 else ""
    kill_rank, kill_step = (int(x) for x in kill.split(":")) if kill else (-1, -1)

    def ckpt_path(s: int) -> str:
        """Step ``s``'s directory, as the command line named the root (``./checkpoints/step_00000100``),
        or its URL when only the remote tier (``--upload-to``) holds it."""
        if args.upload_to and not mgr.step_dir(s).is_dir():
            return f"{args.upload_to.rstrip('/')}/{mgr.step_dir(s).name}"
        return os.path.join(args.ckpt_dir, mgr.step_dir(s).name)

    def latest_committed() -> str:
        latest = mgr.latest_step()
        return "no checkpoint committed" if latest is None else f"latest committed: step {latest} ({ckpt_path(latest)})"

    preemption = None if args.no_preemption_save else asyncckpt.PreemptionSave(mgr, grace_s=args.grace_s, exit=False)
    logging.getLogger("asyncckpt.preemption").setLevel(logging.ERROR)  # this script prints its own lines
    step, exit_code = 0, 0
    try:
        latest = mgr.latest_step()
        if args.resume and mgr.local is not None:
            t0 = time.perf_counter()
            sd = state_dict(0, rng_ranks=world_size)  # the local tier holds this world size's steps only
            saved = [world_size]

            def load_persistent(s: int) -> None:  # the persistent tier: any world size (resharded)
                probe = {"world_size": 0}
                mgr.load(probe, s, verify=False)
                saved[0] = int(probe["world_size"])
                sd.clear()
                sd.update(state_dict(0, rng_ranks=saved[0]))
                mgr.load(sd, s)

            restored = mgr.local.restore(sd, latest, load_persistent)
            if restored is None:
                # the template's get_state_dict initialised AdamW's state (a step with zero
                # grads: step count 1); a fresh start has none, as without --resume
                optimizer.state.clear()
                log(f"nothing to restore in {args.ckpt_dir} or {args.local_dir}: starting from step 0")
            else:
                step = restored.step
                set_state_dict(raw_model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
                scheduler.load_state_dict(sd["sched"])
                sampler.load_state_dict(sd["data"])
                if rank < saved[0]:
                    set_rng_state(sd["rng"][f"rank{rank}"], device)
                log(f"{restored} ({time.perf_counter() - t0:.2f} s)")
        elif args.resume and latest is not None:
            t0 = time.perf_counter()
            # The saving world size first (a small read): it fixes which RNG states exist.
            probe = {"world_size": 0}
            mgr.load(probe, latest, verify=False)
            saved_ws = int(probe["world_size"])
            # A template with the right structure (initialises AdamW's state); DCP reshards
            # the saved tensors into this rank's shards of it.
            sd = state_dict(0, rng_ranks=saved_ws)
            step = mgr.load(sd, latest)
            set_state_dict(raw_model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            scheduler.load_state_dict(sd["sched"])
            sampler.load_state_dict(sd["data"])
            if rank < saved_ws:
                set_rng_state(sd["rng"][f"rank{rank}"], device)
            log(
                f"resumed from step {step} in {ckpt_path(step)} ({time.perf_counter() - t0:.2f} s)"
                + (f", saved by {saved_ws} ranks, resharded to {world_size}" if saved_ws != world_size else "")
            )
        elif args.resume:
            log(f"no checkpoint in {args.ckpt_dir}: starting from step 0")
        elif latest is not None:
            raise SystemExit(
                f"{args.ckpt_dir} already holds checkpoints (latest step {latest}); pass --resume "
                "to continue, --fresh to start over (removes them), or choose another --ckpt-dir"
            )
        end = args.steps if args.stop_at is None else min(args.steps, args.stop_at)
        if step >= end and step:
            log(
                f"nothing left to train: step {step} ({ckpt_path(step)}) is at "
                + (f"--steps {args.steps}" if end == args.steps else f"--stop-at {args.stop_at}")
            )
        model = DistributedDataParallel(raw_model) if distributed and not args.fsdp else raw_model
        if isinstance(model, DistributedDataParallel):
            settle_ddp_buckets(model, (args.batch_size, args.block_size), device)
        handles: dict[int, Any] = {}  # step -> SaveHandle, until committed
        # A checkpoint's stall: the seconds the loop spent in state_dict() + save() (the
        # library's SaveTimings.stall_s counts save()'s part only), per step saved.
        stalls: dict[int, float] = {}
        committed: list[tuple[float, Any]] = []  # (stall, SaveTimings) of the committed saves

        def report(steps: list[int]) -> None:
            for s in steps:
                t = handles.pop(s).timings
                committed.append((stalls[s], t))
                progress.checkpoint(stalls[s])
                log(
                    f"checkpoint step {s} committed | {ckpt_path(s)} | stall {stalls[s] * 1e3:.1f} ms | "
                    f"write {t.write_s:.3f} s | {t.bytes / 1e6:.1f} MB at {t.gbps:.3f} GB/s | "
                    f"plan {t.plan_s * 1e3:.1f} ms, stage {t.stage_s * 1e3:.1f} ms, "
                    f"commit {t.commit_s * 1e3:.1f} ms, finalize {t.finalize_s:.3f} s"
                )

        model.train()
        start_step, t_start = step, time.perf_counter()
        progress.start(step)
        while step < args.steps and (args.stop_at is None or step < args.stop_at):
            signum = stop.agreed(distributed)
            if signum:
                exit_code = 128 + signum
                progress.close()
                log(f"received {signal.Signals(signum).name}: stopping at step {step}")
                break
            t0 = time.perf_counter()
            x, y = (t.to(device) for t in sampler.next_batch())
            loss = F.cross_entropy(model(x).view(-1, VOCAB), y.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if args.quiet:
                pass
            elif args.log_every and (step % args.log_every == 0 or step == args.steps):
                log(
                    f"step {step:5d}/{args.steps} | loss {global_loss(loss):.4f} | lr {scheduler.get_last_lr()[0]:.2e} "
                    f"| {(time.perf_counter() - t0) * 1e3:.0f} ms"
                )
            elif not args.log_every:  # the progress display; with --fsdp on several ranks the loss is a
                # collective (all ranks, every step), else read only when shown (no sync per step)
                progress.step(step, global_loss(loss) if args.fsdp and distributed else loss.detach())
            last = step == args.steps or step == args.stop_at
            state = None
            if step % args.ckpt_every == 0 or last:
                t1 = time.perf_counter()
                state = state_dict(step)
                handles[step] = mgr.save(step, state)
                stalls[step] = time.perf_counter() - t1
                log(
                    f"checkpoint step {step} staged in {stalls[step] * 1e3:.1f} ms (stall), "
                    f"writing {ckpt_path(step)} in the background"
                )
            if mgr.local is not None:
                if mgr.local.due(step):
                    t1 = time.perf_counter()
                    mgr.local.save(step, state if state is not None else state_dict(step))
                    log(f"local checkpoint step {step} staged in {(time.perf_counter() - t1) * 1e3:.1f} ms (stall)")
                for s in mgr.local.maybe_finalize(blocking=step == kill_step and rank == kill_rank):
                    log(f"local checkpoint step {s} restorable | {args.local_dir} | {args.replicas} replicas")
                if step == kill_step and rank == kill_rank:
                    print(f"rank {rank}: TRAIN_KILL at step {step}: SIGKILL", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
            try:
                report(mgr.maybe_finalize())
            except asyncckpt.CheckpointException as exc:  # raised on every rank alike
                # A signal sent to the whole process group (Slurm, systemd) may have killed
                # the checkpoint writer mid-write: then stop as planned; otherwise fail.
                if not stop.agreed(distributed):
                    raise
                log(f"a checkpoint failed while stopping: {str(exc).splitlines()[0]}")
            if preemption is not None and preemption.reached(step):  # all ranks agree, without a stall
                signame = signal.Signals(preemption.agreed_signum).name
                progress.close()
                log(f"received {signame}: preemption save of step {step}")
                t1 = time.perf_counter()
                final = preemption.finish(step, functools.partial(state_dict, step))
                report([s for s in list(handles) if handles[s].done() and handles[s].exception() is None])
                exit_code = 128 + preemption.agreed_signum
                log(
                    f"preemption checkpoint step {step} committed in {time.perf_counter() - t1:.2f} s: "
                    f"{ckpt_path(step)}"
                    if final == step
                    else f"preemption save of step {step} aborted"
                )
                break
        train_s = time.perf_counter() - t_start
        if preemption is not None:
            preemption.close()  # no agreement collective outstanding past the loop
        progress.close()

        if exit_code:
            preempted = preemption is not None and preemption.agreed_signum
            mgr.close(abort=True)  # after a preemption save: closed already, nothing to abort
            log(("" if preempted else "aborted in-flight checkpoints; ") + latest_committed())
            return exit_code
        t0 = time.perf_counter()
        report(mgr.maybe_finalize(blocking=True))
        if mgr.local is not None:
            for s in mgr.local.maybe_finalize(blocking=True):
                log(f"local checkpoint step {s} restorable | {args.local_dir} | {args.replicas} replicas")
        mgr.close()
        report([s for s in list(handles) if handles[s].done()])
        close_s = time.perf_counter() - t0
        if args.save_final and args.fsdp:  # collective: gathers the full tensors to rank 0
            full = get_model_state_dict(raw_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                torch.save(full, args.save_final)
        elif args.save_final and rank == 0:
            torch.save(raw_model.state_dict(), args.save_final)

        n = step - start_step
        log("=" * 72)
        if n:
            log(
                f"summary: {n} steps in {train_s:.1f} s ({n / max(train_s, 1e-9):.2f} steps/s, "
                f"{n * args.batch_size * args.block_size * world_size / max(train_s, 1e-9):,.0f} tokens/s), "
                f"final loss {global_loss(loss):.4f}"
            )
        else:
            log(f"summary: no step trained (at step {step} of {args.steps})")
        log(f"  checkpoints: {len(stalls)} saved, {len(committed)} committed, kept {mgr.steps()} in {args.ckpt_dir}")
        if committed:
            blocked = sum(stalls.values())
            log(
                f"  stall: median {statistics.median(st for st, _ in committed) * 1e3:.1f} ms, "
                f"max {max(st for st, _ in committed) * 1e3:.1f} ms; training loop blocked "
                f"{blocked:.2f} s in all ({100 * blocked / max(train_s, 1e-9):.1f}% of training time)"
            )
            log(
                f"  write: median {statistics.median(t.write_s for _, t in committed):.3f} s at "
                f"{statistics.median(t.gbps for _, t in committed):.3f} GB/s, {committed[-1][1].bytes / 1e6:.1f} MB "
                f"per checkpoint; final wait + close {close_s:.2f} s"
            )
        return 0
    except BaseException:
        progress.close()
        mgr.close(abort=True)
        raise
    finally:
        if preemption is not None:
            preemption.close()
        if use_pg:
            dist.destroy_process_group()


#: Whether this run made a process group, which has a gloo backend (see :func:`exit_without_finalizing`).
_USED_GLOO = [False]


def exit_without_finalizing(code: int) -> None:
    """End the process with ``code`` once the atexit functions ran (asyncckpt's exit
    phases among them) and the output is flushed, without the interpreter's finalization.

    Why, after a run on a gloo process group: a gloo worker thread may still hold the
    last reference to a tensor of the run's last collective (its Python object dropped
    first) when the interpreter finalizes. Releasing it takes the GIL, which a
    finalizing interpreter refuses by ending the thread (``pthread_exit``), and that
    ends the process: SIGABRT, "terminate called without an active exception" (the
    stack: ``c10d::ProcessGroupGloo::runLoop`` -> ``c10::TensorImpl::decref_pyobject``
    -> ``pthread_exit``), after a run that succeeded. Seen about once in 30 FSDP runs
    with the machine loaded; torch's own attempt at a fix (an atexit
    ``destroy_process_group``, pytorch#179291) was abandoned, and destroying the groups
    does not help: their worker threads outlive it.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# The persistent checkpoint writer is started with "spawn", which re-imports this file in
# a fresh interpreter: everything above only defines things; training starts here.
if __name__ == "__main__":
    exit_code = main()
    if _USED_GLOO[0]:
        exit_without_finalizing(exit_code)
    sys.exit(exit_code)
