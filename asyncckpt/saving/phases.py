"""The save pipeline: named phases, and the saver that runs them on a queue.

A save is one :class:`SaveInFlight` record passed through four phases, each a
module-level function that returns what the next one needs (the shape of
Megatron-core's ``save_state_dict_async_plan`` / ``save_state_dict_async_finalize``):

======  ===========================  ==========================================  =======================
phase   function                     runs where                                  returns
======  ===========================  ==========================================  =======================
plan    :func:`plan`                 training thread, all ranks (collective)     :class:`SaveInFlight`
stage   :func:`stage`                training thread (CPU copies: a thread with  the ``WriteTask``
                                     overlapped staging), each rank
write   ``write_rank_files``         the background worker / forked child,       ``RankWriteResult``
                                     each rank (torch-free)
commit  :func:`commit`               the queue's finalizer thread, all ranks     :class:`SaveTimings`
                                     (collective); I/O on the coordinator
======  ===========================  ==========================================  =======================

After ``save()`` returns, the training thread does no file I/O, no fsync and no
collective for that save: the status all_gather, the gather of write results, the
coordinator's commit and the broadcast of its outcome all run in the finalizer thread
of the queue (``AsyncCallsQueue(background_finalize=True)``), on its own gloo group.

The format is torch.distributed.checkpoint's: stock ``dcp.load`` reads it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

from asyncckpt import __version__, _faults
from asyncckpt._fs import current_umask
from asyncckpt._gc import gc_paused
from asyncckpt.dist import SyncGroup
from asyncckpt.errors import CheckpointError, CheckpointException, InvalidArgumentError, RankFailure
from asyncckpt.format import records as _records
from asyncckpt.format import shards as _shards
from asyncckpt.format.crc import crc32
from asyncckpt.format.layout import RankLayout
from asyncckpt.format.manifest import CHUNKS_NAME, METADATA_NAME, RECORDS_NAME, SHARDS_NAME
from asyncckpt.io.storage import LOCAL, Storage
from asyncckpt.io.writer import RankWriteResult, WriteTask
from asyncckpt.options import SaveOptions
from asyncckpt.root import CheckpointRoot
from asyncckpt.saving.exchange import _LayoutCache, _LayoutExchange
from asyncckpt.saving.handle import SaveHandle, SaveTimings
from asyncckpt.saving.planning import PlanCache, SavePlanResult, plan_save
from asyncckpt.saving.record import SaveInFlight
from asyncckpt.saving.staging import StagingBuffer, StagingCopier, StagingPool

_log = logging.getLogger("asyncckpt")


# ====================================================================== the phases
def plan(
    state_dict: dict[str, Any],
    final_dir: Path,
    handle: SaveHandle,
    *,
    sync: SyncGroup,
    coordinator_rank: int,
    step: int | None = None,
    root: CheckpointRoot | None = None,
    cache: PlanCache | None = None,
    layouts: _LayoutCache | None = None,
    check_target: bool = True,
    check_layout: Callable[[RankLayout], None] | None = None,
    in_flight: Callable[[Path], bool] | None = None,
    storage: Storage = LOCAL,
    share: tuple[int, ...] = (),
    on_shared: Callable[[list[list[int]]], None] | None = None,
) -> SaveInFlight:
    """Phase 1, plan: validate, plan and lay out one save (all ranks, collective).

    Call sequence:

    1. (each rank) validate ``state_dict``; (coordinator) ``final_dir`` must not
       exist, or be an empty directory, and no save of it may be in flight
       (``in_flight``: the coordinator renames a save's directory before it settles
       it, so to the coordinator a target is always either in flight or existing, and
       the ranks agree through the funnel). (each rank whose state kept the cached plan's
       structure) resolve this rank's data (tensors, pickled values), lay out its
       data file (the ``torch.save`` framing of every record), and run
       ``check_layout`` on the layout (the memory guard).
    2. (all ranks) the error funnel: a failure anywhere raises on every rank. If
       every rank kept the structure, the plan is done: the steady state's one
       collective.
    3. (all ranks) else plan with DCP's ``DefaultSavePlanner``.
    4. (each rank) resolve, lay out and ``check_layout`` as in 1.
    5. (all ranks) the error funnel again (e.g. a value that cannot be pickled).

    ``check_target=False`` skips the target check (``prepare`` writes nothing).
    ``in_flight(final_dir)``: True while an earlier save into ``final_dir`` is
    pending (its commit would remove this one's temporary directory, or this one
    would fail at commit). ``share`` / ``on_shared``: ints every rank receives from
    every rank, through the plan's first collective (see :func:`plan_save`).

    Raises:
        CheckpointError: invalid input or target on any rank, raised on every rank,
            before anything is written (``failures`` by rank).
    """
    started = time.monotonic()
    if not 0 <= coordinator_rank < sync.world_size:
        raise InvalidArgumentError(f"coordinator_rank {coordinator_rank} is not a rank of the group")

    def precheck() -> None:
        if in_flight is not None and in_flight(final_dir):
            what = f"step {step}" if step is not None else "a save"
            raise CheckpointError(
                f"{what} is already being saved to {final_dir}: an earlier save of it is still pending, "
                f"and a checkpoint is written once. Wait for it (handle.wait() or maybe_finalize(blocking=True)) "
                f"or save under another {'step' if step is not None else 'path'}"
            )
        if final_dir.exists() and (not final_dir.is_dir() or any(final_dir.iterdir())):
            raise FileExistsError(
                f"{final_dir} exists and is not an empty directory; a checkpoint never overwrites one"
            )

    layouts = layouts if layouts is not None else _LayoutCache()

    def finish(planned: SavePlanResult) -> RankLayout:
        layout = layouts.get(sync.rank, planned)
        if check_layout is not None:
            check_layout(layout)
        return layout

    what = f"step {step} ({final_dir})" if step is not None else str(final_dir)

    def disagree(agreed: list[list[int]]) -> None:  # (all ranks) name every rank's target
        targets = sync.all_gather_object(what)
        raise CheckpointError(
            "the ranks passed different checkpoints to save(), so none is written: "
            + "; ".join(f"rank {r}: {t}" for r, t in enumerate(targets))
            + ". Every rank must save the same step into the same directory"
        )

    with sync.describing(f"the plan of the save of {what}"):
        planned, layout = plan_save(
            state_dict,
            str(final_dir),
            sync,
            coordinator_rank,
            precheck if check_target else None,
            cache,
            finish=finish,
            agree=_target_ints(step, final_dir) if check_target else (),
            on_disagree=disagree,
            share=share,
            on_shared=on_shared,
        )
    return SaveInFlight(
        final_dir=final_dir,
        tmp_dir=storage.temporary_dir(final_dir, planned.token),
        step=step,
        sync=sync,
        coordinator_rank=coordinator_rank,
        planned=planned,
        layout=layout,
        handle=handle,
        root=root,
        storage=storage,
        plan_s=time.monotonic() - started,
    )


def _target_ints(step: int | None, final_dir: Path) -> tuple[int, int]:
    """What every rank must agree on, as int64s: the step (-1: none) and a 63-bit hash
    of the target directory's path."""
    digest = hashlib.blake2b(os.fsencode(final_dir), digest_size=8).digest()
    wide = step is not None and not -1 <= step < (1 << 63)
    return (-1 if step is None or wide else step, int.from_bytes(digest, "big") >> 1)


def stage(
    save: SaveInFlight,
    buffer: StagingBuffer,
    copier: StagingCopier,
    *,
    cpu: bool = True,
    cuda: bool = True,
    synchronize: bool = True,
    select: Callable[[torch.Tensor], bool] | None = None,
    blobs: bool = True,
) -> None:
    """Phase 2, stage: copy this rank's data into ``buffer`` (each rank, no collective).

    Tensors go through the buffer's views in one batched copy (``torch._foreach_copy_``
    for CPU tensors; non-blocking D2H on a side stream into the page-locked buffer for
    CUDA tensors), then the pickled non-tensor values. ``cpu``/``cuda`` select which
    sources are copied now (overlapped staging issues the D2H copies from the training
    thread and the CPU copies from a thread); ``synchronize`` waits for the D2H copies;
    ``select`` copies only the tensors it accepts; ``blobs`` writes the non-tensor values.

    Raises:
        RuntimeError: a copy failed (CUDA error).
    """
    started = time.monotonic()
    if cpu and blobs:
        _faults.hit("stage")
    data = save.planned.data
    # (A process that has not initialised CUDA holds no CUDA tensor: no walk over the data then.)
    if (
        not buffer.pinned
        and cuda
        and torch.cuda.is_initialized()
        and any(isinstance(d, torch.Tensor) and d.is_cuda for d in data)
    ):
        buffer.populate(copier)  # on every copy thread: cudaHostRegister would fault them in on one
        buffer.pin()
    buffer.format(save.layout)
    program = None
    if select is None:  # every tensor: the buffer's views, and how they are copied (kept per layout)
        dsts, srcs, program = buffer.dsts, [data[item] for item in buffer.items], buffer.copy_program(copier)
    else:
        pairs = [(dst, data[item]) for item, dst in buffer.views if select(data[item])]
        dsts, srcs = [dst for dst, _ in pairs], [src for _, src in pairs]
    # A new buffer's pages are allocated by the copy threads, each just before its piece.
    copier.copy(dsts, srcs, cpu=cpu, cuda=cuda, populate=not buffer.populated, program=program)
    if cpu:
        buffer.populated = True
    if cpu and blobs:
        for slot in save.layout.blobs:
            buffer.write_bytes(slot.offset, data[slot.item])
    if synchronize:
        copier.synchronize()
    save.buffer = buffer
    save.stage_s += time.monotonic() - started


def write_task(save: SaveInFlight, pool: StagingPool, options: SaveOptions) -> WriteTask:
    """What the writer needs (picklable, torch-free): the staged buffer and the files."""
    assert save.buffer is not None
    return WriteTask(
        str(save.tmp_dir),
        save.buffer.ref,
        save.layout.files,
        pool.live_slab_ids,
        umask=current_umask(),
        threads=options.write_threads,
        drop_cache=options.drop_page_cache,
    )


def commit(
    save: SaveInFlight,
    result: RankWriteResult,
    sync: SyncGroup,
    pending_steps: Iterable[int] = (),
    exchange: _LayoutExchange | None = None,
    metadata_pickle: MetadataPickle | None = None,
) -> SaveTimings:
    """Phase 4, commit: make the checkpoint visible, atomically (all ranks, collective).

    Call sequence (``sync`` is the finalizer's group in the background):

    1. (all ranks) all_gather every rank's file layout and write result (with
       ``exchange``, only a token for a layout the coordinator already holds).
    2. (coordinator) DCP ``.metadata`` and ``.manifest.json`` (sizes, CRC-32s),
       fsync, rename the temporary directory to its final name, fsync the parent:
       the rename is the commit point.
    3. (coordinator) after the commit point: ``latest``, retention, leftovers
       (``save.root``). Every failure after the commit point (the parent's fsync, the
       ``after_rename`` failpoint, ``latest``, retention, leftovers) is a
       ``RuntimeWarning`` on a committed save, never a failed one, and step 4 runs.
    4. (all ranks) broadcast the coordinator's outcome of step 2.

    A collective of 1 or 4 that breaks (a rank destroyed its groups, or left) does not
    make the outcome up: the coordinator reports what it did (committed after its
    rename, whatever the broadcast); another rank waits (at most
    :data:`OUTCOME_WAIT_S`) until the coordinator decided, i.e. the temporary
    directory is gone (renamed, or removed by the coordinator alone, see
    ``Saver._settle``), and reports committed only if the final directory's manifest
    carries this save's token.

    ``metadata_pickle``: the saver's cache of the last ``.metadata`` it pickled (one
    per saver: two managers must not evict each other's entry); ``None``: pickled afresh.

    Returns:
        The save's timings (also set on ``save``).

    Raises:
        CheckpointException: the commit failed (on every rank, with the
            coordinator's cause); nothing was committed.
    """
    started = time.monotonic()
    exchange = exchange if exchange is not None else _LayoutExchange()
    metadata_pickle = metadata_pickle if metadata_pickle is not None else MetadataPickle()
    coordinator = sync.rank == save.coordinator_rank
    try:
        gathered = sync.all_gather_object((exchange.outgoing(save), result))
    except BaseException as exc:
        exchange.forget_sent()
        if coordinator or not isinstance(exc, Exception):
            raise  # the coordinator commits nothing without every rank's result
        return _outcome_from_disk(save, result, sync, started, exc)
    failure: RankFailure | None = None
    if coordinator:
        try:
            metadata = save.planned.metadata
            metadata.storage_data = exchange.merged([layout for layout, _ in gathered])
            metadata.version = CURRENT_DCP_VERSION
            files = [f for _, r in gathered for f in r.files]
            info: dict[str, Any] = {"world_size": sync.world_size, "step": save.step, "save_token": save.planned.token}
            if save.planned.int_keys:  # dict keys that were int (DCP's metadata has str(key))
                info["int_keys"] = {fqn: list(ints) for fqn, ints in save.planned.int_keys.items()}
            if save.root is not None:
                info["commit_seq"] = save.root.next_commit_seq()  # the rollback order (root.py)
            info["asyncckpt_version"] = __version__
            info.update(save.user_info)  # metrics, metadata (the coordinator's)
            metadata_bytes, small = metadata_pickle.encode(metadata, save.planned.peers)
            committing = time.monotonic()
            save.storage.commit(save.tmp_dir, save.final_dir, metadata_bytes, files, info, small)
            save.commit_s = time.monotonic() - committing
        except Exception as exc:  # noqa: BLE001 - funnelled to every rank below
            if _renamed(save):  # it failed after the commit point: committed all the same
                _warn_committed(save, "its commit raised after the rename", exc)
            else:
                failure = RankFailure.from_exception(exc, "commit failed: ")
        if failure is None and save.root is not None:
            try:
                save.root.after_commit(save.final_dir, pending_steps)
            except Exception as exc:  # noqa: BLE001 - after the commit point: a warning, and the outcome is sent
                _warn_committed(save, "its cleanup after the commit point (latest, retention, leftovers) failed", exc)
    try:
        failure = sync.broadcast_object(failure, save.coordinator_rank)
    except BaseException as exc:
        exchange.forget_sent()
        if not isinstance(exc, Exception):
            raise
        if not coordinator:
            return _outcome_from_disk(save, result, sync, started, exc)
        if failure is None:  # renamed: committed, whatever the other ranks heard
            _log.warning(
                "asyncckpt: %s is committed; the other ranks could not be told (%s)",
                save.final_dir,
                str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
            )
    if failure is not None:
        exchange.forget_sent()
        raise CheckpointException(
            save.call_idx if save.call_idx is not None else -1,
            {save.coordinator_rank: failure},
            save.step,
            save.final_dir,
        )
    write_s = max(r.write_s for _, r in gathered)
    nbytes = sum(r.nbytes for _, r in gathered)
    return save.finish_timings(write_s, time.monotonic() - started, nbytes)


def _renamed(save: SaveInFlight) -> bool:
    """(coordinator, after its commit raised) Whether the rename, the commit point, took
    place: the temporary directory is gone and ``final_dir``'s manifest carries this
    save's token."""
    if save.tmp_dir.exists():
        return False
    try:
        manifest: dict[str, Any] | None = save.storage.read_manifest(save.final_dir)
    except Exception:  # noqa: BLE001 - absent or unreadable: not committed by this save
        return False
    return manifest is not None and manifest.get("save_token") == save.planned.token


def _warn_committed(save: SaveInFlight, what: str, exc: Exception) -> None:
    """A failure after the commit point: a ``RuntimeWarning`` (and a log line) that names
    the committed checkpoint; the save is reported committed."""
    name = f"step {save.step} ({save.final_dir})" if save.step is not None else str(save.final_dir)
    message = f"asyncckpt: {name} is committed, but {what}: {type(exc).__name__}: {exc}"
    _log.warning("%s", message)
    warnings.warn(message, RuntimeWarning, stacklevel=2)


#: Seconds a rank whose commit collective broke waits for the coordinator's decision.
OUTCOME_WAIT_S = 60.0


def _committed_on_disk(save: SaveInFlight, result: RankWriteResult, started: float) -> SaveTimings | None:
    """The save's timings (set on ``save``) if ``final_dir`` holds the checkpoint this
    save committed (its manifest carries this save's token), else ``None``."""
    try:
        manifest: dict[str, Any] | None = save.storage.read_manifest(save.final_dir)
    except Exception:  # noqa: BLE001 - absent or not ours: not committed by this save
        manifest = None
    if manifest is None or manifest.get("save_token") != save.planned.token:
        return None
    small = (METADATA_NAME, RECORDS_NAME, SHARDS_NAME, CHUNKS_NAME)
    nbytes = sum(e["size"] for n, e in manifest["files"].items() if n not in small)
    return save.finish_timings(result.write_s, time.monotonic() - started, nbytes)


def _outcome_from_disk(
    save: SaveInFlight, result: RankWriteResult, sync: SyncGroup, started: float, cause: BaseException
) -> SaveTimings:
    """(a rank other than the coordinator, whose commit collective broke) The outcome as
    the disk has it: wait until the coordinator decided (the temporary directory is
    gone: renamed or discarded; at most :data:`OUTCOME_WAIT_S` and the group's
    timeout), then committed only if ``final_dir``'s manifest carries this save's token.

    Raises:
        CheckpointException: not committed (or not decided in time), naming the path.
    """
    limit = min(OUTCOME_WAIT_S, sync.timeout.total_seconds())
    deadline = time.monotonic() + limit
    while save.tmp_dir.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    why = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    name = f"step {save.step} ({save.final_dir})" if save.step is not None else str(save.final_dir)
    timings = _committed_on_disk(save, result, started)
    if timings is not None:
        _log.warning("asyncckpt: the commit of %s broke on this rank (%s); the coordinator committed it", name, why)
        return timings
    if save.tmp_dir.exists():
        text = (
            f"the commit of {name} broke on this rank ({why}) and the coordinator (rank "
            f"{save.coordinator_rank}) did not decide within {limit:g} s: it is not committed now "
            f"(a checkpoint that appears there later is complete)"
        )
    else:
        text = (
            f"the commit of {name} broke on this rank ({why}); the coordinator (rank "
            f"{save.coordinator_rank}) did not commit it"
        )
    raise CheckpointException(
        save.call_idx if save.call_idx is not None else -1, {sync.rank: RankFailure(text)}
    ) from cause


class MetadataPickle:
    """The pickled DCP ``.metadata`` of the last commit, reused while only its
    ``storage_meta`` changes: pickling the metadata of thousands of entries on every
    commit would hold, in the finalizer thread, the GIL the training thread needs.

    A cached plan's metadata shares its ``state_dict_metadata`` dict across saves, and
    a cached layout gives equal ``storage_data``; then the bytes differ only in two
    strings of ``storage_meta``: the checkpoint path and the save's random id. Pickle
    stores a string as its length and bytes, so when the new strings have the old
    lengths (the same root, ``step_%08d`` names, 32 hex digits) they are written over
    the old ones in place, and the result is byte for byte what ``pickle.dumps`` gives.
    Otherwise the metadata is pickled afresh (and cached). One per saver (it holds one
    entry: savers sharing one would evict each other's).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple | None = None
        self._data: bytes = b""
        self._at: tuple[int, int, int, int] = (0, 0, 0, 0)  # checkpoint_id, save_id: offset, length
        #: What the cached metadata's small files but ``.metadata`` are made of: its
        #: records (``records_json``), or its shard index and chunk lines
        #: (:func:`asyncckpt.format.shards.shard_files`), or nothing.
        self._cached: str | tuple[str, bytes] | None = None

    def encode(
        self, metadata: Any, peers: Mapping[int, tuple[int, ...]] | None = None
    ) -> tuple[bytes, dict[str, bytes]]:
        """``pickle.dumps(metadata)`` and the small files beside it: the records file
        when every entry is one record (:mod:`asyncckpt.format.records`), else the
        shard index and its chunk lines (:mod:`asyncckpt.format.shards`) when every
        chunk can be described, else none; from the cache where possible (these files
        then differ only in the CRC-32 of the new ``.metadata`` bytes). ``peers``: the
        plan's :attr:`~asyncckpt.saving.planning.SavePlanResult.peers`, for the index."""
        peers = dict(peers or {})
        meta = metadata.storage_meta
        cid = str(meta.checkpoint_id).encode() if meta is not None and meta.checkpoint_id is not None else None
        sid = meta.save_id.encode() if meta is not None and isinstance(meta.save_id, str) else None
        with self._lock:
            key = self._key
            if (
                key is not None
                and cid is not None
                and sid is not None
                and key[0] is metadata.state_dict_metadata
                and key[1] == metadata.planner_data
                and key[2] == metadata.storage_data
                and key[3] == metadata.version
                and key[4] == (meta.load_id, list(meta.modules))
                and key[5] == peers
                and len(cid) == self._at[1]
                and len(sid) == self._at[3]
            ):
                patched = bytearray(self._data)
                patched[self._at[0] : self._at[0] + len(cid)] = cid
                patched[self._at[2] : self._at[2] + len(sid)] = sid
                return bytes(patched), self._small_files(self._cached, patched)
        with gc_paused():  # (tens of objects per chunk made and freed: no collection of the heap between)
            data = pickle.dumps(metadata)
            found = _records.records_from_metadata(metadata)
            cached = _records.records_json(found) if found is not None else _shards.shard_files(metadata, peers)
            del found
        with self._lock:
            self._key = None
            self._cached = cached
            if cid is not None and sid is not None and cid != sid and data.count(cid) == 1 and data.count(sid) == 1:
                self._key = (
                    metadata.state_dict_metadata,
                    metadata.planner_data,
                    dict(metadata.storage_data),
                    metadata.version,
                    (meta.load_id, list(meta.modules)),
                    peers,
                )
                self._data = data
                self._at = (data.find(cid), len(cid), data.find(sid), len(sid))
        return data, self._small_files(cached, data)

    @staticmethod
    def _small_files(cached: str | tuple[str, bytes] | None, data: bytes | bytearray) -> dict[str, bytes]:
        if cached is None:
            return {}
        if isinstance(cached, str):
            return {RECORDS_NAME: _records.records_file(cached, crc32(data))}
        header, chunks = cached
        return {SHARDS_NAME: _shards.shards_file(header, crc32(data)), CHUNKS_NAME: chunks}
