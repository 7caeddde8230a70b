"""The names of a checkpoint root's entries: which names are a root's own steps.

One place for the naming policy (Orbax's ``NameFormat`` in our words), shared by the
local root (:mod:`asyncckpt.root`), the command-line tool, and every tier that lists a
root's steps (a local directory, an object store prefix). Torch-free, no I/O.

Only the names a manager itself writes are steps: ``step_`` followed by the step in
ASCII decimal, zero-padded to 8 digits (``step_00000007``; ``step_123456789`` past
10**8). ``step_7``, ``step_000000007`` or a name with a non-ASCII digit are foreign
names: never a step, never removed by retention.
"""

from __future__ import annotations

import re

__all__ = [
    "STEP_PREFIX",
    "STEP_DIR_RE",
    "LEFTOVER_RE",
    "step_dir_name",
    "parse_step_dir",
    "parse_leftover",
]

STEP_PREFIX = "step_"
#: The shape of a step directory's name (ASCII digits only); :func:`parse_step_dir`
#: also requires the canonical zero-padding, so use it rather than this pattern alone.
STEP_DIR_RE = re.compile(r"^step_([0-9]+)$", re.ASCII)
#: The hidden leftovers of a step: a save's temporary directory, or an old checkpoint
#: being deleted (``.step_00000007.tmp-<hex>``, ``.step_00000007.deleting-<hex>``).
LEFTOVER_RE = re.compile(r"^\.(step_[0-9]+)\.(tmp|deleting)-[0-9a-f]+$", re.ASCII)


def step_dir_name(step: int) -> str:
    """The directory name of step ``step`` (``step_%08d``)."""
    return f"{STEP_PREFIX}{int(step):08d}"


def parse_step_dir(name: str) -> int | None:
    """The step whose directory is named ``name``, or ``None`` when ``name`` is not a
    name :func:`step_dir_name` writes (a foreign entry)."""
    m = STEP_DIR_RE.match(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_dir_name(step) == name else None


def parse_leftover(name: str) -> tuple[int, str] | None:
    """``(step, "tmp" | "deleting")`` of a hidden leftover of a step directory named as
    :func:`step_dir_name` writes, or ``None`` for any other name."""
    m = LEFTOVER_RE.match(name)
    if m is None:
        return None
    step = parse_step_dir(m.group(1))
    return None if step is None else (step, m.group(2))
