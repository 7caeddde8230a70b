"""Pending saves at ``torch.distributed.destroy_process_group()``: committed first, or named.

A script that ends with ``dist.destroy_process_group()`` and no ``close()`` (a common
ending) used to destroy the groups the background commit runs on while a save was
pending: the save was lost, or, with a collective broken on one rank only, half
committed. :func:`asyncckpt.dist.call_before_destroy` runs
:func:`settle_pending_before_destroy` first, on every rank that calls it: each rank
waits for its pending saves to settle (every rank's finalizer still has its group, so
the commit runs as usual), then the groups are destroyed.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any

from asyncckpt.dist import _TORCH_DEFAULT_TIMEOUT, SyncGroup, call_before_destroy

_log = logging.getLogger("asyncckpt")


def _name(record: Any) -> str:
    return f"step {record.step} ({record.final_dir})" if record.step is not None else str(record.final_dir)


def settle_pending_before_destroy(group: Any) -> None:
    """(each rank, in ``destroy_process_group(group)``) Let every pending save of the
    queues on ``group`` (``None``: all groups) commit, then name each one still pending
    as lost (a warning on logger ``asyncckpt``), and each that failed.

    An overlapped staging still copying is handed to the writer first. Saves of a queue
    finalized in the training loop cannot commit here (it needs the loop): they are
    named at once. The wait is bounded by the group's collective timeout (at least
    torch's default, 30 minutes): a peer that is gone fails the commit much sooner.
    """
    from asyncckpt.saving.pending import (
        _live_savers,  # not at import: pending imports this module
    )

    pending: list[tuple[bool, Any, float]] = []
    for saver in list(_live_savers):
        queue = saver._queue_ref()
        if queue is None or queue.closed or queue.caller.foreign:
            continue
        if group is not None and queue._process_group is not group:
            continue  # another group's saves: their groups are not destroyed now
        try:
            saver.synchronize_staging()  # an overlapped save still copying: hand it to the writer
        except Exception:  # noqa: BLE001 - its failure is reported through its handle
            pass
        timeout_s = max(SyncGroup(queue._process_group).timeout, _TORCH_DEFAULT_TIMEOUT).total_seconds()
        pending += [(queue.background_finalize, record, timeout_s) for record in saver.pending_records()]
    if not pending:
        return
    _log.info("asyncckpt: destroy_process_group() waits for %d pending save(s) to commit: %s", len(pending),
              ", ".join(_name(record) for _, record, _ in pending))
    started = time.monotonic()
    for background, record, timeout_s in pending:
        if background:
            concurrent.futures.wait([record.handle], max(0.0, started + timeout_s - time.monotonic()))
    for background, record, _ in pending:
        handle = record.handle
        if not handle.done():
            why = ("its queue is finalized in the training loop" if not background
                   else f"not committed after {time.monotonic() - started:.0f} s")
            _log.warning("asyncckpt: the save of %s was still pending at destroy_process_group() and is lost "
                         "(%s); call close() or wait() before destroying the process group", _name(record), why)
        elif handle.exception() is not None:
            _log.warning("asyncckpt: the save of %s, pending at destroy_process_group(), failed: %s",
                         _name(record), str(handle.exception()).splitlines()[0])


call_before_destroy(settle_pending_before_destroy)
