"""``s3://`` URLs for the ``asyncckpt`` subcommands (``ls``, ``inspect``, ``verify``,
``convert``).

``ls s3://bucket/prefix`` lists the remote tier (:class:`asyncckpt.io.s3.S3Tier`):
the committed steps (those with a commit marker), their sizes, which one ``latest``
names, and the steps with objects but no marker (uploads in flight or failed).
``verify`` of URLs (only URLs) streams every object with ranged GETs through memory
and checks each segment's CRC-32 (:meth:`asyncckpt.io.s3.S3Checkpoint.verify`), with
the local command's lines and JSON. The other subcommands (and a ``verify`` of URLs
and local paths together) read a remote checkpoint with :func:`asyncckpt.io.s3.fetched`
(ranged GETs in parallel, into a scratch directory in memory) and run the local
subcommand on it, printing the URL where the local one prints the scratch directory.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from asyncckpt.cli.scan import human_bytes
from asyncckpt.errors import AsyncckptError
from asyncckpt.io import s3 as _s3

__all__ = ["run_remote", "list_remote"]


def list_remote(url: str) -> dict[str, Any]:
    """The remote tier at ``url``: ``{"root", "latest", "checkpoints": [{"step",
    "name", "bytes", "latest"}], "partial": [step, ...]}``, steps ascending.

    Raises:
        RemoteStorageError: the bucket cannot be listed.
    """
    tier = _s3.S3Tier(url)
    committed, unmarked = tier.scan()
    latest = tier.read_latest()
    rows = []
    for step in sorted(committed):
        try:
            marker = _s3.read_marker(tier, _s3.parse_url(tier.step_url(step)))
            size: int | None = marker.total_bytes
        except (OSError, ValueError):  # removed meanwhile, or not readable: listed without a size
            size = None
        rows.append({"step": step, "name": Path(tier.step_url(step)).name, "bytes": size, "latest": step == latest})
    return {"root": tier.url, "latest": latest, "checkpoints": rows, "partial": sorted(unmarked)}


def _root_steps(url: str) -> list[str] | None:
    """The committed steps' URLs when ``url`` is a root (no commit marker of its own),
    else ``None``."""
    tier = _s3.S3Tier(url)
    where = _s3.parse_url(url)
    try:
        _s3.read_marker(tier, where)
        return None  # a checkpoint
    except FileNotFoundError:
        steps = tier.steps()
    return [tier.step_url(step) for step in steps] or None


def _ls(args: argparse.Namespace, out: TextIO) -> int:
    info = list_remote(args.root)
    if args.json:
        out.write(json.dumps(info, indent=2) + "\n")
        return 0
    print(f"root: {info['root']}", file=out)
    if info["checkpoints"]:
        for c in info["checkpoints"]:
            size = "-" if c["bytes"] is None else human_bytes(c["bytes"])
            print(f"  {c['name']}  {size:>10}" + ("  <- latest" if c["latest"] else ""), file=out)
    else:
        print("no committed checkpoints", file=out)
    for step in info["partial"]:
        print(f"  partial: step {step} (objects without a commit marker: an upload in flight or failed)", file=out)
    return 0


def _verify_urls(urls: list[str], args: argparse.Namespace, out: TextIO) -> int:
    """``verify`` of committed remote checkpoints, streamed (nothing on disk): the local
    command's lines, JSON document and exit status (0, or 1 when one failed)."""
    results = []
    for url in urls:
        result: dict[str, Any] = {
            "path": url,
            "ok": False,
            "files": None,
            "bytes": None,
            "error": None,
            "file": None,
            "verifiable": True,
            "removed": False,
        }
        try:
            with _s3.open_url(url) as remote:
                files = remote.verify()["files"]
            result.update(ok=True, files=len(files), bytes=sum(e["size"] for e in files.values()))
        except (AsyncckptError, OSError) as exc:  # corrupt, missing, or a request that failed
            result.update(error=str(exc), file=getattr(exc, "path", None))
        results.append(result)
        if not args.json:
            if result["ok"]:
                print(f"OK      {url}  ({result['files']} files, {human_bytes(result['bytes'])})", file=out)
            else:
                print(f"FAILED  {url}: {result['error']}", file=out)
            out.flush()
    failed = [r for r in results if not r["ok"]]
    if args.json:
        doc = {
            "ok": not failed,
            "checked": len(results),
            "failed": len(failed),
            "unverifiable": 0,
            "removed": 0,
            "results": results,
        }
        out.write(json.dumps(doc, indent=2) + "\n")
    if failed:
        print(f"asyncckpt: error: {len(failed)} of {len(results)} checkpoint(s) failed verification", file=sys.stderr)
        return 1
    return 0


def run_remote(args: argparse.Namespace, out: TextIO, local: Callable[[argparse.Namespace, TextIO], int]) -> int | None:
    """Run a subcommand whose checkpoint arguments are ``s3://`` URLs; ``None`` when none
    is (the caller runs the local subcommand ``local``)."""
    if args.command == "ls":
        return _ls(args, out) if _s3.is_url(args.root) else None
    attr = {"inspect": "checkpoint", "verify": "checkpoints", "convert": "checkpoint"}.get(args.command)
    if attr is None:
        return None
    value = getattr(args, attr)
    urls = [v for v in (value if isinstance(value, list) else [value]) if _s3.is_url(v)]
    if not urls:
        return None
    if args.command == "verify":  # a root URL stands for its committed steps, as a local root does
        expanded: list[str] = []
        for v in value:
            steps = _root_steps(v) if _s3.is_url(v) else None
            expanded.extend(steps if steps else [v])
        value = expanded
        setattr(args, attr, value)
        urls = [v for v in value if _s3.is_url(v)]
        if len(urls) == len(value):
            return _verify_urls(urls, args, out)
    with contextlib.ExitStack() as stack:
        places = {url: stack.enter_context(_s3.fetched(url)) for url in dict.fromkeys(urls)}
        if isinstance(value, list):
            setattr(args, attr, [str(places[v]) if v in places else v for v in value])
        else:
            setattr(args, attr, str(places[value]))
        buffer = io.StringIO()
        code = local(args, buffer)
    text = buffer.getvalue()
    for url, place in places.items():
        text = text.replace(str(place), url)
    out.write(text)
    return code
