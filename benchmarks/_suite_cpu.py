"""Where the test suite's time goes: a pytest plugin that reads the machine's CPU
counters (``/proc/stat``) around every test and prints, at the end, each file's wall
time, how many cores were busy on average, and the suite's CPU floor: its busy
core-seconds divided by the cores (what it would take if two streams of tests packed
the cores perfectly).

    PYTHONPATH=benchmarks .venv/bin/python -m pytest -q -p _suite_cpu [--suite-cpu-json FILE]
    .venv/bin/python benchmarks/_suite_cpu.py compare SLOW.json NORMAL.json

It counts the whole machine (the session's Ray, kernels and rank processes the tests
start are the point), so run nothing else beside it.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict

import pytest

_seen: list[dict] = []


def _busy_and_total() -> tuple[int, int]:
    with open("/proc/stat") as stat:
        ticks = [int(x) for x in stat.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return sum(ticks) - idle, sum(ticks)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--suite-cpu-json", default="", help="write each test's figures here")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    busy_before, _ = _busy_and_total()
    began = time.monotonic()
    yield
    wall = time.monotonic() - began
    busy_after, _ = _busy_and_total()
    busy_s = (busy_after - busy_before) / os.sysconf("SC_CLK_TCK")
    _seen.append({"test": item.nodeid, "wall_s": wall, "busy_core_s": busy_s})


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if not _seen:
        return
    cores = os.cpu_count() or 1
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for row in _seen:
        entry = files[row["test"].split("::")[0]]
        entry[0] += row["wall_s"]
        entry[1] += row["busy_core_s"]
    write = terminalreporter.write_line
    write("")
    write(f"suite CPU by file ({cores} cores): wall s, busy cores on average")
    for name, (wall, busy) in sorted(files.items(), key=lambda kv: -kv[1][0])[:25]:
        write(f"  {wall:7.1f} s  {busy / wall if wall else 0:4.2f}  {name}")
    wall = sum(w for w, _ in files.values())
    busy = sum(b for _, b in files.values())
    write(
        f"tests' wall {wall / 60:.1f} min, {busy / wall:.2f} cores busy on average; "
        f"{busy:.0f} busy core-s: at best {busy / cores / 60:.1f} min on {cores} cores"
    )
    out = config.getoption("--suite-cpu-json")
    if out:
        with open(out, "w") as dest:
            json.dump({"cores": cores, "tests": _seen}, dest, indent=1)


def compare(slow_path: str, normal_path: str, top: int = 25) -> str:
    """Two runs' ``--suite-cpu-json`` side by side: each test's wall time on the slow
    run over the normal one. A machine twice as slow doubles what is CPU; a test whose
    ratio is far above the run's own is waiting on something that scales worse than its
    work (a retry, a poll that backs off, a timeout it reaches), one far below waits on
    a clock (a fixed sleep, an idle timeout)."""
    slow = {t["test"]: t for t in json.load(open(slow_path))["tests"]}
    normal = {t["test"]: t for t in json.load(open(normal_path))["tests"]}
    both = [name for name in slow if name in normal and normal[name]["wall_s"] >= 1.0]
    total_slow = sum(slow[n]["wall_s"] for n in both)
    total_normal = sum(normal[n]["wall_s"] for n in both)
    run_ratio = total_slow / total_normal if total_normal else 0.0
    lines = [
        f"{len(both)} tests of >= 1 s in both: {total_normal / 60:.1f} min -> "
        f"{total_slow / 60:.1f} min ({run_ratio:.2f}x)",
        f"the {top} that grew the most (seconds added), with their own ratio:",
    ]
    grown = sorted(both, key=lambda n: normal[n]["wall_s"] - slow[n]["wall_s"])
    for name in grown[:top]:
        a, b = normal[name]["wall_s"], slow[name]["wall_s"]
        lines.append(f"  {b - a:+7.1f} s  {a:6.1f} -> {b:6.1f} s  {b / a:5.2f}x  {name}")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 4 or sys.argv[1] != "compare":
        sys.exit("usage: python benchmarks/_suite_cpu.py compare SLOW.json NORMAL.json")
    print(compare(sys.argv[2], sys.argv[3]))
