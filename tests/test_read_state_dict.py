"""``asyncckpt.read_state_dict``: a whole checkpoint into a new nested dict, no template.

Checkpoints are real: written by ``asyncckpt.save`` (synchronously, with a forked child
per call: no worker left behind) and by stock ``torch.distributed.checkpoint.save``;
one is written by two gloo ranks with sharded DTensors and read back, whole, by one of
them while the process group exists. The ``convert`` command runs as a real subprocess.
"""

from __future__ import annotations

import datetime
import io
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import asyncckpt
from asyncckpt import AsyncCallsQueue, CheckpointError, CorruptCheckpointError, read_state_dict
from asyncckpt.format import manifest as commit
from asyncckpt.loading.metadata import read_metadata

from helpers import assert_same, flip_byte

DATA = "__0_0.distcp"


def nested_state(seed: int = 0) -> dict[str, Any]:
    """A model and an optimizer-like nesting, several dtypes, values, a list."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "encoder.weight": torch.randn(16, 8, generator=g),
            "encoder.bias": torch.randn(16, generator=g).to(torch.float16),
            "head.weight": torch.randn(4, 16, generator=g).to(torch.bfloat16),
            "embed": torch.randint(-100, 100, (10, 3), generator=g, dtype=torch.int64),
            "mask": torch.rand(7, generator=g) > 0.5,
            "codes": torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
            "small": torch.randint(-128, 127, (3, 3), generator=g, dtype=torch.int8),
            "phase": torch.randn(5, generator=g, dtype=torch.complex64),
            "scale": torch.tensor(2.5, dtype=torch.float64),  # 0-dim
            "nothing": torch.empty(0, 4),
        },
        "optim": {
            "state": {
                "0": {"step": torch.tensor(12.0), "exp_avg": torch.randn(16, 8, generator=g)},
                "1": {"step": torch.tensor(12.0), "exp_avg": torch.randn(16, generator=g)},
            },
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1], "name": None}],
        },
        "history": [torch.full((2,), 1.5), 7, "warmup"],
        "epoch": 3,
        "loss": 0.125,
        "tag": "run-7",
        "flags": {"resumed": True, "notes": b"\x00raw"},
    }


@pytest.fixture
def saved(tmp_path: Path, temporal_queue: AsyncCallsQueue) -> tuple[Path, dict[str, Any]]:
    state = nested_state()
    ckpt = tmp_path / "ckpt"
    asyncckpt.save(state, ckpt, async_op=False, calls_queue=temporal_queue)
    return ckpt, state


def stock_dcp_save(state: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


# ----------------------------------------------------------------------------- round trips
def test_round_trip_of_a_nested_state_is_bitwise(saved: tuple[Path, dict[str, Any]]) -> None:
    ckpt, state = saved
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a committed checkpoint: no warning
        got = read_state_dict(ckpt)
    assert_same(state, got)
    assert all(t.device.type == "cpu" for t in got["model"].values())
    # Each tensor has memory of its own: writing to one changes nothing else.
    got["model"]["embed"].zero_()
    assert_same(state["model"]["encoder.weight"], got["model"]["encoder.weight"])
    assert_same(state, read_state_dict(ckpt, verify=False))
    # The same structure as stock DCP's own converter gives.
    ref = ckpt.parent / "ref.pt"
    dcp_to_torch_save(ckpt, ref)
    assert_same(torch.load(ref, weights_only=True), read_state_dict(ckpt))


def test_stock_dcp_checkpoint_reads_back_with_a_warning(tmp_path: Path) -> None:
    state = nested_state(1)
    ckpt = tmp_path / "stock"
    stock_dcp_save(state, ckpt)
    assert not (ckpt / commit.MANIFEST_NAME).exists()
    with pytest.warns(UserWarning, match="checksums were not verified"):
        got = read_state_dict(ckpt)
    assert_same(state, got)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # verify=False asked for no check: nothing to warn about
        assert_same(state, read_state_dict(ckpt, verify=False))


def test_missing_or_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        read_state_dict(tmp_path / "nope")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(NotADirectoryError):
        read_state_dict(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata"), pytest.warns(UserWarning):
        read_state_dict(tmp_path / "empty")


# ----------------------------------------------------------------------------- failures
def test_corrupted_byte_is_refused(saved: tuple[Path, dict[str, Any]]) -> None:
    ckpt, _ = saved
    os.chmod(ckpt / DATA, 0o644)
    flip_byte(ckpt / DATA, (ckpt / DATA).stat().st_size // 2)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as info:
        read_state_dict(ckpt)
    assert info.value.path == str(ckpt / DATA)


def test_pickled_object_needs_allow_pickle(tmp_path: Path, temporal_queue: AsyncCallsQueue) -> None:
    state = {"w": torch.ones(3), "meta": {"when": datetime.date(2024, 5, 6)}}
    ours, stock = tmp_path / "ours", tmp_path / "stock"
    asyncckpt.save(state, ours, async_op=False, calls_queue=temporal_queue)
    stock_dcp_save(state, stock)
    for ckpt in (ours, stock):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(CheckpointError, match=r"'meta\.when'.*allow_pickle=True"):
                read_state_dict(ckpt)
            with torch.serialization.safe_globals([datetime.date]):  # or allowlist the class
                assert_same(state, read_state_dict(ckpt))
            assert_same(state, read_state_dict(ckpt, allow_pickle=True))


def test_crafted_metadata_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "stock"
    stock_dcp_save({"a": {"b": torch.ones(2)}, "n": 1}, ckpt)
    marker = tmp_path / "pwned"
    metadata = read_metadata(ckpt)

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    # planner_data that puts an entry below another one's value
    metadata.planner_data["a.b"] = ("n", "b")
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CorruptCheckpointError, match="planner_data is inconsistent"), pytest.warns(UserWarning):
        read_state_dict(ckpt)
    # a list index far beyond the number of entries (would allocate a huge list)
    metadata.planner_data["a.b"] = ("a", 10**12)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CorruptCheckpointError, match="malformed planner_data"), pytest.warns(UserWarning):
        read_state_dict(ckpt)
    # code in the metadata pickle never runs
    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CorruptCheckpointError, match="not allowed"), pytest.warns(UserWarning):
        read_state_dict(ckpt)
    assert not marker.exists()


# ----------------------------------------------------------------------------- sharded, with a process group
def _save_sharded_then_read_on_rank0(rank: int, world_size: int, root: str) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)  # uneven shards: 4 + 3 rows
    state = {"model": {"w": distribute_tensor(full, mesh, [Shard(0)])}, "step": 5}
    asyncckpt.save(state, Path(root) / "sharded", async_op=False, calls_queue=AsyncCallsQueue(persistent=False))
    got = None
    if rank == 0:  # one rank alone, the group initialized: no collective may be issued
        buf = io.BytesIO()
        torch.save(read_state_dict(Path(root) / "sharded"), buf)
        got = buf.getvalue()  # bytes: tensors through a multiprocessing queue would be shared memory
    dist.barrier()
    return got


def test_sharded_checkpoint_reads_whole_in_one_rank(tmp_path: Path) -> None:
    from dist_utils import preload_forkserver, run_ranks

    preload_forkserver()  # ranks fork from a server that imported torch once (shared with test_sharded.py)
    blob, _ = run_ranks(_save_sharded_then_read_on_rank0, 2, str(tmp_path), timeout=90, start_method="forkserver")
    got = torch.load(io.BytesIO(blob), weights_only=True)
    assert_same({"model": {"w": torch.arange(21, dtype=torch.float32).reshape(7, 3)}, "step": 5}, got)
    assert sorted(p.name for p in (tmp_path / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


# ----------------------------------------------------------------------------- the convert command
def test_cli_convert_of_a_stock_dcp_checkpoint(tmp_path: Path) -> None:
    state = nested_state(2)
    ckpt, out, ref = tmp_path / "stock", tmp_path / "model.pt", tmp_path / "ref.pt"
    stock_dcp_save(state, ckpt)
    env = {k: v for k, v in os.environ.items() if k != "ASYNCCKPT_FAULT"}
    proc = subprocess.run(
        [sys.executable, "-m", "asyncckpt", "convert", str(ckpt), str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out}" in proc.stdout
    assert "asyncckpt: warning:" in proc.stderr and "checksums were not verified" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    got = torch.load(out, weights_only=True)
    assert_same(state, got)
    dcp_to_torch_save(ckpt, ref)  # what torch's own converter makes of it
    assert_same(torch.load(ref, weights_only=True), got)
