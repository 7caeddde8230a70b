"""The training example's loop (scripts/train.py's GPT + AdamW) with a checkpoint every
K steps, against the same loop without one; on a GPU (``--device cuda``) issue 35's MLP
loop (:class:`benchmark.gpu.MlpTrainer`), whose training thread runs ahead of the device."""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

import asyncckpt
from benchmark.common import error_line, free_memory, log, med, state_bytes


def train_defaults() -> dict[str, Any]:
    import train

    try:
        a = train.parse_args([])
        return {
            "n_layer": a.n_layer,
            "n_head": a.n_head,
            "n_embd": a.n_embd,
            "block_size": a.block_size,
            "lr": a.lr,
            "weight_decay": a.weight_decay,
            "dropout": a.dropout,
        }
    except (AttributeError, SystemExit):  # the example's command line changed: its documented defaults
        return {
            "n_layer": 4,
            "n_head": 4,
            "n_embd": 128,
            "block_size": 128,
            "lr": 1e-3,
            "weight_decay": 0.1,
            "dropout": 0.1,
        }


class Trainer:
    """The training example's model (scripts/train.py's GPT) and AdamW, on random bytes."""

    def __init__(self, batch_size: int, seed: int = 1337, **overrides: Any) -> None:
        import train
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self._get_state_dict = get_state_dict
        cfg = {**train_defaults(), **overrides}
        self.cfg = {**cfg, "batch_size": batch_size}
        torch.manual_seed(seed)
        self.model = train.GPT(
            train.GPTConfig(cfg["block_size"], cfg["n_layer"], cfg["n_head"], cfg["n_embd"], cfg["dropout"])
        )
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=cfg["weight_decay"]
        )
        self.vocab = getattr(train, "VOCAB", 256)
        gen = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, self.vocab, (64, batch_size, cfg["block_size"] + 1), generator=gen)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.label = (
            f"scripts/train.py's GPT ({cfg['n_layer']} layers, {cfg['n_head']} heads, width {cfg['n_embd']}, "
            f"context {cfg['block_size']}, batch {batch_size}) + AdamW"
        )
        self.step_no = 0
        self.model.train()
        self.forward_backward()
        self.opt.step()  # AdamW's state exists from here on

    def forward_backward(self) -> None:
        w = self.data[self.step_no % len(self.data)]
        x, y = w[:, :-1], w[:, 1:]
        loss = F.cross_entropy(self.model(x).view(-1, self.vocab), y.reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)

    def optimizer_step(self) -> None:
        self.opt.step()
        self.step_no += 1

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = self._get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd, "step": self.step_no}

    def sync(self) -> None:
        """Nothing is queued on a device: the CPU loop's work is done when its calls return."""


class TrainCkpt:
    """A checkpointing policy in the training loop: ``before_update`` runs between
    backward and optimizer.step(), ``after_update`` after it (where a checkpoint is
    due), ``drain`` at the end. Their time in the loop is the stall."""

    overlapped = False

    def open(self, root: Path, state: Callable[[], Any] | None = None) -> None:
        """Set up before the timed loop; ``state()`` gives the training state."""
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def before_update(self) -> None:
        pass

    def save(self, step: int, sd: Any) -> None:
        pass

    def poll(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class TrainTorchSave(TrainCkpt):
    def save(self, step: int, sd: Any) -> None:
        with open(self.root / f"step_{step}.pt", "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())


class TrainDcpAsync(TrainCkpt):
    """dcp.async_save, waiting for the previous save before the next (as torchtitan does).

    ``stager``: a ``DefaultStager`` with asynchronous staging (overlapped: the loop waits
    for its staging before ``optimizer.step()``), with pinned memory and non-blocking
    copies where ``cuda``; reused across saves, or, with ``fresh_stager``, a new one per
    save, closed once that save is written (torch 2.11's ``async_save`` closes the stager
    it is given, so that a reused one fails its second save with ``KeyError: <class
    'type'>``; torch 2.13 leaves it to its owner). ``keep``: remove older checkpoints,
    in a background thread, once a newer one is written (``None``: keep all)."""

    def __init__(self, stager: bool, cuda: bool = False, fresh_stager: bool = False, keep: int | None = None) -> None:
        self.use_stager, self.overlapped = stager, stager
        self.cuda, self.fresh_stager, self.keep = cuda, fresh_stager, keep
        self.prev: Any = None
        self.staging: Any = None
        self.stager: Any = None
        self.prev_stager: Any = None
        self.saved: list[Path] = []
        self.pruner: ThreadPoolExecutor | None = None

    def _new_stager(self) -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        return DefaultStager(StagingOptions(self.cuda, True, True, self.cuda))

    def open(self, root: Path, state: Callable[[], Any] | None = None) -> None:
        super().open(root)
        if self.use_stager and not self.fresh_stager:
            self.stager = self._new_stager()
        if self.keep is not None:
            self.pruner = ThreadPoolExecutor(1, thread_name_prefix="dcp-prune")

    def _written(self) -> None:
        """The previous save is written: close its own stager, remove what ``keep`` drops."""
        if self.prev_stager is not None:
            self.prev_stager.close()
            self.prev_stager = None
        if self.pruner is not None and self.keep is not None:
            while len(self.saved) > self.keep:
                self.pruner.submit(shutil.rmtree, self.saved.pop(0), True)

    def save(self, step: int, sd: Any) -> None:
        if self.prev is not None:
            self.prev.result()
            self.prev = None
            self._written()
        stager = self.stager
        if self.fresh_stager:
            stager = self.prev_stager = self._new_stager()  # closed once written, or by close()
        path = self.root / f"step_{step}"
        r = dcp.async_save(sd, checkpoint_id=str(path), async_stager=stager)
        self.saved.append(path)
        if isinstance(r, AsyncSaveResponse):
            self.staging, self.prev = r.staging_completion, r.upload_completion
        else:
            self.prev = r

    def before_update(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def drain(self) -> None:
        self.before_update()
        if self.prev is not None:
            self.prev.result()
            self.prev = None
            self._written()

    def close(self) -> None:
        for stager in (self.stager, self.prev_stager):
            if stager is not None:
                stager.close()
        self.stager = self.prev_stager = None
        if self.pruner is not None:
            self.pruner.shutdown(wait=True)
            self.pruner = None


class TrainAsyncckpt(TrainCkpt):
    """asyncckpt's CheckpointManager, made and prepare()d before the loop; ``keep``: its
    ``keep_last`` (``None``: keep all); ``staging_buffers``: its ``staging_buffers``
    (``None``: the default, 1)."""

    def __init__(self, overlap: bool, keep: int | None = None, staging_buffers: int | None = None) -> None:
        self.overlapped = overlap
        self.overlap_staging = True if overlap else None  # None: the manager's default
        self.keep = keep
        self.staging_buffers = staging_buffers
        self.mgr: Any = None
        self.pending = False

    def open(self, root: Path, state: Callable[[], Any] | None = None) -> None:
        super().open(root)
        self.mgr = asyncckpt.CheckpointManager(
            root, keep_last=self.keep, overlap_staging=self.overlap_staging, staging_buffers=self.staging_buffers
        )
        if state is not None:  # as the quick start does, after building model and optimizer
            self.mgr.prepare(state())

    def save(self, step: int, sd: Any) -> None:
        self.mgr.save(step, sd)
        self.pending = self.overlapped

    def before_update(self) -> None:
        if self.pending:
            self.mgr.synchronize_staging()
            self.pending = False

    def poll(self) -> None:
        self.mgr.maybe_finalize()

    def drain(self) -> None:
        self.before_update()
        self.mgr.maybe_finalize(blocking=True)

    def close(self) -> None:
        self.mgr.close()


def train_systems(device: str = "cpu") -> list[tuple[str, Callable[[], TrainCkpt]]]:
    """The loop's checkpointing systems, by name. On the CPU: none, torch.save, DCP's
    thread executor with and without a DefaultStager, asyncckpt with and without
    overlapped staging; every checkpoint kept until the run ends. On a GPU (issue 35's
    rows): none, DCP with a DefaultStager (pinned, shared memory, asynchronous staging,
    non-blocking copies; reused, and a new one per save), asyncckpt with and without
    overlapped staging, and overlapped with 2 staging buffers (a save need not wait for
    the previous save's write to free the buffer); the last 2 checkpoints kept (a checkpoint every step of a
    1.6 GB state would fill the disk)."""
    if device == "cuda":
        return [
            ("no checkpoint", TrainCkpt),
            (
                "dcp.async_save thread + DefaultStager, overlapped",
                lambda: TrainDcpAsync(True, cuda=True, keep=2),
            ),
            (
                "dcp.async_save thread + DefaultStager per save, overlapped",
                lambda: TrainDcpAsync(True, cuda=True, fresh_stager=True, keep=2),
            ),
            ("asyncckpt persistent", lambda: TrainAsyncckpt(False, keep=2)),
            ("asyncckpt persistent overlapped", lambda: TrainAsyncckpt(True, keep=2)),
            (
                "asyncckpt persistent overlapped, 2 staging buffers",
                lambda: TrainAsyncckpt(True, keep=2, staging_buffers=2),
            ),
        ]
    return [
        ("no checkpoint", TrainCkpt),
        ("torch.save (sync)", TrainTorchSave),
        ("dcp.async_save thread", lambda: TrainDcpAsync(False)),
        ("dcp.async_save thread + DefaultStager, overlapped", lambda: TrainDcpAsync(True)),
        ("asyncckpt persistent", lambda: TrainAsyncckpt(False)),
        ("asyncckpt persistent overlapped", lambda: TrainAsyncckpt(True)),
    ]


def train_run(tr: Any, ck: TrainCkpt, steps: int, every: int, root: Path) -> dict[str, Any]:
    """One run of ``steps`` steps of ``tr`` (a :class:`Trainer` or
    :class:`benchmark.gpu.MlpTrainer`) with a checkpoint of ``ck`` every ``every`` steps
    (0: none); the time runs from an idle device to the last checkpoint committed and the
    device idle again (``tr.sync()``). Returns the time (s), the checkpoints, the
    training thread's time in the checkpoint's calls (``blocked_*_s``), ``trained_s``
    (the time until the steps' work was done on the device, the last save's copy
    included: the loop's cost without the last save's write, which a long run pays
    once) and ``drain_s`` (the rest: the last save's write and commit)."""
    ck.open(root, tr.state_dict)
    blocked = {"save": 0.0, "staging_wait": 0.0, "poll": 0.0}
    saves = 0
    try:
        tr.sync()
        t_start = time.perf_counter()
        for s in range(1, steps + 1):
            tr.forward_backward()
            t0 = time.perf_counter()
            ck.before_update()  # overlapped: the copy ran during this step's forward/backward
            blocked["staging_wait"] += time.perf_counter() - t0
            tr.optimizer_step()
            if every and s % every == 0:
                t0 = time.perf_counter()
                ck.save(tr.step_no, tr.state_dict())
                blocked["save"] += time.perf_counter() - t0
                saves += 1
            t0 = time.perf_counter()
            ck.poll()
            blocked["poll"] += time.perf_counter() - t0
        tr.sync()  # on a GPU: the queued steps (and the last save's D2H copy) are done
        t0 = time.perf_counter()
        trained = t0 - t_start
        ck.drain()  # the last save is committed inside the measured time
        drain = time.perf_counter() - t0
        tr.sync()
        total = time.perf_counter() - t_start
    finally:
        ck.close()
        shutil.rmtree(root, ignore_errors=True)
    return {
        "time_s": total,
        "saves": saves,
        "blocked_s": sum(blocked.values()),
        "drain_s": drain,
        "trained_s": trained,
        **{f"blocked_{k}_s": v for k, v in blocked.items()},
    }


def bench_training(
    root: Path,
    steps: int,
    reps: int,
    every: list[int] | None,
    batch: int,
    systems: set[str] | None,
    sparse_factor: int = 4,
    min_checkpoints: int = 24,
    trainer: Callable[[], Any] | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """The training loop with a checkpoint every K steps, for every K of ``every``
    (``None``: a calibrated K, where synchronous torch.save costs >= 50 %, and
    ``sparse_factor`` * K), against no checkpoint: interleaved runs, medians. Each K
    runs ``max(steps, min_checkpoints * K)`` steps (a whole number of checkpoints), its
    slowdown taken against no-checkpoint runs of the same length.

    ``trainer()`` makes the loop's model (default: the training example's GPT with
    ``batch`` sequences a step); ``device`` picks :func:`train_systems`' set. A system
    whose run raises is not measured further: its error is in ``failed`` (a list of
    ``{"system", "every", "error"}``) and the other systems' runs go on."""
    tr = trainer() if trainer is not None else Trainer(batch)
    sd = tr.state_dict()
    nbytes = state_bytes(sd)
    # Calibration: the step time, and the torch.save + fsync time of the training state.
    for _ in range(3):
        tr.forward_backward()
        tr.optimizer_step()
    step_times = []
    for _ in range(10 if every is None else 3):
        tr.sync()
        t0 = time.perf_counter()
        tr.forward_backward()
        tr.optimizer_step()
        tr.sync()
        step_times.append(time.perf_counter() - t0)
    save_times = []
    root.mkdir(parents=True, exist_ok=True)
    calib = TrainTorchSave()
    calib.open(root)
    for i in range(5 if every is None else 2):
        t0 = time.perf_counter()
        calib.save(i, tr.state_dict())
        save_times.append(time.perf_counter() - t0)
    shutil.rmtree(root, ignore_errors=True)
    sd_times = []
    for _ in range(10 if every is None else 3):
        t0 = time.perf_counter()
        tr.state_dict()
        sd_times.append(time.perf_counter() - t0)
    step_s, save_s = med(step_times), med(save_times)
    # Sync torch.save every K steps costs about save / (K * step): the largest K with >= 50 %.
    auto_k = max(1, math.floor(2 * save_s / step_s))
    if every:
        ks = sorted(set(every))
    else:
        # The calibrated K, and a sparser cadence (sparse_factor * K), where an
        # asynchronous write has time to finish between checkpoints.
        ks = [auto_k] + ([sparse_factor * auto_k] if sparse_factor > 1 else [])
    k = ks[0]
    # Every K runs at least ``steps`` steps and ``min_checkpoints`` checkpoints, in a whole
    # number of checkpoints: at K = 16, 96 steps held 6 checkpoints, whose cost (about
    # 7 % of the run for torch.save) was below the spread of the runs themselves (the
    # no-checkpoint runs alone spread +-9 %).
    steps_at = {kk: -(-max(steps, min_checkpoints * kk, 2 * kk) // kk) * kk for kk in ks}
    chosen = [(n, f) for n, f in train_systems(device) if systems is None or n in systems or n == "no checkpoint"]
    baselines = sorted(set(steps_at.values()))
    configs = [("no checkpoint", f, 0, n_steps) for n, f in chosen if n == "no checkpoint" for n_steps in baselines] + [
        (n, f, kk, steps_at[kk]) for kk in ks for n, f in chosen if n != "no checkpoint"
    ]
    runs: dict[tuple[str, int, int], list[dict[str, Any]]] = {(n, kk, st): [] for n, _, kk, st in configs}
    failed: list[dict[str, Any]] = []
    for rep in range(reps):
        for name, factory, kk, n_steps in configs:
            if any(f["system"] == name and f["every"] == kk for f in failed):
                continue
            log(f"  training: {name}" + (f", every {kk}" if kk else "") + f", {n_steps} steps (rep {rep + 1}/{reps})")
            free_memory()
            try:
                runs[(name, kk, n_steps)].append(train_run(tr, factory(), n_steps, kk, root / "train_ckpt"))
            except Exception as exc:  # a peer that fails is a row that says so (no checkpoint: raised)
                if name == "no checkpoint":
                    raise
                error = error_line(exc)
                log(f"  training: {name} failed: {type(exc).__name__}: {exc}")
                failed.append({"system": name, "every": kk, "error": error})
                runs.pop((name, kk, n_steps), None)
                tr.sync()
    base = {n_steps: med([r["time_s"] for r in runs[("no checkpoint", 0, n_steps)]]) for n_steps in baselines}
    by_every: dict[int, dict[str, Any]] = {kk: {} for kk in ks}
    for (name, kk, n_steps), rs in runs.items():
        if not rs:
            continue
        t = med([r["time_s"] for r in rs])
        per = {b: med([r[f"blocked_{b}_s"] / max(1, r["saves"]) for r in rs]) for b in ("save", "staging_wait", "poll")}
        entry = {
            "time_s": t,
            "slowdown": t / base[n_steps] - 1,
            "saves": rs[0]["saves"],
            "steps": n_steps,
            "blocked_per_save_s": med([r["blocked_s"] / max(1, r["saves"]) for r in rs]),
            **{f"blocked_{b}_per_save_s": v for b, v in per.items()},
            "drain_s": med([r["drain_s"] for r in rs]),
            "trained_s": med([r["trained_s"] for r in rs]),
            "times_s": [r["time_s"] for r in rs],
        }
        for target in [kk2 for kk2 in ks if steps_at[kk2] == n_steps] if kk == 0 else [kk]:
            by_every[target][name] = entry
    results = by_every[k]
    return {
        "config": tr.cfg,
        "label": tr.label,
        "device": device,
        "failed": failed,
        "params": tr.n_params,
        "state_bytes": nbytes,
        "steps": steps_at[k],
        "every": k,
        "auto_every": auto_k,
        "calib_step_s": step_s,
        "calib_torch_save_s": save_s,
        "state_dict_s": med(sd_times),
        "torch_save_target_met": results.get("torch.save (sync)", {}).get("slowdown", 0) >= 0.5,
        "systems": results,
        "every_list": ks,
        "every_calibrated": not every,
        "min_checkpoints": min_checkpoints,
        "sparser": [{"every": kk, "steps": steps_at[kk], "systems": by_every[kk]} for kk in ks[1:]],
    }
