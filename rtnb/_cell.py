"""Running one cell on the ranks: streaming, results, errors, and the stop protocol.

:class:`CellHandle` drives a cell from the driver: it long-polls every rank,
forwards output and reports as they arrive, and turns the ranks' outcomes into a
:class:`PerRank` value or one rtnb error. Stopping (interrupt, timeout,
``handle.stop()``) follows DESIGN.md section 3:

1. cooperative: every rank pauses at its next ``report()``; once all have paused
   they leave together at the same step, so none is left inside a collective;
2. after ``stop_grace_s``: CellStopped is raised inside each rank's cell thread
   (reaches pure-Python loops);
3. after another ``stop_grace_s``: the group is rebuilt (ranks blocked in C++,
   e.g. a collective whose peer has left, cannot be interrupted any other way).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rtnb._values import PerRank, from_portable
from rtnb.errors import CellError, CellInterrupted, RtnbError, WorkerGroupError

if TYPE_CHECKING:
    from rtnb._session import Session

__all__ = ["CellHandle", "OutputSink", "print_sink"]

OutputSink = Callable[[int, str, str], None]

# How often the driver loop wakes to check stop deadlines and Ctrl-C.
_TICK_S = 0.1
# When some ranks have paused for a stop while others still run, give the others
# this long to reach a report() before choosing a later common stop step.
_PAUSE_SKEW_S = 0.5
_LOG_LIMIT = 20_000


class _Restart(Exception):
    """Internal: the cell could not be stopped in place; the group must be rebuilt."""


class _LinePrefixer:
    """Writes rank output line by line with a ``[rank N]`` tag."""

    def __init__(self) -> None:
        self._partial: dict[tuple[int, str], str] = {}

    def __call__(self, rank: int, stream: str, text: str) -> None:
        if rank < 0:  # a note from rtnb itself, not a rank
            (sys.stderr if stream == "stderr" else sys.stdout).write(text)
            return
        key = (rank, stream)
        text = self._partial.pop(key, "") + text
        lines = text.split("\n")
        self._partial[key] = lines.pop()
        if lines:
            out = sys.stderr if stream == "stderr" else sys.stdout
            out.write("".join(f"[rank {rank}] {line}\n" for line in lines))
            out.flush()

    def flush(self) -> None:
        for (rank, stream), rest in list(self._partial.items()):
            if rest:
                out = sys.stderr if stream == "stderr" else sys.stdout
                out.write(f"[rank {rank}] {rest}\n")
                out.flush()
        self._partial.clear()


def print_sink() -> _LinePrefixer:
    return _LinePrefixer()


class CellHandle:
    """A cell running (or finished) on the ranks of a session.

    ``wait()`` returns its :class:`PerRank` value or raises its error; ``stop()``
    stops it on every rank; ``log`` keeps the recent output for late viewers.
    """

    def __init__(
        self,
        session: Session,
        cell_id: int,
        code: str,
        ranks: list[int],
        timeout_s: float | None = None,
        background: bool = False,
    ) -> None:
        self.session = session
        self.cell_id = cell_id
        self.code = code
        self.ranks = ranks
        self.timeout_s = timeout_s
        self.background = background
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.steps: dict[int, int] = {r: 0 for r in ranks}
        self.states: dict[int, str] = {r: "running" for r in ranks}
        self.log: list[tuple[int, str, str]] = []
        self.reported = False
        self.recoveries = 0
        self.recovering = False  # the group is being rebuilt for this cell right now
        self.restarted_from: str | None = None  # checkpoint id of the latest restart
        self.replay = False  # a replayed cell during recovery: no bookkeeping, no recovery
        self._sinks: list[OutputSink] = []
        self._done_callbacks: list[Callable[[CellHandle], None]] = []
        self._done = threading.Event()
        self._value: PerRank | None = None
        self._error: BaseException | None = None
        # Driver loop state; kept on self so the loop can be re-entered after Ctrl-C.
        self._pending: dict[Any, int] = {}
        self._last: dict[int, dict] = {}
        self._finished: dict[int, dict] = {}
        self._dead: dict[int, str] = {}
        self._stop_reason: str | None = None
        self._stop_phase = ""
        self._phase_started = 0.0
        self._first_pause_at: float | None = None
        self._stop_target: int | None = None
        self._interrupt_sent = False
        self._stop_lock = threading.Lock()

    # ---- public ------------------------------------------------------------------------
    def add_sink(self, sink: OutputSink, replay: bool = True) -> None:
        """Send this cell's output to ``sink(rank, stream, text)`` (past output first)."""
        if replay:
            for entry in list(self.log):
                sink(*entry)
        self._sinks.append(sink)

    def add_done_callback(self, callback: Callable[[CellHandle], None]) -> None:
        if self._done.is_set():
            callback(self)
        else:
            self._done_callbacks.append(callback)

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> PerRank:
        """Block until the cell ends; its value per rank, or its error raised."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"cell {self.cell_id} is still running after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value

    result = wait

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def elapsed_s(self) -> float:
        return (self.ended_at or time.time()) - self.started_at

    def stop(self, reason: str = "stopped by the user") -> None:
        """Ask every rank to stop (cooperatively first); returns at once."""
        with self._stop_lock:
            if self._stop_reason is None:
                self._stop_reason = reason
                self._stop_phase = "requested"
            elif self._stop_phase == "cooperative":
                self._enter_phase("raise")  # a second request escalates
            elif self._stop_phase == "raise":
                self._enter_phase("restart")

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<rtnb cell {self.cell_id} on ranks {self.ranks}: {state}, {self.elapsed_s:.1f} s>"

    # ---- driving -----------------------------------------------------------------------
    def run_here(self) -> PerRank:
        """Drive the cell in this thread until it ends (Ctrl-C stops it on every rank)."""
        return self._run_foreground()

    def _run_foreground(self) -> PerRank:
        self._dispatch()
        while not self._done.is_set():
            try:
                self._loop()
            except KeyboardInterrupt:
                self.stop("interrupted (Ctrl-C / kernel interrupt)")
        return self.wait(0)

    def _run_background(self) -> None:
        self._dispatch()
        thread = threading.Thread(target=self._loop, name=f"rtnb-cell-{self.cell_id}", daemon=True)
        thread.start()

    def _dispatch(self) -> None:
        actors = self.session._require_group().actors
        for rank in self.ranks:
            ref = actors[rank].run.remote(self.cell_id, self.code)
            self._pending[ref] = rank

    def _loop(self) -> None:
        while True:
            try:
                self._drive()
            except _Restart:
                recovered = False
                while (
                    self._dead
                    and self._stop_reason is None
                    and not self.replay
                    and self.session._can_recover()
                ):
                    try:
                        self._recover()
                        recovered = True
                        break
                    except _Restart:
                        continue  # a rank died again while the cells were replayed
                    except RtnbError as exc:
                        self._finish(
                            error=WorkerGroupError(
                                f"{self._death_summary()}; recovery failed: {exc}"
                            )
                        )
                        return
                if recovered:
                    continue
                self._finish_with_restart()
                return
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 - never leave a handle hanging
                self._finish(
                    error=exc
                    if isinstance(exc, RtnbError)
                    else WorkerGroupError(f"lost contact with the ranks: {_one_line(exc)}")
                )
                return
            self._finish_normally()
            return

    def _drive(self) -> None:
        import ray

        actors = self.session._require_group().actors
        while len(self._finished) + len(self._dead) < len(self.ranks):
            self._ensure_polled(actors)
            refs = list(self._pending)
            ready, updates = _wait_and_get(ray, refs)
            for ref, update in zip(ready, updates):
                rank = self._pending.pop(ref)
                if isinstance(update, BaseException):
                    self._dead[rank] = _one_line(update)
                    continue
                self._apply(update)
                if update["state"] == "running":
                    self._pending[actors[rank].poll.remote()] = rank
                else:
                    self._finished[rank] = update
            if self._dead:
                raise _Restart()
            if not self.replay:
                self.session._commit_checkpoints(self)
            self._check_timeout()
            self._advance_stop(actors)

    def _death_summary(self) -> str:
        ranks = sorted(self._dead)
        if ranks == [-1]:
            return f"a rank died while the group was rebuilt during cell {self.cell_id} ({self._dead[-1]})"
        ranks = [r for r in ranks if r >= 0]
        return (
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} died during "
            f"cell {self.cell_id} ({self._dead[ranks[0]]})"
        )

    def _recover(self) -> None:
        """Rebuild the group, replay the cells run so far, and run this cell again;
        ``rtnb.get_checkpoint()`` returns the latest committed checkpoint, as when Ray
        Train restarts ``train_loop_per_worker``."""
        what = self._death_summary()
        self.recovering = True
        try:
            died_again = self.session._recover(what)
        finally:
            self.recovering = False
        if died_again:
            self._dead = died_again
            raise _Restart()
        self.recoveries += 1
        latest = self.session.checkpoints.latest()
        self.restarted_from = latest.id if latest else None
        note = (
            f"[rtnb] {what}; worker group rebuilt (recovery {self.session.failures}/"
            f"{self.session.config.max_failures}), {len(self.session.history)} cell(s) replayed, "
            f"cell {self.cell_id} restarted from {latest.id if latest else 'no checkpoint'}\n"
        )
        for sink in list(self._sinks):
            try:
                sink(-1, "stderr", note)
            except Exception:  # noqa: BLE001
                pass
        self._pending.clear()
        self._last.clear()
        self._finished.clear()
        self._dead.clear()
        self.states = {r: "running" for r in self.ranks}
        self._dispatch()

    def _ensure_polled(self, actors) -> None:
        # A Ctrl-C can land between taking an update and re-polling; make sure every
        # unfinished rank always has a call in flight.
        polled = set(self._pending.values())
        for rank in self.ranks:
            if rank not in polled and rank not in self._finished and rank not in self._dead:
                self._pending[actors[rank].poll.remote()] = rank

    def _apply(self, update: dict) -> None:
        rank = update["rank"]
        self._last[rank] = update
        self.steps[rank] = update["step"]
        self.states[rank] = "paused" if update.get("paused_at") is not None else update["state"]
        if update["reports"]:
            self.reported = True
            self.session.metrics.add(rank, update["reports"])
        for step, timestamp, metrics, files in update.get("checkpoints", ()):
            self.session.checkpoints.offer(rank, step, timestamp, metrics, files)
        for stream, text in update["output"]:
            if len(self.log) < _LOG_LIMIT:
                self.log.append((rank, stream, text))
            for sink in list(self._sinks):
                try:
                    sink(rank, stream, text)
                except Exception:  # noqa: BLE001 - a broken view must not stop the cell
                    pass

    # ---- stopping ----------------------------------------------------------------------
    def _check_timeout(self) -> None:
        if (
            self.timeout_s is not None
            and self._stop_reason is None
            and self.elapsed_s > self.timeout_s
        ):
            self.stop(f"timed out after {self.timeout_s:g} s (--timeout)")

    def _enter_phase(self, phase: str) -> None:
        self._stop_phase = phase
        self._phase_started = time.monotonic()

    def _unfinished(self) -> list[int]:
        return [r for r in self.ranks if r not in self._finished and r not in self._dead]

    def _advance_stop(self, actors) -> None:
        phase = self._stop_phase
        if not phase:
            return
        unfinished = self._unfinished()
        grace = self.session.config.stop_grace_s
        waited = time.monotonic() - self._phase_started
        if phase == "requested":
            for rank in unfinished:
                actors[rank].request_stop.remote()
            self._enter_phase("cooperative")
        elif phase == "cooperative":
            paused = {
                r: self._last[r]["paused_at"]
                for r in unfinished
                if self._last.get(r, {}).get("paused_at") is not None
            }
            if paused and self._first_pause_at is None:
                self._first_pause_at = time.monotonic()
            target = None
            if unfinished and len(paused) == len(unfinished):
                target = max(paused.values())
            elif paused and time.monotonic() - self._first_pause_at > _PAUSE_SKEW_S:
                target = max(self.steps[r] for r in unfinished) + 1
            if target is not None and self._stop_target is None:
                self._stop_target = target
                for rank in unfinished:
                    actors[rank].set_stop_target.remote(target)
            if waited > grace:
                self._enter_phase("raise")
        elif phase == "raise":
            if not self._interrupt_sent:
                self._interrupt_sent = True
                for rank in unfinished:
                    actors[rank].interrupt.remote()
            if waited > grace:
                self._enter_phase("restart")
        if self._stop_phase == "restart":
            raise _Restart()

    # ---- outcomes ----------------------------------------------------------------------
    def _finish_normally(self) -> None:
        finished = self._finished
        if self._stop_reason is not None and any(
            u["state"] == "interrupted" for u in finished.values()
        ):
            steps = {finished[r]["step"] for r in finished if finished[r]["state"] == "interrupted"}
            at = (
                f" at step {steps.pop()}"
                if len(steps) == 1 and self._stop_target is not None
                else ""
            )
            how = (
                "at a report() boundary"
                if self._stop_phase == "cooperative"
                else "inside the cell code"
            )
            self._finish(
                error=CellInterrupted(
                    f"cell {self.cell_id} {self._stop_reason}: every rank stopped{at} ({how}); "
                    "the worker group and its variables are intact",
                    kept=True,
                    step=max(u["step"] for u in finished.values()),
                )
            )
            return
        failures = {r: u["error"] for r, u in finished.items() if u["state"] == "error"}
        if failures:
            self._finish(error=CellError.from_failures(failures))
            return
        value = PerRank({r: from_portable(finished[r].get("value")) for r in sorted(finished)})
        self._finish(value=value)

    def _finish_with_restart(self) -> None:
        if self._dead:
            what = self._death_summary()
            if self.session.config.max_failures:
                what += f" after {self.session.failures} recoveries (--max-failures {self.session.config.max_failures})"
            error_cls: type[RtnbError] = WorkerGroupError
        else:
            stuck = self._unfinished()
            what = (
                f"cell {self.cell_id} {self._stop_reason}, but rank{'s' if len(stuck) > 1 else ''} "
                f"{', '.join(map(str, stuck))} did not stop within {2 * self.session.config.stop_grace_s:g} s "
                "(blocked in a collective or in native code)"
            )
            error_cls = CellInterrupted
        try:
            self.session._rebuild(reason=what)
            tail = "the worker group was rebuilt with fresh ranks; variables defined on the ranks are gone"
        except RtnbError as exc:
            tail = f"rebuilding the worker group failed: {exc}"
        message = f"{what}; {tail}"
        error = (
            CellInterrupted(message, kept=False)
            if error_cls is CellInterrupted
            else WorkerGroupError(message)
        )
        self._finish(error=error)

    def _finish(self, value: PerRank | None = None, error: BaseException | None = None) -> None:
        try:
            if not self.replay:
                self.session._commit_checkpoints(self)
        except Exception:  # noqa: BLE001 - a storage error must not hide the cell's outcome
            pass
        for sink in self._sinks:
            flush = getattr(sink, "flush", None)
            if flush is not None:
                flush()
        self._value, self._error = value, error
        self.ended_at = time.time()
        for rank in self.ranks:
            if self.states.get(rank) in ("running", "paused"):
                self.states[rank] = "stopped"
        if not self.replay:
            self.session._cell_ended(self)
        self._done.set()
        for callback in self._done_callbacks:
            try:
                callback(self)
            except Exception:  # noqa: BLE001
                pass


def _wait_and_get(ray, refs: list) -> tuple[list, list]:
    """Whatever ``refs`` are ready within one tick, with their results.

    A short cell usually answers on every rank within the first call, so try a
    single ``ray.get`` of all first: one driver call instead of wait + get.
    """
    try:
        return refs, ray.get(refs, timeout=_TICK_S)
    except ray.exceptions.GetTimeoutError:
        pass
    except ray.exceptions.RayError:
        return refs, _get_each(ray, refs)
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    return ready, _get_each(ray, ready)


def _get_each(ray, refs: list) -> list:
    """Results of ``refs`` in one call when all succeed (the common, fast case); a
    failed ref (its rank died) yields its exception instead of losing the others."""
    if not refs:
        return []
    try:
        return ray.get(refs)
    except ray.exceptions.RayError:
        results = []
        for ref in refs:
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayError as exc:
                results.append(exc)
        return results


def _one_line(exc: BaseException) -> str:
    text = [line for line in str(exc).strip().splitlines() if line.strip()]
    return text[0][:300] if text else type(exc).__name__
