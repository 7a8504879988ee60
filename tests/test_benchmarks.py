"""benchmarks/run.py: each round a fresh process, figures judged against their goals,
--check failing on a miss, and every peer's settings in one place."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import run as runner  # noqa: E402


def test_a_real_benchmark_run_through_the_runner_is_judged_and_recorded(tmp_path):
    out = tmp_path / "result.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "run.py"),
            "--only",
            "local_overhead",
            "--quick",
            "--rounds",
            "3",
            "--check",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    result = json.loads(out.read_text())
    (bench,) = result["benchmarks"]
    assert [r["peer_first"] for r in bench["rounds"]] == [False, True, False], "sides alternate"
    assert all(not r["error"] for r in bench["rounds"]), bench["rounds"]
    (figure,) = bench["figures"]
    assert figure["figure"] == "train_ratio" and len(figure["values"]) == 3
    assert figure["min"] <= figure["median"] <= figure["max"]
    (goal,) = (f.goal for b in runner.BENCHMARKS if b.name == "local_overhead" for f in b.figures)
    assert goal is not None
    assert figure["verdict"] == ("MET" if figure["median"] <= goal else "MISSED")
    assert done.returncode == (0 if figure["verdict"] == "MET" else 1), done.stdout
    assert (
        "local-mode training cell / exec()" in done.stdout and "exec() of the same" in done.stdout
    )
    assert result["machine"]["cpus"] and result["commit"]
    table = runner.markdown(result)
    assert f"| local_overhead | local-mode training cell / exec() | ≤ {goal:.2f}x |" in table


def _bench(goal: float, lower: bool = True) -> runner.Benchmark:
    return runner.Benchmark("probe", (runner.Figure("f", "a figure", "x", goal, lower),))


@pytest.mark.parametrize(
    ("values", "lower", "verdict"),
    [
        ([1.1, 1.3, 0.9], True, "MISSED"),
        ([1.1, 1.3, 0.9], False, "MET"),
        ([0.8, 0.9, 1.2, 0.7], True, "MET"),
        ([0.8, 0.9], True, "UNJUDGED"),
    ],
)
def test_the_median_decides_the_verdict(values, lower, verdict):
    rounds = [runner.Round(False, 1.0, {"f": v}) for v in values]
    (row,) = runner.summarise(_bench(1.0, lower), rounds)
    assert row.verdict == verdict and row.min == min(values) and row.max == max(values)


def test_a_peer_that_failed_is_a_failed_round_never_the_peers_time():
    """The round where the peer timed out would have made rtnb look 7x faster: it is
    counted as the peer's failure, and with two good rounds left the goal is not
    judged; the table and the README say so."""
    rounds = [
        runner.Round(False, 1.0, {"f": 1.5}),
        runner.Round(True, 1.0, {"f": 0.14}, peer_failed={"f": "peer: cell_timeout"}),
        runner.Round(False, 1.0, {"f": 1.6}),
    ]
    (row,) = runner.summarise(_bench(1.0), rounds)
    assert row.values == [1.5, 1.6] and row.median == 1.55
    assert (row.verdict, row.note) == ("UNJUDGED", "peer failed 1 of 3")
    rounds.append(runner.Round(True, 1.0, {"f": 1.7}))
    (row,) = runner.summarise(_bench(1.0), rounds)
    assert (row.verdict, row.note) == ("MISSED", "peer failed 1 of 4"), "3 good rounds: judged"
    result = {
        "quick": True,
        "rounds": 4,
        "date": "2026-11-28 10:00",
        "commit": "abc1234",
        "minutes": 1.0,
        "machine": {"cpus": 2, "memory_gb": 23.5, "python": "3.11"},
        "benchmarks": [
            {"benchmark": "probe", "rounds": [], "figures": [runner.asdict(row)]},
        ],
    }
    assert "| MISSED (peer failed 1 of 4) |" in runner.markdown(result)
    assert "| MISSED (peer failed 1 of 4) |" in runner.readme_markdown(result)


def test_a_figure_quick_cannot_miss_is_not_counted_by_quick():
    """checkpoint_async's quick size (10 MB a rank) cannot miss its goal: a quick run
    shows it unjudged; the full run judges it."""
    bench = next(b for b in runner.BENCHMARKS if b.name == "checkpoint_async")
    rounds = [runner.Round(i % 2 == 1, 1.0, {"async_ratio_s3": 1.01}) for i in range(3)]
    quick = next(
        r for r in runner.summarise(bench, rounds, quick=True) if r.figure == "async_ratio_s3"
    )
    full = next(r for r in runner.summarise(bench, rounds) if r.figure == "async_ratio_s3")
    assert (quick.verdict, quick.note) == ("", "judged by the full run only")
    assert full.verdict == "MET"


def test_quick_runs_one_round_of_a_benchmark_whose_goals_only_the_full_run_judges():
    """DDP's 5 s quick windows cannot resolve its 2 % goal: one round shows the figure;
    a benchmark with a goal quick judges keeps its rounds, and the full run all."""
    by_name = {b.name: b for b in runner.BENCHMARKS}
    assert by_name["ddp_throughput"].rounds(3, quick=True) == 1
    assert by_name["ddp_throughput"].rounds(5, quick=False) == 5
    assert by_name["cell_latency"].rounds(3, quick=True) == 3
    shown = runner.summarise(
        by_name["ddp_throughput"],
        [runner.Round(False, 1.0, {"rtnb_vs_torchrun": 0.9, "trainer_vs_torchrun": 0.8})],
        quick=True,
    )
    assert [(r.verdict, r.note) for r in shown if r.figure == "rtnb_vs_torchrun"] == [
        ("", "judged by the full run only")
    ]


def test_a_failed_round_is_a_failure_not_a_skip():
    rounds = [runner.Round(False, 1.0, {"f": 0.5}), runner.Round(True, 1.0, error="exit 1: boom")]
    (row,) = runner.summarise(_bench(1.0), rounds)
    assert row.verdict == "FAILED"


def test_every_benchmark_has_its_peer_named_and_ray_train_is_tuned_in_one_place():
    scripts = {p.stem for p in (REPO / "benchmarks").glob("[a-z]*.py")} - {"run", "peers"}
    assert {b.path[:-3] for b in runner.BENCHMARKS} == scripts, "run.py runs every benchmark"
    assert all((REPO / "benchmarks" / b.path).exists() for b in runner.BENCHMARKS)
    assert all(runner.PEERS.get(b.name) for b in runner.BENCHMARKS)
    for name in scripts:
        text = (REPO / "benchmarks" / f"{name}.py").read_text()
        assert 'RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"' not in text, f"{name} tunes Ray Train itself"
        assert "emit(" in text, f"{name} prints no FIGURES line"


def _stored(commit: str, names: list[str], minutes: float) -> dict:
    return {
        "quick": False,
        "rounds": 3,
        "date": "2026-11-29 10:00",
        "commit": commit,
        "minutes": minutes,
        "machine": {"cpus": 2, "memory_gb": 23.5, "python": "3.11"},
        "benchmarks": [{"benchmark": name, "rounds": [], "figures": []} for name in names],
    }


def test_a_run_finished_in_parts_reads_as_one_run_and_a_later_one_says_so():
    """A full run cut short is finished with --only and --merge: the same commit's
    part is the same run (its minutes counted, no 'measured later'); a part from
    another commit is stamped with its commit in the table."""
    first = _stored("abc1234", ["cell_latency", "soak"], 60.0)
    rest = _stored("abc1234", ["checkpoint_async"], 25.5)
    whole = runner._merged(first, rest)
    assert [b["benchmark"] for b in whole["benchmarks"]] == [
        "cell_latency",
        "checkpoint_async",
        "soak",
    ], "run.py's order"
    assert whole["minutes"] == 85.5
    assert not any("measured" in b for b in whole["benchmarks"])
    later = runner._merged(whole, _stored("def5678", ["soak"], 3.0))
    (soak,) = [b for b in later["benchmarks"] if b["benchmark"] == "soak"]
    assert soak["measured"]["commit"] == "def5678" and later["minutes"] == 85.5


def test_a_run_merged_into_the_file_it_rewrites_as_it_goes_counts_its_minutes_once():
    """--merge F --json F: the run writes F after each benchmark; each write merges
    into F as it was when the run began, so the parts' minutes are added once."""
    import argparse

    first = _stored(runner._commit(), ["cell_latency"], 20.0)
    base = json.dumps(first)
    args = argparse.Namespace(quick=False, merge="F")
    report: list[dict] = [{"benchmark": "soak", "rounds": [], "figures": []}]
    runner._result(args, 3, 600.0, report, base)
    report.append({"benchmark": "sweep", "rounds": [], "figures": []})
    whole = runner._result(args, 3, 1200.0, report, base)
    assert whole["minutes"] == 40.0, "20 min of the first part and 20 of this one"
    assert [b["benchmark"] for b in whole["benchmarks"]] == ["cell_latency", "sweep", "soak"]


def test_a_miss_by_a_hair_never_reads_as_its_goal_and_a_table_names_its_versions():
    assert runner._fmt(0.254, "x", "<= 0.25x") == "0.254x", "a miss shown as the goal itself"
    assert runner._fmt(0.25, "x", "<= 0.25x") == "0.25x"
    assert runner._fmt(1.691, "x", "<= 1.50x") == "1.69x"
    result = json.loads((runner.HERE / "results" / "full.json").read_text())
    head = runner.markdown(result).splitlines()[0]
    assert "Ray 2." in head and "torch 2." in head, head
    missed = [
        [cell.strip() for cell in line.split("|")]
        for line in runner.readme_markdown(result).splitlines()
        if "| MISSED |" in line
    ]
    for cells in missed:  # ["", figure, median, goal, verdict, ""]
        assert cells[2] != cells[3].split()[-1], f"a miss shown as its goal: {cells}"
    fresh = runner.machine()
    assert fresh["ray"] == __import__("ray").__version__ and fresh["torch"].startswith("2."), fresh
