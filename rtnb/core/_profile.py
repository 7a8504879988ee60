"""``%rtnb profile``: what each rank spent a few steps on, and who held the others up.

Each rank profiles its steps with ``torch.profiler`` and sorts its cell thread's
time into five parts (:func:`breakdown`), one instant at a time, first match wins:

- **rtnb**: inside ``rtnb.report`` (recorded while profiling);
- **data**: inside a DataLoader's ``__next__`` (``enumerate(DataLoader)...``);
- **compute**: inside any other top-level torch op of the cell thread;
- **communication**: inside a collective: a ``c10d::``/DDP reducer op of the cell
  thread, or a gloo/NCCL operation in flight on any thread while the cell thread
  runs no op (it waits for it, as after ``dist.all_reduce`` or DDP's backward);
- **idle**: the rest (Python outside torch ops, sleeps, the GIL).

The parts tile the profiled window, so they add up to its wall time. The rank that
waits least in communication is the one the others wait for: the straggler, if
its lead is real; its main cause is the part where it spends most above the others.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = [
    "PROFILE_START",
    "PROFILE_STOP",
    "PARTS",
    "ProfileReport",
    "RankProfile",
    "breakdown",
    "profile_trigger",
]

# Internal triggers: start a profile of N steps (the name carries N), and stop it.
PROFILE_START = "__profile__"
PROFILE_STOP = "__profile_stop__"
PARTS = ("compute", "communication", "data", "rtnb", "idle")
_PART_TEXT = {
    "compute": "compute (torch ops)",
    "communication": "communication (waiting in collectives)",
    "data": "data loading",
    "rtnb": "rtnb's own reporting",
    "idle": "idle (Python outside torch ops, sleeps)",
}


def profile_trigger(steps: int) -> str:
    return f"{PROFILE_START}{int(steps)}"


@dataclass
class RankProfile:
    """One rank's profiled window: seconds per part over ``steps`` steps."""

    rank: int
    first_step: int
    steps: int
    wall_s: float
    parts: dict[str, float]
    trace: str = ""  # where the rank's own trace was written (run-relative)
    error: str = ""  # the profile could not be taken: why

    def per_step_ms(self, part: str) -> float:
        return 1000.0 * self.parts.get(part, 0.0) / max(1, self.steps)


@dataclass
class ProfileReport:
    """Every rank's profile of the same steps, the merged trace, the straggler."""

    profile_id: str
    first_step: int
    steps: int
    ranks: dict[int, RankProfile]
    trace: str = ""  # the merged Chrome/Perfetto trace (where messages show it)
    straggler: int | None = None
    cause: str = ""
    lead_ms: float = 0.0  # the straggler's cause, ms per step above the others' mean
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        last = self.first_step + self.steps - 1
        text = f"profile of steps {self.first_step}-{last} on {len(self.ranks)} ranks"
        if self.trace:
            text += f": trace {self.trace} (open it in ui.perfetto.dev or chrome://tracing)"
        if self.straggler is not None:
            text += (
                f"; straggler: rank {self.straggler}, {_PART_TEXT[self.cause]} "
                f"+{self.lead_ms:.1f} ms/step over the others"
            )
        elif len(self.ranks) > 1:
            text += "; no straggler (the ranks wait on each other alike)"
        return text

    def table(self) -> str:
        rows = [f"{'rank':>4}  " + "  ".join(f"{p:>13}" for p in PARTS) + "  ms/step"]
        for rank, prof in sorted(self.ranks.items()):
            if prof.error:
                rows.append(f"{rank:>4}  {prof.error}")
                continue
            cells = "  ".join(f"{prof.per_step_ms(p):13.2f}" for p in PARTS)
            rows.append(f"{rank:>4}  {cells}  {1000 * prof.wall_s / max(1, prof.steps):7.2f}")
        return "\n".join(rows)

    def __repr__(self) -> str:
        return self.summary() + "\n" + self.table()

    def find_straggler(self, min_lead_ms: float = 0.5) -> None:
        """The rank others wait for: least communication, if it leads by
        ``min_lead_ms`` per step and 10% of the step; its cause is the part it spends
        most above the others' mean."""
        good = {r: p for r, p in self.ranks.items() if not p.error}
        if len(good) < 2:
            return
        waits = {r: p.per_step_ms("communication") for r, p in good.items()}
        candidate = min(waits, key=waits.get)
        others = [r for r in good if r != candidate]
        waited = sum(waits[r] for r in others) / len(others) - waits[candidate]
        step_ms = 1000 * good[candidate].wall_s / max(1, good[candidate].steps)
        if waited < max(min_lead_ms, 0.1 * step_ms):
            return
        leads = {
            part: good[candidate].per_step_ms(part)
            - sum(good[r].per_step_ms(part) for r in others) / len(others)
            for part in PARTS
            if part != "communication"
        }
        cause = max(leads, key=leads.get)
        self.straggler, self.cause, self.lead_ms = candidate, cause, leads[cause]


_COMM_ON_CELL = ("c10d::", "torch.distributed.ddp.reducer", "gloo:", "nccl", "record_param_comms")
_COMM_ANYWHERE = ("gloo:", "nccl", "c10d::")


def _category(name: str, on_cell_thread: bool) -> str | None:
    if on_cell_thread:
        if name == "rtnb.report":
            return "rtnb"
        if "DataLoader" in name or name.startswith("enumerate("):
            return "data"
        if name.startswith(_COMM_ON_CELL):
            return "communication"
        return "compute"
    if name.startswith(_COMM_ANYWHERE):
        return "comm-elsewhere"
    return None


def breakdown(events: Iterable[tuple[str, float, float, bool]], wall_us: float) -> dict[str, float]:
    """Seconds per part over ``[0, wall_us]`` from top-level events given as
    (name, start µs, end µs, on the cell thread)."""
    marks: list[tuple[float, int, str]] = []
    for name, start, end, on_cell in events:
        category = _category(name, on_cell)
        if category is None or end <= start:
            continue
        marks.append((max(0.0, start), 1, category))
        marks.append((min(wall_us, end), -1, category))
    marks.sort(key=lambda m: (m[0], m[1]))
    open_: dict[str, int] = {}
    parts = dict.fromkeys(PARTS, 0.0)
    last = 0.0
    for at, delta, category in marks:
        at = min(max(at, 0.0), wall_us)
        if at > last:
            parts[_now(open_)] += at - last
            last = at
        open_[category] = open_.get(category, 0) + delta
    if wall_us > last:
        parts[_now(open_)] += wall_us - last
    return {part: us / 1e6 for part, us in parts.items()}


def _now(open_: dict[str, int]) -> str:
    for part in ("rtnb", "data", "communication", "compute"):
        if open_.get(part, 0) > 0:
            return part
    if open_.get("comm-elsewhere", 0) > 0:
        return "communication"
    return "idle"
