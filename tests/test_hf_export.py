"""Hugging Face safetensors export and import (issue 33).

Export: ``asyncckpt.export_safetensors`` / ``asyncckpt export`` of a checkpoint of
scripts/train.py, of a 2-rank FSDP2 checkpoint (ours and stock ``dcp.save``), compared
with ``safetensors.torch.load_file``; its peak memory (a subprocess's high-water RSS).
Import: ``asyncckpt.load`` / ``read_state_dict`` of an exported directory, and hostile
directories (each a ``CorruptCheckpointError``).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import asyncckpt
from asyncckpt.errors import CorruptCheckpointError, InvalidArgumentError
from asyncckpt.export import parse_size

from dist_utils import preload_forkserver, run_ranks
from helpers import flip_byte, started_session

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "scripts" / "train.py"
TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--batch-size", "8"]
TINY += ["--data-mb", "0.002", "--dropout", "0", "--log-every", "100"]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))


def _run(cmd: list[str], cwd: Path, timeout: float = 120, env: dict[str, str] | None = None) -> str:
    with started_session(
        cmd, cwd=cwd, env={**_env(), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    ) as p:
        out, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"exit code {p.returncode}: {' '.join(cmd)}\n{out}"
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_bitwise(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(_bits(got[k]), _bits(v)), k


def _exported(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export, read with the safetensors library; the index checked:
    every tensor once, in the file it names, and ``total_size`` the tensors' bytes."""
    index_path = out / "model.safetensors.index.json"
    if not index_path.exists():
        return load_file(out / "model.safetensors")
    index = json.loads(index_path.read_text())
    got: dict[str, torch.Tensor] = {}
    files = sorted(set(index["weight_map"].values()))
    assert files == sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    for file in files:
        part = load_file(out / file)
        assert not set(part) & set(got), "a tensor in two shards"
        assert {k for k, f in index["weight_map"].items() if f == file} == set(part)
        got.update(part)
    assert set(got) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    return got


# ----------------------------------------------------------------------------- scripts/train.py
@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """scripts/train.py for 4 steps, a checkpoint at step 4: (its directory, the final params)."""
    d = tmp_path_factory.mktemp("train")
    _run([sys.executable, str(TRAIN), *TINY, "--steps", "4", "--ckpt-every", "4", "--save-final", "final.pt"], d)
    return d / "checkpoints" / "step_00000004", torch.load(d / "final.pt")


@pytest.mark.timeout(180)
def test_train_export_cli_is_bitwise_and_bf16_cast_equal(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    ckpt, final = trained
    # Small shards: several files and an index.
    out = _run([sys.executable, "-m", "asyncckpt", "export", str(ckpt), "hf", "--max-shard-size", "20KB"], tmp_path)
    assert "wrote" in out
    got = _exported(tmp_path / "hf")
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1
    _assert_bitwise(final, got)
    result = asyncckpt.export_safetensors(ckpt, tmp_path / "bf16", dtype="bf16")
    assert result.files == ["model.safetensors"]
    cast = _exported(tmp_path / "bf16")
    assert sorted(cast) == sorted(final)
    for k, v in final.items():
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert cast[k].dtype == want.dtype and torch.equal(_bits(cast[k]), _bits(want)), k


@pytest.mark.timeout(120)
def test_exported_directory_loads_into_a_fresh_state_bitwise(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    ckpt, final = trained
    asyncckpt.export_safetensors(ckpt, tmp_path / "hf", max_shard_size=30_000, rename=lambda n: "model." + n)
    fresh = {"model": {k: torch.zeros_like(v) for k, v in final.items()}}
    asyncckpt.load(fresh, tmp_path / "hf")  # names model.X: the nested state's flattened keys
    _assert_bitwise(final, fresh["model"])
    sd = asyncckpt.read_state_dict(tmp_path / "hf", strip_prefix="model.")
    _assert_bitwise(final, sd)
    # Into another dtype (a bf16 release into a float32 model): cast on load.
    asyncckpt.export_safetensors(ckpt, tmp_path / "bf16", dtype=torch.bfloat16)
    target = {k: torch.zeros_like(v) for k, v in final.items()}
    asyncckpt.load(target, tmp_path / "bf16")
    for k, v in final.items():
        want = v.to(torch.bfloat16).to(v.dtype) if v.is_floating_point() else v
        assert torch.equal(target[k], want), k
    # A key the directory lacks, and a shape that differs: refused, naming them.
    with pytest.raises(asyncckpt.CheckpointError, match="no tensor for"):
        asyncckpt.load({"nope": torch.zeros(1)}, tmp_path / "bf16")
    name = next(iter(final))
    with pytest.raises(asyncckpt.CheckpointError, match="shape"):
        asyncckpt.load({name: torch.zeros(1, 2, 3)}, tmp_path / "bf16")


@pytest.mark.timeout(120)
def test_export_checks_the_manifest_and_leaves_nothing_on_a_bad_checksum(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained[0], ckpt)
    data = ckpt / "__0_0.distcp"
    flip_byte(data, data.stat().st_size // 2)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        asyncckpt.export_safetensors(ckpt, tmp_path / "hf", max_shard_size="10KB")
    assert not (tmp_path / "hf").exists()  # created by the call: removed
    # Arguments and an existing export are refused before anything is read.
    asyncckpt.export_safetensors(trained[0], tmp_path / "ok")
    with pytest.raises(InvalidArgumentError, match="already holds an export"):
        asyncckpt.export_safetensors(trained[0], tmp_path / "ok")
    with pytest.raises(InvalidArgumentError, match="no tensor under the key"):
        asyncckpt.export_safetensors(trained[0], tmp_path / "k", key="nothing")
    with pytest.raises(InvalidArgumentError, match="both map to"):
        asyncckpt.export_safetensors(trained[0], tmp_path / "r", rename=lambda n: "same")


def test_cli_key_strip_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from asyncckpt.cli import main

    net = {"net.w": torch.randn(3, 4), "net.b": torch.arange(3), "head.w": torch.randn(2, 3)}
    state = {"app": {"model": net, "opt": {"lr": torch.tensor(0.1)}}, "step": 7}
    asyncckpt.save(state, tmp_path / "ckpt").result(timeout=60)
    args = ["export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--key", "app.model", "--strip", "net."]
    assert main([*args, "--json", "--dtype", "fp16"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["files"] == ["model.safetensors"] and doc["tensors"] == 3 and doc["warnings"] == []
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == ["b", "head.w", "w"]
    assert torch.equal(got["w"], net["net.w"].half()) and torch.equal(got["b"], net["net.b"])  # ints not cast
    # A usage problem is exit status 1 with a message (the export exists already; a bad size).
    assert main(args) == 1
    assert "already holds an export" in capsys.readouterr().err
    assert main([*args[:2], str(tmp_path / "hf2"), "--max-shard-size", "lots"]) == 1
    assert "cannot read the size" in capsys.readouterr().err


def test_parse_size_as_huggingface_hub() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("256MiB") == 256 * 2**20
    assert parse_size("500mb") == 500 * 10**6
    assert parse_size(1234) == 1234
    for bad in ("5 parsecs", "-1GB", 0, "GB"):
        with pytest.raises(InvalidArgumentError):
            parse_size(bad)


# ----------------------------------------------------------------------------- FSDP2 on 2 ranks
def _fsdp_model(seed: int) -> torch.nn.Module:
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    # Uneven shards (dims 3 and 1: a rank holds an empty chunk) and a 2-d chunking of rows.
    model = nn.Sequential(nn.Linear(64, 130), nn.ReLU(), nn.Linear(130, 3), nn.Linear(3, 1))
    for layer in model.children():
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _rank_save_fsdp(rank: int, world_size: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    torch.set_num_threads(1)
    model = _fsdp_model(0)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 64)).square().mean().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    full, _ = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, Path(root) / "full.pt")
    asyncckpt.save({"model": msd, "optim": osd, "step": 1}, Path(root) / "ours").result(timeout=60)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(Path(root) / "stock"))


def _rank_load_hf(rank: int, world_size: int, root: str) -> None:
    """A fresh FSDP2 model (other weights) loads the export: each rank its DTensor shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    torch.set_num_threads(1)
    model = _fsdp_model(1)
    msd = get_model_state_dict(model)
    asyncckpt.load(msd, Path(root) / "hf_ours")
    set_model_state_dict(model, msd)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, Path(root) / "loaded.pt")


@pytest.mark.timeout(180)
def test_fsdp2_checkpoint_of_two_ranks_exports_the_gathered_tensors_and_loads_back(tmp_path: Path) -> None:
    preload_forkserver()
    run_ranks(_rank_save_fsdp, 2, str(tmp_path), timeout=150, start_method="forkserver")
    full = torch.load(tmp_path / "full.pt")
    assert len(list((tmp_path / "ours").glob("*.distcp"))) == 2
    asyncckpt.export_safetensors(tmp_path / "ours", tmp_path / "hf_ours", max_shard_size="4KiB")
    _assert_bitwise(full, _exported(tmp_path / "hf_ours"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncckpt.export_safetensors(tmp_path / "stock", tmp_path / "hf_stock")
    assert any("without checksum verification" in str(w.message) for w in caught)
    _assert_bitwise(full, _exported(tmp_path / "hf_stock"))
    # HF -> FSDP2 on 2 ranks: the DTensor shards of a fresh model, gathered, are the export's.
    run_ranks(_rank_load_hf, 2, str(tmp_path), timeout=150, start_method="forkserver")
    _assert_bitwise(full, torch.load(tmp_path / "loaded.pt"))


# ----------------------------------------------------------------------------- bounded memory
_PEAK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import psutil, torch, asyncckpt
    from asyncckpt.export import export_safetensors
    from asyncckpt.loading.tensors import CheckpointTensors
    CheckpointTensors(sys.argv[1]).close()  # imports and metadata: in the baseline
    base = psutil.Process().memory_info().rss
    export_safetensors(sys.argv[1], sys.argv[2], max_shard_size=int(sys.argv[3]))
    # VmHWM: this process image's high-water RSS (ru_maxrss would carry the forking
    # parent's over the exec).
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"base": base, "peak": peak}))
    """
)


def _peak_of_export(tmp_path: Path, total: int, shard: int) -> None:
    """Save ``total`` bytes in 16 MiB tensors, export with ``shard``-byte shards in a
    subprocess: its high-water RSS (the kernel's VmHWM) stays under its baseline RSS
    (psutil, after the imports) + 2 shards (+ slack), far below the whole model."""
    n = total // (16 << 20)
    state = {"model": {f"layer{i}.weight": torch.full((4 << 20,), float(i)) for i in range(n)}}
    asyncckpt.save(state, tmp_path / "ckpt").result(timeout=120)
    del state
    # glibc's malloc serves the 16 MiB tensors from its heaps once its dynamic mmap
    # threshold has grown, and a freed chunk there can stay in the process (the reader
    # thread's arena, fragmentation): the high-water RSS then varied with the threads'
    # timing (130 MiB here alone, 177 MiB once in the loaded suite). A fixed 1 MiB
    # threshold maps each tensor and unmaps it when freed, so the peak is the live bytes.
    out = _run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path / "ckpt"), str(tmp_path / "hf"), str(shard)],
        tmp_path,
        timeout=240,
        env={"MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
    )
    found = json.loads(out.strip().splitlines()[-1])
    grown = found["peak"] - found["base"]
    print(f"export of {total >> 20} MiB, {shard >> 20} MiB shards: peak RSS grew by {grown / 2**20:.0f} MiB")
    # Two shards (one written while the next is read) and the allocator's slack (freed
    # tensors of the heap are not all returned at once): a quarter shard, 32 MiB at least.
    slack = max(32 << 20, shard // 4)
    assert grown < 2 * shard + slack, f"peak RSS grew by {grown >> 20} MiB for {shard >> 20} MiB shards"
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == n * (16 << 20)
    assert len(set(index["weight_map"].values())) == total // shard


@pytest.mark.timeout(300)
def test_export_peak_memory_is_about_two_shards(tmp_path: Path) -> None:
    _peak_of_export(tmp_path, 256 << 20, 64 << 20)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ASYNCCKPT_LONG") != "1", reason="set ASYNCCKPT_LONG=1 (writes 2 GiB, ~30 s)")
@pytest.mark.timeout(600)
def test_export_peak_memory_of_1gib_with_256mib_shards(tmp_path: Path) -> None:
    _peak_of_export(tmp_path, 1 << 30, 256 << 20)


# ----------------------------------------------------------------------------- hostile directories
def _file(header: dict[str, Any], data: bytes, raw_header: bytes | None = None) -> bytes:
    head = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


def _good(tmp_path: Path) -> Path:
    d = tmp_path / "hf"
    d.mkdir()
    save_file({"a": torch.arange(4, dtype=torch.float32)}, d / "model-00001-of-00002.safetensors")
    save_file({"b": torch.ones(2, 3)}, d / "model-00002-of-00002.safetensors")
    index = {
        "metadata": {"total_size": 40},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


def _set_index(d: Path, weight_map: dict[str, str]) -> None:
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_a_good_sharded_directory_reads(tmp_path: Path) -> None:
    sd = asyncckpt.read_state_dict(_good(tmp_path))
    assert torch.equal(sd["a"], torch.arange(4, dtype=torch.float32)) and torch.equal(sd["b"], torch.ones(2, 3))


def test_a_directory_of_dcps_huggingface_storage_writer_reads(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    # (floating only: its consolidation calls torch.finfo on every dtype)
    sd = {"a.w": torch.randn(5, 3), "b": torch.randn(7).half(), "c": torch.randn(2).to(torch.bfloat16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "torch.distributed is disabled" (one process, intended)
        writer = HuggingFaceStorageWriter(
            str(tmp_path / "hf"),
            fqn_to_index_mapping={"a.w": 1, "b": 2, "c": 2},
            save_distributed=True,
            enable_consolidation=True,
        )
        dcp.save(sd, storage_writer=writer)
    _assert_bitwise(sd, asyncckpt.read_state_dict(tmp_path / "hf"))


def _refused(d: Path, match: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=match):
        asyncckpt.read_state_dict(d)
    with pytest.raises(CorruptCheckpointError, match=match):
        asyncckpt.load({"a": torch.zeros(4)}, d)


def test_hostile_index_parent_path(tmp_path: Path) -> None:
    d = _good(tmp_path)
    save_file({"b": torch.ones(2, 3)}, tmp_path / "outside.safetensors")
    _set_index(d, {"a": "model-00001-of-00002.safetensors", "b": "../outside.safetensors"})
    _refused(d, "outside the directory")


def test_hostile_index_absolute_path(tmp_path: Path) -> None:
    d = _good(tmp_path)
    _set_index(d, {"a": "model-00001-of-00002.safetensors", "b": str(d / "model-00002-of-00002.safetensors")})
    _refused(d, "outside the directory")


def test_hostile_shard_symlink(tmp_path: Path) -> None:
    d = _good(tmp_path)
    save_file({"b": torch.ones(2, 3)}, tmp_path / "elsewhere.safetensors")
    (d / "model-00002-of-00002.safetensors").unlink()
    (d / "model-00002-of-00002.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    _refused(d, "symlink")


def test_hostile_index_symlink(tmp_path: Path) -> None:
    d = _good(tmp_path)
    (tmp_path / "index.json").write_text((d / "model.safetensors.index.json").read_text())
    (d / "model.safetensors.index.json").unlink()
    (d / "model.safetensors.index.json").symlink_to(tmp_path / "index.json")
    _refused(d, "symlink")


def test_hostile_offsets_not_matching_dtype_and_shape(tmp_path: Path) -> None:
    d = tmp_path / "one"
    d.mkdir()
    (d / "model.safetensors").write_bytes(
        _file({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"x" * 12)
    )
    _refused(d, "needs 16 bytes")


def test_hostile_overlapping_data(tmp_path: Path) -> None:
    d = tmp_path / "one"
    d.mkdir()
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    (d / "model.safetensors").write_bytes(_file(header, b"x" * 12))
    _refused(d, "overlaps")


def test_hostile_data_out_of_the_file(tmp_path: Path) -> None:
    d = tmp_path / "one"
    d.mkdir()
    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    (d / "model.safetensors").write_bytes(_file(header, b"x" * 8))
    _refused(d, "data section has 8 bytes")


def test_hostile_header_larger_than_the_file(tmp_path: Path) -> None:
    d = tmp_path / "one"
    d.mkdir()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    _refused(d, "does not fit the file")


def test_hostile_duplicate_names_in_a_header(tmp_path: Path) -> None:
    d = tmp_path / "one"
    d.mkdir()
    entry = '{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    (d / "model.safetensors").write_bytes(_file({}, b"x" * 4, f'{{"a": {entry}, "a": {entry}}}'.encode()))
    _refused(d, "appears twice")


def test_hostile_tensor_in_two_shards(tmp_path: Path) -> None:
    d = _good(tmp_path)
    save_file({"a": torch.zeros(4), "b": torch.ones(2, 3)}, d / "model-00002-of-00002.safetensors")
    _refused(d, "does not place in it")


def test_hostile_index_names_a_tensor_the_file_lacks(tmp_path: Path) -> None:
    d = _good(tmp_path)
    _set_index(
        d,
        {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors",
        },
    )
    _refused(d, "whose header does not have it")


def test_hostile_unknown_dtype_and_malformed_json(tmp_path: Path) -> None:
    d = tmp_path / "one"
    d.mkdir()
    (d / "model.safetensors").write_bytes(
        _file({"a": {"dtype": "PICKLE", "shape": [1], "data_offsets": [0, 4]}}, b"x" * 4)
    )
    _refused(d, "malformed header entry")
    (d / "model.safetensors").write_bytes(_file({}, b"", b"{not json"))
    _refused(d, "not JSON")
    (tmp_path / "x").mkdir()
    d2 = _good(tmp_path / "x")
    (d2 / "model.safetensors.index.json").write_text('{"weight_map": []}')
    _refused(d2, "no weight_map")


def test_a_manager_starts_a_fresh_run_from_a_safetensors_directory(tmp_path: Path) -> None:
    """``CheckpointManager.load(state, initial=hf_dir)``: a fresh run loads the release
    and returns -1 (the step before the first); a resumed run loads its newest step."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    release = {"weight": torch.randn(8, 4, generator=g), "bias": torch.randn(8, generator=g)}
    (tmp_path / "hf").mkdir()
    save_file(release, str(tmp_path / "hf" / "model.safetensors"))
    with asyncckpt.CheckpointManager(tmp_path / "root", persistent=False) as manager:
        state = {"weight": torch.zeros(8, 4), "bias": torch.zeros(8)}
        with pytest.raises(asyncckpt.CheckpointNotFoundError):
            manager.load(state)
        assert manager.load(state, initial=tmp_path / "hf") == -1
        assert all(torch.equal(state[k], release[k]) for k in release)
        state["bias"] += 1
        manager.save(0, state, async_op=False)
    with asyncckpt.CheckpointManager(tmp_path / "root", persistent=False) as manager:
        resumed = {"weight": torch.zeros(8, 4), "bias": torch.zeros(8)}
        assert manager.load(resumed, initial=tmp_path / "hf") == 0
        assert torch.equal(resumed["bias"], release["bias"] + 1)
