"""Where the test suite's time goes: a pytest plugin that reads the machine's CPU
counters (``/proc/stat``) around every test and prints, at the end, each file's wall
time, how many cores were busy on average, and the suite's CPU floor: its busy
core-seconds divided by the cores (what it would take if two streams of tests packed
the cores perfectly).

    PYTHONPATH=benchmarks .venv/bin/python -m pytest -q -p _suite_cpu [--suite-cpu-json FILE]
    .venv/bin/python benchmarks/_suite_cpu.py compare SLOW.json NORMAL.json

It counts the whole machine (the session's Ray, kernels and rank processes the tests
start are the point), so run nothing else beside it. A thread also reads ``/proc``
every 0.25 s and gives each process it had not seen to the test then running, by kind
(a rank, another Ray worker, a kernel, a Ray node's own processes, Chromium, other):
how many each test started and the CPU they used by their last reading. A process
that lived under 0.25 s is not seen; the busy core-s above count it still.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict

import pytest

_seen: list[dict] = []

_CENSUS_EVERY_S = 0.25
# First match wins: a Ray worker's title changes once it holds an actor, so a worker
# is classed again at each reading until it is a rank.
_KINDS = (
    ("rank", ("ray::RankActor",)),
    ("ray worker", ("default_worker.py", "ray::")),
    ("kernel", ("ipykernel_launcher", "ipykernel")),
    (
        "ray node",
        ("raylet", "gcs_server", "dashboard", "log_monitor", "runtime_env", "monitor.py"),
    ),
    ("chromium", ("chromium", "chrome")),
)


def _kind(cmdline: str) -> str:
    for kind, marks in _KINDS:
        if any(mark in cmdline for mark in marks):
            return kind
    return "other"


class _Census:
    """Every process started during the run, by the test running when it was first
    seen (see the module's docstring)."""

    def __init__(self) -> None:
        self.test = "(before the first test)"
        self._known: dict[int, list] = {}  # pid -> [test, kind, cpu_s]
        self._tick = os.sysconf("SC_CLK_TCK")
        self._own = os.getpid()
        self._stop = threading.Event()
        self._before = set(self._pids())
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    @staticmethod
    def _pids() -> list[int]:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]

    def _read(self, pid: int) -> tuple[str, float] | None:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as raw:
                cmdline = raw.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as raw:
                fields = raw.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return cmdline, (int(fields[11]) + int(fields[12])) / self._tick

    def _watch(self) -> None:
        while not self._stop.wait(_CENSUS_EVERY_S):
            for pid in self._pids():
                if pid in self._before or pid == self._own:
                    continue
                read = self._read(pid)
                if read is None:
                    continue
                cmdline, cpu_s = read
                known = self._known.get(pid)
                if known is None:
                    self._known[pid] = [self.test, _kind(cmdline), cpu_s]
                    continue
                known[2] = cpu_s
                if known[1] in ("ray worker", "other"):
                    known[1] = _kind(cmdline)

    def by_test(self) -> dict[str, dict[str, list[float]]]:
        """test -> kind -> [processes, CPU seconds]."""
        self._stop.set()
        self._thread.join(timeout=5)
        found: dict[str, dict[str, list[float]]] = defaultdict(
            lambda: defaultdict(lambda: [0, 0.0])
        )
        for test, kind, cpu_s in self._known.values():
            found[test][kind][0] += 1
            found[test][kind][1] += cpu_s
        return found


_census: _Census | None = None


def pytest_sessionstart(session: pytest.Session) -> None:
    global _census
    _census = _Census()


def _busy_and_total() -> tuple[int, int]:
    with open("/proc/stat") as stat:
        ticks = [int(x) for x in stat.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return sum(ticks) - idle, sum(ticks)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--suite-cpu-json", default="", help="write each test's figures here")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if _census is not None:
        _census.test = item.nodeid
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
    census = _census.by_test() if _census is not None else {}
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for started in census.values():
        for kind, (count, cpu_s) in started.items():
            kinds[kind][0] += count
            kinds[kind][1] += cpu_s
    write("processes started, by kind: count, CPU s they used")
    for kind, (count, cpu_s) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        write(f"  {kind:12} {count:5d} {cpu_s:8.0f}")
    ranks = sorted(census.items(), key=lambda kv: -kv[1].get("rank", [0, 0.0])[0])
    write("tests that started the most ranks: ranks, their CPU s")
    for test, started in ranks[:30]:
        if started.get("rank"):
            write(f"  {started['rank'][0]:4d} {started['rank'][1]:7.0f}  {test}")
    out = config.getoption("--suite-cpu-json")
    if out:
        with open(out, "w") as dest:
            json.dump({"cores": cores, "tests": _seen, "started": census}, dest, indent=1)


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
