"""The command line and the run: every workload's systems, limits, loads and techniques,
the training loop, Lightning; then the report (markdown, JSON, PNG)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

import asyncckpt
from benchmark import gpu, llm
from benchmark import systems as systems_mod
from benchmark.chart import render_png
from benchmark.common import GiB, error_line, free_memory, log, med, remove, state_bytes
from benchmark.harness import bench_loads, bench_techniques, run_system
from benchmark.limits import bench_memcpy, host_tensors, raw_write
from benchmark.machine import init_process_group, machine_info
from benchmark.memory import MemorySampler
from benchmark.report import render_markdown
from benchmark.systems import SYSTEM_KEYS, Asyncckpt, System, all_systems, manager_params, terminate_dcp_daemon
from benchmark.targets import issue11_targets, issue35_targets
from benchmark.training import bench_training
from benchmark.workloads import DEFAULT_WORKLOADS, QUICK_WORKLOADS, SIZES_WARMUP, default_systems, make_workload


def parse_args(argv: list[str] | None, prog: str | None = None) -> argparse.Namespace:
    """The command line, with --quick's smaller defaults applied (see ``--help``)."""
    import benchmark

    p = argparse.ArgumentParser(
        prog=prog, description=benchmark.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the states live (%(default)s: cuda where torch sees a GPU, else cpu). cuda: issue 35's GPU "
        f"rows: the llm workload ({gpu.LLM_GPU}) and the GPU training loop ({gpu.GPU_TRAIN}) unless "
        "--workloads / --train-config say otherwise; without a GPU it says so and exits 0",
    )
    p.add_argument(
        "--workloads",
        default=None,
        help="comma-separated: SIZE/NTENSORS, sizesN[:LO-HI] (N tensors of N distinct sizes, 64K-1M "
        f"unless given), 'llm', 'fsdp2' or 'train' (default {DEFAULT_WORKLOADS}; --device cuda: llm)",
    )
    p.add_argument(
        "--systems",
        default=None,
        help=f"comma-separated keys of {SYSTEM_KEYS}, for every workload (default: all but "
        "ack-prepare on the synthetic states and train; dcp-async-thread-stager, ack-persistent and "
        "ack-prepare on llm and fsdp2; dcp-async-thread-stager and ack-persistent on sizesN)",
    )
    p.add_argument(
        "--llm-config",
        default=None,
        help="the llm / fsdp2 GPT's size as n_layer=24,n_embd=560,n_head=8,block_size=128 (default those: "
        "~1 GiB of params + AdamW state in 1172 tensors; --quick: a tiny one)",
    )
    p.add_argument("--reps", type=int, default=3, help="saves after the first, per system (%(default)s)")
    p.add_argument("--big-reps", type=int, default=2, help="the same for states >= 2 GiB (%(default)s)")
    p.add_argument(
        "--llm-reps",
        type=int,
        default=5,
        help="saves after the first, per system, on llm and fsdp2 (%(default)s: their stalls vary "
        "more on a shared machine)",
    )
    p.add_argument(
        "--sizes-warmup",
        type=int,
        default=SIZES_WARMUP,
        help="saves after the first and before the measured ones on the sizesN workloads (%(default)s: "
        "past the 33 records of a size after which asyncckpt's writer merges its CRC)",
    )
    p.add_argument(
        "--load-reps",
        type=int,
        default=None,
        help="loads per method (default: 5; cold reads of this disk vary up to 3x)",
    )
    p.add_argument(
        "--techniques",
        default="1G/16,1G/4096",
        help="workloads on which asyncckpt's techniques are measured one by one ('' for none)",
    )
    p.add_argument("--technique-reps", type=int, default=2, help="saves after the first, per variant (%(default)s)")
    p.add_argument(
        "--train-steps",
        type=int,
        default=96,
        help="steps per training run at least (%(default)s), rounded up to a whole number of checkpoints at each K",
    )
    p.add_argument(
        "--train-min-checkpoints",
        type=int,
        default=24,
        help="checkpoints per training run at least: a sparse K runs more steps (%(default)s: 384 "
        "steps at K = 16, whose 6 checkpoints in 96 steps cost less than the runs' own spread)",
    )
    p.add_argument("--train-reps", type=int, default=3, help="interleaved training runs per system (%(default)s)")
    p.add_argument(
        "--train-every",
        default=None,
        help="checkpoint every K steps, for each K of this comma-separated list (default: issue 11's K = 1, "
        "4, 16; --device cuda: issue 35's 1, 4, 10; --quick: 1, 2); 'auto': a calibrated K where "
        "torch.save costs >= 50 %% and FACTOR*K",
    )
    p.add_argument(
        "--train-model",
        choices=("gpt", "mlp"),
        default=None,
        help="the training loop's model: 'gpt' (scripts/train.py's, the default on the CPU) or 'mlp' "
        "(issue 35's GPU loop, the default with --device cuda)",
    )
    p.add_argument(
        "--train-config",
        default=None,
        help=f"the mlp loop's size as blocks=16,width=1024,hidden=4096,tokens=8192 (default those: "
        f"{gpu.GPU_TRAIN}; --quick: {gpu.GPU_TRAIN_TINY})",
    )
    p.add_argument(
        "--train-sparse-factor",
        type=int,
        default=4,
        help="with --train-every auto: also measure a checkpoint every FACTOR*K steps (1: not) (%(default)s)",
    )
    p.add_argument(
        "--train-batch",
        type=int,
        default=1,
        help="sequences per step (%(default)s: the example's model at its default size, with a "
        "batch small enough that torch.save can cost >= 50 %%)",
    )
    p.add_argument("--no-train", action="store_true", help="skip the training-loop measurement")
    p.add_argument(
        "--lightning-mb",
        type=int,
        default=256,
        help="MiB of the Lightning checkpoint compared with Lightning's AsyncCheckpointIO "
        "(scripts/bench_lightning.py; needs the lightning extra; 0 to skip) (%(default)s)",
    )
    p.add_argument(
        "--export-reps",
        type=int,
        default=3,
        help="runs of each Hugging Face export route on the llm state's model (asyncckpt.export_safetensors, "
        "DCP's HuggingFaceStorageWriter + consolidation, a raw write); 0 to skip (%(default)s)",
    )
    p.add_argument("--no-memory", action="store_true", help="do not sample memory")
    p.add_argument(
        "--share-dcp-daemon",
        action="store_true",
        help="keep DCP's process-executor daemon between systems (faster; its memory is then "
        "counted only where it was started; default with --quick)",
    )
    p.add_argument(
        "--dir",
        default=None,
        help=f"directory to write into (default: a new temp dir under {tempfile.gettempdir()}, removed at the end)",
    )
    p.add_argument("--json", default="bench_results.json", help="JSON output (%(default)s)")
    p.add_argument("--png", default=None, help="PNG chart (default: bench_results.png; '' for none)")
    p.add_argument("--md", default=None, help="also write the markdown here")
    p.add_argument("--quick", action="store_true", help="smoke run: a few MiB, 2 reps, tiny training run (< 60 s)")
    p.add_argument(
        "--render",
        metavar="JSON",
        help="measure nothing: print the markdown (and --md, --png) of an earlier run's JSON",
    )
    args = p.parse_args(argv)
    if args.render:
        return args
    args.png = "bench_results.png" if args.png is None else args.png
    args.device, args.no_gpu = gpu.resolve_device(args.device)
    cuda = args.device == "cuda"
    if cuda:  # issue 35's GPU rows unless asked otherwise
        args.workloads = args.workloads or "llm"
        if args.techniques == p.get_default("techniques"):
            args.techniques = ""
        if args.lightning_mb == p.get_default("lightning_mb"):
            args.lightning_mb = 0
        args.train_every = args.train_every or "1,4,10"
        args.train_model = args.train_model or "mlp"
        if args.train_steps == p.get_default("train_steps"):
            args.train_steps = 60  # issue 35's runs
        if args.train_min_checkpoints == p.get_default("train_min_checkpoints"):
            args.train_min_checkpoints = 6  # K = 10: 60 steps
        if args.llm_config is None and not args.quick:
            args.llm_config = ",".join(f"{k}={v}" for k, v in gpu.LLM_GPU.items())
    args.train_model = args.train_model or "gpt"
    if args.quick:
        args.workloads = args.workloads or QUICK_WORKLOADS
        args.reps = args.big_reps = args.llm_reps = 2
        args.techniques = "4M/16" if args.techniques == p.get_default("techniques") else args.techniques
        args.share_dcp_daemon = True
        args.train_steps, args.train_reps, args.train_sparse_factor = 4, 1, 2
        args.train_min_checkpoints = 2
        args.train_every = args.train_every or "1,2"
        if args.llm_config is None:
            args.llm_config = ",".join(f"{k}={v}" for k, v in llm.LLM_TINY.items())
        args.technique_reps = 1
        if args.export_reps == p.get_default("export_reps"):
            args.export_reps = 1
        if args.lightning_mb == p.get_default("lightning_mb"):
            args.lightning_mb = 8
    args.train_every = args.train_every or "1,4,16"
    train_cfg = dict(gpu.GPU_TRAIN_TINY if args.quick else gpu.GPU_TRAIN)
    for item in (args.train_config or "").split(","):
        if item.strip():
            k, _, v = item.partition("=")
            if k.strip() not in train_cfg:
                p.error(f"--train-config: unknown {k.strip()!r}; known: {sorted(train_cfg)}")
            train_cfg[k.strip()] = int(v)
    args.train_config = train_cfg
    args.workloads = DEFAULT_WORKLOADS if args.workloads is None else args.workloads
    args.load_reps = args.load_reps or (args.reps if args.quick else 5)
    unknown = set(args.systems.split(",") if args.systems else ()) - set(SYSTEM_KEYS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; known: {SYSTEM_KEYS}")
    return args


def run_workload(
    spec: str,
    systems: list[System],
    args: argparse.Namespace,
    llm_cfg: dict[str, int] | None,
    base: Path,
    sampler: MemorySampler,
) -> tuple[dict[str, Any], list[str]]:
    """One workload (not fsdp2): each system's saves between raw writes + fsyncs of the
    same bytes, the memcpy limit before and after, the loads of the kept checkpoints,
    and asyncckpt's techniques where --techniques names it.

    A system whose saves raise is a row that says so (``failed``: its error) and the
    run goes on.

    Returns the workload's figures and what was skipped."""
    sd, info = make_workload(spec, args.train_batch, llm_cfg, sizes_warmup=args.sizes_warmup, device=args.device)
    host = host_tensors(sd)  # the raw write / read limits' bytes
    nbytes = state_bytes(sd)
    # llm: --llm-reps whatever its size (on a GPU it is 3.4 GiB)
    reps = args.llm_reps if spec == "llm" else args.big_reps if nbytes >= 2 * GiB else args.reps
    warmup = info.get("warmup", 0)
    saves = 1 + warmup + reps
    log(f"workload {spec}: {nbytes / GiB:.3f} GiB, {info['tensors']} tensors")
    wdir = base / spec.replace("/", "_").replace(":", "_")
    wdir.mkdir(parents=True, exist_ok=True)
    memcpy_times = bench_memcpy(sd, 3)
    raw_path = wdir / "raw.bin"
    raw_write(host, raw_path)  # warm-up (file system allocation), not reported
    raw_times: list[float] = []
    w: dict[str, Any] = {**info, "bytes": nbytes, "saves": saves, "systems": {}, "limits": {}, "failed": {}}
    kept: dict[str, Path] = {}
    skipped: list[str] = []
    # The disk's speed drifts on a shared machine: raw writes + fsyncs of the same
    # bytes right before and right after each system's saves are its reference.
    raw_times.append(raw_write(host, raw_path))
    for s in systems:
        log(f"  {s.name}")
        if s.key == "ack-prepare":
            s.prepare_sd = sd  # type: ignore[attr-defined]
        try:
            r = run_system(
                s,
                sd,
                wdir / s.key,
                saves,
                sampler,
                nbytes,
                keep_last=s.loadable,
                warmup=warmup,
                interleave=(lambda: raw_write(host, raw_path)) if info.get("interleave_raw") else None,
            )
        except Exception as exc:  # noqa: BLE001 - a peer that fails is a row that says so
            w["failed"][s.name] = error_line(exc)
            log(f"  {s.name} failed: {type(exc).__name__}: {exc}")
            skipped.append(f"{spec}: {s.name} failed ({w['failed'][s.name]})")
            remove(wdir / s.key)
            free_memory()
            continue
        raw_times.append(raw_write(host, raw_path))
        r["raw_write_before_s"], r["raw_write_after_s"] = raw_times[-2], raw_times[-1]
        r["raw_write_adjacent_s"] = (raw_times[-2] + raw_times[-1]) / 2
        if "_last_path" in r:
            kept[s.key] = Path(r.pop("_last_path"))
        w["systems"][s.name] = r
    memcpy_times += bench_memcpy(sd, 3)
    w["limits"].update(
        {
            "memcpy_s": min(memcpy_times),
            "memcpy_all_s": memcpy_times,
            "raw_write_fsync_s": med(raw_times),
            "raw_write_fsync_all_s": raw_times,
        }
    )
    log("  loads")
    w["loads"] = bench_loads(
        sd, kept, raw_path, min(args.load_reps, reps) if nbytes >= 2 * GiB else args.load_reps, host
    )
    w["limits"]["raw_read_cold_s"] = w["loads"]["raw read (cold cache)"]["s"]
    w["limits"]["raw_read_warm_s"] = w["loads"]["raw read (warm cache)"]["s"]
    for path in kept.values():
        remove(path)
    remove(raw_path)
    if spec in {t for t in args.techniques.split(",") if t}:
        ref = w["systems"].get("asyncckpt persistent", {}).get("committed_s", w["limits"]["raw_write_fsync_s"])
        w["techniques"], tech_skipped = bench_techniques(sd, wdir, args.technique_reps + 1, sampler, nbytes, ref)
        skipped += [f"{spec}: {s}" for s in tech_skipped]
    shutil.rmtree(wdir, ignore_errors=True)
    return w, skipped


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the benchmark (see ``--help``); returns the exit status. ``local-tier ...``
    runs the node-local tier's rows instead (:mod:`benchmark.local_tier`, its own options),
    ``stall-tail ...`` the stall's tail over many saves (:mod:`benchmark.stall_tail`),
    ``shard-index ...`` a sharded load's planning input by world size (:mod:`benchmark.shard_index`)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["local-tier"]:
        from benchmark import local_tier

        return local_tier.main(argv[1:], prog=f"{prog or 'bench.py'} local-tier")
    if argv[:1] == ["stall-tail"]:
        from benchmark import stall_tail

        return stall_tail.main(argv[1:], prog=f"{prog or 'bench.py'} stall-tail")
    if argv[:1] == ["shard-index"]:
        from benchmark import shard_index

        return shard_index.main(argv[1:], prog=f"{prog or 'bench.py'} shard-index")
    args = parse_args(argv, prog)
    if args.render:  # a chart only where asked for
        earlier = json.loads(Path(args.render).read_text())
        md = render_markdown(earlier)
        print(md)
        if args.md:
            Path(args.md).write_text(md)
        if args.png and earlier["workloads"]:
            render_png(earlier, Path(args.png))
        return 0
    if args.no_gpu:
        return no_gpu(args)
    keys = args.systems.split(",") if args.systems else None
    systems_mod.SHARE_DCP_DAEMON = args.share_dcp_daemon

    t_total = time.perf_counter()
    # Scratch in the temp directory (/tmp here, the same disk), never in the working tree.
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_"))
    base.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"machine": machine_info(base), "args": vars(args), "workloads": [], "skipped": []}
    res["device"] = args.device
    params = manager_params()
    missing: set[str] = set()  # systems this asyncckpt cannot run
    for s in all_systems():
        if isinstance(s, Asyncckpt) and s.missing():
            missing.add(s.key)
            res["skipped"].append(f"{s.name}: CheckpointManager has no {', '.join(s.missing())}")
    if not hasattr(asyncckpt.CheckpointManager, "prepare"):
        missing.add("ack-prepare")
        res["skipped"].append("asyncckpt persistent + prepare(): CheckpointManager has no prepare")

    def systems_for(spec: str) -> list[System]:
        """Fresh system objects for a workload: --systems if given, else its defaults."""
        chosen = keys if keys is not None else default_systems(spec, args.device)
        return [s for s in all_systems() if s.key in chosen and s.key not in missing]

    res["manager_params"] = sorted(params)
    llm_cfg = None
    if args.llm_config:
        llm_cfg = dict(llm.LLM_FULL)
        for item in args.llm_config.split(","):
            k, _, v = item.partition("=")
            llm_cfg[k.strip()] = int(v)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)

    def partial() -> None:
        """What is measured so far, in the JSON (``"partial": true``): a run stopped by a
        time limit (scripts/gpu_check.sh's) leaves its finished workloads behind."""
        out.write_text(json.dumps({**res, "partial": True}, indent=1, default=str))

    def measure_training() -> None:
        """The training-loop rows, into ``res["training"]``."""
        log("training loop")
        every = (
            None if args.train_every.strip() == "auto" else [int(k) for k in args.train_every.split(",") if k.strip()]
        )
        trainer = None
        if args.train_model == "mlp":
            train_cfg, device = args.train_config, args.device

            def trainer() -> gpu.MlpTrainer:
                return gpu.MlpTrainer(device, **train_cfg)

        res["training"] = bench_training(
            base / "train",
            args.train_steps,
            args.train_reps,
            every,
            args.train_batch,
            None,
            args.train_sparse_factor,
            args.train_min_checkpoints,
            trainer=trainer,
            device=args.device,
        )
        partial()

    # On a GPU the training loop (issue 35's point) is measured first: a device check
    # stopped by its time limit still has it.
    train_first = args.device == "cuda"
    init_process_group()
    sampler = MemorySampler(enabled=not args.no_memory)
    try:
        if not args.no_train and train_first:
            measure_training()
        for spec in [w for w in args.workloads.split(",") if w]:
            if spec == "fsdp2":
                cfg = llm_cfg or llm.LLM_FULL
                log(f"workload fsdp2: 2 ranks ({llm.describe(cfg)})")
                keys_f = [s.key for s in systems_for(spec)]
                f = llm.run_fsdp(cfg, args.llm_reps, base / "fsdp2", systems=tuple(keys_f))
                f["label"] = llm.describe(cfg)
                f["config"] = cfg
                res["fsdp2"] = f
                partial()
                continue
            w, skipped = run_workload(spec, systems_for(spec), args, llm_cfg, base, sampler)
            res["skipped"] += skipped
            res["workloads"].append(w)
            partial()
            free_memory()
        if args.export_reps:
            from benchmark import export as export_bench

            log("export to Hugging Face safetensors")
            try:
                res["export"] = export_bench.run(llm_cfg or llm.LLM_FULL, args.export_reps, base / "export")
                res["export_md"] = export_bench.render_markdown(res["export"])
            except Exception as exc:  # noqa: BLE001 - a section that fails is a row that says so; the run goes on
                log(f"  export failed: {type(exc).__name__}: {exc}")
                res["export_md"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0]}"
            partial()
        if not args.no_train and not train_first:
            measure_training()
        if args.lightning_mb:
            try:
                import bench_lightning
            except ImportError as exc:  # no lightning installed
                res["skipped"].append(f"Lightning plugins: {exc}")
            else:
                log("Lightning: AsyncckptCheckpointIO against AsyncCheckpointIO")
                res["lightning"] = bench_lightning.run(
                    reps=args.reps, size_mb=args.lightning_mb, directory=base / "lightning"
                )
                res["lightning_md"] = bench_lightning.render_markdown(res["lightning"])
    finally:
        sampler.close()
        terminate_dcp_daemon()
        if dist.is_initialized():
            dist.destroy_process_group()
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    res["total_s"] = time.perf_counter() - t_total
    res["targets"] = issue11_targets(res)
    if args.device == "cuda":
        res["gpu_targets"] = issue35_targets(res)
    res["machine"]["loadavg_end"] = os.getloadavg()
    md = render_markdown(res)
    print(md)
    if args.md:
        Path(args.md).write_text(md)
    out.write_text(json.dumps(res, indent=1, default=str))
    if args.png and res["workloads"]:
        render_png(res, Path(args.png))
    log(f"JSON: {out}" + (f", PNG: {args.png}" if args.png else ""))
    return 0


def no_gpu(args: argparse.Namespace) -> int:
    """``--device cuda`` where torch sees no GPU: measure nothing, say so (stderr, the
    markdown and the JSON: ``device`` ``"cuda"``, ``no_gpu`` the reason) and return 0."""
    t0 = time.perf_counter()
    log(f"{args.no_gpu}: the GPU rows are not measured")
    res: dict[str, Any] = {
        "machine": machine_info(Path(args.dir or tempfile.gettempdir())),
        "args": vars(args),
        "device": "cuda",
        "no_gpu": args.no_gpu,
        "workloads": [],
        "skipped": [f"GPU rows: {args.no_gpu}"],
    }
    res["machine"]["loadavg_end"] = os.getloadavg()
    res["total_s"] = time.perf_counter() - t0
    md = render_markdown(res)
    print(md)
    if args.md:
        Path(args.md).write_text(md)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str))
    log(f"JSON: {out}")
    return 0
