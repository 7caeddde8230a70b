"""Security (issue 3, deliverable 5): a checkpoint is untrusted input; files are ours.

(a) ``load`` refuses a checkpoint whose ``.metadata`` or manifest names a path outside
    its directory (``../``, absolute, with a separator) or a symlink, with
    ``CorruptCheckpointError``, with and without ``verify``; ``.metadata`` is unpickled
    with an allowlist (a crafted ``__reduce__`` never runs).
(b) Non-tensor values load with ``weights_only=True`` semantics unless
    ``allow_pickle=True``; a refused value leaves the state_dict unchanged.
(c) Files and directories follow the umask; the temporary names carry >= 64 random
    bits and are not world-writable.
(d) The lock file (and ``latest``) never follow a symlink.

The crafted checkpoints are real committed ones, edited; when the edit changes a file
the manifest covers, the manifest is re-signed (sizes and CRC-32s recomputed), so that
``verify`` passes and only the path / pickle checks can refuse the checkpoint.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import stat
import time
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import asyncckpt
import asyncckpt.io.commit as commit_mod
from asyncckpt import AsyncCallsQueue, CheckpointError, CheckpointManager, CorruptCheckpointError
from asyncckpt.loading.metadata import read_metadata

from helpers import resign

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

DATA = "__0_0.distcp"


# ----------------------------------------------------------------------------- helpers
def make_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, generator=g), "b": torch.arange(5), "n": 7, "name": "model"}


def fresh() -> dict[str, Any]:
    return {"w": torch.zeros(64), "b": torch.zeros(5, dtype=torch.int64), "n": -1, "name": "?"}


def assert_untouched(out: dict[str, Any]) -> None:
    """A refused load changed nothing."""
    assert not out["w"].any() and not out["b"].any() and out["n"] == -1 and out["name"] == "?"


@pytest.fixture
def ckpt(tmp_path: Path, temporal_queue: AsyncCallsQueue) -> Path:
    """A committed checkpoint of :func:`make_state` (sync save: no worker)."""
    path = tmp_path / "ck"
    asyncckpt.save(make_state(), path, calls_queue=temporal_queue)
    asyncckpt.verify(path)
    return path


def edit_metadata(ckpt: Path, edit: Callable[[Any], object]) -> None:
    """Unpickle ``.metadata`` (trusted here: we wrote it), edit it, write it back, re-sign."""
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    edit(md)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    resign(ckpt)


def storage_info(md: Any, fqn: str) -> Any:
    return next(info for index, info in md.storage_data.items() if index.fqn == fqn)


def load_both_ways(ckpt: Path, out: dict[str, Any], **kwargs: Any) -> list[CheckpointError]:
    """Load with verify=True and verify=False; both must raise. Returns the errors."""
    errors = []
    for verify in (True, False):
        with pytest.raises(CheckpointError) as info:
            asyncckpt.load(out, ckpt, verify=verify, **kwargs)
        errors.append(info.value)
    return errors


class Evil:
    """Its unpickling creates (opens for writing) the file ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


class UserConfig:
    """An ordinary user class (not allowlisted for weights_only loading)."""

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UserConfig) and other.lr == self.lr


# ----------------------------------------------------------------------------- (a) paths
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["dotdot", "absolute", "subdir", "parent", "empty", "nul", "backslash"])
def test_load_refuses_metadata_path_outside(tmp_path: Path, ckpt: Path, kind: str) -> None:
    outside = tmp_path / "outside.distcp"
    outside.write_bytes((ckpt / DATA).read_bytes())  # a perfectly readable copy: only the path is wrong
    (ckpt / "sub").mkdir()
    name = {
        "dotdot": "../outside.distcp",
        "absolute": str(outside),
        "subdir": f"sub/{DATA}",
        "parent": "..",
        "empty": "",
        "nul": DATA + "\x00",
        "backslash": f"..\\{DATA}",
    }[kind]

    def edit(md: Any) -> None:
        storage_info(md, "w").relative_path = name

    edit_metadata(ckpt, edit)
    asyncckpt.verify(ckpt)  # the manifest still matches: only the metadata path check can refuse
    out = fresh()
    for error in load_both_ways(ckpt, out):
        assert isinstance(error, CorruptCheckpointError), error
        assert "outside the checkpoint directory" in str(error) and repr(name) in str(error), str(error)
    assert_untouched(out)
    with pytest.raises(CorruptCheckpointError):
        read_metadata(ckpt)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["dotdot", "absolute", "subdir", "parent", "nul"])
def test_load_refuses_manifest_path_outside(tmp_path: Path, ckpt: Path, kind: str) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"secret")
    name = {"dotdot": "../outside", "absolute": str(outside), "subdir": "sub/x", "parent": "..", "nul": "x\x00"}[kind]
    manifest = json.loads((ckpt / ".manifest.json").read_text())
    manifest["files"][name] = {"size": 6, "segments": [[0, 6, zlib.crc32(b"secret")]]}
    (ckpt / ".manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpointError) as info:
        asyncckpt.verify(ckpt)
    assert ".manifest.json" in str(info.value) and "outside the checkpoint" in str(info.value)
    out = fresh()
    for error in load_both_ways(ckpt, out):
        assert isinstance(error, CorruptCheckpointError) and ".manifest.json" in str(error), str(error)
    assert_untouched(out)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("victim", [DATA, ".metadata", ".manifest.json", "inside_alias"])
def test_load_refuses_symlinks(tmp_path: Path, ckpt: Path, victim: str) -> None:
    if victim == "inside_alias":
        # A symlink that stays inside the directory is refused too (only regular files).
        (ckpt / "alias.distcp").symlink_to(DATA)
        edit_metadata(ckpt, lambda md: setattr(storage_info(md, "w"), "relative_path", "alias.distcp"))
        resign(ckpt, {"alias.distcp": ckpt / DATA})
        name = "alias.distcp"
    else:
        outside = tmp_path / f"outside{victim}"
        outside.write_bytes((ckpt / victim).read_bytes())  # same bytes: checksums still match
        (ckpt / victim).unlink()
        (ckpt / victim).symlink_to(outside)
        name = victim
    out = fresh()
    for error in load_both_ways(ckpt, out):
        assert isinstance(error, CorruptCheckpointError), error
        assert name in str(error) and "symlink" in str(error), str(error)
    assert_untouched(out)


@pytest.mark.timeout(60)
def test_checkpoint_dir_reached_through_a_symlink_loads(tmp_path: Path, ckpt: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(ckpt, target_is_directory=True)
    out = fresh()
    asyncckpt.load(out, link, verify=False)
    asyncckpt.load(out, link)
    assert torch.equal(out["w"], make_state()["w"]) and out["n"] == 7


@pytest.mark.timeout(60)
def test_metadata_record_past_end_or_unlisted_file_refused(tmp_path: Path, ckpt: Path) -> None:
    size = (ckpt / DATA).stat().st_size
    edit_metadata(ckpt, lambda md: setattr(storage_info(md, "w"), "offset", size))
    out = fresh()
    for error in load_both_ways(ckpt, out):
        assert isinstance(error, CorruptCheckpointError) and "up to byte" in str(error), str(error)

    # A data file inside the directory, but not covered by the manifest (not checksummed).
    (ckpt / "extra.distcp").write_bytes((ckpt / DATA).read_bytes())

    def point_w_at_extra(md: Any) -> None:
        storage_info(md, "w").offset = 0
        storage_info(md, "w").relative_path = "extra.distcp"

    edit_metadata(ckpt, point_w_at_extra)
    for error in load_both_ways(ckpt, out):
        assert isinstance(error, CorruptCheckpointError) and "does not list" in str(error), str(error)
    assert_untouched(out)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("payload", ["reduce_open", "eval", "not_metadata"])
def test_metadata_unpickler_allows_only_dcp_classes(tmp_path: Path, ckpt: Path, payload: str) -> None:
    marker = tmp_path / "pwned"
    if payload == "reduce_open":
        blob = pickle.dumps(Evil(marker))
    elif payload == "eval":

        class _Eval:
            def __reduce__(self) -> tuple:
                return (eval, (f"open({str(marker)!r}, 'w')",))

        blob = pickle.dumps(_Eval())
    else:
        blob = pickle.dumps({"storage_data": {}})  # only allowed types, but not a Metadata
    (ckpt / ".metadata").write_bytes(blob)
    resign(ckpt)
    out = fresh()
    for error in load_both_ways(ckpt, out):
        assert isinstance(error, CorruptCheckpointError), error
        assert ".metadata" in str(error)
        expected = "does not hold DCP Metadata" if payload == "not_metadata" else "is not allowed"
        assert expected in str(error), str(error)
    assert not marker.exists(), "the metadata's pickle ran code"
    assert_untouched(out)


# ----------------------------------------------------------------------------- (b) pickles
@pytest.mark.timeout(60)
def test_user_object_needs_allow_pickle(tmp_path: Path, temporal_queue: AsyncCallsQueue) -> None:
    path = tmp_path / "ck"
    state: dict[str, Any] = {"w": torch.randn(8), "cfg": UserConfig(0.25), "n": 3}
    asyncckpt.save(state, path, calls_queue=temporal_queue)

    out: dict[str, Any] = {"w": torch.zeros(8), "cfg": None, "n": 0}
    with pytest.raises(CheckpointError) as info:
        asyncckpt.load(out, path)
    message = str(info.value)
    assert not isinstance(info.value, CorruptCheckpointError)
    assert "'cfg'" in message and "allow_pickle=True" in message and "UserConfig" in message, message
    assert not out["w"].any() and out["cfg"] is None and out["n"] == 0, "a refused load changed the state"

    asyncckpt.load(out, path, allow_pickle=True)
    assert out["cfg"] == UserConfig(0.25) and out["n"] == 3 and torch.equal(out["w"], state["w"])

    # The narrower opt-in the message suggests: allowlist the class.
    out2 = {"w": torch.zeros(8), "cfg": None, "n": 0}
    with torch.serialization.safe_globals([UserConfig]):
        asyncckpt.load(out2, path)
    assert out2["cfg"] == UserConfig(0.25)


@pytest.mark.timeout(60)
def test_manager_load_passes_allow_pickle(tmp_path: Path, temporal_queue: AsyncCallsQueue) -> None:
    manager = CheckpointManager(tmp_path / "root", calls_queue=temporal_queue)
    try:
        manager.save(1, {"cfg": UserConfig(1.5)}, async_op=False)
        out: dict[str, Any] = {"cfg": None}
        with pytest.raises(CheckpointError, match="allow_pickle"):
            manager.load(out)
        assert manager.load(out, allow_pickle=True) == 1 and out["cfg"] == UserConfig(1.5)
    finally:
        manager.close()


@pytest.mark.timeout(60)
def test_crafted_reduce_in_a_value_runs_only_with_allow_pickle(tmp_path: Path, ckpt: Path) -> None:
    marker = tmp_path / "pwned"
    # Append a torch.save archive of Evil to the data file and point entry "name" at it.
    buf = io.BytesIO()
    torch.save(Evil(marker), buf)
    evil = buf.getvalue()
    data = ckpt / DATA
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(evil)

    def edit(md: Any) -> None:
        info = storage_info(md, "name")
        info.offset, info.length = offset, len(evil)

    edit_metadata(ckpt, edit)
    asyncckpt.verify(ckpt)

    out = fresh()
    for error in load_both_ways(ckpt, out):
        assert not isinstance(error, CorruptCheckpointError)
        assert "'name'" in str(error) and "allow_pickle" in str(error), str(error)
    assert not marker.exists(), "weights_only loading ran the payload"
    assert_untouched(out)

    # Stock DCP (weights_only=False) runs it: the threat is real.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stock_out = fresh()
        dcp.load(stock_out, checkpoint_id=str(ckpt))
    assert marker.exists()
    stock_out["name"].close()
    marker.unlink()

    # The explicit opt-in unpickles (and so runs) it.
    asyncckpt.load(out, ckpt, allow_pickle=True)
    assert marker.exists()
    out["name"].close()


@pytest.mark.timeout(60)
def test_plain_values_load_by_default(tmp_path: Path, temporal_queue: AsyncCallsQueue) -> None:
    state: dict[str, Any] = {
        "i": 3,
        "big": -(2**80),
        "f": 0.5,
        "s": "str",
        "none": None,
        "b": True,
        "list": [1, "a", None],
        "tuple": (1, 2.0),
        "dict": {"x": 1},
        "t": torch.arange(3),
        "bytes": b"\x00",
        "c": 1j,
    }
    asyncckpt.save(state, tmp_path / "ck", calls_queue=temporal_queue)
    out: dict[str, Any] = {k: torch.zeros(3, dtype=torch.int64) if k == "t" else None for k in state}
    out["list"] = [None, None, None]
    out["dict"] = {"x": None}
    asyncckpt.load(out, tmp_path / "ck")
    for k, v in state.items():
        assert torch.equal(out[k], v) if k == "t" else (type(out[k]) is type(v) and out[k] == v), k


@pytest.mark.timeout(60)
def test_foreign_tensor_record_loads_with_weights_only(tmp_path: Path, ckpt: Path) -> None:
    """A tensor record not in our writer's framing goes through torch.load(weights_only=True)."""
    marker = tmp_path / "pwned"
    data = ckpt / DATA
    foreign = io.BytesIO()
    torch.save(make_state()["w"].clone(), foreign)  # stock torch.save: random serialization id
    evil = io.BytesIO()
    torch.save(Evil(marker), evil)
    offsets = []
    with open(data, "ab") as f:
        for blob in (foreign.getvalue(), evil.getvalue()):
            offsets.append((f.tell(), len(blob)))
            f.write(blob)

    def point_w_at(i: int) -> Callable[[Any], None]:
        def edit(md: Any) -> None:
            info = storage_info(md, "w")
            info.offset, info.length = offsets[i]

        return edit

    edit_metadata(ckpt, point_w_at(0))
    out = fresh()
    asyncckpt.load(out, ckpt)
    assert torch.equal(out["w"], make_state()["w"])

    edit_metadata(ckpt, point_w_at(1))
    out = fresh()
    for error in load_both_ways(ckpt, out, allow_pickle=True):  # tensors never unpickle objects
        assert isinstance(error, CorruptCheckpointError) and "'w'" in str(error), str(error)
    assert not marker.exists()


# ----------------------------------------------------------------------------- (c) modes, names
def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("caller", ["sync", "temporal", "persistent"])
def test_files_and_directories_follow_the_umask(tmp_path: Path, caller: str) -> None:
    old = os.umask(0o027)
    try:
        root = tmp_path / "root"
        # The worker (forked per save, or spawned now) starts under this umask.
        manager = CheckpointManager(root, persistent=caller == "persistent")
        try:
            manager.save(1, make_state(), async_op=caller != "sync")
            manager.maybe_finalize(blocking=True)
        finally:
            manager.close()
    finally:
        os.umask(old)
    step = manager.step_dir(1)
    assert _mode(root) == 0o750 and _mode(step) == 0o750
    names = sorted(p.name for p in step.iterdir())
    assert names == [".manifest.json", ".metadata", ".records.json", DATA]
    for name in names:
        assert _mode(step / name) == 0o640, (name, oct(_mode(step / name)))
    for name in ("latest", ".asyncckpt.lock"):
        assert _mode(root / name) == 0o640, (name, oct(_mode(root / name)))


@pytest.mark.timeout(120)
def test_a_long_lived_worker_follows_the_umask_of_each_save(tmp_path: Path) -> None:
    root = tmp_path / "root"
    manager = CheckpointManager(root, persistent=True)  # worker started under the old umask
    old = os.umask(0o027)
    try:
        manager.save(1, make_state()).wait()
        os.umask(0o077)
        manager.save(2, make_state()).wait()
    finally:
        os.umask(old)
        manager.close()
    for step, mode in ((1, 0o640), (2, 0o600)):
        for path in manager.step_dir(step).iterdir():
            assert _mode(path) == mode, (step, path.name, oct(_mode(path)))


@pytest.mark.timeout(120)
def test_temporary_names_are_random_and_not_world_writable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCCKPT_FAULT", "mid_write:sleep=1")  # the forked writer pauses mid-file
    old = os.umask(0o022)
    queue = AsyncCallsQueue(persistent=False)
    tokens = []
    try:
        for name in ("ck1", "ck2"):
            handle = asyncckpt.save({"w": torch.randn(1000)}, tmp_path / name, async_op=True, calls_queue=queue)
            pattern = re.compile(rf"^\.{name}\.tmp-([0-9a-f]+)$")
            deadline = time.monotonic() + 30
            seen = None
            while seen is None and time.monotonic() < deadline:
                seen = next((p for p in tmp_path.iterdir() if pattern.match(p.name)), None)
                time.sleep(0.01)
            assert seen is not None, "the temporary directory was never seen"
            match = pattern.match(seen.name)
            assert match is not None
            token = match.group(1)
            assert len(token) * 4 >= 64, token  # >= 64 random bits (uuid4: 122)
            assert not _mode(seen) & 0o022, oct(_mode(seen))  # neither group- nor world-writable
            for f in seen.iterdir():
                assert not _mode(f) & 0o022, (f.name, oct(_mode(f)))
            tokens.append(token)
            handle.wait(timeout=60)
        assert tokens[0] != tokens[1]
    finally:
        os.umask(old)
        queue.close()

    # latest's temporary file: 64 random bits, created with O_EXCL.
    replaced: list[str] = []
    real_replace = os.replace

    def spy(src: Any, dst: Any) -> None:
        replaced.append(os.path.basename(src))
        real_replace(src, dst)

    monkeypatch.delenv("ASYNCCKPT_FAULT")
    monkeypatch.setattr(commit_mod.os, "replace", spy)
    for _ in range(2):
        commit_mod.write_latest(tmp_path, "ck1")
    assert len(replaced) == 2 and replaced[0] != replaced[1]
    for name in replaced:
        assert re.fullmatch(r"\.latest\.tmp-[0-9a-f]{16}", name), name


# ----------------------------------------------------------------------------- (d) lock, latest
@pytest.mark.timeout(60)
@pytest.mark.parametrize("target_exists", [True, False], ids=["to_file", "dangling"])
def test_lock_and_latest_symlinks_are_not_followed(
    tmp_path: Path, temporal_queue: AsyncCallsQueue, target_exists: bool
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    lock_target, latest_target = outside / "lock_victim", outside / "latest_victim"
    if target_exists:
        for victim in (lock_target, latest_target):
            victim.write_text("precious")
            os.utime(victim, ns=(1_000_000_000, 1_000_000_000))
    (root / ".asyncckpt.lock").symlink_to(lock_target)
    (root / "latest").symlink_to(latest_target)

    manager = CheckpointManager(root, calls_queue=temporal_queue)
    try:
        assert manager.latest_step() is None  # a symlinked latest is not read
        manager.save(1, make_state(), async_op=False)
        manager.save(2, make_state(), async_op=True).wait(timeout=60)
        assert manager.latest_step() == 2
    finally:
        manager.close()

    if target_exists:
        for victim in (lock_target, latest_target):
            assert victim.read_text() == "precious"
            assert victim.stat().st_mtime_ns == 1_000_000_000
    assert sorted(p.name for p in outside.iterdir()) == (["latest_victim", "lock_victim"] if target_exists else [])
    for name in (".asyncckpt.lock", "latest"):
        assert stat.S_ISREG(os.lstat(root / name).st_mode), name
    assert (root / "latest").read_text() == "step_00000002\n"

    # A symlink planted at latest afterwards is ignored (never followed) by readers.
    (root / "latest").unlink()
    (root / "latest").symlink_to(root / "step_00000001" / ".metadata")
    assert commit_mod.read_latest(root) is None
    manager = CheckpointManager(root, calls_queue=temporal_queue)
    try:
        assert manager.latest_step() == 2  # falls back to the largest committed step
    finally:
        manager.close()
