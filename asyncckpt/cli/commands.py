"""The subcommands of the ``asyncckpt`` command: ``ls``, ``inspect``, ``verify``,
``convert``, ``clean`` (the parser and ``main`` are in :mod:`asyncckpt.cli`). Five short
commands in one module, a little over 600 lines: one module each would be five of a
hundred lines sharing the same helpers.

``ls``, ``verify`` and ``clean`` do not import torch; ``inspect`` reads ``.metadata``
with the restricted unpickler of :mod:`asyncckpt.loading.metadata`; ``convert`` reads
with :func:`asyncckpt.read_state_dict`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import json
import os
import secrets
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

from asyncckpt import _faults
from asyncckpt import root as _root
from asyncckpt._fs import fsync_directory
from asyncckpt.cli.remote import root_steps
from asyncckpt.cli.scan import (
    PARTIAL_DESCRIPTION,
    CliError,
    PartialDir,
    _require_checkpoint_dir,
    _require_dir,
    human_bytes,
    scan_root,
)
from asyncckpt.errors import (
    AsyncckptError,
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    RemoteStorageError,
    RootInUseError,
)
from asyncckpt.format.manifest import MANIFEST_NAME, METADATA_NAME, is_committed, step_metadata
from asyncckpt.io import s3 as _s3
from asyncckpt.io.storage import LOCAL, ReadableStorage

__all__ = [
    "PROG",
    "EXIT_UNVERIFIABLE",
    "PROGRESS_MIN_BYTES",
    "inspect_checkpoint",
    "convert_to_torch_save",
    "remove_partial",
    "FOREIGN_KEPT",
    "emit_json",
    "cmd_ls",
    "cmd_inspect",
    "cmd_verify",
    "cmd_convert",
    "cmd_clean",
]

PROG = "asyncckpt"

#: Exit status of ``verify`` when nothing failed but some checkpoint had no manifest.
EXIT_UNVERIFIABLE = 3

#: ``verify`` shows a progress bar by default for checkpoints larger than this
#: (bytes), when stderr is a terminal.
PROGRESS_MIN_BYTES = 256 << 20


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC).astimezone().isoformat(timespec="seconds")


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


# ----------------------------------------------------------------------------- inspect
def inspect_checkpoint(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """Describe every entry of a checkpoint, from its ``.metadata`` (read safely).

    ``.metadata`` is read with :func:`asyncckpt.loading.metadata.read_metadata` (an
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
    remote = _s3.is_url(checkpoint_dir)
    path: Any = str(checkpoint_dir) if remote else Path(checkpoint_dir).absolute()
    if not remote:
        _require_checkpoint_dir(path)

    from torch.distributed.checkpoint.metadata import (
        TensorStorageMetadata,  # torch only once needed
    )

    from asyncckpt.loading.metadata import read_metadata
    from asyncckpt.loading.read import manifest_int_keys, typed_entry_paths

    with _readable(str(path)) as tier:  # a URL: its marker and .metadata, nothing else
        manifest: dict[str, Any] | None = None
        if remote or tier.exists(path, MANIFEST_NAME):  # a remote one's is its commit marker
            manifest = tier.read_manifest(path)
        metadata = read_metadata(path, tier)
        listed = manifest["files"] if manifest is not None else {}
        files = sorted({info.relative_path for info in metadata.storage_data.values()})
        with tier.open_checkpoint(str(path)) as opened:  # (a stock DCP directory: from the files)
            file_sizes = {n: listed[n]["size"] if n in listed else opened.file_size(n) or 0 for n in files}
    where = f"{path}/{METADATA_NAME}"
    paths = typed_entry_paths(metadata, manifest_int_keys(manifest, f"{path}/{MANIFEST_NAME}"), where)

    storage: dict[str, list[dict[str, Any]]] = {}
    for index, info in metadata.storage_data.items():
        storage.setdefault(index.fqn, []).append(
            {"file": info.relative_path, "offset": info.offset, "length": info.length}
        )
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
            entry = {
                "fqn": fqn,
                "kind": "tensor",
                "dtype": str(dtype).replace("torch.", "", 1),
                "shape": shape,
                "bytes": numel * dtype.itemsize,
                "chunks": len(md.chunks),
            }
        else:
            entry = {"fqn": fqn, "kind": "bytes", "dtype": None, "shape": None, "bytes": stored, "chunks": len(records)}
        entry["path"] = list(paths[fqn][0])
        entry["stored_bytes"] = stored
        entry["files"] = records
        entries.append(entry)

    tensors = [e for e in entries if e["kind"] == "tensor"]

    def manifest_int(key: str) -> int | None:
        value = manifest.get(key) if manifest is not None else None
        return value if type(value) is int else None

    return {
        "path": str(path),
        "committed": manifest is not None and (remote or is_committed(path)),
        "step": manifest_int("step"),
        "world_size": manifest_int("world_size"),
        "saved_with": step_metadata(manifest) if manifest is not None else None,
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
def _verify_targets(arg: str) -> tuple[list[str], bool]:
    """The checkpoints named by one ``verify`` argument: itself, or every committed
    checkpoint of a manager root (a local directory or an ``s3://`` prefix); and whether
    they came from a root's scan (then one that vanishes before its check was removed by
    the job's retention)."""
    if _s3.is_url(arg):
        steps = root_steps(arg)
        return (steps, True) if steps else ([arg], False)
    path = Path(arg).absolute()
    _require_dir(path)
    if is_committed(path):
        return [str(path)], False
    try:
        scan = scan_root(path)
    except (CliError, OSError):
        return [str(path)], False
    if not scan.is_checkpoint and scan.checkpoints:
        return [c.path for c in scan.checkpoints], True
    return [str(path)], False


@contextlib.contextmanager
def _readable(target: str) -> Iterator[ReadableStorage]:
    """The read side of the tier holding ``target``: the local directory's
    (:data:`~asyncckpt.io.storage.LOCAL`), or the remote checkpoint's
    (:func:`asyncckpt.io.s3.open_url`: its commit marker read, the objects streamed).

    Raises:
        CheckpointNotFoundError: no committed remote checkpoint at ``target``.
        RemoteStorageError: a request failed, or boto3 is missing.
    """
    if _s3.is_url(target):
        with _s3.open_url(target) as checkpoint:
            yield checkpoint
    else:
        yield LOCAL


def _verify_one(target: str, progress: bool | None) -> dict[str, Any]:
    """Check one checkpoint (a local directory or an ``s3://`` URL) against its manifest
    through its tier's :class:`~asyncckpt.io.storage.ReadableStorage`: every file's size
    and CRC-32s, the bytes streamed (a remote one with ranged GETs, nothing on disk)."""
    result: dict[str, Any] = {
        "path": target,
        "ok": False,
        "files": None,
        "bytes": None,
        "error": None,
        "file": None,
        "verifiable": True,
    }
    if not _s3.is_url(target) and _root.is_stock_dcp(Path(target)):
        # not ours, nothing wrong with it known: its own exit status
        result.update(
            verifiable=False,
            error="no manifest: not verifiable (a stock torch.distributed.checkpoint directory has no checksums)",
        )
        return result
    try:
        with _readable(target) as storage:
            manifest = storage.read_manifest(target)
            total = sum(e["size"] for e in manifest["files"].values())
            show = progress if progress is not None else (total > PROGRESS_MIN_BYTES and sys.stderr.isatty())
            if show:
                from tqdm import tqdm

                with tqdm(
                    total=total,
                    unit="B",
                    unit_scale=True,
                    unit_divisor=1024,
                    desc=Path(target).name,
                    file=sys.stderr,
                    leave=False,
                    disable=False,
                    mininterval=0.2,
                ) as bar:

                    def advance(n: int) -> None:
                        bar.update(n)

                    manifest = storage.verify(target, on_bytes=advance)
            else:
                manifest = storage.verify(target)
    except (CorruptCheckpointError, CheckpointNotFoundError, RemoteStorageError) as exc:
        # damaged, missing (a remote retention racing the check), or a request that failed
        result["error"] = str(exc)
        result["file"] = getattr(exc, "path", None)
        return result
    result.update(ok=True, files=len(manifest["files"]), bytes=sum(e["size"] for e in manifest["files"].values()))
    return result


# ----------------------------------------------------------------------------- convert
def convert_to_torch_save(
    checkpoint_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    force: bool = False,
    allow_pickle: bool = False,
    verify: bool = True,
) -> dict[str, Any]:
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
    src: Any = str(checkpoint_dir) if _s3.is_url(checkpoint_dir) else Path(checkpoint_dir).absolute()
    dst = Path(out).absolute()
    if not _s3.is_url(src):
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
    from asyncckpt.loading.metadata import read_metadata

    with _readable(str(src)) as tier:  # a URL: read in place, with ranged GETs, as read_state_dict does
        entries = len(read_metadata(src, tier).state_dict_metadata)  # an unsafe .metadata is named as such first
        has_manifest = _s3.is_url(src) or tier.exists(src, MANIFEST_NAME)
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
        fsync_directory(dst.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return {
        "source": str(src),
        "output": str(dst),
        "entries": entries,
        "bytes": dst.stat().st_size,
        "verified": verify and has_manifest,
        "warnings": notes,
    }


# ----------------------------------------------------------------------------- clean
#: ``clean``'s result for a directory that is not asyncckpt's leftover (dry run or not).
FOREIGN_KEPT = "kept: not an asyncckpt leftover"


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
        return FOREIGN_KEPT
    if not path.is_dir() or path.is_symlink():
        return "kept: no longer a directory"
    shutil.rmtree(path)
    return "removed"


# ----------------------------------------------------------------------------- commands
def emit_json(doc: Any, out: TextIO) -> None:
    """Write ``doc`` to ``out`` as indented JSON and a newline."""
    json.dump(doc, out, indent=2)
    out.write("\n")


def cmd_ls(args: argparse.Namespace, out: TextIO) -> int:
    scan = scan_root(args.root)
    latest_committed = any(c.latest for c in scan.checkpoints)
    if args.json:
        emit_json(
            {
                "root": scan.root,
                "is_checkpoint": scan.is_checkpoint,
                "latest": scan.latest,
                "latest_is_committed": latest_committed,
                "newest_step": scan.newest_step,
                "checkpoints": [
                    {**asdict(c), "size": human_bytes(c.bytes), "committed_at": _iso(c.committed_unix_s)}
                    for c in scan.checkpoints
                ],
                "partial": [{**asdict(p), "size": human_bytes(p.bytes)} for p in scan.partial],
            },
            out,
        )
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
            if c.foreign and not scan.is_checkpoint:
                notes.append("foreign: not a CheckpointManager step")
            if c.error:
                notes.append(f"manifest unreadable: {c.error}")
            rows.append(
                [
                    "-" if c.step is None else c.step,
                    c.name,
                    human_bytes(c.bytes),
                    c.bytes,
                    _iso(c.committed_unix_s) or "-",
                    "-" if c.world_size is None else c.world_size,
                    ", ".join(notes),
                ]
            )
        print(_table(["STEP", "NAME", "SIZE", "BYTES", "COMMITTED", "WORLD", ""], rows, right=(0, 2, 3, 5)), file=out)
    else:
        print("no committed checkpoints", file=out)
    if not scan.is_checkpoint:
        if scan.latest is None:
            print("latest: (none)", file=out)
        elif latest_committed:
            print(f"latest: {scan.latest} (newest committed step: {scan.newest_step})", file=out)
        else:
            print(
                f"latest: {scan.latest} (NOT a committed checkpoint in this root; "
                f"newest committed step: {scan.newest_step})",
                file=out,
            )
    leftovers = [p for p in scan.partial if p.kind != "foreign"]
    foreign = [p for p in scan.partial if p.kind == "foreign"]
    for title, entries in (
        (f"partial (never committed; `{PROG} clean {scan.root}` lists what it would remove):", leftovers),
        ("foreign (not committed by asyncckpt here: never listed as a step, never removed):", foreign),
    ):
        if entries:
            print(title, file=out)
            rows = [[p.name, human_bytes(p.bytes), PARTIAL_DESCRIPTION[p.kind]] for p in entries]
            table = _table(["NAME", "SIZE", "WHAT"], rows, right=(1,))
            print("  " + table.replace("\n", "\n  "), file=out)
    return 0


def cmd_inspect(args: argparse.Namespace, out: TextIO) -> int:
    info = inspect_checkpoint(args.checkpoint)
    if args.json:
        emit_json(info, out)
        return 0
    rows = []
    for e in info["entries"]:
        files = sorted({r["file"] for r in e["files"]})
        rows.append(
            [
                e["fqn"],
                e["kind"],
                e["dtype"] or "-",
                "(" + ", ".join(map(str, e["shape"])) + ("," if len(e["shape"]) == 1 else "") + ")"
                if e["shape"] is not None
                else "-",
                e["bytes"],
                human_bytes(e["bytes"]),
                ", ".join(files),
            ]
        )
    print(f"checkpoint: {info['path']}" + ("" if info["committed"] else "  (no asyncckpt manifest)"), file=out)
    print(_table(["FQN", "KIND", "DTYPE", "SHAPE", "BYTES", "SIZE", "FILES"], rows, right=(4, 5)), file=out)
    t = info["totals"]
    print(
        f"entries: {t['entries']} ({t['tensors']} tensor{'' if t['tensors'] == 1 else 's'}, "
        f"{t['values']} other value{'' if t['values'] == 1 else 's'})",
        file=out,
    )
    print(
        f"tensor bytes: {t['tensor_bytes']} ({human_bytes(t['tensor_bytes'])}); "
        f"other values: {t['value_bytes']} ({human_bytes(t['value_bytes'])})",
        file=out,
    )
    print(f"data files: {t['files']} ({human_bytes(t['file_bytes'])}): {', '.join(t['file_sizes'])}", file=out)
    ws = "-" if info["world_size"] is None else info["world_size"]
    step = "-" if info["step"] is None else info["step"]
    print(f"world_size: {ws}  step: {step}", file=out)
    saved_with = info.get("saved_with") or {}
    if saved_with.get("metrics"):
        print("metrics: " + ", ".join(f"{k}={v:g}" for k, v in sorted(saved_with["metrics"].items())), file=out)
    if saved_with.get("metadata"):
        print(f"metadata: {json.dumps(saved_with['metadata'], sort_keys=True)}", file=out)
    if saved_with.get("asyncckpt_version"):
        print(f"written by asyncckpt {saved_with['asyncckpt_version']}", file=out)
    return 0


def _vanished(target: str) -> bool:
    """Whether a checkpoint listed by a root's scan is gone now (removed, not damaged)."""
    if not _s3.is_url(target):
        return not os.path.lexists(target)
    try:
        with _s3.open_url(target):
            return False
    except CheckpointNotFoundError:
        return True
    except (AsyncckptError, OSError):
        return False


def cmd_verify(args: argparse.Namespace, out: TextIO) -> int:
    results = []
    for arg in args.checkpoints:
        try:
            targets, scanned = _verify_targets(arg)
        except (CliError, RemoteStorageError) as exc:
            shown = arg if _s3.is_url(arg) else str(Path(arg).absolute())
            message = str(exc)[len(shown) + 2 :] if str(exc).startswith(shown + ": ") else str(exc)
            results.append(
                {
                    "path": shown,
                    "ok": False,
                    "files": None,
                    "bytes": None,
                    "error": message,
                    "file": None,
                    "verifiable": True,
                    "removed": False,
                }
            )
            if not args.json:
                print(f"FAILED  {shown}: {message}", file=out)
            continue
        _faults.hit("verify_scanned")
        for path in targets:
            result = _verify_one(path, args.progress)
            # A step of a root that vanished between the scan and its check was removed
            # (retention of a job still saving, a user's rm): gone, not damaged.
            result["removed"] = scanned and not result["ok"] and _vanished(path)
            results.append(result)
            if not args.json:
                if result["removed"]:
                    print(f"REMOVED {path}  (removed since the root was listed: skipped)", file=out)
                elif result["ok"]:
                    print(f"OK      {path}  ({result['files']} files, {human_bytes(result['bytes'])})", file=out)
                elif not result["verifiable"]:
                    print(f"UNVERIFIABLE  {path}: {result['error']}", file=out)
                else:
                    print(f"FAILED  {path}: {result['error']}", file=out)
            out.flush()
    failed = [r for r in results if not r["ok"] and r["verifiable"] and not r.get("removed")]
    unverifiable = [r for r in results if not r["verifiable"] and not r.get("removed")]
    removed = [r for r in results if r.get("removed")]
    if args.json:
        emit_json(
            {
                "ok": not failed and not unverifiable,
                "checked": len(results) - len(removed),
                "failed": len(failed),
                "unverifiable": len(unverifiable),
                "removed": len(removed),
                "results": results,
            },
            out,
        )
    if failed:
        print(f"{PROG}: error: {len(failed)} of {len(results)} checkpoint(s) failed verification", file=sys.stderr)
        return 1
    if unverifiable:
        print(
            f"{PROG}: warning: {len(unverifiable)} of {len(results)} checkpoint(s) have no manifest and "
            f"could not be verified (exit status {EXIT_UNVERIFIABLE})",
            file=sys.stderr,
        )
        return EXIT_UNVERIFIABLE
    return 0


def cmd_convert(args: argparse.Namespace, out: TextIO) -> int:
    info = convert_to_torch_save(
        args.checkpoint, args.out, force=args.force, allow_pickle=args.allow_pickle, verify=args.verify
    )
    for note in info["warnings"]:  # e.g. a stock DCP checkpoint: no checksums to verify
        print(f"{PROG}: warning: {note}", file=sys.stderr)
    if args.json:
        emit_json(info, out)
    else:
        print(f"wrote {info['output']} ({info['entries']} entries, {human_bytes(info['bytes'])})", file=out)
    return 0


def _holder(root: str) -> AsyncckptError | None:
    """Why ``root`` must not be cleaned now: the ``RootInUseError`` naming the
    ``CheckpointManager`` that holds its lock (a probe:
    :meth:`asyncckpt.root.CheckpointRoot.check_not_in_use`), a lock file that cannot be
    a manager's (a FIFO: ``CheckpointPathError``), or ``None``."""
    try:
        _root.CheckpointRoot(root, create=False).check_not_in_use()
    except AsyncckptError as exc:
        return exc
    return None


def cmd_clean(args: argparse.Namespace, out: TextIO) -> int:
    scan = scan_root(args.root)
    removing = args.yes or args.force
    in_use = None if scan.is_checkpoint else _holder(scan.root)
    if removing and in_use is not None and not isinstance(in_use, RootInUseError):
        raise CliError(f"not cleaning: {in_use}")
    if removing and in_use is not None and not args.force:
        raise CliError(
            f"not cleaning: {in_use}. A temporary directory may be a save in progress; "
            "stop the job first, or pass --force to remove the leftovers anyway"
        )
    actions: list[dict[str, Any]] = []
    failed = False
    for p in scan.partial:
        # The dry run says "would remove" for exactly what --yes removes.
        action = {**asdict(p), "size": human_bytes(p.bytes), "result": "would remove"}
        if p.kind == "foreign":
            action["result"] = FOREIGN_KEPT
        elif removing:
            try:
                action["result"] = remove_partial(p)
            except OSError as exc:
                action["result"] = f"failed: {exc}"
                failed = True
        actions.append(action)
    if args.json:
        emit_json(
            {
                "root": scan.root,
                "dry_run": not removing,
                "in_use_by": None if in_use is None else str(in_use),
                "partial": actions,
                "removed": [a["name"] for a in actions if a["result"] == "removed"],
            },
            out,
        )
    elif not actions:
        print(f"nothing to clean in {scan.root}", file=out)
    else:
        rows = [[a["name"], human_bytes(a["bytes"]), PARTIAL_DESCRIPTION[a["kind"]], a["result"]] for a in actions]
        print(_table(["NAME", "SIZE", "WHAT", "RESULT"], rows, right=(1,)), file=out)
        doomed = [a for a in actions if a["result"] == "would remove"]
        if not removing and not doomed:
            print(f"nothing to clean in {scan.root}", file=out)
        elif not removing:
            total = sum(a["bytes"] for a in doomed)
            print(
                f"dry run: nothing was removed; pass --yes to remove these {len(doomed)} "
                f"director{'y' if len(doomed) == 1 else 'ies'} ({human_bytes(total)}).\n"
                "Committed checkpoints and `latest` are never touched. Do not clean a root that a job\n"
                "is saving into: a temporary directory may be a save in progress.",
                file=out,
            )
    if in_use is not None and not removing:
        held = isinstance(in_use, RootInUseError)
        then = "--yes refuses while it does (--force overrides)" if held else "--yes refuses"
        print(f"{PROG}: warning: {in_use}; {then}", file=sys.stderr)
    if failed:
        print(f"{PROG}: error: some directories could not be removed", file=sys.stderr)
        return 1
    return 0
