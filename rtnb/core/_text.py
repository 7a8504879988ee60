"""Small shared helpers for numbers and text: one of each, used everywhere.

``to_number`` turns a reported value into a plottable float; ``mean_over_ranks``
is the one definition of "the mean across ranks" (Result.metrics, checkpoint
manifests); ``format_table`` is the one plain-text table (status, runs, CLI).
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Mapping, Sequence
from typing import Any

__all__ = [
    "align_rows",
    "enum_member",
    "format_duration",
    "format_table",
    "mean_over_ranks",
    "to_number",
]


def to_number(value: Any) -> float | None:
    """A plottable float for ``value`` (ints, floats, 0-d tensors/arrays), else None."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    item = getattr(value, "item", None)
    if item is not None:
        try:
            out = item()
        except Exception:  # noqa: BLE001 - not a scalar
            return None
        return float(out) if isinstance(out, (int, float)) else None
    return None


def mean_over_ranks(per_rank: Mapping[int, Mapping[str, Any]]) -> dict[str, float]:
    """Each metric's mean over the ranks that reported it; a metric with a
    non-numeric value on any rank has no mean. The metrics keep the order they were
    reported in (the first is what a plot or a "best" without --score starts from)."""
    names = list(dict.fromkeys(k for metrics in per_rank.values() for k in metrics))
    out: dict[str, float] = {}
    for name in names:
        values = [to_number(m[name]) for m in per_rank.values() if name in m]
        numbers = [v for v in values if v is not None]
        if numbers and len(numbers) == len(values):
            out[name] = statistics.fmean(numbers)
    return out


def align_rows(rows: Sequence[Sequence[str]], right: Collection[str] = ()) -> list[str]:
    """The rows as aligned text lines, the first row the header; the columns whose
    header is in ``right`` (numbers) are right-aligned, the others left-aligned."""
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    header = rows[0]
    return [
        "  ".join(
            cell.rjust(w) if name in right else cell.ljust(w)
            for name, cell, w in zip(header, row, widths)
        ).rstrip()
        for row in rows
    ]


def format_table(rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns, the first row as the header."""
    return "\n".join(align_rows(rows))


def format_duration(seconds: float) -> str:
    """h:mm:ss"""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def enum_member(cls: Any, given: Any) -> Any:
    """``given`` as a member of the enum ``cls``: a member, another enum's member of
    the same name (Ray Train's own), or the name as a string; None when it is none."""
    name = str(getattr(given, "value", given)).upper()
    try:
        return cls(name)
    except ValueError:
        return None
