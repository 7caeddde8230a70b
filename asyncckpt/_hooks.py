"""Timings hooks: a process-wide list of callables that receive each save's and load's
timings record (for metrics systems: TensorBoard, Prometheus, W&B).

In the style of PyTorch's module hooks (``Module.register_forward_hook``): adding one
returns a :class:`torch.utils.hooks.RemovableHandle`; ``handle.remove()`` takes it off.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.utils.hooks import RemovableHandle

__all__ = ["TimingsHook", "add_timings_hook", "call_timings_hooks"]

_log = logging.getLogger("asyncckpt")

#: A timings hook: ``hook(record, step, path)`` with ``record`` a ``SaveTimings`` or a
#: ``LoadTimings``, ``step`` the step (``CheckpointManager``; else ``None``) and
#: ``path`` the checkpoint directory.
TimingsHook = Callable[[Any, "int | None", Path], None]

#: An OrderedDict, as PyTorch's module hooks: RemovableHandle holds a weak reference to it.
_hooks: collections.OrderedDict[int, TimingsHook] = collections.OrderedDict()
_lock = threading.Lock()


def add_timings_hook(hook: TimingsHook) -> RemovableHandle:
    """Call ``hook(record, step, path)`` after every committed save and every load of
    this process, on every rank (each rank's own record; filter on the rank to report
    once).

    ``record`` is the save's :class:`asyncckpt.SaveTimings` (called where the save
    settles: the queue's finalizer thread for an async save, so the hook must be
    thread-safe and quick; before the completion callback) or the load's
    :class:`asyncckpt.LoadTimings` (in the loading thread). Failed saves and loads
    call no hook. An exception raised by a hook is logged (logger ``"asyncckpt"``, at
    ERROR) and never fails the save or the load.

    Returns:
        A ``torch.utils.hooks.RemovableHandle``: ``handle.remove()`` removes the hook.
    """
    with _lock:
        handle = RemovableHandle(_hooks)
        _hooks[handle.id] = hook
    return handle


def call_timings_hooks(record: Any, step: int | None, path: Path) -> None:
    """Call every hook with ``record``; a hook that raises is logged, never raised."""
    if not _hooks:  # the common case: nothing allocated
        return
    with _lock:
        hooks = list(_hooks.values())
    for hook in hooks:
        try:
            hook(record, step, path)
        except Exception:  # noqa: BLE001 - a metrics hook never fails a save or a load
            _log.exception("asyncckpt: the timings hook %r raised (for %s); ignored", hook, path)
