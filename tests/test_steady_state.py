"""The steady state: a save of a state with the previous save's structure reuses the plan.

Issue #11, items 1-2. :class:`asyncckpt.saving.planning.PlanCache` keys the plan on the
state's structure (:func:`asyncckpt.saving.planning.structure_signature`); every kind of
change must re-plan, and every checkpoint, planned or cached, must load back equal.
Each case saves for real (a persistent worker, real files) and loads with asyncckpt
and with stock ``dcp.load``. The observable: how many saves DCP's planner planned
(``DefaultSavePlanner.create_local_plan`` calls, counted, not replaced); a save that
reuses the cached plan does not call it.
"""

from __future__ import annotations

import collections
import json
import math
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_sharded import _compare, _fsdp, _local, _map_tensors, _train

import asyncckpt

from dist_utils import preload_forkserver, run_ranks
from helpers import count_calls, count_plans, counting_calls, counting_plans, observing_loads

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


class _Counter:
    """A ``Stateful`` whose state_dict's structure depends on ``n``."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {f"t{i}": torch.full((2,), float(i)) for i in range(self.n)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loaded = sd


def _base() -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(12.0).view(3, 4), "b": torch.ones(4)},
        "optim": {
            "state": {"0": {"step": torch.tensor(3.0), "m": torch.zeros(3, 4)}},
            "groups": [{"lr": 0.1, "params": ["0"]}],
        },
        "list": [torch.ones(2), torch.zeros(2)],
        "step": 7,
    }


def _empty_like(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.full_like(state, -1)
    if isinstance(state, dict):
        return {k: _empty_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_empty_like(v) for v in state]
    return None


def _assert_loads_equal(path: Path, state: dict[str, Any]) -> None:
    for loader in ("asyncckpt", "dcp"):
        out = _empty_like(state)
        if loader == "asyncckpt":
            asyncckpt.load(out, path)
        else:
            dcp.load(out, checkpoint_id=str(path))
        cmp = _compare(state, out)
        assert cmp["mismatch"] == [], (loader, cmp)


# Each change: a function of the base state -> the changed state.
CHANGES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "key added": lambda s: {**s, "extra": torch.ones(1)},
    "key removed": lambda s: {k: v for k, v in s.items() if k != "list"},
    "key renamed": lambda s: {**{k: v for k, v in s.items() if k != "step"}, "steps": 7},
    "nested key renamed": lambda s: {**s, "model": {"w": s["model"]["w"], "bias": s["model"]["b"]}},
    "dtype": lambda s: {**s, "model": {**s["model"], "b": s["model"]["b"].double()}},
    "shape": lambda s: {**s, "model": {**s["model"], "w": s["model"]["w"].reshape(4, 3)}},
    "same numel, other rank": lambda s: {**s, "model": {**s["model"], "w": s["model"]["w"].reshape(12)}},
    "value becomes tensor": lambda s: {**s, "step": torch.tensor(7)},
    "tensor becomes value": lambda s: {**s, "model": {**s["model"], "b": 1.5}},
    "list grows": lambda s: {**s, "list": s["list"] + [torch.ones(3)]},
    "list becomes dict": lambda s: {**s, "list": {"0": s["list"][0], "1": s["list"][1]}},
    "key order": lambda s: dict(reversed(list(s.items()))),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_every_kind_of_change_replans_and_loads_back(tmp_path: Path, change: str) -> None:
    base = _base()
    changed = CHANGES[change](_base())
    with asyncckpt.CheckpointManager(tmp_path / "root") as mgr, counting_plans() as plans:
        mgr.save(1, base).wait()
        mgr.save(2, base).wait()
        assert plans.n == 1  # unchanged: the plan is reused
        mgr.save(3, changed).wait()
        assert plans.n == 2, f"{change}: the changed state reused the old plan"
        mgr.save(4, changed).wait()
        assert plans.n == 2  # and the new structure is cached in turn
        mgr.save(5, base).wait()
        assert plans.n == 3
    for step, state in ((1, base), (2, base), (3, changed), (4, changed), (5, base)):
        _assert_loads_equal(tmp_path / "root" / f"step_{step:08d}", state)


@pytest.mark.timeout(120)
def test_stateful_structure_change_replans(tmp_path: Path) -> None:
    counter = _Counter(2)
    with asyncckpt.CheckpointManager(tmp_path / "root") as mgr, counting_plans() as plans:
        mgr.save(1, {"c": counter, "x": torch.ones(2)}).wait()
        mgr.save(2, {"c": counter, "x": torch.ones(2)}).wait()
        assert plans.n == 1
        counter.n = 3
        mgr.save(3, {"c": counter, "x": torch.ones(2)}).wait()
        assert plans.n == 2
    target = _Counter(3)
    asyncckpt.load({"c": target, "x": torch.zeros(2)}, tmp_path / "root" / "step_00000003")
    assert target.loaded is not None and sorted(target.loaded) == ["t0", "t1", "t2"]
    assert torch.equal(target.loaded["t2"], torch.full((2,), 2.0))


@pytest.mark.timeout(120)
def test_cached_plan_repickles_values_and_keeps_snapshot_semantics(tmp_path: Path) -> None:
    """On a hit, non-tensor values are pickled afresh (their sizes may change), and the
    checkpoint holds the values as of save(), however the state changes afterwards."""
    state = _base()
    with asyncckpt.CheckpointManager(tmp_path / "root") as mgr, counting_plans() as plans:
        mgr.save(1, state).wait()
        expected = {}
        for step, value in ((2, 8), (3, "a much longer value " * 100), (4, ("a", "tuple", 3))):
            state["step"] = value
            state["optim"]["groups"][0]["lr"] = step / 10
            state["model"]["w"].add_(1.0)
            expected[step] = _map_tensors(state, lambda t: t.clone())
            handle = mgr.save(step, state)
            state["model"]["w"].mul_(-3.0)  # after save() returned: not in the checkpoint
            state["list"][0].fill_(float(step))
            handle.wait()
        assert plans.n == 1  # saves 2-4 reused the plan
    for step, snap in expected.items():
        path = tmp_path / "root" / f"step_{step:08d}"
        out = _empty_like(snap)
        asyncckpt.load(out, path)
        assert _compare(snap, out)["mismatch"] == [], step
        got = asyncckpt.read_state_dict(path)
        assert got["step"] == snap["step"] and got["optim"]["groups"][0]["lr"] == step / 10


@pytest.mark.timeout(120)
def test_unchanged_plain_values_reuse_their_bytes_and_every_change_is_saved(tmp_path: Path) -> None:
    """A cached plan's plain non-tensor values equal to the last save's reuse its bytes
    (``PlanCache.pickled``); every change is saved, also one that ``==`` misses (``1``
    to ``1.0``, ``True`` to ``1``, ``0.0`` to ``-0.0``) or made in place. Observed: the
    ``torch.save`` calls of the training thread (one per non-tensor value pickled afresh)."""
    from asyncckpt.saving.planning import plain_key

    state = _base()
    group = state["optim"]["groups"][0]
    group.update({"betas": (0.9, 0.95), "eps": 0.0, "flag": True, "lr": 1})
    changes: list[tuple[str, Callable[[], None]]] = [
        ("lr int to float", lambda: group.update(lr=1.0)),
        ("flag True to 1", lambda: group.update(flag=1)),
        ("eps 0.0 to -0.0", lambda: group.update(eps=-0.0)),
        ("betas by one ulp", lambda: group.update(betas=(0.9, math.nextafter(0.95, 1.0)))),
        ("params entry replaced in place", lambda: group["params"].__setitem__(0, "renamed")),
    ]

    def saved(step: int) -> int:  # how many values the save pickled afresh
        with counting_calls(torch, "save", this_thread=True) as pickled:
            mgr.save(step, state).wait()
        return pickled.n

    with asyncckpt.CheckpointManager(tmp_path / "root") as mgr, counting_plans() as plans:
        mgr.save(1, state).wait()  # planned
        n_items = saved(2)  # cached plan: the values' bytes remembered
        assert plans.n == 1 and n_items >= 6  # step and the group's values
        assert saved(3) == 0  # nothing changed: every plain value reused
        for step, (name, change) in enumerate(changes, start=4):
            before = plain_key(group)
            change()
            assert plain_key(group) != before, name
            assert saved(step) == 1, name  # the others reused
            got = asyncckpt.read_state_dict(tmp_path / "root" / f"step_{step:08d}")["optim"]["groups"][0]
            for key, value in group.items():
                assert type(got[key]) is type(value) and plain_key(got[key]) == plain_key(value), (name, key)
        assert plans.n == 1
    out = _empty_like(state)
    out["optim"]["groups"][0] = {k: None for k in group}
    dcp.load(out, checkpoint_id=str(tmp_path / "root" / f"step_{3 + len(changes):08d}"))
    assert plain_key(out["optim"]["groups"][0]) == plain_key(group)


def test_plain_key_is_exact_about_types_and_refuses_what_it_cannot_see() -> None:
    from asyncckpt.saving.planning import plain_key

    values = [
        1,
        1.0,
        True,
        0.0,
        -0.0,
        float("nan"),
        "1",
        b"1",
        None,
        (1,),
        [1],
        {"a": 1},
        {"a": 1.0},
        [[1], [1]],
        1 + 0j,
    ]
    keys = [plain_key(v) for v in values]
    assert all(k is not None for k in keys)
    assert len(set(keys)) == len(values)  # no two of them alike
    shared = [1]
    assert plain_key([shared, shared]) != plain_key([[1], [1]])  # sharing is seen too
    for opaque in (torch.ones(2), {"t": torch.ones(2)}, object(), collections.OrderedDict(a=1), range(3)):
        assert plain_key(opaque) is None
    assert plain_key(list(range(100))) is not None
    assert plain_key(list(range(100)), max_elements=50) is None


def test_structure_signature_is_exact_and_validates() -> None:
    from asyncckpt.errors import CheckpointError
    from asyncckpt.saving.planning import structure_signature

    base = _base()
    sig = structure_signature(base)
    assert sig is not None and structure_signature(_base()) == sig
    for name, change in CHANGES.items():
        assert structure_signature(change(_base())) != sig, name
    # Non-contiguous tensors are accepted and cached; their values do not matter.
    t = torch.arange(6.0).view(2, 3).t()
    assert structure_signature({"t": t}) == structure_signature({"t": t + 1})
    # int keys (an optimizer's state) are accepted, and differ from their str.
    assert structure_signature({"s": {0: t}}) != structure_signature({"s": {"0": t}})
    # What validate_state_dict refuses, the signature refuses with the same message.
    for bad, words in (
        ({1.5: torch.ones(1)}, "keys must be str or int"),
        ({0: 1, "0": 2}, "would both be stored"),
        ({"m": torch.ones(2, device="meta")}, "meta"),
        ({"s": torch.ones(2).to_sparse()}, "sparse"),
    ):
        with pytest.raises(CheckpointError, match=words):
            structure_signature(bad)
    cyc: dict[str, Any] = {"a": {}}
    cyc["a"]["b"] = cyc["a"]
    with pytest.raises(CheckpointError, match="cycle"):
        structure_signature(cyc)


# ----------------------------------------------------------------------------- FSDP2 / DTensor, 2 ranks
def _rank_fsdp_cached(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    torch.set_num_threads(1)
    root_p = Path(root)
    model, optim = _fsdp(rank, 1)
    out: dict[str, Any] = {"plans": [], "diffs": {}}
    mgr = asyncckpt.CheckpointManager(root_p / "fsdp")
    ok = False
    with counting_plans() as plans:
        try:
            for step in (1, 2, 3):
                msd, osd = get_state_dict(model, optim)
                state = {"model": msd, "optim": osd, "step": step}
                snapshot = _map_tensors(state, lambda t: _local(t).detach().clone())
                handle = mgr.save(step, state)
                _train(model, optim, 1, rank)  # mutate while the write is in flight
                handle.wait(timeout=60)
                out["plans"].append(plans.n)
                dist.barrier()
                got = _map_tensors(state, torch.zeros_like)
                dcp.load(got, checkpoint_id=str(mgr.step_dir(step)))
                out["diffs"][("dcp", step)] = _compare(snapshot, _map_tensors(got, _local))
                got = _map_tensors(state, torch.zeros_like)
                asyncckpt.load(got, mgr.step_dir(step))
                out["diffs"][("ours", step)] = _compare(snapshot, _map_tensors(got, _local))
            # A changed sharding of the same global tensor: re-planned.
            mesh = init_device_mesh("cpu", (world_size,))
            full = torch.arange(24.0).view(4, 6)
            for step, placement in ((4, Shard(0)), (5, Shard(0)), (6, Shard(1)), (7, Replicate())):
                state = {"w": distribute_tensor(full, mesh, [placement])}
                mgr.save(step, state).wait(timeout=60)
                out["plans"].append(plans.n)
                dist.barrier()
                got = {"w": distribute_tensor(torch.zeros(4, 6), mesh, [Shard(0)])}
                dcp.load(got, checkpoint_id=str(mgr.step_dir(step)))
                out["diffs"][("reshard", step)] = _compare({"w": full}, {"w": got["w"].full_tensor()})
            mgr.close()
            ok = True
        finally:
            if not ok:
                mgr.close(abort=True)
        return out


@pytest.mark.timeout(180)
def test_fsdp2_second_save_hits_the_cache_on_every_rank(tmp_path: Path) -> None:
    preload_forkserver()
    results = run_ranks(_rank_fsdp_cached, 2, str(tmp_path), timeout=150, start_method="forkserver")
    for res in results:
        # FSDP2 saves 1-3: planned once, then cached; sharding: Shard(0) planned, then
        # cached, Shard(1) and Replicate planned afresh.
        assert res["plans"] == [1, 1, 1, 2, 2, 3, 4], res["plans"]
        for key, cmp in res["diffs"].items():
            assert cmp["tensors"] > 0 and cmp["mismatch"] == [], (key, cmp)


def test_metadata_bytes_are_reused_and_exact(tmp_path: Path) -> None:
    """Issue #11 item 4: a steady save's ``.metadata`` is the cached pickle with only the
    checkpoint path and save id written over: the same bytes ``pickle.dumps`` gives, the
    right ``storage_meta``, loadable by stock ``dcp.load``; its records file, reused as
    well, names the CRC-32 of each step's own ``.metadata`` and is what ``load`` plans from."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    state: dict[str, Any] = {
        "layers": [{"w": torch.full((64,), float(i)), "b": torch.zeros(3)} for i in range(200)],
        "step": 0,
    }
    with (
        asyncckpt.CheckpointManager(tmp_path) as mgr,
        counting_calls(pickle, "dumps", when=lambda obj, *a, **k: isinstance(obj, Metadata)) as pickled,
    ):
        for step in range(1, 4):
            state["step"] = step
            state["layers"][0]["w"].fill_(step)
            mgr.save(step, state)
        mgr.maybe_finalize(blocking=True)
    assert pickled.n == 1  # the first commit's .metadata; the next two reuse its bytes
    save_ids = set()
    files_part: set[str] = set()
    for step in range(1, 4):
        ckpt = tmp_path / f"step_{step:08d}"
        data = (ckpt / ".metadata").read_bytes()
        metadata = pickle.loads(data)
        assert pickle.dumps(metadata) == data
        assert metadata.storage_meta.checkpoint_id == str(ckpt)
        save_ids.add(metadata.storage_meta.save_id)
        asyncckpt.verify(ckpt)
        got: dict[str, Any] = {"layers": [{"w": torch.zeros(64), "b": torch.ones(3)} for _ in range(200)], "step": 0}
        dcp.load(got, checkpoint_id=str(ckpt))
        assert got["step"] == step and float(got["layers"][0]["w"][0]) == step
        # The records file, reused with the cache, stands for this step's own .metadata.
        records = json.loads((ckpt / ".records.json").read_bytes())
        assert records["metadata_crc32"] == zlib.crc32(data)
        files_part.add(json.dumps(records["files"]))
        got = {"layers": [{"w": torch.zeros(64), "b": torch.ones(3)} for _ in range(200)], "step": 0}
        with observing_loads() as loads:
            asyncckpt.load(got, ckpt)
        assert (loads.direct, loads.records) == (1, 1)
        assert got["step"] == step and float(got["layers"][0]["w"][0]) == step
    assert len(save_ids) == 3
    assert len(files_part) == 1  # the same layout every step


# ----------------------------------------------------------------------------- one collective, 2 ranks
def _rank_collectives(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Saves of one manager, recording the collectives the training thread calls in each
    ``save()`` (the ``SyncGroup`` methods, observed, not replaced)."""
    import threading

    from asyncckpt import CheckpointError
    from asyncckpt.dist import SyncGroup

    calls: list[str] = []
    main = threading.current_thread()
    for name in ("all_gather_ints", "all_gather_object", "gather_failures", "broadcast_object"):
        orig = getattr(SyncGroup, name)

        def spy(self: Any, *args: Any, _orig: Any = orig, _name: str = name, **kwargs: Any) -> Any:
            if threading.current_thread() is main:
                calls.append(_name)
            return _orig(self, *args, **kwargs)

        setattr(SyncGroup, name, spy)
    out: dict[str, Any] = {"calls": {}, "plans": {}, "error": None, "mismatch": {}}
    mgr = asyncckpt.CheckpointManager(Path(root) / "m")
    plans = count_plans()  # in this rank's process, left on

    def save(step: int, state: dict[str, Any]) -> None:
        calls.clear()
        try:
            handle = mgr.save(step, state)
        finally:
            out["calls"][step] = list(calls)
        handle.wait(timeout=60)
        out["plans"][step] = plans.n
        _assert_loads_equal(mgr.step_dir(step), state)

    def base(own: Any = 1) -> dict[str, Any]:  # a value only this rank has: this rank writes it
        return {**_base(), f"own{rank}": own}

    try:
        save(1, base())  # planned
        save(2, base())  # the steady state
        try:  # the same structure; on one rank a value that cannot be pickled
            save(3, base(threading.Lock() if rank == 1 else 1))
        except CheckpointError as exc:
            out["error"] = str(exc)
        save(4, base())  # still cached
        changed = base()
        if rank == 1:  # a structure change on one rank: every rank re-plans
            changed["extra"] = torch.ones(3)
        save(5, changed)
        save(6, changed)
    finally:
        mgr.close()
    return out


@pytest.mark.timeout(180)
def test_a_steady_save_plans_with_one_collective_and_keeps_the_error_funnel(tmp_path: Path) -> None:
    """With every rank's structure unchanged, planning costs one int64 all_gather (each
    rank resolves and lays out its data before it); a value that cannot be pickled on
    one rank still fails the save on every rank, and a change on one rank re-plans on
    every rank."""
    results = run_ranks(_rank_collectives, 2, str(tmp_path), timeout=150, start_method="forkserver")
    for res in results:
        assert res["calls"][2] == ["all_gather_ints"], res["calls"]
        assert res["calls"][4] == ["all_gather_ints"] and res["calls"][6] == ["all_gather_ints"], res["calls"]
        assert "all_gather_object" in res["calls"][1] and "all_gather_object" in res["calls"][5], res["calls"]
        assert res["plans"] == {1: 1, 2: 1, 4: 1, 5: 2, 6: 2}, res["plans"]
        assert res["error"] is not None and "cannot be pickled" in res["error"] and "rank 1" in res["error"], res


# ----------------------------------------------------------------------------- the commit's layout exchange, 2 ranks
def _rank_layout_exchange(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Saves of one manager on 2 ranks: which commits sent only a layout token, what
    each step's ``.metadata`` holds, and a coordinator that lost the layouts it held
    (the fault, injected by clearing them on rank 0)."""
    import pickle

    import torch.distributed as dist

    from asyncckpt import CheckpointException
    from asyncckpt.dist import SyncGroup
    from asyncckpt.testing import lose_held_layouts

    def token_only(_group: Any, obj: Any, *args: Any, **kwargs: Any) -> bool:
        """A commit's gather of this rank's ``((layout token, layout or None), result)``
        that carries the token only."""
        return (
            isinstance(obj, tuple)
            and len(obj) == 2
            and isinstance(obj[0], tuple)
            and len(obj[0]) == 2
            and isinstance(obj[0][0], int)
            and obj[0][1] is None
        )

    sent = count_calls(SyncGroup, "all_gather_object", when=token_only)  # in this rank's process, left on
    mgr = asyncckpt.CheckpointManager(Path(root) / "x")
    out: dict[str, Any] = {"token_only": {}, "failure": None, "storage_data": {}, "step4": None}

    def save(step: int, state: dict[str, Any]) -> None:
        mgr.save(step, state)
        try:
            mgr.maybe_finalize(blocking=True)
        except CheckpointException as exc:
            out["failure"] = (step, sorted(exc.failures), str(exc))
            return
        out["token_only"][step] = sent.n
        _assert_loads_equal(mgr.step_dir(step), state)
        metadata = pickle.loads((mgr.step_dir(step) / ".metadata").read_bytes())
        out["storage_data"][step] = {
            (i.fqn, i.offset and tuple(i.offset)): (s.relative_path, s.offset, s.length)
            for i, s in metadata.storage_data.items()
        }

    try:
        state = {**_base(), f"own{rank}": torch.full((5,), float(rank))}
        for step in (1, 2, 3):
            state[f"own{rank}"].add_(1)
            save(step, state)
        if rank == 0:
            lose_held_layouts(mgr)  # the fault: the coordinator no longer holds any layout
        save(4, state)
        dist.barrier()
        out["step4"] = mgr.step_dir(4).exists()
        save(5, state)
        save(6, state)
        changed = {**state, "extra": torch.ones(2)}  # a new plan, so a new layout, on every rank
        save(7, changed)
        save(8, changed)
    finally:
        mgr.close()
    return out


@pytest.mark.timeout(180)
def test_a_commit_sends_an_unchanged_layout_once(tmp_path: Path) -> None:
    """Issue #11 (FSDP2 stall): a rank sends its file layout to the coordinator once,
    then only its token while the layout is unchanged; every step's ``.metadata``
    still lists both ranks' records, loadable by both loaders. A coordinator that does
    not hold a layout fails that commit on every rank, naming the rank, commits
    nothing, and the next save sends the layouts again."""
    results = run_ranks(_rank_layout_exchange, 2, str(tmp_path), timeout=150, start_method="forkserver")
    for res in results:
        # Full sends at steps 1, 5 (after the failure) and 7 (new layout); tokens else.
        assert res["token_only"] == {1: 0, 2: 1, 3: 2, 5: 3, 6: 4, 7: 4, 8: 5}, res["token_only"]
        step, failed_ranks, message = res["failure"]
        assert step == 4 and failed_ranks == [0], res["failure"]
        assert "does not hold rank 0's file layout" in message, message
        assert res["step4"] is False
        sd = res["storage_data"]
        for step in (1, 2, 3, 5, 6, 7, 8):
            assert {fqn for fqn, _ in sd[step]} >= {"own0", "own1", "model.w", "step"}, sd[step]
        assert sd[1] == sd[2] == sd[3] == sd[5] == sd[6], "an unchanged layout"
        assert sd[7] == sd[8] and {fqn for fqn, _ in sd[7]} == {fqn for fqn, _ in sd[1]} | {"extra"}
    assert results[0]["storage_data"] == results[1]["storage_data"]
