"""Object storage rows (issue 32): asyncckpt's S3 tier against raw boto3 on the same
server, in one run.

- **upload**: a committed step (the manager's files) uploaded by the tier
  (``S3Tier.upload_step``: multipart, CRC32 per part, the manifest's CRC-32s checked,
  token metadata, marker, latest) against boto3's own multipart upload of the same
  files (one ``TransferManager``, every file submitted at once) with the same client,
  part size and concurrency (botocore's default CRC32 trailer, no marker), the reps
  interleaved. Goal: >= 0.9x the raw throughput. Beside it, the CPU seconds per GiB
  each upload cost this process (the client) and the server. ``--workload llm``: the LLM-shaped
  checkpoint (GPT + AdamW, about 1.02 GiB in 1172 tensors) instead of ``--mib`` in
  ``--tensors`` equal ones.
- **load**: ``asyncckpt.load(state, "s3://...")`` (ranged GETs of ``part_size`` bytes,
  ``max_concurrency`` in flight, streamed straight into the state's tensors, the CRC-32s
  checked inline; with ``verify=False`` too) and ``read_state_dict`` (DCP's path: windows
  of records, CRC-checked as they arrive) against a raw parallel ranged GET of the same objects
  into memory by the same client, the median of ``--reps`` each. Goal: <= 1.2x the raw
  time. Beside them, DCP's own object-store path: ``dcp.load`` through
  ``FsspecReader`` and ``dcp.save`` through ``FsspecWriter``
  (``torch.distributed.checkpoint._fsspec_filesystem``, with s3fs) on the same server; a
  row that fails says so and the run goes on.
- **training**: the loop of a small MLP with a save every K steps (K = 4, 16): local
  only, with ``upload_to`` (the bytes going up from the upload process, the default),
  and with ``upload_to`` in a thread of the training process (``upload_process=False``),
  interleaved, ``--reps`` each: the slowdown of the medians beside the min..max of each
  and the local tier's own run-to-run spread. Goal: within the spread. Beside it, the
  CPU seconds the training process with its children and the server (when started
  here) used during the loops. On one machine the server shares its cores with the
  loop, so an upload costs the loop the server's work too, which a remote store does
  elsewhere: ``--pin`` puts the server on the last CPU and everything else on the
  others, standing for a remote server.

By default it starts a SeaweedFS server (``weed server -s3``, the tests' fixture
``tests/s3_server.py``) on 127.0.0.1 in a temporary directory; ``--endpoint`` (with
the standard AWS variables for the keys) uses another S3 server instead.

    python scripts/bench_s3.py                       # 1 GiB in 4096 tensors, K = 4, 16
    python scripts/bench_s3.py --mib 256 --tensors 1024 --no-train
    python scripts/bench_s3.py --mib 512 --tensors 2048 --pin    # the server off the loop's cores
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import asyncckpt
from asyncckpt.format import manifest as _manifest
from asyncckpt.io import s3 as _s3
from benchmark.common import ROOT, MiB, log


def _state(mib: int, tensors: int, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    per = max(1, mib * MiB // 4 // tensors)
    return {f"layer{i:05d}.weight": torch.randn(per, generator=g) for i in range(tensors)}


def llm_state() -> dict[str, Any]:
    """The LLM-shaped checkpoint (``benchmark.llm.LLM_FULL``: scripts/train.py's GPT and
    AdamW stepped once, about 1.02 GiB of float32 in 1172 tensors), flattened to
    ``{"model.<fqn>" | "optim.state.<fqn>.<key>": tensor}``: the same tensors, sizes and
    count as the nested state, in the flat form the load rows compare tensor by tensor."""
    from benchmark.llm import LLM_FULL, build_llm

    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            flat[prefix] = value.detach().clone()
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)

    walk("", build_llm(LLM_FULL, device="cpu")[2])
    return flat


#: The SeaweedFS server's pid when this benchmark started it (its CPU time is shown).
SERVER_PID: list[int] = []


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def _server(endpoint: str | None) -> Iterator[dict[str, str]]:
    if endpoint:
        yield {"AWS_ENDPOINT_URL": endpoint}
        return
    sys.path.insert(0, str(ROOT / "tests"))
    from s3_server import S3Server

    with tempfile.TemporaryDirectory(prefix="asyncckpt-bench-s3-") as d:
        # The runs write several times the state (each rep, raw and ours, DCP's rows, the
        # training rows) and a volume's space of an overwritten object comes back only when
        # vacuumed: 64 GB of room (nothing is preallocated), against an "internal error"
        # of a full server in a 1 GiB run.
        server = S3Server(d, max_volumes=1000)
        try:
            server.start()
            if server._proc is not None:
                SERVER_PID[:] = [server._proc.pid]
            yield server.env()
        finally:
            SERVER_PID.clear()
            server.stop()


def _files(step_dir: Path) -> dict[str, str]:
    return {p.name: str(p) for p in step_dir.iterdir() if p.is_file()}


def _raw_upload(tier: _s3.S3Tier, prefix: str, files: dict[str, str]) -> None:
    """boto3's own multipart upload of the same files: one ``TransferManager`` (s3transfer)
    with the tier's part size and concurrency, every file submitted at once, the same
    client (botocore's default CRC32 checksum of each part, as a trailer)."""
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    config = TransferConfig(
        multipart_threshold=tier.part_size,
        multipart_chunksize=tier.part_size,
        max_concurrency=tier.max_concurrency,
        use_threads=True,
    )
    with create_transfer_manager(tier.client, config) as manager:
        futures = [manager.upload(path, tier.bucket, f"{prefix}/{name}") for name, path in sorted(files.items())]
        for future in futures:
            future.result()


def _raw_get(tier: _s3.S3Tier, prefix: str, sizes: dict[str, int]) -> int:
    """Ranged GETs of ``part_size`` bytes, ``max_concurrency`` in flight, into memory."""
    bufs = {name: bytearray(size) for name, size in sizes.items()}
    jobs = [(n, off, min(tier.part_size, s - off)) for n, s in sizes.items() for off in range(0, s, tier.part_size)]

    def get(job: tuple[str, int, int]) -> None:
        name, off, length = job
        body = tier.client.get_object(
            Bucket=tier.bucket, Key=f"{prefix}/{name}", Range=f"bytes={off}-{off + length - 1}"
        )["Body"]
        view = memoryview(bufs[name])[off : off + length]
        got = 0
        while got < length:
            n = body.readinto(view[got:]) if hasattr(body, "readinto") else 0
            if not n:
                chunk = body.read(length - got)
                if not chunk:
                    break
                view[got : got + len(chunk)] = chunk
                n = len(chunk)
            got += n

    with concurrent.futures.ThreadPoolExecutor(tier.max_concurrency) as pool:
        list(pool.map(get, jobs))
    return sum(sizes.values())


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _rate(gb: float, times: list[float]) -> str:
    """GB/s of the median time, with the min..max of the reps."""
    return f"{gb / statistics.median(times):.3f} GB/s (reps {gb / max(times):.3f}..{gb / min(times):.3f})"


def _median_time(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_upload_load(
    url_base: str, mib: int, tensors: int, reps: int, work: Path, llm: bool = False
) -> list[tuple[str, str]]:
    state = llm_state() if llm else _state(mib, tensors)
    root = work / "root"
    with asyncckpt.CheckpointManager(root) as manager:
        manager.save(1, state, async_op=False)
    step_dir = root / "step_00000001"
    manifest = _manifest.read_manifest(step_dir)
    files = _files(step_dir)
    nbytes = sum(e["size"] for e in manifest["files"].values())
    tier = _s3.S3Tier(url_base)
    tier.check_bucket()
    rows = []

    def ours() -> None:
        tier.upload_step(1, files, manifest, rank=0, coordinator=True)

    prefix = _s3.parse_url(url_base).prefix
    n = iter(range(10**6))

    def raw() -> None:
        _raw_upload(tier, f"{prefix}/raw-{next(n)}", files)

    ours()  # warm: connections, volumes
    raw()
    t_raw: list[float] = []
    t_ours: list[float] = []
    cpu: dict[str, list[tuple[float, float]]] = {"raw": [], "ours": []}  # (client, server) CPU-s
    for _ in range(reps):  # interleaved: the same load on the machine for both
        for name, fn, times in (("raw", raw, t_raw), ("ours", ours, t_ours)):
            client0, server0 = time.process_time(), _cpu_s(SERVER_PID[0]) if SERVER_PID else 0.0
            times.append(_timed(fn))
            server = _cpu_s(SERVER_PID[0]) - server0 if SERVER_PID else 0.0
            cpu[name].append((time.process_time() - client0, server))
    gb = nbytes / 1e9
    rows.append(
        ("upload: raw boto3 TransferManager, every file at once (same client, parts, concurrency)", _rate(gb, t_raw))
    )
    ratio = statistics.median(t_raw) / statistics.median(t_ours)
    rows.append(
        (
            "upload: asyncckpt S3Tier.upload_step (CRC32 per part, manifest CRCs checked, marker, latest)",
            f"{_rate(gb, t_ours)} ({ratio:.2f}x raw; goal >= 0.9x)",
        )
    )
    gib = nbytes / 2**30
    per = {name: [statistics.median(c[i] for c in cpu[name]) / gib for i in (0, 1)] for name in cpu}
    rows.append(
        (
            "upload: CPU seconds per GiB uploaded, client (this process) / S3 server (medians)",
            f"asyncckpt {per['ours'][0]:.2f} / {per['ours'][1]:.2f}, raw TransferManager "
            f"{per['raw'][0]:.2f} / {per['raw'][1]:.2f}"
            + ("" if SERVER_PID else " (the server's: not started here, not measured)"),
        )
    )

    rows += bench_load(tier, state, manifest, reps, url_base, statistics.median(t_raw))
    return rows


def _row(name: str, fn: Any) -> tuple[str, str]:
    """``(name, fn())``, or ``(name, "failed: ...")``: a row that fails never ends the run."""
    try:
        return name, fn()
    except Exception as exc:  # noqa: BLE001 - the failure is the row's result (printed)
        text = str(exc).splitlines()[0][:160] if str(exc) else ""
        return name, f"failed: {type(exc).__name__}: {text}"


def bench_load(
    tier: _s3.S3Tier, state: dict[str, Any], manifest: dict[str, Any], reps: int, url_base: str, t_upload: float
) -> list[tuple[str, str]]:
    """The load rows: committed step 1 of ``tier`` (``state``'s, with ``manifest``) read
    back every way, each the median of ``reps`` against the raw ranged GETs of the same
    objects; ``t_upload``: the raw upload's median seconds (for the FsspecWriter row)."""
    import warnings

    url = tier.step_url(1)
    sizes = {name: e["size"] for name, e in manifest["files"].items() if name != _manifest.MANIFEST_NAME}
    nbytes = sum(sizes.values())
    gb = nbytes / 1e9
    step_prefix = _s3.parse_url(url).prefix
    target = {k: torch.empty_like(v) for k, v in state.items()}
    _raw_get(tier, step_prefix, sizes)  # warm: connections, imports, the page cache of the server
    asyncckpt.load(target, url)
    # Interleaved repetitions: the raw GETs and the load see the same server state.
    t_gets, t_loads, t_unverified = [], [], []
    for _ in range(reps):
        t_gets.append(_median_time(lambda: _raw_get(tier, step_prefix, sizes), 1))
        t_loads.append(_median_time(lambda: asyncckpt.load(target, url), 1))
        t_unverified.append(_median_time(lambda: asyncckpt.load(target, url, verify=False), 1))
    t_get, t_load, t_plain = statistics.median(t_gets), statistics.median(t_loads), statistics.median(t_unverified)
    assert all(torch.equal(target[k], state[k]) for k in state)
    rows = [
        (
            "load: raw parallel ranged GET into memory (same client, parts, concurrency)",
            f"{t_get:.2f} s ({gb / t_get:.2f} GB/s)",
        )
    ]
    rows.append(
        (
            "load: asyncckpt.load(state, s3://...) (verify inline)",
            f"{t_load:.2f} s ({t_load / t_get:.2f}x raw; goal <= 1.2x)",
        )
    )
    rows.append(
        ("load: asyncckpt.load(state, s3://..., verify=False)", f"{t_plain:.2f} s ({t_plain / t_get:.2f}x raw)")
    )

    def read() -> str:
        t = _median_time(lambda: asyncckpt.read_state_dict(url), reps)
        return f"{t:.2f} s ({t / t_get:.2f}x raw)"

    rows.append(_row("load: asyncckpt.read_state_dict(s3://...) (DCP's path, read-ahead windows, CRC-32s)", read))

    endpoint = tier.client.meta.endpoint_url

    def fsspec_load() -> str:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        out = {k: torch.empty_like(v) for k, v in state.items()}

        def once() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(out, storage_reader=FsspecReader(url, endpoint_url=endpoint, skip_instance_cache=True))

        once()  # warm (and a check: the same bytes)
        assert all(torch.equal(out[k], state[k]) for k in state)
        t = _median_time(once, reps)
        return f"{t:.2f} s ({t / t_get:.2f}x raw; no checksums)"

    rows.append(_row("load: DCP dcp.load + FsspecReader (s3fs) of the same checkpoint", fsspec_load))

    def fsspec_save() -> str:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        n = iter(range(10**6))

        def once() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save(
                    state,
                    storage_writer=FsspecWriter(
                        f"{url_base}/fsspec-{next(n)}", endpoint_url=endpoint, skip_instance_cache=True
                    ),
                )

        once()  # warm
        t = _median_time(once, reps)
        return f"{gb / t:.2f} GB/s ({t_upload / t:.2f}x the raw upload; no commit marker, no checksums)"

    rows.append(_row("upload: DCP dcp.save + FsspecWriter (s3fs) of the same state", fsspec_save))
    return rows


def _train(
    root: Path, every: int, steps: int, upload_to: str | None, process: bool = True
) -> tuple[float, float, float, int, int]:
    """Seconds of ``steps`` training steps with a save every ``every`` (``upload_to``:
    uploaded too, from the upload process or, ``process=False``, a thread of this one),
    the CPU seconds this process with its children (the upload process, the writer)
    and the server (0 when not started here) used meanwhile, and how many of the loop's
    steps were uploaded and how many skipped (:class:`asyncckpt.UploadSkipped`: the
    uploads fell behind the saves)."""
    outcomes = {"uploaded": 0, "skipped": 0}

    def count(outcome: Any) -> None:  # the manager's callback: saves and uploads
        if isinstance(outcome, asyncckpt.UploadResult) and outcome.step > 0:
            outcomes["uploaded"] += 1
        elif isinstance(outcome, asyncckpt.UploadSkipped):
            outcomes["skipped"] += 1

    torch.manual_seed(0)
    extra: dict[str, Any] = {}
    if TRAIN_MODEL[0] == "python":  # a loop bound by Python: 48 tiny layers, as a GPU loop launching kernels
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(48)])
        extra = {f"w{i}": torch.randn(1 << 20) for i in range(24)}  # the save's 96 MiB
        x = torch.randn(8, 64)
    else:  # a loop bound by its kernels (GIL released in them)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])  # 32 MiB of weights
        x = torch.randn(64, 1024)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with asyncckpt.CheckpointManager(
        root,
        keep_last=2,
        upload_to=upload_to,
        keep_remote=2 if upload_to else None,
        upload_process=process,
        callback=count,
    ) as m:
        if upload_to:  # the upload process is up before the loop, as after a run's first upload
            m.save(0, {"w": torch.zeros(1)})
            m.maybe_finalize(blocking=True)
            m.wait_uploads(600)
        server0 = _cpu_s(SERVER_PID[0]) if SERVER_PID else 0.0
        own0 = _tree_cpu_s()
        t = time.perf_counter()
        for step in range(1, steps + 1):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            m.maybe_finalize()
            if step % every == 0:
                m.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), **extra})
        elapsed = time.perf_counter() - t
        own = _tree_cpu_s() - own0
        server = _cpu_s(SERVER_PID[0]) - server0 if SERVER_PID else 0.0
        m.wait_uploads(600)
    return elapsed, own, server, outcomes["uploaded"], outcomes["skipped"]


def _tree_cpu_s() -> float:
    """CPU seconds of this process and its live children (the upload process, the writer)."""
    import psutil

    total = _cpu_s(os.getpid())
    for child in psutil.Process().children(recursive=True):
        try:
            total += _cpu_s(child.pid)
        except OSError:
            pass
    return total


MODES = {"local": "local only", "process": "upload_to (upload process)", "thread": "upload_to (in a thread)"}


def bench_training(url_base: str, ks: list[int], steps: int, reps: int, work: Path) -> list[tuple[str, str]]:
    rows = []
    for k in ks:
        runs: dict[str, list[tuple[float, float, float, int, int]]] = {mode: [] for mode in MODES}
        for r in range(reps):  # interleaved
            for mode in MODES:
                url = None if mode == "local" else f"{url_base}/train-{mode}-{k}-{r}"
                runs[mode].append(_train(work / f"{mode}{k}-{r}", k, steps, url, process=mode != "thread"))
        times = {mode: [x[0] for x in runs[mode]] for mode in MODES}
        med = {mode: statistics.median(times[mode]) for mode in MODES}
        local = times["local"]
        spread = (max(local) - min(local)) / med["local"]
        for mode in ("process", "thread"):
            rows.append(
                (
                    (
                        f"training ({TRAIN_MODEL[0]} loop), a save every K={k} of {steps} steps: {MODES[mode]} vs "
                        f"local only ({reps} reps)"
                    ),
                    (
                        f"median {med[mode]:.2f} s (min..max {min(times[mode]):.2f}..{max(times[mode]):.2f}) vs "
                        f"median {med['local']:.2f} s ({min(local):.2f}..{max(local):.2f}): "
                        f"{med[mode] / med['local'] - 1:+.1%}; local run-to-run spread (max-min)/median "
                        f"{spread:.1%}; goal: within the spread; steps uploaded / skipped (behind the saves) "
                        f"per run: {', '.join(f'{x[3]} / {x[4]}' for x in runs[mode])}"
                    ),
                )
            )
        cpu = {mode: [statistics.median(x[i] for x in runs[mode]) for i in (1, 2)] for mode in MODES}
        rows.append(
            (
                "the same, CPU seconds used during the loop: training process and its children / S3 server (medians)",
                "; ".join(f"{MODES[mode]} {cpu[mode][0]:.1f} / {cpu[mode][1]:.1f}" for mode in MODES)
                + f" ({_placement()})",
            )
        )
    return rows


def _placement() -> str:
    ours = sorted(os.sched_getaffinity(0))
    if SERVER_CPUS:
        return f"the server on CPUs {SERVER_CPUS}, the training process on {ours}, of {os.cpu_count()}"
    return f"{os.cpu_count()} cores shared by all"


#: The training rows' model (``--train-model``).
TRAIN_MODEL = ["mlp"]
#: The CPUs the server was pinned to (``--pin``), else empty.
SERVER_CPUS: list[int] = []


def _pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of process ``pid`` to ``cpus`` (new threads inherit it)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(task), cpus)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_s3.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--endpoint", default=None, help="an S3 endpoint (default: start a local SeaweedFS)")
    p.add_argument("--bucket", default="asyncckpt-bench", help="bucket (created if missing)")
    p.add_argument("--mib", type=int, default=1024, help="state size in MiB (%(default)s)")
    p.add_argument("--tensors", type=int, default=4096, help="tensors (%(default)s)")
    p.add_argument(
        "--workload",
        choices=("uniform", "llm"),
        default="uniform",
        help="uniform: --mib in --tensors equal tensors; llm: the LLM-shaped checkpoint "
        "(GPT + AdamW, about 1.02 GiB in 1172 tensors; --mib/--tensors ignored) (%(default)s)",
    )
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (%(default)s)")
    p.add_argument("--train-k", default="4,16", help="training rows: a save every K steps (%(default)s)")
    p.add_argument("--train-steps", type=int, default=64, help="steps per training run (%(default)s)")
    p.add_argument("--no-train", action="store_true")
    p.add_argument(
        "--train-model",
        choices=("mlp", "python"),
        default="mlp",
        help="mlp: 8 Linear(1024) layers + AdamW, bound by its kernels (96 MiB a save); python: 48 "
        "Linear(64) layers at batch 8, bound by Python as a GPU loop launching kernels is, saved with "
        "96 MiB of other tensors (%(default)s)",
    )
    p.add_argument("--no-load", action="store_true", help="only the training rows")
    p.add_argument(
        "--pin",
        action="store_true",
        help="pin the server started here to the last CPU and this process (its children, its torch "
        "threads) to the others: the server stands for a remote one, off the training cores",
    )
    args = p.parse_args(argv)
    TRAIN_MODEL[0] = args.train_model
    with _server(args.endpoint) as env, tempfile.TemporaryDirectory(prefix="asyncckpt-bench-") as work:
        os.environ.update(env)
        cpus = sorted(os.sched_getaffinity(0))
        if args.pin and SERVER_PID and len(cpus) > 1:
            SERVER_CPUS[:] = cpus[-1:]
            _pin(SERVER_PID[0], set(SERVER_CPUS))
            os.sched_setaffinity(0, set(cpus[:-1]))
            torch.set_num_threads(len(cpus) - 1)
        tier = _s3.S3Tier(f"s3://{args.bucket}")
        with contextlib.suppress(Exception):
            tier.client.create_bucket(Bucket=args.bucket)
        base = f"s3://{args.bucket}/bench-{uuid.uuid4().hex[:8]}"
        what = "the LLM-shaped checkpoint" if args.workload == "llm" else f"{args.mib} MiB in {args.tensors} tensors"
        log(f"upload / load of {what}")
        rows: list[tuple[str, str]] = []
        try:  # what was measured is printed, also when a later stage fails
            if not args.no_load:
                rows += bench_upload_load(
                    base, args.mib, args.tensors, args.reps, Path(work), llm=args.workload == "llm"
                )
            if not args.no_train:
                ks = [int(k) for k in args.train_k.split(",") if k]
                log(f"training loop, K = {ks}")
                rows += bench_training(base, ks, args.train_steps, args.reps, Path(work))
        finally:
            shape = "LLM-shaped, GPT + AdamW" if args.workload == "llm" else f"{args.mib} MiB / {args.tensors} tensors"
            print(f"| object storage ({shape}, one run) | |")
            print("|---|---|")
            for name, value in rows:
                print(f"| {name} | {value} |")
    return 0
