"""A cell's code on a rank: compiled as IPython runs a cell (the last expression's
value is the cell's), its source kept for tracebacks, its errors shown from the
user's first frame on. A part of the rank's runtime; no state but caches."""

from __future__ import annotations

import ast
import linecache
import traceback
from collections import deque
from types import CodeType

__all__ = ["CellSources", "error_summary", "split_last_expression", "user_traceback"]

# Source of this many recent cells stays in linecache for tracebacks; older cells'
# source is dropped so a long session does not grow the rank's memory per cell.
_LINECACHE_CELLS = 256
# Compiled cells by their code, oldest first (a rank runs one cell at a time).
_COMPILED: dict[str, tuple[CodeType, CodeType | None]] = {}
_COMPILED_KEPT = 32


def split_last_expression(code: str, filename: str) -> tuple[CodeType, CodeType | None]:
    """Compile ``code`` into (body, last_expression_or_None), as IPython does.

    A cell run again (a loop of cells, a re-run notebook) reuses its compiled code
    under its new name: parsing and compiling were a tenth of a trivial cell's
    Python time on a rank."""
    compiled = _COMPILED.get(code)
    if compiled is None:
        tree = ast.parse(code, filename=filename, mode="exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last_node = tree.body.pop()
            last = compile(ast.Expression(last_node.value), filename, "eval")
        compiled = (compile(tree, filename, "exec"), last)
        _COMPILED[code] = compiled
        while len(_COMPILED) > _COMPILED_KEPT:
            _COMPILED.pop(next(iter(_COMPILED)))
    body, last = compiled
    if body.co_filename != filename:
        body = _renamed(body, filename)
        last = _renamed(last, filename) if last is not None else None
    return body, last


def _renamed(code: CodeType, filename: str) -> CodeType:
    """``code`` and the functions and classes it defines, named ``filename`` (what
    tracebacks show and read their source lines by)."""
    consts = tuple(_renamed(c, filename) if isinstance(c, CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


class CellSources:
    """The source of the rank's recent cells, where tracebacks and pdb read it."""

    def __init__(self, kept: int = _LINECACHE_CELLS) -> None:
        self._kept = kept
        self._cached: deque[str] = deque()

    def add(self, filename: str, code: str) -> None:
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        self._cached.append(filename)
        while len(self._cached) > self._kept:
            linecache.cache.pop(self._cached.popleft(), None)


def error_summary(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def user_traceback(exc: BaseException, filename: str) -> str:
    """The traceback from the first frame of the user's cell on, as IPython shows
    one (``Cell In[3], line 4`` and the lines up to it, ``---->`` at the one that
    raised): rtnb's own frames (the exec machinery) are noise to the user."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    if isinstance(exc, SyntaxError) or tb is None:
        return "".join(traceback.format_exception_only(type(exc), exc))
    frames = [_frame_text(frame) for frame in traceback.extract_tb(tb)]
    last = "".join(traceback.format_exception_only(type(exc), exc))
    return "Traceback (most recent call last):\n" + "\n".join(frames) + "\n" + last


_CONTEXT_LINES = 2  # shown above the line a frame is at


def _frame_text(frame: traceback.FrameSummary) -> str:
    name = frame.filename
    if name.startswith("<rtrain"):
        # <rtrain In[3]> -> "Cell In[3]"; <rtrain-cell-7> -> "Cell rtrain-cell-7".
        where = f"Cell {name.strip('<>').removeprefix('rtrain ')}, line {frame.lineno}"
        if frame.name != "<module>":
            where += f", in {frame.name}()"
    else:
        where = f"File {name}:{frame.lineno}, in {frame.name}()"
    lineno = frame.lineno or 0
    lines = [where]
    for number in range(max(1, lineno - _CONTEXT_LINES), lineno + 1):
        text = linecache.getline(name, number).rstrip()
        if number < lineno and not text.strip():
            continue
        marker = "---->" if number == lineno else ""
        lines.append(f"{marker:<5} {number} {text}" if text else f"{marker:<5} {number}")
    return "\n".join(lines) + "\n"
