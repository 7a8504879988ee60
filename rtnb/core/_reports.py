"""Reports travel as columns: one array per metric per poll, not one dict per report.

At 10-200 kHz per rank a dict (or a class) per report costs the driver more than
the ranks spend computing it, so a rank gathers its reports into
:class:`ReportColumns` and each poll ships one :class:`ReportBatch`: the steps, the
wall times and one column per metric. A column is an ``array('d')`` (or
``array('q')`` when every value is an int) when every report of the batch had a
number for it, else a list of portable values (float, int, str or None for "not
reported"). Raw objects such as tensors never cross the wire: they become numbers
or their ``repr``. A CUDA scalar (``report({"loss": loss})``) is read at the poll,
not at the report: reading it there would make the training loop wait for the
GPU at every step.
"""

from __future__ import annotations

import base64
import math
import sys
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rtnb.core._text import to_number

__all__ = ["ReportBatch", "ReportColumns", "pack_column", "portable_metric", "unpack_column"]

Column = Any  # array('d') | array('q') | list[float | int | str | None]


def portable_metric(value: Any) -> float | int | str | None:
    """What a metric value becomes on the wire and on disk: ints stay ints, other
    numbers (0-d tensors and arrays included) become floats, non-finite floats their
    name ("nan", "inf"), anything else its ``repr``; None stays "not reported"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    number = to_number(value)
    if number is None:
        return repr(value)
    return number if math.isfinite(number) else str(number)


class _OnDevice:
    """A CUDA scalar as reported, kept on its GPU until the poll reads it."""

    __slots__ = ("stream", "tensor")

    def __init__(self, value: Any) -> None:
        import torch

        # A copy queued on the loop's own stream, as the loop may change its tensor in
        # place later; the poll reads it on that stream, after the work it depends on.
        self.stream = torch.cuda.current_stream(value.device)
        self.tensor = value.detach().reshape(()).clone()


def _held(value: Any) -> Any:
    """What ``ReportColumns.add`` keeps of a value that is not a plain number."""
    if getattr(value, "is_cuda", False) and value.numel() == 1:
        return _OnDevice(value)
    return portable_metric(value)


def _read_device_values(columns: dict[str, list]) -> None:
    """Replace each held CUDA scalar by its number: one copy per stream and dtype."""
    import torch

    groups: dict[tuple, list[tuple[list, int, Any]]] = {}
    for column in columns.values():
        for i, value in enumerate(column):
            if type(value) is _OnDevice:
                key = (value.stream, value.tensor.dtype)
                groups.setdefault(key, []).append((column, i, value.tensor))
    for (stream, _dtype), held in groups.items():
        try:
            with torch.cuda.stream(stream):
                numbers = torch.stack([tensor for _, _, tensor in held]).cpu().tolist()
        except Exception:  # noqa: BLE001 - a broken CUDA context fails the cell itself
            numbers = [None] * len(held)
        for (column, i, _), number in zip(held, numbers):
            column[i] = portable_metric(number)


_NON_FINITE = ("nan", "inf", "-inf")
_PLAIN = frozenset((float, int, str, type(None)))


def _plottable(value: float | int | str | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, str):
        return float(value) if value in _NON_FINITE else None
    return float(value)


def _column(values: list) -> Column:
    try:
        packed = array("d", values)
    except Exception:  # noqa: BLE001 - None, str, a multi-element tensor...: slow path
        return [portable_metric(v) for v in values]
    if type(values[0]) is int and all(type(v) is int for v in values):
        try:
            return array("q", values)
        except OverflowError:
            pass
    if not math.isfinite(sum(packed)):
        # NaN/inf are kept as their names in the record, like every other path.
        return [portable_metric(v) for v in values]
    return packed


_CODES = {"q": "int64", "d": "float64"}
_TYPECODES = {name: code for code, name in _CODES.items()}


def pack_column(column: Column) -> Any:
    """A column as JSON: a list, or ``{"float64"|"int64": base64}`` for an array."""
    if not isinstance(column, array):
        return column
    if sys.byteorder != "little":
        column = array(column.typecode, column)
        column.byteswap()
    return {_CODES[column.typecode]: base64.b64encode(column.tobytes()).decode("ascii")}


def unpack_column(packed: Any) -> list:
    """The values of a column written by :func:`pack_column`, as a list."""
    if not isinstance(packed, dict):
        return packed
    [(kind, text)] = packed.items()
    column = array(_TYPECODES[kind])
    column.frombytes(base64.b64decode(text))
    if sys.byteorder != "little":
        column.byteswap()
    return column.tolist()


@dataclass
class ReportBatch:
    """A rank's reports since its previous poll, column by column."""

    steps: array = field(default_factory=lambda: array("q"))
    times: array = field(default_factory=lambda: array("d"))
    columns: dict[str, Column] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.steps)

    @classmethod
    def from_records(cls, records: list[tuple[int, float, dict]]) -> ReportBatch:
        collected = ReportColumns()
        for step, when, metrics in records:
            collected.add(step, when, metrics)
        return collected.take() or cls()

    def rows(self) -> Iterator[tuple[int, float, dict[str, Any]]]:
        """The reports one by one (for exporters that want them so)."""
        names = list(self.columns)
        columns = [self.columns[n] for n in names]
        for i, (step, when) in enumerate(zip(self.steps, self.times)):
            yield (
                step,
                when,
                {n: c[i] for n, c in zip(names, columns) if c[i] is not None},
            )

    def last_metrics(self) -> dict[str, Any]:
        return {n: c[-1] for n, c in self.columns.items() if len(c) and c[-1] is not None}

    def numbers(self, name: str) -> tuple[Any, Any, Any]:
        """(steps, times, values) of the reports that have a number for ``name``."""
        column = self.columns[name]
        if isinstance(column, array):
            return self.steps, self.times, column
        keep = [(i, x) for i, x in enumerate(map(_plottable, column)) if x is not None]
        return (
            array("q", (self.steps[i] for i, _ in keep)),
            array("d", (self.times[i] for i, _ in keep)),
            array("d", (x for _, x in keep)),
        )

    def to_json(self, rank: int) -> dict[str, Any]:
        """One line of the metrics record: this batch as columns (numeric columns as
        base64 of little-endian int64/float64: writing floats as decimal text costs
        the kernel ~0.4 us each, more than everything else a report costs it)."""
        return {
            "rank": rank,
            "step": pack_column(self.steps),
            "timestamp": pack_column(self.times),
            "metrics": {n: pack_column(c) for n, c in self.columns.items()},
        }


class ReportColumns:
    """The rank's side: ``add`` is the hot path of ``rtnb.report``; ``take`` packs
    what was added into a :class:`ReportBatch` (in the poll thread)."""

    __slots__ = ("_steps", "_times", "_columns", "_keys", "_same", "_on_device")

    def __init__(self) -> None:
        self._steps: list[int] = []
        self._times: list[float] = []
        self._columns: dict[str, list] = {}
        # The previous report's keys and their columns: most loops report the same
        # keys every step, and then a report is one append per value.
        self._keys: tuple = ()
        self._same: list[list] = []
        self._on_device = False

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step: int, when: float, metrics: dict) -> int:
        """Record one report; returns how many are buffered now."""
        keys = tuple(metrics)
        if keys == self._keys:
            for column, value in zip(self._same, metrics.values()):
                if type(value) not in _PLAIN:
                    # Now, not at the next poll: a tensor may be changed in place later.
                    value = _held(value)
                    self._on_device = self._on_device or type(value) is _OnDevice
                column.append(value)
        else:
            n = len(self._steps)
            columns = self._columns
            for name, value in metrics.items():
                if type(value) not in _PLAIN:
                    value = _held(value)
                    self._on_device = self._on_device or type(value) is _OnDevice
                column = columns.get(name)
                if column is None:
                    column = columns[name] = [None] * n
                elif len(column) != n:
                    column.extend([None] * (n - len(column)))
                column.append(value)
            self._keys = keys
            self._same = [columns[name] for name in keys]
        self._steps.append(step)
        self._times.append(when)
        return len(self._steps)

    def take(self) -> ReportBatch | None:
        n = len(self._steps)
        if not n:
            return None
        steps, times, columns = self._steps, self._times, self._columns
        self._steps, self._times, self._columns = [], [], {}
        self._keys, self._same = (), []
        if self._on_device:
            self._on_device = False
            _read_device_values(columns)
        for column in columns.values():
            if len(column) != n:
                column.extend([None] * (n - len(column)))
        return ReportBatch(
            steps=array("q", steps),
            times=array("d", times),
            columns={name: _column(values) for name, values in columns.items()},
        )
