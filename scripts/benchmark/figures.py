"""Formatting and ratios of measured figures, shared by every table of the report."""

from __future__ import annotations

import math
from typing import Any


def fmt_ms(s: float | None) -> str:
    """Seconds as milliseconds with 2-3 significant digits ('' for None / NaN)."""
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return ""
    ms = s * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 1 else f"{ms:.2f}"


def fmt_x(x: float | None) -> str:
    """A ratio as ``1.23x`` ('' for None / NaN)."""
    return "" if x is None or math.isnan(x) else f"{x:.2f}x"


def committed_ratio(s: dict[str, Any], lim: dict[str, Any]) -> float:
    """Committed time over the mean of the raw writes + fsyncs measured right before and
    right after the system's saves (or the workload's median raw write)."""
    return s["committed_s"] / s.get("raw_write_adjacent_s", lim["raw_write_fsync_s"])
