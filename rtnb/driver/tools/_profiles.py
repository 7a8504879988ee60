"""The driver's side of ``%rtnb profile``: every rank's trace merged into one.

Each rank wrote ``profiles/{id}/rank-N.json`` (torch's Chrome trace). The merged
``profiles/{id}/trace.json`` has one process row per rank (``pid`` = the rank,
named "rank N"), every timestamp moved onto one clock: a rank's are microseconds
from its ``baseTimeNanoseconds``, so each is shifted by its base less the earliest
rank's. Perfetto and chrome://tracing load it as it is.
"""

from __future__ import annotations

import json
import posixpath

from rtnb.core._profile import ProfileReport, RankProfile
from rtnb.storage._layout import profile_trace
from rtnb.storage._rundir import RunDirectory

__all__ = ["merge_profile"]


def merge_profile(run_dir: RunDirectory, profiles: dict[int, RankProfile]) -> ProfileReport:
    first = min(p.first_step for p in profiles.values())
    steps = min(p.steps for p in profiles.values())
    profile_id = f"step-{first:09d}"
    report = ProfileReport(profile_id, first, steps, dict(sorted(profiles.items())))
    traces: dict[int, dict] = {}
    for rank, prof in profiles.items():
        if prof.error or not prof.trace:
            continue
        try:
            with run_dir.fs.open_input_stream(posixpath.join(run_dir.path, prof.trace)) as src:
                traces[rank] = json.loads(src.read())
        except (OSError, ValueError) as exc:
            report.notes.append(f"rank {rank}'s trace could not be read: {exc}")
    if traces:
        base = min(int(t.get("baseTimeNanoseconds", 0)) for t in traces.values())
        events: list[dict] = []
        for rank, trace in sorted(traces.items()):
            shift_us = (int(trace.get("baseTimeNanoseconds", 0)) - base) / 1000.0
            events.append(_meta("process_name", rank, {"name": f"rank {rank}"}))
            events.append(_meta("process_sort_index", rank, {"sort_index": rank}))
            for event in trace.get("traceEvents", []):
                if event.get("ph") == "M" and event.get("name") in (
                    "process_name",
                    "process_sort_index",
                    "process_labels",
                ):
                    continue
                moved = dict(event)
                moved["pid"] = rank
                if isinstance(moved.get("ts"), (int, float)):
                    moved["ts"] = moved["ts"] + shift_us
                events.append(moved)
        merged = {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "baseTimeNanoseconds": base,
            "otherData": {"rtnb": f"steps {first}-{first + steps - 1}, ranks {sorted(traces)}"},
        }
        report.trace = run_dir.write_bytes(profile_trace(profile_id), json.dumps(merged).encode())
    report.find_straggler()
    return report


def _meta(name: str, rank: int, args: dict) -> dict:
    return {"ph": "M", "name": name, "pid": rank, "tid": 0, "args": args}
