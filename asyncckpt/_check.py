"""Argument checks at the public API's boundary (torch-free).

Each check raises :class:`asyncckpt.errors.InvalidArgumentError` (an
``AsyncckptError`` that is also a ``ValueError`` and a ``TypeError``) before anything
is planned, staged or written.
"""

from __future__ import annotations

import json
import math
import operator
import os
from collections.abc import Mapping
from typing import Any

from asyncckpt.errors import InvalidArgumentError

__all__ = ["check_step", "check_path", "check_state_dict", "check_callback"]


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def check_step(step: Any, *, what: str = "step", hint: str = "") -> int:
    """``step`` as a non-negative ``int``.

    Accepted: an ``int`` and integer scalars that implement ``__index__`` (numpy
    integers, a 0-d integer ``torch.Tensor``). Refused: ``bool`` (also numpy's and a
    bool tensor), floats (``1.5`` is not step 1), strings (``"7"``), anything else, and
    negative values (a ``step_-0000001`` directory would be invisible to ``steps()``).

    Args:
        step: the value to check.
        what: the argument's name, for the message.
        hint: appended to the message (e.g. the call's signature).

    Returns:
        The step as a plain ``int``.

    Raises:
        InvalidArgumentError: ``step`` is not a non-negative integer.
    """
    dtype = str(getattr(step, "dtype", ""))
    bad = isinstance(step, bool) or "bool" in dtype or getattr(step, "ndim", 0) != 0
    value = None
    if not bad:
        try:
            value = operator.index(step)
        except TypeError:
            bad = True
    if bad or value is None:
        raise InvalidArgumentError(f"{what} must be a non-negative int, not {_describe(step)}{hint}")
    if value < 0:
        raise InvalidArgumentError(f"{what} must be a non-negative int, not {value}{hint}")
    return int(value)


def check_path(path: Any, *, what: str = "checkpoint_dir", hint: str = "") -> str | os.PathLike:
    """Check that ``path`` is a ``str`` or an ``os.PathLike`` (``pathlib.Path``), not empty.

    Raises:
        InvalidArgumentError: it is anything else (e.g. a state_dict given where a
            path belongs).
    """
    if isinstance(path, (str, os.PathLike)) and not isinstance(path, bytes) and os.fspath(path) != "":
        return path
    if isinstance(path, str):
        raise InvalidArgumentError(f"{what} must not be empty{hint}")
    raise InvalidArgumentError(f"{what} must be a str or os.PathLike path, not {_describe(path)}{hint}")


def check_state_dict(state_dict: Any, *, what: str = "state_dict", hint: str = "") -> dict:
    """Check that ``state_dict`` is a ``dict`` (any dict subclass).

    Raises:
        InvalidArgumentError: it is anything else.
    """
    if isinstance(state_dict, dict):
        return state_dict
    raise InvalidArgumentError(f"{what} must be a dict, not {_describe(state_dict)}{hint}")


def check_callback(callback: Any, *, what: str = "callback", hint: str = "") -> None:
    """Check that ``callback`` is ``None`` or callable (a completion callback runs only
    after the commit: a wrong one would fail a save that is already on disk).

    Raises:
        InvalidArgumentError: it is anything else (e.g. a ``SaveResult`` or a string).
    """
    if callback is not None and not callable(callback):
        raise InvalidArgumentError(
            f"{what} must be callable (called with the SaveResult or the exception) or None, "
            f"not {_describe(callback)}{hint}"
        )


def int_key(name: str) -> int | None:
    """The ``int`` dict key whose ``str`` is ``name`` (DCP records every key as
    ``str(key)``), or ``None`` when ``name`` is not the ``str`` of an ``int``
    (``"07"``, ``"+1"`` and ``" 1"`` are not)."""
    try:
        value = int(name)
    except ValueError:
        return None
    return value if str(value) == name else None


def check_step_info(metrics: Any, metadata: Any) -> dict[str, Any]:
    """The manifest fields of a save's ``metrics`` and user ``metadata`` (only those
    given), checked at the API.

    Args:
        metrics: ``None``, or a mapping of ``str`` names to finite numbers (``int`` or
            ``float``, ``bool`` excluded), e.g. ``{"val_loss": 0.31}``: what ``BestN``
            ranks steps by.
        metadata: ``None``, or a ``dict`` with ``str`` keys that ``json.dumps`` writes
            (no NaN or infinity), e.g. ``{"epoch": 3, "data": "shard-17"}``.

    Returns:
        ``{"metrics": {...}, "metadata": {...}}`` with the given ones (floats and
        plain dicts).

    Raises:
        InvalidArgumentError: either is of the wrong shape (nothing is staged).
    """
    fields: dict[str, Any] = {}
    if metrics is not None:
        if not isinstance(metrics, Mapping):
            raise InvalidArgumentError(f"metrics must be a dict of names to numbers, not {type(metrics).__name__}")
        out: dict[str, float] = {}
        for name, value in metrics.items():
            if not isinstance(name, str) or not name:
                raise InvalidArgumentError(f"a metric's name must be a non-empty str, not {name!r}")
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise InvalidArgumentError(f"metric {name!r} must be a finite int or float, not {value!r}")
            out[name] = float(value)
        fields["metrics"] = out
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
            raise InvalidArgumentError("metadata must be a dict with str keys (stored as JSON in the manifest)")
        try:
            fields["metadata"] = json.loads(json.dumps(metadata, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"metadata must be JSON-serializable: {exc}") from None
    return fields
