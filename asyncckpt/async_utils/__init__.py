"""The framework: Megatron-core's ``async_utils`` in asyncckpt's words.

``from asyncckpt.async_utils import AsyncCallsQueue, AsyncRequest, ...`` is what
Megatron users write (``megatron.core.dist_checkpointing.strategies.async_utils``):
:class:`AsyncRequest` (request), :class:`AsyncCaller`, :class:`TemporalAsyncCaller`
and :class:`PersistentAsyncCaller` (callers), :class:`AsyncCallsQueue` (calls_queue),
:class:`CallOutcome` (what a worker returns) and ``SettleCallback`` (the type of
``on_settled``). The same names are on ``asyncckpt``.

Imported lazily, as ``asyncckpt`` itself: the background worker imports this package
(``worker``, ``callers``) and must not import torch, which ``calls_queue`` does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncRequest": "request",
    "AsyncCaller": "callers",
    "TemporalAsyncCaller": "callers",
    "PersistentAsyncCaller": "callers",
    "CallOutcome": "worker",
    "AsyncCallsQueue": "calls_queue",
    "SettleCallback": "calls_queue",
}

__all__ = sorted(_EXPORTS)  # noqa: PLE0605 (the names above, kept in one place)

if TYPE_CHECKING:
    from asyncckpt.async_utils.callers import AsyncCaller as AsyncCaller
    from asyncckpt.async_utils.callers import PersistentAsyncCaller as PersistentAsyncCaller
    from asyncckpt.async_utils.callers import TemporalAsyncCaller as TemporalAsyncCaller
    from asyncckpt.async_utils.calls_queue import AsyncCallsQueue as AsyncCallsQueue
    from asyncckpt.async_utils.calls_queue import SettleCallback as SettleCallback
    from asyncckpt.async_utils.request import AsyncRequest as AsyncRequest
    from asyncckpt.async_utils.worker import CallOutcome as CallOutcome


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncckpt.async_utils' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
