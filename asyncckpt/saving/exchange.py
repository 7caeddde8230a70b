"""The layout exchange: the coordinator's cache of every rank's file layout, and the
wire protocol that sends a rank's layout only when it changed."""

from __future__ import annotations

import secrets
from typing import Any

from asyncckpt.errors import CheckpointError
from asyncckpt.format.layout import RankLayout, build_layout
from asyncckpt.saving.planning import SavePlanResult
from asyncckpt.saving.record import SaveInFlight


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
    """Commit step 1 without sending an unchanged file layout again.

    The coordinator needs every rank's ``storage_data`` (a ``MetadataIndex`` and a
    ``_StorageInfo`` per record) for ``.metadata``. Gathered on every save, a cached
    layout's entries would be pickled, sent and unpickled by every rank each time:
    thousands of objects per commit on each rank, which set the pace of the cyclic GC's
    full collections (in whichever thread runs then, a stall on every rank when one
    falls inside a save's plan).

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

    def outgoing(self, save: SaveInFlight) -> tuple[int, dict | None]:
        """What this rank contributes: ``(token, storage_data or None)``."""
        sent = self._sent
        if sent is not None and sent[0] == save.coordinator_rank and sent[1] is save.layout:
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
                raise CheckpointError(
                    f"the coordinator does not hold rank {rank}'s file layout "
                    f"(token {token:016x}); the next save sends every layout again"
                )
            merged.update(held[1])
        self._merged = (tokens, merged)
        return merged

    def forget_sent(self) -> None:
        """After a failed commit: send the next layout in full."""
        self._sent = None
