"""The storage seam (asyncckpt.io.storage): the local tier writes, commits and discards
what the save path wrote before, and every read of the load side goes through it."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

import asyncckpt
from asyncckpt._fs import remove_checkpoint
from asyncckpt.dist import SyncGroup
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.layout import build_layout
from asyncckpt.format.manifest import MANIFEST_NAME, METADATA_NAME
from asyncckpt.io.storage import LOCAL, LocalStorage, Storage
from asyncckpt.io.writer import WriteTask
from asyncckpt.loading.dcp import SafeFileSystemReader, SafeLoadPlanner
from asyncckpt.loading.direct import direct_load, plan_direct_load
from asyncckpt.loading.metadata import read_metadata
from asyncckpt.root import CheckpointRoot, parse_leftover
from asyncckpt.saving.planning import plan_save
from asyncckpt.saving.staging import StagingBuffer

from helpers import assert_same, clone_state

REPO = Path(__file__).resolve().parent.parent
DATA = "__0_0.distcp"


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(300, 70, generator=gen),
        "b": torch.arange(17, dtype=torch.int16),
        "empty": torch.zeros(0),
        "meta": {"step": 5, "name": "x"},
    }


def _save_through(storage: Storage, state: dict[str, Any], final_dir: Path) -> dict[str, Any]:
    """One rank's save through ``storage`` only: the plan, the staging into a host
    buffer, then the tier's write, and its commit (as the coordinator)."""
    planned, _ = plan_save(state, str(final_dir), SyncGroup(None), 0)
    blobs = {i: len(d) for i, d in enumerate(planned.data) if isinstance(d, bytes)}
    layout = build_layout(0, list(planned.plan.items), blobs)
    tmp_dir = storage.temporary_dir(final_dir, planned.token)
    buffer = StagingBuffer(layout.slab_nbytes)
    try:
        buffer.format(layout)
        for slot in layout.tensors:
            if slot.nbytes:
                buffer.u8[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape).copy_(
                    planned.data[slot.item]
                )
        for blob in layout.blobs:
            buffer.write_bytes(blob.offset, planned.data[blob.item])
        result = storage.write_rank(WriteTask(str(tmp_dir), buffer.ref, layout.files, (buffer.slab_id,)))
    finally:
        buffer.release()
    metadata = planned.metadata
    metadata.storage_data = dict(layout.storage_data)
    metadata.version = CURRENT_DCP_VERSION
    return storage.commit(
        tmp_dir,
        final_dir,
        pickle.dumps(metadata),
        result.files,
        {"world_size": 1, "step": None, "save_token": planned.token},
    )


@pytest.mark.timeout(60)
def test_the_local_tier_writes_the_bytes_a_save_writes(tmp_path: Path) -> None:
    """A save through the tier's write and commit is a checkpoint that loads, verifies,
    and whose data file holds the records ``asyncckpt.save`` writes for the same state,
    with the same manifest segments; its temporary directory is gone after the commit."""
    state = _state()
    manifest = _save_through(LOCAL, state, tmp_path / "seam")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["seam"]
    asyncckpt.save(state, tmp_path / "api", async_op=False)
    seam, api = (tmp_path / "seam" / DATA).read_bytes(), (tmp_path / "api" / DATA).read_bytes()
    records = sorted((i.offset, i.length) for i in read_metadata(tmp_path / "seam").storage_data.values())
    assert len(seam) == len(api) and records == sorted(
        (i.offset, i.length) for i in read_metadata(tmp_path / "api").storage_data.values()
    )
    # Every record byte for byte (the alignment padding between records is not
    # written by the writer: a reused staging buffer leaves what it held there).
    assert [seam[o : o + n] for o, n in records] == [api[o : o + n] for o, n in records]
    assert asyncckpt.verify(tmp_path / "seam")["files"] == manifest["files"]
    theirs = LOCAL.read_manifest(tmp_path / "api")["files"][DATA]
    assert manifest["files"][DATA]["size"] == theirs["size"]
    assert [s[:2] for s in manifest["files"][DATA]["segments"]] == [s[:2] for s in theirs["segments"]]
    assert_same(state, asyncckpt.read_state_dict(tmp_path / "seam"))


def test_the_commit_refuses_to_replace_a_checkpoint(tmp_path: Path) -> None:
    state = _state()
    _save_through(LOCAL, state, tmp_path / "ck")
    with pytest.raises(FileExistsError):
        _save_through(LOCAL, state, tmp_path / "ck")


def test_a_discard_removes_the_temporary_directory_under_a_leftover_name(tmp_path: Path) -> None:
    """A failed save's temporary directory is renamed to ``.step_N.deleting-*`` (the name
    ``asyncckpt clean`` and ``CheckpointManager`` recognise) before it is removed; the
    discard of what is already gone, or of a directory whose parent is a file, raises
    nothing."""
    tmp = LOCAL.temporary_dir(tmp_path / "step_00000007", "0123abcd")
    assert parse_leftover(tmp.name) == (7, "tmp")
    tmp.mkdir()
    (tmp / DATA).write_bytes(b"x" * 100)
    thread = remove_checkpoint(tmp, background=True, best_effort=True)
    assert thread is not None
    doomed = thread.name.partition(":")[2]
    thread.join(30)
    assert parse_leftover(doomed) == (7, "deleting")
    assert list(tmp_path.iterdir()) == []
    LOCAL.discard(tmp)  # gone already
    blocker = tmp_path / "file"
    blocker.write_text("a regular file")
    LOCAL.discard(blocker / tmp.name)  # its parent is a file
    with pytest.raises(FileNotFoundError):
        remove_checkpoint(tmp)  # a checkpoint's removal (retention) does report it


def test_the_local_tier_is_picklable_and_torch_free(tmp_path: Path) -> None:
    """The write runs in the torch-free worker: the tier's bound write unpickles in a
    fresh interpreter without importing torch."""
    payload = pickle.dumps(LOCAL.write_rank)
    assert pickle.loads(payload).__self__ == LocalStorage()
    code = (
        "import pickle, sys; fn = pickle.loads(sys.stdin.buffer.read()); "
        "assert fn.__name__ == 'write_rank'; print('torch' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == "False"


class _Recording:
    """A tier over the local one that records the files the load side opens and can
    refuse one (``refuse``)."""

    def __init__(self, refuse: str | None = None) -> None:
        self.opened: list[str] = []
        self.refuse = refuse

    def __getattr__(self, name: str) -> Any:
        return getattr(LOCAL, name)

    def open_checkpoint(self, checkpoint_dir: str) -> Any:
        return _RecordingReader(self, LOCAL.open_checkpoint(checkpoint_dir))


class _RecordingReader:
    """The checkpoint reader of :class:`_Recording`: the local one, each file it opens
    (or reads whole) recorded."""

    def __init__(self, tier: _Recording, local: Any) -> None:
        self.tier, self.local, self.root = tier, local, local.root

    def _note(self, name: str) -> None:
        self.tier.opened.append(name)
        if name == self.tier.refuse:
            raise CorruptCheckpointError(f"{name} refused by the tier", name)

    def open(self, name: str) -> Any:
        self._note(name)
        return self.local.open(name)

    def read_bytes(self, name: str) -> bytes:
        self._note(name)
        return self.local.read_bytes(name)

    def file_size(self, name: str) -> int | None:
        return self.local.file_size(name)

    def close(self) -> None:
        self.local.close()

    def __enter__(self) -> _RecordingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.mark.timeout(60)
def test_the_load_side_reads_through_the_tier(tmp_path: Path) -> None:
    """``.metadata`` and every data file are opened through the tier given to the
    readers (DCP's path and the direct path); a tier that refuses a file fails the load."""
    state = _state()
    ckpt = tmp_path / "ck"
    asyncckpt.save(state, ckpt, async_op=False)

    tier = _Recording()
    metadata = read_metadata(ckpt, tier)
    assert tier.opened == [METADATA_NAME]

    tier = _Recording()
    out = clone_state(state)
    dcp.load(out, storage_reader=SafeFileSystemReader(ckpt, storage=tier), planner=SafeLoadPlanner())
    assert_same(state, out)
    assert METADATA_NAME in tier.opened and DATA in tier.opened

    tier = _Recording()
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": 0, "name": ""} for k, v in state.items()}
    plan = plan_direct_load(out, metadata)
    assert plan is not None
    direct_load(
        plan, str(ckpt), LOCAL.read_manifest(ckpt)["files"], decode=SafeLoadPlanner().decode_value, storage=tier
    )
    assert tier.opened == [DATA]
    assert_same(state, out)

    with pytest.raises(CorruptCheckpointError, match="refused by the tier"):
        direct_load(plan, str(ckpt), None, decode=SafeLoadPlanner().decode_value, storage=_Recording(DATA))
    with pytest.raises(CorruptCheckpointError, match="refused by the tier"):
        read_metadata(ckpt, _Recording(METADATA_NAME))
    assert LOCAL.exists(ckpt, MANIFEST_NAME) and not LOCAL.exists(ckpt, "absent")


def test_a_root_scan_names_every_directory_by_kind(tmp_path: Path) -> None:
    """``CheckpointRoot.scan`` (what ``asyncckpt ls`` and ``clean`` list): committed steps,
    uncommitted ``step_N``, temporary and deleting leftovers, other committed
    directories; never a symlink, never another hidden name."""
    root = CheckpointRoot(tmp_path / "root")
    state = {"w": torch.ones(4)}
    asyncckpt.save(state, root.path / "step_00000002", async_op=False)
    asyncckpt.save(state, root.path / "epoch=0-step=3.ckpt", async_op=False)
    (root.path / "step_00000005").mkdir()
    (root.path / ".step_00000006.tmp-0a1b").mkdir()
    (root.path / ".step_00000001.deleting-0a1b").mkdir()
    (root.path / ".hidden").mkdir()
    os.symlink(root.path / "step_00000002", root.path / "step_00000009")
    found = [(e.name, e.step, e.kind) for e in root.scan()]
    assert found == [
        (".step_00000001.deleting-0a1b", 1, "deleting"),
        (".step_00000006.tmp-0a1b", 6, "temporary"),
        ("epoch=0-step=3.ckpt", None, "committed"),
        ("step_00000002", 2, "committed"),
        ("step_00000005", 5, "uncommitted"),
    ]
    assert root.steps() == [2]
