"""The record of one save in flight: what each phase of a save hands to the next."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from asyncckpt.dist import SyncGroup
from asyncckpt.format.layout import RankLayout
from asyncckpt.root import CheckpointRoot
from asyncckpt.saving import destroy_hook as _destroy_hook  # noqa: F401 - pending saves commit before destroy_process_group()
from asyncckpt.saving.handle import SaveHandle, SaveTimings
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


