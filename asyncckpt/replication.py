"""The node-local tier's phases: local save, replication to peer nodes, and restore.

Beside the persistent tier's save, not in it: a local save is planned and staged by a
:class:`~asyncckpt.saving.saver.Saver` of its own (its own staging buffers) on the
manager's queue (the same worker writes it), into the node's tier directory
(:class:`~asyncckpt.io.local_tier.NodeLocalStorage`). Each rank saves *its own* state
as a one-rank checkpoint (planned on a process group of this rank alone, so nothing is
deduplicated away: a DDP rank keeps the full state, an FSDP rank its shards), so that
a rank restores without reading any other rank's data.

Phases of a local save of step ``s`` (after NVIDIA resiliency-ext's
``LocalCheckpointManager`` + ``CliqueReplicationStrategy``; Orbax's emergency manager):

=========  ================================  ==================================  ==========
phase      what                              thread / process                    ranks
=========  ================================  ==================================  ==========
plan       this rank's one-rank plan; then   training thread                     all (one
           the error funnel of the job                                           int64
                                                                                 all_gather)
stage      copy into the local saver's       training thread                     each
           staging buffer
write      this rank's files (into its       the manager's worker                each
           shard's spare), fsynced
commit     this rank's ``.metadata``,        the queue's finalizer thread        each
           manifest, rename (local)
replicate  the funnel of the local commits;  the finalizer thread, on its        all
           each rank sends its shard's       private gloo group                  (collective)
           files to its ``replicas`` peers
           on other nodes (gloo isend/
           irecv); each receiver writes
           (into its shard's spare),
           CRC-checks and renames; the
           funnel of the arrivals
mark       ``restorable.json`` of every      the finalizer thread                each
           shard this node stored, older
           steps removed (the newest
           older one kept as the shard's
           spare, written over by the
           next)
=========  ================================  ==================================  ==========

A step is restorable once every rank's shard is stored on ``replicas + 1`` nodes: the
replicate phase's last funnel decides it for all ranks together, like a commit; a step
whose replication failed anywhere is marked nowhere (its handle fails; training goes
on). Restore (:meth:`LocalCheckpoints.restore`) is one collective at (re)start; see
its docstring for the contract.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import ctypes
import dataclasses
import functools
import io
import itertools
import json
import logging
import os
import pickle
import shutil
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import psutil
import torch
import torch.distributed as dist

from asyncckpt import _faults, _fs
from asyncckpt._gc import gc_paused
from asyncckpt.async_utils.calls_queue import AsyncCallsQueue
from asyncckpt.dist import SyncGroup
from asyncckpt.errors import (
    AsyncckptError,
    CheckpointError,
    CheckpointException,
    CheckpointPathError,
    CorruptCheckpointError,
    InvalidArgumentError,
    RankFailure,
)
from asyncckpt.format.crc import crc32
from asyncckpt.format.layout import RankLayout
from asyncckpt.format.manifest import MANIFEST_NAME, METADATA_NAME, RECORDS_NAME, is_plain_name
from asyncckpt.format.records import Record, parse_records
from asyncckpt.io.local_tier import Arrival, LocalTier, NodeLocalStorage, Packed, check_segments
from asyncckpt.loading.api import load
from asyncckpt.loading.dcp import SafeLoadPlanner, set_value
from asyncckpt.loading.direct import local_shard, plan_direct_load
from asyncckpt.loading.framing import suffix_matches, writer_framing
from asyncckpt.options import SaveOptions
from asyncckpt.saving.handle import SaveHandle
from asyncckpt.saving.phases import commit, plan
from asyncckpt.saving.record import SaveInFlight
from asyncckpt.saving.saver import Saver, _SaveLink

__all__ = ["LocalCheckpoints", "RestoreResult", "replica_map"]

_log = logging.getLogger("asyncckpt")


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """What :meth:`LocalCheckpoints.restore` (``CheckpointManager.restore``) restored.

    Attributes:
        step: the step restored.
        tier: ``"local"`` (the node-local tier, shards from this node or from peers)
            or ``"persistent"`` (the manager's root, or the bucket of its ``upload_to``).
        peers: for the local tier, ``rank -> the rank that sent it its shard``, for
            every rank whose shard was not on its own node (empty: no transfer).
        source: this rank's source: ``"local"``, ``"peer <rank>"`` or ``"persistent"``.
        notes: the fallbacks taken on the way (a bad or missing copy, another world
            size), one line each.
        location: for the persistent tier, where the step was read: its directory in
            the root, or its ``s3://`` URL (the bucket of ``upload_to``); ``""`` when
            not known (or for the local tier: see ``peers`` and ``source``).
    """

    step: int
    tier: str
    peers: dict[int, int]
    source: str
    notes: tuple[str, ...] = ()
    location: str = ""

    def __str__(self) -> str:
        where = "the persistent tier" if self.tier == "persistent" else "the local tier"
        if self.location:
            where += f" ({self.location})"
        if self.peers:
            fetched = ", ".join(f"rank {r} from rank {p}" for r, p in sorted(self.peers.items()))
            where += f" (fetched from peers: {fetched})"
        elif self.tier == "local":
            where += " (every shard on its own node)"
        return f"restored step {self.step} from {where}" + "".join(f"; {n}" for n in self.notes)


def replica_map(nodes: list[int], replicas: int) -> list[list[int]]:
    """For every rank, the ranks that store its shard: one rank on each of the next
    ``replicas`` nodes (in node order, wrapping), the one of the same position among
    its node's ranks (after ``CliqueReplicationStrategy``'s ring of nodes).

    Args:
        nodes: ``nodes[r]`` is rank ``r``'s node id.
        replicas: copies on other nodes per shard.

    Returns:
        ``targets[r]``: the ranks storing rank ``r``'s shard besides ``r`` itself.

    Raises:
        InvalidArgumentError: fewer than ``replicas + 1`` nodes.
    """
    order = sorted(set(nodes))
    if replicas and len(order) < replicas + 1:
        raise InvalidArgumentError(
            f"LocalTier(replicas={replicas}) needs at least {replicas + 1} nodes; this job has {len(order)} "
            f"(nodes from GROUP_RANK / LOCAL_WORLD_SIZE, or LocalTier(node=...)); LocalTier(replicas=0) keeps "
            "the tier on each node without copies"
        )
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    targets = []
    for rank, node in enumerate(nodes):
        i, j = order.index(node), members[node].index(rank)
        row = []
        for k in range(1, replicas + 1):
            peers = members[order[(i + k) % len(order)]]
            row.append(peers[j % len(peers)])
        targets.append(row)
    return targets


def local_shards(obj: Any) -> Any:
    """``obj`` (a state_dict) with every DTensor replaced by its local shard
    (:func:`~asyncckpt.loading.direct.local_shard`: a plain tensor, the DTensor's own
    memory, so that a load into it fills the DTensor), through nested dicts, lists and
    tuples; other values as they are. A container with no DTensor inside is returned
    itself, not copied (a state without DTensors costs one walk of its containers, and
    nothing when ``torch.distributed.tensor`` was never imported); one with a DTensor
    inside is copied (a ``dict`` for any mapping), the caller's left as it is.

    The local tier stores and restores a rank's own bytes, for the same world size and
    sharding only (any other restores from the persistent tier): as plain tensors they
    take the direct paths, with no DCP planning over global chunk offsets, no
    ``.metadata``-only layout and no second pass over the bytes.
    """
    module = sys.modules.get("torch.distributed.tensor")  # (not imported: no DTensor exists)
    return obj if module is None else _shards(obj, module.DTensor)


#: Types that are never a container nor a DTensor (checked first: most of a state's values).
_LEAVES = frozenset((torch.Tensor, torch.nn.Parameter, str, int, float, bool, type(None)))


def _shards(obj: Any, dtensor: type) -> Any:
    """:func:`local_shards` below ``torch.distributed.tensor``'s ``dtensor`` class."""
    if type(obj) in _LEAVES:
        return obj
    if isinstance(obj, dtensor):
        return local_shard(obj)
    if isinstance(obj, dict):
        out: Any = None
        for k, v in obj.items():
            if type(v) in _LEAVES:
                continue
            new = _shards(v, dtensor)
            if new is not v:
                if out is None:
                    out = dict(obj)
                out[k] = new
        return obj if out is None else out
    if isinstance(obj, list) or (isinstance(obj, tuple) and not hasattr(obj, "_fields")):
        items = [_shards(v, dtensor) for v in obj]
        if all(new is v for new, v in zip(items, obj)):
            return obj
        return items if isinstance(obj, list) else tuple(items)
    return obj


@contextlib.contextmanager
def _local_shards_in_place(state_dict: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """``state_dict`` with every DTensor in its dicts and lists swapped for its local
    shard (as :func:`local_shards`) while the block runs, then put back: a restore
    fills the shards (the DTensors' memory) and sets the other values in the
    caller's own dicts."""
    swapped: list[tuple[Any, Any, Any, Any]] = []

    def swap(container: Any) -> None:
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for key, value in list(items):
            shard = local_shard(value)
            if shard is not None:
                container[key] = shard
                swapped.append((container, key, value, shard))
            elif isinstance(value, (dict, list)):
                swap(value)

    try:
        swap(state_dict)
        yield state_dict
    finally:
        for container, key, dtensor, shard in reversed(swapped):
            if container[key] is shard:
                container[key] = dtensor


def _refused(what: str, failures: dict[int, RankFailure]) -> CheckpointError:
    """The error every rank raises when ``what`` failed on some rank: each failing
    rank's first line of cause, in rank order."""
    causes = "; ".join(f"rank {r}: {str(f).splitlines()[0]}" for r, f in sorted(failures.items()))
    return CheckpointError(f"{what} was refused ({causes})", failures)


def _node_of(tier: LocalTier, rank: int) -> int:
    if tier.node is not None:
        return tier.node
    if "GROUP_RANK" in os.environ:
        return int(os.environ["GROUP_RANK"])
    if "LOCAL_WORLD_SIZE" in os.environ:
        return rank // max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
    return 0  # one node


class _LocalSaver(Saver):
    """A :class:`Saver` whose saves are one-rank checkpoints in the node-local tier, and
    whose commit phase is the tier's (local commit, replicate, mark)."""

    def __init__(self, owner: LocalCheckpoints, queue: AsyncCallsQueue, options: SaveOptions) -> None:
        super().__init__(queue, options, None, storage=owner.storage)
        self.owner = owner

    def _check_memory(self, layout: RankLayout, reserve: bool = False) -> None:
        """The memory guard of a local save (``reserve``: of ``prepare()``, every staging
        buffer at once): the staging buffer (as any save), and the
        tier's bytes for the new step (this rank's shard and the replicas it receives,
        about one shard each, less what each shard's spare holds: the new step is
        written into it), against the free space of the tier's file system, and
        against the memory available too when the tier is RAM (``/dev/shm``).

        Raises:
            CheckpointError: not enough room (funnelled to every rank by ``save``).
        """
        super()._check_memory(layout, reserve)
        limit = self.options.staging_memory_limit
        if limit is None:
            return
        storage = self.owner.storage
        shards = (self.owner.rank, *self.owner.sources)
        tier_need = sum(max(0, layout.slab_nbytes - storage.spare_bytes(shard)) for shard in shards)
        base = storage.base
        free = shutil.disk_usage(base).free
        if tier_need > limit * free:
            raise CheckpointError(
                f"the local tier needs {tier_need:,} bytes in {base} for this step (this rank's shard and "
                f"{len(self.owner.sources)} replicas), more than {limit:g} x the {free:,} bytes free there"
            )
        if self.owner._on_ram:
            staging = self._staging_need(layout, reserve)
            available = psutil.virtual_memory().available
            if tier_need + staging > limit * available:
                raise CheckpointError(
                    f"the local tier in {base} (RAM) and the staging buffer need {tier_need + staging:,} bytes, "
                    f"more than {limit:g} x the {available:,} bytes of memory available"
                )

    def _commit_call(self, record: SaveInFlight) -> None:
        """The finalize function of a local save: commit, replicate, mark (finalizer thread)."""
        if record.call_idx is None:
            raise CheckpointError(f"the local save of step {record.step} was committed before it was scheduled")
        queue = self.queue
        self.owner._commit_replicate_mark(record, queue.get_result(record.call_idx), queue.finalize_sync)


class LocalCheckpoints:
    """The node-local tier of a :class:`~asyncckpt.CheckpointManager` (``manager.local``).

    Args:
        tier: the policy (:class:`~asyncckpt.io.local_tier.LocalTier`).
        queue: the manager's queue (its worker writes the local saves too).
        options: the manager's save options (with ``overlap_staging``, local saves are
            overlapped too: :meth:`save`, :meth:`synchronize_staging`).
        process_group: the ranks saving together.
        root: the job's persistent root (its absolute path): the tier directory is
            this job's (:meth:`NodeLocalStorage.claim`: a tier of another job that is
            not running is taken over, its shards removed; a running one's refused).

    Collective contract: the constructor (one all_gather of the nodes, then two
    funnels: each node's first rank claims the tier, then the others hold it and every
    rank makes its shard's directory; a one-rank group per rank), :meth:`save` on the
    steps it is due (every rank, the same steps), :meth:`restore` and :meth:`close`:
    all ranks. :meth:`maybe_finalize`: any rank.

    Raises:
        InvalidArgumentError: fewer nodes than ``replicas + 1``.
        LocalTierInUseError: another job that is running holds the tier directory.
        CheckpointPathError: (an ``OSError``) the tier directory cannot be created.
    """

    def __init__(
        self,
        tier: LocalTier,
        queue: AsyncCallsQueue,
        options: SaveOptions,
        process_group: Any = None,
        *,
        root: str,
    ) -> None:
        self.tier = tier
        self.process_group = process_group
        self.sync = SyncGroup(process_group)
        self.rank, self.world_size = self.sync.rank, self.sync.world_size
        self.storage = NodeLocalStorage(Path(os.path.abspath(os.fspath(tier.dir))))
        self.nodes = [n[0] for n in self.sync.all_gather_ints([_node_of(tier, self.rank)])]
        self.targets = replica_map(self.nodes, tier.replicas)
        self.sources = [r for r, row in enumerate(self.targets) if self.rank in row]
        self._self_group = None
        self._lock: weakref.finalize | None = None  # (calling it lets go of the tier's lock, once)
        # The node's first rank makes the tier this job's before the node's other ranks use it.
        first = self.nodes.index(self.nodes[self.rank]) == self.rank
        storage = self.storage

        def claim() -> None:
            if first:
                self._hold_lock(storage.claim(root))

        def hold() -> None:
            if not first:
                self._hold_lock(storage.hold(root))
            storage.shard_dir(self.rank).mkdir(parents=True, exist_ok=True)
            for shard in (self.rank, *self.sources):
                storage.remove_leftovers(shard)

        try:
            self._opening(claim)
            self._opening(hold)
        except BaseException:
            self._release_lock()
            raise
        if self.sync.distributed:  # this rank alone: its local saves and loads involve no other rank
            me = dist.get_rank()
            self._self_group = dist.new_group(ranks=[me], backend="gloo", use_local_synchronization=True)
        self._on_ram = str(self.storage.base.resolve()).startswith("/dev/shm/")
        self._saver = _LocalSaver(self, queue, options)
        self.restored: RestoreResult | None = None

    def _opening(self, step: Callable[[], None]) -> None:
        """Run one step of opening the tier on every rank, then the job's funnel: every
        rank raises the first failure, none goes on alone (collective).

        Raises:
            AsyncckptError: the first rank's, if it was one (``LocalTierInUseError``,
                ``CheckpointPathError`` for a directory that cannot be used).
            CheckpointError: another failure.
        """
        failure: RankFailure | None = None
        try:
            step()
        except AsyncckptError as exc:
            failure = RankFailure.from_exception(exc)
        except OSError as exc:
            error = CheckpointPathError.of(exc.errno, f"the local tier {self.storage.base} cannot be used: {exc}")
            failure = RankFailure.from_exception(error)
        failures = self.sync.gather_failures(failure)
        if failures:
            first = failures[min(failures)]
            if isinstance(first.exception, AsyncckptError):
                raise first.exception
            raise CheckpointError(f"opening the local tier failed: {first}", failures)

    def _release_lock(self) -> None:
        if self._lock is not None:
            with contextlib.suppress(OSError):
                self._lock()  # (a finalizer runs once: never again when this is collected)

    def _hold_lock(self, lock: tuple[int, object]) -> None:
        """Keep ``lock`` (the tier's: descriptor and token) until :meth:`close`, or until this object is
        garbage-collected (a manager dropped without ``close()``: its local saves have
        settled by then, since a pending one holds it), so that the tier does not stay
        this job's until the process exits. One finalizer releases it either way."""
        self._lock = weakref.finalize(self, NodeLocalStorage.release, *lock)
        self._lock.atexit = False  # (the process's exit closes it anyway)

    # ------------------------------------------------------------------ save
    def due(self, step: int) -> bool:
        """Whether ``step`` is saved to the tier (``step % every == 0``)."""
        return step % self.tier.every == 0

    @gc_paused()
    def save(self, step: int, state_dict: dict[str, Any]) -> SaveHandle | None:
        """Save this rank's ``state_dict`` as step ``step`` of the local tier, if due
        (all ranks, the same steps; asynchronous: returns once staged).

        The handle completes once the step is restorable (stored on ``replicas + 1``
        nodes for every rank) or failed; :meth:`maybe_finalize` reports both. A DTensor
        is saved as its local shard, a plain tensor (:func:`local_shards`): the tier
        restores the same sharding only. With the manager's ``overlap_staging`` it
        returns once the copy is started, as the manager's ``save`` does: the state must
        not change until :meth:`CheckpointManager.synchronize_staging` (or the
        optimizer's step, which is ordered after the copy); the write starts at the
        first :meth:`maybe_finalize` that finds the copy over (or the next save).

        Returns:
            The handle, or ``None`` when ``step`` is not due.

        Raises:
            CheckpointError: this save was refused on some rank (invalid state, the
                memory guard), on every rank.
        """
        if not self.due(step):
            return None
        state_dict = local_shards(state_dict)  # (a DTensor: its shard, as a plain tensor)
        saver = self._saver
        with saver.lock:
            started = time.monotonic()
            saver.hand_off_overlapped()  # an earlier overlapped save of the queue is scheduled first
            queue = saver.queue
            queue.start()  # collective the first time (the finalizer's group)
            saver.wait_for_room()  # no more local steps on the node than a commit keeps up with
            final_dir = self.storage.step_dir(self.rank, step)
            if final_dir.exists() and not saver._in_flight(final_dir):
                self._drop_stale(step, final_dir)
            link = _SaveLink(saver)
            handle = SaveHandle(final_dir, step, link)
            failure: RankFailure | None = None
            record: SaveInFlight | None = None
            try:
                record = plan(
                    state_dict,
                    final_dir,
                    handle,
                    sync=SyncGroup(self._self_group),
                    coordinator_rank=0,
                    step=step,
                    cache=saver.plan_cache,
                    layouts=saver.layouts,
                    check_layout=saver._check_memory,
                    in_flight=saver._in_flight,
                    storage=self.storage,
                )
            except Exception as exc:  # noqa: BLE001 - funnelled to every rank
                failure = RankFailure.from_exception(exc)
            with self.sync.describing(f"the plan of the local save of step {step}"):
                failures = self.sync.gather_failures(failure)
            if failures:
                raise _refused(f"the local save of step {step}", failures)
            assert record is not None
            record.started = started
            link.record = record
            saver._begin_staging(record)
            record.stall_s += time.monotonic() - started
            return handle

    def synchronize_staging(self) -> None:
        """Make the state of an overlapped local save free to change, and start its
        write once its copy is over (:meth:`CheckpointManager.synchronize_staging`
        calls it; the same contract). No-op when nothing is being staged."""
        self._saver.release_staging()

    @gc_paused()
    def prepare(self, state_dict: dict[str, Any]) -> int:
        """Plan this rank's shard of ``state_dict`` and allocate, page-fault and format
        the local tier's staging buffer, writing nothing (collective, all ranks: one
        funnel), so that the first local save stalls no longer than later ones
        (:meth:`CheckpointManager.prepare` calls it).

        Returns:
            The bytes of host memory its staging buffers hold (this rank).

        Raises:
            CheckpointError: refused on some rank (invalid state, the memory guard), on
                every rank.
        """
        nbytes, failure = 0, None
        try:
            nbytes = self._saver.prepare(local_shards(state_dict), self._self_group, 0)
        except Exception as exc:  # noqa: BLE001 - funnelled to every rank
            failure = RankFailure.from_exception(exc)
        with self.sync.describing("the local tier's prepare"):
            failures = self.sync.gather_failures(failure)
        if failures:
            raise _refused("preparing the local tier", failures)
        return nbytes

    def _drop_stale(self, step: int, final_dir: Path) -> None:
        """Remove this rank's copy of ``step`` left by an earlier run or timeline (training
        went back: a fresh start, or a restore of an older step): the step is saved
        again, and the new copy replaces it. If it was the restorable one, the marker
        goes first: an old timeline's step must never be restored as this one's."""
        marker = self.storage.marker(self.rank)
        if marker is not None and marker["step"] == step:
            self.storage.unmark(self.rank)
        _log.info("asyncckpt: removing the local tier's stale copy of step %d (%s)", step, final_dir)
        _fs.remove_checkpoint(final_dir, best_effort=True)

    def _commit_replicate_mark(self, record: SaveInFlight, result: Any, sync: SyncGroup) -> None:
        """Phases commit, replicate and mark of a local save (finalizer thread, all ranks).

        Raises:
            CheckpointException: the step is not restorable (a commit, a transfer or a
                check failed on some rank; the same on every rank).
        """
        step = record.step
        assert step is not None
        call = record.call_idx if record.call_idx is not None else -1
        failure: RankFailure | None = None
        try:  # (each rank) this rank's one-rank checkpoint, committed in the tier
            commit(record, result, record.sync, (), self._saver.layout_exchange, self._saver.metadata_pickle)
        except Exception as exc:  # noqa: BLE001 - funnelled below
            failure = RankFailure.from_exception(exc, "the local commit failed: ")
        with sync.describing(f"the local commit of step {step}"):
            failures = sync.gather_failures(failure)
        if failures:
            raise CheckpointException(call, failures, step, record.final_dir)
        received: list[int] = []
        with sync.describing(f"the replication of step {step}"):
            failure = self._replicate(step, sync, received)
            failures = sync.gather_failures(failure)
        if failures:
            raise CheckpointException(call, failures, step, record.final_dir)
        for shard in (self.rank, *received):  # decided: restorable on every rank's replicas + 1 nodes
            try:
                self.storage.mark_restorable(shard, step, self.world_size)
            except OSError as exc:
                _log.warning("asyncckpt: could not mark step %d of rank %d restorable: %s", step, shard, exc)

    def _replicate(self, step: int, sync: SyncGroup, received: list[int]) -> RankFailure | None:
        """Send this rank's shard of ``step`` to its targets, receive its sources' shards
        (all ranks); returns this rank's failure (a receive that does not check)."""
        packed: Packed | None = None
        failure: RankFailure | None = None
        if self.targets[self.rank]:
            try:
                packed = self.storage.pack(self.rank, step)
            except Exception as exc:  # noqa: BLE001 - funnelled; the header says "nothing"
                failure = RankFailure.from_exception(exc, "reading the local shard to replicate failed: ")
        try:
            headers = sync.all_gather_object(packed.files if packed is not None else None)
            for s in self.sources:
                if headers[s] is None and failure is None:
                    failure = RankFailure(f"rank {s} could not read its shard of step {step} to send it here")

            def finish(src: int, arrival: Arrival) -> None:
                _faults.hit("replicate")  # a receiver that fails (raise) or dies (kill) with the bytes in hand
                arrival.finish()
                received.append(src)

            return _transfer(
                sync,
                {t: packed for t in self.targets[self.rank]} if packed is not None else {},
                {s: headers[s] for s in self.sources if headers[s] is not None},
                lambda src, files: self.storage.arrival(src, step, files),
                finish,
                failure,
            )
        finally:
            if packed is not None:
                packed.close()

    def maybe_finalize(self, blocking: bool = False) -> list[int]:
        """The local steps that became restorable since the last call (any rank, no
        collective, except with a ``calls_queue`` finalized in the training loop, which
        it drives as ``CheckpointManager.maybe_finalize`` does; at most the newest 512
        to 1024, as ``CheckpointManager.maybe_finalize``);
        a local save that failed is logged as a warning on logger ``asyncckpt`` (the
        tier keeps its last restorable step), never raised. An overlapped local save
        whose copy is over is handed to the writer first (``blocking``: whether over
        or not), as :meth:`CheckpointManager.maybe_finalize` does."""
        if blocking or self._saver.staging_copied():
            self._saver.synchronize_staging()
        steps: list[int] = []
        while True:
            try:
                records = self._saver.harvest(blocking)
            except CheckpointException as exc:
                _log.warning("asyncckpt: a local checkpoint is not restorable: %s", str(exc).splitlines()[0])
                continue
            steps += [r.step for r in records if r.step is not None]
            return steps

    def settle_within(self, timeout: float, when: str) -> list[SaveInFlight]:
        """Let the pending local saves settle for up to ``timeout`` seconds (a crashed
        ``with`` block); returns those still pending (named on logger ``asyncckpt``)."""
        return self._saver.settle_within(timeout, when)

    def close(self, abort: bool = False) -> None:
        """Wait for the local saves (``abort``: drop them), then free the staging buffers."""
        if not abort:
            try:
                self.maybe_finalize(blocking=True)
            except Exception as exc:  # noqa: BLE001 - the persistent tier's close goes on
                _log.warning("asyncckpt: closing the local tier: %s", exc)
        self._saver.release()
        self._release_lock()
        group, self._self_group = self._self_group, None
        if group is not None and not abort:  # (aborted: a dropped save may still name it)
            with contextlib.suppress(Exception):
                if dist.is_initialized():
                    dist.destroy_process_group(group)

    # ------------------------------------------------------------------ restore
    @gc_paused()
    def restore(
        self,
        state_dict: dict[str, Any],
        persistent_step: int | None,
        load_persistent: Callable[[int], Any],
    ) -> RestoreResult | None:
        """Restore the newest step into ``state_dict`` in place (collective, all ranks).

        Call sequence:

        1. (all ranks) the census, one all_gather (``all_gather_object`` with ``fits``:
           a second only when a node holds more shards than this job's saves leave
           there): the shards each node holds (``(rank, step, world_size)`` of every
           restorable marker; every rank of a node reports its node's), and rank 0's
           newest persistent step.
        2. (each rank, the same result) the newest step for which every rank's shard is
           held somewhere, saved by this world size; newest wins against the persistent
           tier (equal: the local tier). A local tier of another world size is named
           once and the persistent tier restores (resharding).
        3. (all ranks) rounds: every rank takes its shard from the first holder in its
           list (itself, then one rank per other node). A holder serving a peer sends
           it a header (point to point: the file sizes and the small files), then the
           data files cut into pieces, each tensor's data received straight into the
           tensor it restores (:class:`_Fetch`; nothing is written on the receiver's
           node); the receiver checks every byte against the manifest's CRC-32s. A rank
           holding its own shard loads it (:meth:`_load_own`: every byte CRC-checked)
           while its sends are in flight. One funnel (one int64 all_gather when no rank
           failed). A rank whose copy failed takes the
           next holder in the next round; when a rank has none left, every rank loads
           the persistent tier.

        Args:
            state_dict: the template to load into (the structure saved).
            persistent_step: the persistent tier's newest step (rank 0's counts), or ``None``.
            load_persistent: loads a persistent step into ``state_dict`` (collective);
                it may return where it read it (a path or URL: ``location``).

        Returns:
            What was restored (also :attr:`restored`), or ``None`` if neither tier
            holds a checkpoint.

        Raises:
            CheckpointError: a copy failed on some rank and the persistent tier holds
                nothing to fall back to (the same on every rank).
        """
        sync = self.sync
        with sync.describing("the restore's census of the local tier"):
            census = sync.all_gather_object((self.storage.held(), persistent_step), fits=self._census_bytes())
        persistent = census[0][1]
        held: dict[tuple[int, int], list[int]] = {}
        worlds: set[int] = set()
        for holder, (shards, _) in enumerate(census):
            for shard, step, world in shards:
                worlds.add(world)
                if world == self.world_size and 0 <= shard < self.world_size:
                    held.setdefault((shard, step), []).append(holder)
        steps = {s for _, s in held}
        covered = [s for s in steps if all((r, s) in held for r in range(self.world_size))]
        local_step = max(covered) if covered else None
        notes: list[str] = []
        if local_step is None and worlds - {self.world_size}:
            notes.append(
                f"the local tier holds steps saved by {sorted(worlds - {self.world_size})} ranks, this job has "
                f"{self.world_size}: restoring from the persistent tier (resharding)"
            )
        if local_step is not None and (persistent is None or local_step >= persistent):
            with _local_shards_in_place(state_dict):
                result = self._restore_local(state_dict, local_step, held, notes)
            if result is not None:
                return self._done(result)
            if persistent is None:
                raise CheckpointError(
                    f"no copy of step {local_step} could be restored on every rank, and the persistent tier "
                    "holds no checkpoint; " + "; ".join(notes)
                )
        if persistent is None:
            if notes and self.rank == 0:
                _log.warning("asyncckpt: %s", notes[0])
            return None
        read = load_persistent(persistent)
        location = str(read) if isinstance(read, (str, os.PathLike)) else ""
        return self._done(RestoreResult(int(persistent), "persistent", {}, "persistent", tuple(notes), location))

    def _census_bytes(self) -> int:
        """Bytes that a rank's census fits when its node holds what this job's saves leave
        there (its ranks' shards and the replicas they receive; about 20 bytes a shard
        pickled), the same on every rank: the census is then one collective."""
        ranks = collections.Counter(self.nodes)
        return 64 + 24 * max(ranks.values()) * (1 + self.tier.replicas)

    def _done(self, result: RestoreResult) -> RestoreResult:
        self.restored = result
        if self.rank == 0:
            _log.warning("asyncckpt: %s", result)
        return result

    def _load_own(self, state_dict: dict[str, Any], step: int, out: list[RankFailure]) -> None:
        """Load this rank's shard of ``step`` from its own node; a failure is appended to
        ``out``. When the state has the shard's structure, from its files
        (:meth:`_Fetch.mapped`: tensors of 1 MiB or more read into the state, the rest
        from the files' mappings, every byte CRC-checked once, no per-entry read
        planning);
        else with :func:`~asyncckpt.loading.api.load` (every
        byte CRC-checked as it is read)."""
        try:
            packed = self.storage.pack(self.rank, step, read=True)
            try:
                fetch = _Fetch.mapped(self, state_dict, step, packed)
                if fetch is None:
                    load(state_dict, self.storage.step_dir(self.rank, step), process_group=self._self_group)
                elif (failure := fetch.finish(None)) is not None:
                    out.append(failure)
            finally:
                packed.close()
        except (AsyncckptError, OSError) as exc:
            out.append(RankFailure.from_exception(exc, f"the copy of step {step} from its own node: "))

    def _restore_local(
        self, state_dict: dict[str, Any], step: int, held: dict[tuple[int, int], list[int]], notes: list[str]
    ) -> RestoreResult | None:
        """Step 3 of :meth:`restore`; ``None``: some rank ran out of copies."""
        sync, world = self.sync, self.world_size
        holders: list[list[int]] = []
        for r in range(world):
            row, seen = [], set()
            # itself, then one rank per other node: the one that received it (its replica target) first
            order = sorted(
                held[(r, step)], key=lambda h: (h != r, self.nodes[h] == self.nodes[r], h not in self.targets[r], h)
            )
            for h in order:
                if h == r or self.nodes[h] not in seen:
                    row.append(h)
                    seen.add(self.nodes[h])
            holders.append(row)
        attempt = [0] * world
        done = [False] * world
        while True:
            src = [holders[r][attempt[r]] for r in range(world)]
            serve = {r: src[r] for r in range(world) if not done[r] and src[r] != r}
            failure: RankFailure | None = None
            packed: dict[int, Packed] = {}
            unread: dict[int, str] = {}
            for r, h in serve.items():
                if h == self.rank:
                    try:
                        packed[r] = self.storage.pack(r, step)
                    except Exception as exc:  # noqa: BLE001 - the receiver fails this round, saying why
                        unread[r] = f"{type(exc).__name__}: {exc}"
            with sync.describing(f"the restore of step {step} from the local tier"), _closing(packed):
                # (every rank knows ``serve``: with no transfer, as in a restart on intact nodes, no exchange)
                offers = {r: _header(p) for r, p in packed.items()}
                mine = serve.get(self.rank)
                try:
                    header = _swap_headers(
                        sync, {r: offers.get(r, unread.get(r)) for r, h in serve.items() if h == self.rank}, mine
                    )
                except CheckpointError as exc:
                    header = str(exc)
                fetch: _Fetch | None = None
                if mine is not None:
                    if isinstance(header, dict):
                        fetch = _Fetch(self, state_dict, step, mine, header)
                    else:
                        failure = RankFailure(
                            f"rank {mine} could not read its copy of rank {self.rank}'s shard: {header}"
                        )
                own: list[RankFailure] = []  # its own node's copy, loaded while its sends are in flight
                meanwhile = (
                    functools.partial(self._load_own, state_dict, step, own)
                    if mine is None and not done[self.rank]
                    else _nothing
                )
                sends = {r: _piece_views(p, _pieces(offers[r])) for r, p in packed.items()}
                receive = (mine, fetch.bufs) if fetch is not None and mine is not None else None
                error = _exchange(sync, sends, receive, meanwhile, fetch.check_arriving if fetch is not None else None)
                for views in sends.values():
                    for view in views:
                        view.release()  # before the mappings close
                if fetch is not None:
                    failure = fetch.finish(error)
                failure = failure or (own[0] if own else None) or (error if mine is not None else None)
                failures = sync.gather_failures(failure if not done[self.rank] else None)
            for r in range(world):
                if r not in failures:
                    done[r] = True
            if all(done):
                peers = {r: src[r] for r in range(world) if src[r] != r}
                mine = src[self.rank]
                return RestoreResult(
                    step, "local", peers, "local" if mine == self.rank else f"peer {mine}", tuple(notes)
                )
            for r, why in sorted(failures.items()):
                attempt[r] += 1
                left = attempt[r] < len(holders[r])
                notes.append(
                    f"rank {r}'s copy from {'its own node' if src[r] == r else f'rank {src[r]}'} failed "
                    f"({str(why).splitlines()[0]}); "
                    + (f"taking the replica from rank {holders[r][attempt[r]]}" if left else "no copy left")
                )
            if any(attempt[r] >= len(holders[r]) for r in range(world)):
                return None


#: The files of a shard that travel in the restore's header (small; the receiver plans from them).
_SMALL = (MANIFEST_NAME, METADATA_NAME, RECORDS_NAME)


#: A tensor's data travels as a message of its own, straight into the tensor, from this
#: size on; smaller ones travel with the bytes around them (a message costs more than
#: copying this many bytes, and an LLM state has thousands of small tensors).
_PIECE_MIN_BYTES = 1 << 20


#: A restore's transfer moves each piece in messages of at most this many bytes (both
#: sides cut the same pieces the same way), so that the receiver checks each message's
#: CRC-32 as soon as it has arrived, from the cache, while the next ones arrive.
_MESSAGE_BYTES = 4 << 20


class _Undelivered(Exception):
    """A message of a restore's transfer failed (:func:`_exchange` reports why)."""


class _Piece(NamedTuple):
    """Bytes ``[offset, offset + length)`` of data file ``file`` of a shard, one message of
    a restore's transfer: a tensor's data (``fqn``), or the bytes between (``None``)."""

    file: str
    offset: int
    length: int
    fqn: str | None


def _header(packed: Packed) -> dict[str, Any]:
    """What a rank serving a shard at a restore tells its receiver first: the files
    (``[(name, size)]``) and the bytes of the small ones (manifest, ``.metadata``,
    ``.records.json``), from which both sides cut the data files into :func:`_pieces`."""
    small = {
        name: bytes(m) if m is not None else b"" for (name, _), m in zip(packed.files, packed.maps) if name in _SMALL
    }
    return {"files": list(packed.files), "small": small}


def _pieces(header: dict[str, Any], records: dict[str, Record] | None = None) -> list[_Piece]:
    """The messages of a shard's data files (the sender's cut and the receiver's, from the
    same header): each tensor record's data of at least :data:`_PIECE_MIN_BYTES` alone
    (so that it lands in the tensor it restores), and the bytes between (framing,
    values, gaps, smaller tensors: one message for many). Without a records file
    that stands for the ``.metadata`` (``parse_records``), each file is one piece.
    ``records``: those of the header, parsed already (:func:`_checked_header`).
    Never raises: a header that does not check is refused by the receiver
    (:func:`_checked_header`), which still drains these pieces."""
    files, small = header["files"], header["small"]
    if records is None and METADATA_NAME in small and RECORDS_NAME in small:
        names = dict.fromkeys(name for name, _ in files)
        records = parse_records(small[RECORDS_NAME], crc32(small[METADATA_NAME]), names)
    by_file: dict[str, list[tuple[int, int, str, Any, Any]]] = {}
    for fqn, (name, offset, length, dtype, shape) in (records or {}).items():
        by_file.setdefault(name, []).append((offset, length, fqn, dtype, shape))
    out: list[_Piece] = []
    for name, size in files:
        if name in _SMALL:
            continue
        pos = 0
        for offset, length, fqn, dtype, shape in sorted(by_file.get(name, []), key=lambda r: (r[0], r[1], r[2])):
            framing = writer_framing(dtype, shape) if dtype is not None else None
            if (
                framing is None
                or framing.nbytes < _PIECE_MIN_BYTES
                or offset < pos
                or offset + length > size
                or length != len(framing.prefix) + framing.nbytes + len(framing.suffix)
            ):
                continue  # its bytes travel in the piece between
            lo = offset + len(framing.prefix)
            if lo > pos:
                out.append(_Piece(name, pos, lo - pos, None))
            out.append(_Piece(name, lo, framing.nbytes, fqn))
            pos = lo + framing.nbytes
        if size > pos:
            out.append(_Piece(name, pos, size - pos, None))
    return out


def _piece_views(packed: Packed, pieces: list[_Piece]) -> list[memoryview]:
    """The sender's buffer of each piece: a slice of its file's mapping (no copy)."""
    index = {name: i for i, (name, _) in enumerate(packed.files)}
    views = []
    for piece in pieces:
        m = packed.maps[index[piece.file]]
        assert m is not None
        views.append(memoryview(m)[piece.offset : piece.offset + piece.length])
    return views


def _checked_header(header: dict[str, Any], where: Path) -> tuple[dict[str, Any], dict[str, Record] | None]:
    """The receiver's check of a restore's header: the manifest lists the files sent
    (plain names, their sizes), and the small files' bytes match it (every byte
    CRC-checked).

    Returns:
        The manifest's ``files`` and the records (``None``: no records file that
        stands for the ``.metadata``: the shard is loaded from files).

    Raises:
        CorruptCheckpointError: naming what does not match.
    """
    files, small = header["files"], header["small"]
    try:
        entries = json.loads(small[MANIFEST_NAME])["files"]
    except (KeyError, ValueError, TypeError) as exc:
        raise CorruptCheckpointError(f"a copy arrived with an unreadable manifest: {exc}", str(where)) from exc
    names = [name for name, _ in files if name != MANIFEST_NAME]
    if not isinstance(entries, dict) or sorted(entries) != sorted(names) or len(set(names)) != len(names):
        raise CorruptCheckpointError(f"a copy's files {names} are not its manifest's", str(where))
    for name, size in files:
        if not is_plain_name(name) or (name != MANIFEST_NAME and entries[name].get("size") != size):
            raise CorruptCheckpointError(f"a copy's {name!r} does not match its manifest", str(where / str(name)))
    for name, data in small.items():
        if name != MANIFEST_NAME:
            check_segments(entries[name], [memoryview(data)], where / name)
    records = None
    if METADATA_NAME in small and RECORDS_NAME in small:
        records = parse_records(small[RECORDS_NAME], crc32(small[METADATA_NAME]), entries)
    return entries, records


def _memory(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a buffer export."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class _Fetch:
    """A rank's shard received from a peer at a restore, straight into the state.

    When the state has the shard's structure (``plan_direct_load``: its keys, dtypes
    and shapes, plain tensors), each tensor's data is received into the tensor
    itself (a CPU contiguous one; else a temporary, copied in after), the bytes
    between into small buffers; :meth:`finish` then checks every byte against the
    manifest (the CRC-32 of each segment folded over the pieces), the framing, and
    decodes the values. No file is written: the transfer is the restore's only pass
    besides the CRC (a DTensor's local shard is a plain tensor here: :func:`local_shards`).
    Otherwise (another structure) the shard is
    received into a hidden directory of the node's tier and loaded from there with
    :func:`~asyncckpt.loading.api.load` (every byte CRC-checked as it is read), then
    removed. Either way the node's tier is not given the shard (the next local save
    stores it again). A receiver that cannot land the bytes still drains them."""

    def __init__(
        self, owner: LocalCheckpoints, state_dict: dict[str, Any], step: int, src: int, header: dict[str, Any]
    ) -> None:
        self.owner, self.state_dict, self.src = owner, state_dict, src
        self.where = owner.storage.step_dir(owner.rank, step)
        self.pieces: list[_Piece] = []
        self.bufs: list[memoryview] = []
        self.packed: Packed | None = None  # (the own shard's files, read by :meth:`finish`)
        self.sources: list[tuple[int, int, bool]] = []  # (theirs: each piece's file, offset, whether read)
        self.failure: RankFailure | None = None
        self.checked = False  # every byte checked as it arrived (:meth:`check_arriving`)
        self.arrival: Arrival | None = None
        self.plan: Any = None
        self.temps: dict[str, torch.Tensor] = {}
        self._scratch_memory: torch.Tensor | None = None
        self._index: dict[str, tuple[list[int], list[tuple[int, memoryview]]]] = {}
        self._placed: dict[str, int] = {}  # per file: how many of the plan's entries are placed
        self._values: list[tuple[str, str, int, int]] = []  # (fqn, file, offset, length): decoded last
        self._received: set[str] = set()  # the tensors whose data lands in them (or a temporary) whole
        self._bad_framing: CorruptCheckpointError | None = None  # the first record out of framing
        try:
            self.entries, records = _checked_header(header, self.where)
            self.pieces = _pieces(header, records)  # (the sender's cut, of the same records)
            self._received = {p.fqn for p in self.pieces if p.fqn is not None}
            self.plan = plan_direct_load(state_dict, records) if records is not None else None
            if self.plan is not None:
                targets = {e.fqn: e for es in self.plan.files.values() for e in es}
                views = [self._target(targets, piece) for piece in self.pieces]
                between = iter(self._scratch([p.length for p, v in zip(self.pieces, views) if v is None]))
                self.bufs = [v if v is not None else next(between) for v in views]
            else:
                self.arrival = owner.storage.arrival(owner.rank, step, header["files"])
                maps = {name: m for (name, _), m in zip(header["files"], self.arrival.maps)}
                for name, data in header["small"].items():
                    if maps[name] is not None:
                        maps[name][:] = data  # type: ignore[index]
                for piece in self.pieces:
                    self.bufs.append(memoryview(maps[piece.file])[piece.offset : piece.offset + piece.length])  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - funnelled; the bytes are drained all the same
            self._release()
            self.failure = RankFailure.from_exception(exc, f"the copy of step {step} from rank {src}: ")
            self.plan = None
            self.pieces = self.pieces or _pieces(header)  # (the header did not check: cut as the sender did)
            self.bufs = self._scratch([piece.length for piece in self.pieces])

    def _scratch(self, lengths: list[int]) -> list[memoryview]:
        """Buffers of ``lengths`` bytes (uninitialized: each is received into whole), cut
        from one allocation that this fetch keeps: a ``bytearray`` each would zero
        every byte first, and the bytes between an LLM state's tensors are most of it."""
        self._scratch_memory = torch.empty(sum(lengths), dtype=torch.uint8)
        whole = _memory(self._scratch_memory)
        views, offset = [], 0
        for n in lengths:
            views.append(whole[offset : offset + n])
            offset += n
        return views

    @classmethod
    def mapped(cls, owner: LocalCheckpoints, state_dict: dict[str, Any], step: int, packed: Packed) -> _Fetch | None:
        """The shard in this node's files (``packed``, packed to read) as if received,
        cut into the same :func:`_pieces`: each tensor of 1 MiB or more lands in the
        tensor it restores, read from its file (``preadv``) 2 MiB at a time just before
        the CRC reads it, from the cache (:func:`check_segments` with ``fill``; no page
        of it mapped); the bytes between (framing, values, smaller tensors) are checked
        in the files' mappings and placed from there (:meth:`finish`: one mapping
        fault per 16 pages where a copy into buffers by ``preadv`` would cost a page
        of buffer and a copy each, and thousands of small pieces would cost more in
        Python than they save). ``None``: the state has another structure (load it
        from the files).

        Raises:
            CorruptCheckpointError: the small files do not match the manifest.
        """
        self = cls.__new__(cls)
        self.owner, self.state_dict, self.src = owner, state_dict, owner.rank
        self.where = owner.storage.step_dir(owner.rank, step)
        self.failure, self.arrival, self.temps, self._index, self.checked = None, None, {}, {}, False
        self._placed, self._values, self._bad_framing = {}, [], None
        header = _header(packed)
        self.entries, records = _checked_header(header, self.where)
        self.plan = plan_direct_load(state_dict, records) if records is not None else None
        if self.plan is None:
            return None
        self.pieces, self.bufs, self.sources, self.packed = _pieces(header, records), [], [], packed
        self._received = {p.fqn for p in self.pieces if p.fqn is not None}
        index = {name: i for i, (name, _) in enumerate(packed.files)}
        targets = {e.fqn: e for es in self.plan.files.values() for e in es}
        try:
            for piece in self.pieces:
                view = self._target(targets, piece)
                read = view is not None
                if view is None:  # (the bytes between: checked and placed from the mapping)
                    m = packed.maps[index[piece.file]]
                    view = memoryview(m)[piece.offset : piece.offset + piece.length]  # type: ignore[arg-type]
                self.bufs.append(view)
                self.sources.append((index[piece.file], piece.offset, read))
        except BaseException:
            self._release()
            raise
        return self

    def _target(self, targets: dict[str, Any], piece: _Piece) -> memoryview | None:
        """Where ``piece`` lands in the state: its tensor's memory (a temporary for a
        tensor that is not CPU contiguous, copied in by :meth:`finish`), or ``None``
        (the bytes between: a buffer).

        Raises:
            CorruptCheckpointError: the piece is not its tensor's size.
        """
        entry = targets.get(piece.fqn) if piece.fqn is not None else None
        if entry is None or entry.target is None:
            return None
        target = entry.target.detach()
        if not (target.is_cpu and target.is_contiguous()):
            target = self.temps[entry.fqn] = torch.empty(target.shape, dtype=target.dtype)
        view = _memory(target)
        if len(view) != piece.length:
            raise CorruptCheckpointError(f"the record of {piece.fqn!r} does not fit its tensor", str(self.where))
        return view

    def _release(self) -> None:
        for view in self.bufs:
            view.release()
        self.bufs, self.sources = [], []
        self._scratch_memory = None  # (after the views of it)
        if self.arrival is not None:
            self.arrival.discard()
            self.arrival = None

    def _at(self, name: str, offset: int, length: int) -> memoryview:
        """File ``name``'s bytes ``[offset, offset + length)``, from the pieces received
        (a view where one piece holds them).

        Raises:
            CorruptCheckpointError: they are not all there (a record past the file's end).
        """
        starts, pieces = self._index.get(name, ([], []))
        i = bisect.bisect_right(starts, offset) - 1
        if i >= 0:  # (the usual case: one piece holds them all; a record's framing, a value)
            start, buf = pieces[i]
            if offset - start + length <= len(buf):
                return buf[offset - start : offset - start + length]
        i = max(0, i)
        parts: list[memoryview] = []
        got, pos, end = 0, offset, offset + length
        while i < len(pieces) and pos < end:
            start, buf = pieces[i]
            if start <= pos < start + len(buf):
                take = min(end, start + len(buf)) - pos
                parts.append(buf[pos - start : pos - start + take])
                pos += take
                got += take
            i += 1
        if got != length:
            raise CorruptCheckpointError(f"a record lies outside {name!r}", str(self.where / name))
        return parts[0] if len(parts) == 1 else memoryview(b"".join(parts))

    def check_arriving(self, arrived: Callable[[int], None]) -> None:
        """Check every received byte against the manifest's CRC-32s as the messages
        arrive (``arrived(k)`` waits for message ``k`` of :func:`_messages` of
        :attr:`bufs`): each message is checked right after it landed, from the cache,
        while gloo receives the next ones, and the tensors under 1 MiB whose bytes it
        held are placed then (:meth:`_place_upto`), still from the cache; :meth:`finish`
        then only decodes the values. A mismatch (or a tensor that cannot be placed)
        becomes this rank's failure (the rest is drained by :func:`_exchange`; the state
        may hold some of the copy's bytes, all overwritten by the next copy); a transfer
        that fails leaves the check to :meth:`finish` (which reports it)."""
        if self.failure is not None or self.plan is None or self.arrival is not None:
            return  # (nothing lands in the state: drained, or loaded from the arrival's files)
        first, k = [], 0  # each piece's first message
        for buf in self.bufs:
            first.append(k)
            k += -(-len(buf) // _MESSAGE_BYTES)
        by_file: dict[str, list[int]] = {}
        for p, piece in enumerate(self.pieces):
            by_file.setdefault(piece.file, []).append(p)

        def fill(idx: list[int], i: int, lo: int, hi: int) -> int:
            p = idx[i]
            last = (hi - 1) // _MESSAGE_BYTES
            arrived(first[p] + last)
            return self.pieces[p].offset + min(len(self.bufs[p]), (last + 1) * _MESSAGE_BYTES)

        self._index_pieces()
        try:
            for name, entry in self.entries.items():
                if name not in _SMALL:
                    idx = by_file.get(name, [])
                    views = [self.bufs[p] for p in idx]
                    place = functools.partial(self._place_upto, name)
                    check_segments(entry, views, self.where / name, functools.partial(fill, idx), place)
        except _Undelivered:
            return
        except Exception as exc:  # noqa: BLE001 - a checksum, or placing a tensor: this rank's failure
            self.failure = RankFailure.from_exception(exc, f"the copy of {self.where.name} from rank {self.src}: ")
        else:
            if self._bad_framing is not None:
                self.failure = RankFailure.from_exception(
                    self._bad_framing, f"the copy of {self.where.name} from rank {self.src}: "
                )
            self.checked = True

    def finish(self, error: RankFailure | None) -> RankFailure | None:
        """After the transfer (``error``: it failed): check and place what arrived.
        Returns this rank's failure (its state may then hold some of the bytes)."""
        try:
            if self.failure is not None or error is not None:
                return self.failure or error
            try:
                if self.arrival is not None:
                    for view in self.bufs:
                        view.release()  # before the load (and the mappings close)
                    load(self.state_dict, self.arrival.tmp, process_group=self.owner._self_group)
                else:
                    self._check_and_place()
            except (AsyncckptError, OSError) as exc:
                where = "its own node" if self.src == self.owner.rank else f"rank {self.src}"
                return RankFailure.from_exception(exc, f"the copy of {self.where.name} from {where}: ")
            return None
        finally:
            self._release()

    def _index_pieces(self) -> None:
        """Index the pieces by file for :meth:`_at` (once)."""
        if self._index:
            return
        for piece, buf in zip(self.pieces, self.bufs):
            starts, pieces = self._index.setdefault(piece.file, ([], []))
            starts.append(piece.offset)
            pieces.append((piece.offset, buf))

    def _check_and_place(self) -> None:
        """Every byte against the manifest, the framing, the values, the temporaries:
        each tensor under 1 MiB placed as soon as the CRC has read its bytes (while the
        cache holds them), unless :meth:`check_arriving` placed it already.

        Raises:
            CorruptCheckpointError: a checksum, a framing or a value that does not match.
            CheckpointError: a value that needs ``allow_pickle``.
        """
        self._index_pieces()
        by_file: dict[str, list[memoryview]] = {}
        sources: dict[str, list[tuple[int, int, bool]]] = {}
        for piece, buf, source in itertools.zip_longest(self.pieces, self.bufs, self.sources):
            by_file.setdefault(piece.file, []).append(buf)
            sources.setdefault(piece.file, []).append(source)
        for name, entry in self.entries.items():
            if name not in _SMALL and not self.checked:
                views = by_file.get(name, [])
                fill = None
                if self.packed is not None:
                    fill = functools.partial(_read_into, self.packed, views, sources.get(name, []))
                check_segments(entry, views, self.where / name, fill, functools.partial(self._place_upto, name))
        for name in self.plan.files:
            self._place_upto(name, sys.maxsize)  # (none left where the checks placed them)
        if self._bad_framing is not None:
            raise self._bad_framing
        planner = SafeLoadPlanner(allow_pickle=False)
        values = []
        for fqn, name, offset, length in self._values:
            raw = self._at(name, offset, length).tobytes()
            values.append((fqn, planner.decode_value(fqn, io.BytesIO(raw))))
        for fqn, obj in values:
            set_value(self.plan.state_dict, self.plan.mappings[fqn], obj)

    def _place_upto(self, name: str, end: int) -> None:
        """Place the plan's entries of file ``name`` that end at or before offset ``end``
        and are not placed yet (in file order): check each tensor's framing, copy the
        data of one not received into its tensor, copy a temporary in; a value's bytes
        are decoded by :meth:`_check_and_place` once every byte is checked.

        A record not in our writer's framing is not placed; :meth:`_check_and_place`
        (or :meth:`check_arriving`) raises it once the checksums passed.
        """
        entries = self.plan.files.get(name, ())
        k = self._placed.get(name, 0)
        while k < len(entries) and entries[k].offset + entries[k].length <= end:
            e = entries[k]
            k += 1
            self._placed[name] = k
            framing = e.framing
            if framing is None:
                self._values.append((e.fqn, name, e.offset, e.length))
                continue
            n = len(framing.prefix)
            tail = self._at(name, e.offset + n + framing.nbytes, len(framing.suffix))
            if self._at(name, e.offset, n) != framing.prefix or not suffix_matches(tail, framing):
                # (raised once every byte is checked: a flipped byte is a checksum mismatch, said so)
                self._bad_framing = self._bad_framing or CorruptCheckpointError(
                    f"{self.where / name}: the record of {e.fqn!r} is not in our writer's framing",
                    str(self.where / name),
                )
                continue
            if e.fqn in self.temps:
                e.target.detach().copy_(self.temps[e.fqn])
            elif e.fqn not in self._received and framing.nbytes:
                view = self._at(name, e.offset + n, framing.nbytes)
                target = e.target.detach()
                if target.is_cpu and target.is_contiguous():  # (libc's memmove: torch's copy_ of
                    # a small tensor wakes its intra-op threads, milliseconds each on a busy machine)
                    ctypes.memmove(target.data_ptr(), ctypes.addressof(ctypes.c_char.from_buffer(view)), len(view))
                else:
                    data = torch.frombuffer(view, dtype=torch.uint8)
                    target.copy_(data.view(target.dtype).view(target.shape))
                    del data  # (it holds a view of a buffer released after)


def _read_into(
    packed: Packed, views: list[memoryview], sources: list[tuple[int, int, bool]], i: int, lo: int, hi: int
) -> int:
    """``fill`` of :func:`check_segments` for this node's shard: bytes ``[lo, hi)`` of
    ``views[i]`` read from its file (``sources[i]``: file index, offset, and whether
    it is read; else the view is the file's mapping). Returns the file offset up to
    which ``views`` hold their bytes."""
    index, offset, read = sources[i]
    if not read:
        return offset + len(views[i])
    packed.readinto(index, offset + lo, [views[i][lo:hi]])
    return offset + hi


def _messages(bufs: list[memoryview]) -> list[memoryview]:
    """``bufs`` cut into the messages of a restore's transfer: consecutive views of at
    most :data:`_MESSAGE_BYTES` (release them after use)."""
    return [buf[o : o + _MESSAGE_BYTES] for buf in bufs for o in range(0, len(buf), _MESSAGE_BYTES)]


def _exchange(
    sync: SyncGroup,
    sends: dict[int, list[memoryview]],
    receive: tuple[int, list[memoryview]] | None,
    meanwhile: Callable[[], None] = lambda: None,
    check: Callable[[Callable[[int], None]], None] | None = None,
) -> RankFailure | None:
    """Point-to-point messages on ``sync``'s gloo group: each buffer of ``sends[dst]``
    to group rank ``dst``, the buffers of ``receive`` (``(src, buffers)``) from
    ``src``, each cut into :func:`_messages` tagged by their position; all posted, then
    ``meanwhile()`` runs (gloo moves the bytes on its own threads), then
    ``check(arrived)`` (``arrived(k)`` waits for received message ``k`` and those
    before it, raising :class:`_Undelivered` if one failed), then all are waited for.
    Returns this rank's failure (``meanwhile`` runs even when posting failed; neither
    it nor ``check`` may raise anything else)."""
    group = sync.gloo if sync.active else None
    works: list[Any] = []
    tensors: list[torch.Tensor] = []
    posts: list[tuple[int, memoryview, Callable[..., Any]]] = [
        (dst, buf, dist.isend) for dst, bufs in sends.items() for buf in _messages(bufs)
    ]
    first_receive = len(posts)
    if receive is not None:
        posts += [(receive[0], buf, dist.irecv) for buf in _messages(receive[1])]
    counts: dict[tuple[int, Any], int] = {}
    # (a gloo work is waited for once: a second wait waits for another message)
    waited, failed = [first_receive], []  # the received messages waited for end at waited[0]

    def arrived(k: int) -> None:
        while waited[0] <= first_receive + k:
            work = works[waited[0]]
            waited[0] += 1
            try:
                if work is not None:
                    work.wait()
            except Exception as exc:
                failed.append(exc)
                raise _Undelivered() from exc

    try:
        try:
            for peer, buf, op in posts:
                tag = counts[(peer, op)] = counts.get((peer, op), -1) + 1
                tensors.append(torch.frombuffer(buf, dtype=torch.uint8))
                works.append(op(tensors[-1], sync.global_rank(peer), group=group, tag=tag))
        finally:
            meanwhile()
        if check is not None and len(works) == len(posts):
            check(arrived)
        for i, work in enumerate(works):
            if work is not None and not first_receive <= i < waited[0]:
                work.wait()
        if failed:
            raise failed[0]
    except Exception as exc:  # noqa: BLE001 - funnelled by the caller
        return RankFailure.from_exception(exc, "a transfer of the local tier failed: ")
    finally:
        works.clear()
        tensors.clear()  # they hold the buffers
        for _, buf, _ in posts:
            buf.release()
    return None


#: The tags of a restore's header messages (its size, its bytes); the pieces count from 0.
_HEADER_TAGS = (1 << 24, (1 << 24) + 1)


def _swap_headers(sync: SyncGroup, offers: dict[int, Any], source: int | None) -> Any:
    """Send each ``offers[dst]`` (a :func:`_header`, or why the copy could not be read)
    to group rank ``dst``, and receive this rank's from ``source`` (point to point: a
    size, then the pickled bytes); returns it (``None`` without a source).

    Raises:
        CheckpointError: the transfer failed.
    """
    group = sync.gloo if sync.active else None
    works: list[Any] = []
    keep: list[torch.Tensor] = []
    for dst, offer in offers.items():
        payload = pickle.dumps(offer, protocol=pickle.HIGHEST_PROTOCOL)
        keep += [
            torch.tensor([len(payload)], dtype=torch.int64),
            torch.frombuffer(bytearray(payload), dtype=torch.uint8),
        ]
        for tensor, tag in zip(keep[-2:], _HEADER_TAGS):
            works.append(dist.isend(tensor, sync.global_rank(dst), group=group, tag=tag))
    try:
        if source is None:
            return None
        size = torch.zeros(1, dtype=torch.int64)
        _wait(dist.irecv(size, sync.global_rank(source), group=group, tag=_HEADER_TAGS[0]), "the restore's header")
        data = bytearray(int(size.item()))
        buf = torch.frombuffer(data, dtype=torch.uint8)
        _wait(dist.irecv(buf, sync.global_rank(source), group=group, tag=_HEADER_TAGS[1]), "the restore's header")
        return pickle.loads(data)
    finally:
        for work in works:
            _wait(work, "the restore's header")


def _wait(work: Any, what: str) -> None:
    try:
        if work is not None:
            work.wait()
    except RuntimeError as exc:
        raise CheckpointError(f"{what} could not be transferred: {exc}") from exc


def _nothing() -> None:
    pass


@contextlib.contextmanager
def _closing(packed: dict[int, Packed]) -> Iterator[None]:
    try:
        yield
    finally:
        for p in packed.values():
            p.close()


def _transfer(
    sync: SyncGroup,
    send: dict[int, Packed],
    receive: dict[int, list[tuple[str, int]]],
    open_arrival: Callable[[int, list[tuple[str, int]]], Arrival],
    finish: Callable[[int, Arrival], Any],
    failure: RankFailure | None,
) -> RankFailure | None:
    """Point-to-point transfers on ``sync``'s gloo group, every rank posting its own:
    each file of ``send[dst]`` to group rank ``dst`` (one isend per file, tagged by its
    position, straight from its mapping); from each ``receive`` source, the files it
    lists, straight into the mappings of ``open_arrival(src, files)``, then
    ``finish(src, arrival)``. A receiver that cannot open its arrival still drains the
    bytes (no sender waits for it). Returns this rank's failure (or the one given)."""
    group = sync.gloo if sync.active else None
    works: list[Any] = []
    tensors: list[torch.Tensor] = []
    arrivals: dict[int, Arrival | None] = {}

    def post(buf: Any, peer: int, tag: int, op: Callable[..., Any]) -> None:
        tensors.append(torch.frombuffer(buf, dtype=torch.uint8))
        works.append(op(tensors[-1], sync.global_rank(peer), group=group, tag=tag))

    try:
        try:
            for dst, packed in send.items():
                for tag, m in enumerate(packed.maps):
                    if m is not None:
                        post(m, dst, tag, dist.isend)
            for src, files in receive.items():
                bufs: list[Any]
                try:
                    arrival: Arrival | None = open_arrival(src, files)
                    assert arrival is not None
                    bufs = list(arrival.maps)
                except Exception as exc:  # noqa: BLE001 - funnelled; the bytes are drained all the same
                    failure = failure or RankFailure.from_exception(exc, f"storing rank {src}'s shard failed: ")
                    arrival, bufs = None, [bytearray(size) if size else None for _, size in files]
                arrivals[src] = arrival
                for tag, buf in enumerate(bufs):
                    if buf is not None:
                        post(buf, src, tag, dist.irecv)
            for work in works:
                if work is not None:
                    work.wait()
        finally:
            works.clear()
            tensors.clear()  # they hold the mappings' buffers
    except Exception as exc:  # noqa: BLE001 - funnelled by the caller
        for arrival in arrivals.values():
            if arrival is not None:
                arrival.discard()
        return failure or RankFailure.from_exception(exc, "a transfer of the local tier failed: ")
    for src, arrival in arrivals.items():
        if arrival is None:
            continue
        try:
            finish(src, arrival)
        except Exception as exc:  # noqa: BLE001 - funnelled by the caller
            arrival.discard()  # nothing of it is kept (finish discards what it refused; this is the rest)
            failure = failure or RankFailure.from_exception(exc, f"the shard received from rank {src} failed: ")
    return failure
