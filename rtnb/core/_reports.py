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
import json
import math
import sys
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from operator import itemgetter
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


def _values_getter(keys: tuple):
    """A function from a report with exactly ``keys`` to its values, in that order."""
    if len(keys) > 1:
        return itemgetter(*keys)
    if keys:
        key = keys[0]
        return lambda metrics: (metrics[key],)
    return lambda metrics: ()


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

    def json_line(self, rank: int) -> bytes:
        """One line of the metrics record: this batch as columns (numeric columns as
        base64 of little-endian int64/float64: writing floats as decimal text costs
        the kernel ~0.4 us each, more than everything else a report costs it).
        Assembled as text rather than with ``json.dumps`` of a dict: base64 needs no
        escaping, and scanning it for escapes was ~0.45 us of kernel CPU per report."""
        metrics = ", ".join(f"{json.dumps(n)}: {_column_json(c)}" for n, c in self.columns.items())
        return (
            f'{{"rank": {int(rank)}, "step": {_column_json(self.steps)}, '
            f'"timestamp": {_column_json(self.times)}, "metrics": {{{metrics}}}}}\n'
        ).encode()


def _column_json(column: Column) -> str:
    packed = pack_column(column)
    if isinstance(packed, dict):
        [(kind, text)] = packed.items()
        return f'{{"{kind}": "{text}"}}'
    return json.dumps(packed)


class ReportColumns:
    """The rank's side: ``add`` is the hot path of ``rtnb.report``; ``take`` packs
    what was added into a :class:`ReportBatch` (in the poll thread).

    Reports are kept column by column already, in segments of reports with the same
    keys (most loops report the same keys every step, so there is one): a report
    appends each value to its key's list. Nothing it allocates is tracked by
    Python's garbage collector (floats, ints and strs are not; a tuple per report
    was): at 40 kHz those tuples set off a young collection every few hundred steps
    and, every ~100k reports, a full one of a torch process's ~200k objects
    (~140 ms on this VM, ~2 us per report).
    """

    __slots__ = (
        "_segments",
        "_keys",
        "_values_of",
        "_width",
        "_cols",
        "_segment_start",
        "_steps",
        "_times",
        "_on_device",
    )

    def __init__(self) -> None:
        # (keys, one list of values per key, how many reports) per closed segment.
        self._segments: list[tuple[tuple, list[list], int]] = []
        self._keys: tuple = ()
        self._values_of = _values_getter(())
        self._width = 0
        self._cols: list[list] = []
        self._segment_start = 0
        self._steps: list[int] = []
        self._times: list[float] = []
        self._on_device = False

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step: int, when: float, metrics: dict) -> int:
        """Record one report; returns how many are buffered now."""
        try:
            # The same keys as the previous report (in any order): their values in
            # this segment's order, in C.
            values = self._values_of(metrics) if len(metrics) == self._width else None
        except KeyError:
            values = None
        if values is None:
            values = self._new_segment(metrics)
        for value in values:
            if type(value) not in _PLAIN:
                # Now, not at the next poll: a tensor may be changed in place later.
                values = tuple(v if type(v) in _PLAIN else _held(v) for v in values)
                self._on_device = self._on_device or _OnDevice in map(type, values)
                break
        for column, value in zip(self._cols, values):
            column.append(value)
        self._steps.append(step)
        self._times.append(when)
        return len(self._steps)

    def _new_segment(self, metrics: dict) -> tuple:
        self._close_segment()
        self._keys = tuple(metrics)
        self._width = len(self._keys)
        self._values_of = _values_getter(self._keys)
        self._cols = [[] for _ in self._keys]
        return tuple(metrics.values())

    def _close_segment(self) -> None:
        count = len(self._steps) - self._segment_start
        if count:
            self._segments.append((self._keys, self._cols, count))
            self._cols = [[] for _ in self._keys]
            self._segment_start = len(self._steps)

    def take(self) -> ReportBatch | None:
        n = len(self._steps)
        if not n:
            return None
        self._close_segment()
        segments = self._segments
        steps, times, on_device = self._steps, self._times, self._on_device
        self._segments, self._segment_start = [], 0
        self._steps, self._times, self._on_device = [], [], False
        if len(segments) == 1:
            keys, cols, _ = segments[0]
            columns = dict(zip(keys, cols))
        else:
            names = dict.fromkeys(name for keys, _, _ in segments for name in keys)
            columns = {name: [] for name in names}
            for keys, cols, count in segments:
                # Every column grows by ``count`` per segment (None where a report
                # lacked the key), so values stay lined up with the steps.
                for name, values in zip(keys, cols):
                    columns[name].extend(values)
                if len(keys) != len(names):
                    gap = [None] * count
                    for name in names.keys() - set(keys):
                        columns[name].extend(gap)
        if on_device:
            _read_device_values(columns)
        return ReportBatch(
            steps=array("q", steps),
            times=array("d", times),
            columns={name: _column(values) for name, values in columns.items()},
        )
