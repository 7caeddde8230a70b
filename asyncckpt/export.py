"""Export a checkpoint as Hugging Face safetensors: :func:`export_safetensors`.

The layout is the one ``transformers``' ``save_pretrained`` and ``huggingface_hub``'s
``split_torch_state_dict_into_shards`` produce: ``model-00001-of-0000N.safetensors``
shards plus ``model.safetensors.index.json`` (``metadata.total_size``: the tensors'
bytes; ``weight_map``: name -> file), or one ``model.safetensors`` when every tensor
fits one shard. The files are written with the ``safetensors`` library
(``safetensors.torch.save_file``, which writes the tensors' memory without a copy).

Memory stays bounded: the checkpoint is read tensor by tensor
(:class:`asyncckpt.loading.tensors.CheckpointTensors`: a sharded FSDP2 / DTensor
checkpoint of N ranks is assembled one tensor at a time from its chunks, with the
loaders' path checks and, for a checkpoint of ours, every byte checked against the
manifest's CRC-32s as it is read), and an output shard is written and freed as soon as
it is complete, so the peak is about two output shards (one being written while a
reader thread reads the next) plus the largest tensor, never the model. The idea is
DCP's ``HuggingFaceStorageWriter`` followed by ``consolidate_safetensors_files``,
without the intermediate per-rank files.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncckpt import _fs
from asyncckpt._check import check_path
from asyncckpt.errors import InvalidArgumentError
from asyncckpt.loading.hf import HF_INDEX_NAME, HF_SINGLE_NAME, map_name
from asyncckpt.loading.tensors import CheckpointTensors, TensorEntry

__all__ = ["export_safetensors", "ExportResult", "parse_size", "parse_dtype", "DEFAULT_MAX_SHARD_SIZE"]

#: ``huggingface_hub``'s default shard size (``save_torch_state_dict``): 5 GB.
DEFAULT_MAX_SHARD_SIZE = "5GB"

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
}
_SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def parse_size(size: int | str) -> int:
    """A size in bytes from an int or a string as ``huggingface_hub`` reads
    ``max_shard_size``: ``"5GB"`` is ``5 * 10**9`` (decimal units KB, MB, GB, TB),
    ``"256MiB"`` is ``256 * 2**20`` (binary units KiB, MiB, GiB, TiB); case-insensitive.

    Raises:
        InvalidArgumentError: not a positive size.
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise InvalidArgumentError(f"a size must be an int or a str like '5GB', not {size!r}")
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size)
        unit = _UNITS.get(m.group(2).upper()) if m else None
        if m is None or unit is None:
            raise InvalidArgumentError(f"cannot read the size {size!r} (e.g. '5GB', '500MB', '256MiB')")
        value = int(float(m.group(1)) * unit)
    if value <= 0:
        raise InvalidArgumentError(f"a size must be positive, not {size!r}")
    return value


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The floating dtype ``dtype`` names (``"bf16"``, ``"bfloat16"``, ``"fp16"``,
    ``"float32"``, ...), or ``None``.

    Raises:
        InvalidArgumentError: not a floating dtype.
    """
    if dtype is None:
        return None
    found = dtype if isinstance(dtype, torch.dtype) else _DTYPES.get(str(dtype).lower().removeprefix("torch."))
    if found is None or not found.is_floating_point:
        raise InvalidArgumentError(f"dtype must be a floating dtype (e.g. 'bf16', 'fp16', 'fp32'), not {dtype!r}")
    return found


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_safetensors` wrote.

    Attributes:
        out: the output directory.
        files: the safetensors files written, in order (``model.safetensors``, or
            ``model-00001-of-0000N.safetensors`` ...).
        weight_map: tensor name -> file (the index's ``weight_map``).
        total_size: bytes of all tensors (the index's ``metadata.total_size``).
        skipped: flattened keys of the selection that were not exported: non-tensor
            values (safetensors holds only tensors) and names ``rename`` dropped.
    """

    out: Path
    files: list[str]
    weight_map: dict[str, str]
    total_size: int
    skipped: list[str] = field(default_factory=list)


def _select(
    src: CheckpointTensors, key: str | None
) -> tuple[list[tuple[TensorEntry, str]], tuple[str, ...], list[str]]:
    """The entries under ``key`` (a dotted path of dict keys; ``None``: ``model`` when
    the checkpoint has it, else everything), each with its name below the key."""
    tops = {str(e.path[0]) for e in src.entries if len(e.path) > 1}
    if key is None:
        parts: tuple[str, ...] = ("model",) if "model" in tops else ()
    else:
        parts = tuple(key.split(".")) if key else ()
    n = len(parts)
    chosen = [
        (e, ".".join(str(p) for p in e.path[n:]))
        for e in src.entries
        if len(e.path) > n and tuple(str(p) for p in e.path[:n]) == parts
    ]
    if not chosen:
        raise InvalidArgumentError(
            f"{src.path} has no tensor under the key {key!r} (its top-level keys: {sorted(tops)[:8]})"
            if parts
            else f"{src.path} holds no tensor"
        )
    prefix = ".".join(parts) + "." if parts else ""
    skipped = [fqn for fqn in src.skipped if fqn.startswith(prefix)]
    return chosen, parts, skipped


def _shards(sizes: list[int], limit: int) -> list[list[int]]:
    """Greedy shards of positions (``huggingface_hub``'s rule): a tensor goes to the
    current shard unless it would pass ``limit``; a tensor larger than ``limit`` gets
    a shard of its own."""
    shards: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        if current and total + size > limit:
            shards.append(current)
            current, total = [], 0
        current.append(i)
        total += size
    if current:
        shards.append(current)
    return shards


def _existing_export(out: Path) -> list[str]:
    try:
        names = os.listdir(out)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n in (HF_SINGLE_NAME, HF_INDEX_NAME) or _SHARD_NAME.match(n))


def _fsync_rename(tmp: Path, final: Path) -> None:
    """fsync ``tmp``, then rename it to ``final``."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, final)


def export_safetensors(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    key: str | None = None,
    dtype: torch.dtype | str | None = None,
    strip_prefix: str | None = None,
    rename: Callable[[str], str | None] | None = None,
    verify: bool = True,
) -> ExportResult:
    """Write a checkpoint's model as Hugging Face safetensors files in ``out``.

    Reads any checkpoint asyncckpt reads: one of ours (checked against its manifest as
    it is read), a stock ``torch.distributed.checkpoint`` directory (no checksums: a
    ``UserWarning`` says so), an FSDP2 / DTensor checkpoint of N ranks (each tensor
    assembled whole from its chunks). Runs in this process alone, with memory for about
    two output shards plus the largest tensor (see the module docstring).

    Names: the selected entries' nested paths below ``key``, joined with ``.`` (a
    ``model.state_dict()`` saved as ``{"model": ...}`` gives its own names), then
    ``strip_prefix`` removed where present, then ``rename`` (a function of the name;
    ``None`` drops the tensor). Each file is written under a hidden temporary name,
    fsynced and renamed; the index comes last.

    Args:
        checkpoint: a checkpoint directory.
        out: the output directory (created if missing; it may hold other files such as
            ``config.json``, but no earlier export).
        max_shard_size: the largest shard, in bytes, or a size like ``"5GB"``
            (``5 * 10**9``) or ``"256MiB"`` (:func:`parse_size`); one tensor larger
            than it gets a shard of its own, as in ``huggingface_hub``.
        key: which part of the saved state is the model: a dotted path of dict keys
            (``"model"``, ``"app.model"``); default ``"model"`` if the checkpoint has
            it, else every tensor; ``""``: every tensor.
        dtype: cast floating tensors to this dtype (``torch.bfloat16``, ``"bf16"``,
            ``"fp16"``, ``"fp32"``); integer and bool tensors keep theirs.
        strip_prefix: removed from the start of every name that has it (``"model."``).
        rename: ``rename(name) -> new name | None``, after ``strip_prefix``.
        verify: check the CRC-32s of what is read against the manifest (a checkpoint
            of ours).

    Returns:
        An :class:`ExportResult` (files, weight_map, total_size, skipped).

    Raises:
        InvalidArgumentError: a bad argument, no tensor under ``key``, two tensors
            mapped to the same name, or ``out`` already holds an export.
        CheckpointNotFoundError, CorruptCheckpointError: as :func:`asyncckpt.load`
            (a checksum mismatch, a hostile ``.metadata``, ...); nothing of the export
            is left in ``out`` then (nor ``out``, when this call created it).
    """
    check_path(checkpoint)
    out_path = Path(check_path(out, what="out"))
    limit = parse_size(max_shard_size)
    cast = parse_dtype(dtype)
    if key is not None and not isinstance(key, str):
        raise InvalidArgumentError(f"key must be a str or None, not {key!r}")
    if out_path.exists() and not out_path.is_dir():
        raise InvalidArgumentError(f"out must be a directory: {out_path} is a file")
    found = _existing_export(out_path)
    if found:
        raise InvalidArgumentError(f"{out_path} already holds an export ({found[0]}): remove it or export elsewhere")
    with CheckpointTensors(checkpoint, verify=verify) as src:
        chosen, _parts, skipped = _select(src, key)
        names: list[tuple[TensorEntry, str]] = []
        taken: dict[str, str] = {}
        for entry, name in chosen:
            mapped = map_name(name, strip_prefix, rename)
            if mapped is None:
                skipped.append(entry.fqn)
                continue
            if mapped in taken:
                raise InvalidArgumentError(f"entries {taken[mapped]!r} and {entry.fqn!r} both map to {mapped!r}")
            taken[mapped] = entry.fqn
            names.append((entry, mapped))
        if not names:
            raise InvalidArgumentError(f"no tensor of {src.path} is left to export after the name mapping")

        def out_bytes(e: TensorEntry) -> int:
            return e.nbytes // e.dtype.itemsize * cast.itemsize if cast and e.dtype.is_floating_point else e.nbytes

        shards = _shards([out_bytes(e) for e, _ in names], limit)
        n = len(shards)
        files = [HF_SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        created = not out_path.exists()
        out_path.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(4)
        written: list[Path] = []
        weight_map: dict[str, str] = {}

        def read_shard(shard: list[int]) -> dict[str, torch.Tensor]:
            tensors: dict[str, torch.Tensor] = {}
            for i in shard:
                entry, name = names[i]
                t = src.read(entry)
                if cast is not None and t.dtype.is_floating_point and t.dtype != cast:
                    t = t.to(cast)
                tensors[name] = t.contiguous()
            return tensors

        try:
            from safetensors.torch import save_file

            # One reader thread reads shard k + 1 while this thread writes shard k, and a
            # syncer thread fsyncs and renames shard k - 1 (reads, CRC-32s, the write and
            # fsync release the GIL): memory for two shards (a written shard is freed
            # before its fsync), time about the slowest of the three rather than their sum.
            with (
                ThreadPoolExecutor(1, thread_name_prefix="asyncckpt-export-read") as reader,
                ThreadPoolExecutor(1, thread_name_prefix="asyncckpt-export-sync") as syncer,
            ):
                ahead: Future[dict[str, torch.Tensor]] | None = reader.submit(read_shard, shards[0])
                synced: list[Future[None]] = []
                try:
                    for k, file in enumerate(files):
                        assert ahead is not None
                        tensors = ahead.result()
                        ahead = reader.submit(read_shard, shards[k + 1]) if k + 1 < n else None
                        for name in tensors:
                            weight_map[name] = file
                        tmp = out_path / f".{file}.tmp-{token}"
                        written += [tmp, out_path / file]
                        save_file(tensors, str(tmp), metadata={"format": "pt"})
                        del tensors
                        synced.append(syncer.submit(_fsync_rename, tmp, out_path / file))
                    for f in synced:
                        f.result()
                finally:
                    if ahead is not None:  # an error: let the threads finish before the files close
                        ahead.cancel()
                    pending: list[Future[Any]] = [*synced] + ([ahead] if ahead is not None else [])
                    wait(pending)
            total = sum(out_bytes(e) for e, _ in names)
            if n > 1:
                index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
                tmp = out_path / f".{HF_INDEX_NAME}.tmp-{token}"
                written.append(tmp)
                written.append(out_path / HF_INDEX_NAME)
                tmp.write_text(json.dumps(index, indent=2) + "\n")
                _fsync_rename(tmp, out_path / HF_INDEX_NAME)
            _fs.fsync_directory(out_path)
        except BaseException:
            for p in written:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            if created:
                with contextlib.suppress(OSError):  # not empty: someone else's files
                    out_path.rmdir()
            raise
    return ExportResult(out_path, files, weight_map, total, skipped)
