"""The load side of the user-facing API: ``load`` (in place, collective) and ``verify``.

``load`` reads a committed checkpoint into a given state_dict, like
``torch.distributed.checkpoint.load`` (resharded as DCP does), without trusting the
checkpoint: see :mod:`asyncckpt.loading.metadata`, :mod:`asyncckpt.loading.dcp` and
:mod:`asyncckpt.loading.direct`. Files are read through the tier: the local file
system (:data:`asyncckpt.io.storage.LOCAL`), or an ``s3://`` URL's objects with ranged
GETs straight into the targets (:class:`asyncckpt.io.s3.S3Checkpoint`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import (
    CheckpointException as _DcpCheckpointException,
)

from asyncckpt._check import check_path, check_state_dict
from asyncckpt._gc import gc_paused
from asyncckpt._hooks import call_timings_hooks
from asyncckpt.dist import SyncGroup
from asyncckpt.errors import (
    AsyncckptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointPathError,
    CorruptCheckpointError,
    InvalidArgumentError,
    RankFailure,
    RemoteStorageError,
    UnverifiableCheckpointError,
)
from asyncckpt.format.manifest import MANIFEST_NAME, METADATA_NAME, step_metadata
from asyncckpt.io import s3 as _s3
from asyncckpt.io.storage import LOCAL, ReadableStorage
from asyncckpt.loading.dcp import SafeFileSystemReader, SafeLoadPlanner
from asyncckpt.loading.direct import ShardCatalog, direct_load, local_shard, plan_direct_load
from asyncckpt.loading.hf import is_hf_dir, load_hf
from asyncckpt.root import is_stock_dcp

__all__ = ["LoadTimings", "load", "verify", "read_metadata", "from_dcp_exception", "not_a_directory"]


class LoadTimings(NamedTuple):
    """Timings of one :func:`load` on this rank (what ``load`` returns, and what the
    timings hooks receive: :func:`asyncckpt.add_timings_hook`).

    Attributes:
        read_s: seconds reading the checkpoint's data into the state_dict (the direct
            path's reads, DCP's ``dcp.load``, or the safetensors reads), copies
            included except ``copy_s``.
        verify_s: seconds checking sizes and CRC-32s before the reads (``verify=True``,
            or DCP's path); with ``verify="inline"`` on the direct path the checksums
            run during the reads (in ``read_s``) and this is only the small files'.
        copy_s: seconds copying read data into targets after the reads (the direct
            path's temporaries: CUDA or non-contiguous targets); 0.0 where the copy
            is part of the read (DCP's path, safetensors).
        total_s: seconds of the whole call (planning and the collectives included).
        bytes: bytes of the tensors of ``state_dict`` that were loaded (this rank's
            local shards), non-tensor values excluded.
    """

    read_s: float
    verify_s: float
    copy_s: float
    total_s: float
    bytes: int


@dataclasses.dataclass
class _Clock:
    """The phases of one load, accumulated as they run."""

    read_s: float = 0.0
    verify_s: float = 0.0
    copy_s: float = 0.0


def _tensor_bytes(state_dict: dict[str, Any]) -> int:
    """Bytes of the tensors in a nested state_dict (a DTensor's local shard, as
    :func:`~asyncckpt.loading.direct.local_shard` gives it: no autograd call, about
    20 us, per DTensor). A loop over one stack, no generator per entry: it allocates
    (and so collects) nothing per entry."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)  # none if never imported
    total = 0
    stack: list[Any] = [state_dict]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            local = local_shard(obj) if dtensor is not None and isinstance(obj, dtensor) else None
            local = obj if local is None else local
            total += local.numel() * local.element_size()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
    return total


def not_a_directory(path: Path) -> CheckpointPathError:
    """The one error of ``load``, ``verify`` and ``read_state_dict`` for a path that
    exists and is not a directory: a ``CheckpointPathError`` that is a
    ``NotADirectoryError`` (``errno.ENOTDIR``), not a ``FileNotFoundError`` (which
    readers retry on, as for a step removed by retention)."""
    return CheckpointPathError.of(
        errno.ENOTDIR,
        "not a checkpoint directory (a checkpoint is a directory; for a torch.save file use torch.load)",
        path,
    )


def _existing_dir(checkpoint_dir: str | os.PathLike) -> Path:
    """``checkpoint_dir`` as a path that exists and is not a file.

    Raises:
        InvalidArgumentError: not a path.
        CheckpointNotFoundError: it does not exist.
        CheckpointPathError: (a ``NotADirectoryError``) it is a file.
    """
    check_path(checkpoint_dir)
    path = Path(checkpoint_dir)
    if not os.path.lexists(path):
        raise CheckpointNotFoundError("no such checkpoint directory", str(path))
    if path.exists() and not path.is_dir():
        raise not_a_directory(path)
    return path


def read_metadata(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """What a committed checkpoint was saved with, from its manifest alone: no tensor
    (and no other file) is read. Orbax's ``metadata(step)``, in our words.

    Args:
        checkpoint_dir: a committed checkpoint directory, or an
            ``s3://bucket/prefix/step_N`` URL (only its commit marker is read).

    Returns:
        ``step``, ``metrics`` and ``metadata`` as given to ``save`` (``{}`` when
        none), ``asyncckpt_version``, ``format_version``, ``world_size``,
        ``total_bytes``, ``created_unix_s``, ``commit_seq``
        (:func:`asyncckpt.format.manifest.step_metadata`).

    Raises:
        CheckpointNotFoundError: (a ``FileNotFoundError``) ``checkpoint_dir`` does not
            exist.
        CheckpointPathError: (a ``NotADirectoryError``) it is not a directory.
        CorruptCheckpointError: it has no manifest (a stock DCP directory has none),
            an unreadable one, or one of a newer format than this asyncckpt reads.
        InvalidArgumentError: ``checkpoint_dir`` is not a path.
    """
    if _s3.is_url(checkpoint_dir):
        where = _s3.parse_url(str(checkpoint_dir))
        return step_metadata(_s3.read_marker(_s3.reader_tier(where.bucket), where).manifest)
    return step_metadata(LOCAL.read_manifest(_existing_dir(checkpoint_dir)))


def verify(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """Check a committed checkpoint against its manifest (sizes and CRC-32s).

    Returns:
        The manifest (``files``, ``total_bytes``, ``world_size``, ``step``, ...).

    Raises:
        CorruptCheckpointError: naming the first missing or mismatching file (also a
            checkpoint of an asyncckpt root that lost its manifest).
        UnverifiableCheckpointError: a stock ``torch.distributed.checkpoint``
            directory (``.metadata``, no manifest, not in an asyncckpt root): there
            are no checksums to check; nothing is known to be wrong with it.
        CheckpointNotFoundError: (a ``FileNotFoundError``) ``checkpoint_dir`` does
            not exist.
        CheckpointPathError: (a ``NotADirectoryError``) ``checkpoint_dir`` is not a
            directory (a ``model.pt``): not a checkpoint directory.
        InvalidArgumentError: ``checkpoint_dir`` is not a path.
    """
    if _s3.is_url(checkpoint_dir):  # ranged GETs into memory, every segment checked
        with _s3.open_url(str(checkpoint_dir)) as remote:
            return remote.verify()
    path = _existing_dir(checkpoint_dir)
    if is_stock_dcp(path):
        raise UnverifiableCheckpointError(
            f"{path}: no manifest: not verifiable (a stock torch.distributed.checkpoint directory; "
            "its files carry no checksums)",
            str(path),
        )
    return LOCAL.verify(checkpoint_dir)


def load(
    state_dict: dict[str, Any],
    checkpoint_dir: str | os.PathLike,
    *,
    process_group: Any = None,
    verify: bool | Literal["inline"] = "inline",
    allow_pickle: bool = False,
    strip_prefix: str | None = None,
    rename: Callable[[str], str | None] | None = None,
) -> LoadTimings:
    """Load a checkpoint into ``state_dict`` in place, like ``torch.distributed.checkpoint.load``.

    Tensors are copied into the given tensors (any device; resharded as DCP does);
    other values are replaced in the given dicts. Collective over ``process_group``.

    When ``state_dict`` has exactly the checkpoint's keys, dtypes and shapes (plain
    tensors, one record each), on every rank, the records are read directly, in few
    large reads straight into the tensors (``asyncckpt.loading.direct``), without DCP's
    per-entry load planning (the records' places come from ``.records.json``, written
    at commit, when it stands for the ``.metadata`` in the directory); anything else
    goes through ``dcp.load``. Both give the same values and the same errors.

    The checkpoint is not trusted (:mod:`asyncckpt.loading.metadata`): ``.metadata`` is
    unpickled with an allowlist of DCP metadata classes; every file it or the manifest
    names must be a plain file name of a regular file (not a symlink) inside
    ``checkpoint_dir``; non-tensor values load with ``torch.load(weights_only=True)``
    semantics, all decoded before any tensor of ``state_dict`` is written.

    A stock ``torch.distributed.checkpoint`` directory (``dcp.save``: no
    ``.manifest.json``, and not a step of an asyncckpt root) is read through DCP's path
    with the same path and unpickling checks, but without checksums (there are none):
    a ``UserWarning`` says so. A checkpoint of an asyncckpt root that lost its manifest
    is refused as corrupt (see :func:`asyncckpt.root.is_in_root`).

    A Hugging Face safetensors directory (``model.safetensors`` or
    ``model.safetensors.index.json`` with its shards, no ``.metadata``: a released
    model, or ``asyncckpt.export_safetensors``' output) is read tensor by tensor into
    the state_dict's tensors, matched by name (DCP's flattened keys, after
    ``strip_prefix`` and ``rename``), cast to the targets' dtypes; pass the model's
    part of a training state (``load(state["model"], hf_dir)``). Its index and headers
    are checked (:mod:`asyncckpt.loading.hf`); safetensors carry no checksums. Each
    rank reads on its own (no collective).

    Args:
        state_dict: the structure to fill; its keys select what is read.
        checkpoint_dir: a committed checkpoint directory, a stock DCP directory, a
            Hugging Face safetensors directory, or an ``s3://bucket/prefix/step_N`` URL
            (:mod:`asyncckpt.io.s3`, the ``s3`` extra: each rank GETs the byte ranges
            its own plan reads, in parallel, straight into the targets, the CRC-32s
            checked as the bytes arrive; nothing is copied to local disk).
        process_group: the ranks loading together.
        verify: ``"inline"`` (default): the CRC-32 of every byte is checked as it is
            read, in the same pass (the files' sizes and ``.metadata`` are checked
            before anything is read; a bad checksum in tensor data fails the load,
            on every rank, after some tensors of ``state_dict`` may already hold
            bytes of this checkpoint, and the error says so); on DCP's path as
            ``True``. ``True``: check sizes and checksums of the files first (each
            rank checks a share of the files; any mismatch fails every rank), so a
            refused load changes nothing, for a second read of the files (from the
            page cache when they fit). ``False``: no checksums. The path checks
            above run either way.
        allow_pickle: unpickle non-tensor values of any class (stock DCP's
            ``weights_only=False``). Unpickling runs code chosen by whoever wrote the
            checkpoint: pass ``True`` only for checkpoints you trust. To allow a few
            classes instead, use ``torch.serialization.safe_globals([...])``.
        strip_prefix: (a safetensors directory only) removed from the start of the
            directory's tensor names that have it, before matching.
        rename: (a safetensors directory only) ``rename(name) -> name | None``
            (``None``: ignore that tensor), after ``strip_prefix``.

    Raises:
        CorruptCheckpointError: ``checkpoint_dir`` is not a committed checkpoint; a
            file is missing or corrupt (with ``verify``); the metadata holds a
            disallowed global; the metadata or the manifest names a path outside the
            directory or a symlink.
        CheckpointError: a non-tensor value needs ``allow_pickle=True`` (its entry is
            named; ``state_dict`` is left unchanged).
        CheckpointNotFoundError: (a ``FileNotFoundError``) ``checkpoint_dir`` does not
            exist, or was removed while it was being loaded (retention of a job that
            is still saving): retry with a newer step.
        CheckpointPathError: (a ``NotADirectoryError``, never a
            ``CheckpointNotFoundError``) ``checkpoint_dir`` is not a directory (a
            ``model.pt``): not a checkpoint directory.
        InvalidArgumentError: (a ``ValueError`` and ``TypeError``) ``state_dict`` is not
            a dict, ``checkpoint_dir`` not a path, or ``verify`` not one of its values.
    """
    started = time.monotonic()
    hint = "; the call is load(state_dict, checkpoint_dir)"
    check_state_dict(state_dict, hint=hint)
    clock = _Clock()
    if _s3.is_url(checkpoint_dir):
        _load_url(state_dict, str(checkpoint_dir), process_group, verify, allow_pickle, clock)
        return _finish(clock, started, state_dict, Path(str(checkpoint_dir)))
    path = _load_path(state_dict, checkpoint_dir, process_group, verify, allow_pickle, strip_prefix, rename, clock)
    return _finish(clock, started, state_dict, path)


def _finish(clock: _Clock, started: float, state_dict: dict[str, Any], path: Path) -> LoadTimings:
    """The load's record, given to the timings hooks."""
    with gc_paused():  # the walk's temporaries, freed inside, never start a collection
        nbytes = _tensor_bytes(state_dict)
    timings = LoadTimings(clock.read_s, clock.verify_s, clock.copy_s, time.monotonic() - started, nbytes)
    call_timings_hooks(timings, None, path)
    return timings


def _load_path(
    state_dict: dict[str, Any],
    checkpoint_dir: str | os.PathLike,
    process_group: Any,
    verify: bool | str,
    allow_pickle: bool,
    strip_prefix: str | None,
    rename: Callable[[str], str | None] | None,
    clock: _Clock,
) -> Path:
    """:func:`load` of a local directory, its phases timed into ``clock``."""
    hint = "; the call is load(state_dict, checkpoint_dir)"
    check_path(checkpoint_dir, hint=hint)
    if verify not in (True, False, "inline"):
        raise InvalidArgumentError(f"verify must be True, False or 'inline', not {verify!r}")
    path = Path(checkpoint_dir)
    if is_hf_dir(path):
        reading = time.monotonic()
        load_hf(state_dict, path, strip_prefix=strip_prefix, rename=rename)
        clock.read_s += time.monotonic() - reading
        return path
    if strip_prefix is not None or rename is not None:
        raise InvalidArgumentError(f"strip_prefix and rename are for a safetensors directory; {path} is not one")
    try:
        _load(state_dict, path, process_group, verify, allow_pickle, clock)
    except (CheckpointError, OSError) as exc:
        # After the error funnel (the same on every rank): what is there now decides.
        if isinstance(exc, CheckpointNotFoundError) or path.is_dir():
            raise
        if path.exists():  # a regular file (model.pt): never "removed, retry"
            raise not_a_directory(path) from exc
        raise CheckpointNotFoundError(
            "the checkpoint does not exist, or was removed while it was being "
            "loaded (e.g. by retention): load a newer step",
            str(path),
        ) from exc
    return path


def _load_url(
    state_dict: dict[str, Any], url: str, process_group: Any, verify: bool | str, allow_pickle: bool, clock: _Clock
) -> None:
    """:func:`load` of an ``s3://`` URL: the local load's two paths (direct, DCP's),
    reading through :class:`asyncckpt.io.s3.S3Checkpoint` (ranged GETs of what each
    rank's plan needs), without a local copy."""
    check_path(url)
    if verify not in (True, False, "inline"):
        raise InvalidArgumentError(f"verify must be True, False or 'inline', not {verify!r}")
    with opened_on_every_rank(url, process_group) as remote:
        with gc_paused():
            fallback = _load_direct(state_dict, url, process_group, verify, allow_pickle, clock, remote)
        if fallback is not None:
            reading = time.monotonic()
            _load_dcp(state_dict, process_group, *fallback)
            clock.read_s += time.monotonic() - reading


@contextlib.contextmanager
def opened_on_every_rank(url: str, process_group: Any) -> Iterator[_s3.S3Checkpoint]:
    """(all ranks) :func:`asyncckpt.io.s3.open_url` on each rank (its commit marker
    read), with the error funnel: a rank that cannot read it fails every rank, with the
    lowest rank's error (its type kept: ``CheckpointNotFoundError``,
    ``RemoteStorageError``, ...)."""
    with _on_every_rank(url, process_group, _s3.open_url) as remote:
        yield remote


@contextlib.contextmanager
def _on_every_rank(url: str, process_group: Any, enter: Callable[[str], Any]) -> Iterator[Any]:
    sync = SyncGroup(process_group)
    with contextlib.ExitStack() as stack:
        failure: RankFailure | None = None
        local: Any = None
        try:
            local = stack.enter_context(enter(url))
        except (AsyncckptError, OSError) as exc:
            if not sync.active:
                raise
            failure = RankFailure.from_exception(exc)
        if sync.active:
            failures = sync.gather_failures(failure)
            if failures:
                first = failures[min(failures)]
                if isinstance(first.exception, AsyncckptError):
                    raise first.exception
                raise CheckpointError(f"reading {url} failed: {first}", failures)
        assert local is not None
        yield local


class _Stock(Exception):
    """(internal) A stock DCP directory: skip the manifest's checks."""


def _raise_first(failures: dict[int, RankFailure], path: Path | str) -> None:
    """Raise the lowest rank's failure as ours, the same on every rank (a URL's
    ``CheckpointNotFoundError`` and ``RemoteStorageError`` as they are)."""
    first = failures[min(failures)]
    exc = first.exception
    if _s3.is_url(path) and isinstance(exc, (CheckpointNotFoundError, RemoteStorageError)):
        raise exc
    message = str(exc) if exc is not None else str(first)
    if isinstance(exc, CorruptCheckpointError) or exc is None:
        raise CorruptCheckpointError(message, getattr(exc, "path", None) or str(path))
    if isinstance(exc, FileNotFoundError) or not isinstance(exc, CheckpointError):
        raise CheckpointError(f"loading {path} failed: {type(exc).__name__}: {message}")
    raise CheckpointError(message)


def _load(
    state_dict: dict[str, Any], path: Path, process_group: Any, verify: bool | str, allow_pickle: bool, clock: _Clock
) -> None:
    # The direct path runs with the cyclic garbage collector off, and every object it
    # made (the unpickled metadata: tens of objects per entry) is freed before it is
    # back on: otherwise a full collection of the heap the metadata grew comes in the
    # middle of the reads, stalling them and the CRC thread.
    with gc_paused():
        fallback = _load_direct(state_dict, path, process_group, verify, allow_pickle, clock)
    if fallback is not None:
        reading = time.monotonic()
        _load_dcp(state_dict, process_group, *fallback)
        clock.read_s += time.monotonic() - reading


def _load_direct(
    state_dict: dict[str, Any],
    path: Path | str,
    process_group: Any,
    verify: bool | str,
    allow_pickle: bool,
    clock: _Clock,
    remote: _s3.S3Checkpoint | None = None,
) -> tuple[SafeFileSystemReader, SafeLoadPlanner, Path | str] | None:
    """Load on the direct path, or, when a rank cannot take it, check the files (with
    ``verify``) and return what DCP's path needs (the same on every rank). ``remote``:
    the checkpoint is that URL's (``path``), read through it."""
    sync = SyncGroup(process_group)
    tier: ReadableStorage = LOCAL if remote is None else remote
    reader = SafeFileSystemReader(str(path), storage=tier)
    planner = SafeLoadPlanner(allow_pickle=allow_pickle)
    failure: RankFailure | None = None
    plan = None
    share: list[str] = []
    stock = remote is None and is_stock_dcp(path)  # no manifest: DCP's path, without checksums
    # A remote read can also fail with a missing object or a failed request: funnelled too.
    funnelled: tuple[type[BaseException], ...] = (
        (CorruptCheckpointError,) if remote is None else (AsyncckptError, OSError)
    )
    try:
        if stock:
            raise _Stock
        manifest = tier.read_manifest(path)  # also refuses names outside the directory
        share = sorted(manifest["files"])[sync.rank :: sync.world_size]
        verifying = time.monotonic()
        if verify is True:
            tier.verify(path, share)
        # verify == "inline": the data files as they are read; the small files where
        # they are read (the records file and the shard index check theirs, strictly,
        # when the load verifies; .metadata below).
        clock.verify_s += time.monotonic() - verifying
        # Where each entry lies: from the records file when it stands for this
        # .metadata (JSON, no unpickling), or a sharded checkpoint's shard index (this
        # rank's own chunks), else from .metadata.
        records = reader.read_records(manifest["files"], strict=bool(verify))
        if records is None:  # a sharded checkpoint: this rank's own chunks, where its shard index says
            shards = reader.read_shards(manifest["files"], sync.rank, strict=bool(verify))
            if shards is not None:
                plan = plan_direct_load(state_dict, ShardCatalog(*shards))
        if records is None and plan is None:
            if verify == "inline":
                verifying = time.monotonic()
                tier.verify(path, [METADATA_NAME])
                clock.verify_s += time.monotonic() - verifying
            reader.check_manifest(manifest["files"])  # reads and checks .metadata
            plan = plan_direct_load(state_dict, reader.read_metadata())
        elif records is not None:
            plan = plan_direct_load(state_dict, records)
    except _Stock:
        pass
    except funnelled as exc:
        failure = RankFailure.from_exception(exc)
    # One collective: did a rank fail, can every rank take the direct path, is it stock DCP?
    flags = sync.all_gather_ints([failure is not None, plan is not None, stock])
    if any(f[0] for f in flags):
        _raise_first(sync.gather_failures(failure), path)  # the error funnel: the same error on every rank
    if any(f[2] for f in flags):
        if not all(f[2] for f in flags):
            raise CorruptCheckpointError(f"{path}: some ranks see a {MANIFEST_NAME} and some do not", str(path))
        warnings.warn(
            f"{path} has no {MANIFEST_NAME} (a stock torch.distributed.checkpoint "
            "directory): loaded without checksum verification",
            UserWarning,
            stacklevel=5,  # the caller of load(): load, _load_path, _load, _load_direct
        )
        return reader, planner, path
    direct = all(f[1] for f in flags)
    if verify == "inline" and not direct and remote is not None:
        reader.inline_files = manifest["files"]  # each rank checks the bytes it reads, as they arrive
    elif verify == "inline" and not direct:  # DCP's path checks first
        verifying = time.monotonic()
        try:
            tier.verify(path, share)
        except funnelled as exc:
            failure = RankFailure.from_exception(exc)
        clock.verify_s += time.monotonic() - verifying
        failures = sync.gather_failures(failure)
        if failures:
            _raise_first(failures, path)
    if direct:
        assert plan is not None
        reading = time.monotonic()
        try:
            clock.copy_s += direct_load(
                plan,
                str(path),
                manifest["files"] if verify == "inline" else None,
                decode=planner.decode_value,
                storage=tier,
            )
        except (CheckpointError, OSError) as exc:
            failure = RankFailure.from_exception(exc)
        clock.read_s += time.monotonic() - reading - clock.copy_s
        failures = sync.gather_failures(failure)
        if failures:
            _raise_first(failures, path)
        return None
    return reader, planner, path


def _load_dcp(
    state_dict: dict[str, Any],
    process_group: Any,
    reader: SafeFileSystemReader,
    planner: SafeLoadPlanner,
    path: Path | str,
) -> None:
    try:
        with warnings.catch_warnings():
            # Without a process group DCP warns that it loads in a single process: intended.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=process_group)
    except _DcpCheckpointException as exc:
        if _s3.is_url(path):  # a remote object gone, a request failed: as they are
            for _, (cause, _tb) in sorted(exc.failures.items()):
                if isinstance(cause, (CheckpointNotFoundError, RemoteStorageError)):
                    raise cause from exc
        raise from_dcp_exception(exc, path) from exc


def from_dcp_exception(exc: _DcpCheckpointException, path: Path | str) -> CheckpointError:
    """Our error for DCP's ``CheckpointException`` (a ``BaseException``, which
    ``except Exception`` misses): ours (``CheckpointError``) as they were raised, the
    lowest rank's, the same on every rank; anything else as ``CheckpointError``."""
    for _, (cause, _tb) in sorted(exc.failures.items()):
        if isinstance(cause, CorruptCheckpointError):
            return CorruptCheckpointError(str(cause), cause.path)
        if isinstance(cause, CheckpointError):
            return CheckpointError(str(cause))
    causes = "; ".join(f"rank {r}: {type(c).__name__}: {c}" for r, (c, _tb) in sorted(exc.failures.items()))
    return CheckpointError(f"loading {path} failed: {causes}")
