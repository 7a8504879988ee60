"""``rtnb ps``, ``rtnb attach RUN`` and ``rtnb stop RUN``: detached groups from a
terminal, through the public face (batch code never reaches into the driver)."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from rtnb.core._output import print_sink
from rtnb.core._text import format_table, mean_over_ranks

__all__ = ["detached_command"]

# How often the followed cell's progress line is printed.
PROGRESS_EVERY_S = 5.0


def detached_command(command: str, run: str | None, address: str | None) -> int:
    import rtnb

    if command == "ps":
        _print_groups(rtnb.detached_groups(address))
        return 0
    if command == "stop":
        rtnb.stop_detached(run, address=address)
        print(f"rtnb: the detached group of run {run!r} is stopped; its CPUs/GPUs are free")
        return 0
    # Ctrl-C must reach the follow even when this process was started with SIGINT
    # ignored (a background job of a script inherits that): it is how one leaves.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return _follow(rtnb.attach(run, address=address, observe=True))


def _since(when: float) -> str:
    seconds = max(0.0, time.time() - when)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _print_groups(groups: list[Any]) -> None:
    if not groups:
        print("rtnb: no detached groups")
        return
    rows = [
        [
            g.run,
            str(g.ranks),
            g.state + (f" ({g.cell})" if g.cell else ""),
            "-" if g.step is None else str(g.step),
            _since(g.since),
            f"{g.cpus:g} CPU" + (f", {g.gpus:g} GPU" if g.gpus else ""),
            g.held_by or "no kernel",
        ]
        for g in groups
    ]
    print(format_table([["run", "ranks", "state", "step", "since", "holds", "attached"], *rows]))


def _progress(session: Any) -> str:
    last = session.metrics.last
    if not last:
        return "no reports yet"
    step = max(r.step for r in last.values())
    means = mean_over_ranks({rank: report.metrics for rank, report in last.items()})
    shown = "  ".join(f"{name}={value:.4g}" for name, value in list(means.items())[:6])
    return f"step {step}  {shown}".rstrip()


def _flushed(sink: Any) -> Any:
    """Each line out at once, also into a pipe (`rtnb attach RUN | tee log`)."""

    def write(rank: int, stream: str, text: str) -> None:
        sink(rank, stream, text)
        sys.stdout.flush()

    return write


def _follow(session: Any) -> int:
    """Print the running cell's output and a progress line until it ends; Ctrl-C
    leaves it running."""
    run = session.run_name
    try:
        cell = session.active_cell
        if cell is None:
            ended = session.cells[-1] if session.cells else None
            print(
                f"rtnb: run {run!r} has no cell running"
                + (f" ({ended.name} ended)" if ended else "")
            )
            return 0
        print(f"rtnb: following {cell.name} of run {run!r} (Ctrl-C leaves it running)")
        print(f"rtnb: {_progress(session)}", flush=True)
        cell.add_sink(_flushed(print_sink()), replay=False)
        while not cell.wait_done(PROGRESS_EVERY_S):
            print(f"rtnb: {_progress(session)}", flush=True)
        print(f"rtnb: {_progress(session)}")
        try:
            value = cell.wait(0)
        except Exception as exc:  # noqa: BLE001 - the cell's own error, in one line
            print(f"rtnb: {cell.name} failed: {exc}", file=sys.stderr)
            return 1
        print(f"rtnb: {cell.name} ended:\n{value!r}")
        return 0
    except KeyboardInterrupt:
        print(
            f"\nrtnb: run {run!r} is left running: `rtnb attach {run}` follows it again, "
            f"`rtnb stop {run}` frees it",
            flush=True,
        )
        # Out at once: this process holds nothing, and a Ray shutdown would first wait
        # for the follow call in flight (up to a minute on a busy machine).
        os._exit(130)
    finally:
        session.release()
