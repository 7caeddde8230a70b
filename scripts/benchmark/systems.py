"""The systems under test: ``torch.save``, ``dcp.save``, ``dcp.async_save`` (thread and
process executors, with and without a reused ``DefaultStager``) and asyncckpt's
``CheckpointManager`` (synchronous, temporal, persistent, overlapped, with ``prepare()``).

Each is a :class:`System`: ``open`` (untimed), ``save`` returning a :class:`Pending`
(staged / committed waits), ``close``."""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

import asyncckpt
import asyncckpt.manager

#: The phases of an asyncckpt save (its ``SaveTimings``), in seconds, and its bytes.
PHASES = ("write_s", "finalize_s", "total_s", "bytes")


class Pending:
    """One save in flight: ``staged()`` blocks until the state may be mutated,
    ``committed()`` until the checkpoint is durable and committed. For asyncckpt,
    ``poll`` is the training loop's ``maybe_finalize()`` and ``done`` the handle's
    ``done()``: the benchmark times ``poll`` while the commit is pending; ``phases()``,
    once committed, the save's own timings (:data:`PHASES`), or ``None``."""

    def __init__(
        self,
        path: Path,
        staged: Callable[[], Any] = lambda: None,
        committed: Callable[[], Any] = lambda: None,
        poll: Callable[[], Any] | None = None,
        done: Callable[[], bool] | None = None,
        phases: Callable[[], dict[str, float] | None] = lambda: None,
    ) -> None:
        self.path, self.staged, self.committed = path, staged, committed
        self.poll, self.done, self.phases = poll, done, phases


def save_phases(handle: Any) -> dict[str, float] | None:
    """A committed asyncckpt save's :data:`PHASES` from its handle: the writer's time
    (``write_s``: checksums, writes and fsyncs of the slowest rank), the commit
    (``finalize_s``), the whole save (``total_s``, from the ``save()`` call) and the
    bytes of its data files; ``None`` where the handle carries no timings."""
    timings = getattr(handle, "timings", None)
    if timings is None and hasattr(handle, "result"):
        result = handle.result(timeout=0)
        timings = getattr(result, "timings", result)
    if timings is None or not all(hasattr(timings, k) for k in PHASES):
        return None
    return {k: float(getattr(timings, k)) for k in PHASES}


def manager_params() -> set[str]:
    """The parameters of ``CheckpointManager`` (a knob the benchmark cannot pass is skipped)."""
    return set(inspect.signature(asyncckpt.CheckpointManager).parameters)


def param_default(name: str) -> Any:
    """``CheckpointManager``'s default for ``name`` (``inspect.Parameter.empty`` if none)."""
    p = inspect.signature(asyncckpt.CheckpointManager).parameters.get(name)
    return inspect.Parameter.empty if p is None else p.default


def terminate_dcp_daemon() -> None:
    """Stop DCP's process-executor daemon (a module global) so that the next system
    starts without it and its memory is freed."""
    import torch.distributed.checkpoint._async_process_executor as ape

    proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
    if proc is None:
        return
    with contextlib.suppress(Exception):
        proc._send(ape._CheckpointSaveProcessControlOpts.TERMINATE)
        proc._save_process.join(timeout=10)
    if proc._save_process.is_alive():
        proc._save_process.terminate()
        proc._save_process.join(timeout=10)
    ape._CHECKPOINT_PROCESS = None


class System:
    """A system under test: ``open`` (untimed set-up), ``save`` (one save, timed by the
    harness through its :class:`Pending`), ``close``."""

    name = ""
    key = ""
    loadable = False  # its last checkpoint is kept for the load measurements

    def open(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def save(self, i: int, sd: Any) -> Pending:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TorchSave(System):
    name, key, loadable = "torch.save (sync)", "torch.save", True

    def save(self, i: int, sd: Any) -> Pending:
        path = self.root / f"ckpt_{i}.pt"
        with open(path, "wb") as f:  # committed = written and fsynced, as DCP does by default
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        return Pending(path)


class DcpSave(System):
    name, key, loadable = "dcp.save (sync)", "dcp", True

    def save(self, i: int, sd: Any) -> Pending:
        path = self.root / f"ckpt_{i}"
        dcp.save(sd, checkpoint_id=str(path))
        return Pending(path)


class DcpAsync(System):
    """dcp.async_save (thread or process executor), with DCP's default staging or a
    DefaultStager; with ``fresh_stager``, a new DefaultStager per save, closed once the
    save is written (the way a stager is used where DCP closes the one it is given:
    torch 2.11's reused stager failed its second save with ``KeyError: <class 'type'>``,
    the error of a closed DefaultStager, issue 35)."""

    def __init__(self, process: bool, stager: bool, fresh_stager: bool = False) -> None:
        self.process, self.use_stager, self.fresh_stager = process, stager or fresh_stager, fresh_stager
        self.name = f"dcp.async_save {'process' if process else 'thread'}" + (
            " + DefaultStager per save" if fresh_stager else " + DefaultStager" if stager else ""
        )
        self.key = f"dcp-async-{'process' if process else 'thread'}" + (
            "-stager-fresh" if fresh_stager else "-stager" if stager else ""
        )
        self.stager: Any = None
        self.fresh: list[Any] = []  # the stagers per save not closed yet

    def _new_stager(self) -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # The best options on a CPU-only host: pinned memory and non-blocking copies
        # need an accelerator; shared memory hands the staged tensors to the
        # process executor without a copy; the copy runs in the stager's thread and
        # its buffers are cached across saves (same state dict objects).
        return DefaultStager(
            StagingOptions(
                use_pinned_memory=torch.cuda.is_available(),
                use_shared_memory=True,
                use_async_staging=True,
                use_non_blocking_copy=torch.cuda.is_available(),
            )
        )

    def open(self, root: Path) -> None:
        super().open(root)
        if self.use_stager and not self.fresh_stager:
            self.stager = self._new_stager()

    def save(self, i: int, sd: Any) -> Pending:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        path = self.root / f"ckpt_{i}"
        kind = AsyncCheckpointerType.PROCESS if self.process else AsyncCheckpointerType.THREAD
        stager = self.stager
        if self.fresh_stager:
            stager = self._new_stager()
            self.fresh.append(stager)
        r = dcp.async_save(sd, checkpoint_id=str(path), async_checkpointer_type=kind, async_stager=stager)
        if isinstance(r, AsyncSaveResponse):  # asynchronous staging
            upload = r.upload_completion
            if not self.fresh_stager:
                return Pending(path, r.staging_completion.result, upload.result)

            def committed() -> Any:
                try:
                    return upload.result()
                finally:
                    self.fresh.remove(stager)
                    stager.close()

            return Pending(path, r.staging_completion.result, committed)
        return Pending(path, committed=r.result)

    def close(self) -> None:
        for stager in [self.stager, *self.fresh]:
            if stager is not None:
                stager.close()
        self.stager, self.fresh = None, []
        if self.process and not SHARE_DCP_DAEMON:
            terminate_dcp_daemon()


class Asyncckpt(System):
    """asyncckpt through ``CheckpointManager`` (keep_last=None: old steps are removed by
    the benchmark, outside the timed region)."""

    def __init__(
        self, name: str, key: str, *, sync: bool = False, overlap: bool = False, loadable: bool = False, **kwargs: Any
    ) -> None:
        self.name, self.key, self.sync, self.overlap, self.loadable = name, key, sync, overlap, loadable
        self.kwargs = dict(kwargs)
        if overlap:
            self.kwargs["overlap_staging"] = True
        self.mgr: Any = None
        #: a state to ``CheckpointManager.prepare`` at open (untimed), or None
        self.prepare_sd: Any = None

    def missing(self) -> list[str]:
        return sorted(set(self.kwargs) - manager_params())

    def open(self, root: Path) -> None:
        super().open(root)
        self.mgr = asyncckpt.CheckpointManager(root, **self.kwargs)
        if self.prepare_sd is not None:
            self.mgr.prepare(self.prepare_sd)

    def save(self, i: int, sd: Any) -> Pending:
        mgr = self.mgr
        if self.sync:
            handle = mgr.save(i, sd, async_op=False)
            return Pending(mgr.step_dir(i), phases=lambda: save_phases(handle))
        handle = mgr.save(i, sd)
        staged = getattr(mgr, "synchronize_staging", None) or handle.synchronize_staging
        return Pending(
            mgr.step_dir(i),
            staged if self.overlap else (lambda: None),
            handle.wait,
            poll=mgr.maybe_finalize,
            done=handle.done,
            phases=lambda: save_phases(handle),
        )

    def close(self) -> None:
        if self.mgr is not None:
            self.mgr.close()
            self.mgr = None


def all_systems() -> list[System]:
    """A fresh object of every system, in report order."""
    return [
        TorchSave(),
        DcpSave(),
        DcpAsync(process=False, stager=False),
        DcpAsync(process=True, stager=False),
        DcpAsync(process=False, stager=True),
        DcpAsync(process=True, stager=True),
        DcpAsync(process=False, stager=True, fresh_stager=True),
        Asyncckpt("asyncckpt sync", "ack-sync", sync=True, persistent=False),
        Asyncckpt("asyncckpt temporal", "ack-temporal", persistent=False),
        Asyncckpt("asyncckpt persistent", "ack-persistent", loadable=True),
        Asyncckpt("asyncckpt persistent overlapped", "ack-overlap", overlap=True),
        Asyncckpt("asyncckpt persistent + prepare()", "ack-prepare"),
    ]


SYSTEM_KEYS = [s.key for s in all_systems()]
#: the systems a workload runs unless --systems names them: every one on the synthetic
#: states (prepare() is among the techniques there; a DefaultStager per save only on
#: request), asyncckpt and DCP's best asynchronous save on the LLM states
#: (llm.LLM_SYSTEMS; on a GPU llm.LLM_GPU_SYSTEMS) and on the record-size workloads
#: (workloads.SIZES_SYSTEMS).
DEFAULT_SYSTEM_KEYS = [k for k in SYSTEM_KEYS if k not in ("ack-prepare", "dcp-async-thread-stager-fresh")]
#: Keep DCP's process-executor daemon between systems (``--share-dcp-daemon``).
SHARE_DCP_DAEMON = False
