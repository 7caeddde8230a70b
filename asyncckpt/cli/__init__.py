"""The ``asyncckpt`` command-line tool: list, inspect, verify, convert and clean checkpoints.

Usage (``asyncckpt SUBCOMMAND --help`` for each)::

    asyncckpt ls ROOT                  checkpoints of a CheckpointManager root (or a Lightning
                                       dirpath), ``latest``, leftovers
    asyncckpt inspect CKPT             every entry: kind, dtype, shape, bytes, data file(s)
    asyncckpt verify CKPT [CKPT ...]   sizes and CRC-32s against the manifest
    asyncckpt convert CKPT OUT.pt      one ``torch.save`` file, loaded safely
    asyncckpt clean ROOT [--yes]       remove directories of saves that never committed

Every subcommand takes ``--json`` (one JSON document on stdout, also on error:
``{"error": ...}``). Exit status: 0 success, 1 a problem was found (a checkpoint failed
verification, a path is missing, a checkpoint is corrupt), 2 usage error, 3 (``verify``)
nothing failed but some checkpoint has no manifest and could not be verified (a stock
``torch.distributed.checkpoint`` directory). Errors are printed to stderr as
``asyncckpt: error: ...``.

The tool is a user of the public API and the storage modules (DESIGN.md, "Layers"):
``ls``, ``verify`` and ``clean`` do not import torch; ``inspect`` reads ``.metadata``
with the restricted unpickler of :mod:`asyncckpt.loading.reader`; ``convert`` reads with
:func:`asyncckpt.read_state_dict` (path checks, CRC verification when the checkpoint
has a manifest, ``weights_only`` values).
"""

from __future__ import annotations

import argparse
import datetime
import errno
import json
import os
import secrets
import shutil
import stat
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence, TextIO

from asyncckpt import __version__
from asyncckpt import root as _root
from asyncckpt.errors import AsyncckptError, CheckpointError, CorruptCheckpointError
from asyncckpt.format import manifest as _commit

__all__ = [
    "main",
    "build_parser",
    "CliError",
    "CheckpointEntry",
    "PartialDir",
    "RootScan",
    "scan_root",
    "inspect_checkpoint",
    "convert_to_torch_save",
    "remove_partial",
    "human_bytes",
    "PROGRESS_MIN_BYTES",
]

PROG = "asyncckpt"

#: Exit status of ``verify`` when nothing failed but some checkpoint had no manifest.
EXIT_UNVERIFIABLE = 3

#: ``verify`` shows a progress bar by default for checkpoints larger than this
#: (bytes), when stderr is a terminal.
PROGRESS_MIN_BYTES = 256 << 20

# The directory names of ``CheckpointManager`` (asyncckpt/root.py is torch-free).
_STEP_RE = _root.STEP_DIR_RE
_LEFTOVER_RE = _root.LEFTOVER_RE


class CliError(Exception):
    """An expected failure: reported as ``asyncckpt: error: <message>``, exit status 1."""


# ----------------------------------------------------------------------------- helpers
def human_bytes(n: int | float) -> str:
    """``n`` bytes in binary units: ``"512 B"``, ``"1.5 KiB"``, ``"3.0 GiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.datetime.fromtimestamp(ts, tz=datetime.timezone.utc).astimezone().isoformat(timespec="seconds")


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


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


# ----------------------------------------------------------------------------- scanning a root
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
    """

    name: str
    path: str
    step: int | None
    bytes: int
    committed_unix_s: float | None
    world_size: int | None
    latest: bool = False
    error: str | None = None


@dataclass
class PartialDir:
    """A directory of a save that never committed (or of an interrupted delete).

    Attributes:
        name: the directory name.
        path: its absolute path.
        kind: ``"temporary"`` (``.step_N.tmp-*``: a save that failed, was killed, or is
            still writing), ``"deleting"`` (``.step_N.deleting-*``: an interrupted
            removal) or ``"foreign"`` (``step_N`` without an asyncckpt manifest: a
            stock ``torch.distributed.checkpoint`` directory, or not a checkpoint;
            asyncckpt never leaves such a directory, so ``clean`` never removes it).
        step: the step its name carries.
        bytes: bytes of its files.
    """

    name: str
    path: str
    kind: str
    step: int
    bytes: int


_PARTIAL_DESCRIPTION = {
    "temporary": "unfinished save (failed, killed, or still writing)",
    "deleting": "interrupted removal of a checkpoint",
    "foreign": "step directory without an asyncckpt manifest (never removed)",
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
            newest = _root.CheckpointRoot(self.root).latest()
            if newest is not None:
                return newest
        steps = [c.step for c in self.checkpoints if c.step is not None]
        return max(steps) if steps else None


def _checkpoint_entry(path: Path, step: int | None) -> CheckpointEntry:
    error = None
    world_size = None
    nbytes: int | None = None
    try:
        manifest = _commit.read_manifest(path)
    except CorruptCheckpointError as exc:
        error = str(exc)
    else:
        total = manifest.get("total_bytes")
        nbytes = total if isinstance(total, int) else sum(e["size"] for e in manifest["files"].values())
        ws = manifest.get("world_size")
        world_size = ws if isinstance(ws, int) else None
        if step is None and isinstance(manifest.get("step"), int):
            step = manifest["step"]
    try:
        committed: float | None = os.stat(path / _commit.MANIFEST_NAME, follow_symlinks=False).st_mtime
    except OSError:
        committed = None
    return CheckpointEntry(name=path.name, path=str(path), step=step,
                           bytes=_tree_bytes(path) if nbytes is None else nbytes,
                           committed_unix_s=committed, world_size=world_size, error=error)


def scan_root(root: str | os.PathLike) -> RootScan:
    """List the checkpoints and leftovers of a ``CheckpointManager`` root.

    Committed checkpoints are ``step_N`` directories with a manifest and ``.metadata``
    (:func:`asyncckpt.format.manifest.is_committed`), and other committed directories
    not hidden (a Lightning ``dirpath``'s ``epoch=0-step=16.ckpt`` directories written by
    ``asyncckpt.lightning``; their step is the one recorded in the manifest, Lightning's
    ``global_step``). Leftovers are ``.step_N.tmp-*``
    and ``.step_N.deleting-*`` directories and ``step_N`` directories that are not
    committed. Symlinks are never followed. If ``root`` is itself a checkpoint
    directory (it holds ``.manifest.json`` or ``.metadata``), it is the only entry.

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
    if (path / _commit.MANIFEST_NAME).exists() or (path / _commit.METADATA_NAME).exists():
        m = _STEP_RE.match(path.name)
        entry = _checkpoint_entry(path, int(m.group(1)) if m else None)
        if not _commit.is_committed(path) and entry.error is None:
            entry.error = f"{path} is not committed (no {_commit.METADATA_NAME})"
        return RootScan(str(path), True, [entry])
    scan = RootScan(str(path), False, latest=_commit.read_latest(path))
    with os.scandir(path) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        sub = Path(entry.path)
        m = _STEP_RE.match(entry.name)
        if m:
            if _commit.is_committed(sub):
                ckpt = _checkpoint_entry(sub, int(m.group(1)))
                ckpt.latest = entry.name == scan.latest
                scan.checkpoints.append(ckpt)
            else:
                scan.partial.append(PartialDir(entry.name, str(sub), "foreign", int(m.group(1)),
                                               _tree_bytes(sub)))
            continue
        m = _LEFTOVER_RE.match(entry.name)
        if m:
            kind = "temporary" if ".tmp-" in entry.name else "deleting"
            scan.partial.append(PartialDir(entry.name, str(sub), kind, int(m.group(1)), _tree_bytes(sub)))
        elif not entry.name.startswith(".") and _commit.is_committed(sub):
            # e.g. Lightning's epoch=0-step=16.ckpt (asyncckpt.lightning): the step from the manifest
            ckpt = _checkpoint_entry(sub, None)
            ckpt.latest = entry.name == scan.latest
            scan.checkpoints.append(ckpt)
    scan.checkpoints.sort(key=lambda c: (c.step if c.step is not None else -1, c.name))
    return scan


def _require_checkpoint_dir(path: Path) -> None:
    """Raise :class:`CliError` unless ``path`` is a directory with a ``.metadata``
    (with a hint when it is a CheckpointManager root)."""
    _require_dir(path)
    if os.path.lexists(path / _commit.METADATA_NAME):
        return
    hint = ""
    try:
        scan = scan_root(path)
        if scan.checkpoints:
            hint = f"; it is a checkpoint root, its newest checkpoint is {scan.checkpoints[-1].path}"
    except (CliError, OSError):
        pass
    raise CliError(f"{path} is not a checkpoint directory (no {_commit.METADATA_NAME}){hint}")


# ----------------------------------------------------------------------------- inspect
def inspect_checkpoint(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """Describe every entry of a checkpoint, from its ``.metadata`` (read safely).

    ``.metadata`` is read with :func:`asyncckpt.loading.reader.read_metadata` (an
    allowlist of DCP metadata classes, every data file checked). The manifest is
    optional (a stock DCP directory has none).

    Args:
        checkpoint_dir: a checkpoint directory.

    Returns:
        A JSON-able dict: ``path``, ``committed`` (a manifest is present), ``step`` and
        ``world_size`` (from the manifest, else ``None``), ``entries`` (each ``fqn``,
        ``path`` (nested keys: ``int`` for list indices and for dict keys saved as
        ``int``, as :func:`asyncckpt.read_state_dict` gives them), ``kind`` (``"tensor"`` or ``"bytes"``), ``dtype``,
        ``shape`` (global), ``bytes`` (tensor: ``numel * itemsize``; bytes: the pickled
        size), ``stored_bytes`` (on disk, with framing), ``chunks``, ``files``: a list of
        ``{"file", "offset", "length"}``) and ``totals``.

    Raises:
        CliError: the directory is missing, or holds no ``.metadata``.
        CorruptCheckpointError: ``.metadata`` or the manifest is unreadable, holds a
            disallowed global, or names a path outside the directory.
    """
    path = Path(checkpoint_dir).absolute()
    _require_checkpoint_dir(path)
    manifest: dict[str, Any] | None = None
    if os.path.lexists(path / _commit.MANIFEST_NAME):
        manifest = _commit.read_manifest(path)

    from torch.distributed.checkpoint.metadata import (
        TensorStorageMetadata,  # torch only once needed
    )

    from asyncckpt.loading.read import manifest_int_keys, typed_entry_paths
    from asyncckpt.loading.reader import read_metadata

    metadata = read_metadata(path)
    where = str(path / _commit.METADATA_NAME)
    paths = typed_entry_paths(metadata, manifest_int_keys(manifest, str(path / _commit.MANIFEST_NAME)), where)

    storage: dict[str, list[dict[str, Any]]] = {}
    for index, info in metadata.storage_data.items():
        storage.setdefault(index.fqn, []).append(
            {"file": info.relative_path, "offset": info.offset, "length": info.length})
    entries = []
    for fqn, md in metadata.state_dict_metadata.items():
        records = sorted(storage.get(fqn, []), key=lambda r: (r["file"], r["offset"]))
        stored = sum(r["length"] for r in records)
        if isinstance(md, TensorStorageMetadata):
            dtype = md.properties.dtype
            shape = [int(s) for s in md.size]
            numel = 1
            for s in shape:
                numel *= s
            entry = {"fqn": fqn, "kind": "tensor", "dtype": str(dtype).replace("torch.", "", 1),
                     "shape": shape, "bytes": numel * dtype.itemsize, "chunks": len(md.chunks)}
        else:
            entry = {"fqn": fqn, "kind": "bytes", "dtype": None, "shape": None, "bytes": stored,
                     "chunks": len(records)}
        entry["path"] = list(paths[fqn][0])
        entry["stored_bytes"] = stored
        entry["files"] = records
        entries.append(entry)

    files = sorted({info.relative_path for info in metadata.storage_data.values()})
    file_sizes = {}
    for name in files:
        if manifest is not None and name in manifest["files"]:
            file_sizes[name] = manifest["files"][name]["size"]
        else:
            file_sizes[name] = os.stat(path / name, follow_symlinks=False).st_size
    tensors = [e for e in entries if e["kind"] == "tensor"]

    def manifest_int(key: str) -> int | None:
        value = manifest.get(key) if manifest is not None else None
        return value if type(value) is int else None

    return {
        "path": str(path),
        "committed": manifest is not None and _commit.is_committed(path),
        "step": manifest_int("step"),
        "world_size": manifest_int("world_size"),
        "entries": entries,
        "totals": {
            "entries": len(entries),
            "tensors": len(tensors),
            "values": len(entries) - len(tensors),
            "tensor_bytes": sum(e["bytes"] for e in tensors),
            "value_bytes": sum(e["bytes"] for e in entries if e["kind"] != "tensor"),
            "files": len(files),
            "file_bytes": sum(file_sizes.values()),
            "file_sizes": file_sizes,
            "total_bytes": manifest_int("total_bytes"),
        },
    }


# ----------------------------------------------------------------------------- verify
def _verify_targets(arg: str) -> list[Path]:
    """The checkpoints named by one ``verify`` argument: itself, or every committed
    checkpoint of a manager root."""
    path = Path(arg).absolute()
    _require_dir(path)
    if _commit.is_committed(path):
        return [path]
    try:
        scan = scan_root(path)
    except (CliError, OSError):
        return [path]
    if not scan.is_checkpoint and scan.checkpoints:
        return [Path(c.path) for c in scan.checkpoints]
    return [path]


def _verify_one(path: Path, progress: bool | None) -> dict[str, Any]:
    result: dict[str, Any] = {"path": str(path), "ok": False, "files": None, "bytes": None,
                              "error": None, "file": None, "verifiable": True}
    if _root.is_stock_dcp(path):  # not ours, nothing wrong with it known: its own exit status
        result.update(verifiable=False, error="no manifest: not verifiable (a stock "
                                              "torch.distributed.checkpoint directory has no checksums)")
        return result
    try:
        manifest = _commit.read_manifest(path)
        total = sum(e["size"] for e in manifest["files"].values())
        show = progress if progress is not None else (total > PROGRESS_MIN_BYTES and sys.stderr.isatty())
        if show:
            from tqdm import tqdm

            with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=path.name,
                      file=sys.stderr, leave=False, disable=False, mininterval=0.2) as bar:
                manifest = _commit.verify_checkpoint(path, on_bytes=bar.update)
        else:
            manifest = _commit.verify_checkpoint(path)
    except CorruptCheckpointError as exc:
        result["error"] = str(exc)
        result["file"] = exc.path
        return result
    result.update(ok=True, files=len(manifest["files"]),
                  bytes=sum(e["size"] for e in manifest["files"].values()))
    return result


# ----------------------------------------------------------------------------- convert
def convert_to_torch_save(checkpoint_dir: str | os.PathLike, out: str | os.PathLike, *, force: bool = False,
                          allow_pickle: bool = False, verify: bool = True) -> dict[str, Any]:
    """Write a checkpoint as one ``torch.save`` file, like DCP's ``dcp_to_torch_save``.

    The state_dict is read with :func:`asyncckpt.read_state_dict` (nested as saved,
    rebuilt from the metadata as ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``
    does): ``.metadata`` through the restricted unpickler, every path checked, the
    CRC-32s verified (``verify``) when the checkpoint has a manifest, non-tensor values
    loaded with ``weights_only=True`` unless ``allow_pickle``. A stock
    ``torch.distributed.checkpoint`` directory (no manifest) is converted without
    checksum verification; ``warnings`` says so. The file is written to a temporary
    name beside ``out``, fsynced, and renamed (without ``force``: linked, so an
    existing ``out`` is never replaced).

    Args:
        checkpoint_dir: a committed checkpoint directory, or a stock DCP directory.
        out: the file to write.
        force: replace ``out`` if it exists.
        allow_pickle: unpickle non-tensor values of any class (trusted checkpoints only).
        verify: check sizes and CRC-32s before loading.

    Returns:
        ``{"source", "output", "entries", "bytes", "verified", "warnings"}`` (bytes: the
        size of ``out``; verified: whether the checksums were checked; warnings: what
        to tell the user, e.g. that a stock DCP checkpoint's checksums were not verified).

    Raises:
        CliError: ``out`` exists (without ``force``) or is a directory; its directory
            is missing; the checkpoint directory is missing.
        CorruptCheckpointError: the checkpoint is corrupt, or names paths outside its
            directory.
        CheckpointError: a non-tensor value needs ``allow_pickle``.
        OSError: writing ``out`` failed (nothing is left behind).
    """
    src = Path(checkpoint_dir).absolute()
    dst = Path(out).absolute()
    _require_checkpoint_dir(src)
    if dst.is_dir():
        raise CliError(f"{dst} is a directory")
    if os.path.lexists(dst) and not force:
        raise CliError(f"{dst} exists; pass --force to overwrite it")
    if not dst.parent.is_dir():
        raise CliError(f"{dst.parent}: no such directory")

    import warnings

    import torch  # only once needed: ls / verify / clean and argument errors stay fast

    from asyncckpt import read_state_dict  # the public API
    from asyncckpt.loading.reader import read_metadata

    entries = len(read_metadata(src).state_dict_metadata)  # an unsafe .metadata is named as such first
    has_manifest = os.path.lexists(src / _commit.MANIFEST_NAME)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state_dict = read_state_dict(src, verify=verify, allow_pickle=allow_pickle)
    except CorruptCheckpointError:
        raise
    except CheckpointError as exc:
        if allow_pickle or "allow_pickle=True" not in str(exc):
            raise
        raise CheckpointError(f"{exc} (here: pass --allow-pickle)") from None
    notes = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]

    tmp = dst.parent / f".{dst.name}.tmp-{secrets.token_hex(8)}"
    try:
        with open(tmp, "xb") as f:
            torch.save(state_dict, f)
            f.flush()
            os.fsync(f.fileno())
        if force:
            os.replace(tmp, dst)
        else:
            try:
                os.link(tmp, dst)  # fails if dst appeared meanwhile: never replaces a file
            except FileExistsError:
                raise CliError(f"{dst} exists; pass --force to overwrite it") from None
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                    raise
                if os.path.lexists(dst):  # no hard links here: check, then rename
                    raise CliError(f"{dst} exists; pass --force to overwrite it") from None
                os.replace(tmp, dst)
        from asyncckpt.io.writer import fsync_directory

        fsync_directory(str(dst.parent))
    finally:
        tmp.unlink(missing_ok=True)
    return {"source": str(src), "output": str(dst), "entries": entries, "bytes": dst.stat().st_size,
            "verified": verify and has_manifest, "warnings": notes}


# ----------------------------------------------------------------------------- clean
def remove_partial(partial: PartialDir) -> str:
    """Remove one hidden leftover of asyncckpt (a save that never committed, or an
    interrupted removal); a ``"foreign"`` directory is never removed.

    Args:
        partial: an entry of :attr:`RootScan.partial`.

    Returns:
        ``"removed"`` or ``"kept: <reason>"``.

    Raises:
        OSError: the removal failed.
    """
    path = Path(partial.path)
    if partial.kind == "foreign":
        return "kept: not an asyncckpt leftover"
    if not path.is_dir() or path.is_symlink():
        return "kept: no longer a directory"
    shutil.rmtree(path)
    return "removed"


# ----------------------------------------------------------------------------- commands
def _emit_json(doc: Any, out: TextIO) -> None:
    json.dump(doc, out, indent=2)
    out.write("\n")


def _cmd_ls(args: argparse.Namespace, out: TextIO) -> int:
    scan = scan_root(args.root)
    latest_committed = any(c.latest for c in scan.checkpoints)
    if args.json:
        _emit_json({
            "root": scan.root,
            "is_checkpoint": scan.is_checkpoint,
            "latest": scan.latest,
            "latest_is_committed": latest_committed,
            "newest_step": scan.newest_step,
            "checkpoints": [{**asdict(c), "size": human_bytes(c.bytes), "committed_at": _iso(c.committed_unix_s)}
                            for c in scan.checkpoints],
            "partial": [{**asdict(p), "size": human_bytes(p.bytes)} for p in scan.partial],
        }, out)
        return 0
    if scan.is_checkpoint:
        print(f"{scan.root} is a checkpoint directory", file=out)
    else:
        print(f"root: {scan.root}", file=out)
    if scan.checkpoints:
        newest = scan.newest_step
        rows = []
        for c in scan.checkpoints:
            notes = []
            if c.latest:
                notes.append("latest")
            if c.step is not None and c.step == newest and not scan.is_checkpoint:
                notes.append("newest")
            if c.error:
                notes.append(f"manifest unreadable: {c.error}")
            rows.append(["-" if c.step is None else c.step, c.name, human_bytes(c.bytes), c.bytes,
                         _iso(c.committed_unix_s) or "-", "-" if c.world_size is None else c.world_size,
                         ", ".join(notes)])
        print(_table(["STEP", "NAME", "SIZE", "BYTES", "COMMITTED", "WORLD", ""], rows, right=(0, 2, 3, 5)),
              file=out)
    else:
        print("no committed checkpoints", file=out)
    if not scan.is_checkpoint:
        if scan.latest is None:
            print("latest: (none)", file=out)
        elif latest_committed:
            print(f"latest: {scan.latest} (newest committed step: {scan.newest_step})", file=out)
        else:
            print(f"latest: {scan.latest} (NOT a committed checkpoint in this root; "
                  f"newest committed step: {scan.newest_step})", file=out)
    if scan.partial:
        print(f"partial (never committed; `{PROG} clean {scan.root}` lists what it would remove):", file=out)
        rows = [[p.name, human_bytes(p.bytes), _PARTIAL_DESCRIPTION[p.kind]] for p in scan.partial]
        table = _table(["NAME", "SIZE", "WHAT"], rows, right=(1,))
        print("  " + table.replace("\n", "\n  "), file=out)
    return 0


def _cmd_inspect(args: argparse.Namespace, out: TextIO) -> int:
    info = inspect_checkpoint(args.checkpoint)
    if args.json:
        _emit_json(info, out)
        return 0
    rows = []
    for e in info["entries"]:
        files = sorted({r["file"] for r in e["files"]})
        rows.append([e["fqn"], e["kind"], e["dtype"] or "-",
                     "(" + ", ".join(map(str, e["shape"])) + ("," if len(e["shape"]) == 1 else "") + ")"
                     if e["shape"] is not None else "-",
                     e["bytes"], human_bytes(e["bytes"]), ", ".join(files)])
    print(f"checkpoint: {info['path']}" + ("" if info["committed"] else "  (no asyncckpt manifest)"), file=out)
    print(_table(["FQN", "KIND", "DTYPE", "SHAPE", "BYTES", "SIZE", "FILES"], rows, right=(4, 5)), file=out)
    t = info["totals"]
    print(f"entries: {t['entries']} ({t['tensors']} tensor{'' if t['tensors'] == 1 else 's'}, "
          f"{t['values']} other value{'' if t['values'] == 1 else 's'})", file=out)
    print(f"tensor bytes: {t['tensor_bytes']} ({human_bytes(t['tensor_bytes'])}); "
          f"other values: {t['value_bytes']} ({human_bytes(t['value_bytes'])})", file=out)
    print(f"data files: {t['files']} ({human_bytes(t['file_bytes'])}): {', '.join(t['file_sizes'])}", file=out)
    ws = "-" if info["world_size"] is None else info["world_size"]
    step = "-" if info["step"] is None else info["step"]
    print(f"world_size: {ws}  step: {step}", file=out)
    return 0


def _cmd_verify(args: argparse.Namespace, out: TextIO) -> int:
    results = []
    for arg in args.checkpoints:
        try:
            targets = _verify_targets(arg)
        except CliError as exc:
            path = str(Path(arg).absolute())
            message = str(exc)[len(path) + 2:] if str(exc).startswith(path + ": ") else str(exc)
            results.append({"path": path, "ok": False, "files": None, "bytes": None, "error": message,
                            "file": None, "verifiable": True})
            if not args.json:
                print(f"FAILED  {path}: {message}", file=out)
            continue
        for path in targets:
            result = _verify_one(path, args.progress)
            results.append(result)
            if not args.json:
                if result["ok"]:
                    print(f"OK      {path}  ({result['files']} files, {human_bytes(result['bytes'])})", file=out)
                elif not result["verifiable"]:
                    print(f"UNVERIFIABLE  {path}: {result['error']}", file=out)
                else:
                    print(f"FAILED  {path}: {result['error']}", file=out)
            out.flush()
    failed = [r for r in results if not r["ok"] and r["verifiable"]]
    unverifiable = [r for r in results if not r["verifiable"]]
    if args.json:
        _emit_json({"ok": not failed and not unverifiable, "checked": len(results), "failed": len(failed),
                    "unverifiable": len(unverifiable), "results": results}, out)
    if failed:
        print(f"{PROG}: error: {len(failed)} of {len(results)} checkpoint(s) failed verification", file=sys.stderr)
        return 1
    if unverifiable:
        print(f"{PROG}: warning: {len(unverifiable)} of {len(results)} checkpoint(s) have no manifest and "
              f"could not be verified (exit status {EXIT_UNVERIFIABLE})", file=sys.stderr)
        return EXIT_UNVERIFIABLE
    return 0


def _cmd_convert(args: argparse.Namespace, out: TextIO) -> int:
    info = convert_to_torch_save(args.checkpoint, args.out, force=args.force, allow_pickle=args.allow_pickle,
                                 verify=args.verify)
    for note in info["warnings"]:  # e.g. a stock DCP checkpoint: no checksums to verify
        print(f"{PROG}: warning: {note}", file=sys.stderr)
    if args.json:
        _emit_json(info, out)
    else:
        print(f"wrote {info['output']} ({info['entries']} entries, {human_bytes(info['bytes'])})", file=out)
    return 0


def _cmd_clean(args: argparse.Namespace, out: TextIO) -> int:
    scan = scan_root(args.root)
    actions: list[dict[str, Any]] = []
    failed = False
    for p in scan.partial:
        action = {**asdict(p), "size": human_bytes(p.bytes), "result": "would remove"}
        if args.yes:
            try:
                action["result"] = remove_partial(p)
            except OSError as exc:
                action["result"] = f"failed: {exc}"
                failed = True
        actions.append(action)
    if args.json:
        _emit_json({"root": scan.root, "dry_run": not args.yes, "partial": actions,
                    "removed": [a["name"] for a in actions if a["result"] == "removed"]}, out)
    elif not actions:
        print(f"nothing to clean in {scan.root}", file=out)
    else:
        rows = [[a["name"], human_bytes(a["bytes"]), _PARTIAL_DESCRIPTION[a["kind"]], a["result"]] for a in actions]
        print(_table(["NAME", "SIZE", "WHAT", "RESULT"], rows, right=(1,)), file=out)
        if not args.yes:
            total = sum(a["bytes"] for a in actions)
            print(f"dry run: nothing was removed; pass --yes to remove these {len(actions)} "
                  f"director{'y' if len(actions) == 1 else 'ies'} ({human_bytes(total)}).\n"
                  "Committed checkpoints and `latest` are never touched. Do not clean a root that a job\n"
                  "is saving into: a temporary directory may be a save in progress.", file=out)
    if failed:
        print(f"{PROG}: error: some directories could not be removed", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    """The ``asyncckpt`` argument parser (subcommands ``ls``, ``inspect``, ``verify``,
    ``convert``, ``clean``)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document on stdout")

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect, verify, convert and clean asyncckpt / torch.distributed.checkpoint checkpoints.",
        epilog="Exit status: 0 success, 1 a problem was found (corrupt or missing checkpoint, failed "
               f"verification), 2 usage error, {EXIT_UNVERIFIABLE} (verify) nothing failed but some checkpoint "
               "has no manifest and could not be verified (a stock torch.distributed.checkpoint directory). "
               f"`{PROG} SUBCOMMAND --help` describes each subcommand.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)

    p = sub.add_parser("ls", parents=[common], help="list the checkpoints of a CheckpointManager root",
                       description="List the committed checkpoints of a CheckpointManager root (step, "
                                   "size, commit time, which one `latest` names, the newest committed "
                                   "step) and leftovers of saves that never committed. ROOT may also be "
                                   "a single checkpoint directory, or a Lightning dirpath holding "
                                   "checkpoints of asyncckpt.lightning (epoch=0-step=16.ckpt; the step "
                                   "is Lightning's global_step).")
    p.add_argument("root", metavar="ROOT", help="a CheckpointManager root (or one checkpoint directory)")
    p.set_defaults(func=_cmd_ls)

    p = sub.add_parser("inspect", parents=[common], help="list the entries of a checkpoint",
                       description="List every entry (FQN) of a checkpoint: kind (tensor / bytes), dtype, "
                                   "global shape, bytes, and the data file(s) holding it; then totals. "
                                   ".metadata is read with a restricted unpickler.")
    p.add_argument("checkpoint", metavar="CKPT", help="a checkpoint directory")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("verify", parents=[common], help="check sizes and CRC-32s against the manifest",
                       description="Check every file's size and CRC-32s against the checkpoint's manifest. "
                                   "Prints OK, FAILED or UNVERIFIABLE per checkpoint. A CheckpointManager "
                                   "root stands for all its committed checkpoints.",
                       epilog=f"Exit status: 0 all verified; 1 some checkpoint failed (corrupt, missing "
                              f"files, or a checkpoint of an asyncckpt root that lost its manifest); 2 usage "
                              f"error; {EXIT_UNVERIFIABLE} none failed, but some had no manifest and could not "
                              "be verified (a stock torch.distributed.checkpoint directory: UNVERIFIABLE, "
                              "'no manifest: not verifiable').")
    p.add_argument("checkpoints", metavar="CKPT", nargs="+", help="checkpoint directories")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--progress", dest="progress", action="store_const", const=True, default=None,
                       help="show a progress bar (bytes) on stderr (default: for checkpoints over "
                            f"{PROGRESS_MIN_BYTES >> 20} MiB when stderr is a terminal)")
    group.add_argument("--no-progress", dest="progress", action="store_const", const=False,
                       help="never show a progress bar")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("convert", parents=[common], help="write a checkpoint as one torch.save file",
                       description="Write a checkpoint as one torch.save file (nested as saved, like "
                                   "torch.distributed.checkpoint.format_utils.dcp_to_torch_save), loading "
                                   "it safely: restricted metadata unpickling, paths checked, CRC-32s "
                                   "verified (an asyncckpt checkpoint; a stock torch.distributed.checkpoint "
                                   "directory has no manifest and is converted unverified, with a "
                                   "warning), non-tensor values with weights_only=True. Written to a "
                                   "temporary file, then renamed.")
    p.add_argument("checkpoint", metavar="CKPT",
                   help="a committed asyncckpt checkpoint or a stock torch.distributed.checkpoint directory")
    p.add_argument("out", metavar="OUT", help="the torch.save file to write (e.g. model.pt)")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    p.add_argument("--allow-pickle", action="store_true",
                   help="unpickle non-tensor values of any class: this can run code chosen by whoever "
                        "wrote the checkpoint; only for checkpoints you trust")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip the size and CRC-32 checks before loading")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("clean", parents=[common], help="remove directories of saves that never committed",
                       description="Find directories of saves that never committed in a CheckpointManager "
                                   "root (.step_N.tmp-*, .step_N.deleting-*, step_N without a committed "
                                   "manifest) and print them. Dry run unless --yes: nothing is removed. "
                                   "Committed checkpoints and `latest` are never touched. Do not clean a "
                                   "root a running job saves into (a temporary directory may be a save "
                                   "in progress).")
    p.add_argument("root", metavar="ROOT", help="a CheckpointManager root")
    p.add_argument("-y", "--yes", "--force", dest="yes", action="store_true", help="remove them")
    p.set_defaults(func=_cmd_clean)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``asyncckpt`` command line.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 success, 1 a problem was found. Usage errors exit with 2
        (``SystemExit`` from argparse).
    """
    args = build_parser().parse_args(argv)
    out = sys.stdout
    try:
        return args.func(args, out)
    except BrokenPipeError:
        # The reader went away (`asyncckpt ls ROOT | head`): not worth a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except (CliError, AsyncckptError, OSError) as exc:
        message = str(exc)
        if args.json:
            try:
                _emit_json({"error": message}, out)
            except BrokenPipeError:
                pass
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
