"""Scanning a checkpoint root for the ``asyncckpt`` command (``ls``, ``verify``, ``clean``).

Built on :class:`asyncckpt.root.CheckpointRoot` (its :meth:`~asyncckpt.root.CheckpointRoot.scan`
of step directories and leftovers, its :meth:`~asyncckpt.root.CheckpointRoot.latest`);
this module adds what the command shows: sizes, commit times, world sizes, and which
directory ``latest`` names. Torch-free.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncckpt import root as _root
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.format.manifest import MANIFEST_NAME, METADATA_NAME, is_committed, step_metadata
from asyncckpt.io.commit import read_latest
from asyncckpt.io.storage import LOCAL

__all__ = ["CliError", "CheckpointEntry", "PartialDir", "RootScan", "scan_root", "human_bytes", "PARTIAL_DESCRIPTION"]


class CliError(Exception):
    """An expected failure: reported as ``asyncckpt: error: <message>``, exit status 1."""


def human_bytes(n: int | float) -> str:
    """``n`` bytes in binary units: ``"512 B"``, ``"1.5 KiB"``, ``"3.0 GiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _tree_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (symlinks are not followed)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path, followlinks=False):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def _require_dir(path: Path) -> None:
    """Raise :class:`CliError` unless ``path`` is an existing directory."""
    if not path.exists():
        raise CliError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise CliError(f"{path}: not a directory")


@dataclass
class CheckpointEntry:
    """One committed checkpoint directory.

    Attributes:
        name: the directory name (``step_00000100``).
        path: its absolute path.
        step: the step (from the name, else from the manifest), or ``None``.
        bytes: checkpoint bytes as recorded in the manifest (data files and
            ``.metadata``), or the bytes on disk when the manifest is unreadable.
        committed_unix_s: the manifest's modification time (seconds since the epoch).
        world_size: ranks that saved it (from the manifest), or ``None``.
        latest: ``latest`` names this directory.
        error: why the manifest could not be read, else ``None``.
        metrics, metadata, asyncckpt_version: what it was saved with (its manifest;
            :func:`asyncckpt.format.manifest.step_metadata`).
        foreign: in a root, its name is not one a ``CheckpointManager`` writes
            (``step_%08d``): committed by someone else (``asyncckpt.save`` to
            ``root/step_6``, a Lightning ``dirpath``'s ``epoch=0-step=16.ckpt``), so it
            is not among the manager's ``steps()`` and retention never removes it.
    """

    name: str
    path: str
    step: int | None
    bytes: int
    committed_unix_s: float | None
    world_size: int | None
    latest: bool = False
    error: str | None = None
    foreign: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    asyncckpt_version: str | None = None


@dataclass
class PartialDir:
    """A directory of a save that never committed (or of an interrupted delete).

    Attributes:
        name: the directory name.
        path: its absolute path.
        kind: ``"temporary"`` (``.step_N.tmp-*``: a save that failed, was killed, or is
            still writing), ``"deleting"`` (``.step_N.deleting-*``: an interrupted
            removal) or ``"foreign"`` (a directory asyncckpt did not commit: ``step_N``
            without an asyncckpt manifest, a stock ``torch.distributed.checkpoint``
            directory, or any other name such as ``step_6`` or ``step_٤``; asyncckpt
            never leaves such a directory, so ``clean`` never removes it).
        step: the step its name carries (``None`` for a name that is not a step's).
        bytes: bytes of its files.
    """

    name: str
    path: str
    kind: str
    step: int | None
    bytes: int


PARTIAL_DESCRIPTION = {
    "temporary": "unfinished save (failed, killed, or still writing)",
    "deleting": "interrupted removal of a checkpoint",
    "foreign": "foreign: not committed by asyncckpt here (never listed as a step, never removed)",
}


@dataclass
class RootScan:
    """What :func:`scan_root` found.

    Attributes:
        root: the directory scanned (absolute).
        is_checkpoint: ``root`` itself is a checkpoint directory (not a manager root).
        checkpoints: committed checkpoints, by ascending step.
        partial: directories of saves that never committed, by name.
        latest: the directory name ``root/latest`` holds, or ``None``.
    """

    root: str
    is_checkpoint: bool
    checkpoints: list[CheckpointEntry] = field(default_factory=list)
    partial: list[PartialDir] = field(default_factory=list)
    latest: str | None = None

    @property
    def newest_step(self) -> int | None:
        """The step ``CheckpointManager`` resumes from: the newest *save* committed in a
        root (:meth:`asyncckpt.root.CheckpointRoot.latest`: after a rollback, not the
        largest step number); for a directory without ``step_N`` checkpoints (a
        Lightning ``dirpath``) or a single checkpoint, the largest step."""
        if not self.is_checkpoint:
            newest = _root.CheckpointRoot(self.root, create=False).latest()
            if newest is not None:
                return newest
        steps = [c.step for c in self.checkpoints if c.step is not None]
        return max(steps) if steps else None


def _checkpoint_entry(path: Path, step: int | None) -> CheckpointEntry:
    error = None
    world_size = None
    nbytes: int | None = None
    saved_with: dict[str, Any] = {}
    try:
        manifest = LOCAL.read_manifest(path)
    except CorruptCheckpointError as exc:
        error = str(exc)
    else:
        saved_with = step_metadata(manifest)
        total = manifest.get("total_bytes")
        nbytes = total if isinstance(total, int) else sum(e["size"] for e in manifest["files"].values())
        ws = manifest.get("world_size")
        world_size = ws if isinstance(ws, int) else None
        if step is None and isinstance(manifest.get("step"), int):
            step = manifest["step"]
    try:
        committed: float | None = os.stat(path / MANIFEST_NAME, follow_symlinks=False).st_mtime
    except OSError:
        committed = None
    return CheckpointEntry(
        name=path.name,
        path=str(path),
        step=step,
        bytes=_tree_bytes(path) if nbytes is None else nbytes,
        committed_unix_s=committed,
        world_size=world_size,
        error=error,
        metrics=saved_with.get("metrics", {}),
        metadata=saved_with.get("metadata", {}),
        asyncckpt_version=saved_with.get("asyncckpt_version"),
    )


def scan_root(root: str | os.PathLike) -> RootScan:
    """List the checkpoints and leftovers of a ``CheckpointManager`` root.

    Committed checkpoints are ``step_N`` directories with a manifest and ``.metadata``
    (:func:`asyncckpt.format.manifest.is_committed`), and other committed directories
    not hidden (a Lightning ``dirpath``'s ``epoch=0-step=16.ckpt`` directories written by
    ``asyncckpt.lightning``; their step is the one recorded in the manifest, Lightning's
    ``global_step``). Leftovers are ``.step_N.tmp-*``
    and ``.step_N.deleting-*`` directories; any other directory not committed (a
    ``step_N`` without a manifest, ``step_6``, ``logs``) is listed as ``"foreign"``.
    Committed directories whose name is not a manager's step are marked
    ``foreign``. Symlinks are never followed (:meth:`asyncckpt.root.CheckpointRoot.scan`).
    If ``root`` is itself a checkpoint directory (it holds ``.manifest.json`` or
    ``.metadata``), it is the only entry.

    Args:
        root: the directory.

    Returns:
        The scan.

    Raises:
        CliError: ``root`` does not exist or is not a directory.
        OSError: ``root`` cannot be listed.
    """
    path = Path(root).absolute()
    _require_dir(path)
    if (path / MANIFEST_NAME).exists() or (path / METADATA_NAME).exists():
        entry = _checkpoint_entry(path, _root.parse_step_dir(path.name))
        if not is_committed(path) and entry.error is None:
            entry.error = f"{path} is not committed (no {METADATA_NAME})"
        return RootScan(str(path), True, [entry])
    scan = RootScan(str(path), False, latest=read_latest(path))
    for found in _root.CheckpointRoot(path, create=False).scan():
        if found.kind == "committed":
            ckpt = _checkpoint_entry(found.path, found.step)
            ckpt.latest = found.name == scan.latest
            ckpt.foreign = found.step is None
            scan.checkpoints.append(ckpt)
        else:
            kind = "foreign" if found.kind in ("uncommitted", "foreign") else found.kind
            scan.partial.append(PartialDir(found.name, str(found.path), kind, found.step, _tree_bytes(found.path)))
    scan.checkpoints.sort(key=lambda c: (c.step if c.step is not None else -1, c.name))
    return scan


def _require_checkpoint_dir(path: Path) -> None:
    """Raise :class:`CliError` unless ``path`` is a directory with a ``.metadata``
    (with a hint when it is a CheckpointManager root)."""
    _require_dir(path)
    if os.path.lexists(path / METADATA_NAME):
        return
    hint = ""
    try:
        scan = scan_root(path)
        if scan.checkpoints:
            hint = f"; it is a checkpoint root, its newest checkpoint is {scan.checkpoints[-1].path}"
    except (CliError, OSError):
        pass
    raise CliError(f"{path} is not a checkpoint directory (no {METADATA_NAME}){hint}")
