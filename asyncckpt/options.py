"""SaveOptions: how a save stages and writes, as one frozen value.

Policy is data, as in Orbax's ``CheckpointManagerOptions``: ``asyncckpt.save`` and
``CheckpointManager`` take the same object, and the individual keyword arguments they
also accept are only a shorter way to build it (giving both raises).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from asyncckpt.errors import InvalidArgumentError

__all__ = ["SaveOptions"]


def default_copy_threads() -> int:
    """This process's share of the CPUs, at most 4: the CPUs it may run on
    (``os.sched_getaffinity``) divided by the ranks on this node (``LOCAL_WORLD_SIZE``,
    set by ``torchrun``), unless the affinity already confines the process to fewer
    CPUs than the machine has (a launcher that binds each rank to its own cores).

    Ranks of one node stage at the same moment: on 2 CPUs, 2 ranks with 2 copy threads
    each ran 4 memory-bound threads on 2 cores.
    """
    total = os.cpu_count() or 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = total
    if cpus >= total:
        try:
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        except ValueError:
            local_ranks = 1
        cpus //= max(1, local_ranks)
    return max(1, min(4, cpus))


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    """How saves are staged and written.

    Attributes:
        staging_buffers: host staging buffers that may exist at once, each one copy
            of this rank's state (bytes of host memory = this many x the state). 1
            bounds the extra memory to one copy: a save then waits until the previous
            write no longer reads the buffer; 2 lets a save stage while the previous
            one still writes. It also bounds the saves written and not yet committed:
            a save waits while ``staging_buffers + 1`` earlier ones are (their files
            are on disk meanwhile; see :meth:`asyncckpt.saving.saver.Saver.wait_for_room`).
        copy_threads: threads for the staging copy of CPU tensors, which take 8 MiB
            pieces of ``memmove`` work from a shared list (default:
            :func:`default_copy_threads`, this rank's share of the node's CPUs, at
            most 4; one copy thread runs at about half the
            memory bandwidth of two here, and a thread on a busy core simply takes
            fewer pieces). ``scripts/bench.py`` measures 1 and 2.
        write_threads: threads writing each data file with positioned writes (1: one
            sequential stream).
        plan_cache: reuse the save plan while the state's structure (keys, dtypes,
            shapes, devices) is unchanged on every rank.
        overlap_staging: ``save`` returns right after planning and the copy into the
            host buffer runs in a background thread while training goes on; call
            ``synchronize_staging()`` before the state is mutated (DCP's
            ``AsyncStager.synchronize_staging``).
        drop_page_cache: once a data file is written and fsynced, ask the kernel to
            drop its pages from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``;
            Linux, ignored elsewhere). A checkpoint is rarely read back by the run that
            wrote it, and keeping every save's pages cached made the writer's next
            writes cost 3-4x the CPU (measured here: 10.9 MB written + fsynced into a
            growing page cache, 14.6-15.7 ms of system time against 4.1-4.3 ms with the
            pages dropped, on 2 cores the training's own) and crowds out the
            training's cached files. ``False`` keeps them cached (e.g. to load a save
            right back in the same process without reading the disk).
        staging_memory_limit: the memory guard. Before a new staging buffer is
            allocated, its bytes are compared with the memory available
            (``psutil.virtual_memory().available``); above this fraction of it the
            save raises ``CheckpointError`` on every rank, before anything is
            allocated or written, instead of being killed by the kernel's OOM
            killer. ``None`` turns the check off.

    Raises:
        InvalidArgumentError: (a ``ValueError`` and a ``TypeError``) a count below 1, a
            limit not > 0, or a value of the wrong type.
    """

    staging_buffers: int = 1
    copy_threads: int = dataclasses.field(default_factory=default_copy_threads)
    write_threads: int = 1
    plan_cache: bool = True
    overlap_staging: bool = False
    staging_memory_limit: float | None = 0.9
    drop_page_cache: bool = True

    def __post_init__(self) -> None:
        for name in ("staging_buffers", "copy_threads", "write_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(f"SaveOptions.{name} must be an int >= 1, not {value!r}")
        for name in ("plan_cache", "overlap_staging", "drop_page_cache"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(f"SaveOptions.{name} must be a bool, not {getattr(self, name)!r}")
        limit = self.staging_memory_limit
        if limit is not None and (not isinstance(limit, (int, float)) or isinstance(limit, bool) or not limit > 0):
            raise InvalidArgumentError(f"SaveOptions.staging_memory_limit must be a number > 0 or None, not {limit!r}")

    @classmethod
    def resolve(cls, options: SaveOptions | None, **given: Any) -> SaveOptions:
        """``options``, or one built from the keyword arguments that are not ``None``.

        Raises:
            InvalidArgumentError: both ``options`` and a keyword argument were given (one
                would silently win over the other), or ``options`` is not a ``SaveOptions``.
        """
        given = {k: v for k, v in given.items() if v is not None}
        if options is None:
            return cls(**given)
        if given:
            raise InvalidArgumentError(f"pass either options= or {', '.join(sorted(given))}=, not both")
        if not isinstance(options, SaveOptions):
            raise InvalidArgumentError(f"options must be a SaveOptions, not {type(options).__name__}")
        return options
