"""The ``asyncckpt`` command-line tool: list, inspect, verify, convert and clean checkpoints.

Usage (``asyncckpt SUBCOMMAND --help`` for each)::

    asyncckpt ls ROOT                  checkpoints of a CheckpointManager root (or a Lightning
                                       dirpath), ``latest``, leftovers
    asyncckpt inspect CKPT             every entry: kind, dtype, shape, bytes, data file(s)
    asyncckpt verify CKPT [CKPT ...]   sizes and CRC-32s against the manifest
    asyncckpt convert CKPT OUT.pt      one ``torch.save`` file, loaded safely
    asyncckpt clean ROOT [--yes|--force]  remove directories of saves that never committed
    asyncckpt export CKPT OUT          the model as Hugging Face safetensors (--max-shard-size,
                                       --key, --dtype, --strip)

Every subcommand takes ``--json`` (one JSON document on stdout, also on error:
``{"error": ...}``). Exit status: 0 success, 1 a problem was found (a checkpoint failed
verification, a path is missing, a checkpoint is corrupt), 2 usage error, 3 (``verify``)
nothing failed but some checkpoint has no manifest and could not be verified (a stock
``torch.distributed.checkpoint`` directory). Errors are printed to stderr as
``asyncckpt: error: ...``.

The tool is a user of the public API and the storage modules (DESIGN.md, "Layers"):
:mod:`asyncckpt.cli.scan` (a root, on :class:`asyncckpt.root.CheckpointRoot`),
:mod:`asyncckpt.cli.commands` (the subcommands), this module (the parser and ``main``).
``ls``, ``verify`` and ``clean`` do not import torch; ``inspect`` reads ``.metadata``
with the restricted unpickler of :mod:`asyncckpt.loading.metadata`; ``convert`` reads with
:func:`asyncckpt.read_state_dict` (path checks, CRC verification when the checkpoint
has a manifest, ``weights_only`` values).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from asyncckpt import __version__
from asyncckpt.cli.commands import (
    EXIT_UNVERIFIABLE,
    PROG,
    PROGRESS_MIN_BYTES,
    cmd_clean,
    cmd_convert,
    cmd_inspect,
    cmd_ls,
    cmd_verify,
    convert_to_torch_save,
    emit_json,
    inspect_checkpoint,
    remove_partial,
)
from asyncckpt.cli.export import add_export_parser
from asyncckpt.cli.remote import run_remote
from asyncckpt.cli.scan import (
    CheckpointEntry,
    CliError,
    PartialDir,
    RootScan,
    human_bytes,
    scan_root,
)
from asyncckpt.errors import AsyncckptError

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
        f"`{PROG} SUBCOMMAND --help` describes each subcommand.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)

    p = sub.add_parser(
        "ls",
        parents=[common],
        help="list the checkpoints of a CheckpointManager root",
        description="List the committed checkpoints of a CheckpointManager root (step, "
        "size, commit time, which one `latest` names, the newest committed "
        "step) and leftovers of saves that never committed. ROOT may also be "
        "a single checkpoint directory, or a Lightning dirpath holding "
        "checkpoints of asyncckpt.lightning (epoch=0-step=16.ckpt; the step "
        "is Lightning's global_step).",
    )
    p.add_argument("root", metavar="ROOT", help="a CheckpointManager root (or one checkpoint directory)")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser(
        "inspect",
        parents=[common],
        help="list the entries of a checkpoint",
        description="List every entry (FQN) of a checkpoint: kind (tensor / bytes), dtype, "
        "global shape, bytes, and the data file(s) holding it; then totals. "
        ".metadata is read with a restricted unpickler.",
    )
    p.add_argument("checkpoint", metavar="CKPT", help="a checkpoint directory")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "verify",
        parents=[common],
        help="check sizes and CRC-32s against the manifest",
        description="Check every file's size and CRC-32s against the checkpoint's manifest. "
        "Prints OK, FAILED or UNVERIFIABLE per checkpoint. A CheckpointManager "
        "root stands for all its committed checkpoints.",
        epilog=f"Exit status: 0 all verified; 1 some checkpoint failed (corrupt, missing "
        f"files, or a checkpoint of an asyncckpt root that lost its manifest); 2 usage "
        f"error; {EXIT_UNVERIFIABLE} none failed, but some had no manifest and could not "
        "be verified (a stock torch.distributed.checkpoint directory: UNVERIFIABLE, "
        "'no manifest: not verifiable').",
    )
    p.add_argument("checkpoints", metavar="CKPT", nargs="+", help="checkpoint directories")
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--progress",
        dest="progress",
        action="store_const",
        const=True,
        default=None,
        help="show a progress bar (bytes) on stderr (default: for checkpoints over "
        f"{PROGRESS_MIN_BYTES >> 20} MiB when stderr is a terminal)",
    )
    group.add_argument(
        "--no-progress", dest="progress", action="store_const", const=False, help="never show a progress bar"
    )
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "convert",
        parents=[common],
        help="write a checkpoint as one torch.save file",
        description="Write a checkpoint as one torch.save file (nested as saved, like "
        "torch.distributed.checkpoint.format_utils.dcp_to_torch_save), loading "
        "it safely: restricted metadata unpickling, paths checked, CRC-32s "
        "verified (an asyncckpt checkpoint; a stock torch.distributed.checkpoint "
        "directory has no manifest and is converted unverified, with a "
        "warning), non-tensor values with weights_only=True. Written to a "
        "temporary file, then renamed.",
    )
    p.add_argument(
        "checkpoint",
        metavar="CKPT",
        help="a committed asyncckpt checkpoint or a stock torch.distributed.checkpoint directory",
    )
    p.add_argument("out", metavar="OUT", help="the torch.save file to write (e.g. model.pt)")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="unpickle non-tensor values of any class: this can run code chosen by whoever "
        "wrote the checkpoint; only for checkpoints you trust",
    )
    p.add_argument(
        "--no-verify", dest="verify", action="store_false", help="skip the size and CRC-32 checks before loading"
    )
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser(
        "clean",
        parents=[common],
        help="remove directories of saves that never committed",
        description="Find directories of saves that never committed in a CheckpointManager "
        "root (.step_N.tmp-*, .step_N.deleting-*, step_N without a committed "
        "manifest) and print them. Dry run unless --yes: nothing is removed. "
        "Committed checkpoints, `latest` and foreign directories are never touched. "
        "--yes refuses while a CheckpointManager holds the root (naming it): a "
        "temporary directory may be a save in progress.",
    )
    p.add_argument("root", metavar="ROOT", help="a CheckpointManager root")
    p.add_argument("-y", "--yes", action="store_true", help="remove them (refused while a manager holds the root)")
    p.add_argument(
        "--force",
        action="store_true",
        help="remove them even while a CheckpointManager holds the root (implies --yes)",
    )
    p.set_defaults(func=cmd_clean)

    add_export_parser(sub, common)
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
        code = run_remote(args, out, args.func)  # s3:// URLs (asyncckpt.cli.remote)
        return args.func(args, out) if code is None else code
    except BrokenPipeError:
        # The reader went away (`asyncckpt ls ROOT | head`): not worth a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except (CliError, AsyncckptError, OSError) as exc:
        message = str(exc)
        if args.json:
            try:
                emit_json({"error": message}, out)
            except BrokenPipeError:
                pass
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
