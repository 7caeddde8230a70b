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

import atexit
import collections
import dataclasses
import hashlib
import logging
import multiprocessing.util as mp_util
import os
import pickle
import secrets
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable

import psutil
import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

from asyncckpt.saving import destroy_hook as _destroy_hook  # noqa: F401 - pending saves commit before destroy_process_group()
from asyncckpt import _faults
from asyncckpt.async_utils.calls_queue import AsyncCallsQueue
from asyncckpt.dist import SyncGroup
from asyncckpt._check import check_path, check_state_dict, check_step
from asyncckpt.errors import CallbackError, CheckpointError, CheckpointException, RankFailure
from asyncckpt.saving.handle import SaveCallback, SaveHandle, SaveResult, SaveTimings
from asyncckpt.options import SaveOptions
from asyncckpt.saving.planning import PlanCache, SavePlanResult, plan_save
from asyncckpt.async_utils.request import AsyncRequest
from asyncckpt.root import EXIT_TIMEOUT_ENV, CheckpointRoot, exit_timeout
from asyncckpt.saving import staging as _staging
from asyncckpt.saving.staging import StagingBuffer, StagingCopier, StagingPool
from asyncckpt.format import manifest as _commit
from asyncckpt.format import records as _records
from asyncckpt.format.crc import crc32
from asyncckpt.format.layout import RankLayout, build_layout
from asyncckpt.io.writer import RankWriteResult, WriteTask, current_umask, write_rank_files

__all__ = ["SaveInFlight", "plan", "stage", "commit", "Saver", "save", "default_calls_queue"]

_log = logging.getLogger("asyncckpt")


# ====================================================================== the record
@dataclasses.dataclass
class SaveInFlight:
    """One save in flight: what its phases need and produce.

    Attributes:
        final_dir: the committed name.
        tmp_dir: the hidden temporary directory every rank writes into.
        step: the step (``CheckpointManager``), else ``None``.
        sync: the ranks saving together (the training thread's group).
        coordinator_rank: the rank that commits.
        planned: this rank's plan, data and the global metadata.
        layout: this rank's data file layout.
        handle: the user's handle.
        root: the checkpoint root whose ``latest`` and retention the commit updates
            (``CheckpointManager``), else ``None``.
        buffer: the staging buffer (after :func:`stage`).
        timings: set by :func:`commit`.
    """

    final_dir: Path
    tmp_dir: Path
    step: int | None
    sync: SyncGroup
    coordinator_rank: int
    planned: SavePlanResult
    layout: RankLayout
    handle: SaveHandle
    root: CheckpointRoot | None = None
    buffer: StagingBuffer | None = None
    timings: SaveTimings | None = None


class _LayoutCache:
    """The last few layouts, keyed by plan object and non-tensor sizes."""

    def __init__(self, size: int = 4) -> None:
        self._size = size
        self._layouts: dict[Any, tuple[Any, RankLayout]] = {}

    def get(self, rank: int, planned: SavePlanResult) -> RankLayout:
        blobs = {i: len(d) for i, d in enumerate(planned.data) if isinstance(d, bytes)}
        # Cached plans are reused as is: the plan object (by identity) and the sizes
        # of the non-tensor values, which may change from save to save, fix the layout.
        key = (rank, id(planned.plan), tuple(sorted(blobs.items())))
        hit = self._layouts.get(key)
        if hit is not None and hit[0] is planned.plan:
            return hit[1]
        layout = build_layout(rank, list(planned.plan.items), blobs)
        if len(self._layouts) >= self._size:
            self._layouts.pop(next(iter(self._layouts)))
        self._layouts[key] = (planned.plan, layout)
        return layout

    def clear(self) -> None:
        self._layouts.clear()


class _LayoutExchange:
    """Commit step 1 without sending an unchanged file layout again (issue #11).

    The coordinator needs every rank's ``storage_data`` (a ``MetadataIndex`` and a
    ``_StorageInfo`` per record) for ``.metadata``. Gathered on every save, a cached
    layout's entries were pickled, sent and unpickled by every rank each time: at 1172
    FSDP2 records, about 8000 objects per commit on each rank, which set the pace of
    the cyclic GC's full collections (250-350 ms each, in whichever thread ran then,
    and a stall on every rank when one fell inside a save's plan).

    So a rank sends a layout in full once, with a random token, and after that only
    the token while its layout is that same object and the coordinator the same rank.
    The coordinator keeps each rank's last ``(token, storage_data)`` and the merged
    dict of the last commit (reused while every token is the same: the metadata
    pickle cache then compares identical objects).

    A rank forgets what it sent when a commit fails anywhere (the coordinator's
    outcome is broadcast to every rank); a coordinator that is sent a token it does
    not hold fails that commit, naming the rank, and the next save sends in full.
    One instance per :class:`Saver` (its ranks create theirs together).
    """

    def __init__(self) -> None:
        self._sent: tuple[int, RankLayout, int] | None = None  # (coordinator, layout, token)
        self._held: dict[int, tuple[int, dict]] = {}  # coordinator: rank -> (token, storage_data)
        self._merged: tuple[tuple[int, ...], dict] | None = None  # (tokens by rank, merged)
        #: how many commits this rank sent only a token (observable in tests).
        self.token_only = 0

    def outgoing(self, save: SaveInFlight) -> tuple[int, dict | None]:
        """What this rank contributes: ``(token, storage_data or None)``."""
        sent = self._sent
        if sent is not None and sent[0] == save.coordinator_rank and sent[1] is save.layout:
            self.token_only += 1
            return sent[2], None
        token = secrets.randbits(63)
        self._sent = (save.coordinator_rank, save.layout, token)
        return token, save.layout.storage_data

    def merged(self, gathered: list[tuple[int, dict | None]]) -> dict:
        """(coordinator) Every rank's ``storage_data`` merged, in rank order.

        Raises:
            CheckpointError: a rank sent a token whose layout this rank does not hold.
        """
        for rank, (token, storage_data) in enumerate(gathered):
            if storage_data is not None:
                self._held[rank] = (token, storage_data)
        tokens = tuple(token for token, _ in gathered)
        if self._merged is not None and self._merged[0] == tokens:
            return self._merged[1]
        merged: dict = {}
        for rank, (token, _) in enumerate(gathered):
            held = self._held.get(rank)
            if held is None or held[0] != token:
                raise CheckpointError(f"the coordinator does not hold rank {rank}'s file layout "
                                      f"(token {token:016x}); the next save sends every layout again")
            merged.update(held[1])
        self._merged = (tokens, merged)
        return merged

    def forget_sent(self) -> None:
        """After a failed commit: send the next layout in full."""
        self._sent = None


# ====================================================================== the phases
def plan(state_dict: dict[str, Any], final_dir: Path, handle: SaveHandle, *, sync: SyncGroup,
         coordinator_rank: int, step: int | None = None, root: CheckpointRoot | None = None,
         cache: PlanCache | None = None, layouts: _LayoutCache | None = None,
         check_target: bool = True, check_layout: Callable[[RankLayout], None] | None = None,
         in_flight: Callable[[Path], bool] | None = None) -> SaveInFlight:
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
    would fail at commit).

    Raises:
        CheckpointError: invalid input or target on any rank, raised on every rank,
            before anything is written (``failures`` by rank).
    """
    if not 0 <= coordinator_rank < sync.world_size:
        raise ValueError(f"coordinator_rank {coordinator_rank} is not a rank of the group")

    def precheck() -> None:
        if in_flight is not None and in_flight(final_dir):
            what = f"step {step}" if step is not None else "a save"
            raise CheckpointError(
                f"{what} is already being saved to {final_dir}: an earlier save of it is still pending, "
                f"and a checkpoint is written once. Wait for it (handle.wait() or maybe_finalize(blocking=True)) "
                f"or save under another {'step' if step is not None else 'path'}")
        if final_dir.exists() and (not final_dir.is_dir() or any(final_dir.iterdir())):
            raise FileExistsError(f"{final_dir} exists and is not an empty directory; "
                                  "a checkpoint never overwrites one")

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
            + ". Every rank must save the same step into the same directory")

    with sync.describing(f"the plan of the save of {what}"):
        planned, layout = plan_save(state_dict, str(final_dir), sync, coordinator_rank,
                                    precheck if check_target else None, cache, finish=finish,
                                    agree=_target_ints(step, final_dir) if check_target else (),
                                    on_disagree=disagree)
    return SaveInFlight(final_dir=final_dir, tmp_dir=_commit.temporary_dir_for(final_dir, planned.token),
                        step=step, sync=sync, coordinator_rank=coordinator_rank, planned=planned,
                        layout=layout, handle=handle, root=root)


def _target_ints(step: int | None, final_dir: Path) -> tuple[int, int]:
    """What every rank must agree on, as int64s: the step (-1: none) and a 63-bit hash
    of the target directory's path."""
    digest = hashlib.blake2b(os.fsencode(final_dir), digest_size=8).digest()
    wide = step is not None and not -1 <= step < (1 << 63)
    return (-1 if step is None or wide else step,
            int.from_bytes(digest, "big") >> 1)


def stage(save: SaveInFlight, buffer: StagingBuffer, copier: StagingCopier, *, cpu: bool = True,
          cuda: bool = True, synchronize: bool = True, select: Callable[[torch.Tensor], bool] | None = None,
          blobs: bool = True) -> None:
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
    if cpu and blobs:
        _faults.hit("stage")
    data = save.planned.data
    if not buffer.pinned and cuda and any(isinstance(d, torch.Tensor) and d.is_cuda for d in data):
        buffer.populate(copier)  # on every copy thread: cudaHostRegister would fault them in on one
        buffer.pin()
    buffer.format(save.layout)
    pairs = [(dst, data[item]) for item, dst in buffer.views if select is None or select(data[item])]
    # A new buffer's pages are allocated by the copy threads, each just before its piece.
    copier.copy([dst for dst, _ in pairs], [src for _, src in pairs], cpu=cpu, cuda=cuda,
                populate=not buffer.populated)
    if cpu:
        buffer.populated = True
    if cpu and blobs:
        for slot in save.layout.blobs:
            buffer.write_bytes(slot.offset, data[slot.item])
    if synchronize:
        copier.synchronize()
    save.buffer = buffer


def write_task(save: SaveInFlight, pool: StagingPool, options: SaveOptions) -> WriteTask:
    """What the writer needs (picklable, torch-free): the staged buffer and the files."""
    assert save.buffer is not None
    return WriteTask(str(save.tmp_dir), save.buffer.ref, save.layout.files, pool.live_slab_ids,
                     umask=current_umask(), threads=options.write_threads, drop_cache=options.drop_page_cache)


def commit(save: SaveInFlight, result: RankWriteResult, sync: SyncGroup,
           pending_steps: Iterable[int] = (), exchange: _LayoutExchange | None = None) -> SaveTimings:
    """Phase 4, commit: make the checkpoint visible, atomically (all ranks, collective).

    Call sequence (``sync`` is the finalizer's group in the background):

    1. (all ranks) all_gather every rank's file layout and write result (with
       ``exchange``, only a token for a layout the coordinator already holds).
    2. (coordinator) DCP ``.metadata`` and ``.manifest.json`` (sizes, CRC-32s),
       fsync, rename the temporary directory to its final name, fsync the parent:
       the rename is the commit point.
    3. (coordinator) after the commit point: ``latest``, retention, leftovers
       (``save.root``); a failure here is a warning on a committed save.
    4. (all ranks) broadcast the coordinator's outcome of step 2.

    A collective of 1 or 4 that breaks (a rank destroyed its groups, or left) does not
    make the outcome up: the coordinator reports what it did (committed after its
    rename, whatever the broadcast); another rank waits (at most
    :data:`OUTCOME_WAIT_S`) until the coordinator decided, i.e. the temporary
    directory is gone (renamed, or removed by the coordinator alone, see
    ``Saver._settle``), and reports committed only if the final directory's manifest
    carries this save's token.

    Returns:
        The save's timings.

    Raises:
        CheckpointException: the commit failed (on every rank, with the
            coordinator's cause); nothing was committed.
    """
    started = time.monotonic()
    exchange = exchange if exchange is not None else _LayoutExchange()
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
            info = {"world_size": sync.world_size, "step": save.step, "save_token": save.planned.token}
            if save.planned.int_keys:  # dict keys that were int (DCP's metadata has str(key))
                info["int_keys"] = {fqn: list(ints) for fqn, ints in save.planned.int_keys.items()}
            if save.root is not None:
                info["commit_seq"] = save.root.next_commit_seq()  # the rollback order (root.py)
            metadata_bytes, records = _METADATA_PICKLE.encode(metadata)
            _commit.commit_directory(save.tmp_dir, save.final_dir, metadata_bytes, files, info, records)
        except Exception as exc:  # noqa: BLE001 - funnelled to every rank below
            failure = RankFailure.from_exception(exc, "commit failed: ")
        else:
            if save.root is not None:
                save.root.after_commit(save.final_dir, pending_steps)
    try:
        failure = sync.broadcast_object(failure, save.coordinator_rank)
    except BaseException as exc:
        exchange.forget_sent()
        if not isinstance(exc, Exception):
            raise
        if not coordinator:
            return _outcome_from_disk(save, result, sync, started, exc)
        if failure is None:  # renamed: committed, whatever the other ranks heard
            _log.warning("asyncckpt: %s is committed; the other ranks could not be told (%s)", save.final_dir,
                         str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
    if failure is not None:
        exchange.forget_sent()
        raise CheckpointException(save.handle.call_idx if save.handle.call_idx is not None else -1,
                                  {save.coordinator_rank: failure}, save.step, save.final_dir)
    write_s = max(r.write_s for _, r in gathered)
    nbytes = sum(r.nbytes for _, r in gathered)
    save.timings = save.handle._commit_timings(write_s, time.monotonic() - started, nbytes)
    return save.timings


#: Seconds a rank whose commit collective broke waits for the coordinator's decision.
OUTCOME_WAIT_S = 60.0


def _committed_on_disk(save: SaveInFlight, result: RankWriteResult, started: float) -> SaveTimings | None:
    """The save's timings (set on ``save``) if ``final_dir`` holds the checkpoint this
    save committed (its manifest carries this save's token), else ``None``."""
    try:
        manifest: dict[str, Any] | None = _commit.read_manifest(save.final_dir)
    except Exception:  # noqa: BLE001 - absent or not ours: not committed by this save
        manifest = None
    if manifest is None or manifest.get("save_token") != save.planned.token:
        return None
    small = (_commit.METADATA_NAME, _commit.RECORDS_NAME)
    nbytes = sum(e["size"] for n, e in manifest["files"].items() if n not in small)
    save.timings = save.handle._commit_timings(result.write_s, time.monotonic() - started, nbytes)
    return save.timings


def _outcome_from_disk(save: SaveInFlight, result: RankWriteResult, sync: SyncGroup, started: float,
                       cause: BaseException) -> SaveTimings:
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
        _log.warning("asyncckpt: the commit of %s broke on this rank (%s); the coordinator committed it",
                     name, why)
        return timings
    if save.tmp_dir.exists():
        text = (f"the commit of {name} broke on this rank ({why}) and the coordinator (rank "
                f"{save.coordinator_rank}) did not decide within {limit:g} s: it is not committed now "
                f"(a checkpoint that appears there later is complete)")
    else:
        text = (f"the commit of {name} broke on this rank ({why}); the coordinator (rank "
                f"{save.coordinator_rank}) did not commit it")
    raise CheckpointException(save.handle.call_idx if save.handle.call_idx is not None else -1,
                              {sync.rank: RankFailure(text)}) from cause


class _MetadataPickle:
    """The pickled DCP ``.metadata`` of the last commit, reused while only its
    ``storage_meta`` changes (issue #11: 50-220 ms of ``pickle.dumps`` per save at
    4096 tensors, in the finalizer thread, holding the GIL the training thread needs).

    A cached plan's metadata shares its ``state_dict_metadata`` dict across saves, and
    a cached layout gives equal ``storage_data``; then the bytes differ only in two
    strings of ``storage_meta``: the checkpoint path and the save's random id. Pickle
    stores a string as its length and bytes, so when the new strings have the old
    lengths (the same root, ``step_%08d`` names, 32 hex digits) they are written over
    the old ones in place, and the result is byte for byte what ``pickle.dumps`` gives.
    Otherwise the metadata is pickled afresh (and cached).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple | None = None
        self._data: bytes = b""
        self._at: tuple[int, int, int, int] = (0, 0, 0, 0)  # checkpoint_id, save_id: offset, length
        self._records: str | None = None  # the cached metadata's records (records_json), None: none
        #: how many commits reused the cached bytes (observable in tests).
        self.hits = 0

    def encode(self, metadata: Any) -> tuple[bytes, bytes | None]:
        """``pickle.dumps(metadata)`` and the records file for it (``None`` when an entry
        is not one record: :mod:`asyncckpt.format.records`), from the cache where
        possible (the records then differ only in the CRC-32 of the new bytes)."""
        meta = metadata.storage_meta
        cid = str(meta.checkpoint_id).encode() if meta is not None and meta.checkpoint_id is not None else None
        sid = meta.save_id.encode() if meta is not None and isinstance(meta.save_id, str) else None
        with self._lock:
            key = self._key
            if (key is not None and cid is not None and sid is not None
                    and key[0] is metadata.state_dict_metadata and key[1] == metadata.planner_data
                    and key[2] == metadata.storage_data and key[3] == metadata.version
                    and key[4] == (meta.load_id, list(meta.modules)) and len(cid) == self._at[1]
                    and len(sid) == self._at[3]):
                data = bytearray(self._data)
                data[self._at[0]:self._at[0] + len(cid)] = cid
                data[self._at[2]:self._at[2] + len(sid)] = sid
                self.hits += 1
                return bytes(data), self._records_file(self._records, data)
        data = pickle.dumps(metadata)
        found = _records.records_from_metadata(metadata)
        records = None if found is None else _records.records_json(found)
        with self._lock:
            self._key = None
            self._records = records
            if cid is not None and sid is not None and cid != sid and data.count(cid) == 1 and data.count(sid) == 1:
                self._key = (metadata.state_dict_metadata, metadata.planner_data, dict(metadata.storage_data),
                             metadata.version, (meta.load_id, list(meta.modules)))
                self._data = data
                self._at = (data.find(cid), len(cid), data.find(sid), len(sid))
        return data, self._records_file(records, data)

    @staticmethod
    def _records_file(records: str | None, data: bytes | bytearray) -> bytes | None:
        return None if records is None else _records.records_file(records, crc32(data))


_METADATA_PICKLE = _MetadataPickle()


# ====================================================================== the saver
#: With overlapped staging, CPU tensors up to this size (bytes) are copied before
#: ``save`` returns: buffers such as BatchNorm's running statistics change in the next
#: forward, before ``synchronize_staging``, and cost little to copy at once.
OVERLAP_SYNC_BYTES = 1 << 20


def _small(t: torch.Tensor) -> bool:
    return not t.is_cuda and t.numel() * t.element_size() <= OVERLAP_SYNC_BYTES


class _Overlapped:
    """An overlapped staging: the large CPU copies run in a thread while training goes on.

    Every tensor copied after ``save`` returned is watched through its version counter
    (``Tensor._version``, shared with the views and detached copies the plan holds; for
    a DTensor, its local tensor's): one modified in place before the copy was
    synchronized fails the save, naming its keys, instead of committing torn data.

    And every optimizer waits for the copy before its step changes a parameter (a
    global step pre-hook, :func:`asyncckpt.saving.staging.watch_copy`): fused kernels and
    updates through ``.data`` bump no version counter. The versions are compared once,
    when the copy is over (:meth:`wait_copied`); later changes cannot tear it.
    """

    def __init__(self, save: SaveInFlight, run: Any, event: Any = None) -> None:
        self.save = save
        data = save.planned.data
        self.watched = [(item, data[item], data[item]._version) for item, _ in save.buffer.views
                        if not _small(data[item])] if save.buffer is not None else []
        self.error: BaseException | None = None
        self._event = event  # the D2H copies' CUDA event, or None
        self._lock = threading.Lock()
        self._copied = False
        self.thread = threading.Thread(target=self._run, args=(run,), name="asyncckpt-staging", daemon=True)
        self.thread.start()
        _staging.watch_copy(self)  # after start(): the hook joins the thread

    def _run(self, run: Any) -> None:
        try:
            run()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the request's preload_fn
            self.error = exc

    def wait_copied(self) -> None:
        """Wait until the copy is over (the thread's CPU copies and the D2H copies), then
        compare the versions once and stop watching (any thread; idempotent).

        A change seen then is kept in :attr:`error` (raised by the save's preload)."""
        if threading.current_thread() is self.thread:
            return
        self.thread.join()
        if self._event is not None:
            self._event.synchronize()
        with self._lock:
            if self._copied:
                return
            try:
                self.check_unmodified()
            except CheckpointError as exc:
                self.error = self.error or exc
            self.watched = []
            self._copied = True
        _staging.unwatch_copy(self)

    def check_unmodified(self) -> None:
        """Raise if a watched tensor was modified in place during its copy.

        Raises:
            CheckpointError: naming the state_dict keys that changed.
        """
        items = self.save.planned.plan.items
        changed = [items[item].index.fqn for item, tensor, version in self.watched if tensor._version != version]
        if changed:
            shown = ", ".join(repr(k) for k in changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
            raise CheckpointError(
                f"overlapped staging: {shown} changed in place before synchronize_staging(); the checkpoint "
                "would mix two steps, so it is not written. Call synchronize_staging() before the state "
                "changes (before optimizer.step()), or save without overlap_staging")


class Saver:
    """Runs the save phases on one queue for one owner (a manager, or ``asyncckpt.save``).

    Owns: a :class:`StagingPool` (freed by :meth:`release`), a copier, the plan and
    layout caches, the saves in flight and their handles. It learns how each save
    ended from the queue's settle listener, on every rank, whichever thread settled
    it: it then settles the handle, runs the completion callback, and for a failed
    save the coordinator removes its temporary directory (so a failed save leaves
    nothing behind; another rank never removes what the coordinator may commit).

    Args:
        queue: the queue that runs the writes (held weakly: the saver goes with it).
        options: staging and writing options.
        root: the checkpoint root of a ``CheckpointManager`` (``latest``, retention).
    """

    def __init__(self, queue: AsyncCallsQueue, options: SaveOptions | None = None,
                 root: CheckpointRoot | None = None) -> None:
        self.options = options or SaveOptions()
        self._queue_ref = weakref.ref(queue)
        self.root = root
        self.pool = StagingPool(self.options.staging_buffers)
        self.copier = StagingCopier(self.options.copy_threads)
        self.plan_cache: PlanCache | None = PlanCache() if self.options.plan_cache else None
        self.layouts = _LayoutCache()
        self.layout_exchange = _LayoutExchange()  # used by the finalizer thread's commits only
        self.lock = threading.RLock()  # one save() / synchronize_staging() at a time
        self._state = threading.RLock()  # guards the maps below (training and finalizer threads)
        self._overlapped: _Overlapped | None = None
        self._inflight: dict[int, SaveInFlight] = {}  # call_idx -> scheduled, not settled
        self._settling: set[int] = set()  # in _inflight, being settled by _on_settled
        self._unharvested: collections.deque[tuple[int, SaveInFlight, BaseException | None]] = collections.deque()
        self._reported: set[int] = set()  # outcomes already seen through handle.wait()
        self._callback_errors: list[tuple[SaveHandle, BaseException]] = []
        #: Timings of the most recently committed save (``None`` before the first).
        self.last_committed_timings: SaveTimings | None = None
        queue.add_settle_listener(self._on_settled)
        _live_savers.add(self)

    @property
    def queue(self) -> AsyncCallsQueue:
        queue = self._queue_ref()
        if queue is None:
            raise RuntimeError("the AsyncCallsQueue of this saver was garbage-collected")
        return queue

    def set_options(self, options: SaveOptions) -> None:
        """Use ``options`` for the next saves (the pool grows or shrinks lazily)."""
        self.options = options
        self.pool.num_buffers = options.staging_buffers
        if options.copy_threads != self.copier.threads:
            self.copier.close()
            self.copier = StagingCopier(options.copy_threads)
        if options.plan_cache and self.plan_cache is None:
            self.plan_cache = PlanCache()
        elif not options.plan_cache:
            self.plan_cache = None

    def pending_records(self) -> list[SaveInFlight]:
        """This saver's saves scheduled and not settled yet, in call order."""
        with self._state:
            return list(self._inflight.values())

    def _in_flight(self, final_dir: Path) -> bool:
        """True while a save of this saver into ``final_dir`` is scheduled and not settled."""
        with self._state:
            return any(record.final_dir == final_dir for record in self._inflight.values())

    def pending_steps(self) -> list[int]:
        """Steps of this saver's saves scheduled and not settled yet."""
        with self._state:
            return [s.step for s in self._inflight.values() if s.step is not None]

    # ------------------------------------------------------------------ phases, driven
    def _check_memory(self, layout: RankLayout) -> None:
        """The memory guard (``SaveOptions.staging_memory_limit``), before any allocation.

        Raises:
            CheckpointError: a new staging buffer would take more than the allowed
                fraction of the memory available (funnelled to every rank by the plan).
        """
        limit = self.options.staging_memory_limit
        if limit is None:
            return
        need = self.pool.bytes_to_allocate(layout.slab_nbytes, self.queue.caller.is_running)
        if not need:
            return  # a buffer is reused: nothing to allocate (the steady state)
        available = psutil.virtual_memory().available
        if need > limit * available:
            raise CheckpointError(
                f"staging this rank's state needs a new host buffer of {need:,} bytes, more than "
                f"{limit:g} x the {available:,} bytes of memory available; free memory, use fewer "
                "staging_buffers, or pass SaveOptions(staging_memory_limit=None) to skip this check")

    def _buffer_for(self, save: SaveInFlight) -> StagingBuffer:
        queue = self.queue
        return self.pool.acquire(save.layout.slab_nbytes, save.layout.key,
                                 queue.caller.is_running, lambda idx: queue.wait_local(idx))

    def save(self, state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike, *, async_op: bool,
             process_group: Any, coordinator_rank: int, step: int | None = None,
             callback: SaveCallback | None = None) -> SaveHandle:
        """Save ``state_dict`` (see :func:`asyncckpt.save`); the caller holds :attr:`lock`."""
        started = time.monotonic()
        self.synchronize_staging()  # an earlier overlapped save is scheduled first
        final_dir = Path(checkpoint_dir).absolute()
        queue = self.queue
        if async_op:
            queue.start()  # collective the first time: the finalizer's group
        sync = SyncGroup(process_group)
        handle = SaveHandle(final_dir, step, started, callback, self)
        record = plan(state_dict, final_dir, handle, sync=sync, coordinator_rank=coordinator_rank, step=step,
                      root=self.root, cache=self.plan_cache, layouts=self.layouts,
                      check_layout=self._check_memory, in_flight=self._in_flight)
        if not async_op:
            self._save_sync(record, started)
            return handle
        if self.options.overlap_staging:
            buffer = self._buffer_for(record)
            # D2H copies are issued here (ordered after this thread's current stream,
            # they run asynchronously); small CPU tensors are copied now, the large
            # ones in a thread.
            stage(record, buffer, self.copier, cpu=False, synchronize=False)
            stage(record, buffer, self.copier, cuda=False, synchronize=False, select=_small, blobs=False)
            self._overlapped = _Overlapped(
                record, lambda: stage(record, buffer, self.copier, cuda=False, synchronize=False,
                                      select=lambda t: not _small(t)), self.copier.event)
            handle._set_staging(True)
            handle._add_stall(time.monotonic() - started)
            return handle
        self._schedule(record, lambda: self._stage_now(record))
        handle._add_stall(time.monotonic() - started)
        return handle

    def _stage_now(self, record: SaveInFlight) -> WriteTask:
        buffer = self._buffer_for(record)
        try:
            stage(record, buffer, self.copier)
        finally:
            record.planned.data.clear()  # drop references to the user's tensors
        return write_task(record, self.pool, self.options)

    def _schedule(self, record: SaveInFlight, preload: Any) -> None:
        queue = self.queue
        request = AsyncRequest(write_rank_files, (), [lambda: self._commit_call(record)], preload_fn=preload)
        # Registered before it is scheduled: the listener must know the call however
        # soon it settles (an interrupted or failed preload settles it at once).
        call_idx = queue.next_call_idx
        record.handle._set_scheduled(call_idx)
        with self._state:
            self._inflight[call_idx] = record
        scheduled = queue.schedule_async_request(request)
        assert scheduled == call_idx, "schedule_async_request was called concurrently on one queue"
        if record.buffer is not None:
            self.pool.lease(record.buffer, call_idx)

    def _commit_call(self, record: SaveInFlight) -> None:
        """The finalize function of a save's call: phase 4 on the finalizer's group."""
        queue = self.queue
        call_idx = record.handle.call_idx
        assert call_idx is not None
        result: RankWriteResult = queue.get_result(call_idx)
        commit(record, result, queue.finalize_sync, [s for s in self.pending_steps() if s != record.step],
               self.layout_exchange)

    def _save_sync(self, record: SaveInFlight, started: float) -> None:
        """A synchronous save: the same phases in this thread, after the pending saves.

        Interrupted (Ctrl-C, or a broken collective), the save is settled as failed
        and its temporary directory removed where no rank can commit it any more:
        always on the coordinator (it alone commits, and it is interrupted), on the
        other ranks never (the coordinator may still commit them). Then the interrupt
        is re-raised.
        """
        sync = record.sync
        failure: RankFailure | None = None
        result: RankWriteResult | None = None
        try:
            self.wait_all()  # commits stay in call order: `latest` never goes backwards
            try:
                result = write_rank_files(self._stage_now(record))
            except Exception as exc:  # noqa: BLE001 - funnelled to every rank
                failure = RankFailure.from_exception(exc)
            record.handle._add_stall(time.monotonic() - started)
            error: CheckpointException | None = None
            failures = sync.gather_failures(failure)
            if failures:
                error = CheckpointException(-1, failures, record.step, record.final_dir)
            else:
                assert result is not None
                try:
                    commit(record, result, sync, self.pending_steps())
                except CheckpointException as exc:
                    error = exc
        except BaseException as exc:
            if result is not None and _committed_on_disk(record, result, started) is not None:
                self._settle(record, None)  # interrupted after the commit point: committed, as on disk
                raise
            interrupted = CheckpointException(-1, {sync.rank: RankFailure.from_exception(exc, "interrupted: ")},
                                              record.step, record.final_dir)
            self._settle(record, interrupted)  # the coordinator removes its files: it did not commit
            raise
        self._settle(record, error)
        if error is not None:
            self.mark_reported(record.handle)
            self.attach_callback_errors(error)
            raise error
        self.raise_callback_errors()

    def prepare(self, state_dict: dict[str, Any], process_group: Any, coordinator_rank: int) -> int:
        """Plan ``state_dict`` and allocate and format its staging buffer, writing nothing.

        Returns:
            The bytes of host memory the staging buffer holds.
        """
        with self.lock:
            self.synchronize_staging()
            sync = SyncGroup(process_group)
            handle = SaveHandle(Path(""), None, time.monotonic(), None, None)
            record = plan(state_dict, Path(""), handle, sync=sync, coordinator_rank=coordinator_rank,
                          cache=self.plan_cache, layouts=self.layouts, check_target=False,
                          check_layout=self._check_memory)
            buffer = self._buffer_for(record)
            buffer.populate(self.copier)  # the allocation a first save would pay
            buffer.format(record.layout)
            if any(isinstance(d, torch.Tensor) and d.is_cuda for d in record.planned.data):
                buffer.pin()
            return buffer.nbytes

    def synchronize_staging(self) -> None:
        """Finish an overlapped staging and schedule its write (see ``SaveHandle``)."""
        with self.lock:
            pending, self._overlapped = self._overlapped, None
            if pending is None:
                return
            started = time.monotonic()
            record = pending.save

            def preload() -> WriteTask:  # joins the copy; runs inside schedule_async_request
                try:
                    pending.wait_copied()  # compares the versions
                    self.copier.synchronize()
                    if pending.error is not None:
                        raise pending.error
                finally:
                    record.planned.data.clear()
                    pending.watched = []
                return write_task(record, self.pool, self.options)

            try:
                self._schedule(record, preload)
            finally:
                record.handle._set_staging(False)
                record.handle._add_stall(time.monotonic() - started)

    # ------------------------------------------------------------------ outcomes
    def _on_settled(self, call_idx: int, exc: CheckpointException | None) -> bool:
        """The queue's settle listener (any thread, every rank). True for this saver's
        calls: their outcomes are reported through their handles and :meth:`harvest`."""
        with self._state:
            record = self._inflight.get(call_idx)
            if record is None or call_idx in self._settling:
                return record is not None
            self._settling.add(call_idx)  # stays in _inflight until queued for harvest
        self._settle(record, exc)
        return True

    def _settle(self, record: SaveInFlight, exc: BaseException | None) -> None:
        handle = record.handle
        if isinstance(exc, CheckpointException):  # named by the step and path, not the queue's call
            exc = exc.for_save(record.step, record.final_dir)
        if exc is not None:
            if record.sync.rank == record.coordinator_rank:
                # The coordinator alone, once it decided not to commit: another rank
                # must never remove what the coordinator may still be committing.
                _commit.discard_temporary(record.tmp_dir)
            outcome: Any = exc
        else:
            assert record.timings is not None
            outcome = SaveResult(record.final_dir, record.step, record.timings, record.timings.bytes)
            self.last_committed_timings = record.timings
        callback = handle._take_callback()
        if callback is not None:
            try:
                callback(outcome)
            except Exception as error:  # reported by raise_callback_errors, never swallowed
                _log.error("the completion callback of the save of %s raised", handle.checkpoint_dir,
                           exc_info=error)
                with self._state:
                    self._callback_errors.append((handle, error))
        record.planned = record.planned._replace(data=[])
        # Out of _inflight and queued for harvest at once (a save is always in one of
        # them, else wait_all() misses it while it settles, and a blocking harvest
        # returns without its failure), and before the handle is settled (a wait() that
        # returns marks the outcome reported, and must find it queued, else harvest
        # reports it again).
        if handle.call_idx is not None:
            with self._state:
                self._inflight.pop(handle.call_idx, None)
                self._settling.discard(handle.call_idx)
                self._unharvested.append((handle.call_idx, record, exc))
        handle._settle(record.timings if exc is None else None, exc)

    def poll_foreground(self, handle: SaveHandle) -> None:
        """Make progress on a queue finalized in the training loop, single process only."""
        queue = self._queue_ref()
        if (queue is None or queue.background_finalize or queue.closed or handle.call_idx is None
                or queue.sync.active or not queue.is_pending(handle.call_idx)):
            return
        try:
            queue.maybe_finalize_async_calls(blocking=False)
        except CheckpointException:
            pass  # settles its handle

    def drive_foreground(self, handle: SaveHandle, timeout: float | None) -> None:
        """Finalize up to ``handle`` on a queue finalized in the training loop (collective)."""
        queue = self._queue_ref()
        if queue is None or queue.background_finalize or handle.call_idx is None:
            return
        if timeout is not None and not queue.wait_local(handle.call_idx, timeout):
            raise TimeoutError(f"the write of {handle.checkpoint_dir} did not finish within {timeout} s")
        while queue.is_pending(handle.call_idx):
            try:
                queue.maybe_finalize_async_calls(blocking=True, until=handle.call_idx)
            except CheckpointException:
                pass  # an earlier call's failure settles that call's handle

    def wait_all(self) -> None:
        """Wait until every save of this saver is settled (no error raised here)."""
        self.synchronize_staging()
        with self._state:
            records = list(self._inflight.values())
        for record in records:
            self.drive_foreground(record.handle, None)
            record.handle._wait_settled()

    def harvest(self, blocking: bool) -> list[SaveInFlight]:
        """The saves committed since the last harvest, in order; raises the first failure
        not reported yet (``CheckpointManager.maybe_finalize``). Not blocking, a failure
        behind committed saves is left for the next harvest; blocking, it is raised now
        (a note names the committed steps). Callback errors are left for
        :meth:`raise_callback_errors`.

        With a queue finalized in the training loop this first finalizes (collective).
        """
        queue = self._queue_ref()
        if queue is not None and not queue.background_finalize and not queue.closed:
            try:
                queue.maybe_finalize_async_calls(blocking=blocking)
            except CheckpointException:
                pass  # settled its handle; raised below, in order
        if blocking:
            self.wait_all()
        committed: list[SaveInFlight] = []
        failure: BaseException | None = None
        with self._state:
            while self._unharvested:
                call_idx, record, exc = self._unharvested[0]
                reported = call_idx in self._reported
                if exc is not None and not reported:
                    if committed and not blocking:
                        break  # raised by the next harvest, in order
                    # blocking (the end of training): raised now, whatever committed before
                    self._unharvested.popleft()
                    failure = exc
                    break
                self._unharvested.popleft()
                self._reported.discard(call_idx)
                if exc is None and not reported:
                    committed.append(record)
        if failure is not None:
            if committed:
                steps = ", ".join(str(r.step) if r.step is not None else str(r.final_dir) for r in committed)
                failure.add_note(f"committed before this failure and reported with it: {steps}")
            self.attach_callback_errors(failure)
            raise failure
        return committed

    def mark_reported(self, handle: SaveHandle) -> None:
        """An outcome the user saw already (through ``wait``): harvest does not report it again."""
        if handle.call_idx is not None:
            with self._state:
                if any(entry[0] == handle.call_idx for entry in self._unharvested):
                    self._reported.add(handle.call_idx)

    def attach_callback_errors(self, exc: BaseException) -> None:
        """Report the pending callback errors as notes of ``exc`` (which is raised instead)."""
        with self._state:
            errors, self._callback_errors = self._callback_errors, []
        for handle, error in errors:
            exc.add_note(f"the completion callback of the save of {handle.checkpoint_dir} also raised "
                         f"{type(error).__name__}: {error}")

    def raise_callback_errors(self) -> None:
        """Raise :class:`CallbackError` for the callbacks that raised since the last call."""
        with self._state:
            errors, self._callback_errors = self._callback_errors, []
        if not errors:
            return
        lines = [f"{h.checkpoint_dir} (committed): {type(e).__name__}: {e}" for h, e in errors]
        raise CallbackError("a completion callback raised: " + "; ".join(lines), [e for _, e in errors]) \
            from errors[0][1]

    def busy(self) -> bool:
        """True while a save of this saver is being staged (overlapped) or is pending."""
        with self._state:
            return self._overlapped is not None or bool(self._inflight)

    def settle_within(self, timeout: float, when: str) -> list[SaveInFlight]:
        """Let the pending saves settle for up to ``timeout`` seconds, then name on
        logger ``asyncckpt`` each one still pending (lost unless the caller waits on)
        and each one that failed, also earlier failures not reported yet (no
        ``maybe_finalize`` since). An overlapped save still copying is handed to the
        writer first. Saves of a queue finalized in the training loop cannot settle
        without the loop: they are named at once.

        Args:
            timeout: seconds to wait, in all.
            when: the occasion, for the messages ("at interpreter exit").

        Returns:
            The saves still pending.
        """
        try:
            self.synchronize_staging()
        except Exception:  # noqa: BLE001 - its failure is reported through its handle
            pass
        queue = self._queue_ref()
        background = queue is not None and queue.background_finalize and not queue.closed
        pending = self.pending_records()
        lost = _settle_or_name([(background, record) for record in pending], timeout, when)
        named = {id(record) for record in pending}
        with self._state:  # failed before, never reported (no maybe_finalize since): named too
            earlier = [(record, exc) for idx, record, exc in self._unharvested
                       if exc is not None and idx not in self._reported and id(record) not in named]
        for record, exc in earlier:
            _log.warning("asyncckpt: the save of %s failed (not reported before %s): %s", _describe_save(record),
                         when.removeprefix("when "), str(exc).splitlines()[0])
        return lost

    def release(self) -> None:
        """Free the staging buffers and stop listening to the queue; never blocks on a
        write (a buffer a write may still read is closed here but its memory is left
        to that write's process). An overlapped save not handed to the writer yet is
        dropped: its handle fails."""
        pending, self._overlapped = self._overlapped, None
        if pending is not None:
            pending.wait_copied()  # optimizers stop waiting for it
            record = pending.save
            record.planned.data.clear()
            record.handle._set_staging(False)
            self._settle(record, CheckpointError(
                f"the save of {_describe_save(record)} was dropped before it was handed to the writer (its "
                "manager was closed with abort=True or released before synchronize_staging()); it is not saved"))
        self.copier.close()
        queue = self._queue_ref()
        self.pool.release_all(queue.caller.is_running if queue is not None else None)
        self.layouts.clear()
        queue = self._queue_ref()
        if queue is not None:
            queue.remove_settle_listener(self._on_settled)


# ====================================================================== interpreter exit
#: Every saver of this process (a forked child forgets its parent's).
_live_savers: "weakref.WeakSet[Saver]" = weakref.WeakSet()
#: Pending saves get ``root.exit_timeout()`` seconds at exit to commit; one still
#: pending then is lost, and named.
_exit_done: list[int] = []  # the pid whose exit hook ran (it runs once per process)


def _describe_save(record: SaveInFlight) -> str:
    """``step N (path)`` for a manager's save, else its path."""
    return f"step {record.step} ({record.final_dir})" if record.step is not None else str(record.final_dir)


def _settle_or_name(pending: list[tuple[bool, SaveInFlight]], timeout: float, when: str,
                    hint: str = "") -> list[SaveInFlight]:
    """Wait up to ``timeout`` seconds in all for the saves finalized in the background
    (``(True, record)``) to settle, then name each one still pending and each failed
    one (a warning on logger ``asyncckpt``, shown on stderr). Returns those pending."""
    deadline = time.monotonic() + timeout
    for background, record in pending:
        if background:
            record.handle._wait_settled(max(0.0, deadline - time.monotonic()))
    lost = []
    for _, record in pending:
        handle = record.handle
        if not handle._wait_settled(0):
            lost.append(record)
            _log.warning("asyncckpt: the save of %s was still pending %s and is lost (not committed; waited "
                         "%.0f s, %s)%s", _describe_save(record), when, timeout, EXIT_TIMEOUT_ENV, hint)
        elif handle.exception() is not None:
            _log.warning("asyncckpt: the save of %s, pending %s, failed: %s", _describe_save(record), when,
                         str(handle.exception()).splitlines()[0])
    return lost


def _settle_pending_at_exit() -> None:
    """At interpreter exit: let pending saves commit, for a bounded time, then name each
    one that is lost (a ``logging`` warning on logger ``asyncckpt``, shown on stderr).

    Runs before the workers are stopped (atexit is last-in first-out, and this module
    registers after :mod:`asyncckpt.async_utils.callers`; on multiprocessing's exit path, with a
    higher priority). Saves of a queue finalized in the training loop cannot commit
    without the loop: they are named at once.
    """
    if os.getpid() in _exit_done:
        return
    _exit_done.append(os.getpid())  # also tells the threads of dropped managers (below)
    pending = []
    queues: dict[int, AsyncCallsQueue] = {}
    for saver in list(_live_savers):
        queue = saver._queue_ref()
        if queue is None or queue.closed or queue.caller.foreign:
            continue
        try:
            saver.synchronize_staging()  # an overlapped save still copying: hand it to the writer
        except Exception:  # noqa: BLE001 - at exit: its failure is reported through its handle
            pass
        records = saver.pending_records()
        pending += [(queue.background_finalize, record) for record in records]
        queues.update((id(record), queue) for record in records)
    if not pending:
        return
    lost = _settle_or_name(pending, exit_timeout(), "at interpreter exit", "; call close() or wait() before exiting")
    # A lost save's queue is aborted now, while the interpreter is whole: its finalizer
    # thread must not be left inside a call (waiting for the writer, or in a collective)
    # when the process groups are torn down (gloo then aborts the process).
    for queue in {id(q): q for q in (queues[id(record)] for record in lost)}.values():
        try:
            queue.close(abort=True)
        except Exception as exc:  # noqa: BLE001 - at exit: nobody left to raise it to
            _log.debug("aborting a queue at exit failed: %s", exc)


atexit.register(_settle_pending_at_exit)
# A process started by multiprocessing exits through its own exit path (no atexit):
# run there too, before asyncckpt.async_utils.callers stops the workers (priority 100).
mp_util.Finalize(None, _settle_pending_at_exit, exitpriority=150)
os.register_at_fork(after_in_child=_live_savers.clear)


# ====================================================================== a dropped manager
def release_when_settled(saver: Saver, queue: AsyncCallsQueue | None,
                         then: Callable[[], None] | None = None) -> None:
    """What a ``CheckpointManager`` collected without ``close()`` leaves to do (and
    ``close()`` itself, for saves still pending on a queue passed in).

    Its pending saves still commit: a thread (``asyncckpt-dropped-manager``) holds the
    saver and the manager's own queue (``queue``; ``None`` for a queue passed in)
    until every save settled (an overlapped one is handed to the writer first; on a
    queue passed in, which another thread may be scheduling on, it is dropped and
    named), names each failed one, then frees the staging buffers and closes the
    manager's own queue. Without
    pending saves this frees the buffers at once (and the queue goes with its last
    reference). A save still pending at interpreter exit is left to the exit's bound
    and named there. ``then`` (the manager's root lock release) runs last, once no
    save of the manager can commit any more. Runs in whichever thread collected the
    manager.
    """
    q = saver._queue_ref()
    if q is None or q.closed or q.caller.foreign or not saver.busy():
        saver.release()
        if then is not None:
            then()
        return
    threading.Thread(target=_finish_dropped, args=(saver, queue, then), name="asyncckpt-dropped-manager",
                     daemon=True).start()


def _finish_dropped(saver: Saver, queue: AsyncCallsQueue | None, then: Callable[[], None] | None) -> None:
    try:
        _settle_dropped(saver, queue)
    finally:
        if then is not None:
            then()


def _settle_dropped(saver: Saver, queue: AsyncCallsQueue | None) -> None:
    if queue is not None:  # the manager's own queue: nobody else schedules on it now
        try:
            saver.synchronize_staging()  # an overlapped save still copying: hand it to the writer
        except Exception:  # noqa: BLE001 - reported through its handle
            pass
    records = saver.pending_records()
    for record in records:
        record.handle._wait_settled()  # committed by the queue's finalizer (or failed, or aborted)
    if os.getpid() in _exit_done:
        return  # the interpreter exits: its hook named what is lost, its exit path stops the worker
    for record in records:
        if record.handle.exception() is not None:
            _log.warning("asyncckpt: the save of %s, pending when its CheckpointManager was dropped without "
                         "close(), failed: %s", _describe_save(record),
                         str(record.handle.exception()).splitlines()[0])
    overlapped = saver._overlapped
    if overlapped is not None:  # a queue passed in: its owner's thread schedules on it, not this one
        _log.warning("asyncckpt: the save of %s is dropped: it was never handed to the writer (its "
                     "CheckpointManager was closed with abort=True, or dropped without close(), before "
                     "synchronize_staging())", _describe_save(overlapped.save))
    saver.release()
    if queue is not None:
        try:
            queue.close()
        except Exception as exc:  # noqa: BLE001 - nobody left to raise it to
            _log.warning("asyncckpt: closing the queue of a CheckpointManager dropped without close() failed: %s",
                         exc)


# ====================================================================== free functions
_savers: "weakref.WeakKeyDictionary[AsyncCallsQueue, Saver]" = weakref.WeakKeyDictionary()
_default_queues: dict[int, tuple[Any, AsyncCallsQueue]] = {}
_module_lock = threading.Lock()


def _saver_for(queue: AsyncCallsQueue, options: SaveOptions | None = None) -> Saver:
    with _module_lock:
        saver = _savers.get(queue)
        if saver is None:
            saver = Saver(queue, options)
            _savers[queue] = saver
            weakref.finalize(queue, saver.release)  # free the staging buffers with the queue
        elif options is not None and options != saver.options:
            saver.set_options(options)
        return saver


def default_calls_queue(process_group: Any = None) -> AsyncCallsQueue:
    """The queue behind ``asyncckpt.save(..., async_op=True)`` for ``process_group``.

    One per process group: a persistent worker (started without re-importing the main
    script) and a background finalizer. Close it with ``close()`` to commit the
    pending saves and stop the worker (every rank; a later ``save`` makes a new one),
    or ``close(abort=True)`` to drop them.
    """
    with _module_lock:
        hit = _default_queues.get(id(process_group))
        if hit is not None and hit[0] is process_group and not hit[1].closed:
            return hit[1]
        queue = AsyncCallsQueue(persistent=True, process_group=process_group, import_main=False,
                                background_finalize=True)
        _default_queues[id(process_group)] = (process_group, queue)
        return queue


def save(
    state_dict: dict[str, Any],
    checkpoint_dir: str | os.PathLike,
    *,
    async_op: bool = False,
    calls_queue: AsyncCallsQueue | None = None,
    process_group: Any = None,
    coordinator_rank: int = 0,
    overlap_staging: bool | None = None,
    callback: SaveCallback | None = None,
    options: SaveOptions | None = None,
    step: int | None = None,
) -> SaveHandle:
    """Save ``state_dict`` as a torch.distributed.checkpoint directory, atomically.

    Collective: every rank of ``process_group`` calls it with its own state_dict.

    Args:
        state_dict: nested dicts / lists of tensors (CPU or CUDA, any dtype, DTensor
            included: each rank stages and writes only its local shards) and
            picklable Python values.
        checkpoint_dir: the directory to create; must not exist (or be empty).
        async_op: ``False``: write and commit before returning. ``True``: stage (copy
            into reused host buffers) and return; the write and the commit run in the
            background (the handle settles by itself). Mutating the state after
            return never changes the checkpoint.
        calls_queue: the queue that runs the write (default:
            :func:`default_calls_queue` of ``process_group``).
        process_group: the ranks saving together (default: the default group, or a
            single process without ``torch.distributed``).
        coordinator_rank: the rank (in ``process_group``) that commits.
        overlap_staging: shorthand for ``options.overlap_staging``.
        callback: called once, in this process, after finalize, with the
            :class:`SaveResult` (committed) or the exception (failed); in the queue's
            finalizer thread for ``async_op=True`` (it must be thread-safe). If it
            raises, the error is logged and raised as :class:`CallbackError` by the
            next ``wait`` (the queue and the checkpoint are unaffected).
        options: staging and writing options (:class:`SaveOptions`).
        step: the training step this state belongs to (a non-negative int), recorded
            in the manifest (``asyncckpt ls`` shows it) and in error messages;
            ``None`` (default): none.

    Returns:
        A :class:`SaveHandle`; for ``async_op=False`` it is already committed.

    Raises:
        CheckpointError: invalid input or target on any rank (raised on every rank,
            before anything is written).
        CheckpointException: (``async_op=False``) the write or commit failed on some
            rank; nothing was committed.
        ValueError: ``overlap_staging`` without ``async_op``; both ``options`` and
            ``overlap_staging``.
        InvalidArgumentError: (a ``ValueError`` and ``TypeError``) ``state_dict`` is not
            a dict, ``checkpoint_dir`` not a path, ``step`` not a non-negative int.
    """
    hint = "; the call is save(state_dict, checkpoint_dir)"
    check_state_dict(state_dict, hint=hint)
    check_path(checkpoint_dir, hint=hint)
    if step is not None:
        step = check_step(step)
    opts = SaveOptions.resolve(options, overlap_staging=overlap_staging)
    if opts.overlap_staging and not async_op:
        raise ValueError("overlap_staging needs async_op=True")
    queue = calls_queue if calls_queue is not None else default_calls_queue(process_group)
    saver = _saver_for(queue, opts)
    with saver.lock:
        return saver.save(state_dict, checkpoint_dir, async_op=async_op, process_group=process_group,
                          coordinator_rank=coordinator_rank, callback=callback, step=step)
