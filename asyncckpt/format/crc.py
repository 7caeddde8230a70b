"""CRC-32, the checksum of every byte asyncckpt writes and verifies.

The polynomial is zlib's (``zlib.crc32``, ``binascii.crc32``, the zip format's), so a
manifest's checksums can be checked with the standard library alone. The
computation comes from python-isal (Intel ISA-L, a dependency) when it is importable:
``isal.isal_zlib.crc32`` folds with carry-less multiplication, several times faster
than ``zlib.crc32``, and releases the GIL the same way; ``zlib.crc32`` is the
fallback, with identical results.

:class:`CrcChain` checksums what a reading thread has just read on a helper thread,
so that one thread reads a file sequentially (the kernel's readahead keeps the disk
busy) while the checksum keeps up beside it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

try:
    from isal.isal_zlib import crc32

    IMPLEMENTATION = "isal"
except ImportError:  # pragma: no cover - a platform without an isal wheel
    from zlib import crc32

    IMPLEMENTATION = "zlib"

__all__ = ["crc32", "IMPLEMENTATION", "CrcChain"]


class CrcChain:
    """The CRC-32s of consecutive byte ranges, computed in order on one helper thread.

    The reading thread hands over each piece it has read (:meth:`update`) and closes a
    range with :meth:`end`; the helper folds the pieces in order. The pieces must not
    change until their future is done (a reused read buffer waits for it).

    Use as a context manager, or call :meth:`close`, which joins the helper.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="asyncckpt-crc")
        self._crc = 0
        self._lock = threading.Lock()
        self._done: list[tuple[Any, int]] = []
        self._taken = 0
        self._error: BaseException | None = None

    def update(self, pieces: Sequence[Any]) -> Future:
        """Fold ``pieces`` (buffers, in order) into the current range's CRC, later.

        Returns:
            A future that is done once the pieces were read by the helper.
        """
        return self._pool.submit(self._update, pieces)

    def feed(self, steps: Sequence[tuple[Sequence[Any], tuple[Any, int | None] | None]]) -> Future:
        """:meth:`update` and :meth:`end` for many ranges in one hand-over: for each
        ``(pieces, closes)`` fold ``pieces`` in, then, if ``closes`` is ``(tag,
        expected)``, end the range as :meth:`end` does (one hand-over per read call
        instead of two per range: a file of 578 ranges paid 1156 of them).

        Returns:
            A future that is done once the pieces were read by the helper.
        """
        return self._pool.submit(self._feed, steps)

    def end(self, tag: Any, expected: int | None = None) -> None:
        """Close the current range: ``(tag, its crc32)`` goes to :meth:`take`; the next
        range starts from 0. ``expected``: the CRC the range must have, for
        :meth:`raise_mismatch`."""
        self._pool.submit(self._end, tag, expected)

    def raise_mismatch(self, error: Any, final: bool = False) -> None:
        """Raise ``error(tag, actual)`` for the first finished range whose CRC is not its
        ``expected`` one; ``final``: wait for the helper first (:meth:`close`)."""
        for (tag, expected), actual in self.close() if final else self.take():
            if expected is not None and actual != expected:
                raise error(tag, actual)

    def take(self) -> list[tuple[Any, int]]:
        """The ranges finished since the last call, as ``((tag, expected), crc32)`` in order."""
        with self._lock:
            out, self._taken = self._done[self._taken :], len(self._done)
        return out

    def close(self) -> list[tuple[Any, int]]:
        """Wait for the helper; return the ranges not taken yet (as :meth:`take`).

        Raises:
            Exception: what a checksum raised (a buffer that is no buffer).
        """
        self._pool.shutdown(wait=True)
        if self._error is not None:
            raise self._error
        return self.take()

    def __enter__(self) -> CrcChain:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._pool.shutdown(wait=True)

    def _update(self, pieces: Sequence[Any]) -> None:
        crc = self._crc
        try:
            for piece in pieces:
                crc = crc32(piece, crc)
        except BaseException as exc:  # noqa: BLE001 - raised by close()
            self._error = self._error or exc
        self._crc = crc

    def _feed(self, steps: Sequence[tuple[Sequence[Any], tuple[Any, int | None] | None]]) -> None:
        for pieces, closes in steps:
            self._update(pieces)
            if closes is not None:
                self._end(*closes)

    def _end(self, tag: Any, expected: int | None) -> None:
        with self._lock:
            self._done.append(((tag, expected), self._crc))
        self._crc = 0
