"""``s3://`` URLs for the ``asyncckpt`` subcommands (``ls``, ``inspect``, ``verify``,
``convert``).

``ls s3://bucket/prefix`` lists the remote tier (:class:`asyncckpt.io.s3.S3Tier`):
the committed steps (those with a commit marker), their sizes, which one ``latest``
names, the steps with objects but no marker (uploads in flight or failed), and the
job whose lease holds the prefix (its root, host and pid; "Whose prefix" in
:mod:`asyncckpt.io.s3`).
``verify``, ``inspect`` and ``convert`` take URLs and local paths alike
(:mod:`asyncckpt.cli.commands` reads each through its tier's
:class:`~asyncckpt.io.storage.ReadableStorage`: a remote checkpoint is read in place
with ranged GETs, nothing copied to disk or memory first); :func:`root_steps` expands
a root URL into its committed steps for ``verify``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from asyncckpt.cli.scan import human_bytes
from asyncckpt.io import s3 as _s3

__all__ = ["run_remote", "list_remote", "root_steps"]


def list_remote(url: str) -> dict[str, Any]:
    """The remote tier at ``url``: ``{"root", "latest", "checkpoints": [{"step",
    "name", "bytes", "latest"}], "partial": [step, ...], "lease": {"root", "host",
    "pid", "age_s", "holds"} or None}``, steps ascending.

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
    lease = tier.read_lease()
    held = None if lease is None else {**dataclasses.asdict(lease), "holds": lease.holds()}
    return {"root": tier.url, "latest": latest, "checkpoints": rows, "partial": sorted(unmarked), "lease": held}


def root_steps(url: str) -> list[str] | None:
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
    lease = info["lease"]
    if lease is not None:
        state = "uploading here" if lease["holds"] else "lapsed: the next job to upload takes it over"
        print(
            f"lease: the job of root {lease['root']} (host {lease['host']}, pid {lease['pid']}; renewed "
            f"{lease['age_s']:.0f} s ago, {state})",
            file=out,
        )
    return 0


def run_remote(args: argparse.Namespace, out: TextIO, local: Callable[[argparse.Namespace, TextIO], int]) -> int | None:
    """Run ``ls`` of an ``s3://`` root; ``None`` for anything else (the caller runs the
    subcommand ``local``, which reads URLs and paths alike through their tier's
    :class:`~asyncckpt.io.storage.ReadableStorage`)."""
    if args.command == "ls":
        return _ls(args, out) if _s3.is_url(args.root) else None
    return None
