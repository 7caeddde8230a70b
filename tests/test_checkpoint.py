"""The checkpoint layer in one process: save / load / verify / SaveHandle / CheckpointManager.

Real files in ``tmp_path``, real ``torch.distributed.checkpoint`` for interop, and both
background callers: ``AsyncCallsQueue(persistent=False)`` (a forked child per call) and
``persistent=True`` (one spawned worker). Every queue and manager is closed in a
``finally`` so that the autouse ``no_leaks`` fixture sees no child process.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import asyncckpt
import asyncckpt.io.commit as commit_mod
from asyncckpt import (
    AsyncCallsQueue,
    CheckpointError,
    CheckpointException,
    CheckpointManager,
    CorruptCheckpointError,
    SaveHandle,
    SaveTimings,
    testing,
)

from helpers import assert_same, clone_state, closing_queue, counting_plans

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CALLERS = ["temporal", "persistent"]


# ----------------------------------------------------------------------------- helpers
_PLACEHOLDER = "<not loaded>"


def fresh_like(sd: Any) -> Any:
    """A structure to load into: zero tensors of the same dtype/shape, placeholders elsewhere."""
    if isinstance(sd, torch.Tensor):
        return torch.zeros(sd.shape, dtype=sd.dtype)
    if isinstance(sd, dict):
        return {k: fresh_like(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [fresh_like(v) for v in sd]
    return _PLACEHOLDER


def make_state(seed: int = 0) -> dict[str, Any]:
    """Every kind of entry the round trip must preserve."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(6, 10, generator=g)
    shared = torch.randint(-1000, 1000, (4, 10), generator=g, dtype=torch.int64)
    return {
        "f32": torch.randn(5, 7, generator=g),
        "f16": torch.randn(33, generator=g).to(torch.float16),
        "bf16": torch.randn(3, 4, 5, generator=g).to(torch.bfloat16),
        "f64": torch.randn(4, generator=g, dtype=torch.float64),
        "i64": torch.randint(-(2**62), 2**62, (9,), generator=g, dtype=torch.int64),
        "i8": torch.randint(-128, 128, (17,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 256, (2, 9), generator=g, dtype=torch.uint8),
        "bool": torch.rand(11, generator=g) > 0.5,
        "c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "f8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
        "special": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45]),
        "scalar": torch.tensor(2.5),
        "scalar_i": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0),
        "empty3": torch.empty(2, 0, 3, dtype=torch.bfloat16),
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "base": base,
        "view_a": shared[0],
        "view_b": shared[1:, ::2],
        "nested": {
            "layer": {"w": torch.randn(3, 3, generator=g), "b": torch.zeros(3)},
            "list": [torch.randn(2, generator=g), {"x": torch.ones(1, dtype=torch.int8)}, 5, "s"],
        },
        "py": {"int": 42, "big": 2**70, "float": 0.1, "str": "héllo", "none": None, "neg": -3},
        "step": 17,
        "param": torch.nn.Parameter(torch.randn(4, generator=g)),
    }


def data_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.endswith(".distcp"))


@pytest.fixture(params=CALLERS)
def calls_queue(request: pytest.FixtureRequest) -> Iterator[AsyncCallsQueue]:
    with closing_queue(persistent=request.param == "persistent") as queue:
        yield queue


@pytest.fixture
def default_queues_closed() -> Iterator[None]:
    """Close the module-level default queues that ``save()`` without ``calls_queue`` uses."""
    try:
        yield
    finally:
        try:
            asyncckpt.default_calls_queue().close()  # as README says: commits what it has, stops the worker
        except CheckpointException:
            pass


def _save_and_commit(state: dict, path: Path, mode: str, queue: AsyncCallsQueue | None) -> SaveHandle:
    if mode == "sync":
        handle = asyncckpt.save(state, path, async_op=False, calls_queue=queue)
        assert handle.done()
    else:
        handle = asyncckpt.save(state, path, async_op=True, calls_queue=queue)
        handle.wait(timeout=30)
    return handle


# ----------------------------------------------------------------------------- round trip
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sync", "temporal", "persistent"])
def test_round_trip_bitwise(tmp_path: Path, mode: str) -> None:
    state = make_state()
    state["alias"] = state["f32"]  # the same tensor object under two keys
    expected = clone_state(state)
    queue = AsyncCallsQueue(persistent=mode == "persistent")
    try:
        _save_and_commit(state, tmp_path / "ck", mode, queue)
        assert queue.get_num_unfinalized_calls() == 0
    finally:
        queue.close()
    # The state itself was not modified by saving.
    assert_same(expected, state)

    out = fresh_like(state)
    asyncckpt.load(out, tmp_path / "ck")
    assert_same(expected, out)

    # Views sharing one storage are loaded as independent values.
    assert torch.equal(out["view_a"], expected["base"].new_tensor(expected["view_a"]))


@pytest.mark.timeout(60)
def test_sync_save_without_queue_starts_no_worker(tmp_path: Path, default_queues_closed: None) -> None:
    state = make_state(1)
    handle = asyncckpt.save(state, tmp_path / "ck")  # async_op=False, default queue
    assert handle.done() and handle.timings is not None and handle.call_idx is None
    out = fresh_like(state)
    asyncckpt.load(out, tmp_path / "ck")
    assert_same(clone_state(state), out)


@pytest.mark.timeout(60)
def test_async_save_with_default_queue(tmp_path: Path, default_queues_closed: None) -> None:
    state: dict[str, Any] = {"w": torch.randn(1000), "n": 3}
    expected = clone_state(state)
    handle = asyncckpt.save(state, tmp_path / "ck", async_op=True)
    state["w"].zero_()
    handle.wait(timeout=30)
    out = fresh_like(state)
    asyncckpt.load(out, tmp_path / "ck")
    assert_same(expected, out)


# ----------------------------------------------------------------------------- format / interop
@pytest.mark.timeout(60)
def test_committed_checkpoint_is_a_dcp_directory(tmp_path: Path, temporal_queue: AsyncCallsQueue) -> None:
    state = make_state(2)
    expected = clone_state(state)
    ckpt = tmp_path / "ck"
    handle = asyncckpt.save(state, ckpt, async_op=True, calls_queue=temporal_queue)
    handle.wait(timeout=30)

    # Only the committed directory: no temporary directory left beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == sorted([".metadata", ".records.json", ".manifest.json", "__0_0.distcp"])

    # Stock DCP reads it (default FileSystemReader via checkpoint_id).
    out = fresh_like(state)
    dcp.load(out, checkpoint_id=str(ckpt))
    assert_same(expected, out)

    # dcp_to_torch_save: the whole content, without a template.
    pt = tmp_path / "converted.pt"
    dcp_to_torch_save(str(ckpt), str(pt))
    converted = torch.load(pt, weights_only=False)
    assert_same(expected, converted)

    # The manifest: per-file sizes and CRC-32 segments covering each file.
    manifest = json.loads((ckpt / ".manifest.json").read_bytes())
    assert set(manifest["files"]) == {".metadata", ".records.json", "__0_0.distcp"}
    for name, entry in manifest["files"].items():
        content = (ckpt / name).read_bytes()
        assert entry["size"] == len(content) > 0
        pos = 0
        for offset, length, crc in entry["segments"]:
            assert offset == pos
            assert zlib.crc32(content[offset : offset + length]) == crc, (name, offset, length)
            pos = offset + length
        assert pos == len(content)
    assert manifest["total_bytes"] == sum(e["size"] for e in manifest["files"].values())
    assert manifest["world_size"] == 1

    assert asyncckpt.verify(ckpt)["files"] == manifest["files"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", ["__0_0.distcp", ".metadata"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "missing", "symlink"])
def test_verify_detects_corruption(tmp_path: Path, temporal_queue: AsyncCallsQueue, damage: str, target: str) -> None:
    state = {"w": torch.randn(1 << 19), "b": torch.arange(10), "n": 5}  # w: own 2 MB manifest segment
    ckpt = tmp_path / "ck"
    asyncckpt.save(state, ckpt, calls_queue=temporal_queue)
    asyncckpt.verify(ckpt)

    path = ckpt / target
    content = bytearray(path.read_bytes())
    if damage == "flip":
        content[len(content) // 2] ^= 0x01
        path.write_bytes(bytes(content))
    elif damage == "truncate":
        path.write_bytes(bytes(content[:-1]))
    elif damage == "symlink":  # same bytes, but not a regular file of the checkpoint
        elsewhere = tmp_path / "elsewhere"
        elsewhere.write_bytes(bytes(content))
        path.unlink()
        path.symlink_to(elsewhere)
    else:
        path.unlink()

    with pytest.raises(CorruptCheckpointError) as info:
        asyncckpt.verify(ckpt)
    assert target in str(info.value)
    assert info.value.path is not None and info.value.path.endswith(target)

    out = fresh_like(state)
    with pytest.raises(CorruptCheckpointError) as info:
        asyncckpt.load(out, ckpt, verify=True)
    assert target in str(info.value)
    assert not out["w"].any() and out["n"] == _PLACEHOLDER, "a refused load must not change the state"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", ["missing", "truncate", "outside"])
def test_verify_detects_bad_manifest(tmp_path: Path, temporal_queue: AsyncCallsQueue, damage: str) -> None:
    ckpt = tmp_path / "ck"
    asyncckpt.save({"w": torch.randn(100)}, ckpt, calls_queue=temporal_queue)
    manifest_path = ckpt / ".manifest.json"
    text = manifest_path.read_text()
    if damage == "missing":
        manifest_path.unlink()
    elif damage == "truncate":
        manifest_path.write_text(text[: len(text) // 2])
    else:  # a manifest naming a file outside the checkpoint directory
        manifest = json.loads(text)
        manifest["files"]["../outside"] = manifest["files"]["__0_0.distcp"]
        manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpointError) as info:
        asyncckpt.verify(ckpt)
    assert ".manifest.json" in str(info.value)
    with pytest.raises(CorruptCheckpointError):
        asyncckpt.load({"w": torch.zeros(100)}, ckpt)


@pytest.mark.timeout(60)
def test_load_refuses_uncommitted_directory(tmp_path: Path) -> None:
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"junk")
    for verify in (True, False):
        with pytest.raises(CheckpointError):
            asyncckpt.load({"w": torch.zeros(1)}, partial, verify=verify)


# ----------------------------------------------------------------------------- snapshot semantics
@pytest.mark.timeout(60)
def test_mutation_after_async_save_does_not_change_checkpoint(tmp_path: Path, calls_queue: AsyncCallsQueue) -> None:
    g = torch.Generator().manual_seed(3)
    state: dict[str, Any] = {
        "big": torch.randn(2 << 20, generator=g),  # 8 MB, so the write takes a while
        "m": torch.randn(256, 256, generator=g),
        "half": torch.randn(1000, generator=g).to(torch.bfloat16),
        "nested": {"t": torch.arange(100, dtype=torch.int64), "lst": [1, 2, torch.ones(3)]},
        "counter": 5,
        "name": "before",
    }
    expected = clone_state(state)
    handle = asyncckpt.save(state, tmp_path / "ck", async_op=True, calls_queue=calls_queue)

    # Mutate everything, in place, right away.
    state["big"].add_(1)
    state["m"].zero_()
    state["half"].mul_(-2)
    state["nested"]["t"].fill_(-1)
    state["nested"]["lst"].append(3)
    state["nested"]["lst"][2].add_(41)
    state["counter"] = 6
    state["name"] = "after"
    state["new"] = torch.ones(2)

    handle.wait(timeout=30)
    asyncckpt.verify(tmp_path / "ck")
    # Exactly what was there at the call, and nothing else (no template bias).
    dcp_to_torch_save(str(tmp_path / "ck"), str(tmp_path / "all.pt"))
    assert_same(expected, torch.load(tmp_path / "all.pt", weights_only=False))
    out = fresh_like(expected)
    asyncckpt.load(out, tmp_path / "ck")
    assert_same(expected, out)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staging_buffers", [1, 2])
@pytest.mark.parametrize("caller", CALLERS)
def test_back_to_back_saves_in_flight(tmp_path: Path, caller: str, staging_buffers: int) -> None:
    g = torch.Generator().manual_seed(4)
    state: dict[str, Any] = {
        "big": torch.randn(8 << 20, generator=g),
        "small": torch.arange(64, dtype=torch.int32),
        "meta": {"step": 0},
    }
    manager = CheckpointManager(tmp_path / "root", persistent=caller == "persistent", staging_buffers=staging_buffers)
    expected: dict[int, Any] = {}
    try:
        for step in (1, 2, 3):
            state["meta"]["step"] = step
            state["meta"]["tag"] = "x" * (100 * step)  # the pickled bytes change size
            state["grow"] = torch.full(((1 << 12) * step,), float(step))  # needs a bigger buffer
            manager.save(step, state, async_op=True)
            expected[step] = clone_state(state)
            # Mutate while the write (and possibly the previous one) is in flight.
            state["big"].add_(1.5)
            state["small"].mul_(3)
            state["grow"].zero_()
            assert len(testing.staging_buffers(manager)) <= staging_buffers
        assert manager.maybe_finalize(blocking=True) == [1, 2, 3]
        assert manager.steps() == [1, 2, 3]
        for step in (1, 2, 3):
            asyncckpt.verify(manager.step_dir(step))
            out = fresh_like(expected[step])
            assert manager.load(out, step) == step
            assert_same(expected[step], out)
    finally:
        manager.close()


# ----------------------------------------------------------------------------- refused input
def _sparse() -> dict:
    return {"ok": torch.ones(2), "layer": {"weight": torch.eye(3).to_sparse()}}


def _meta() -> dict:
    return {"ok": torch.ones(2), "bias": torch.empty(3, device="meta")}


def _quantized() -> dict:
    return {"ok": torch.ones(2), "q": torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)}


def _float_key() -> dict:  # int keys are saved (an optimizer's state): tests/test_keys.py
    return {"ok": torch.ones(2), "opt": {7.5: torch.ones(1)}}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "make_bad,needle",
    [
        (_sparse, "state_dict['layer']['weight']"),
        (_meta, "state_dict['bias']"),
        (_quantized, "state_dict['q']"),
        (_float_key, "key 7.5"),
    ],
    ids=["sparse", "meta", "quantized", "float_key"],
)
def test_unsaveable_input_refused_before_writing(
    tmp_path: Path, temporal_queue: AsyncCallsQueue, make_bad: Any, needle: str, async_op: bool
) -> None:
    target = tmp_path / "ck"
    with pytest.raises(CheckpointError) as info:
        asyncckpt.save(make_bad(), target, async_op=async_op, calls_queue=temporal_queue)
    assert needle in str(info.value)
    if needle.startswith("key"):
        assert "state_dict['opt']" in str(info.value)
    assert not isinstance(info.value, CorruptCheckpointError)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == [], "nothing may be written"
    assert temporal_queue.get_num_unfinalized_calls() == 0


@pytest.mark.timeout(60)
def test_unpicklable_value_refused_before_writing(tmp_path: Path, temporal_queue: AsyncCallsQueue) -> None:
    target = tmp_path / "ck"
    with pytest.raises(CheckpointError):
        asyncckpt.save({"w": torch.ones(1), "fn": lambda: 1}, target, async_op=True, calls_queue=temporal_queue)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_existing_target_refused(tmp_path: Path, temporal_queue: AsyncCallsQueue) -> None:
    state = {"w": torch.ones(3)}
    nonempty = tmp_path / "nonempty"
    nonempty.mkdir()
    (nonempty / "keep.txt").write_text("precious")
    for async_op in (False, True):
        with pytest.raises(CheckpointError):
            asyncckpt.save(state, nonempty, async_op=async_op, calls_queue=temporal_queue)
    assert sorted(p.name for p in nonempty.iterdir()) == ["keep.txt"]
    assert (nonempty / "keep.txt").read_text() == "precious"

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(CheckpointError):
        asyncckpt.save(state, a_file, calls_queue=temporal_queue)
    assert a_file.read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "nonempty"]

    # An existing *empty* directory is accepted.
    empty = tmp_path / "empty"
    empty.mkdir()
    asyncckpt.save(state, empty, calls_queue=temporal_queue)
    asyncckpt.verify(empty)
    assert temporal_queue.get_num_unfinalized_calls() == 0


# ----------------------------------------------------------------------------- failed saves
@pytest.mark.timeout(60)
def test_failed_write_commits_nothing(tmp_path: Path, calls_queue: AsyncCallsQueue) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("regular file")
    target = blocker / "ck"  # its parent is a regular file: every write fails
    state = {"w": torch.randn(100)}

    with pytest.raises(CheckpointException) as info:
        asyncckpt.save(state, target, async_op=False, calls_queue=calls_queue)
    assert 0 in info.value.failures and "NotADirectoryError" in info.value.failures[0]

    handle = asyncckpt.save(state, target, async_op=True, calls_queue=calls_queue)
    with pytest.raises(CheckpointException) as info:
        handle.wait(timeout=30)
    assert "NotADirectoryError" in info.value.failures[0]
    assert handle.done()
    assert handle.exception() is info.value
    assert handle.timings is None
    assert "failed" in repr(handle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not_a_dir"]

    # The queue is usable afterwards.
    good = asyncckpt.save(state, tmp_path / "good", async_op=True, calls_queue=calls_queue)
    good.wait(timeout=30)
    asyncckpt.verify(tmp_path / "good")


# ----------------------------------------------------------------------------- SaveHandle
@pytest.mark.timeout(60)
def test_save_handle(tmp_path: Path, calls_queue: AsyncCallsQueue) -> None:
    state = {"w": torch.randn(1 << 20), "i": torch.arange(1000), "n": 1}
    handle = asyncckpt.save(state, tmp_path / "a", async_op=True, calls_queue=calls_queue)
    assert isinstance(handle.call_idx, int)
    assert handle.checkpoint_dir == (tmp_path / "a").absolute()
    assert not handle.checkpoint_dir.exists(), "committed only in finalize"
    timings = handle.wait(timeout=30)
    assert handle.done() and handle.exception() is None
    assert handle.timings == timings
    assert isinstance(timings, SaveTimings)
    assert "committed" in repr(handle)
    assert handle.checkpoint_dir.is_dir()
    asyncckpt.verify(handle.checkpoint_dir)

    data_bytes = (handle.checkpoint_dir / "__0_0.distcp").stat().st_size
    assert timings.bytes == data_bytes > 4 << 20
    assert timings.write_s > 0 and timings.stall_s > 0 and timings.finalize_s > 0
    assert timings.total_s >= timings.stall_s and timings.total_s >= timings.finalize_s
    assert timings.total_s < 30
    assert timings.gbps == pytest.approx(timings.bytes / timings.write_s / 1e9)
    assert handle.wait() == timings  # idempotent

    # done() only reads the state: on a queue finalized in the training loop nothing
    # commits until the loop finalizes (here: wait(); result(timeout=0) reads too).
    second = asyncckpt.save(state, tmp_path / "b", async_op=True, calls_queue=calls_queue)
    call_idx = second.call_idx
    assert call_idx is not None  # an async save without overlap is scheduled at once
    assert calls_queue.wait_local(call_idx, timeout=30)  # this rank's write is over
    for _ in range(3):
        assert not second.done()
        with pytest.raises(TimeoutError):
            second.result(timeout=0)
    assert not (tmp_path / "b").exists() and calls_queue.is_pending(call_idx)
    second.wait(timeout=30)
    assert second.done() and second.exception() is None and second.timings is not None
    asyncckpt.verify(tmp_path / "b")

    # A synchronous save returns an already committed handle.
    sync = asyncckpt.save(state, tmp_path / "c", async_op=False, calls_queue=calls_queue)
    assert sync.done() and sync.call_idx is None and sync.checkpoint_dir == (tmp_path / "c").absolute()
    st = sync.wait()
    assert st.bytes == data_bytes and st.write_s > 0 and st.total_s >= st.write_s


# ----------------------------------------------------------------------------- CheckpointManager
@pytest.mark.timeout(60)
def test_manager_steps_latest_and_retention(tmp_path: Path, calls_queue: AsyncCallsQueue) -> None:
    root = tmp_path / "root"
    state: dict[str, Any] = {"w": torch.zeros(1000), "step": 0}
    expected: dict[int, Any] = {}
    manager = CheckpointManager(root, keep_last=2, calls_queue=calls_queue)
    try:
        assert manager.steps() == [] and manager.latest_step() is None
        with pytest.raises(FileNotFoundError):
            manager.load(fresh_like(state))

        def save(step: int) -> SaveHandle:
            state["w"].fill_(step)
            state["step"] = step
            expected[step] = clone_state(state)
            return manager.save(step, state, async_op=True)

        save(1).wait(timeout=30)
        assert manager.steps() == [1] and manager.latest_step() == 1
        assert (root / "latest").read_text().strip() == "step_00000001"

        save(2)
        h3 = save(3)
        # Nothing commits before finalize: step 1 still there, latest unchanged.
        time.sleep(0.3)
        assert manager.steps() == [1] and manager.latest_step() == 1
        assert manager.maybe_finalize(blocking=True) == [2, 3]
        assert h3.timings is not None and manager.last_committed_timings == h3.timings
        # keep_last=2 removed step 1 only now that newer ones committed.
        assert manager.steps() == [2, 3]
        assert not manager.step_dir(1).exists()
        assert manager.latest_step() == 3
        assert (root / "latest").read_text().strip() == "step_00000003"

        out = fresh_like(state)
        assert manager.load(out) == 3
        assert_same(expected[3], out)
        out = fresh_like(state)
        assert manager.load(out, step=2) == 2
        assert_same(expected[2], out)
        with pytest.raises(FileNotFoundError):
            manager.load(fresh_like(state), step=1)

        # Partial and hidden directories are never taken for checkpoints.
        hidden = root / ".step_00000009.tmp-0123abcd"
        hidden.mkdir()
        (hidden / "__0_0.distcp").write_bytes(b"partial")
        partial = root / "step_00000010"
        partial.mkdir()
        (partial / "__0_0.distcp").write_bytes(b"partial")
        (partial / ".metadata").write_bytes(b"partial")  # but no manifest
        assert manager.steps() == [2, 3]
        assert manager.latest_step() == 3
        # A `latest` naming a non-committed directory is not trusted.
        (root / "latest").write_text("step_00000010\n")
        assert manager.latest_step() == 3
        assert manager.load(fresh_like(state)) == 3

        # A step that already exists is refused before anything is written.
        with pytest.raises(CheckpointError):
            manager.save(3, state, async_op=True)
        assert manager.steps() == [2, 3]

        # Synchronous save through the manager.
        state["w"].fill_(4)
        expected[4] = clone_state(state)
        handle = manager.save(4, state, async_op=False)
        assert handle.done() and handle.step == 4
        assert manager.steps() == [3, 4] and manager.latest_step() == 4
    finally:
        manager.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("caller", CALLERS)
def test_manager_failed_save_leaves_latest_untouched(
    tmp_path: Path, caller: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    blocker = tmp_path / "blocker"
    blocker.write_text("a regular file")
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    good = clone_state(state)
    with CheckpointManager(root, keep_last=1, persistent=caller == "persistent") as manager:
        manager.save(1, state).wait(timeout=30)
        assert manager.steps() == [1]
        before = {p.name: p.read_bytes() for p in manager.step_dir(1).iterdir()}
        latest_before = (root / "latest").read_bytes()

        # Fault: this save's data directory cannot be created (its parent is a file).
        real_tmp = commit_mod.temporary_dir_for
        monkeypatch.setattr(
            commit_mod, "temporary_dir_for", lambda final_dir, token: blocker / real_tmp(final_dir, token).name
        )
        state["w"].add_(1)
        failing = manager.save(2, state, async_op=True)
        with pytest.raises(CheckpointException) as info:
            manager.maybe_finalize(blocking=True)
        assert info.value.call_idx == failing.call_idx
        assert "NotADirectoryError" in info.value.failures[0]
        assert failing.done() and failing.exception() is info.value

        with pytest.raises(CheckpointException):
            manager.save(3, state, async_op=False)

        # Nothing of the failed saves is visible; keep_last removed nothing.
        assert manager.steps() == [1] and manager.latest_step() == 1
        assert (root / "latest").read_bytes() == latest_before
        assert {p.name: p.read_bytes() for p in manager.step_dir(1).iterdir()} == before
        assert not manager.step_dir(2).exists() and not manager.step_dir(3).exists()
        asyncckpt.verify(manager.step_dir(1))
        out = fresh_like(state)
        assert manager.load(out) == 1
        assert_same(good, out)
        monkeypatch.undo()

        # Fault at commit: the final name got taken by a non-empty directory meanwhile.
        failing = manager.save(4, state, async_op=True)
        manager.step_dir(4).mkdir()
        (manager.step_dir(4) / "intruder").write_text("x")
        with pytest.raises(CheckpointException):
            manager.maybe_finalize(blocking=True)
        assert manager.steps() == [1] and manager.latest_step() == 1
        assert (root / "latest").read_bytes() == latest_before
        assert sorted(p.name for p in manager.step_dir(4).iterdir()) == ["intruder"]

        # The manager recovers: the next save commits and retention applies.
        expected = clone_state(state)
        manager.save(5, state).wait(timeout=30)
        assert manager.steps() == [5] and manager.latest_step() == 5
        out = fresh_like(state)
        assert manager.load(out) == 5
        assert_same(expected, out)


@pytest.mark.timeout(60)
def test_manager_last_committed_timings_after_handle_wait(tmp_path: Path, temporal_queue: AsyncCallsQueue) -> None:
    """``last_committed_timings`` is "the timings of the most recently committed save",
    also when the save was committed by ``SaveHandle.wait()`` rather than
    ``maybe_finalize()``; the manager must not keep the committed handle pending."""
    manager = CheckpointManager(tmp_path / "root", calls_queue=temporal_queue)
    try:
        handle = manager.save(1, {"w": torch.ones(10)}, async_op=True)
        timings = handle.wait(timeout=30)
        assert manager.steps() == [1]
        assert manager.last_committed_timings == timings
        assert manager.maybe_finalize(blocking=True) == []  # reported through wait()
        assert testing.pending_steps(manager) == []
    finally:
        manager.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("caller", CALLERS)
def test_an_outcome_seen_through_wait_is_not_reported_again(
    tmp_path: Path, caller: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``handle.wait()`` may return as soon as the handle is settled, while the finalizer
    thread has not finished settling the save (the fault: that thread is descheduled
    right after settling the handle). The outcome seen through ``wait`` must not be
    reported again by ``maybe_finalize``: before the fix it was, and as a committed save
    ahead of a failure it made ``maybe_finalize(blocking=True)`` return instead of
    raising (seen in the fault suite's ``preload`` scenario)."""

    def stall(_: Any) -> None:
        time.sleep(0.3)  # the finalizer thread, descheduled right after completing the handle

    with CheckpointManager(tmp_path / "root", persistent=caller == "persistent") as manager:
        first = manager.save(1, {"w": torch.ones(10)})
        first.add_done_callback(stall)
        first.wait(timeout=30)
        assert manager.maybe_finalize(blocking=True) == []
        second = manager.save(2, {"w": torch.ones(10)})
        second.add_done_callback(stall)
        second.wait(timeout=30)
        assert manager.maybe_finalize(blocking=True) == []
        manager.save(3, {"w": torch.ones(10)})
        assert manager.maybe_finalize(blocking=True) == [3]
        assert manager.steps() == [1, 2, 3]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("caller", CALLERS)
def test_a_blocking_maybe_finalize_waits_for_a_failure_being_settled(
    tmp_path: Path, caller: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``maybe_finalize(blocking=True)`` called while the finalizer thread settles a failed
    save (here: it is descheduled while removing the save's temporary directory) must
    wait for it and raise. Before the fix the save was, for that moment, neither pending
    nor settled, and the call returned as if every save had committed (seen in the
    fault suite's ``preload`` scenario)."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a regular file")
    real_tmp = commit_mod.temporary_dir_for
    real_rmtree = shutil.rmtree
    settling = threading.Event()

    def stalled_rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path).parent == blocker and not settling.is_set():
            settling.set()
            time.sleep(0.5)  # the finalizer thread, descheduled while it settles the failure
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", stalled_rmtree)
    with CheckpointManager(tmp_path / "root", persistent=caller == "persistent") as manager:
        manager.save(1, {"w": torch.ones(10)}).wait(timeout=30)
        monkeypatch.setattr(
            commit_mod, "temporary_dir_for", lambda final_dir, token: blocker / real_tmp(final_dir, token).name
        )
        failing = manager.save(2, {"w": torch.ones(10)})
        monkeypatch.setattr(commit_mod, "temporary_dir_for", real_tmp)
        assert settling.wait(timeout=30)
        with pytest.raises(CheckpointException) as info:
            manager.maybe_finalize(blocking=True)
        assert info.value.call_idx == failing.call_idx
        assert manager.maybe_finalize(blocking=True) == [] and manager.steps() == [1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("caller", CALLERS)
def test_a_blocking_maybe_finalize_raises_a_failure_behind_committed_saves(
    tmp_path: Path, caller: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the end of training (``maybe_finalize(blocking=True)``) a failed save is raised
    even when saves committed before it are reported in the same call: left to "the next
    call", which may never come, the failure would be lost. Not blocking, the committed
    steps are returned first and the failure is raised by the next call."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a regular file")
    real_tmp = commit_mod.temporary_dir_for
    with CheckpointManager(tmp_path / "root", persistent=caller == "persistent") as manager:
        for blocking in (True, False):
            first = 10 if blocking else 20
            ok = manager.save(first, {"w": torch.ones(10)})
            monkeypatch.setattr(
                commit_mod, "temporary_dir_for", lambda final_dir, token: blocker / real_tmp(final_dir, token).name
            )
            failing = manager.save(first + 1, {"w": torch.ones(10)})
            monkeypatch.setattr(commit_mod, "temporary_dir_for", real_tmp)
            if blocking:
                with pytest.raises(CheckpointException) as info:
                    manager.maybe_finalize(blocking=True)
                assert info.value.call_idx == failing.call_idx
                assert any(f"reported with it: {first}" in note for note in info.value.__notes__)
            else:
                deadline = time.monotonic() + 30
                while not failing.done() and time.monotonic() < deadline:
                    time.sleep(0.01)  # settled by the finalizer thread, not harvested
                assert ok.done() and failing.done()
                assert manager.maybe_finalize() == [first]
                with pytest.raises(CheckpointException) as info:
                    manager.maybe_finalize()
                assert info.value.call_idx == failing.call_idx
            assert manager.maybe_finalize(blocking=True) == []
        assert manager.steps() == [10, 20]


@pytest.mark.timeout(60)
def test_concurrent_saves_to_one_target_commit_once(tmp_path: Path, calls_queue: AsyncCallsQueue) -> None:
    """Two async saves into the same (not yet existing) directory: the first commits,
    the second is refused at once while the first is pending, and never replaces it."""
    target = tmp_path / "ck"
    first = {"w": torch.full((1000,), 1.0)}
    second = {"w": torch.full((1000,), 2.0)}
    h1 = asyncckpt.save(first, target, async_op=True, calls_queue=calls_queue)
    # Pending: refused as being saved; committed already (a fast first save): it exists.
    with pytest.raises(CheckpointError, match=r"already being saved|exists") as info:
        asyncckpt.save(second, target, async_op=True, calls_queue=calls_queue)
    assert str(target) in str(info.value)
    h1.wait(timeout=30)
    asyncckpt.verify(target)
    out = {"w": torch.zeros(1000)}
    asyncckpt.load(out, target)
    assert torch.equal(out["w"], first["w"])
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == ["ck"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("caller", CALLERS)
def test_manager_close_commits_pending_and_abort_drops(tmp_path: Path, caller: str) -> None:
    root = tmp_path / "root"
    persistent = caller == "persistent"
    state: dict[str, Any] = {"big": torch.randn(4 << 20), "n": 1}
    manager = CheckpointManager(root, persistent=persistent)
    try:
        manager.save(1, state, async_op=True)
        manager.save(2, state, async_op=True)
    finally:
        manager.close()  # commits the pending saves
    assert manager.steps() == [1, 2] and manager.latest_step() == 2
    manager.close()  # idempotent
    with pytest.raises(RuntimeError):
        manager.save(3, state)

    # abort: in-flight saves are dropped; nothing new is committed, latest unchanged.
    manager = CheckpointManager(root, persistent=persistent)
    try:
        manager.save(3, state, async_op=True)
    finally:
        manager.close(abort=True)
    assert manager.steps() == [1, 2] and manager.latest_step() == 2
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert not manager.step_dir(3).exists()

    # The context manager aborts on Ctrl-C, too; an exception that is a crash keeps the
    # saves staged before it (tests/test_lifecycle.py).
    with pytest.raises(KeyboardInterrupt):
        with CheckpointManager(root, persistent=persistent) as manager:
            manager.save(4, state, async_op=True)
            raise KeyboardInterrupt
    assert manager.steps() == [1, 2] and manager.latest_step() == 2
    out: dict[str, Any] = {"big": torch.zeros(4 << 20), "n": 0}
    reader = CheckpointManager(root, persistent=False)
    try:
        assert reader.load(out) == 2
    finally:
        reader.close()
    assert torch.equal(out["big"], state["big"]) and out["n"] == 1


@pytest.mark.timeout(60)
def test_manager_starts_a_light_worker_before_the_first_save(tmp_path):
    import psutil

    manager = asyncckpt.CheckpointManager(tmp_path / "root")
    try:
        assert isinstance(manager.queue.caller, asyncckpt.PersistentAsyncCaller)  # the manager's default
        pid = manager.queue.caller.worker_pid
        assert pid is not None, "the persistent worker must be up before the first save"
        manager.save(1, {"w": torch.ones(4)}).wait()
        worker = psutil.Process(pid)
        assert manager.queue.caller.worker_pid == pid
        # The writer imports no torch and the training script is not re-imported.
        assert worker.memory_info().rss < 150 * 2**20
    finally:
        manager.close()


@pytest.mark.timeout(60)
def test_plan_is_cached_while_the_structure_is_unchanged(tmp_path):
    queue = asyncckpt.AsyncCallsQueue(persistent=False)
    try:
        states: list[dict[str, Any]] = [
            {"a": torch.ones(3), "b": [torch.zeros(2, 2)], "step": 1},
            {"a": torch.full((3,), 2.0), "b": [torch.ones(2, 2)], "step": 2},  # same structure: hit
            {"a": torch.ones(4), "b": [torch.zeros(2, 2)], "step": 3},  # shape changed
            {"a": torch.ones(4, dtype=torch.float64), "b": [torch.zeros(2, 2)], "step": 4},  # dtype
            {"a": torch.ones(4, dtype=torch.float64), "b": [torch.zeros(2, 2)], "c": 1, "step": 5},  # new key
            {"a": torch.ones(4, dtype=torch.float64), "b": [torch.zeros(2, 2)], "c": "x" * 1000, "step": 6},
        ]
        plans = []
        with counting_plans() as planned:
            for i, state in enumerate(states):
                asyncckpt.save(state, tmp_path / f"c{i}", async_op=True, calls_queue=queue).wait()
                plans.append(planned.n)
        assert plans == [1, 1, 2, 3, 4, 4]
        for i, state in enumerate(states):
            out: dict[str, Any] = {
                k: (
                    torch.empty_like(v)
                    if torch.is_tensor(v)
                    else [torch.empty_like(t) for t in v]
                    if isinstance(v, list)
                    else None
                )
                for k, v in state.items()
            }
            asyncckpt.load(out, tmp_path / f"c{i}")
            assert torch.equal(out["a"], state["a"]) and out["a"].dtype == state["a"].dtype
            assert torch.equal(out["b"][0], state["b"][0])
            assert out["step"] == state["step"] and out.get("c") == state.get("c")
    finally:
        queue.close()


@pytest.mark.timeout(60)
def test_manager_removes_leftovers_of_failed_saves_and_resumes_from_newest_commit(tmp_path):
    root = tmp_path / "root"
    manager = asyncckpt.CheckpointManager(root, persistent=False)
    try:
        manager.save(1, {"w": torch.ones(2)}).wait()
        # A killed save of step 2, a half-deleted step 0, and a later save's temp dir.
        for name in (".step_00000002.tmp-0123abcd", ".step_00000000.deleting-beef", ".step_00000009.tmp-77"):
            (root / name).mkdir()
            (root / name / "__0_0.distcp").write_bytes(b"partial")
        # A crash between the rename of step 3 and the update of `latest`:
        manager.save(3, {"w": torch.ones(2)}).wait()
        (root / "latest").write_text("step_00000001\n")
        assert manager.latest_step() == 3, "resume from the newest committed step, not a lagging latest"
        leftovers = sorted(p.name for p in root.iterdir() if p.name.startswith(".step_"))
        assert leftovers == [".step_00000009.tmp-77"]
        manager.save(4, {"w": torch.ones(2)}).wait()
        assert (root / "latest").read_text().strip() == "step_00000004"
    finally:
        manager.close()
