"""The run journal: an append-only, ordered record of what the ranks were given.

Every action that changes what the ranks hold is one entry in
``{run}/journal/``, written before the action is sent to the ranks (a
write-ahead log): each cell's code and rank subset, each push, each function sent
by value, each checkpoint choice, each start, scale and restart; and, when a cell
ends, an entry with its outcome, duration and whether it reported. Values (pushed
variables, functions) are stored beside their entry as ``{seq}.pkl`` and read
back only when a replay needs them, so the driver keeps no copy in memory.

An entry is written ahead: before ``append`` returns (so before its action reaches
a rank, and before a cell's result reaches the notebook) its line is in a
write-ahead file, with one ``os.write`` to a file opened for appending: in the OS,
so a kernel killed the next instant (SIGKILL, the OOM killer) loses nothing. On a
local run directory that file, ``journal/ahead-*.jsonl``, is the journal. Object
storage cannot append: there the write-ahead file is in this machine's spool
(``RTNB_HOME/journal-spool/``) and one writer thread also puts each entry as a file
of its own in storage, in order, off the cell's critical path; ``flush()`` waits for
them. Reading merges both, so a journal whose last files never reached storage is
whole again on this machine, and the next writer puts what was missing there. A
push's values are written to the same place as its line, before it. A write that
fails is one line (a full disk, a read-only folder): an entry that was not written
ahead was never acted on; one that did not reach object storage is written again
with the next entry.

Entries are never rewritten; a crash can lose at most the line being written
(which a reader skips), never one before it. The journal is what recovery replays after a
failure, what ``--replay`` rebuilds a new kernel's ranks from, and what ``scale``
carries over to a new group (docs/architecture.md, "The journal").
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import posixpath
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from rtnb.core._paths import rtnb_home
from rtnb.errors import SessionError, one_line
from rtnb.storage._layout import JOURNAL, JOURNAL_SPOOL, is_journal_ahead, journal_ahead_file
from rtnb.storage._rundir import RunDirectory

__all__ = ["CellOutcome", "EntryKind", "Journal", "JournalEntry", "ReplayStep"]

FOLDER = JOURNAL


class EntryKind(str, enum.Enum):
    START = "start"  # a session started a group: fresh, or rebuilt with --replay
    CELL = "cell"  # code run on ranks (with a function by value, for Session.run(fn))
    CELL_END = "cell_end"  # a cell's outcome, duration and whether it reported
    PUSH = "push"  # notebook values set on ranks
    DATASETS = "datasets"  # Ray Datasets handed to the ranks (split for each group)
    CHECKPOINT = "checkpoint"  # a checkpoint chosen with load / resume / the browser
    SCALE = "scale"  # a new group of N ranks, the journal replayed onto it
    RESTART = "restart"  # a new group; with keep=False a fresh start (replay stops here)
    CONTROL = "control"  # live controls changed: in a cell (of) from a step, or between cells

    def __str__(self) -> str:
        return self.value


class CellOutcome(str, enum.Enum):
    OK = "ok"
    ERROR = "error"
    INTERRUPTED = "interrupted"

    def __str__(self) -> str:
        return self.value


@dataclass
class JournalEntry:
    seq: int
    kind: EntryKind
    time: float = field(default_factory=time.time)
    cell_id: int | None = None  # rtnb's cell number
    label: str | None = None  # the notebook's name for the cell ("[4]"), when it had one
    code: str | None = None
    ranks: list[int] | None = None  # None: every rank of the group
    once: bool = False  # %%rtrain --once: never replayed
    values: str | None = None  # file beside the entry holding pickled values
    names: list[str] = field(default_factory=list)  # what a push or function set
    checkpoint: str | None = None  # CHECKPOINT: the chosen id
    run: str | None = None  # CHECKPOINT: the run it came from, when another one
    workers: int | None = None  # START/SCALE/RESTART: the group's size
    keep: bool = True  # START/RESTART: the ranks' state was kept (replayed)
    of: int | None = None  # CELL_END: seq of its CELL
    outcome: CellOutcome | None = None
    duration_s: float | None = None
    reported: bool | None = None
    reason: str | None = None  # START/SCALE/RESTART: why the group has this size
    controls: dict[str, Any] | None = None  # CONTROL: name -> new value
    step: int | None = None  # CONTROL: the first step of the cell (of) it holds for
    triggers: list[str] = field(default_factory=list)  # CONTROL: fired at that step

    def to_json(self) -> dict[str, Any]:
        # Fields at their default are left out, so entries stay small to read back.
        # (No dataclasses.asdict: its deep copy costs more than the write, per cell.)
        record = {
            name: value
            for name in _FIELDS
            if (value := getattr(self, name)) != _DEFAULTS.get(name, _NO_DEFAULT) or name in _ALWAYS
        }
        record["kind"] = str(self.kind)
        if self.outcome is not None:
            record["outcome"] = str(self.outcome)
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> JournalEntry:
        known = {f.name for f in fields(cls)}
        entry = cls(**{k: v for k, v in record.items() if k in known})
        entry.kind = EntryKind(entry.kind)
        if entry.outcome is not None:
            entry.outcome = CellOutcome(entry.outcome)
        return entry


_FIELDS = tuple(f.name for f in fields(JournalEntry))
_DEFAULTS = {f.name: f.default for f in fields(JournalEntry) if f.default is not MISSING}
_DEFAULTS["names"] = []
_DEFAULTS["triggers"] = []
_ALWAYS = {"seq", "kind", "time"}
_NO_DEFAULT = object()


@dataclass
class ReplayStep:
    """One action to replay: a push, datasets handed over, or a cell (with the
    values it needs first)."""

    entry: JournalEntry
    skipped: str = ""  # why it is not replayed, when it is not


class Journal:
    """The journal of one run directory; appends are ordered and thread-safe."""

    def __init__(self, run_dir: RunDirectory) -> None:
        self.run_dir = run_dir
        self._lock = threading.Lock()
        self._entries: list[JournalEntry] | None = None
        self._writes: queue.Queue[tuple[str, bytes] | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._write_error: BaseException | None = None
        self._ahead_fd: int | None = None
        self._failed: list[tuple[str, bytes]] = []
        # Where lines are written ahead: the journal folder itself when it is on a
        # local disk, else this machine's spool for the run.
        self._ahead_dir = (
            os.path.join(run_dir.path, FOLDER)
            if run_dir.is_local
            else str(
                rtnb_home() / JOURNAL_SPOOL / hashlib.sha1(run_dir.uri.encode()).hexdigest()[:16]
            )
        )

    # ---- reading -------------------------------------------------------------------
    def entries(self) -> list[JournalEntry]:
        with self._lock:
            if self._entries is None:
                self._entries = self._read_all()
            return list(self._entries)

    def _read_all(self) -> list[JournalEntry]:
        from pyarrow import fs as pafs

        base = posixpath.join(self.run_dir.path, FOLDER)
        try:
            infos = self.run_dir.fs.get_file_info(
                pafs.FileSelector(base, recursive=False, allow_not_found=True)
            )
        except OSError as exc:
            raise SessionError(
                f"the run journal in {self.run_dir.shown(FOLDER)!r} cannot be read "
                f"({one_line(exc)}); nothing was sent to the ranks"
            ) from None
        names = sorted(
            i.base_name
            for i in infos
            if i.type == pafs.FileType.File and i.base_name.endswith(".json")
        )
        stored: dict[int, JournalEntry] = {}
        for name in names:
            try:
                entry = JournalEntry.from_json(self.run_dir.read_json(f"{FOLDER}/{name}"))
            except (OSError, ValueError, TypeError):
                continue  # a torn last entry (crash mid-write) is not an action
            stored[entry.seq] = entry
        ahead = self._read_ahead()
        for seq in sorted(set(ahead) - set(stored)):
            # Written ahead by a process that ended before its files reached storage.
            entry = ahead[seq]
            if entry.values is not None:
                values = os.path.join(self._ahead_dir, entry.values)
                if not os.path.exists(values):
                    continue  # its values never got written: its action never happened
                if not self.run_dir.is_local:
                    with open(values, "rb") as src:
                        self._write(f"{FOLDER}/{entry.values}", src.read())
            if not self.run_dir.is_local:
                self._write(_entry_name(entry), _entry_bytes(entry))
            stored[seq] = entry
        return [stored[seq] for seq in sorted(stored)]

    def _read_ahead(self) -> dict[int, JournalEntry]:
        found: dict[int, JournalEntry] = {}
        try:
            names = sorted(n for n in os.listdir(self._ahead_dir) if is_journal_ahead(n))
        except OSError:
            return found
        for name in names:
            try:
                with open(os.path.join(self._ahead_dir, name), "rb") as src:
                    lines = src.read().splitlines()
            except OSError:
                continue
            for line in lines:
                try:
                    entry = JournalEntry.from_json(json.loads(line))
                except (ValueError, TypeError, KeyError):
                    continue  # a line cut short by a crash mid-write
                found[entry.seq] = entry
        return found

    def read_values(self, entry: JournalEntry) -> bytes:
        if entry.values is None:
            raise ValueError(f"journal entry {entry.seq} holds no values")
        self.flush()
        try:
            with self.run_dir.fs.open_input_stream(
                posixpath.join(self.run_dir.path, FOLDER, entry.values)
            ) as src:
                return src.read()
        except OSError:
            # Not in storage (yet): the copy written ahead on this machine.
            with open(os.path.join(self._ahead_dir, entry.values), "rb") as src:
                return src.read()

    # ---- writing -------------------------------------------------------------------
    def append(self, kind: EntryKind, values: bytes | None = None, **fields_: Any) -> JournalEntry:
        """Add one entry, written ahead (its values first), and return it."""
        self._raise_write_error()
        with self._lock:
            if self._entries is None:
                self._entries = self._read_all()
            seq = self._entries[-1].seq + 1 if self._entries else 1
            entry = JournalEntry(seq=seq, kind=kind, **fields_)
            if values is not None:
                entry.values = f"{seq:08d}.pkl"
                self._write_values_ahead(entry.values, values)
                if not self.run_dir.is_local:
                    self._write(f"{FOLDER}/{entry.values}", values)
            data = _entry_bytes(entry)
            self._write_ahead(data)
            if not self.run_dir.is_local:
                # Object storage cannot append: each entry also goes there as a file.
                self._write(_entry_name(entry), data)
            self._entries.append(entry)
            return entry

    def _write_ahead(self, line: bytes) -> None:
        try:
            if self._ahead_fd is None:
                os.makedirs(self._ahead_dir, mode=0o700, exist_ok=True)
                name = journal_ahead_file(time.time_ns(), os.getpid())
                self._ahead_fd = os.open(
                    os.path.join(self._ahead_dir, name),
                    os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                    0o600,
                )
            # One write of one line: a kill leaves it whole or (cut short) ignored.
            written = os.write(self._ahead_fd, line + b"\n")
            if written != len(line) + 1:
                raise OSError(f"wrote {written} of {len(line) + 1} bytes")
        except OSError as exc:
            raise self._not_written_ahead(exc) from None

    def _write_values_ahead(self, name: str, values: bytes) -> None:
        try:
            os.makedirs(self._ahead_dir, mode=0o700, exist_ok=True)
            target = os.path.join(self._ahead_dir, name)
            tmp = f"{target}.tmp-{time.time_ns()}"
            with open(tmp, "wb") as out:
                out.write(values)
            os.replace(tmp, target)
        except OSError as exc:
            raise self._not_written_ahead(exc) from None

    def _not_written_ahead(self, exc: OSError) -> SessionError:
        return SessionError(
            f"the run journal could not be written to {self._shown_ahead_dir()} "
            f"({one_line(exc)}); nothing was sent to the ranks: free space there (or "
            "fix its permissions) and run it again"
        )

    def _shown_ahead_dir(self) -> str:
        return repr(self.run_dir.shown(FOLDER)) if self.run_dir.is_local else repr(self._ahead_dir)

    def close(self) -> None:
        """Stop writing ahead (the entries' own files keep going to storage)."""
        with self._lock:
            if self._ahead_fd is not None:
                os.close(self._ahead_fd)
                self._ahead_fd = None

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every entry appended so far is in storage."""
        if self._writer is not None:
            self._writes.join() if timeout is None else _join(self._writes, timeout)
        self._raise_write_error()

    def _write(self, name: str, data: bytes) -> None:
        if self._writer is None:
            self._writer = threading.Thread(
                target=self._write_loop, name="rtnb-journal", daemon=True
            )
            self._writer.start()
        self._writes.put((name, data))

    def _write_loop(self) -> None:
        while True:
            name, data = self._writes.get()
            try:
                if self._write_error is None:
                    self.run_dir.write_bytes(name, data)
                else:
                    self._failed.append((name, data))  # keeps the order for the retry
            except BaseException as exc:  # noqa: BLE001 - reported by the next append
                self._failed.append((name, data))
                self._write_error = exc
            finally:
                self._writes.task_done()

    def _raise_write_error(self) -> None:
        """Entries that did not reach storage are tried again first; if they still
        cannot be written, one line says so (they are written ahead on this machine)."""
        error = self._write_error
        if error is None:
            return
        if self._writer is not None:
            _join(self._writes, 10.0)
        failed, self._failed = self._failed, []
        try:
            while failed:
                name, data = failed[0]
                self.run_dir.write_bytes(name, data)
                failed.pop(0)
        except Exception as exc:  # noqa: BLE001 - any storage error: said in one line
            self._failed = failed + self._failed
            raise SessionError(
                f"the run journal could not be written to {self.run_dir.uri!r} "
                f"({one_line(exc)}); its entries are kept on this machine "
                f"({self._ahead_dir}) and written there once it takes them again"
            ) from None
        self._write_error = None

    # ---- replay --------------------------------------------------------------------
    def replay_plan(self, before: int | None = None) -> list[ReplayStep]:
        """What to replay, in order, to rebuild the ranks' state: the pushes and the
        cells that ended well since the last fresh start, up to entry ``before``.

        Not replayed (listed with the reason): cells marked ``--once``, cells that
        failed or were interrupted (their partial effects cannot be reproduced), and
        cells whose outcome was never recorded (running when the kernel died).
        """
        entries = [e for e in self.entries() if before is None or e.seq < before]
        start = 0
        for i, entry in enumerate(entries):
            if entry.kind in (EntryKind.START, EntryKind.RESTART) and not entry.keep:
                start = i + 1
        outcomes = {e.of: e for e in entries if e.kind is EntryKind.CELL_END}
        plan: list[ReplayStep] = []
        for entry in entries[start:]:
            if entry.kind in (EntryKind.PUSH, EntryKind.DATASETS):
                plan.append(ReplayStep(entry))
            elif entry.kind is EntryKind.CONTROL and entry.of is None:
                plan.append(ReplayStep(entry))  # set between cells: from the next cell on
            elif entry.kind is EntryKind.CELL:
                end = outcomes.get(entry.seq)
                if entry.once:
                    plan.append(ReplayStep(entry, "marked --once"))
                elif end is None:
                    plan.append(ReplayStep(entry, "its outcome was never recorded"))
                elif end.outcome is not CellOutcome.OK:
                    plan.append(ReplayStep(entry, f"it ended with {end.outcome}"))
                else:
                    plan.append(ReplayStep(entry))
        return plan

    def controls_of(self, cell_seq: int) -> tuple[tuple[str, Any, int], ...]:
        """The live-control changes made while cell ``cell_seq`` ran, as
        (name, value, from_step), in the order they were made."""
        return tuple(
            (name, value, e.step if e.step is not None else -1)
            for e in self.entries()
            if e.kind is EntryKind.CONTROL and e.of == cell_seq
            for name, value in (e.controls or {}).items()
        )

    def triggers_of(self, cell_seq: int) -> tuple[tuple[int, str], ...]:
        """The triggers fired while cell ``cell_seq`` ran, as (step, name)."""
        return tuple(
            (e.step if e.step is not None else -1, name)
            for e in self.entries()
            if e.kind is EntryKind.CONTROL and e.of == cell_seq
            for name in e.triggers
        )

    def append_control(
        self, cell_seq: int | None, values: dict[str, Any], step: int, triggers: Iterable[str]
    ) -> JournalEntry:
        """A live change to cell ``cell_seq`` from ``step`` on, written ahead."""
        return self.append(
            EntryKind.CONTROL,
            controls=dict(values) or None,
            of=cell_seq,
            step=step,
            triggers=list(triggers),
        )

    def last_cell_id(self) -> int:
        """The highest cell number the run's journal has (0: none)."""
        return max((e.cell_id or 0 for e in self.entries()), default=0)

    def last_training(self) -> tuple[str, str | None] | None:
        """(code, label) of the last cell that reported: what Resume runs again."""
        entries = self.entries()
        ends = {e.of for e in entries if e.kind is EntryKind.CELL_END and e.reported}
        trained = [e for e in entries if e.seq in ends]
        return (trained[-1].code or "", trained[-1].label) if trained else None

    def cell_entry(self, seq: int) -> JournalEntry | None:
        return next((e for e in self.entries() if e.seq == seq), None)


def _entry_name(entry: JournalEntry) -> str:
    return f"{FOLDER}/{entry.seq:08d}-{entry.kind}.json"


def _entry_bytes(entry: JournalEntry) -> bytes:
    return json.dumps(entry.to_json()).encode()


def _join(pending: queue.Queue, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while pending.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.005)
