"""asyncckpt: asynchronous, atomic checkpointing for PyTorch training.

The training loop is blocked only while the state is staged (copied) into host
buffers; a background process writes it; every rank commits the checkpoint together,
atomically, once all writes succeeded. Committed checkpoints are
``torch.distributed.checkpoint`` directories plus a manifest of sizes and checksums.

Names are imported lazily, so that a background worker that unpickles a function of
this package does not import torch unless that function needs it.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncRequest": "async_utils.request",
    "AsyncCaller": "async_utils.callers",
    "TemporalAsyncCaller": "async_utils.callers",
    "PersistentAsyncCaller": "async_utils.callers",
    "AsyncCallsQueue": "async_utils.calls_queue",
    "AsyncckptError": "errors",
    "RankFailure": "errors",
    "CheckpointException": "errors",
    "CheckpointError": "errors",
    "CorruptCheckpointError": "errors",
    "CallbackError": "errors",
    "CheckpointNotFoundError": "errors",
    "CheckpointPathError": "errors",
    "InvalidArgumentError": "errors",
    "RootInUseError": "errors",
    "UnverifiableCheckpointError": "errors",
    "SaveOptions": "options",
    "save": "saving.api",
    "default_calls_queue": "saving.api",
    "load": "loading.api",
    "verify": "loading.api",
    "read_state_dict": "loading.read",
    "SaveHandle": "saving.handle",
    "SaveTimings": "saving.handle",
    "SaveResult": "saving.handle",
    "CheckpointManager": "manager",
    "PreemptionSave": "preemption",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
