"""Sharded and replicated state through the asynchronous path, on real gloo ranks.

- FSDP2 (``fully_shard`` on CPU) state from ``get_state_dict``: DTensor shards. Every
  rank stages and writes only its shards; stock ``dcp.load`` reads the result back
  bit for bit, also after the state was mutated while the write was in flight.
- Resharding on load: a checkpoint of 2 ranks loads on 1 and on 3 ranks, and those
  ranks' checkpoints load back on 2, model and Adam state, compared as full tensors
  with references saved as plain tensors (``full_state_dict=True``).
- DDP (replicated) state: DCP's dedup of the global plan writes one copy in all, split
  between the ranks, also when the plan comes from :class:`asyncckpt.saving.planning.PlanCache`.

The rank functions return what they saw; the assertions run in the test process
(see ``test_checkpoint_dist.py``). Run with ``-s`` to see the resharding report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from dist_utils import preload_forkserver, run_ranks
from helpers import count_plans, counting_calls, observing_loads

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

DATA_FILES = ("__0_0.distcp", "__1_0.distcp")


def _run(fn: Any, world_size: int, *args: Any, timeout: float = 60) -> list[Any]:
    """``run_ranks`` with ranks forked from a forkserver that imported torch once."""
    preload_forkserver()
    return run_ranks(fn, world_size, *args, timeout=timeout, start_method="forkserver")


# ----------------------------------------------------------------------------- helpers (both sides)
IN = 128


def _model() -> nn.Module:
    """The same weights on every rank and world size. Shard sizes on 2 and 3 ranks are
    uneven (dims 3 and 1), and some ranks hold empty shards (dim 0 of size 1)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 3), nn.Linear(3, 1)
    )


def _fsdp(rank: int, train_steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model.children():
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, optim, train_steps, rank)
    return model, optim


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, rank: int, dim: int = IN) -> None:
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        model(torch.randn(8, dim, generator=gen)).square().mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)


def _leaves(tree: Any, path: str = "") -> dict[str, Any]:
    """``{"a/b/0": leaf}`` for nested dicts / lists."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _leaves(sub, f"{path}/{key}").items()}
    if isinstance(tree, list):
        return {k: v for i, sub in enumerate(tree) for k, v in _leaves(sub, f"{path}/{i}").items()}
    return {path: tree}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _map_tensors(tree: Any, fn: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map_tensors(v, fn) for v in tree]
    return tree


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _compare(expected: Any, got: Any) -> dict[str, Any]:
    """Tensors compared, max abs difference, and the entries not bit-identical / missing."""
    e, g = _leaves(expected), _leaves(got)
    out: dict[str, Any] = {"tensors": 0, "max_abs_diff": 0.0, "mismatch": sorted(set(e) ^ set(g))}
    for key in sorted(set(e) & set(g)):
        a, b = e[key], g[key]
        if isinstance(a, torch.Tensor):
            out["tensors"] += 1
            if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
                out["mismatch"].append(key)
                continue
            if a.numel():
                diff = (a.double() - b.double()).abs().max().item()
                out["max_abs_diff"] = max(out["max_abs_diff"], diff)
            if not torch.equal(_bits(a), _bits(b)):
                out["mismatch"].append(key)
        elif a != b:
            out["mismatch"].append(key)
    return out


def _full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Full (unsharded) model and optimizer state as plain CPU tensors, on rank 0 (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}


def _sizes(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in path.iterdir() if p.name.endswith(".distcp")}


# ----------------------------------------------------------------------------- FSDP2: save on 2 ranks
def _rank_save_fsdp(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import asyncckpt
    import asyncckpt.loading.dcp
    from asyncckpt import AsyncCallsQueue, CheckpointManager
    from asyncckpt.testing import staging_buffers

    torch.set_num_threads(1)
    root_p = Path(root)
    out: dict[str, Any] = {}
    model, optim = _fsdp(rank, train_steps=3)
    full = _full_state(model, optim)
    if rank == 0:
        torch.save(full, root_p / "ref_w2.pt")
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "step": 3}
    out["dtensors"] = sum(hasattr(v, "placements") for v in _leaves(state).values())
    out["local_bytes"] = sum(_local(v).nbytes for v in _leaves(state).values() if hasattr(v, "placements"))
    out["full_bytes"] = sum(v.nbytes for v in _leaves(full).values() if isinstance(v, torch.Tensor))
    snapshot = _map_tensors(state, lambda t: _local(t).detach().clone())

    queue = AsyncCallsQueue(persistent=True)
    manager = CheckpointManager(root_p / "mgr_w2", persistent=False)
    ok = False
    try:
        handle = asyncckpt.save(state, root_p / "save_w2", async_op=True, calls_queue=queue)
        manager.save(3, state)
        out["staged_bytes"] = sum(b.nbytes for b in staging_buffers(manager))  # this rank's slab
        _train(model, optim, 1, rank)  # mutates the parameters and the Adam state in place
        out["mutated"] = len(_compare(snapshot, _map_tensors(state, _local))["mismatch"])
        out["nonempty"] = sum(v.numel() > 0 for v in _leaves(snapshot).values() if isinstance(v, torch.Tensor))
        out["bytes_save"] = handle.wait(timeout=30).bytes
        out["committed"] = manager.maybe_finalize(blocking=True)
        timings = manager.last_committed_timings
        assert timings is not None
        out["bytes_mgr"] = timings.bytes
        dist.barrier()
        # Stock DCP reads both back, into DTensors of the same sharding.
        out["diffs"] = {}
        for name, path in (("save", root_p / "save_w2"), ("manager", manager.step_dir(3))):
            got = _map_tensors(state, torch.zeros_like)
            dcp.load(got, checkpoint_id=str(path))
            out["diffs"][name] = _compare(snapshot, _map_tensors(got, _local))
        # asyncckpt reads it back into the same sharding too (its direct path: each local
        # shard, even uneven and empty ones, is one saved chunk)
        # (its shard index: this rank's own chunks, without unpickling .metadata)
        got = _map_tensors(state, torch.zeros_like)
        with observing_loads() as loads, counting_calls(asyncckpt.loading.dcp, "read_metadata") as metadata_reads:
            asyncckpt.load(got, manager.step_dir(3))
        out["diffs"]["asyncckpt.load"] = _compare(snapshot, _map_tensors(got, _local))
        out["load_path"] = (loads.direct, loads.shards, loads.metadata, metadata_reads.n)
        manager.close()
        queue.close()
        ok = True
    finally:
        if not ok:
            manager.close(abort=True)
            queue.close(abort=True)
    return out


@pytest.fixture(scope="module")
def fsdp_saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("sharded")
    return root, _run(_rank_save_fsdp, 2, str(root))


@pytest.mark.timeout(90)
def test_fsdp_state_saves_async_each_rank_its_shards(fsdp_saved: tuple[Path, list[dict[str, Any]]]) -> None:
    root, results = fsdp_saved
    full_bytes = results[0]["full_bytes"]
    assert full_bytes > 2_000_000
    for rank, res in enumerate(results):
        assert res["dtensors"] == 24, res  # 8 parameters: weight, exp_avg, exp_avg_sq
        assert res["committed"] == [3]
        # Every (non-empty) tensor changed while the writes ran; the checkpoints hold the values before.
        assert res["mutated"] == res["nonempty"] >= 24, res
        for name, cmp in res["diffs"].items():
            assert cmp["tensors"] == 32 and cmp["mismatch"] == [], (rank, name, cmp)  # + 8 Adam steps
        # asyncckpt.load: the direct path, planned from the shard index, .metadata never read
        assert res["load_path"] == (1, 1, 0, 0), res["load_path"]
        # Each rank holds and stages about half of the state, not all of it.
        assert 0.4 * full_bytes < res["local_bytes"] < 0.6 * full_bytes, res
        assert res["staged_bytes"] < 0.6 * full_bytes, res

    for path, nbytes in (
        (root / "save_w2", results[0]["bytes_save"]),
        (root / "mgr_w2" / "step_00000003", results[0]["bytes_mgr"]),
    ):
        sizes = _sizes(path)
        assert sorted(sizes) == sorted(DATA_FILES), sizes
        total = sum(sizes.values())
        assert total == nbytes == results[1]["bytes_save" if path.name == "save_w2" else "bytes_mgr"]
        # One copy of the state (plus the per-record torch.save framing), not two...
        assert full_bytes <= total < 1.1 * full_bytes, (total, full_bytes)
        for rank, res in enumerate(results):
            size = sizes[f"__{rank}_0.distcp"]
            # ...and each rank's file holds its own shards (plus its share of the small
            # replicated entries and framing): about half of it.
            assert 0.4 * total < size < 0.6 * total, (path, sizes)
            assert res["local_bytes"] <= size < res["local_bytes"] + 0.1 * full_bytes, (path, rank, size, res)
            assert res["staged_bytes"] < size + 2 * 4096
        print(
            f"FSDP2 {path.relative_to(root)}: full state {full_bytes} B, written {total} B "
            f"({total / full_bytes:.3f}x), per rank {[sizes[f] for f in DATA_FILES]}, "
            f"local shards {[r['local_bytes'] for r in results]} B, staged {[r['staged_bytes'] for r in results]} B"
        )


# ----------------------------------------------------------------------------- the shard index
def _rank_load_damaged(rank: int, world_size: int, root: str, ckpts: list[str]) -> list[dict[str, Any]]:
    """Load each of ``ckpts`` into a fresh FSDP2 model + Adam with ``verify=False``;
    report the plan's source, ``.metadata`` reads, the warnings, and (rank 0) the full
    state against ``ref_w2.pt``; then what a load with the default verification raised."""
    import warnings

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import asyncckpt
    import asyncckpt.loading.dcp

    torch.set_num_threads(1)
    out = []
    for ckpt in ckpts:
        model, optim = _fsdp(rank, train_steps=0)
        msd, osd = get_state_dict(model, optim)
        state: dict[str, Any] = {"model": msd, "optim": osd, "step": -1}
        with (
            warnings.catch_warnings(record=True) as seen,
            observing_loads() as loads,
            counting_calls(asyncckpt.loading.dcp, "read_metadata") as reads,
        ):
            warnings.simplefilter("always")
            asyncckpt.load(state, Path(root) / ckpt, verify=False)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        full = _full_state(model, optim)
        try:
            asyncckpt.load(state, Path(root) / ckpt)  # verify="inline": a damaged file is corruption
            raised = ""
        except asyncckpt.CorruptCheckpointError as exc:
            raised = str(exc)
        out.append(
            {
                "path": (loads.direct, loads.shards, loads.metadata, reads.n),
                "warnings": [str(w.message) for w in seen if ".shards" in str(w.message)],
                "cmp": _compare(torch.load(Path(root) / "ref_w2.pt"), full) if rank == 0 else None,
                "raised": raised,
            }
        )
    return out


def _change_a_digit(path: Path, start: int = 0) -> None:
    """Change the first decimal digit at or after byte ``start`` of ``path`` (its size kept)."""
    data = bytearray(path.read_bytes())
    pos = next(i for i in range(start, len(data)) if chr(data[i]).isdigit())
    data[pos] = ord("7") if data[pos] != ord("7") else ord("3")
    path.write_bytes(bytes(data))


@pytest.mark.timeout(90)
def test_a_damaged_shard_index_or_chunk_line_falls_back_to_metadata(
    fsdp_saved: tuple[Path, list[dict[str, Any]]],
) -> None:
    """The shard index is a cache of ``.metadata``: with ``verify=False`` a chunk line
    that does not match the CRC-32 the index gives it (rank 1's), or an index that does
    not match the manifest, is named in a warning and ``.metadata`` is read instead, by
    the ranks it concerns, and the load is bitwise the same; with the default
    verification either is corruption, raised on every rank, naming the file."""
    import json
    import shutil

    root, _ = fsdp_saved
    src = root / "mgr_w2" / "step_00000003"
    for name in ("damaged_line", "damaged_index"):
        shutil.copytree(src, root / name)
    start, _length, _crc = json.loads((src / ".shards.json").read_bytes())["chunks"]["__1_0.distcp"]
    _change_a_digit(root / "damaged_line" / ".shards.chunks.jsonl", start)
    _change_a_digit(root / "damaged_index" / ".shards.json", 40)
    results = _run(_rank_load_damaged, 2, str(root), ["damaged_line", "damaged_index"])
    line, index = zip(*results)  # per rank -> per checkpoint
    assert [r["path"] for r in line] == [(1, 1, 0, 0), (1, 0, 1, 1)], line
    assert not line[0]["warnings"] and "the line of __1_0.distcp" in line[1]["warnings"][0], line
    assert [r["path"] for r in index] == [(1, 0, 1, 1), (1, 0, 1, 1)], index
    assert all("does not match the manifest" in r["warnings"][0] for r in index), index
    for r in (line[0], index[0]):
        assert r["cmp"]["mismatch"] == [] and r["cmp"]["tensors"] == 32, r["cmp"]
    assert all(".shards.chunks.jsonl" in r["raised"] for r in line), line
    assert all(".shards.json" in r["raised"] for r in index), index


# ----------------------------------------------------------------------------- resharding on load
def _rank_reshard(
    rank: int, world_size: int, root: str, loads: list[tuple[str, str, str]], save: tuple[str, str, str] | None
) -> dict[str, Any]:
    """Load each ``(how, checkpoint, reference)`` of ``loads`` into a fresh FSDP2 model +
    Adam on ``world_size`` ranks and compare the full state with the reference; then
    (``save``: ``(how, target, reference)``) train one more step and save."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import asyncckpt
    from asyncckpt import AsyncCallsQueue, CheckpointManager

    torch.set_num_threads(1)
    root_p = Path(root)
    out: dict[str, Any] = {"loads": []}
    for how, ckpt, ref in loads:
        model, optim = _fsdp(rank, train_steps=0)
        msd, osd = get_state_dict(model, optim)  # the template (initialises Adam's state)
        state: dict[str, Any] = {"model": msd, "optim": osd, "step": -1}
        if how == "manager":
            with CheckpointManager(root_p / ckpt, persistent=False) as manager:
                out_step = manager.load(state)
        else:
            asyncckpt.load(state, root_p / ckpt)
            out_step = state["step"]
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        full = _full_state(model, optim)
        cmp = _compare(torch.load(root_p / ref), full) if rank == 0 else None
        out["loads"].append({"how": how, "ckpt": ckpt, "step": out_step, "cmp": cmp})
    if save is not None:
        how, target, ref = save
        _train(model, optim, 1, rank)
        full = _full_state(model, optim)
        if rank == 0:
            torch.save(full, root_p / ref)
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd, "step": 4}
        if how == "manager":
            with CheckpointManager(root_p / target, persistent=False) as manager:
                manager.save(4, state)
                out["committed"] = manager.maybe_finalize(blocking=True)
        else:
            queue = AsyncCallsQueue(persistent=False)
            try:
                handle = asyncckpt.save(state, root_p / target, async_op=True, calls_queue=queue)
                out["committed"] = [4] if handle.wait(timeout=30) is not None else []
                queue.close()
            finally:
                queue.close(abort=True)  # no-op once closed
    return out


@pytest.mark.timeout(120)
def test_resharding_fsdp_model_and_adam_state(fsdp_saved: tuple[Path, list[dict[str, Any]]]) -> None:
    root, _ = fsdp_saved
    report = []

    def check(src_ws: int | tuple[int, ...], results: list[dict[str, Any]]) -> None:
        world_size = len(results)
        sources = src_ws if isinstance(src_ws, tuple) else (src_ws,)
        for res in results:
            assert [load["step"] for load in res["loads"]] == [load["step"] for load in results[0]["loads"]]
        for src, load in zip(sources, results[0]["loads"], strict=True):
            cmp = load["cmp"]
            assert cmp["mismatch"] == [], (src, world_size, load)
            assert cmp["tensors"] == 32, cmp  # 8 parameters, 8 x (exp_avg, exp_avg_sq, step)
            assert cmp["max_abs_diff"] == 0.0
            report.append(
                f"reshard {src} -> {world_size} ranks ({load['how']}, {load['ckpt']}, step "
                f"{load['step']}): {cmp['tensors']} full tensors compared, "
                f"max abs diff {cmp['max_abs_diff']}, bit-identical"
            )

    # 2 -> 1 (asyncckpt.load), then save on 1 rank (manager) for 1 -> 2.
    res = _run(_rank_reshard, 1, str(root), [("load", "save_w2", "ref_w2.pt")], ("manager", "mgr_w1", "ref_w1.pt"))
    assert res[0]["committed"] == [4] and res[0]["loads"][0]["step"] == 3
    check(2, res)
    # 2 -> 3 (CheckpointManager.load), then save on 3 ranks (asyncckpt.save) for 3 -> 2.
    res = _run(_rank_reshard, 3, str(root), [("manager", "mgr_w2", "ref_w2.pt")], ("save", "save_w3", "ref_w3.pt"))
    assert [r["committed"] for r in res] == [[4]] * 3
    check(2, res)
    assert sorted(_sizes(root / "save_w3")) == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    # 1 -> 2 and 3 -> 2.
    res = _run(
        _rank_reshard, 2, str(root), [("manager", "mgr_w1", "ref_w1.pt"), ("load", "save_w3", "ref_w3.pt")], None
    )
    check((1, 3), res)
    print("\nresharding report (FSDP2 model + Adam after 3-4 steps, full tensors vs plain-tensor reference):")
    print("\n".join("  " + line for line in report))


# ----------------------------------------------------------------------------- HSDP: shards replicated
def _rank_hsdp(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """FSDP2 over a 2 x 2 mesh (replicate x shard): each shard is held by two ranks, and
    DCP's dedup writes it once, into one of their files. Saved, then loaded back into
    the same sharding with ``asyncckpt.load``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import asyncckpt
    import asyncckpt.loading.dcp
    from asyncckpt import CheckpointManager

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _model()
    for layer in model.children():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, optim, 2, rank % 2)  # the same batches on the two replicas of a shard
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "step": 2}
    snapshot = _map_tensors(state, lambda t: _local(t).detach().clone())
    out: dict[str, Any] = {
        "placements": sorted({str(v.placements) for v in _leaves(state).values() if hasattr(v, "placements")})
    }
    with CheckpointManager(Path(root) / "hsdp", persistent=False) as manager:
        for step in (1, 2):  # planned, then from the plan cache
            manager.save(step, state)
            manager.maybe_finalize(blocking=True)
        got = _map_tensors(state, torch.zeros_like)
        with observing_loads() as loads, counting_calls(asyncckpt.loading.dcp, "read_metadata") as metadata_reads:
            asyncckpt.load(got, manager.step_dir(2))
        out["diff"] = _compare(snapshot, _map_tensors(got, _local))
        out["load_path"] = (loads.direct, loads.shards, loads.metadata, metadata_reads.n)
    return out


@pytest.mark.timeout(120)
def test_hsdp_state_loads_each_rank_its_shards_from_the_index_also_where_a_replica_wrote_them(tmp_path: Path) -> None:
    """A shard index of an HSDP checkpoint names, for a rank whose shards its replica
    wrote, the files to read besides its own: every rank loads through the index,
    bitwise, and never reads ``.metadata`` (a save from the plan cache, the second)."""
    results = _run(_rank_hsdp, 4, str(tmp_path), timeout=100)
    # DCP's dedup shares each shard's writing between its two replicas: every rank's
    # file holds some of its own chunks and some of its replica's.
    assert len(_sizes(tmp_path / "hsdp" / "step_00000002")) == 4
    for rank, res in enumerate(results):
        assert res["placements"] == ["(Replicate(), Shard(dim=0))"], res
        assert res["diff"]["tensors"] >= 24 and res["diff"]["mismatch"] == [], (rank, res["diff"])
        assert res["load_path"] == (1, 1, 0, 0), (rank, res["load_path"])


@pytest.mark.parametrize(
    "peers,expected",
    [
        ({"1": [0], "3": [2, 0]}, {1: (0,), 3: (2, 0)}),
        ({}, {}),
        (None, {}),  # an index without the field (written before it existed)
        ({"²": [0]}, None),  # a digit that int() refuses: not a rank
        ({"1": [-1]}, None),
        ({"1": "0"}, None),
        ({"x": [0]}, None),
        ([1], None),
    ],
)
def test_the_shard_index_peers_field_is_read_or_the_index_refused_never_raised(peers: Any, expected: Any) -> None:
    """``parse_shards`` reads ``peers`` as written by the coordinator, reads an index
    without it as having none, and refuses (``None``: ``.metadata`` is read instead)
    a malformed one without raising."""
    import json

    from asyncckpt.format.shards import parse_shards

    index: dict[str, Any] = {
        "format": "asyncckpt.shards",
        "version": 1,
        "metadata_crc32": 7,
        "entries": {},
        "records": {},
        "chunks": {},
    }
    if peers is not None:
        index["peers"] = peers
    parsed = parse_shards(json.dumps(index).encode(), 7, {})
    assert (None if parsed is None else parsed.peers) == expected


# ----------------------------------------------------------------------------- DDP: replicated, written once
def _rank_save_ddp(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.nn.parallel import DistributedDataParallel

    import asyncckpt
    from asyncckpt import AsyncCallsQueue, CheckpointManager

    torch.set_num_threads(1)
    root_p = Path(root)
    torch.manual_seed(0)
    plans = count_plans()  # in this rank's process, left on
    model = DistributedDataParallel(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    out: dict[str, Any] = {"bytes": {}, "diffs": {}, "planned": {"save": 0, "manager": 0}}
    queue = AsyncCallsQueue(persistent=False)
    manager = CheckpointManager(root_p / "mgr", persistent=True)

    def planned(name: str, save: Any) -> Any:  # save(), counting whether DCP planned it
        before = plans.n
        handle = save()
        out["planned"][name] += plans.n - before
        return handle

    ok = False
    try:
        for step in (1, 2, 3):
            _train(model, optim, 1, rank, dim=256)
            msd, osd = get_state_dict(model, optim)
            state = {"model": msd, "optim": osd, "step": step}
            out["state_bytes"] = sum(v.nbytes for v in _leaves(state).values() if isinstance(v, torch.Tensor))
            snapshot = _map_tensors(state, lambda t: t.detach().clone())
            handles = [
                (
                    "save",
                    root_p / f"save_{step}",
                    planned(
                        "save",
                        lambda state=state, step=step: asyncckpt.save(
                            state, root_p / f"save_{step}", async_op=True, calls_queue=queue
                        ),
                    ),
                ),
                (
                    "manager",
                    manager.step_dir(step),
                    planned("manager", lambda state=state, step=step: manager.save(step, state)),
                ),
            ]
            _train(model, optim, 1, rank, dim=256)  # mutate while the writes are in flight
            out["mutated"] = len(_compare(snapshot, state)["mismatch"])
            for name, path, handle in handles:
                out["bytes"][(name, step)] = handle.wait(timeout=30).bytes
                dist.barrier()
                got = _map_tensors(state, torch.zeros_like)
                dcp.load(got, checkpoint_id=str(path))
                out["diffs"][(name, step)] = _compare(snapshot, got)
        manager.close()
        queue.close()
        ok = True
    finally:
        if not ok:
            manager.close(abort=True)
            queue.close(abort=True)
    return out


@pytest.mark.timeout(90)
def test_ddp_replicated_state_is_written_once(tmp_path: Path) -> None:
    results = _run(_rank_save_ddp, 2, str(tmp_path))
    state_bytes = results[0]["state_bytes"]
    assert state_bytes == results[1]["state_bytes"] > 1_500_000
    for res in results:
        # The 2nd and 3rd saves of each saver reused the 1st one's plan.
        assert res["planned"] == {"save": 1, "manager": 1}, res["planned"]
        assert res["mutated"] == 16
        for key, cmp in res["diffs"].items():
            assert cmp["tensors"] == 16 and cmp["mismatch"] == [], (key, cmp)  # 4 params + 4 x 3 Adam
    assert results[0]["bytes"] == results[1]["bytes"]
    for (name, step), nbytes in results[0]["bytes"].items():
        path = tmp_path / (f"save_{step}" if name == "save" else f"mgr/step_{step:08d}")
        sizes = _sizes(path)
        assert sorted(sizes) == sorted(DATA_FILES) and sum(sizes.values()) == nbytes, (path, sizes)
        # One copy of the replicated state in all (not one per rank)...
        assert 0.95 * state_bytes <= nbytes <= 1.1 * state_bytes, (name, step, nbytes, state_bytes)
        # ...split between the ranks (DCP's dedup balances the write load).
        for size in sizes.values():
            assert 0.3 * nbytes < size < 0.7 * nbytes, (name, step, sizes)
        print(
            f"DDP {name} step {step}: state {state_bytes} B, written {nbytes} B ({nbytes / state_bytes:.3f}x), "
            f"per rank {[sizes[f] for f in DATA_FILES]}"
        )
