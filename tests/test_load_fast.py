"""The direct load path (``asyncckpt.load`` without DCP's load planner, issue #11 item 5).

Each test checks which path a load took (``helpers.observing_loads``) and compares
the result bitwise with stock ``dcp.load`` of the same checkpoint: nested dicts, many
small tensors, mixed dtypes, non-tensor values, non-contiguous targets; a corrupt byte
is refused before any target is written; anything unusual (a partial load, a missing
key, another shape) goes DCP's way with DCP's errors; two gloo ranks agree on the path.
"""

from __future__ import annotations

import gc
import io
import itertools
import json
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import asyncckpt
from asyncckpt import CheckpointError, CorruptCheckpointError
from asyncckpt.format import manifest as _manifest
from asyncckpt.format.records import RECORDS_NAME, parse_records, records_from_metadata
from asyncckpt.loading.dcp import SafeLoadPlanner
from asyncckpt.loading.direct import direct_load, plan_direct_load
from asyncckpt.loading.metadata import read_metadata

from dist_utils import run_ranks
from helpers import assert_same, flip_byte, observing_loads, resign

DATA = "__0_0.distcp"


def make_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "model": {
            "emb": torch.randn(300, 64, generator=g),
            "ln": {"weight": torch.randn(64, generator=g).half(), "bias": torch.randn(64, generator=g).bfloat16()},
            "ids": torch.randint(-(2**40), 2**40, (33,), generator=g),
            "mask": torch.rand(17, generator=g) > 0.5,
            "big": torch.randn(1 << 19, generator=g),  # 2 MiB: a manifest segment of its own
            "scalar": torch.tensor(3.5, dtype=torch.float64),
            "empty": torch.zeros(0, 4),
        },
        "optim": {
            "state": {"emb": {"step": torch.tensor(12.0), "exp_avg": torch.randn(300, 64, generator=g)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": ["emb"]}],
        },
        "many": {f"t{i}": torch.randn(5 + i % 7, generator=g) for i in range(1500)},
        "step": 41,
        "name": "run-a",
    }


def fresh(sd: Any) -> Any:
    """The same structure with every tensor zeroed and every value replaced."""
    if isinstance(sd, dict):
        return {k: fresh(v) for k, v in sd.items()}
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, list):
        return [fresh(v) for v in sd]
    return {"int": -1, "str": "?", "float": -1.0, "tuple": ()}.get(type(sd).__name__, None)


def stock_load(ckpt: Path, template: Any) -> Any:
    out = fresh(template)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, checkpoint_id=str(ckpt), no_dist=True)
    return out


@pytest.fixture
def ckpt(tmp_path: Path, temporal_queue: Any) -> Path:
    path = tmp_path / "ck"
    asyncckpt.save(make_state(), path, calls_queue=temporal_queue)
    return path


def counted_load(out: Any, ckpt: Path, **kwargs: Any) -> str:
    """Load and return the path it took."""
    with observing_loads() as loads:
        asyncckpt.load(out, ckpt, **kwargs)
    taken = [k for k, v in loads.paths().items() if v]
    assert len(taken) == 1 and loads.paths()[taken[0]] == 1, loads.paths()
    return taken[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("verify", [True, False, "inline"])
def test_direct_path_equals_dcp_bitwise(ckpt: Path, verify: bool) -> None:
    state = make_state()
    out = fresh(state)
    keep = {id(t): t for t in (out["model"]["emb"], out["many"]["t3"])}
    assert counted_load(out, ckpt, verify=verify) == "direct"
    assert_same(state, out)
    assert_same(stock_load(ckpt, state), out)
    # In place: the given tensors were filled, not replaced.
    assert out["model"]["emb"] is keep[id(out["model"]["emb"])] and out["many"]["t3"] is keep[id(out["many"]["t3"])]


@pytest.mark.timeout(120)
def test_noncontiguous_and_parameter_targets(ckpt: Path) -> None:
    state = make_state()
    out = fresh(state)
    out["model"]["emb"] = torch.zeros(64, 300).t()  # non-contiguous, same shape
    out["optim"]["state"]["emb"]["exp_avg"] = torch.nn.Parameter(torch.zeros(300, 64), requires_grad=True)
    assert not out["model"]["emb"].is_contiguous()
    assert counted_load(out, ckpt) == "direct"
    assert_same(state["model"], out["model"])
    assert torch.equal(out["optim"]["state"]["emb"]["exp_avg"].detach(), state["optim"]["state"]["emb"]["exp_avg"])


@pytest.mark.timeout(120)
def test_corrupt_byte_refused_before_any_target_is_written(ckpt: Path) -> None:
    manifest = _manifest.read_manifest(ckpt)
    big = next(s for s in manifest["files"][DATA]["segments"] if s[1] == 4 << 19)  # model.big's data
    flip_byte(ckpt / DATA, big[0] + 1000)
    out = fresh(make_state())
    with pytest.raises(CorruptCheckpointError) as info:
        asyncckpt.load(out, ckpt, verify=True)  # checked first: a refused load changes nothing
    assert DATA in str(info.value) and info.value.path is not None and info.value.path.endswith(DATA)
    assert not out["model"]["big"].any() and not out["many"]["t0"].any() and out["step"] == -1
    # The default checks in the same pass ("inline"): refused all the same, and says that
    # tensors may hold bytes of the checkpoint; non-tensor values are never placed.
    out = fresh(make_state())
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as info:
        asyncckpt.load(out, ckpt)
    assert "may already hold bytes of this checkpoint" in str(info.value) and out["step"] == -1


@pytest.mark.timeout(120)
def test_inline_verification_refuses_a_corrupt_byte(ckpt: Path) -> None:
    """``verify="inline"``: one pass; the mismatch names the file and the entry."""
    manifest = _manifest.read_manifest(ckpt)
    big = next(s for s in manifest["files"][DATA]["segments"] if s[1] == 4 << 19)
    flip_byte(ckpt / DATA, big[0] + 1000)
    out = fresh(make_state())
    with pytest.raises(CorruptCheckpointError) as info:
        counted_load(out, ckpt, verify="inline")
    assert "checksum mismatch" in str(info.value) and "'model.big'" in str(info.value)
    assert (
        info.value.path is not None and info.value.path.endswith(DATA) and out["step"] == -1
    )  # values are placed last
    # Also when DCP's path is taken (a partial load): checked first, as verify=True.
    part = {"model": fresh(make_state()["model"])}
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        counted_load(part, ckpt, verify="inline")
    assert not part["model"]["big"].any()
    with pytest.raises(ValueError, match="verify"):
        asyncckpt.load(out, ckpt, verify="yes")  # type: ignore[arg-type]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "read_bytes,iov_max",
    [(5000, 1024), (64 << 20, 3), (1 << 20, 1)],
    ids=["odd-call-size", "few-buffers-per-call", "one-buffer-per-call"],
)
def test_reads_gathered_across_records_and_segments(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, read_bytes: int, iov_max: int
) -> None:
    """A file's reads are gathered into ``preadv`` calls across records and manifest
    segments: calls that end inside a segment, or a buffer, and calls cut by the buffer
    limit load bitwise, and a flipped byte is still found in its segment."""
    from asyncckpt.loading import direct as reader

    monkeypatch.setattr(reader, "_READ_BYTES", read_bytes)
    monkeypatch.setattr(reader, "_IOV_MAX", iov_max)
    state = make_state()
    for verify in (False, "inline"):
        out = fresh(state)
        assert counted_load(out, ckpt, verify=verify) == "direct"
        assert_same(state, out)
    manifest = _manifest.read_manifest(ckpt)
    big = next(s for s in manifest["files"][DATA]["segments"] if s[1] == 4 << 19)
    flip_byte(ckpt / DATA, big[0] + big[1] - 7)
    with pytest.raises(CorruptCheckpointError) as info:
        asyncckpt.load(fresh(state), ckpt, verify="inline")
    assert f"bytes [{big[0]}, {big[0] + big[1]})" in str(info.value) and "'model.big'" in str(info.value)


@pytest.mark.timeout(120)
def test_inline_verification_covers_the_bytes_between_records(ckpt: Path) -> None:
    """Alignment gaps between records are read and checksummed too: nonzero gap bytes
    (re-signed in the manifest) load; a flipped gap byte is refused."""
    md = read_metadata(ckpt)
    spans = sorted((i.offset, i.offset + i.length) for i in md.storage_data.values())
    gaps = [(a_end, b_start) for (_, a_end), (b_start, _) in itertools.pairwise(spans) if b_start > a_end]
    assert len(gaps) > 10
    content = bytearray((ckpt / DATA).read_bytes())
    for lo, hi in gaps:
        content[lo:hi] = bytes(range(1, hi - lo + 1))
    (ckpt / DATA).write_bytes(bytes(content))
    manifest = json.loads((ckpt / ".manifest.json").read_text())
    manifest["files"][DATA]["segments"] = [
        [o, n, zlib.crc32(content[o : o + n])] for o, n, _ in manifest["files"][DATA]["segments"]
    ]
    (ckpt / ".manifest.json").write_text(json.dumps(manifest))
    state = make_state()
    out = fresh(state)
    assert counted_load(out, ckpt, verify="inline") == "direct"
    assert_same(state, out)
    flip_byte(ckpt / DATA, gaps[len(gaps) // 2][0])
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        asyncckpt.load(fresh(state), ckpt, verify="inline")


@pytest.mark.timeout(120)
def test_direct_load_checks_crcs_of_what_it_reads(ckpt: Path) -> None:
    """``direct_load`` with the manifest: a flipped byte names the file and the entry."""
    manifest = _manifest.read_manifest(ckpt)
    big = next(s for s in manifest["files"][DATA]["segments"] if s[1] == 4 << 19)
    state = make_state()
    out = fresh(state)
    plan = plan_direct_load(out, read_metadata(ckpt))
    assert plan is not None
    direct_load(plan, str(ckpt), manifest["files"], decode=SafeLoadPlanner().decode_value)
    assert_same(state, out)  # the checked read of a sound checkpoint
    flip_byte(ckpt / DATA, big[0] + 1000)
    plan = plan_direct_load(fresh(state), read_metadata(ckpt))
    assert plan is not None
    with pytest.raises(CorruptCheckpointError) as info:
        direct_load(plan, str(ckpt), manifest["files"], decode=SafeLoadPlanner().decode_value)
    assert "checksum mismatch" in str(info.value) and "'model.big'" in str(info.value) and DATA in str(info.value)


@pytest.mark.timeout(120)
def test_unusual_states_go_dcps_way(ckpt: Path) -> None:
    state = make_state()
    # A partial load (the checkpoint has more keys): DCP's planner, same result.
    part = {"model": fresh(state["model"])}
    assert counted_load(part, ckpt) == "dcp"
    assert_same(state["model"], part["model"])
    # A key the checkpoint lacks: DCP's error, naming it.
    out = fresh(state)
    out["model"]["extra"] = torch.zeros(3)
    with observing_loads() as loads, pytest.raises(CheckpointError, match=r"model\.extra"):
        asyncckpt.load(out, ckpt)
    assert loads.paths() == {"direct": 0, "dcp": 1}
    # Another shape: refused by DCP, naming the entry.
    out = fresh(state)
    out["model"]["emb"] = torch.zeros(301, 64)
    with observing_loads() as loads, pytest.raises(CheckpointError, match=r"model\.emb"):
        asyncckpt.load(out, ckpt)
    assert loads.paths() == {"direct": 0, "dcp": 1}
    # Tied targets (one tensor under two keys): DCP's order of writes decides.
    out = fresh(state)
    out["optim"]["state"]["emb"]["exp_avg"] = out["model"]["emb"]
    assert counted_load(out, ckpt) == "dcp"


@pytest.mark.timeout(120)
def test_a_value_needing_pickle_leaves_the_state_unchanged(tmp_path: Path, temporal_queue: Any) -> None:
    path = tmp_path / "ck"
    state: dict[str, Any] = {"w": torch.randn(1 << 18), "cfg": io.StringIO}  # a class: weights_only refuses it
    asyncckpt.save(state, path, calls_queue=temporal_queue)
    out: dict[str, Any] = {"w": torch.zeros(1 << 18), "cfg": None}
    with pytest.raises(CheckpointError, match="'cfg'"):
        counted_load(out, path)
    assert not out["w"].any() and out["cfg"] is None
    assert counted_load(out, path, allow_pickle=True) == "direct"
    assert torch.equal(out["w"], state["w"]) and out["cfg"] is io.StringIO


def _rank_load(rank: int, world_size: int, ckpt: str, odd_rank: int) -> dict[str, Any]:
    state = make_state()
    out = fresh(state)
    if rank == odd_rank:
        out = {"model": out["model"]}  # a partial load on this rank: every rank must go DCP's way
    with observing_loads() as loads:
        asyncckpt.load(out, ckpt)
    assert_same(state["model"], out["model"])
    if rank != odd_rank:
        assert_same(state, out)
    return loads.paths()


@pytest.mark.timeout(180)
def test_two_ranks_agree_on_the_path(ckpt: Path) -> None:
    both = run_ranks(_rank_load, 2, str(ckpt), -1, timeout=120, start_method="forkserver")
    assert [r.get("direct", 0) for r in both] == [1, 1], both
    mixed = run_ranks(_rank_load, 2, str(ckpt), 1, timeout=120, start_method="forkserver")
    assert [r.get("dcp", 0) for r in mixed] == [1, 1] and [r.get("direct", 0) for r in mixed] == [0, 0], mixed


@pytest.fixture
def gc_watch() -> Any:
    """Count the cyclic collections that start, with every allocation triggering one
    (threshold 1), restoring the collector's state and thresholds afterwards."""
    import gc

    started: list[int] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(info["generation"])

    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    gc.callbacks.append(on_gc)
    gc.set_threshold(1, 1, 1)
    try:
        yield started
    finally:
        gc.callbacks.remove(on_gc)
        gc.set_threshold(*thresholds)
        (gc.enable if enabled else gc.disable)()


@pytest.mark.timeout(120)
def test_the_direct_path_runs_without_cyclic_collections(ckpt: Path, gc_watch: list[int]) -> None:
    """Its thousands of metadata objects trigger no collection in the middle of the
    reads (a full one took 40-100 ms per 4096 entries with a large heap), and they are
    freed before the collector is back on; the collector's state is restored, also
    after a refused load; DCP's path (long, unbounded) runs with the collector on."""
    state = make_state()
    out = fresh(state)
    gc.enable()
    with observing_loads() as loads:
        gc_watch.clear()
        asyncckpt.load(out, ckpt)
        collections = len(gc_watch)
    # Only the few that the allocations before and after the paused span start (the
    # path checks before it, the load's LoadTimings record after it: 14 here; without
    # the pause: one per allocation, 6055).
    assert collections <= 16
    assert loads.direct == 1
    assert gc.isenabled()
    assert_same(state, out)
    # Off before the load: still off after it, and no collection at all.
    gc.disable()
    gc_watch.clear()
    assert counted_load(fresh(state), ckpt) == "direct" and gc_watch == [] and not gc.isenabled()
    gc.enable()
    # A refused load turns it back on.
    flip_byte(ckpt / _manifest.METADATA_NAME, 40)
    with pytest.raises(CorruptCheckpointError):
        asyncckpt.load(fresh(state), ckpt)
    assert gc.isenabled()
    flip_byte(ckpt / _manifest.METADATA_NAME, 40)  # (back as it was)
    # DCP's path (a partial load) collects as usual.
    gc_watch.clear()
    assert counted_load({"model": fresh(state["model"])}, ckpt) == "dcp"
    assert len(gc_watch) > 10


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fqn", ["model.emb", "model.ln.bias", "model.scalar", "model.empty"])
def test_framing_check_ignores_only_the_crc_fields(ckpt: Path, fqn: str) -> None:
    """A record read straight into its target is ours only if its framing is our
    writer's byte for byte, but for the CRC-32 fields (the data's checksum): every
    other byte changed sends it the general way (``torch.load``)."""
    from asyncckpt.format.layout import record_framing
    from asyncckpt.loading.framing import suffix_matches

    md = read_metadata(ckpt)
    (info,) = [i for idx, i in md.storage_data.items() if idx.fqn == fqn]
    tensor_md = md.state_dict_metadata[fqn]
    assert isinstance(tensor_md, TensorStorageMetadata)
    framing = record_framing(tensor_md.properties.dtype, tuple(tensor_md.size))  # what our writer writes
    record = (ckpt / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
    head, tail = record[: len(framing.prefix)], record[len(framing.prefix) + framing.nbytes :]
    assert head == framing.prefix and suffix_matches(memoryview(tail), framing)
    crc_bytes = {o + k for o in framing.crc_offsets for k in range(4)}
    if framing.nbytes:
        assert any(tail[i] for i in crc_bytes)  # the real checksum is there, not zeros
    for i in range(len(tail)):
        changed = bytearray(tail)
        changed[i] ^= 0x5A
        assert suffix_matches(memoryview(changed), framing) == (i in crc_bytes), i
    assert not suffix_matches(memoryview(tail[:-1]), framing)
    assert not suffix_matches(memoryview(tail + b"\0"), framing)


# ----------------------------------------------------------------------------- the records file
def _records(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / RECORDS_NAME).read_bytes())


def _load_from(ckpt: Path, **kwargs: Any) -> str:
    """Load ``make_state()``'s structure on the direct path, check it bitwise, and return
    where its records came from (``"records"`` or ``"metadata"``)."""
    state = make_state()
    out = fresh(state)
    with observing_loads() as loads:
        asyncckpt.load(out, ckpt, **kwargs)
    assert loads.paths() == {"direct": 1, "dcp": 0}
    assert_same(state, out)
    assert loads.records + loads.metadata == 1
    return "records" if loads.records else "metadata"


@pytest.mark.timeout(60)
def test_the_records_file_stands_for_the_metadata(ckpt: Path) -> None:
    """Beside ``.metadata`` the coordinator writes every entry's record (file, offset,
    length, dtype, shape; values with none), bound to the ``.metadata`` bytes by their
    CRC-32 and listed in the manifest; the direct path plans from it, on every
    verification mode, without unpickling ``.metadata``."""
    obj = _records(ckpt)
    metadata_bytes = (ckpt / _manifest.METADATA_NAME).read_bytes()
    assert obj["format"] == "asyncckpt.records" and obj["version"] == 1
    assert obj["metadata_crc32"] == zlib.crc32(metadata_bytes)
    manifest = asyncckpt.verify(ckpt)  # listed, with its checksum
    assert RECORDS_NAME in manifest["files"]
    parsed = parse_records((ckpt / RECORDS_NAME).read_bytes(), zlib.crc32(metadata_bytes), manifest["files"])
    metadata = read_metadata(ckpt)
    assert parsed is not None and parsed == records_from_metadata(metadata)
    assert set(parsed) == set(metadata.state_dict_metadata) and len(parsed) > 1500
    assert parsed["model.ln.bias"][3:] == (torch.bfloat16, (64,)) and parsed["model.empty"][3:] == (
        torch.float32,
        (0, 4),
    )
    assert parsed["optim.param_groups.0.lr"][3:] == (None, None)  # a value
    for rows in obj["files"].values():
        assert [r[1] for r in rows] == sorted(r[1] for r in rows)
    for verify in ("inline", True, False):
        assert _load_from(ckpt, verify=verify) == "records"


def _edit(obj: dict[str, Any], how: str) -> Any:
    rows = obj["files"][DATA]
    if how == "not json":
        return b'{"format": '
    if how == "another crc":
        obj["metadata_crc32"] ^= 1
    elif how == "another format":
        obj["format"] = "asyncckpt.index"
    elif how == "another version":
        obj["version"] = 2
    elif how == "an unlisted file":
        obj["files"]["__9_0.distcp"] = obj["files"].pop(DATA)
    elif how == "a path outside":
        obj["files"]["../" + DATA] = obj["files"].pop(DATA)
    elif how == "a short row":
        rows[0].pop()
    elif how == "a bool offset":
        rows[0][1] = True
    elif how == "a negative length":
        rows[0][2] = -1
    elif how == "an unknown dtype":
        rows[0][3] = "torch.float99"
    elif how == "a shape of floats":
        rows[0][4] = [float(s) for s in rows[0][4]]
    elif how == "a value with a shape":
        (row,) = [r for r in rows if r[3] is None][:1]
        row[4] = [1]
    elif how == "an fqn twice":
        rows.append(list(rows[0]))
    return json.dumps(obj).encode()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "how",
    [
        "not json",
        "another crc",
        "another format",
        "another version",
        "an unlisted file",
        "a path outside",
        "a short row",
        "a bool offset",
        "a negative length",
        "an unknown dtype",
        "a shape of floats",
        "a value with a shape",
        "an fqn twice",
    ],
)
def test_records_that_cannot_stand_for_the_metadata_are_not_used(ckpt: Path, how: str) -> None:
    """The records file is a cache of ``.metadata``, never an authority: when it is not
    bound to these ``.metadata`` bytes or has any malformed field, the load (checksums
    all correct: the manifest re-signed) reads ``.metadata`` instead, with the same result."""
    (ckpt / RECORDS_NAME).write_bytes(_edit(_records(ckpt), how))
    resign(ckpt)
    asyncckpt.verify(ckpt)
    for verify in ("inline", False):
        assert _load_from(ckpt, verify=verify) == "metadata"


@pytest.mark.timeout(120)
def test_records_bound_to_the_metadata_are_still_checked(ckpt: Path) -> None:
    """A records file that names the right CRC-32 but lies is held to the same checks as
    ``.metadata``: a record past the end of its file is refused, naming it; overlapping
    records or another dtype than the state's go DCP's way (which reads ``.metadata``)."""

    def rewrite(change: Callable[[list[list[Any]]], None]) -> None:
        obj = _records(ckpt)
        change(obj["files"][DATA])
        (ckpt / RECORDS_NAME).write_bytes(json.dumps(obj).encode())
        resign(ckpt)

    original = (ckpt / RECORDS_NAME).read_bytes()
    size = (ckpt / DATA).stat().st_size

    def past_the_end(rows: list[list[Any]]) -> None:
        rows[-1][1] = size

    rewrite(past_the_end)
    with pytest.raises(CorruptCheckpointError, match="past the end") as info:
        asyncckpt.load(fresh(make_state()), ckpt, verify=False)
    assert DATA in str(info.value)

    def overlapping(rows: list[list[Any]]) -> None:
        rows[1][1] = rows[0][1] + 1

    def another_dtype(rows: list[list[Any]]) -> None:
        (row,) = [r for r in rows if r[0] == "model.emb"]
        row[3] = "torch.float64"

    for change in (overlapping, another_dtype):
        (ckpt / RECORDS_NAME).write_bytes(original)
        rewrite(change)
        state = make_state()
        out = fresh(state)
        assert counted_load(out, ckpt) == "dcp", change.__name__
        assert_same(state, out)


@pytest.mark.timeout(60)
def test_a_checkpoint_without_records_loads_from_the_metadata(ckpt: Path) -> None:
    """Checkpoints of earlier versions (no records file) take the direct path from
    ``.metadata``; a layout that is not one record per entry gets no records at all."""
    (ckpt / RECORDS_NAME).unlink()
    manifest = json.loads((ckpt / ".manifest.json").read_text())
    del manifest["files"][RECORDS_NAME]
    (ckpt / ".manifest.json").write_text(json.dumps(manifest))
    resign(ckpt)
    for verify in ("inline", False):
        assert _load_from(ckpt, verify=verify) == "metadata"

    metadata = read_metadata(ckpt)
    assert records_from_metadata(metadata) is not None
    md = metadata.state_dict_metadata["model.emb"]
    assert isinstance(md, TensorStorageMetadata)
    md.chunks.append(md.chunks[0])  # two chunks: a sharded save
    assert records_from_metadata(metadata) is None
    md.chunks.pop()
    (info,) = [i for idx, i in metadata.storage_data.items() if idx.fqn == "model.emb"]
    info.transform_descriptors = ["zstd"]
    assert records_from_metadata(metadata) is None
