"""The wrapper of ``torch.distributed.destroy_process_group``: functions that run before
the user's process groups are destroyed (the checkpoint layer commits its pending saves
there, :mod:`asyncckpt.saving.pending`).

torch has no hook of its own for it, so asyncckpt wraps the function where torch itself
looks it up (``torch.distributed.distributed_c10d``) and where users import it from
(``torch.distributed``). :func:`install` does it, and ``import asyncckpt`` calls it: a
``from torch.distributed import destroy_process_group`` after ``import asyncckpt``
binds the wrapper, whether torch was imported before asyncckpt or after. One taken
before ``import asyncckpt`` stays torch's own (nothing can change a name already
bound); asyncckpt's commit then reads the outcome from the disk when a collective
breaks (docs/DESIGN.md, "The save phases").

This module imports no torch: the background worker imports the package and must stay
torch-free. When ``torch.distributed`` is not imported yet, :func:`install` registers a
post-import hook (``wrapt.register_post_import_hook``), which wraps the function once
``torch.distributed.distributed_c10d`` has run, before ``torch.distributed`` re-exports
its names.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import wrapt

__all__ = ["install", "call_before_destroy", "installed"]

_log = logging.getLogger("asyncckpt")

#: The module that defines ``destroy_process_group`` (torch's own calls look it up there).
C10D = "torch.distributed.distributed_c10d"

_hooks: list[Callable[[Any], None]] = []
_lock = threading.Lock()
_registered = False


def call_before_destroy(fn: Callable[[Any], None]) -> None:
    """Call ``fn(group)`` at the start of every ``destroy_process_group(group)`` call
    (``group`` as the caller passed it: ``None`` for all groups), before torch's own.
    Once per function (registering it again does nothing). An ``Exception`` of ``fn``
    is logged and the destruction goes on; a ``BaseException`` (Ctrl-C) propagates and
    nothing is destroyed."""
    with _lock:
        if fn not in _hooks:
            _hooks.append(fn)


def install() -> None:
    """Wrap ``destroy_process_group`` now if ``torch.distributed`` is imported, else as
    soon as it is. Idempotent; imports no torch."""
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
    # Calls _wrap at once when the module is already imported.
    wrapt.register_post_import_hook(_wrap, C10D)


def installed(fn: Any) -> bool:
    """True if ``fn`` is asyncckpt's wrapper of ``destroy_process_group``."""
    return getattr(fn, "__asyncckpt_original__", None) is not None


def _wrap(c10d: ModuleType) -> None:
    original = c10d.destroy_process_group
    if installed(original):
        return

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> Any:
        for fn in list(_hooks):
            try:
                fn(group)
            except Exception:  # noqa: BLE001 - the user's destroy goes on
                _log.exception("asyncckpt: a hook before destroy_process_group() raised")
        return original(group)

    destroy_process_group.__asyncckpt_original__ = original  # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]
    # torch.distributed re-exports c10d's names: once it has run (torch imported before
    # asyncckpt), its name is rebound here; while it runs, it re-exports the wrapper.
    package = c10d.__name__.rpartition(".")[0]
    parent = sys.modules.get(package)
    if parent is not None and getattr(parent, "destroy_process_group", None) is original:
        parent.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]
