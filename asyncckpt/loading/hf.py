"""Hugging Face safetensors directories, read without trusting them.

A model released on the Hugging Face hub (or written by ``asyncckpt.export_safetensors``,
``transformers``' ``save_pretrained``, DCP's ``HuggingFaceStorageWriter``) is either one
``model.safetensors`` file or ``model-00001-of-0000N.safetensors`` shards plus
``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map":
{name: file}}``). :class:`HFTensors` reads such a directory tensor by tensor (bounded
memory: one tensor at a time); :func:`read_hf_state_dict` and :func:`load_hf` are what
``asyncckpt.read_state_dict`` and ``asyncckpt.load`` do with one.

Only tensors are read: the safetensors format holds raw bytes and a JSON header, never
a pickle. The header is parsed here (the format's specification,
https://github.com/huggingface/safetensors#format) rather than with the ``safetensors``
library, because the library opens files by name (following symlinks) and keeps the
last of two tensors of the same name; here every file is opened through the
directory's descriptor without following symlinks, and every field is checked:

- the index names only plain file names of regular files in the directory (no ``/``,
  ``..``, absolute paths or symlinks), each tensor once;
- a header is a JSON object of bounded size without duplicate names, each tensor's
  ``dtype`` known, ``shape`` non-negative ints, ``data_offsets`` ``[begin, end]``
  with ``end - begin == numel * itemsize``, and the tensors tile the data section
  exactly (no overlap, no hole, nothing past the end of the file: the format's rule);
- the index and the headers agree (every tensor of the index is in the file it names,
  and no file holds a tensor the index does not name).

Any violation is a :class:`~asyncckpt.errors.CorruptCheckpointError` naming the file.
Safetensors files carry no checksums: the bytes of a well-formed file are not checked.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from asyncckpt.errors import CheckpointError, CorruptCheckpointError, InvalidArgumentError
from asyncckpt.format.manifest import METADATA_NAME, is_plain_name
from asyncckpt.io.storage import LOCAL
from asyncckpt.loading.framing import pread_into

__all__ = [
    "HF_INDEX_NAME",
    "HF_SINGLE_NAME",
    "SAFETENSORS_DTYPES",
    "HFTensor",
    "HFTensors",
    "is_hf_dir",
    "map_name",
    "read_hf_state_dict",
    "load_hf",
]

#: The index of a sharded export (``huggingface_hub``'s ``SAFETENSORS_INDEX_FILE``).
HF_INDEX_NAME = "model.safetensors.index.json"
#: The one file of an unsharded export (``huggingface_hub``'s ``SAFETENSORS_SINGLE_FILE``).
HF_SINGLE_NAME = "model.safetensors"
#: The safetensors dtype names and their torch dtypes (the ``safetensors.torch`` table).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}
#: The largest header accepted, in bytes (the ``safetensors`` library's limit).
MAX_HEADER_BYTES = 100_000_000
#: The largest index file accepted, in bytes.
MAX_INDEX_BYTES = 100_000_000


def map_name(name: str, strip_prefix: str | None, rename: Callable[[str], str | None] | None) -> str | None:
    """A tensor's name after the name mapping of export and import: ``strip_prefix``
    removed where the name starts with it, then ``rename`` applied (``None`` from it
    drops the tensor).

    Raises:
        InvalidArgumentError: ``rename`` returned something other than a non-empty
            ``str`` or ``None``.
    """
    if strip_prefix and name.startswith(strip_prefix):
        name = name[len(strip_prefix) :]
    if rename is not None:
        mapped = rename(name)
        if mapped is None:
            return None
        if not isinstance(mapped, str) or not mapped:
            raise InvalidArgumentError(f"rename({name!r}) returned {mapped!r}, not a non-empty str or None")
        name = mapped
    return name


def is_hf_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a Hugging Face safetensors directory: it holds (an entry
    named) ``model.safetensors.index.json`` or ``model.safetensors``, and no DCP
    ``.metadata``. A symlink of those names counts here and is refused when read."""
    p = os.fspath(path)  # plain strings: load() calls this first, and allocates little before its paused GC
    return (
        os.path.isdir(p)
        and not os.path.lexists(os.path.join(p, METADATA_NAME))
        and (os.path.lexists(os.path.join(p, HF_INDEX_NAME)) or os.path.lexists(os.path.join(p, HF_SINGLE_NAME)))
    )


class HFTensor(NamedTuple):
    """One tensor of a safetensors directory.

    Attributes:
        name: its name (the safetensors key, ``model.layers.0.mlp.up_proj.weight``).
        file: the file holding it (a plain name in the directory).
        dtype: its dtype.
        shape: its shape.
        begin: the byte offset of its data in the file (absolute).
        nbytes: ``numel * itemsize``, in bytes.
    """

    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    nbytes: int


def _no_duplicates(where: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise CorruptCheckpointError(f"{where}: the name {key!r} appears twice", where)
            out[key] = value
        return out

    return hook


def _uint(v: Any) -> bool:
    return type(v) is int and v >= 0


def _read_all(fd: int, limit: int, where: str) -> bytes:
    size = os.fstat(fd).st_size
    if size > limit:
        raise CorruptCheckpointError(f"{where} has {size} bytes, more than an index may have ({limit})", where)
    buf = bytearray(size)
    pread_into(fd, memoryview(buf), 0, where)
    return bytes(buf)


def _parse_header(fd: int, name: str, where: str) -> list[HFTensor]:
    """The tensors of one safetensors file, its header checked (see the module docstring)."""
    size = os.fstat(fd).st_size
    if size < 8:
        raise CorruptCheckpointError(f"{where} has {size} bytes: not a safetensors file", where)
    head = bytearray(8)
    pread_into(fd, memoryview(head), 0, where)
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise CorruptCheckpointError(f"{where}: a header of {n} bytes does not fit the file ({size} bytes)", where)
    raw = bytearray(n)
    pread_into(fd, memoryview(raw), 8, where)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates(where))
    except (UnicodeDecodeError, ValueError) as exc:
        if isinstance(exc, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(f"{where}: the header is not JSON: {exc}", where) from exc
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{where}: the header is not a JSON object", where)
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptCheckpointError(f"{where}: __metadata__ must map names to strings", where)
    start = 8 + n
    data_len = size - start
    tensors: list[HFTensor] = []
    for key, spec in header.items():
        fields = spec if isinstance(spec, dict) else {}
        dtype = SAFETENSORS_DTYPES.get(fields.get("dtype"))  # type: ignore[arg-type]
        shape, offsets = fields.get("shape"), fields.get("data_offsets")
        if (
            dtype is None
            or set(fields) != {"dtype", "shape", "data_offsets"}
            or not isinstance(shape, list)
            or not all(_uint(d) for d in shape)
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_uint(o) for o in offsets)
        ):
            raise CorruptCheckpointError(f"{where}: malformed header entry for {key!r}: {spec!r}"[:400], where)
        begin, end = offsets
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            raise CorruptCheckpointError(
                f"{where}: tensor {key!r} ({fields['dtype']} {shape}) needs {nbytes} bytes, "
                f"its data_offsets [{begin}, {end}] hold {end - begin}",
                where,
            )
        tensors.append(HFTensor(key, name, dtype, tuple(shape), start + begin, nbytes))
    pos = start
    for t in sorted(tensors, key=lambda t: (t.begin, t.nbytes)):
        if t.begin != pos:
            what = "overlaps the previous tensor" if t.begin < pos else "leaves a hole before it"
            raise CorruptCheckpointError(
                f"{where}: the data of tensor {t.name!r} (from byte {t.begin - start}) {what}", where
            )
        pos = t.begin + t.nbytes
    if pos != size:
        raise CorruptCheckpointError(
            f"{where}: the tensors' data ends at byte {pos - start}, the data section has {data_len} bytes "
            "(out of the file, or a hole at its end)",
            where,
        )
    return tensors


class HFTensors:
    """The tensors of a Hugging Face safetensors directory, read one at a time.

    Opening reads the index (if any) and every header, checked; :meth:`read` reads one
    tensor. Use as a context manager (it holds the files open).

    Args:
        path: a directory holding ``model.safetensors.index.json`` (sharded) or
            ``model.safetensors``.

    Attributes:
        tensors: name -> :class:`HFTensor`, in file and offset order.
        metadata: the index's ``metadata`` (``{}`` without an index).

    Raises:
        CheckpointNotFoundError: (a ``FileNotFoundError``) no such directory.
        CorruptCheckpointError: the index or a header is malformed or hostile (see the
            module docstring), a file is missing, a symlink or not a regular file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        root = str(self.path)
        self._dir_fd = LOCAL.open_dir(root)
        self._fds: dict[str, int] = {}
        try:
            self.metadata: dict[str, Any] = {}
            if os.path.lexists(self.path / HF_INDEX_NAME):
                files = self._read_index()
            else:
                files = {HF_SINGLE_NAME: None}
            self.tensors: dict[str, HFTensor] = {}
            for name in sorted(files):
                where = str(self.path / name)
                fd = self._fds[name] = LOCAL.open_file(self._dir_fd, root, name)
                header = _parse_header(fd, name, where)
                expected = files[name]
                for t in header:
                    if expected is not None and t.name not in expected:
                        raise CorruptCheckpointError(
                            f"{where} holds tensor {t.name!r}, which {HF_INDEX_NAME} does not place in it", where
                        )
                    if t.name in self.tensors:
                        raise CorruptCheckpointError(f"{where}: tensor {t.name!r} is also in another file", where)
                    self.tensors[t.name] = t
                for missing in sorted((expected or set()) - {t.name for t in header}):
                    raise CorruptCheckpointError(
                        f"{HF_INDEX_NAME} places tensor {missing!r} in {name}, whose header does not have it", where
                    )
        except BaseException:
            self.close()
            raise

    def _read_index(self) -> dict[str, set[str] | None]:
        """File name -> the tensors the index places in it."""
        where = str(self.path / HF_INDEX_NAME)
        fd = LOCAL.open_file(self._dir_fd, str(self.path), HF_INDEX_NAME)
        try:
            raw = _read_all(fd, MAX_INDEX_BYTES, where)
        finally:
            os.close(fd)
        try:
            index = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates(where))
        except (UnicodeDecodeError, ValueError) as exc:
            if isinstance(exc, CorruptCheckpointError):
                raise
            raise CorruptCheckpointError(f"{where} is not JSON: {exc}", where) from exc
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CorruptCheckpointError(f"{where} has no weight_map object", where)
        meta = index.get("metadata", {})
        self.metadata = meta if isinstance(meta, dict) else {}
        files: dict[str, set[str] | None] = {}
        for tensor, file in weight_map.items():
            if not is_plain_name(file):
                raise CorruptCheckpointError(
                    f"{where} places tensor {tensor!r} in {file!r}, a file outside the directory", where
                )
            names = files.setdefault(file, set())
            assert names is not None
            names.add(tensor)
        return files

    def __enter__(self) -> HFTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the files (idempotent)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None  # type: ignore[assignment]

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` (a new contiguous CPU tensor of its dtype and shape).

        Raises:
            KeyError: no such tensor.
            CorruptCheckpointError: the file ends early (it changed since it was opened).
        """
        t = self.tensors[name]
        out = torch.empty(t.shape, dtype=t.dtype)
        if t.nbytes:
            view = memoryview((ctypes.c_char * t.nbytes).from_address(out.data_ptr())).cast("B")
            pread_into(self._fds[t.file], view, t.begin, str(self.path / t.file))
        return out

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for every tensor, in file order."""
        for name in self.tensors:
            yield name, self.read(name)


def _mapped(tensors: HFTensors, strip_prefix: str | None, rename: Callable[[str], str | None] | None) -> dict[str, str]:
    """Mapped name -> the name in the files.

    Raises:
        InvalidArgumentError: two tensors map to the same name."""
    out: dict[str, str] = {}
    for name in tensors.tensors:
        mapped = map_name(name, strip_prefix, rename)
        if mapped is None:
            continue
        if mapped in out:
            raise InvalidArgumentError(f"tensors {out[mapped]!r} and {name!r} both map to {mapped!r}")
        out[mapped] = name
    return out


def read_hf_state_dict(
    path: str | os.PathLike,
    *,
    strip_prefix: str | None = None,
    rename: Callable[[str], str | None] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors directory, as a flat dict (what
    ``asyncckpt.read_state_dict`` returns for one).

    Raises:
        CorruptCheckpointError: see :class:`HFTensors`.
        InvalidArgumentError: two tensors map to the same name.
    """
    with HFTensors(path) as tensors:
        return {mapped: tensors.read(name) for mapped, name in _mapped(tensors, strip_prefix, rename).items()}


def load_hf(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    *,
    strip_prefix: str | None = None,
    rename: Callable[[str], str | None] | None = None,
) -> None:
    """Fill ``state_dict``'s tensors from a safetensors directory, one tensor at a time
    (what ``asyncckpt.load`` does with one).

    The state_dict's keys are flattened as DCP flattens them (``{"a": {"b": t}}`` is
    ``a.b``) and matched with the directory's names after the mapping (``strip_prefix``,
    ``rename``); tensors the state_dict does not ask for are not read. Values are cast
    to the target's dtype (a ``bf16`` release into a ``float32`` model) and copied into
    the target in place (any device; a DTensor target gets its local shard, computed on
    each rank without a collective).

    Raises:
        CheckpointError: a key of ``state_dict`` is not in the directory, or is not a
            tensor there, or has another shape.
        CorruptCheckpointError: see :class:`HFTensors`.
        InvalidArgumentError: two tensors map to the same name.
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor import DTensor, distribute_tensor

    flat, _ = flatten_state_dict(state_dict)
    with HFTensors(path) as tensors:
        names = _mapped(tensors, strip_prefix, rename)
        missing = [k for k in flat if k not in names]
        if missing:
            raise CheckpointError(
                f"{path} has no tensor for {len(missing)} key(s) of the state_dict: {missing[:4]}"
                + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
                + f" (it has {len(names)} tensors, e.g. {sorted(names)[:3]})"
            )
        bad = [k for k, v in flat.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise CheckpointError(f"{path} holds only tensors; the state_dict's {bad[:4]} are not tensors")
        for key, target in flat.items():
            spec = tensors.tensors[names[key]]
            if tuple(target.shape) != spec.shape:
                raise CheckpointError(
                    f"{path}: tensor {names[key]!r} has shape {spec.shape}, the state_dict's {key!r} "
                    f"{tuple(target.shape)}"
                )
        for key, target in flat.items():
            value = tensors.read(names[key])
            if isinstance(target, DTensor):
                local = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().detach().copy_(local.to_local())
            else:
                target.detach().copy_(value)
