"""The node-local tier (issue 31) on 4 real gloo ranks standing for 2 nodes of 2 ranks.

``LocalTier(node=rank // 2)`` places ranks 0-1 on "node 0" and 2-3 on "node 1", each
node with its own tier directory, as two machines would have. One ``run_ranks`` call
runs a scenario's phases on every rank (saves, wiping a node, restores) and returns
what each rank observed; the assertions run here. The torchrun version of the same
(two agents, a killed worker) is in ``tests/test_local_tier_torchrun.py``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast
from unittest import mock

import psutil
import pytest
import torch
import torch.distributed as dist

import asyncckpt
from asyncckpt.errors import (
    CheckpointError,
    CheckpointPathError,
    CorruptCheckpointError,
    InvalidArgumentError,
    LocalTierInUseError,
)
from asyncckpt.io.local_tier import NodeLocalStorage
from asyncckpt.replication import replica_map

from dist_utils import preload_forkserver, run_ranks
from helpers import assert_same, clone_state, finish_session, flip_byte, small_tmpfs, started_session

WORLD = 4


def _state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {"w": torch.randn(4096, generator=g), "b": torch.arange(7) * step, "step": step, "rank": rank}


def _template() -> dict[str, Any]:
    return {"w": torch.zeros(4096), "b": torch.zeros(7, dtype=torch.int64), "step": -1, "rank": -1}


def _tier(base: str, rank: int) -> asyncckpt.LocalTier:
    node = rank // 2
    return asyncckpt.LocalTier(dir=os.path.join(base, f"node{node}"), every=2, replicas=1, node=node)


def _restore(base: str, rank: int) -> dict[str, Any]:
    with asyncckpt.CheckpointManager(os.path.join(base, "root"), local=_tier(base, rank)) as mgr:
        got = _template()
        result = mgr.restore(got)
        assert mgr.local is not None and mgr.local.restored == result
    expected = _state(rank, result.step) if result is not None else None
    same = expected is not None and all(
        torch.equal(got[k], expected[k]) if isinstance(got[k], torch.Tensor) else got[k] == expected[k]
        for k in expected
    )
    return {"result": result, "same": same}


def _scenario(rank: int, world: int, base: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    with asyncckpt.CheckpointManager(os.path.join(base, "root"), local=_tier(base, rank)) as mgr:
        assert mgr.local is not None
        assert mgr.prepare(_state(rank, 0)) > 0  # (both tiers' staging buffers, before the first save)
        restorable: list[int] = []
        for step in range(1, 12):
            if step in (4, 6):  # rank 3's local commit of step 4 fails, rank 2's receive of step 6:
                restorable += mgr.local.maybe_finalize(blocking=True)  # no rank marks either
                if (rank, step) == (3, 4):
                    os.environ["ASYNCCKPT_FAULT"] = "commit:raise"
                if (rank, step) == (2, 6):
                    os.environ["ASYNCCKPT_FAULT"] = "replicate:raise"
            handle = mgr.local.save(step, _state(rank, step))
            assert (handle is None) == (step % 2 == 1)
            if step == 4:
                mgr.save(step, _state(rank, step))  # the persistent tier: step 4
            if step in (4, 6):
                restorable += mgr.local.maybe_finalize(blocking=True)
                os.environ.pop("ASYNCCKPT_FAULT", None)
                seen[f"after_failed_{step}"] = list(restorable)
            restorable += mgr.local.maybe_finalize()
        restorable += mgr.local.maybe_finalize(blocking=True)
        seen["restorable"] = restorable
    node_dir = Path(base) / f"node{rank // 2}"
    seen["files"] = sorted(
        str(p.relative_to(node_dir))
        for p in node_dir.rglob("*")
        if p.is_file() and not any(part.startswith(".spare") for part in p.relative_to(node_dir).parts)
    )
    seen["spares"] = sorted(p.parent.name for p in node_dir.glob("rank_*/.spare.tmp-*"))
    dist.barrier()
    seen["intact"] = _restore(base, rank)  # every shard on its own node
    dist.barrier()
    if rank == 2:  # a flipped byte in node 1's copy of rank 3's shard: it takes its replica on node 0
        flip_byte(Path(base) / "node1" / "rank_00003" / "step_00000010" / "__0_0.distcp", 100)
    dist.barrier()
    seen["flipped"] = _restore(base, rank)
    dist.barrier()
    if rank == 2:  # node 1 replaced (its tier is empty), the persistent root moved away
        shutil.rmtree(Path(base) / "node1")
    if rank == 0:
        os.rename(Path(base) / "root", Path(base) / "root.away")
    dist.barrier()
    seen["replaced"] = _restore(base, rank)
    dist.barrier()
    node1 = Path(base) / "node1"  # a fetched shard is loaded, not stored: node 1 holds no shard's file
    seen["node1_after"] = sorted(str(p.relative_to(node1)) for p in node1.rglob("rank_*/**/*") if p.is_file())
    dist.barrier()
    if rank == 0:  # node 0's copy of rank 3's shard is bad too (its last one), and the root is back
        flip_byte(Path(base) / "node0" / "rank_00003" / "step_00000010" / "__0_0.distcp", 100)
        shutil.rmtree(Path(base) / "root")  # (the empty root the restores made)
        os.rename(Path(base) / "root.away", Path(base) / "root")
    dist.barrier()
    seen["no_copy"] = _restore(base, rank)["result"]
    return seen


@pytest.mark.timeout(240)
def test_local_tier_replicates_and_restores(tmp_path: Path) -> None:
    preload_forkserver()
    seen = run_ranks(_scenario, WORLD, str(tmp_path), timeout=200, start_method="forkserver")
    for rank, s in enumerate(seen):
        # step 4 failed on rank 3 (its commit), step 6 on rank 2 (a replica it received): both are
        # restorable nowhere, training went on; 2, 8 and 10 are (10 received into the spares of 6)
        assert s["after_failed_4"] == [2] and s["after_failed_6"] == [2], (rank, s)
        assert s["restorable"] == [2, 8, 10], (rank, s)
    # each node keeps the newest restorable step only, of its ranks' shards and its replicas
    assert seen[0]["files"] == seen[2]["files"]
    tier_files = {".asyncckpt.owner.json", ".asyncckpt.tier.lock"}  # whose tier (the job's root), held while it runs
    assert {f.split("/")[0] for f in seen[0]["files"]} == {f"rank_0000{r}" for r in range(WORLD)} | tier_files
    assert {f.split("/")[1] for f in seen[0]["files"] if "/step_" in f} == {"step_00000010"}
    # and one spare per shard, its own ranks' and its replicas' (an older step, written over by the next one)
    assert seen[0]["spares"] == seen[2]["spares"] == [f"rank_0000{r}" for r in range(WORLD)]
    for rank, s in enumerate(seen):
        intact = s["intact"]["result"]
        assert (intact.step, intact.tier, intact.peers, intact.source) == (10, "local", {}, "local"), intact
        assert s["intact"]["same"], rank
        replaced = s["replaced"]["result"]
        assert (replaced.step, replaced.tier) == (10, "local"), replaced
        assert replaced.peers == {2: 0, 3: 1}, replaced  # from their replicas (each rank's replica target)
        assert s["replaced"]["same"], rank
        flipped = s["flipped"]["result"]
        assert flipped.peers == {3: 1}, flipped
        assert "rank 3's copy from its own node failed" in str(flipped) and "checksum mismatch" in str(flipped)
        assert s["flipped"]["same"], rank
        assert s["node1_after"] == [] and (Path(tmp_path) / "node1" / ".asyncckpt.owner.json").exists(), (rank, s)
        # rank 3's shard received from rank 1 fails its check: no copy left, every rank takes the root's step 4
        no_copy = s["no_copy"]
        assert (no_copy.step, no_copy.tier) == (4, "persistent"), no_copy
        assert "rank 3's copy from rank 1 failed" in str(no_copy) and "checksum mismatch" in str(no_copy), no_copy
    assert seen[3]["flipped"]["result"].source == "peer 1"


def _other_world(rank: int, world: int, base: str) -> Any:
    tier = asyncckpt.LocalTier(dir=os.path.join(base, "node0"), every=2, replicas=0, node=0)
    with asyncckpt.CheckpointManager(os.path.join(base, "root"), local=tier) as mgr:
        if world == WORLD:
            for step in (2, 4):
                mgr.local.save(step, _state(rank, step))  # type: ignore[union-attr]
            mgr.save(2, _state(0, 2))
            mgr.maybe_finalize(blocking=True)
            mgr.local.maybe_finalize(blocking=True)  # type: ignore[union-attr]
            return None
        got = _template()
        return mgr.restore(got), got["step"]


@pytest.mark.timeout(180)
def test_other_world_size_restores_from_the_persistent_tier(tmp_path: Path) -> None:
    preload_forkserver()
    run_ranks(_other_world, WORLD, str(tmp_path), timeout=120, start_method="forkserver")
    for result, step in run_ranks(_other_world, 2, str(tmp_path), timeout=120, start_method="forkserver"):
        assert (result.step, result.tier, step) == (2, "persistent", 2), result
        assert "saved by [4] ranks, this job has 2: restoring from the persistent tier" in str(result), result


def test_replica_map_and_policy() -> None:
    # two nodes of two ranks: each rank's shard goes to the rank of the same position on the other node
    assert replica_map([0, 0, 1, 1], 1) == [[2], [3], [0], [1]]
    assert replica_map([0, 0, 1, 1, 2, 2], 2) == [[2, 4], [3, 5], [4, 0], [5, 1], [0, 2], [1, 3]]
    assert replica_map([0, 0], 0) == [[], []]
    with pytest.raises(InvalidArgumentError, match="needs at least 2 nodes"):
        replica_map([0, 0], 1)
    for bad in ({"every": 0}, {"replicas": -1}, {"every": True}, {"node": -2}, {"dir": 3}):
        with pytest.raises(InvalidArgumentError):
            asyncckpt.LocalTier(**bad)


def _fsdp2(rank: int, world: int, base: str) -> list[str]:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step() -> None:
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()

    def full() -> dict[str, torch.Tensor]:  # every parameter and AdamW state, gathered (collective)
        m: Any
        m, o = get_state_dict(model, opt)
        out = {f"model.{k}": v.full_tensor().clone() for k, v in m.items()}
        states: Any = o["state"]
        for fqn, st in states.items():
            out |= {f"optim.{fqn}.{k}": v.full_tensor().clone() for k, v in st.items() if hasattr(v, "full_tensor")}
        return out

    step()
    tier = asyncckpt.LocalTier(dir=os.path.join(base, f"node{rank // 2}"), every=1, replicas=1, node=rank // 2)
    with asyncckpt.CheckpointManager(os.path.join(base, "root"), local=tier) as mgr:
        m, o = get_state_dict(model, opt)
        mgr.local.save(1, {"model": m, "optim": o})  # type: ignore[union-attr]
        assert mgr.local.maybe_finalize(blocking=True) == [1]  # type: ignore[union-attr]
    # the tier holds this rank's shards as plain tensors (its bytes only; records for the direct paths)
    own = Path(base) / f"node{rank // 2}" / f"rank_{rank:05d}" / "step_00000001"
    saved = asyncckpt.read_state_dict(own)["model"]
    as_shards = (own / ".records.json").is_file() and all(
        type(saved[k]) is torch.Tensor and torch.equal(saved[k], cast(Any, v).to_local()) for k, v in m.items()
    )
    ref = full()
    step()  # the state moves on; the restore must bring step 1 back
    if rank == 2:
        shutil.rmtree(os.path.join(base, "node1"))
    dist.barrier()
    with asyncckpt.CheckpointManager(os.path.join(base, "root"), local=tier) as mgr:
        m, o = get_state_dict(model, opt)
        state: dict[str, Any] = {"model": m, "optim": o}
        result = mgr.restore(state)
        dtensors = all(type(v).__name__ == "DTensor" for v in state["model"].values())  # (restored in place)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = full()
    assert result is not None and result.peers == {2: 0, 3: 1}, result
    assert as_shards and dtensors, (as_shards, dtensors)
    return [k for k in ref if not torch.equal(ref[k], got[k])]


@pytest.mark.timeout(180)
def test_fsdp2_shards_restore_from_peers(tmp_path: Path) -> None:
    preload_forkserver()
    for rank, different in enumerate(run_ranks(_fsdp2, WORLD, str(tmp_path), timeout=150, start_method="forkserver")):
        assert not different, (rank, different)


def test_a_replica_damaged_in_transit_is_refused(tmp_path: Path) -> None:
    # one process (no torch.distributed): a local tier without replicas, then its shard
    # sent by hand to another node's tier, intact and with one byte flipped on the way
    tier = asyncckpt.LocalTier(dir=tmp_path / "node0", every=1, replicas=0)
    with asyncckpt.CheckpointManager(tmp_path / "root", local=tier) as mgr:
        assert mgr.local is not None
        mgr.local.save(3, _state(0, 3))
        assert mgr.local.maybe_finalize(blocking=True) == [3]
        packed = mgr.local.storage.pack(0, 3)
        files, data = packed.files, b"".join(bytes(m) if m is not None else b"" for m in packed.maps)
        packed.close()
    other = NodeLocalStorage(tmp_path / "node1")
    bad = bytearray(data)
    bad[len(bad) // 3] ^= 0x01
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        other.receive(0, 3, files, memoryview(bad))
    assert not other.shard_dir(0).exists() or not any(other.shard_dir(0).iterdir())
    asyncckpt.verify(other.receive(0, 3, files, memoryview(data)))
    got = _template()
    asyncckpt.load(got, other.step_dir(0, 3))
    assert torch.equal(got["w"], _state(0, 3)["w"]) and got["step"] == 3


def test_a_tier_that_cannot_be_made_is_refused_at_construction(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    tier = asyncckpt.LocalTier(dir=tmp_path / "file" / "tier", replicas=0)
    with pytest.raises(CheckpointPathError, match=r"the local tier .* cannot be used") as info:
        asyncckpt.CheckpointManager(tmp_path / "root", local=tier)
    assert isinstance(info.value, NotADirectoryError)
    asyncckpt.CheckpointManager(tmp_path / "root").close()  # the root was released
    with pytest.raises(InvalidArgumentError):
        asyncckpt.CheckpointManager(tmp_path / "root", local="/dev/shm/x")  # type: ignore[arg-type]


def test_a_step_saved_again_replaces_an_earlier_runs_copy(tmp_path: Path) -> None:
    # a fresh run of the job (or one restored from an older step) saves a step the tier
    # holds from before, even the restorable one: the new copy replaces it, and is what restores
    tier = asyncckpt.LocalTier(dir=tmp_path / "node0", every=1, replicas=0)
    for run in (1, 2):
        with asyncckpt.CheckpointManager(tmp_path / "root", local=tier) as mgr:
            assert mgr.local is not None
            mgr.local.save(2, _state(run, 2))
            assert mgr.local.maybe_finalize(blocking=True) == [2]
    with asyncckpt.CheckpointManager(tmp_path / "root", local=tier) as mgr:
        got = _template()
        result = mgr.restore(got)
    assert result is not None and (result.step, result.tier) == (2, "local")
    assert got["rank"] == 2 and torch.equal(got["w"], _state(2, 2)["w"])


def test_a_shards_next_step_is_written_into_its_spare(tmp_path: Path) -> None:
    # the step before the restorable one stays, hidden, and the next save writes over its
    # files (on a RAM tier their pages are reused, not freed and zeroed again), also when
    # the new file is shorter
    tier = asyncckpt.LocalTier(dir=tmp_path / "node0", every=1, replicas=0)
    shard = tmp_path / "node0" / "rank_00000"
    inodes = {}
    with asyncckpt.CheckpointManager(tmp_path / "root", local=tier) as mgr:
        assert mgr.local is not None
        for step, n in ((1, 1 << 16), (2, 1 << 16), (3, 1 << 10)):
            mgr.local.save(step, {"w": torch.full((n,), float(step)), "step": step})
            assert mgr.local.maybe_finalize(blocking=True) == [step]
            inodes[step] = (shard / f"step_{step:08d}" / "__0_0.distcp").stat().st_ino
            assert [p.name for p in shard.glob(".spare.tmp-*")] == ([] if step == 1 else [mock.ANY])
    assert inodes[3] == inodes[1] != inodes[2]
    assert sorted(p.name for p in shard.iterdir() if not p.name.startswith(".")) == [
        "restorable.json",
        "step_00000003",
    ]
    asyncckpt.verify(shard / "step_00000003")  # sizes (the file was cut) and CRC-32s
    with asyncckpt.CheckpointManager(tmp_path / "root", local=tier) as mgr:
        got: dict[str, Any] = {"w": torch.zeros(1 << 10), "step": -1}
        result = mgr.restore(got)
    assert result is not None and (result.step, result.tier) == (3, "local")
    assert got["step"] == 3 and torch.equal(got["w"], torch.full((1 << 10,), 3.0))


def _overlapped_then_local(rank: int, world: int, base: str) -> Any:
    """An overlapped save whose copy ends at different times on the two ranks (rank 1's
    copy thread sleeps at the ``stage`` failpoint), a ``maybe_finalize()`` between (it
    hands a copy that is over to the writer: rank 0's), then a local save of the same
    step: both are committed, in the same order on both ranks."""
    if rank == 1:
        os.environ["ASYNCCKPT_FAULT"] = "stage:sleep=1.5"  # read by the copy thread (and the local save's stage)
    tier = asyncckpt.LocalTier(dir=os.path.join(base, f"node{rank}"), every=2, replicas=1, node=rank)
    with asyncckpt.CheckpointManager(os.path.join(base, "root"), local=tier, overlap_staging=True) as mgr:
        assert mgr.local is not None
        state = _state(rank, 2)
        mgr.save(2, state)
        time.sleep(0.5)  # rank 0's copy is over, rank 1's is not
        mgr.maybe_finalize()
        mgr.local.save(2, state)
        committed = mgr.maybe_finalize(blocking=True)
        restorable = mgr.local.maybe_finalize(blocking=True)
    return committed, restorable


def test_an_overlapped_save_is_scheduled_before_a_later_local_save_on_every_rank(tmp_path: Path) -> None:
    # The manager's saves and the local tier's share one queue, whose calls every rank
    # must schedule in the same order: the local save hands the overlapped save still
    # copying to the writer first. Before, rank 0 scheduled the persistent save first and
    # rank 1 the local one, and their commits met each other's collectives.
    seen = run_ranks(_overlapped_then_local, 2, str(tmp_path), timeout=120)
    assert seen == [([2], [2]), ([2], [2])]


def test_overlapped_local_saves_return_before_the_copy_and_hold_the_state_as_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``overlap_staging=True`` a local save returns once its copy is started (the
    copy thread held at the ``stage`` failpoint until a gate file exists, opened 3 s
    later): the optimizer's step right after it waits for the copy, an in-place change
    after ``synchronize_staging()`` is not in the checkpoint, and both steps restore
    bitwise as of their save."""
    gate = tmp_path / "gate"
    monkeypatch.setenv("ASYNCCKPT_FAULT", f"stage:wait={gate}")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Linear(256, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    def backward() -> None:
        model(torch.randn(8, 128)).square().mean().backward()

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    backward()
    opt.step()  # the optimizer state exists
    tier = asyncckpt.LocalTier(dir=tmp_path / "node0", every=1, replicas=0)
    with asyncckpt.CheckpointManager(tmp_path / "root", local=tier, overlap_staging=True) as mgr:
        assert mgr.local is not None
        expected1 = clone_state(state())
        backward()
        opener = threading.Timer(3.0, gate.touch)
        opener.start()
        try:
            mgr.local.save(1, state())
            returned_before_the_copy = not gate.exists()
            opt.step()  # its pre-hook waits for the copy (until the gate opens)
        finally:
            opener.join()
        assert returned_before_the_copy
        assert mgr.local.maybe_finalize(blocking=True) == [1]
        got1 = clone_state(expected1)
        for t in [*got1["model"].values()]:
            t.zero_()
        result1 = mgr.restore(got1)
        assert result1 is not None and (result1.step, result1.tier) == (1, "local")
        assert_same(expected1, got1)

        expected2 = clone_state(state())
        mgr.local.save(2, state())
        mgr.synchronize_staging()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # after synchronize_staging(): not in step 2
        assert mgr.local.maybe_finalize(blocking=True) == [2]
        got2 = clone_state(expected1)
        result2 = mgr.restore(got2)
    assert result2 is not None and (result2.step, result2.tier) == (2, "local")
    assert_same(expected2, got2)
    assert not torch.equal(expected1["model"]["0.weight"], expected2["model"]["0.weight"]), "the step did nothing"


def _overlapped_local_then_persistent(rank: int, world: int, base: str, background: bool) -> Any:
    """An overlapped local save whose copy ends at different times on the two ranks
    (rank 1's copy thread sleeps at the ``stage`` failpoint), the tier's
    ``maybe_finalize()`` between (it hands rank 0's to the writer; on a queue finalized
    in the loop, only once every rank's copy is over), then a persistent save of the
    same step on the same queue: both are committed on both ranks."""
    if rank == 1:
        os.environ["ASYNCCKPT_FAULT"] = "stage:sleep=1.5"  # read by the copy thread (and the other save's stage)
    queue = asyncckpt.AsyncCallsQueue(persistent=True, background_finalize=background)
    tier = asyncckpt.LocalTier(dir=os.path.join(base, f"node{rank}"), every=2, replicas=1, node=rank)
    try:
        with asyncckpt.CheckpointManager(
            os.path.join(base, "root"), local=tier, calls_queue=queue, overlap_staging=True
        ) as mgr:
            assert mgr.local is not None
            state = _state(rank, 2)
            mgr.local.save(2, state)
            time.sleep(0.5)  # rank 0's copy is over, rank 1's is not
            restorable = mgr.local.maybe_finalize()
            mgr.save(2, state)
            committed = mgr.maybe_finalize(blocking=True)
            restorable += mgr.local.maybe_finalize(blocking=True)
            got = _template()
            result = mgr.restore(got)
        same = all(
            torch.equal(got[k], state[k]) if isinstance(got[k], torch.Tensor) else got[k] == state[k] for k in state
        )
        return committed, restorable, (result.step, result.tier) if result is not None else None, same
    finally:
        queue.close()


@pytest.mark.parametrize("background", [True, False], ids=["background-finalizer", "finalized-in-the-loop"])
def test_an_overlapped_local_save_and_a_later_persistent_save_commit_in_order_on_every_rank(
    tmp_path: Path, background: bool
) -> None:
    # The local saver is a saver of the manager's queue: its overlapped save is handed to
    # the writer before the persistent save is scheduled, on every rank; on a queue
    # finalized in the loop the tier's maybe_finalize() hands it off only together.
    seen = run_ranks(_overlapped_local_then_persistent, 2, str(tmp_path), background, timeout=120)
    assert seen == [([2], [2], (2, "local"), True)] * 2


def test_the_memory_guard_counts_the_tiers_bytes(tmp_path: Path) -> None:
    # a 1 MiB tier for a 2 MiB shard: the save is refused before anything is staged or written
    with small_tmpfs(tmp_path / "tier", "1m") as mounted:
        if not mounted:
            pytest.skip("mounting a tmpfs needs root")
        tier = asyncckpt.LocalTier(dir=tmp_path / "tier", every=1, replicas=0)
        with asyncckpt.CheckpointManager(tmp_path / "root", local=tier) as mgr:
            assert mgr.local is not None
            with pytest.raises(CheckpointError, match=r"the local tier needs [\d,]+ bytes in .* more than 0.9 x"):
                mgr.local.save(1, {"w": torch.zeros(1 << 19)})
            assert mgr.local.save(2, {"w": torch.zeros(1 << 10)}) is not None  # a small one fits
            assert mgr.local.maybe_finalize(blocking=True) == [2]
        assert sorted(p.name for p in (tmp_path / "tier" / "rank_00000").iterdir()) == [
            "restorable.json",
            "step_00000002",
        ]


def test_the_memory_guard_counts_a_spare_as_room(tmp_path: Path) -> None:
    # a tier with room for 2 copies of a shard and a half: the restorable step and the
    # spare fill it, and every next save is written into the spare, so none is refused
    with small_tmpfs(tmp_path / "tier", "3m") as mounted:
        if not mounted:
            pytest.skip("mounting a tmpfs needs root")
        tier = asyncckpt.LocalTier(dir=tmp_path / "tier", every=1, replicas=0)
        with asyncckpt.CheckpointManager(tmp_path / "root", local=tier) as mgr:
            assert mgr.local is not None
            for step in range(1, 6):
                mgr.local.save(step, {"w": torch.full((300_000,), float(step))})  # 1.2 MB
                assert mgr.local.maybe_finalize(blocking=True) == [step]
        got: dict[str, Any] = {"w": torch.zeros(300_000)}
        with asyncckpt.CheckpointManager(tmp_path / "root", local=tier) as mgr:
            result = mgr.restore(got)
        assert result is not None and result.step == 5 and torch.equal(got["w"], torch.full((300_000,), 5.0))


def test_the_newest_tier_wins(tmp_path: Path) -> None:
    tier = asyncckpt.LocalTier(dir=tmp_path / "node0", every=1, replicas=0)
    with asyncckpt.CheckpointManager(tmp_path / "root", local=tier) as mgr:
        assert mgr.local is not None
        got = _template()
        assert mgr.restore(got) is None and got["step"] == -1  # nothing anywhere: start at step 0
        mgr.local.save(2, _state(0, 2))
        mgr.save(4, _state(0, 4))  # the root is newer
        mgr.maybe_finalize(blocking=True)
        assert mgr.local.maybe_finalize(blocking=True) == [2]
    with asyncckpt.CheckpointManager(tmp_path / "root", local=tier) as mgr:
        result = mgr.restore(got)
        assert result is not None and (result.step, result.tier, result.source) == (4, "persistent", "persistent")
        assert result.location == str(tmp_path / "root" / "step_00000004") and result.location in str(result)
        assert got["step"] == 4
        assert mgr.local is not None
        mgr.local.save(4, _state(1, 4))  # a tie: the local tier (no shared storage read)
        assert mgr.local.maybe_finalize(blocking=True) == [4]
    with asyncckpt.CheckpointManager(tmp_path / "root", local=tier) as mgr:
        result = mgr.restore(got)
        assert result is not None and (result.step, result.tier) == (4, "local") and got["rank"] == 1


def _sized_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    # tensors of 3 MiB and 2 MiB (each lands in its tensor, chunk by chunk) and small ones between
    return {
        "a": torch.randn(3 << 18, generator=g),
        "t": torch.randn(1024, 512, generator=g),
        "b": torch.arange(5) * step,
        "step": step,
    }


def _root_2_local_3(tmp_path: Path) -> asyncckpt.LocalTier:
    """One process, no replica: step 2 of :func:`_sized_state` in the root, step 3 in
    the local tier (returned)."""
    tier = asyncckpt.LocalTier(dir=tmp_path / "node0", every=1, replicas=0)
    with asyncckpt.CheckpointManager(tmp_path / "root", local=tier) as mgr:
        assert mgr.local is not None
        mgr.save(2, _sized_state(2))
        mgr.local.save(3, _sized_state(3))
        mgr.maybe_finalize(blocking=True)
        assert mgr.local.maybe_finalize(blocking=True) == [3]
    return tier


def _sized_template() -> dict[str, Any]:
    """A state of :func:`_sized_state`'s structure to restore into (``t`` not contiguous)."""
    return {
        "a": torch.zeros(3 << 18),
        "t": torch.zeros(512, 1024).t(),
        "b": torch.zeros(5, dtype=torch.int64),
        "step": -1,
    }


def test_own_shard_lands_in_the_state_and_a_flipped_byte_falls_back(tmp_path: Path) -> None:
    # one process: the own shard's tensors are read from its files into the state (a
    # non-contiguous one through a temporary), every byte CRC-checked as it lands, 2 MiB
    # at a time; a byte flipped inside one of them fails the copy, and with no replica
    # the root restores, all of it
    tier = _root_2_local_3(tmp_path)

    def same(got: dict[str, Any], step: int) -> bool:
        want = _sized_state(step)
        return all(torch.equal(got[k], want[k]) for k in ("a", "t", "b")) and got["step"] == step

    for flipped in (False, True):
        if flipped:
            (data,) = (tmp_path / "node0" / "rank_00000" / "step_00000003").glob("*.distcp")
            flip_byte(data, data.stat().st_size // 2)  # inside a tensor's data (they are nearly all of it)
        with asyncckpt.CheckpointManager(tmp_path / "root", local=tier) as mgr:
            got = _sized_template()
            assert not got["t"].is_contiguous()
            result = mgr.restore(got)
        assert result is not None
        if not flipped:
            assert (result.step, result.tier, result.source) == (3, "local", "local"), result
            assert same(got, 3)
        else:
            assert (result.step, result.tier) == (2, "persistent"), result
            assert "rank 0's copy from its own node failed" in str(result) and "checksum mismatch" in str(result)
            assert same(got, 2)


def _reframe(data: Path, offset: int) -> None:
    """Flip the byte at ``offset`` of shard file ``data`` (a record's framing there) and
    write its manifest's CRC-32s anew, so that every checksum matches the changed bytes."""
    import zlib

    flip_byte(data, offset)
    manifest_path = data.parent / ".manifest.json"
    manifest = json.loads(manifest_path.read_text())
    content = data.read_bytes()
    manifest["files"][data.name]["segments"] = [
        [off, n, zlib.crc32(content[off : off + n])] for off, n, _ in manifest["files"][data.name]["segments"]
    ]
    manifest_path.write_text(json.dumps(manifest))


def test_a_record_out_of_framing_under_a_matching_checksum_is_refused(tmp_path: Path) -> None:
    # the own shard's records are placed in the state as the CRC reads them; a record
    # whose framing changed while every checksum matches (the manifest written anew)
    # is refused all the same, naming it, and the root restores
    tier = _root_2_local_3(tmp_path)
    (data,) = (tmp_path / "node0" / "rank_00000" / "step_00000003").glob("*.distcp")
    _reframe(data, 30)  # in the first record's zip header
    got = _sized_template()
    with asyncckpt.CheckpointManager(tmp_path / "root", local=tier) as mgr:
        result = mgr.restore(got)
    assert result is not None and (result.step, result.tier) == (2, "persistent"), result
    assert "rank 0's copy from its own node failed" in str(result), result
    assert "not in our writer's framing" in str(result) and "checksum mismatch" not in str(result), result
    want = _sized_state(2)
    assert all(torch.equal(got[k], want[k]) for k in ("a", "t", "b")) and got["step"] == 2


def test_the_census_gathers_what_does_not_fit_too() -> None:
    # the restore's census is one all_gather of a guessed width; a rank whose census does
    # not fit it (a node holding shards of earlier jobs) makes it two, with the same result
    preload_forkserver()
    for got in run_ranks(_gather_fits, 2, timeout=60, start_method="forkserver"):
        assert got == [[("r0", "x" * 10), ("r1", "x" * 10)], [("r0", "x" * 10), ("r1", "x" * 500)]], got


def _gather_fits(rank: int, world: int) -> Any:
    from asyncckpt.dist import SyncGroup

    sync = SyncGroup()
    return [sync.all_gather_object((f"r{rank}", "x" * n), fits=64) for n in (10, 10 if rank == 0 else 500)]


def _big_state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {"w": torch.randn(4 << 20, generator=g), "step": step}  # 16 MiB: a transfer of some milliseconds


def _killed_mid_replication(rank: int, world: int, base: str) -> Any:
    import signal
    import threading
    import time

    # (no ``with``: the job fails once rank 2 is gone, and its other ranks end)
    pids = [0] * world
    dist.all_gather_object(pids, os.getpid())
    mgr = asyncckpt.CheckpointManager(os.path.join(base, "root"), local=_tier(base, rank))
    assert mgr.local is not None
    mgr.local.save(2, _big_state(rank, 2))
    assert mgr.local.maybe_finalize(blocking=True) == [2]
    if rank == 2:  # rank 0's replica of step 4 arriving here: this process is SIGKILLed with it half received
        shard = Path(base) / "node1" / "rank_00000"

        def kill_when_arriving() -> None:
            while not any(p.name.startswith(".step_00000004.tmp-") for p in shard.iterdir()):
                time.sleep(0.0005)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=kill_when_arriving, daemon=True).start()
    dist.barrier()
    mgr.local.save(4, _big_state(rank, 4))
    deadline = time.monotonic() + 50
    while time.monotonic() < deadline:  # until rank 2 is dead (its replication goes on meanwhile)
        try:
            alive = psutil.Process(pids[2]).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
        except psutil.NoSuchProcess:
            alive = False
        if not alive:  # the job has failed: this rank goes too (its worker stopped), without a word
            mgr.close(abort=True)  # (no collective: rank 2 is gone)
            os._exit(0)
        time.sleep(0.01)
    return "rank 2 is alive"


def _restart(rank: int, world: int, base: str) -> Any:
    with asyncckpt.CheckpointManager(os.path.join(base, "root"), local=_tier(base, rank)) as mgr:
        node = Path(base) / f"node{rank // 2}"
        leftovers = sorted(str(p.relative_to(node)) for p in node.glob("rank_*/.step_*"))
        got: dict[str, Any] = {"w": torch.zeros(4 << 20), "step": -1}
        result = mgr.restore(got)
    return result, leftovers, torch.equal(got["w"], _big_state(rank, 2)["w"]) and got["step"] == 2


@pytest.mark.timeout(180)
def test_a_replica_target_killed_mid_replication(tmp_path: Path) -> None:
    # the process receiving rank 0's replica of step 4 is SIGKILLed with the bytes half
    # received (a lost node, not a failpoint): the job fails; step 4 was never restorable,
    # and the next start restores step 2, with nothing of the half-received copy
    preload_forkserver()
    with pytest.raises(AssertionError, match=r"exit codes \{[^}]*2: -9"):
        run_ranks(_killed_mid_replication, WORLD, str(tmp_path), timeout=60, start_method="forkserver")
    half = list((tmp_path / "node1" / "rank_00000").glob(".step_00000004.tmp-*"))
    assert half, "rank 2 died before the replica arrived"
    for node in ("node0", "node1"):
        for shard in (tmp_path / node).glob("rank_*"):
            assert NodeLocalStorage(tmp_path / node).marker(int(shard.name[5:]))["step"] == 2  # type: ignore[index]
    for rank, (result, leftovers, same) in enumerate(
        run_ranks(_restart, WORLD, str(tmp_path), timeout=120, start_method="forkserver")
    ):
        assert (result.step, result.tier, result.peers) == (2, "local", {}), (rank, result)
        assert leftovers == [] and same, (rank, leftovers)


def _messages_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    # 9 MiB: a piece of 3 messages (4, 4, 1 MiB), each CRC-checked as it arrives; and a
    # non-contiguous 2 MiB one (received through a temporary) and small ones between
    return {
        "big": torch.randn(9 << 18, generator=g),
        "t": torch.randn(1024, 512, generator=g),
        "b": torch.arange(5) * step,
        "step": step,
    }


def _peer_messages(rank: int, world: int, base: str) -> Any:
    tier = asyncckpt.LocalTier(dir=os.path.join(base, f"node{rank}"), every=1, replicas=1, node=rank)
    with asyncckpt.CheckpointManager(os.path.join(base, "root"), local=tier) as mgr:
        assert mgr.local is not None
        mgr.save(2, _messages_state(2))
        mgr.local.save(3, _messages_state(3))
        mgr.maybe_finalize(blocking=True)
        assert mgr.local.maybe_finalize(blocking=True) == [3]
    seen = []
    for case in ("intact", "damaged", "reframed"):
        dist.barrier()
        if rank == 1:  # node 1 replaced: rank 1's shard comes from node 0
            shutil.rmtree(Path(base) / "node1", ignore_errors=True)
        if rank == 0 and case != "intact":
            (data,) = (Path(base) / "node0" / "rank_00001" / "step_00000003").glob("*.distcp")
            flip_byte(data, (8 << 20) + (512 << 10))  # a byte in the third message of "big" (back, when reframed)
            if case == "reframed":
                _reframe(data, 30)
        dist.barrier()
        got: dict[str, Any] = {
            "big": torch.zeros(9 << 18),
            "t": torch.zeros(512, 1024).t(),
            "b": torch.zeros(5, dtype=torch.int64),
            "step": -1,
        }
        with asyncckpt.CheckpointManager(os.path.join(base, "root"), local=tier) as mgr:
            result = mgr.restore(got)
        want = _messages_state(result.step if result is not None else -1)
        same = all(torch.equal(got[k], want[k]) for k in ("big", "t", "b")) and got["step"] == want["step"]
        seen.append((result, same))
    return seen


@pytest.mark.timeout(120)
def test_a_peer_copy_is_checked_message_by_message(tmp_path: Path) -> None:
    # rank 1's shard sent by rank 0 in messages of 4 MiB at most, each CRC-checked as it
    # arrives: intact, it lands in the state bit for bit; with a byte flipped in the third
    # message of a tensor, the copy fails (no other replica) and the root restores
    preload_forkserver()
    # (and with a record's framing changed under a checksum that matches it: refused, naming the record)
    for rank, ((intact, same), (damaged, same_after), (reframed, same_then)) in enumerate(
        run_ranks(_peer_messages, 2, str(tmp_path), timeout=100, start_method="forkserver")
    ):
        assert (intact.step, intact.tier, intact.peers) == (3, "local", {1: 0}), (rank, intact)
        assert same, rank
        assert (damaged.step, damaged.tier) == (2, "persistent"), (rank, damaged)
        assert "rank 1's copy from rank 0 failed" in str(damaged) and "checksum mismatch" in str(damaged), damaged
        assert same_after, rank
        assert (reframed.step, reframed.tier) == (2, "persistent"), (rank, reframed)
        assert "rank 1's copy from rank 0 failed" in str(reframed), reframed
        assert "not in our writer's framing" in str(reframed), reframed
        assert same_then, rank


def test_another_jobs_tier_is_taken_over_never_restored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # two jobs (two roots) of the same model, one after the other, in one tier directory
    # (as LocalTier's default dir would have it): the second starts fresh, it never
    # restores the first one's weights; the first one's shards are removed (a node keeps
    # one job's tier), and its next run restores what its own root holds
    tier = asyncckpt.LocalTier(dir=tmp_path / "node0", every=1, replicas=0)
    with asyncckpt.CheckpointManager(tmp_path / "rootA", local=tier) as mgr:
        assert mgr.local is not None
        mgr.local.save(5, _state(0, 5))
        assert mgr.local.maybe_finalize(blocking=True) == [5]
        mgr.save(3, _state(0, 3))
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        with asyncckpt.CheckpointManager(tmp_path / "rootB", local=tier) as mgr:
            got = _template()
            assert mgr.restore(got) is None and got["step"] == -1  # a fresh start, not job A's step 5
            assert mgr.local is not None
            mgr.local.save(1, _state(1, 1))
            assert mgr.local.maybe_finalize(blocking=True) == [1]
    taken = [r.getMessage() for r in caplog.records if "takes the tier over" in r.getMessage()]
    assert len(taken) == 1 and str(tmp_path / "rootA") in taken[0], taken
    assert NodeLocalStorage(tmp_path / "node0").held() == [(0, 1, 1)]  # job B's step only
    with asyncckpt.CheckpointManager(tmp_path / "rootA", local=tier) as mgr:
        got = _template()
        result = mgr.restore(got)  # job A again: its root's step 3 (its tier is job B's now: taken back, emptied)
        assert result is not None and (result.step, result.tier) == (3, "persistent") and got["step"] == 3
    assert NodeLocalStorage(tmp_path / "node0").held() == []


_HOLDER = """
    import sys, time, torch, asyncckpt
    tier = asyncckpt.LocalTier(dir=sys.argv[1], every=1, replicas=0)
    with asyncckpt.CheckpointManager(sys.argv[2], local=tier) as mgr:
        mgr.local.save(1, {"w": torch.ones(8)})
        mgr.local.maybe_finalize(blocking=True)
        print("holding", flush=True)
        time.sleep(600)
"""


@contextlib.contextmanager
def _holding(tmp_path: Path, tier_dir: Path) -> Iterator[subprocess.Popen]:
    """Another job (root ``tmp_path / "other"``), running in a process of its own, that
    holds the tier ``tier_dir`` (its manager open, one local step saved)."""
    script = tmp_path / "holder.py"
    script.write_text(textwrap.dedent(_HOLDER))
    env = {k: v for k, v in os.environ.items() if k != "ASYNCCKPT_FAULT"}
    cmd = [sys.executable, str(script), str(tier_dir), str(tmp_path / "other")]
    with started_session(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) as proc:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "holding", proc.stderr
        yield proc


@pytest.mark.timeout(120)
def test_a_tier_held_by_a_running_job_is_refused_then_taken_over_once_it_died(tmp_path: Path) -> None:
    # another job, running (a process with its manager open), holds the tier: this job's
    # manager is refused, naming the other job's root, and nothing of the other's is
    # touched; once that job is gone (SIGKILL: the kernel drops its lock), the tier is taken over
    tier = asyncckpt.LocalTier(dir=tmp_path / "node0", every=1, replicas=0)
    with _holding(tmp_path, tmp_path / "node0") as proc:
        with pytest.raises(LocalTierInUseError, match="in use by the job of the checkpoint root") as info:
            asyncckpt.CheckpointManager(tmp_path / "root", local=tier)
        assert info.value.owner == str(tmp_path / "other") and info.value.path == str(tmp_path / "node0")
        assert NodeLocalStorage(tmp_path / "node0").held() == [(0, 1, 1)]  # the other job's step, untouched
        asyncckpt.CheckpointManager(tmp_path / "root").close()  # the root was released
        proc.kill()
        finish_session(proc, timeout=30)
    with asyncckpt.CheckpointManager(tmp_path / "root", local=tier) as mgr:
        assert mgr.restore(_template()) is None  # taken over: the other job's step is gone
    owner = json.loads((tmp_path / "node0" / ".asyncckpt.owner.json").read_text())
    assert owner == {"root": str(tmp_path / "root")}


def _open_held_tier(rank: int, world: int, base: str) -> tuple[str, str | None]:
    try:
        asyncckpt.CheckpointManager(os.path.join(base, "root"), local=_tier(base, rank))
    except LocalTierInUseError as exc:
        return type(exc).__name__, exc.owner
    return "opened", None


@pytest.mark.timeout(120)
def test_a_tier_held_on_one_node_is_refused_on_every_rank(tmp_path: Path) -> None:
    # another job, running, holds node 1's tier: the claim fails on node 1's first rank,
    # and every rank of the job (node 0's too) raises the same LocalTierInUseError
    with _holding(tmp_path, tmp_path / "node1") as proc:
        seen = run_ranks(_open_held_tier, WORLD, str(tmp_path), timeout=100, start_method="forkserver")
        proc.kill()
        finish_session(proc, timeout=30)
    assert seen == [("LocalTierInUseError", str(tmp_path / "other"))] * WORLD, seen


@pytest.mark.timeout(60)
def test_fifos_in_the_tier_never_block(tmp_path: Path) -> None:
    # FIFOs where the tier's records are (a hostile or broken node): nothing blocks. The
    # lock refuses the tier at once, naming it; an owner record or a marker that is no
    # regular file counts as none (the tier is claimed and its record written anew)
    node = tmp_path / "node0"
    node.mkdir()
    os.mkfifo(node / ".asyncckpt.tier.lock")
    tier = asyncckpt.LocalTier(dir=node, every=1, replicas=0)
    with pytest.raises(CheckpointPathError, match="not a regular file"):
        asyncckpt.CheckpointManager(tmp_path / "root", local=tier)
    (node / ".asyncckpt.tier.lock").unlink()
    os.mkfifo(node / ".asyncckpt.owner.json")
    (node / "rank_00000").mkdir()
    os.mkfifo(node / "rank_00000" / "restorable.json")
    with asyncckpt.CheckpointManager(tmp_path / "root", local=tier) as mgr:
        assert mgr.restore(_template()) is None
        assert mgr.local is not None
        mgr.local.save(1, _state(0, 1))
        assert mgr.local.maybe_finalize(blocking=True) == [1]
    assert json.loads((node / ".asyncckpt.owner.json").read_text()) == {"root": str(tmp_path / "root")}


def test_a_manager_dropped_without_close_lets_go_of_its_tier(tmp_path: Path) -> None:
    # a manager garbage-collected without close() (a notebook cell run again): once its
    # local saves settled, its tier's lock goes with it, not at the process's exit; a job
    # of another root then takes the tier over
    import gc

    tier = asyncckpt.LocalTier(dir=tmp_path / "node0", every=1, replicas=0)
    mgr = asyncckpt.CheckpointManager(tmp_path / "rootA", local=tier)
    assert mgr.local is not None
    mgr.local.save(1, _state(0, 1))
    assert mgr.local.maybe_finalize(blocking=True) == [1]
    del mgr
    gc.collect()
    with asyncckpt.CheckpointManager(tmp_path / "rootB", local=tier) as other:
        assert other.restore(_template()) is None  # taken over, not job A's step 1


def test_a_closed_managers_collection_never_lets_go_of_a_newer_managers_tier(tmp_path: Path) -> None:
    # manager A closed (its tier's lock let go), manager B of the same job opened (its lock
    # may get the number A's had), then A collected: B still holds the tier, so a job of
    # another root is refused while B runs
    import gc

    tier = asyncckpt.LocalTier(dir=tmp_path / "node0", every=1, replicas=0)
    first = asyncckpt.CheckpointManager(tmp_path / "root", local=tier)
    first.close()
    with asyncckpt.CheckpointManager(tmp_path / "root", local=tier) as mgr:
        assert mgr.local is not None
        mgr.local.save(1, _state(0, 1))
        assert mgr.local.maybe_finalize(blocking=True) == [1]
        del first
        gc.collect()
        with pytest.raises(LocalTierInUseError):
            asyncckpt.CheckpointManager(tmp_path / "other", local=tier)
        assert NodeLocalStorage(tmp_path / "node0").held() == [(0, 1, 1)]  # B's step, untouched
