"""What a rank of a sharded load reads and parses before its bytes, as the world grows.

A sharded checkpoint (FSDP2: every tensor cut in one chunk per rank) of ``--tensors``
tensors, for each world size of ``--ranks``: the ``.metadata`` DCP writes (every rank's
chunks), the shard index asyncckpt writes beside it (``.shards.json`` and
``.shards.chunks.jsonl``, :mod:`asyncckpt.format.shards`), a manifest, and sparse data
files, in a temporary directory. Then, as rank 1 of a load with the save's sharding,
the two ways to find where its chunks lie, through the loader's own reader
(``SafeFileSystemReader``):

- ``.metadata``: ``read_metadata`` (read, restricted unpickling, checks), then the
  lookup of rank 1's chunk of every tensor in it;
- the index: ``read_shards`` (the index whole, rank 1's line with one ranged read, the
  checksums, parsing), then the same lookups.

Median of ``--reps`` (fresh readers each time; the files in the page cache). One
process, no collective: the cost is each rank's, paid by every rank at once.

    python scripts/bench.py shard-index --ranks 4,32,128
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from asyncckpt.format import shards
from asyncckpt.format.crc import crc32
from asyncckpt.format.manifest import MANIFEST_NAME, METADATA_NAME, build_manifest, manifest_bytes
from asyncckpt.loading.dcp import SafeFileSystemReader
from asyncckpt.loading.direct import ShardCatalog, _MetadataCatalog

ROWS = 64  # rows of a tensor per rank
COLS = 256


def _metadata(world: int, tensors: int) -> Metadata:
    entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    nbytes = ROWS * COLS * 4
    for t in range(tensors):
        fqn = f"model.layers.{t // 12}.block.{t % 12}.weight"
        chunks = [ChunkStorageMetadata(torch.Size([r * ROWS, 0]), torch.Size([ROWS, COLS])) for r in range(world)]
        props = TensorProperties(dtype=torch.float32)
        entries[fqn] = TensorStorageMetadata(properties=props, size=torch.Size([ROWS * world, COLS]), chunks=chunks)
        for r in range(world):
            storage[MetadataIndex(fqn, torch.Size([r * ROWS, 0]))] = _StorageInfo(f"__{r}_0.distcp", t * nbytes, nbytes)
    return Metadata(state_dict_metadata=entries, storage_data=storage)


class _File:
    def __init__(self, name: str, nbytes: int) -> None:
        self.name, self.nbytes, self.segments = name, nbytes, [[0, nbytes, 0]]


def _write(directory: Path, world: int, tensors: int) -> dict:
    metadata = _metadata(world, tensors)
    data = pickle.dumps(metadata)
    described = shards.shard_files(metadata)
    assert described is not None
    header, lines = described
    small = {
        METADATA_NAME: data,
        shards.SHARDS_NAME: shards.shards_file(header, crc32(data)),
        shards.CHUNKS_NAME: lines,
    }
    for name, content in small.items():
        (directory / name).write_bytes(content)
    files = []
    for r in range(world):  # sparse: the loaders check sizes, this benchmark reads no data
        name = f"__{r}_0.distcp"
        with open(directory / name, "wb") as f:
            f.truncate(tensors * ROWS * COLS * 4)
        files.append(_File(name, tensors * ROWS * COLS * 4))
    manifest = build_manifest(files, small, {"world_size": world})
    (directory / MANIFEST_NAME).write_bytes(manifest_bytes(manifest))
    return manifest


def _lookups(catalog: ShardCatalog | _MetadataCatalog, fqns: list[str], rank: int) -> None:
    where = [catalog.storage(fqn, (rank * ROWS, 0), (ROWS, COLS)) for fqn in fqns]
    assert all(w is not None for w in where)


def _run(world: int, tensors: int, reps: int, base: Path) -> dict[str, float]:
    directory = base / f"w{world}"
    directory.mkdir()
    manifest = _write(directory, world, tensors)
    fqns = list(_metadata(1, tensors).state_dict_metadata)
    old, new = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        metadata = SafeFileSystemReader(str(directory)).read_metadata()
        _lookups(_MetadataCatalog(metadata), fqns, 1)
        old.append(time.perf_counter() - t0)
        del metadata
        t0 = time.perf_counter()
        found = SafeFileSystemReader(str(directory)).read_shards(manifest["files"], 1, strict=True)
        assert found is not None
        _lookups(ShardCatalog(*found), fqns, 1)
        new.append(time.perf_counter() - t0)
    index = shards.parse_shards(
        (directory / shards.SHARDS_NAME).read_bytes(),
        manifest["files"][METADATA_NAME]["segments"][0][2],
        {f"__{r}_0.distcp": 1 for r in range(world)},
    )
    assert index is not None
    return {
        "metadata_bytes": os.path.getsize(directory / METADATA_NAME),
        "index_bytes": os.path.getsize(directory / shards.SHARDS_NAME),
        "line_bytes": index.chunks["__1_0.distcp"][1],
        "metadata_s": statistics.median(old),
        "index_s": statistics.median(new),
    }


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the rows; prints a markdown table. Returns the exit status."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="4,32,128", help="world sizes, comma-separated (%(default)s)")
    p.add_argument("--tensors", type=int, default=1172, help="sharded tensors (%(default)s: the LLM-shaped state)")
    p.add_argument("--reps", type=int, default=3, help="repetitions, the median reported (%(default)s)")
    args = p.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="bench-shard-index-"))
    try:
        rows = {int(w): _run(int(w), args.tensors, args.reps, base) for w in args.ranks.split(",")}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(
        f"| ranks ({args.tensors} sharded tensors) | .metadata | read_metadata + lookups | "
        "index + rank 1's line | read_shards + lookups | ratio |"
    )
    print("|---|---|---|---|---|---|")
    for world, r in rows.items():
        print(
            f"| {world} | {r['metadata_bytes'] / 1e6:.2f} MB | {r['metadata_s'] * 1e3:.1f} ms | "
            f"{r['index_bytes'] / 1e3:.0f} + {r['line_bytes'] / 1e3:.0f} kB | {r['index_s'] * 1e3:.1f} ms | "
            f"{r['metadata_s'] / r['index_s']:.1f}x |"
        )
    return 0
