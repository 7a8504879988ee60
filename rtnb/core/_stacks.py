"""Where every rank's cell is right now: one rank's stack, and the group's folded.

A rank takes its cell thread's stack itself (:func:`thread_stack`, on a thread of its
own, so a rank busy in Python still answers); a rank that does not answer in time
(its Python blocked in native code that holds the GIL) is read from outside with
``py-spy dump`` (:func:`parse_py_spy`). Both give a :class:`RankStack` whose frames
start at the user's cell (rtnb's own exec machinery is left out), so the folded
view (:func:`fold`) says "rank 1: in all_reduce at cell [5] line 12" and names the
odd ranks: those whose stack differs from most ranks'.
"""

from __future__ import annotations

import enum
import html
import linecache
import re
import sys
import traceback
from dataclasses import dataclass, field

__all__ = [
    "GroupStacks",
    "RankStack",
    "StackFrame",
    "StackMethod",
    "StackSet",
    "fold",
    "is_cell_file",
    "parse_py_spy",
    "thread_stack",
]

# Cell code is compiled under "<rtrain In[5]>" (the notebook's label) or
# "<rtrain-cell-3>" (rtnb's number); see core._messages.CellRequest.filename.
_CELL_FILE = re.compile(r"^<rtrain(?: In(\[\d+\])|-cell-(\d+))>$")
_CELL_DEPTH = 60  # innermost frames kept per rank: a deep recursion stays readable


class StackMethod(str, enum.Enum):
    PYTHON = "python"  # the rank took its own stack (sys._current_frames)
    PY_SPY = "py-spy"  # read from outside: the rank's Python did not answer
    NONE = "none"  # neither worked: see the rank's note

    def __str__(self) -> str:
        return self.value


def is_cell_file(filename: str) -> bool:
    return _CELL_FILE.match(filename) is not None


def cell_name(filename: str) -> str | None:
    """``cell [5]`` (a notebook cell) or ``cell 3`` (rtnb's number) for a cell's
    compiled file name, else None."""
    match = _CELL_FILE.match(filename)
    if match is None:
        return None
    return f"cell {match.group(1) or match.group(2)}"


@dataclass(frozen=True)
class StackFrame:
    filename: str
    lineno: int
    function: str
    text: str = ""  # the source line, when known

    @property
    def in_cell(self) -> bool:
        return is_cell_file(self.filename)

    @property
    def where(self) -> str:
        """``cell [5] line 12`` for the user's cell, else ``file.py:120``."""
        cell = cell_name(self.filename)
        if cell is not None:
            return f"{cell} line {self.lineno}"
        return f"{_short_path(self.filename)}:{self.lineno}"

    @property
    def key(self) -> tuple[str, int, str]:
        return (self.filename, self.lineno, self.function)


@dataclass
class RankStack:
    """One rank's cell thread, outermost frame first (from the user's cell on)."""

    rank: int
    running: bool  # a cell was running on the rank
    frames: list[StackFrame] = field(default_factory=list)
    method: StackMethod = StackMethod.PYTHON
    note: str = ""  # why there is no stack, or how it was read
    pid: int = 0

    @property
    def key(self) -> tuple:
        if not self.running:
            return ("idle",)
        if not self.frames:
            return ("unknown", self.note)
        return tuple(f.key for f in self.frames)

    @property
    def innermost(self) -> StackFrame | None:
        return self.frames[-1] if self.frames else None

    @property
    def cell_frame(self) -> StackFrame | None:
        """The innermost frame in the user's cell code."""
        return next((f for f in reversed(self.frames) if f.in_cell), None)

    def summary(self) -> str:
        """``in all_reduce (distributed_c10d.py:2950) at cell [5] line 12``."""
        if not self.running:
            return "no cell running"
        inner = self.innermost
        if inner is None:
            return self.note or "stack unknown"
        cell = self.cell_frame
        text = f"in {inner.function}"
        if cell is None:
            return f"{text} ({inner.where})"
        if cell is not inner:
            text += f" ({inner.where})"
        return f"{text} at {cell.where}"


@dataclass(frozen=True)
class StackSet:
    """Ranks whose stacks are identical, folded into one."""

    ranks: tuple[int, ...]
    stack: RankStack
    odd: bool  # fewer ranks are here than in the largest set

    def label(self) -> str:
        who = "rank" if len(self.ranks) == 1 else "ranks"
        return f"{who} {_ranges(self.ranks)}"


@dataclass
class GroupStacks:
    """Every rank's stack at one moment, folded; how long the collection took."""

    stacks: dict[int, RankStack]
    elapsed_s: float = 0.0
    stalled_s: float | None = None  # set when the hang doctor asked (no activity for this long)

    @property
    def sets(self) -> list[StackSet]:
        return fold(self.stacks)

    @property
    def odd_ranks(self) -> list[int]:
        return sorted(r for s in self.sets if s.odd for r in s.ranks)

    @property
    def methods(self) -> dict[int, StackMethod]:
        return {r: s.method for r, s in self.stacks.items()}

    def headline(self) -> str:
        """One line: ``rank 1: in all_reduce at cell [5] line 12; ranks 0,2,3: in
        __next__ (dataloader.py:630) at cell [5] line 9``, odd ranks first."""
        return "; ".join(f"{s.label()}: {s.stack.summary()}" for s in self.sets)

    def text(self) -> str:
        lines = []
        if self.stalled_s is not None:
            lines.append(f"no report or output for {self.stalled_s:.0f} s")
        for folded in self.sets:
            stack = folded.stack
            mark = "  <- differs" if folded.odd else ""
            how = "" if stack.method is StackMethod.PYTHON else f" [{stack.method}]"
            lines.append(f"{folded.label()}: {stack.summary()}{how}{mark}")
            for frame in stack.frames:
                lines.append(f"    {frame.where} in {frame.function}")
                if frame.text:
                    lines.append(f"        {frame.text}")
            if stack.note and stack.method is not StackMethod.PYTHON:
                lines.append(f"    ({stack.note})")
        return "\n".join(lines)

    def html(self) -> str:
        """The folded stacks for a notebook: odd ranks highlighted, the user's cell
        frames in bold, rtnb's and libraries' frames dimmed."""
        parts = [
            '<div class="rtnb-stacks" style="font-family:var(--jp-code-font-family,monospace);font-size:12px">'
        ]
        if self.stalled_s is not None:
            parts.append(
                '<div style="color:var(--jp-error-color1,#d32f2f);font-weight:bold">'
                f"⚠ no report or output for {self.stalled_s:.0f} s</div>"
            )
        for folded in self.sets:
            stack = folded.stack
            style = (
                "color:var(--jp-error-color1,#d32f2f);font-weight:bold"
                if folded.odd
                else "font-weight:bold"
            )
            how = (
                ""
                if stack.method is StackMethod.PYTHON
                else f" <i>[{html.escape(str(stack.method))}]</i>"
            )
            parts.append(
                f'<div class="rtnb-stack-set" style="margin-top:4px"><span style="{style}">'
                f"{html.escape(folded.label())}</span>: {html.escape(stack.summary())}{how}"
            )
            rows = []
            for frame in stack.frames:
                weight = "font-weight:bold" if frame.in_cell else "opacity:0.75"
                source = f" — <code>{html.escape(frame.text)}</code>" if frame.text else ""
                rows.append(
                    f'<div style="margin-left:2em;{weight}">{html.escape(frame.where)} in '
                    f"{html.escape(frame.function)}{source}</div>"
                )
            if stack.note and stack.method is not StackMethod.PYTHON:
                rows.append(
                    f'<div style="margin-left:2em;opacity:0.75">({html.escape(stack.note)})</div>'
                )
            parts.append("".join(rows) + "</div>")
        parts.append("</div>")
        return "".join(parts)

    def _repr_html_(self) -> str:
        return self.html()

    def __repr__(self) -> str:
        return self.text()


def fold(stacks: dict[int, RankStack]) -> list[StackSet]:
    """Ranks with identical stacks together, the odd sets first. Odd: fewer ranks
    than the largest set; when every set is as large (two ranks that differ), the
    ones not waiting inside a collective (its peers wait for them)."""
    by_key: dict[tuple, list[int]] = {}
    for rank in sorted(stacks):
        by_key.setdefault(stacks[rank].key, []).append(rank)
    sizes = {len(r) for r in by_key.values()}
    largest = max(sizes, default=0)
    tie = len(by_key) > 1 and len(sizes) == 1

    def odd(ranks: list[int]) -> bool:
        if len(by_key) < 2:
            return False
        if not tie:
            return len(ranks) < largest
        waiting = [_in_collective(stacks[r[0]]) for r in by_key.values()]
        return any(waiting) and not all(waiting) and not _in_collective(stacks[ranks[0]])

    sets = [StackSet(tuple(ranks), stacks[ranks[0]], odd(ranks)) for ranks in by_key.values()]
    return sorted(sets, key=lambda s: (not s.odd, s.ranks[0]))


def _in_collective(stack: RankStack) -> bool:
    return any("torch/distributed" in f.filename.replace("\\", "/") for f in stack.frames)


def thread_stack(rank: int, thread_id: int | None, running: bool, pid: int = 0) -> RankStack:
    """The stack of ``thread_id`` in this process, from the user's cell code on."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    if not running or frame is None:
        return RankStack(rank, running=running and frame is not None, pid=pid)
    summary = traceback.extract_stack(frame, limit=None)
    frames = [
        StackFrame(f.filename, f.lineno or 0, f.name, (f.line or "").strip()) for f in summary
    ]
    return RankStack(rank, True, _from_cell(frames), StackMethod.PYTHON, pid=pid)


def _from_cell(frames: list[StackFrame]) -> list[StackFrame]:
    """The frames from the first one in a user's cell on (rtnb's exec machinery is
    not the user's); all of them when no cell frame is there (a frame in a function
    the cell defined in a module). The innermost ``_CELL_DEPTH`` at most."""
    first = next((i for i, f in enumerate(frames) if f.in_cell), 0)
    kept = frames[first:]
    return kept[-_CELL_DEPTH:]


# "    all_reduce (torch/distributed/distributed_c10d.py:2950)" and, with --locals or
# newer py-spy, "    <module> (<rtrain In[5]>:12)".
_PY_SPY_FRAME = re.compile(r"^\s+(?P<func>.+?) \((?P<file>.+):(?P<line>\d+)\)\s*$")
_PY_SPY_THREAD = re.compile(
    r'^Thread (?P<id>0x[0-9A-Fa-f]+|\d+) \((?P<state>[^)]*)\)(?:: "(?P<name>[^"]*)")?'
)


def parse_py_spy(rank: int, text: str, pid: int = 0) -> RankStack:
    """The cell thread's stack in ``py-spy dump``'s output: the thread with a frame
    in a user's cell (else the one named ``rtnb-cell``). py-spy prints innermost
    first; a :class:`RankStack` is outermost first."""
    threads: list[tuple[str, list[StackFrame]]] = []
    for line in text.splitlines():
        head = _PY_SPY_THREAD.match(line)
        if head is not None:
            threads.append((head.group("name") or "", []))
            continue
        frame = _PY_SPY_FRAME.match(line)
        if frame is not None and threads:
            filename = frame.group("file")
            lineno = int(frame.group("line"))
            source = (
                linecache.getline(filename, lineno).strip() if not filename.startswith("<") else ""
            )
            threads[-1][1].append(StackFrame(filename, lineno, frame.group("func"), source))
    chosen = next((frames for _, frames in threads if any(f.in_cell for f in frames)), None)
    if chosen is None:
        chosen = next((frames for name, frames in threads if name == "rtnb-cell"), None)
    if chosen is None:
        return RankStack(rank, True, [], StackMethod.NONE, "py-spy found no cell thread", pid)
    frames = list(reversed(chosen))
    return RankStack(
        rank, True, _from_cell(frames), StackMethod.PY_SPY, "read with py-spy dump", pid
    )


def _short_path(path: str) -> str:
    """``torch/distributed/distributed_c10d.py`` for a file under site-packages."""
    for marker in ("site-packages/", "dist-packages/", "/lib/python"):
        at = path.rfind(marker)
        if at >= 0:
            rest = path[at + len(marker) :]
            return rest.split("/", 1)[1] if marker == "/lib/python" and "/" in rest else rest
    return path


def _ranges(ranks: tuple[int, ...]) -> str:
    """``0-3,5`` for (0, 1, 2, 3, 5)."""
    parts: list[str] = []
    start = prev = None
    for r in ranks:
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = r
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(parts)
