"""Rank synchronization for the framework and checkpoint layers.

All collectives of asyncckpt run on a dedicated gloo group (CPU tensors), created
once per process group, so they work whatever the default backend is (NCCL included)
and never interleave with the user's own collectives on the default group. With no
process group initialized, everything behaves as world_size 1 and no collective is
issued.

Each gloo group takes the timeout of the user's process group (the ``timeout`` given
to ``init_process_group`` or ``new_group``; the finalizer's groups at least torch's
default, as a rank's write may take that much longer than another's). A collective
that fails (its timeout passed, or a peer left) raises :class:`CheckpointError` naming
the collective and which ranks did not arrive: a rank still waiting after
:data:`CHECK_IN_AFTER_S` records that it arrived in the default store, and the error
reads those records. Collectives that complete within that time (the steady state)
touch no store.

``torch.distributed.destroy_process_group`` is wrapped (:mod:`asyncckpt._destroy`,
installed on ``import asyncckpt``) so that the functions registered with
:func:`call_before_destroy` run before the user's groups are destroyed (the checkpoint
layer commits its pending saves there).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from asyncckpt import _destroy, _exit
from asyncckpt.errors import CheckpointError, RankFailure

__all__ = ["SyncGroup", "collective_timeout", "call_before_destroy"]

_log = logging.getLogger("asyncckpt")

#: Seconds a collective may run before this rank records its arrival in the store
#: (at most a quarter of the group's timeout); the steady state stays under it.
CHECK_IN_AFTER_S = 1.0
#: torch's default timeout of gloo groups (30 minutes).
_TORCH_DEFAULT_TIMEOUT = timedelta(minutes=30)

_lock = threading.Lock()
# (id of the user's group object or of the default group) -> (user group, gloo group)
_gloo_groups: dict[int, tuple[Any, Any]] = {}
#: The gloo groups asyncckpt created, and what their collectives need to report a failure.
_own_groups: weakref.WeakKeyDictionary[Any, _Arrivals] = weakref.WeakKeyDictionary()


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
        self._what = "a collective of asyncckpt"

    @contextlib.contextmanager
    def describing(self, what: str) -> Iterator[None]:
        """Name the collectives issued inside the block in their errors, e.g. "the plan
        of the save of step 5 (/ckpt/step_00000005)"."""
        before, self._what = self._what, what
        try:
            yield
        finally:
            self._what = before

    @classmethod
    def private(cls, process_group: Any = None) -> SyncGroup:
        """A group over the same ranks with a gloo group of its own (collective).

        For collectives issued from another thread (a queue's finalizer): two threads
        must never issue collectives on one group, or their order could differ
        between ranks. Free it with :meth:`destroy`.
        """
        sync = cls(process_group)
        if sync.active:
            # At least torch's default: the finalizer's first collective waits for every
            # rank's write, which may take one rank much longer than another.
            sync._gloo = _new_gloo_group(
                process_group, op_timeout=max(collective_timeout(process_group), _TORCH_DEFAULT_TIMEOUT)
            )
            sync._private = True
            sync._what = "a collective of the background commit"
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

    def forget_group(self) -> None:
        """Drop this object's reference to the shared dedicated gloo group (the module's
        cache owns it, and releases it at exit: a group destroyed during interpreter
        finalization can abort the process). A later collective looks it up again.
        A private group is left alone: :meth:`close` frees it."""
        if not self._private:
            self._gloo = None

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
        self._collective("all_gather", lambda group: dist.all_gather(out, local, group=group, async_op=True))
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

    def all_gather_object(self, obj: Any, fits: int = 0) -> list[Any]:
        """Gather one picklable object from every rank; ``result[r]`` is rank ``r``'s.

        Two all_gathers on the gloo group: the pickled sizes (int64), then the bytes
        padded to the largest (uint8). Unlike ``torch.distributed.all_gather_object``
        (which goes through ``Tensor.numpy()`` in torch 2.13) it needs no NumPy.

        Args:
            fits: bytes that every rank's pickle is expected to fit (the same on every
                rank; 0: no guess): one all_gather of that many bytes (and the size)
                per rank; the two above only when some rank's does not fit.
        """
        if not self.active:
            return [obj]
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if fits > 0:
            first = bytearray(8 + fits)
            first[:8] = len(payload).to_bytes(8, "little")
            if len(payload) <= fits:
                first[8 : 8 + len(payload)] = payload
            gathered = self._all_gather_bytes(first)
            sizes = [int.from_bytes(b[:8], "little") for b in gathered]
            if max(sizes) <= fits:
                return [pickle.loads(memoryview(b)[8 : 8 + n]) for b, n in zip(gathered, sizes)]
        else:
            sizes = [s[0] for s in self.all_gather_ints([len(payload)])]
        width = max(max(sizes), 1)
        local = bytearray(width)
        local[: len(payload)] = payload
        bufs = self._all_gather_bytes(local)
        return [pickle.loads(memoryview(b)[:n]) for b, n in zip(bufs, sizes)]

    def _all_gather_bytes(self, local: bytearray) -> list[bytearray]:
        """One all_gather of ``local`` (the same length on every rank) on the gloo group;
        ``result[r]`` is rank ``r``'s bytes."""
        bufs = [bytearray(len(local)) for _ in range(self.world_size)]
        self._collective(
            "all_gather",
            lambda group: dist.all_gather(
                [torch.frombuffer(b, dtype=torch.uint8) for b in bufs],
                torch.frombuffer(local, dtype=torch.uint8),
                group=group,
                async_op=True,
            ),
        )
        return bufs

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Broadcast a picklable object from group rank ``src``; returns it on every rank.

        The size (int64), then the pickled bytes (uint8), broadcast on the gloo group;
        no NumPy needed (see :meth:`all_gather_object`).
        """
        if not self.active:
            return obj
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == src else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        root = self.global_rank(src)
        self._collective("broadcast", lambda group: dist.broadcast(size, src=root, group=group, async_op=True))
        buf = bytearray(payload) if self.rank == src else bytearray(int(size.item()))
        if buf:
            data = torch.frombuffer(buf, dtype=torch.uint8)
            self._collective("broadcast", lambda group: dist.broadcast(data, src=root, group=group, async_op=True))
        return obj if self.rank == src else pickle.loads(buf)

    def _collective(self, op: str, issue: Callable[[Any], Any]) -> None:
        """Run one collective (``issue(group)`` starts it with ``async_op=True``) and wait.

        Raises:
            CheckpointError: it failed or timed out; names the collective and the ranks
                that did not arrive (read from the store, see :class:`_Arrivals`).
        """
        group = self.gloo
        arrivals = _own_groups.get(group)
        if arrivals is None:  # not ours (cannot happen): wait as torch does
            issue(group).wait()
            return
        arrivals.seq += 1
        seq = arrivals.seq
        started = time.monotonic()
        try:
            work = issue(group)
            try:
                work.wait(arrivals.check_in_after)
                return
            except RuntimeError:
                if work.is_completed():  # failed within the short wait, or done just after it:
                    work.wait()  # raises its own error, or returns
                    return
            arrivals.check_in(seq, "waiting")  # still waiting: say so, for the others' errors
            work.wait()
        except RuntimeError as exc:
            raise arrivals.error(f"{self._what} ({op})", seq, self.rank, time.monotonic() - started, exc) from exc

    @property
    def timeout(self) -> timedelta:
        """The timeout of this group's collectives (the dedicated or private gloo group's)."""
        arrivals = _own_groups.get(self._gloo) if self._gloo is not None else None
        if arrivals is not None:
            return arrivals.timeout
        return collective_timeout(self._user_group) if self.distributed else _TORCH_DEFAULT_TIMEOUT


class _Arrivals:
    """Which ranks reached a collective of one of our gloo groups, for its error.

    Each rank counts the collectives it issues on the group (``seq``, equal across
    ranks while they are in step). A rank still waiting after ``check_in_after``
    seconds sets its key in the default store to ``"<seq> waiting"``; a rank whose
    collective failed sets ``"<seq> gave up"``, then reads every rank's key: a rank
    without ``<seq>`` did not arrive. Nothing is stored while collectives complete
    within ``check_in_after``.
    """

    def __init__(self, name: str, ranks: list[int], timeout: timedelta) -> None:
        self.timeout = timeout
        self.check_in_after = timedelta(seconds=min(CHECK_IN_AFTER_S, timeout.total_seconds() / 4))
        self.seq = 0
        self.name = name
        self.ranks = list(ranks)  # group rank -> global rank

    def _key(self, group_rank: int) -> str:
        return f"asyncckpt/arrival/{self.name}/{self.ranks[group_rank]}"

    @staticmethod
    def _store() -> Any:
        return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None

    def check_in(self, seq: int, state: str) -> None:
        """Record this rank's ``state`` at collective ``seq`` (best effort)."""
        try:
            store = self._store()
            if store is not None:
                store.set(self._key(self.ranks.index(dist.get_rank())), f"{seq} {state}")
        except Exception:  # noqa: BLE001 - a diagnosis only
            pass

    def _states(self, seq: int, me: int) -> dict[str, list[int]]:
        store = self._store()
        if store is None:
            raise RuntimeError("torch.distributed is no longer initialized")
        found: dict[str, list[int]] = {"did not arrive": [], "gave up": [], "was waiting": []}
        for r in range(len(self.ranks)):
            if r == me:
                continue
            key = self._key(r)
            value = store.get(key).decode() if store.check([key]) else ""
            their_seq, _, state = value.partition(" ")
            if not their_seq.isdigit() or int(their_seq) < seq:
                found["did not arrive"].append(r)
            elif int(their_seq) == seq and state == "gave up":
                found["gave up"].append(r)
            else:
                found["was waiting"].append(r)
        return found

    def error(self, what: str, seq: int, me: int, waited_s: float, cause: BaseException) -> CheckpointError:
        """The error of a failed collective, naming the ranks that did not arrive."""
        self.check_in(seq, "gave up")
        try:
            found = self._states(seq, me)
            if found["did not arrive"]:  # one that arrived just now has not checked in yet
                time.sleep(self.check_in_after.total_seconds())
                found = self._states(seq, me)
            parts = [f"{k}: " + ", ".join(f"rank {r}" for r in v) for k, v in found.items() if v]
            who = "; ".join(parts) if parts else "every rank arrived"
        except Exception as exc:  # noqa: BLE001 - the store may be gone with the group
            who = f"which ranks arrived is unknown ({type(exc).__name__}: {exc})"
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        timeout_s = self.timeout.total_seconds()
        return CheckpointError(
            f"{what} failed on rank {me} after {waited_s:.1f} s (the group's timeout is {timeout_s:g} s): "
            f"{who}. Every rank must make the same asyncckpt calls in the same order (each rank calls "
            f"save() for every checkpoint). Cause: {first}"
        )


def collective_timeout(process_group: Any = None) -> timedelta:
    """The timeout of ``process_group``'s collectives (default: the default group's):
    the ``timeout`` given to ``init_process_group`` / ``new_group``, else torch's default."""
    try:
        group = _resolve(process_group)
        for device in group._device_types:
            timeout = getattr(getattr(group._get_backend(device), "options", None), "_timeout", None)
            if isinstance(timeout, timedelta):
                return timeout
        if process_group is None:
            timeout = getattr(dist.distributed_c10d._get_default_store(), "timeout", None)
            if isinstance(timeout, timedelta):
                return timeout
    except Exception:  # noqa: BLE001 - private attributes of torch: fall back to its default
        pass
    return _TORCH_DEFAULT_TIMEOUT


#: Our group creations per set of ranks (the same order on every member): names the
#: store keys of a creation's check-in.
_creations: dict[tuple[int, ...], int] = {}


def _new_gloo_group(process_group: Any, op_timeout: timedelta | None = None) -> Any:
    """A new gloo group over ``process_group``'s ranks (collective on them).

    Created with the user group's timeout (a rank that does not come fails it after
    that long), then given ``op_timeout`` for its collectives when that differs.

    Raises:
        CheckpointError: the creation failed (timed out), naming the ranks that did
            not arrive. Each rank records its arrival in the store first (once per
            group: not the steady state).
    """
    timeout = collective_timeout(process_group)
    ranks = (
        dist.get_process_group_ranks(process_group) if process_group is not None else list(range(dist.get_world_size()))
    )
    members = tuple(ranks)
    with _lock:
        _creations[members] = _creations.get(members, 0) + 1
        nth = _creations[members]
    digest = hashlib.blake2b(repr(members).encode(), digest_size=8).hexdigest()
    creation = _Arrivals(f"new_group/{digest}/{nth}", ranks, timeout)
    creation.check_in(1, "waiting")
    started = time.monotonic()
    try:
        if process_group is None:
            gloo = dist.new_group(backend="gloo", timeout=timeout)
        else:
            gloo = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout, use_local_synchronization=True)
    except RuntimeError as exc:
        raise creation.error(
            "the creation of asyncckpt's gloo group (new_group)",
            1,
            ranks.index(dist.get_rank()),
            time.monotonic() - started,
            exc,
        ) from exc
    if op_timeout is not None and op_timeout != timeout:
        try:
            gloo._get_backend(torch.device("cpu"))._set_default_timeout(op_timeout)
            timeout = op_timeout
        except Exception:  # noqa: BLE001 - a private method of torch: keep the creation's timeout
            pass
    _own_groups[gloo] = _Arrivals(f"group/{getattr(gloo, 'group_name', '') or digest}", ranks, timeout)
    return gloo


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


_exit.register(_exit.RELEASE_GROUPS, _release_gloo_groups)


# ---------------------------------------------------------------------- destroy_process_group
_before_destroy: list[Callable[[Any], None]] = []


def call_before_destroy(fn: Callable[[Any], None]) -> None:
    """Call ``fn(group)`` at the start of ``torch.distributed.destroy_process_group(group)``
    (``group`` ``None``: every group is being destroyed), before any group is, whenever
    the group is the user's (never for asyncckpt's own gloo groups). An exception of
    ``fn`` is logged; a ``BaseException`` (Ctrl-C) propagates and nothing is destroyed.
    Once per function (idempotent). The wrapper itself is installed on ``import
    asyncckpt`` (:func:`asyncckpt._destroy.install`); this makes sure of it.
    """
    if fn not in _before_destroy:
        _before_destroy.append(fn)
    _destroy.call_before_destroy(_run_before_destroy)
    _destroy.install()


def _run_before_destroy(group: Any) -> None:
    if group is None or group is dist.GroupMember.WORLD:
        group = None
    elif group is dist.GroupMember.NON_GROUP_MEMBER or group in _own_groups:
        return
    for fn in list(_before_destroy):
        try:
            fn(group)
        except Exception:  # noqa: BLE001 - the user's destroy goes on
            _log.exception("asyncckpt: a hook before destroy_process_group() raised")
