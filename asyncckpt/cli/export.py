"""``asyncckpt export CKPT OUT --format safetensors``: a checkpoint's model as Hugging
Face safetensors (:func:`asyncckpt.export_safetensors`); the parser is in
:mod:`asyncckpt.cli`."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import TextIO

from asyncckpt.cli.commands import PROG, emit_json
from asyncckpt.cli.scan import human_bytes

__all__ = ["add_export_parser", "cmd_export"]


def add_export_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add the ``export`` subcommand to ``sub`` (``common``: the ``--json`` parent)."""
    p = sub.add_parser(
        "export",
        parents=[common],
        help="write a checkpoint's model as Hugging Face safetensors",
        description="Write a checkpoint's model as Hugging Face safetensors in OUT: "
        "model-00001-of-0000N.safetensors and model.safetensors.index.json, or one model.safetensors "
        "when it fits one shard. Reads tensor by tensor (memory: about one shard), assembles sharded "
        "(FSDP2) checkpoints of any number of ranks, and checks every byte read against the manifest "
        "(a stock torch.distributed.checkpoint directory has none: exported unverified, with a warning).",
    )
    p.add_argument("checkpoint", metavar="CKPT", help="a checkpoint directory")
    p.add_argument("out", metavar="OUT", help="the output directory (created if missing)")
    p.add_argument("--format", choices=["safetensors"], default="safetensors", help="the output format (%(default)s)")
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="the largest shard: bytes, or like 5GB (10**9) or 256MiB (2**20) (%(default)s, as huggingface_hub)",
    )
    p.add_argument("--key", default=None, help="the part of the state that is the model (default: model, if present)")
    p.add_argument("--dtype", default=None, help="cast floating tensors, e.g. bf16, fp16, fp32")
    p.add_argument("--strip", dest="strip_prefix", default=None, metavar="PREFIX", help="remove PREFIX from names")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip the CRC-32 checks")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace, out: TextIO) -> int:
    """Run ``export``; returns the exit status (0)."""
    from asyncckpt.export import export_safetensors

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = export_safetensors(
            args.checkpoint,
            args.out,
            max_shard_size=args.max_shard_size,
            key=args.key,
            dtype=args.dtype,
            strip_prefix=args.strip_prefix,
            verify=args.verify,
        )
    for w in caught:  # e.g. a stock DCP checkpoint: no checksums to verify
        print(f"{PROG}: warning: {w.message}", file=sys.stderr)
    info = {
        "output": str(result.out),
        "files": result.files,
        "tensors": len(result.weight_map),
        "total_size": result.total_size,
        "skipped": result.skipped,
        "warnings": [str(w.message) for w in caught],
    }
    if args.json:
        emit_json(info, out)
    else:
        print(
            f"wrote {len(result.files)} file(s) to {result.out} ({len(result.weight_map)} tensors, "
            f"{human_bytes(result.total_size)})",
            file=out,
        )
    return 0
