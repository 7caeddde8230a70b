"""Pending saves at ``torch.distributed.destroy_process_group()``: committed first, or named.

A script that ends with ``dist.destroy_process_group()`` and no ``close()`` (a common
ending) used to destroy the groups the background commit runs on while a save was
pending: the save was lost, or, with a collective broken on one rank only, half
committed. :func:`asyncckpt.dist.call_before_destroy` runs
:func:`settle_pending_before_destroy` first, on every rank that calls it: each rank
waits for its pending saves to settle (every rank's finalizer still has its group, so
the commit runs as usual), then the groups are destroyed. The waiting and naming is
the exit's (:func:`asyncckpt.saving.pending.settle_pending`), with another bound.
"""

from __future__ import annotations

from typing import Any

from asyncckpt.dist import _TORCH_DEFAULT_TIMEOUT, SyncGroup, call_before_destroy
from asyncckpt.saving.pending import settle_pending


def _group_timeout_s(queue: Any) -> float:
    return max(SyncGroup(queue._process_group).timeout, _TORCH_DEFAULT_TIMEOUT).total_seconds()


def settle_pending_before_destroy(group: Any) -> None:
    """(each rank, in ``destroy_process_group(group)``) Let every pending save of the
    queues on ``group`` (``None``: all groups) commit, then name each one still pending
    as lost (a warning on logger ``asyncckpt``), and each that failed.

    An overlapped staging still copying is handed to the writer first. Saves of a queue
    finalized in the training loop cannot commit here (it needs the loop): they are
    named at once. The wait is bounded by the group's collective timeout (at least
    torch's default, 30 minutes): a peer that is gone fails the commit much sooner.
    """
    settle_pending(
        _group_timeout_s,
        "at destroy_process_group()",
        "; call close() or wait() before destroying the process group",
        "the process group's timeout",
        group=... if group is None else group,
        announce=True,
    )


call_before_destroy(settle_pending_before_destroy)
