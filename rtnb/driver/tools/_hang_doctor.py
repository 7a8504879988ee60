"""The hang doctor: every rank's stack, asked of the ranks, else read with py-spy.

:class:`StackReader` is the one owner of asking a group where its ranks are
(``%rtnb stacks``, ``Session.stacks()``, and a cell that went quiet for
``--hang-after`` seconds). Each rank answers ``stack()`` on a control thread of
its own while its cell runs. A rank whose Python does not answer within the wait
(blocked in native code that holds the GIL) is read from outside with ``py-spy
dump`` when it runs on this machine; the result says which method gave each stack.

A rank that did not answer keeps its call queued on its actor until its Python is
free again, holding one of the actor's few concurrent slots; such a rank is not
asked again until that call returned (py-spy reads it meanwhile), so asking
repeatedly cannot starve its long-poll.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from rtnb.core._stacks import GroupStacks, RankStack, StackMethod, parse_py_spy
from rtnb.driver.ranks import RankGroup
from rtnb.errors import one_line
from rtnb.worker._commands import Stack

__all__ = ["HangWatch", "StackReader", "py_spy_path"]

# How long a rank's own answer is awaited before py-spy reads it instead.
ANSWER_WAIT_S = 1.0
_PY_SPY_TIMEOUT_S = 10.0


def py_spy_path() -> str | None:
    """py-spy from this Python's environment (its wheel), else from PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


class StackReader:
    """Asks a group's ranks for their stacks; remembers the calls not yet answered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (id of the group, rank) -> the stack call still out on that rank.
        self._outstanding: dict[tuple[int, int], Any] = {}

    def read(
        self,
        group: RankGroup,
        ranks: list[int],
        wait_s: float = ANSWER_WAIT_S,
        stalled_s: float | None = None,
        in_kernel: bool = False,
    ) -> GroupStacks:
        began = time.monotonic()
        calls: dict[Any, int] = {}
        silent: list[int] = []
        with self._lock:
            for rank in ranks:
                out = self._outstanding.get((id(group), rank))
                if out is not None:
                    calls[out] = rank
                else:
                    call = group.command(rank, Stack())
                    self._outstanding[(id(group), rank)] = call
                    calls[call] = rank
        stacks: dict[int, RankStack] = {}
        deadline = began + wait_s
        waiting = list(calls)
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, results = group.take_ready(waiting, left)
            for call, result in zip(ready, results):
                rank = calls[call]
                waiting.remove(call)
                with self._lock:
                    self._outstanding.pop((id(group), rank), None)
                if isinstance(result, RankStack):
                    stacks[rank] = result
                else:
                    stacks[rank] = RankStack(
                        rank, True, method=StackMethod.NONE, note=f"the rank is gone ({result})"
                    )
        for call in waiting:
            silent.append(calls[call])
        for rank in silent:
            stacks[rank] = self._from_outside(group, rank, wait_s, in_kernel)
        for rank in ranks:
            stacks.setdefault(rank, RankStack(rank, False))
        return GroupStacks(stacks, time.monotonic() - began, stalled_s)

    def _from_outside(
        self, group: RankGroup, rank: int, wait_s: float, in_kernel: bool
    ) -> RankStack:
        info = next((i for i in getattr(group, "ranks", []) if i.rank == rank), None)
        silent = f"its Python did not answer within {wait_s:g} s"
        if info is None or in_kernel:
            return RankStack(rank, True, method=StackMethod.NONE, note=silent)
        if info.hostname != socket.gethostname():
            return RankStack(
                rank,
                True,
                method=StackMethod.NONE,
                note=f"{silent}, and it runs on {info.hostname}, where py-spy cannot be run from "
                f"here (run `py-spy dump --pid {info.pid}` there)",
                pid=info.pid,
            )
        return py_spy_stack(rank, info.pid, silent)


def py_spy_stack(rank: int, pid: int, why: str = "") -> RankStack:
    """``py-spy dump`` of process ``pid``, the cell thread's frames."""
    spy = py_spy_path()
    if spy is None:
        return RankStack(
            rank,
            True,
            method=StackMethod.NONE,
            note=f"{why}; `pip install py-spy` to read such a rank from outside",
            pid=pid,
        )
    try:
        done = subprocess.run(
            [spy, "dump", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=_PY_SPY_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return RankStack(rank, True, method=StackMethod.NONE, note=f"{why}; py-spy: {exc}", pid=pid)
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        reason = said[-1] if said else f"exit status {done.returncode}"
        if "permission" in reason.lower() or "not permitted" in reason.lower():
            reason += " (this machine forbids reading another process: ptrace)"
        return RankStack(
            rank, True, method=StackMethod.NONE, note=f"{why}; py-spy: {reason}", pid=pid
        )
    stack = parse_py_spy(rank, done.stdout, pid)
    if stack.method is StackMethod.PY_SPY:
        stack.note = f"{why}: read with py-spy dump"
    return stack


class HangWatch:
    """A running cell's hang doctor: once its ranks have reported and printed nothing
    for ``after_s`` (0: off), every rank's stack is read in a thread (a rank that does
    not answer is read with py-spy, which takes a while) and one line says where each
    waits; :attr:`stacks` keeps them until the ranks move again, and ``keep`` writes
    them where they outlast the kernel (an unattended run has nobody to ask
    ``%rtnb stacks``), returning where ("" when nowhere)."""

    def __init__(
        self,
        after_s: float,
        cell_name: Callable[[], str],
        read: Callable[[float], GroupStacks],
        note: Callable[[str], None],
        ended: Callable[[], bool],
        keep: Callable[[GroupStacks], str] = lambda stacks: "",
    ) -> None:
        self.after_s = after_s
        self.stacks: GroupStacks | None = None
        self._cell_name = cell_name
        self._read = read
        self._note = note
        self._ended = ended
        self._keep = keep
        self._last_activity = time.monotonic()
        self._reading = False

    def moved(self) -> None:
        """The ranks reported or printed (or wait at a prompt: not hung)."""
        self._last_activity = time.monotonic()
        self.stacks = None

    def check(self) -> None:
        if not self.after_s or self._reading:
            return
        quiet = time.monotonic() - self._last_activity
        if self.stacks is not None or quiet < self.after_s:
            return
        self._reading = True
        threading.Thread(
            target=self._diagnose, args=(quiet,), name="rtnb-hang", daemon=True
        ).start()

    def _diagnose(self, quiet: float) -> None:
        try:
            stacks = self._read(quiet)
        except Exception as exc:  # noqa: BLE001 - a diagnosis must never end the cell
            self._note(
                f"[rtnb] {self._cell_name()}: no report or output for {quiet:.0f} s "
                f"({one_line(exc)})\n"
            )
            return
        finally:
            self._reading = False
        if time.monotonic() - self._last_activity < quiet or self._ended():
            return  # it moved on while the stacks were read
        self.stacks = stacks
        try:
            kept = self._keep(stacks)
        except Exception as exc:  # noqa: BLE001 - a diagnosis must never end the cell
            kept = f"nowhere: {one_line(exc)}"
        where = f"; kept in {kept}" if kept else ""
        self._note(
            f"[rtnb] {self._cell_name()} has reported and printed nothing for {quiet:.0f} s: "
            f"{stacks.headline()} (`%rtnb stacks` for the full stacks{where})\n"
        )
