"""asyncckpt: asynchronous, atomic checkpointing for PyTorch training.

The training loop is blocked only while the state is staged (copied) into host
buffers; a background process writes it; every rank commits the checkpoint together,
atomically, once all writes succeeded. Committed checkpoints are
``torch.distributed.checkpoint`` directories plus a manifest of sizes and checksums.

Names are imported lazily, so that a background worker that unpickles a function of
this package does not import torch unless that function needs it.

``import asyncckpt`` does one thing besides: it wraps
``torch.distributed.destroy_process_group`` (now if ``torch.distributed`` is imported,
else as soon as it is; :mod:`asyncckpt._destroy`), so that pending saves commit before
the process groups they use are destroyed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from asyncckpt import _destroy

__version__ = "0.1.0"

_destroy.install()

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
    "InvalidStateError": "errors",
    "CheckpointTimeoutError": "errors",
    "RootInUseError": "errors",
    "LocalTierInUseError": "errors",
    "SaveDeadlockError": "errors",
    "UnverifiableCheckpointError": "errors",
    "RemoteStorageError": "errors",
    "UploadError": "errors",
    "SaveOptions": "options",
    "LatestN": "policy",
    "EveryNSteps": "policy",
    "EveryNSeconds": "policy",
    "BestN": "policy",
    "AnyOf": "policy",
    "SaveInterval": "policy",
    "save": "saving.api",
    "default_calls_queue": "saving.api",
    "load": "loading.api",
    "verify": "loading.api",
    "read_metadata": "loading.api",
    "LoadTimings": "loading.api",
    "add_timings_hook": "_hooks",
    "read_state_dict": "loading.read",
    "export_safetensors": "export",
    "SaveHandle": "saving.handle",
    "SaveTimings": "saving.handle",
    "SaveResult": "saving.handle",
    "CheckpointManager": "manager",
    "LocalTier": "io.local_tier",
    "RestoreResult": "replication",
    "PreemptionSave": "preemption",
    "UploadResult": "upload",
    "UploadSkipped": "upload",
    "UploadWarning": "upload",
}

__all__ = sorted(_EXPORTS)  # noqa: PLE0605 (the names above, kept in one place)

if TYPE_CHECKING:
    # What __getattr__ returns, for type checkers and editors (without these, every
    # `asyncckpt.X` is `Any` to mypy). tests/test_checks.py keeps this list equal to _EXPORTS.
    from asyncckpt._hooks import add_timings_hook as add_timings_hook
    from asyncckpt.async_utils.callers import AsyncCaller as AsyncCaller
    from asyncckpt.async_utils.callers import PersistentAsyncCaller as PersistentAsyncCaller
    from asyncckpt.async_utils.callers import TemporalAsyncCaller as TemporalAsyncCaller
    from asyncckpt.async_utils.calls_queue import AsyncCallsQueue as AsyncCallsQueue
    from asyncckpt.async_utils.request import AsyncRequest as AsyncRequest
    from asyncckpt.errors import AsyncckptError as AsyncckptError
    from asyncckpt.errors import CallbackError as CallbackError
    from asyncckpt.errors import CheckpointError as CheckpointError
    from asyncckpt.errors import CheckpointException as CheckpointException
    from asyncckpt.errors import CheckpointNotFoundError as CheckpointNotFoundError
    from asyncckpt.errors import CheckpointPathError as CheckpointPathError
    from asyncckpt.errors import CheckpointTimeoutError as CheckpointTimeoutError
    from asyncckpt.errors import CorruptCheckpointError as CorruptCheckpointError
    from asyncckpt.errors import InvalidArgumentError as InvalidArgumentError
    from asyncckpt.errors import InvalidStateError as InvalidStateError
    from asyncckpt.errors import LocalTierInUseError as LocalTierInUseError
    from asyncckpt.errors import RankFailure as RankFailure
    from asyncckpt.errors import RemoteStorageError as RemoteStorageError
    from asyncckpt.errors import RootInUseError as RootInUseError
    from asyncckpt.errors import SaveDeadlockError as SaveDeadlockError
    from asyncckpt.errors import UnverifiableCheckpointError as UnverifiableCheckpointError
    from asyncckpt.errors import UploadError as UploadError
    from asyncckpt.export import export_safetensors as export_safetensors
    from asyncckpt.io.local_tier import LocalTier as LocalTier
    from asyncckpt.loading.api import LoadTimings as LoadTimings
    from asyncckpt.loading.api import load as load
    from asyncckpt.loading.api import read_metadata as read_metadata
    from asyncckpt.loading.api import verify as verify
    from asyncckpt.loading.read import read_state_dict as read_state_dict
    from asyncckpt.manager import CheckpointManager as CheckpointManager
    from asyncckpt.options import SaveOptions as SaveOptions
    from asyncckpt.policy import AnyOf as AnyOf
    from asyncckpt.policy import BestN as BestN
    from asyncckpt.policy import EveryNSeconds as EveryNSeconds
    from asyncckpt.policy import EveryNSteps as EveryNSteps
    from asyncckpt.policy import LatestN as LatestN
    from asyncckpt.policy import SaveInterval as SaveInterval
    from asyncckpt.preemption import PreemptionSave as PreemptionSave
    from asyncckpt.replication import RestoreResult as RestoreResult
    from asyncckpt.saving.api import default_calls_queue as default_calls_queue
    from asyncckpt.saving.api import save as save
    from asyncckpt.saving.handle import SaveHandle as SaveHandle
    from asyncckpt.saving.handle import SaveResult as SaveResult
    from asyncckpt.saving.handle import SaveTimings as SaveTimings
    from asyncckpt.upload import UploadResult as UploadResult
    from asyncckpt.upload import UploadSkipped as UploadSkipped
    from asyncckpt.upload import UploadWarning as UploadWarning


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
