"""What a user-started Ray prints in the kernel about rtnb's own ranks.

A Ray started by the user's ``ray.init()`` (``log_to_driver`` on, Ray's default)
streams every worker's and raylet's output to its driver, the kernel, where it
lands under whatever cell runs. rtnb's ranks write none of their own there (a
cell's prints are captured on the rank), but two things about rtnb's machinery
did: torch's store client on a surviving rank logs a warning with ~20 native
stack frames when a peer's socket closes (a rank died, or the group stopped),
and the raylet reports every rank process that died ("A worker died or was
killed ..."), which rtnb already reports in one line of its own.

:func:`quiet_rank_machinery` drops exactly those lines, for the pids of rtnb's
ranks, from Ray's stream in this process. Everything else still reaches the user:
what their code writes at the file-descriptor level on a rank, other actors'
output, Ray's own messages about other workers.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable

__all__ = ["quiet_rank_machinery", "watch_ranks"]

# A store-client warning ("[c10d] waitForInput ...", "[c10d] recvValueWithTimeout
# failed ...") and the native stack trace torch prints after it.
_STORE_NOISE = re.compile(r"\[c10d\] (waitForInput|recvValueWithTimeout|.*TCPStore)")
_TRACE_LINE = re.compile(r"^(Exception raised from |frame #\d+: |<omitting python frames>|\s*$)")
_DEAD_WORKER = re.compile(r"A worker died or was killed .* Worker PID: (\d+)")

_rank_pids: set[int] = set()
_in_trace: dict[int, bool] = {}
_lock = threading.Lock()
_installed = False


def watch_ranks(pids: Iterable[int]) -> None:
    """The pids of a group's ranks, whose machinery lines are dropped (kept after
    the group ends: the raylet reports a rank's death after rtnb has rebuilt)."""
    with _lock:
        _rank_pids.update(pids)


def quiet_rank_machinery() -> None:
    """Filter what Ray prints in this process about workers (idempotent; private
    Ray hooks, so a Ray without them prints as it did)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        try:
            from ray._private import worker
            from ray._private.ray_logging import global_worker_stdstream_dispatcher
        except Exception:  # noqa: BLE001 - a Ray without the hooks
            return
        # The stream of the workers' output (with log_to_driver only)...
        global_worker_stdstream_dispatcher.emit = _filtered(global_worker_stdstream_dispatcher.emit)
        # ...and the errors the raylet publishes (a dead worker), printed by every
        # driver whatever its log_to_driver, through this module-level function.
        printer = worker.print_to_stdstream
        worker.print_to_stdstream = lambda data, **kw: _filtered(lambda d: printer(d, **kw))(data)


def _filtered(emit: Callable[[dict], None]) -> Callable[[dict], None]:
    def filtered_emit(data: dict) -> None:
        try:
            lines = _without_rank_machinery(data.get("pid"), data.get("lines") or [])
        except Exception:  # noqa: BLE001 - an unexpected batch goes through untouched
            emit(data)
            return
        if lines:
            emit({**data, "lines": lines})

    return filtered_emit


def _without_rank_machinery(pid: object, lines: list[str]) -> list[str]:
    # Ray sends the pid as a number or as its text, depending on the path.
    if str(pid) == "raylet":
        return [line for line in lines if not _reports_a_dead_rank(line)]
    rank_pid = int(pid) if isinstance(pid, int) or str(pid).isdigit() else None
    if rank_pid not in _rank_pids:
        return lines
    kept: list[str] = []
    # A trace can run on into the next batch of the same rank.
    in_trace = _in_trace.get(rank_pid, False)
    for line in lines:
        if _STORE_NOISE.search(line):
            in_trace = True
        elif not (in_trace and _TRACE_LINE.match(line)):
            in_trace = False
            kept.append(line)
    _in_trace[rank_pid] = in_trace
    return kept


def _reports_a_dead_rank(line: str) -> bool:
    match = _DEAD_WORKER.search(line)
    return match is not None and int(match.group(1)) in _rank_pids
