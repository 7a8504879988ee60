"""Where the test suite's time goes: a pytest plugin that reads the machine's CPU
counters (``/proc/stat``) around every test and prints, at the end, each file's wall
time, how many cores were busy on average, and the suite's CPU floor: its busy
core-seconds divided by the cores (what it would take if two streams of tests packed
the cores perfectly).

    PYTHONPATH=benchmarks .venv/bin/python -m pytest -q -p _suite_cpu [--suite-cpu-json FILE]

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
