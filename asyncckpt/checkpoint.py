"""The user-facing checkpoint layer, by its former module name.

The layer is split by job: :mod:`asyncckpt.saving` (the save phases and ``save``),
:mod:`asyncckpt.handle` (``SaveHandle``, timings, results), :mod:`asyncckpt.loading`
(``load``, ``verify``), :mod:`asyncckpt.manager` (``CheckpointManager``),
:mod:`asyncckpt.root` (step naming, ``latest``, retention) and
:mod:`asyncckpt.options` (``SaveOptions``). This module re-exports their public names
so that ``import asyncckpt.checkpoint`` keeps working.
"""

from __future__ import annotations

from .handle import SaveCallback, SaveHandle, SaveResult, SaveTimings
from .loading import load, verify
from .manager import CheckpointManager
from .options import SaveOptions
from .saving import default_calls_queue, save

__all__ = ["save", "load", "verify", "SaveHandle", "SaveTimings", "SaveResult", "SaveCallback",
           "CheckpointManager", "SaveOptions", "default_calls_queue"]
