"""The record of one save in flight: what each phase of a save hands to the next."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from asyncckpt.dist import SyncGroup
from asyncckpt.format.layout import RankLayout
from asyncckpt.io.storage import LOCAL, Storage
from asyncckpt.root import CheckpointRoot
from asyncckpt.saving.handle import SaveCallback, SaveHandle, SaveTimings
from asyncckpt.saving.planning import SavePlanResult
from asyncckpt.saving.staging import StagingBuffer


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
        started: ``time.monotonic()`` at the ``save()`` call (for ``total_s``).
        stall_s: seconds the training thread has been blocked by this save so far.
        call_idx: the save's call in its queue, once scheduled (``None``: not yet,
            or a synchronous save).
        callback: the completion callback, run once when the save is settled.
        storage: the tier the save is written to, committed in or discarded from.
        user_info: extra manifest fields of this save (``metrics``, ``metadata``;
            :func:`asyncckpt._check.check_step_info`), written by the coordinator.
        plan_s, stage_s, commit_s: seconds of those phases on this rank so far
            (:class:`SaveTimings`).
        reported: the user saw the outcome (``wait``/``result``/``exception``): the
            owner's harvest does not report it again.
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
    started: float = dataclasses.field(default_factory=time.monotonic)
    stall_s: float = 0.0
    call_idx: int | None = None
    callback: SaveCallback | None = None
    reported: bool = False
    storage: Storage = LOCAL
    user_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    plan_s: float = 0.0
    stage_s: float = 0.0
    commit_s: float = 0.0

    def finish_timings(self, write_s: float, finalize_s: float, nbytes: int) -> SaveTimings:
        """Set and return :attr:`timings`, the save being committed now."""
        total = time.monotonic() - self.started
        self.timings = SaveTimings(
            stall_s=self.stall_s,
            write_s=write_s,
            finalize_s=finalize_s,
            total_s=total,
            bytes=nbytes,
            gbps=nbytes / write_s / 1e9 if write_s > 0 else 0.0,
            plan_s=self.plan_s,
            stage_s=self.stage_s,
            commit_s=self.commit_s,
        )
        return self.timings
