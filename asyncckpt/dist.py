"""Rank synchronization for the framework and checkpoint layers.

All collectives of asyncckpt run on a dedicated gloo group (CPU tensors), created
once per process group, so they work whatever the default backend is (NCCL included)
and never interleave with the user's own collectives on the default group. With no
process group initialized, everything behaves as world_size 1 and no collective is
issued.
"""

from __future__ import annotations

import atexit
import pickle
import threading
from typing import Any

import torch
import torch.distributed as dist

from .errors import RankFailure

__all__ = ["SyncGroup"]

_lock = threading.Lock()
# (id of the user's group object or of the default group) -> (user group, gloo group)
_gloo_groups: dict[int, tuple[Any, Any]] = {}


def _resolve(process_group: Any) -> Any:
    if process_group is not None:
        return process_group
    return dist.group.WORLD


class SyncGroup:
    """The ranks of one process group, seen through a dedicated gloo group.

    Args:
        process_group: the user's process group (``None``: the default group, or a
            single process if ``torch.distributed`` is not initialized).

    Attributes:
        rank: this process's rank in ``process_group`` (0 without distributed).
        world_size: number of ranks (1 without distributed).
    """

    def __init__(self, process_group: Any = None) -> None:
        self._user_group = process_group
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed:
            group = _resolve(process_group)
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        else:
            self.rank, self.world_size = 0, 1
        self._gloo = None
        self._private = False

    @classmethod
    def private(cls, process_group: Any = None) -> "SyncGroup":
        """A group over the same ranks with a gloo group of its own (collective).

        For collectives issued from another thread (a queue's finalizer): two threads
        must never issue collectives on one group, or their order could differ
        between ranks. Free it with :meth:`destroy`.
        """
        sync = cls(process_group)
        if sync.active:
            sync._gloo = _new_gloo_group(process_group)
            sync._private = True
        return sync

    def destroy(self) -> None:
        """Destroy a :meth:`private` gloo group (no-op otherwise, or if torch.distributed
        was shut down already)."""
        if not self._private or self._gloo is None:
            return
        gloo, self._gloo, self._private = self._gloo, None, False
        try:
            if dist.is_initialized():
                dist.destroy_process_group(gloo)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass

    @property
    def gloo(self) -> Any:
        """The dedicated gloo group (created collectively on first use)."""
        if self._gloo is None:
            self._gloo = _dedicated_gloo_group(self._user_group)
        return self._gloo

    @property
    def active(self) -> bool:
        """True if collectives are needed (distributed with world_size > 1)."""
        return self.distributed and self.world_size > 1

    def global_rank(self, group_rank: int) -> int:
        """The default-group rank of ``group_rank`` (for src/dst arguments)."""
        if not self.distributed or self._user_group is None:
            return group_rank
        return dist.get_global_rank(self._user_group, group_rank)

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Gather a short list of ints from every rank (one int64 all_gather).

        Returns:
            ``result[r]`` is rank ``r``'s list.
        """
        if not self.active:
            return [list(values)]
        local = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(out, local, group=self.gloo)
        return [t.tolist() for t in out]

    def gather_failures(self, failure: RankFailure | None) -> dict[int, RankFailure]:
        """Every rank's failure, the same dict on every rank (all ranks; the error funnel).

        One int64 all_gather of a flag; only if some rank failed, one all_gather of the
        failures. The model is DCP's ``_DistWrapper.reduce_scatter`` /
        ``all_gather`` with ``CheckpointException``: whatever fails on one rank is
        raised, the same, on all of them, so that no rank goes on alone.

        Returns:
            ``rank -> failure`` for the failing ranks (empty: none failed).
        """
        flags = self.all_gather_ints([failure is not None])
        if not any(f[0] for f in flags):
            return {}
        causes = self.all_gather_object(failure)
        return {r: c for r, c in enumerate(causes) if c is not None}

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather one picklable object from every rank; ``result[r]`` is rank ``r``'s.

        Two all_gathers on the gloo group: the pickled sizes (int64), then the bytes
        padded to the largest (uint8). Unlike ``torch.distributed.all_gather_object``
        (which goes through ``Tensor.numpy()`` in torch 2.13) it needs no NumPy.
        """
        if not self.active:
            return [obj]
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        sizes = [s[0] for s in self.all_gather_ints([len(payload)])]
        width = max(max(sizes), 1)
        local = bytearray(width)
        local[:len(payload)] = payload
        bufs = [bytearray(width) for _ in range(self.world_size)]
        dist.all_gather([torch.frombuffer(b, dtype=torch.uint8) for b in bufs],
                        torch.frombuffer(local, dtype=torch.uint8), group=self.gloo)
        return [pickle.loads(memoryview(b)[:n]) for b, n in zip(bufs, sizes)]

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Broadcast a picklable object from group rank ``src``; returns it on every rank.

        The size (int64), then the pickled bytes (uint8), broadcast on the gloo group;
        no NumPy needed (see :meth:`all_gather_object`).
        """
        if not self.active:
            return obj
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == src else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=self.global_rank(src), group=self.gloo)
        buf = bytearray(payload) if self.rank == src else bytearray(int(size.item()))
        if buf:
            dist.broadcast(torch.frombuffer(buf, dtype=torch.uint8), src=self.global_rank(src), group=self.gloo)
        return obj if self.rank == src else pickle.loads(buf)


def _new_gloo_group(process_group: Any) -> Any:
    if process_group is None:
        return dist.new_group(backend="gloo")
    ranks = dist.get_process_group_ranks(process_group)
    return dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)


def _registered(group: Any) -> bool:
    """Whether ``group`` is still a live process group (not destroyed)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def _dedicated_gloo_group(process_group: Any) -> Any:
    user = _resolve(process_group)
    key = id(user)
    with _lock:
        hit = _gloo_groups.get(key)
        if hit is not None and hit[0] is user:
            return hit[1]
        # Forget the groups of destroyed process groups (a process that initializes
        # torch.distributed again and again must not keep them all).
        for stale in [k for k, (u, _) in _gloo_groups.items() if not _registered(u)]:
            del _gloo_groups[stale]
    gloo = _new_gloo_group(process_group)
    with _lock:
        _gloo_groups[key] = (user, gloo)
    return gloo


@atexit.register
def _release_gloo_groups() -> None:
    """Drop the cached gloo groups while the interpreter is still whole.

    After ``destroy_process_group()`` this cache holds the last reference to a gloo
    group; left to interpreter finalization, its C++ destructor runs after Python is
    torn down and, now and then, aborts the process ("terminate called without an
    active exception", exit -6) after a run that succeeded. The same cause as torch
    PR 179291 (a process group destroyed during finalization).
    """
    with _lock:
        groups = list(_gloo_groups.values())
        _gloo_groups.clear()
    del groups
