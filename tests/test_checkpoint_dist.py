"""The checkpoint layer on 2 real gloo ranks (spawned processes on 127.0.0.1).

Each scenario is one ``run_ranks`` call that groups several checks: the rank functions
do every collective step on both ranks and return what they observed; the assertions
run here, in the test process, so that a failed check never leaves the other rank
waiting in a collective.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import asyncckpt

from dist_utils import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CALLERS = ["temporal", "persistent"]
WORLD = 2


# ----------------------------------------------------------------------------- helpers (both sides)
def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _diff(expected: Any, got: Any, path: str = "state_dict") -> str | None:
    """``None`` if bitwise equal, else a description of the first difference."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{path}: not a tensor: {type(got).__name__}"
        if got.dtype != expected.dtype or got.shape != expected.shape:
            return f"{path}: {got.dtype}{tuple(got.shape)} != {expected.dtype}{tuple(expected.shape)}"
        return None if torch.equal(_bits(got), _bits(expected)) else f"{path}: values differ: {got} != {expected}"
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(got) != set(expected):
            return f"{path}: {got!r} does not have the keys {sorted(expected)}"
        for k in expected:
            d = _diff(expected[k], got[k], f"{path}[{k!r}]")
            if d:
                return d
        return None
    if isinstance(expected, list):
        if not isinstance(got, list) or len(got) != len(expected):
            return f"{path}: {got!r} != {expected!r}"
        for i, (e, g) in enumerate(zip(expected, got)):
            d = _diff(e, g, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if (type(got) is type(expected) and got == expected) else f"{path}: {got!r} != {expected!r}"


def _clone(sd: Any) -> Any:
    if isinstance(sd, torch.Tensor):
        return sd.detach().clone()
    if isinstance(sd, dict):
        return {k: _clone(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_clone(v) for v in sd]
    return sd


def _fresh(sd: Any) -> Any:
    if isinstance(sd, torch.Tensor):
        return torch.zeros(sd.shape, dtype=sd.dtype)
    if isinstance(sd, dict):
        return {k: _fresh(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_fresh(v) for v in sd]
    return "<not loaded>"


def _rank_state(rank: int) -> dict[str, Any]:
    """Rank-specific entries plus entries replicated (equal) on every rank."""
    return {
        f"rank{rank}": torch.arange(1000, dtype=torch.float32) + 1000 * rank,
        f"ints{rank}": torch.full((7,), rank + 1, dtype=torch.int64),
        "shared": torch.arange(24, dtype=torch.bfloat16).reshape(4, 6).t(),  # non-contiguous
        "shared_big": torch.linspace(-1, 1, 1 << 16),
        "nested": {"x": torch.ones(3, dtype=torch.int8), f"r{rank}": [rank, "text", None]},
        "step": 7,
    }


def _patch_tmp_dir_into(blocker: Path) -> Any:
    """Fault injection on this rank only: its data directory lands under a regular
    file, so its write fails with NotADirectoryError. Returns the undo function."""
    import asyncckpt.io.commit as commit_mod

    real = commit_mod.temporary_dir_for
    commit_mod.temporary_dir_for = lambda final_dir, token: blocker / real(final_dir, token).name

    def undo() -> None:
        commit_mod.temporary_dir_for = real

    return undo


# ----------------------------------------------------------------------------- scenario: save / load / refuse
def _rank_save_load(rank: int, world_size: int, root: str, persistent: bool) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from asyncckpt import AsyncCallsQueue, CheckpointError, CheckpointException, CorruptCheckpointError

    root_p = Path(root)
    out: dict[str, Any] = {"diffs": []}
    queue = AsyncCallsQueue(persistent=persistent)
    try:
        state = _rank_state(rank)
        expected = _clone(state)

        # Synchronous and asynchronous saves of the same state; mutate after the async one.
        handle = asyncckpt.save(state, root_p / "sync", async_op=False, calls_queue=queue)
        out["sync_done"] = handle.done()
        handle = asyncckpt.save(state, root_p / "async", async_op=True, calls_queue=queue)
        state[f"rank{rank}"].add_(1)
        state["shared"].zero_()
        state["nested"][f"r{rank}"].append("late")
        state["step"] = 8
        timings = handle.wait(timeout=30)
        out["timings"] = tuple(timings)
        out["checkpoint_dir"] = str(handle.checkpoint_dir)
        dist.barrier()

        for name in ("sync", "async"):
            path = root_p / name
            # Stock DCP on the same process group reads every rank's part.
            got = _fresh(expected)
            dcp.load(got, checkpoint_id=str(path))
            out["diffs"].append(_diff(expected, got, f"{name}/dcp.load"))
            # The other rank's private entry is in the same checkpoint.
            other = 1 - rank
            got_other = {f"rank{other}": torch.zeros(1000)}
            dcp.load(got_other, checkpoint_id=str(path))
            out["diffs"].append(
                _diff(
                    {f"rank{other}": torch.arange(1000, dtype=torch.float32) + 1000 * other},
                    got_other,
                    f"{name}/other rank",
                )
            )
            # asyncckpt.load (verifies first, each rank a share of the files).
            got = _fresh(expected)
            asyncckpt.load(got, path)
            out["diffs"].append(_diff(expected, got, f"{name}/asyncckpt.load"))

        # A corrupt file that only rank 1 verifies (files are split by rank in sorted
        # order: rank 0 checks .metadata and __1_0.distcp): load fails on both ranks.
        asyncckpt.save(state, root_p / "corrupt", async_op=False, calls_queue=queue)
        dist.barrier()
        if rank == 0:
            victim = root_p / "corrupt" / "__0_0.distcp"
            content = bytearray(victim.read_bytes())
            content[len(content) // 2] ^= 0x40
            victim.write_bytes(bytes(content))
        dist.barrier()
        try:
            asyncckpt.load(_fresh(expected), root_p / "corrupt")
            out["corrupt"] = None
        except CorruptCheckpointError as exc:
            out["corrupt"] = str(exc)

        # Rank 1 as the coordinator (writes .metadata and the manifest, commits).
        handle = asyncckpt.save(state, root_p / "coord1", async_op=True, calls_queue=queue, coordinator_rank=1)
        handle.wait(timeout=30)
        out["coord1_committed"] = handle.done() and handle.exception() is None

        # Rank 1 cannot save its input: both ranks refuse, naming rank 1, before writing.
        bad = _rank_state(rank)
        if rank == 1:
            bad["bad"] = {"w": torch.eye(3).to_sparse()}
        out["bad_msgs"] = []
        for async_op in (False, True):
            try:
                asyncckpt.save(bad, root_p / f"bad_{async_op}", async_op=async_op, calls_queue=queue)
                out["bad_msgs"].append(None)
            except CheckpointError as exc:
                out["bad_msgs"].append(f"{type(exc).__name__}: {exc}")
            except CheckpointException as exc:
                out["bad_msgs"].append(f"WRONG {type(exc).__name__}: {exc}")

        # A non-empty target (seen by the coordinator only) is refused on both ranks.
        try:
            asyncckpt.save(state, root_p / "occupied", async_op=True, calls_queue=queue)
            out["occupied"] = None
        except CheckpointError as exc:
            out["occupied"] = str(exc)
        out["unfinalized"] = queue.get_num_unfinalized_calls()
    finally:
        queue.close()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("caller", CALLERS)
def test_two_ranks_save_load_and_refuse(tmp_path: Path, caller: str) -> None:
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep").write_text("x")

    results = run_ranks(
        _rank_save_load, WORLD, str(tmp_path), caller == "persistent", timeout=50, start_method="forkserver"
    )

    for rank, res in enumerate(results):
        assert [d for d in res["diffs"] if d] == [], f"rank {rank}"
        assert res["sync_done"]
        assert res["checkpoint_dir"] == str((tmp_path / "async").absolute())
        assert res["unfinalized"] == 0
        assert res["coord1_committed"]
        assert res["corrupt"] is not None and "__0_0.distcp" in res["corrupt"], res["corrupt"]
    assert results[0]["corrupt"] == results[1]["corrupt"]
    # Same timings object on both ranks' view: bytes of all ranks, the slowest write.
    t0 = asyncckpt.SaveTimings(*results[0]["timings"])
    assert t0.bytes > 0 and t0.write_s > 0
    assert results[0]["timings"][4] == results[1]["timings"][4]

    for name in ("sync", "async", "coord1"):
        ckpt = tmp_path / name
        names = sorted(p.name for p in ckpt.iterdir())
        assert names == sorted([".manifest.json", ".metadata", ".records.json", "__0_0.distcp", "__1_0.distcp"])
        manifest = asyncckpt.verify(ckpt)
        assert set(manifest["files"]) == {".metadata", ".records.json", "__0_0.distcp", "__1_0.distcp"}
        assert manifest["world_size"] == WORLD
        for fname, entry in manifest["files"].items():
            assert (ckpt / fname).stat().st_size == entry["size"]
        if name == "async":
            assert t0.bytes == sum(manifest["files"][f]["size"] for f in ("__0_0.distcp", "__1_0.distcp"))
        # Read back in one process, without any process group: everything of both ranks.
        if name == "coord1":
            continue  # saved after the mutations: the files and manifest are what matters here
        dcp_to_torch_save(str(ckpt), str(tmp_path / f"{name}.pt"))
        merged = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        expected = _clone(_rank_state(0))
        expected.update({k: v for k, v in _rank_state(1).items() if k not in ("nested",)})
        expected["nested"]["r1"] = [1, "text", None]
        assert _diff(expected, merged) is None, _diff(expected, merged)

    # No temporary directory left over, nothing written for the refused saves.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "async",
        "async.pt",
        "coord1",
        "corrupt",
        "occupied",
        "sync",
        "sync.pt",
    ]
    assert sorted(p.name for p in occupied.iterdir()) == ["keep"]

    msgs = [res["bad_msgs"] for res in results]
    assert msgs[0] == msgs[1], "both ranks must raise the same error"
    for msg in msgs[0]:
        assert msg is not None and msg.startswith("CheckpointError"), msg
        assert "rank 1" in msg and "state_dict['bad']['w']" in msg and "sparse" in msg, msg
        assert "rank 0:" not in msg, msg
    assert results[0]["occupied"] is not None and results[0]["occupied"] == results[1]["occupied"]
    assert "occupied" in results[0]["occupied"]


# ----------------------------------------------------------------------------- scenario: manager
def _rank_manager(rank: int, world_size: int, root: str, persistent: bool, blocker: str) -> dict[str, Any]:
    import torch.distributed as dist

    from asyncckpt import CheckpointException, CheckpointManager

    out: dict[str, Any] = {"diffs": [], "committed": []}
    manager = CheckpointManager(root, keep_last=2, persistent=persistent)
    try:
        state: dict[str, Any] = {
            f"rank{rank}": torch.zeros(1 << 16),
            "shared": torch.zeros(10, dtype=torch.float64),
            "meta": {"step": 0},
        }
        expected: dict[int, Any] = {}

        def set_step(step: int) -> None:
            state[f"rank{rank}"].fill_(step * 10 + rank)
            state["shared"].fill_(step)
            state["meta"]["step"] = step

        for step in (1, 2, 3):
            set_step(step)
            manager.save(step, state, async_op=True)
            expected[step] = _clone(state)
            state[f"rank{rank}"].add_(0.5)  # mutate while in flight
            out["committed"] += manager.maybe_finalize()  # non-blocking, collective
        out["committed"] += manager.maybe_finalize(blocking=True)
        out["steps"] = manager.steps()
        out["latest"] = manager.latest_step()
        got = _fresh(expected[3])
        out["loaded"] = manager.load(got)
        out["diffs"].append(_diff(expected[3], got, "latest"))
        got = _fresh(expected[2])
        manager.load(got, step=2)
        out["diffs"].append(_diff(expected[2], got, "step 2"))
        dist.barrier()
        out["latest_file"] = (Path(root) / "latest").read_text()

        # A write that fails on rank 1 only: the same exception on both ranks, nothing committed.
        set_step(4)
        undo = _patch_tmp_dir_into(Path(blocker)) if rank == 1 else (lambda: None)
        try:
            handle = manager.save(4, state, async_op=True)
            try:
                manager.maybe_finalize(blocking=True)
                out["async_failure"] = None
            except CheckpointException as exc:
                out["async_failure"] = (exc.call_idx == handle.call_idx, sorted(exc.failures), str(exc))
            out["handle_exc"] = type(handle.exception()).__name__
            try:
                manager.save(5, state, async_op=False)
                out["sync_failure"] = None
            except CheckpointException as exc:
                out["sync_failure"] = (sorted(exc.failures), str(exc))
        finally:
            undo()
        dist.barrier()
        out["steps_after_failure"] = manager.steps()
        out["latest_after_failure"] = manager.latest_step()
        out["latest_file_after_failure"] = (Path(root) / "latest").read_text()

        # Recovery: the next save commits on both ranks; retention applies.
        set_step(6)
        expected[6] = _clone(state)
        manager.save(6, state, async_op=True)
        out["committed"] += manager.maybe_finalize(blocking=True)
        out["final_steps"] = manager.steps()
        got = _fresh(expected[6])
        out["final_loaded"] = manager.load(got)
        out["diffs"].append(_diff(expected[6], got, "after recovery"))
    finally:
        manager.close()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("caller", CALLERS)
def test_two_ranks_manager_and_one_rank_failure(tmp_path: Path, caller: str) -> None:
    root = tmp_path / "root"
    blocker = tmp_path / "blocker"
    blocker.write_text("a regular file: rank 1's data directory cannot be created under it")

    results = run_ranks(
        _rank_manager, WORLD, str(root), caller == "persistent", str(blocker), timeout=50, start_method="forkserver"
    )

    for rank, res in enumerate(results):
        assert [d for d in res["diffs"] if d] == [], f"rank {rank}"
        assert res["committed"] == [1, 2, 3, 6], f"rank {rank}"
        assert res["steps"] == [2, 3] and res["latest"] == 3 and res["loaded"] == 3
        assert res["latest_file"].strip() == "step_00000003"

        ok_idx, failing_ranks, text = res["async_failure"]
        assert ok_idx and failing_ranks == [1], text
        assert "NotADirectoryError" in text
        assert res["handle_exc"] == "CheckpointException"
        failing_ranks, text = res["sync_failure"]
        assert failing_ranks == [1] and "NotADirectoryError" in text

        assert res["steps_after_failure"] == [2, 3]
        assert res["latest_after_failure"] == 3
        assert res["latest_file_after_failure"] == res["latest_file"]
        assert res["final_steps"] == [3, 6] and res["final_loaded"] == 6
    assert results[0]["async_failure"] == results[1]["async_failure"]
    assert results[0]["sync_failure"] == results[1]["sync_failure"]

    # From outside (one process, no group): the committed steps verify and read.
    for step in (3, 6):
        ckpt = root / f"step_{step:08d}"
        manifest = asyncckpt.verify(ckpt)
        assert set(manifest["files"]) == {".metadata", ".records.json", "__0_0.distcp", "__1_0.distcp"}
        assert manifest["step"] == step and manifest["world_size"] == WORLD
    dcp_to_torch_save(str(root / "step_00000006"), str(tmp_path / "s6.pt"))
    merged = torch.load(tmp_path / "s6.pt", weights_only=False)
    assert torch.equal(merged["rank0"], torch.full((1 << 16,), 60.0))
    assert torch.equal(merged["rank1"], torch.full((1 << 16,), 61.0))
    assert torch.equal(merged["shared"], torch.full((10,), 6.0, dtype=torch.float64))
    assert merged["meta"] == {"step": 6}
    assert json.loads((root / "step_00000006" / ".manifest.json").read_text())["step"] == 6
    # The failed steps are not checkpoints (only hidden leftovers may remain).
    assert not (root / "step_00000004").exists() and not (root / "step_00000005").exists()
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "latest",
        "step_00000003",
        "step_00000006",
    ]


def _rank_gloo_cache(rank: int, world_size: int, init_method: str) -> dict[str, Any]:
    import torch.distributed as dist

    from asyncckpt import dist as ack_dist
    from asyncckpt.dist import SyncGroup

    first = SyncGroup()
    assert first.all_gather_ints([rank]) == [[0], [1]]
    cached_before = len(ack_dist._gloo_groups)
    dist.destroy_process_group()
    # A second process group in the same process (as a test suite or an elastic
    # restart does): the first one's cached gloo group is forgotten, not kept.
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    second = SyncGroup()
    assert second.all_gather_object(f"r{rank}") == ["r0", "r1"]
    cached_after = [g for _, g in ack_dist._gloo_groups.values()]
    ack_dist._release_gloo_groups()  # what runs at exit, before interpreter finalization
    return {
        "before": cached_before,
        "after": len(cached_after),
        "current": cached_after == [second.gloo],
        "released": len(ack_dist._gloo_groups),
    }


def test_gloo_groups_of_destroyed_process_groups_are_not_kept(tmp_path: Path) -> None:
    """The dedicated gloo groups of destroyed process groups are dropped, and all of them at
    exit: left to interpreter finalization, a gloo group's destructor now and then aborted a
    successful run ("terminate called without an active exception", exit -6)."""
    for result in run_ranks(_rank_gloo_cache, 2, f"file://{tmp_path / 'second-store'}", start_method="forkserver"):
        assert result == {"before": 1, "after": 1, "current": True, "released": 0}
