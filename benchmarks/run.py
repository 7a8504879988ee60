"""Every benchmark against its peer, several rounds, one table that judges itself.

    .venv/bin/python benchmarks/run.py [--quick] [--check] [--only NAME[,NAME]] [--json FILE]

Each benchmark script runs once per round in a fresh process (and runs each side in
fresh processes of its own where it starts Ray or a kernel); rounds alternate which
side goes first (``RTNB_BENCH_PEER_FIRST``), so the machine's drift over a run hits
both alike. A round prints its figures on one ``FIGURES {json}`` line; this runner
keeps every round's value and prints, per figure: its goal, min / median / max over
the rounds, MET or MISSED (judged on the median), and what the peer was and how it
was tuned (``peers.py``). A round whose peer failed (its line names the figures in
``peer_failed``) is counted as that, "peer failed N of M", never as the peer's
time; a goal with fewer than 3 good rounds is UNJUDGED. ``--check`` exits 1 when a
goal is missed, unjudged or a benchmark failed. ``--json`` writes all of it, with
the machine and the commit, for the docs.

``--quick``: 3 rounds of smaller sizes (one round of a benchmark whose goals only
the full run judges; the time it takes is in docs/benchmarks.md); otherwise 5
rounds of the sizes the docs quote.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from peers import PEERS  # noqa: E402


@dataclass(frozen=True)
class Figure:
    key: str  # the name in the script's FIGURES line
    label: str
    unit: str  # "x" (a ratio), "s", "ms", "us", "/s", "MB", "%"
    goal: float | None = None
    lower_is_better: bool = True
    # Measured only by the full run (--quick leaves out what it measures).
    full_only: bool = False
    # Judged only by the full run: --quick measures it at a size where the goal
    # means nothing (it cannot be missed, or the window cannot resolve it), so its
    # quick figure is shown, never counted as met or missed.
    quick_unjudged: bool = False

    def met(self, value: float | None) -> bool | None:
        if self.goal is None or value is None:
            return None
        return value <= self.goal if self.lower_is_better else value >= self.goal

    def goal_text(self) -> str:
        if self.goal is None:
            return ""
        return f"{'<=' if self.lower_is_better else '>='} {_fmt(self.goal, self.unit)}"


@dataclass(frozen=True)
class Benchmark:
    name: str
    figures: tuple[Figure, ...]
    args: tuple[str, ...] = ()
    quick_args: tuple[str, ...] = ()
    timeout_s: float = 600
    script: str | None = None  # another benchmark's script, run with these args

    @property
    def path(self) -> str:
        return f"{self.script or self.name}.py"

    def rounds(self, asked: int, quick: bool) -> int:
        """``asked`` rounds; one with ``--quick`` when it judges none of this
        benchmark's goals (they wait for the full run): its figures are shown, and
        a median of rounds that judge nothing is not worth their minutes."""
        judged = any(
            fig.goal is not None and not (quick and (fig.quick_unjudged or fig.full_only))
            for fig in self.figures
        )
        return asked if judged else 1


def _x(
    key: str,
    label: str,
    goal: float | None = None,
    lower: bool = True,
    *,
    quick_unjudged: bool = False,
) -> Figure:
    return Figure(key, label, "x", goal, lower, quick_unjudged=quick_unjudged)


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        "cell_latency",
        (
            _x("trivial_ratio", "warm trivial cell vs plain actor exec", 0.75),
            _x("trivial_ray_ratio", "the same with the open channel off (Ray's calls) vs plain"),
            _x("trivial_compiled_ratio", "warm trivial cell vs a Ray Compiled Graph echo"),
            Figure("trivial_ms", "warm trivial cell", "ms"),
            _x(
                "lifecycle_ratio",
                "lifecycle: warm fit() of a 20-step loop / the loop re-run in a live group",
                50,
                False,
            ),
            _x("start_ratio", "group start to ready vs first fit() to its loop", 0.2),
        ),
        quick_args=("--quick",),
        timeout_s=400,
    ),
    Benchmark(
        "report_overhead",
        (
            _x("loop_1khz", "~1 kHz loop with a report every step / without", 1.03),
            _x("loop_10khz", "~10 kHz loop with a report every step / without", 1.05),
            Figure("kernel_us_per_report", "kernel CPU per report at ~10 kHz", "us", 2.0),
            Figure("reports_per_s", "sustained reports/s per rank", "/s", 200_000, False),
            Figure("p95_ms", "report -> driver latency p95 at 100/s", "ms", 150),
            _x(
                "ray_train_per_call",
                "Ray Train report() per call (synchronous: a barrier) / rtnb's (an append)",
            ),
        ),
        quick_args=("--quick",),
        timeout_s=400,
    ),
    Benchmark(
        "ddp_throughput",
        (
            _x(
                "rtnb_vs_torchrun",
                "rtnb cell's DDP throughput / torchrun's",
                0.98,
                False,
                quick_unjudged=True,
            ),
            _x("trainer_vs_torchrun", "TorchTrainer's DDP throughput / torchrun's"),
            _x(
                "ray_actors_vs_torchrun",
                "plain Ray actors' DDP throughput / torchrun's (no rtnb, no Ray Train)",
            ),
        ),
        # 20 s of steps a side each round (the script's window), so 2% is resolved;
        # --quick: 5 s windows (a smoke run: torchrun alone varies more than the goal's
        # 2% over them), shown, judged by the full run only.
        args=("--rounds", "1"),
        quick_args=("--rounds", "1", "--window-s", "5"),
        timeout_s=900,
    ),
    Benchmark(
        "fsdp_throughput",
        (
            _x(
                "rtnb_vs_torchrun",
                "rtnb cell's FSDP2 throughput / torchrun's",
                0.98,
                False,
                quick_unjudged=True,
            ),
            _x("trainer_vs_torchrun", "TorchTrainer's FSDP2 throughput / torchrun's"),
            _x(
                "ray_actors_vs_torchrun",
                "plain Ray actors' FSDP2 throughput / torchrun's (no rtnb, no Ray Train)",
            ),
        ),
        args=("--strategy", "fsdp", "--rounds", "1"),
        quick_args=("--strategy", "fsdp", "--rounds", "1", "--window-s", "5"),
        timeout_s=900,
        script="ddp_throughput",
    ),
    Benchmark(
        "checkpoint_io",
        (
            _x("save_ratio_60", "checkpoint save 60 MB a rank, durable / torch.save durable", 1.2),
            _x("restore_ratio_60", "restore 60 MB (verified) / torch.load", 1.2),
            _x("save_over_ratio_60", "the same save / torch.save overwriting one file"),
            Figure(
                "save_ratio_600",
                "checkpoint save 600 MB a rank, durable / torch.save durable",
                "x",
                1.2,
                full_only=True,
            ),
            Figure(
                "restore_ratio_600",
                "restore 600 MB (verified) / torch.load",
                "x",
                1.2,
                full_only=True,
            ),
            Figure(
                "save_over_ratio_600",
                "the same save / torch.save overwriting one file",
                "x",
                full_only=True,
            ),
        ),
        args=("--mb", "60,600", "--repeats", "3"),
        quick_args=("--mb", "60", "--repeats", "3"),
        timeout_s=400,
    ),
    Benchmark(
        "checkpoint_async",
        (
            Figure(
                "async_ratio_s3",
                "loop saving 100 MB a rank (10 quick) every 10 steps, ASYNC to S3 / none",
                "x",
                1.10,
                quick_unjudged=True,
            ),
            _x("sync_ratio_s3", "the same loop, SYNC to S3 / none"),
            Figure(
                "trainer_async_ratio_s3",
                "Ray Train's ASYNC to S3 / its loop without",
                "x",
                full_only=True,
            ),
            Figure(
                "async_ratio_local",
                "ASYNC to local disk / no checkpoint",
                "x",
                1.10,
                full_only=True,
            ),
            Figure("sync_ratio_local", "SYNC to local disk / no checkpoint", "x", full_only=True),
            Figure(
                "trainer_async_ratio_local",
                "Ray Train's ASYNC to local disk / without",
                "x",
                full_only=True,
            ),
        ),
        quick_args=("--quick",),
        timeout_s=900,
    ),
    Benchmark(
        "cold_start",
        (
            _x(
                "cold_server_ratio",
                "cold, from a Jupyter server's launch: rtnb / jupyter-distributed+gloo",
                1.0,
            ),
            _x(
                "warm_server_ratio",
                "warm, a kernel on a running server: rtnb / jupyter-distributed+gloo",
                1.0,
            ),
            _x("cold_no_server_ratio", "cold, no server: rtnb embedded Ray / nbdistributed", 1.0),
            Figure("warm_server_s", "warm: rtnb's next kernel to first result", "s", 1.0),
        ),
        args=("--rounds", "1", "--install-peers"),
        quick_args=("--rounds", "1", "--install-peers", "--quick"),
        timeout_s=600,
    ),
    Benchmark(
        "data_start",
        (
            _x(
                "total_ratio",
                "Ray Data from nothing (Ray, group, every row): tuned TorchTrainer / rtnb",
                1.0,
                False,
            ),
            _x(
                "groups_up_ratio",
                "Ray Data, groups up: TorchTrainer's loop / rtnb's cell (its split included)",
            ),
            Figure("rtnb_cell_s", "rtnb Ray Data cell on a running group, every row read", "s"),
        ),
        args=("--rounds", "1"),
        quick_args=("--rounds", "1", "--rows", "5000", "--quick"),
        timeout_s=400,
    ),
    Benchmark(
        "data_throughput",
        (
            _x(
                "rows_ratio",
                "Ray Data rows/s per rank, epochs 2-3: rtnb / TorchTrainer",
                0.95,
                False,
            ),
            _x("hf_ratio", "HF Trainer steps/s: rtnb / TorchTrainer", 0.98, False),
        ),
        quick_args=("--quick",),
        timeout_s=600,
    ),
    Benchmark(
        "elastic_shrink",
        (
            _x("resume_ratio", "node lost -> next step: rtnb / elastic TorchTrainer", 1.0),
            Figure("rtnb_resume_s", "rtnb: node lost -> next step", "s"),
        ),
        timeout_s=600,
    ),
    Benchmark(
        "live_view",
        (
            _x(
                "cpu_ratio_2", "kernel CPU of the view, 2 ranks: rtnb / throttled FigureWidget", 1.0
            ),
            Figure("p95_lag_steps_2", "rtnb plot lag p95, 2 ranks at 100 steps/s", "steps", 100),
            Figure("cpu_share_2", "rtnb view's kernel CPU share, 2 ranks", "%"),
            _x(
                "cpu_ratio_8", "kernel CPU of the view, 8 ranks: rtnb / throttled FigureWidget", 1.0
            ),
            Figure("p95_lag_steps_8", "rtnb plot lag p95, 8 ranks at 100 steps/s", "steps", 100),
            Figure("cpu_share_8", "rtnb view's kernel CPU share, 8 ranks", "%", 10),
            _x("cpu_ratio_32", "kernel CPU of the view, 32 ranks: rtnb / throttled FigureWidget"),
            Figure("p95_lag_steps_32", "rtnb plot lag p95, 32 ranks at 100 steps/s", "steps", 100),
            Figure("cpu_share_32", "rtnb view's kernel CPU share, 32 simulated ranks", "%", 10),
            _x("cpu_ratio_128", "kernel CPU of the view, 128 ranks: rtnb / throttled FigureWidget"),
            Figure(
                "p95_lag_steps_128", "rtnb plot lag p95, 128 ranks at 100 steps/s", "steps", 100
            ),
            Figure("cpu_share_128", "rtnb view's kernel CPU share, 128 simulated ranks", "%", 20),
        ),
        quick_args=("--seconds", "4"),
        timeout_s=300,
    ),
    Benchmark(
        "local_overhead",
        (_x("train_ratio", "local-mode training cell / exec()", 1.05),),
        quick_args=("--runs", "7"),
        timeout_s=300,
    ),
    Benchmark(
        "recovery_replay",
        (
            Figure(
                "replay_cell_ms",
                "replaying one training cell that skips its loop, its checkpoint load aside",
                "ms",
                50,
            ),
            _x("replay_vs_start", "a whole session's replay / a new group's start", 1.5),
            _x("replay_ratio", "journal replay / the cells' first run (how long they trained)"),
            _x("scale_ratio", "scale keeping state / restart + re-run by hand"),
            _x("journal_ratio", "warm trivial cell with the journal / without"),
        ),
        quick_args=("--quick",),
        timeout_s=400,
    ),
    Benchmark(
        "stacks_latency",
        (
            _x("stacks_ratio", "all ranks' stacks: %rtnb stacks / py-spy dump", 1.0),
            Figure("stacks_ms", "%rtnb stacks, 2 ranks", "ms", 200),
        ),
        quick_args=("--quick",),
        timeout_s=300,
    ),
    Benchmark(
        "sweep",
        (_x("sweep_ratio", "grid of 8 trials (4 quick): rtnb sweep / Tune + TorchTrainer", 0.5),),
        quick_args=("--quick",),
        timeout_s=600,
    ),
    Benchmark(
        "scale",
        (
            _x("trivial_ratio_max", "trivial cell at 32 ranks (8 quick) / at 2 ranks", 2.0),
            _x(
                "trivial_cpu_ratio_max",
                "the kernel's CPU per trivial cell at 32 ranks (8 quick) / at 2 ranks",
                2.0,
            ),
            Figure("kernel_cpu_max", "kernel CPU, 32 ranks (8 quick) at 100 reports/s", "%", 10),
            _x("stacks_ratio_max", "%rtnb stacks at 32 ranks (8 quick) / at 2 ranks", 2.0),
            Figure("stacks_ms_max", "%rtnb stacks, 32 ranks (8 quick)", "ms", 200),
        ),
        quick_args=("--sizes", "2,8"),
        timeout_s=400,
    ),
    Benchmark(
        "relay",
        (
            _x("relay_4_ratio", "trivial cell at 4 ranks: relayed through rank 0 / direct", 1.0),
            _x("relay_8_ratio", "trivial cell at 8 ranks: relayed through rank 0 / direct", 1.0),
            _x("relay_2_ratio", "trivial cell at 2 ranks: relayed / direct (rtnb calls directly)"),
            _x(
                "channel_2_ratio",
                "trivial cell at 2 ranks: open channel / the better Ray path",
                1.0,
            ),
            _x(
                "channel_8_ratio",
                "trivial cell at 8 ranks: open channel / the better Ray path",
                1.0,
            ),
            _x(
                "fanout_8_ratio",
                "trivial cell at 8 ranks: fanned out through rank 0 / each rank on the channel",
            ),
            _x(
                "fanout_cpu_8_ratio",
                "the kernel's CPU per trivial cell at 8 ranks: fanned out / each rank on the channel",
                1.0,
            ),
            Figure(
                "fanout_16_ratio",
                "trivial cell at 16 ranks: fanned out through rank 0 / each rank on the channel",
                "x",
                1.0,
                full_only=True,
            ),
            Figure(
                "fanout_cpu_16_ratio",
                "the kernel's CPU per trivial cell at 16 ranks: fanned out / each rank on the channel",
                "x",
                1.0,
                full_only=True,
            ),
        ),
        args=("--sizes", "2,4,8,16"),
        quick_args=("--sizes", "2,4,8", "--cells", "30"),
        timeout_s=900,
    ),
    Benchmark(
        "file_sync",
        (
            Figure("unchanged_ms", "50-file folder synced, nothing changed: ms added", "ms", 20),
            Figure("changed_ms", "50-file folder synced, one module changed: ms added", "ms", 100),
            Figure("walk_ms", "the kernel's walk of the folder before a cell", "ms"),
        ),
        quick_args=("--cells", "30"),
        timeout_s=300,
    ),
    Benchmark(
        "cluster",
        (
            _x(
                "node_trivial_ratio",
                "warm trivial cell, notebook off the cluster (joined as a node) / one machine",
                1.5,
            ),
            _x("client_trivial_ratio", "warm trivial cell through ray:// / one machine"),
            Figure("node_first_s", "start to first DDP result, joined as a node", "s"),
            Figure("client_first_s", "start to first DDP result, through ray://", "s"),
            Figure("one_first_s", "start to first DDP result, one machine (embedded Ray)", "s"),
            _x(
                "ddp_vs_torchrun",
                "DDP step on two machines: rtnb / torchrun --nnodes 2",
                0.98,
                False,
            ),
            _x("rtt_ratio", "TCP round trip to a worker machine / on loopback (the network)"),
        ),
        quick_args=("--quick",),
        timeout_s=1200,
    ),
    Benchmark(
        "soak",
        (
            Figure("kernel_growth_mb", "kernel RSS growth after warm-up", "MB", 50),
            Figure("rank_growth_mb", "largest rank RSS growth after warm-up", "MB", 50),
        ),
        quick_args=("--cells", "150"),
        timeout_s=600,
    ),
)


def _fmt(value: float | None, unit: str, goal: str = "") -> str:
    """A figure as the tables show it; beside its goal (the row's goal text), with one
    more digit where two would make a miss read as the goal itself (0.254x against
    0.25x)."""
    if value is None:
        return "—"
    if unit == "x":
        shown = f"{value:.2f}x"
        if goal and goal.split()[-1] == shown and abs(value - float(shown[:-1])) > 1e-9:
            return f"{value:.3f}x"
        return shown
    if unit == "/s":
        return f"{value:,.0f}/s"
    if abs(value) >= 100:
        return f"{value:,.0f} {unit}"
    return f"{value:.2f} {unit}" if abs(value) < 10 else f"{value:.1f} {unit}"


@dataclass
class Round:
    peer_first: bool
    seconds: float
    values: dict[str, float | None] = field(default_factory=dict)
    error: str = ""
    output: str = ""  # the round's printed lines (its tail), for reading a figure's cause
    # Figures whose peer failed this round, with why: no value of theirs counts.
    peer_failed: dict[str, str] = field(default_factory=dict)


# A goal is judged on at least this many good rounds (neither side failed).
MIN_JUDGED_ROUNDS = 3


def run_round(bench: Benchmark, quick: bool, peer_first: bool) -> Round:
    args = bench.quick_args if quick else bench.args
    env = {**os.environ, "RTNB_BENCH_PEER_FIRST": "1" if peer_first else "0"}
    env.pop("RAY_ADDRESS", None)  # each round starts what it measures
    # The round's temporary folders (checkpoints the loops write with mkdtemp, as
    # Ray's examples do, run folders, kernels' homes) go with it: a full run left
    # ~10 GB in /tmp. Ray keeps its own place, so its sockets are where they'd be;
    # the name is short, as Ray's socket paths under a benchmark's own --temp-dir in
    # it must fit 107 bytes.
    scratch = tempfile.TemporaryDirectory(prefix="rb-", ignore_cleanup_errors=True)
    env.update(TMPDIR=scratch.name, RAY_TMPDIR=env.get("RAY_TMPDIR") or tempfile.gettempdir())
    began = time.perf_counter()
    try:
        with scratch:
            proc = subprocess.run(
                [sys.executable, str(HERE / bench.path), *args],
                capture_output=True,
                text=True,
                env=env,
                timeout=bench.timeout_s,
                cwd=HERE.parent,
            )
    except subprocess.TimeoutExpired:
        return Round(
            peer_first,
            time.perf_counter() - began,
            error=f"no result within {bench.timeout_s:.0f} s",
        )
    took = time.perf_counter() - began
    lines = [x for x in proc.stdout.splitlines() if x.startswith("FIGURES ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-3:]
        return Round(
            peer_first,
            took,
            error=f"exit {proc.returncode}: {' | '.join(tail)}"[:400],
            output=(proc.stdout + proc.stderr)[-6000:],
        )
    output = "\n".join(
        x for x in proc.stdout.splitlines() if not x.startswith(("FIGURES ", "RESULT "))
    )
    values = json.loads(lines[-1][len("FIGURES ") :])
    peer_failed = values.pop("peer_failed", None) or {}
    return Round(peer_first, took, values, output=output[-6000:], peer_failed=peer_failed)


@dataclass
class Row:
    benchmark: str
    figure: str
    label: str
    unit: str
    goal: str
    values: list[float]
    min: float | None
    median: float | None
    max: float | None
    verdict: str  # MET, MISSED, "" (no goal), FAILED, UNJUDGED (too few good rounds)
    peer: str
    note: str = ""  # e.g. "peer failed 2 of 3"


def summarise(bench: Benchmark, rounds: list[Round], quick: bool = False) -> list[Row]:
    rows = []
    failed = [r.error for r in rounds if r.error]
    for fig in bench.figures:
        if quick and fig.full_only:
            continue
        peer_failures = [r for r in rounds if fig.key in r.peer_failed]
        values = [
            r.values[fig.key]
            for r in rounds
            if r.values.get(fig.key) is not None and fig.key not in r.peer_failed
        ]
        median = statistics.median(values) if values else None
        met = fig.met(median)
        note = f"peer failed {len(peer_failures)} of {len(rounds)}" if peer_failures else ""
        if failed:
            verdict = "FAILED"
        elif quick and fig.quick_unjudged:
            verdict, note = "", "judged by the full run only"
        elif fig.goal is not None and len(values) < MIN_JUDGED_ROUNDS:
            # A peer's failure is never its time, and two rounds are not a median.
            verdict = "UNJUDGED"
            note = note or f"{len(values)} good rounds"
        elif median is None:
            verdict = "FAILED" if fig.goal is not None else ""
        else:
            verdict = "" if met is None else ("MET" if met else "MISSED")
        rows.append(
            Row(
                bench.name,
                fig.key,
                fig.label,
                fig.unit,
                fig.goal_text(),
                values,
                min(values) if values else None,
                median,
                max(values) if values else None,
                verdict,
                PEERS.get(bench.name, ""),
                note,
            )
        )
    return rows


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
        )
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=HERE,
        ).stdout.splitlines()
        # The browser tests retake the docs' pictures: that is no change to the code.
        dirty = [line for line in changed if not line[3:].startswith("docs/images/")]
        return out.stdout.strip() + ("+changes" if dirty else "")
    except OSError:
        return "unknown"


def machine() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "none"

    return {
        "cpus": os.cpu_count(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "ray": installed("ray"),
        "torch": installed("torch"),
    }


def _versions(m: dict) -> str:
    """The Ray and torch a run measured (results written before they were kept name
    what .ci/setup installed then)."""
    return f"Ray {m.get('ray', '2.60.0')}, torch {m.get('torch', '2.13.0+cpu')}"


def print_table(rows: list[Row], out=sys.stdout) -> None:
    head = ("benchmark", "figure", "goal", "min", "median", "max", "verdict")
    lines = [
        (
            r.benchmark,
            r.label,
            r.goal,
            _fmt(r.min, r.unit, r.goal),
            _fmt(r.median, r.unit, r.goal),
            _fmt(r.max, r.unit, r.goal),
            _verdict(asdict(r)),
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    widths[1] = min(widths[1], 72)
    for line in (head, *lines):
        cells = [c if len(c) <= widths[i] else c[: widths[i] - 1] + "…" for i, c in enumerate(line)]
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip(), file=out)
    print("\npeers (benchmarks/peers.py):", file=out)
    for name in dict.fromkeys(r.benchmark for r in rows):
        print(f"  {name}: {PEERS.get(name, '')}", file=out)


DOCS = HERE.parent / "docs" / "benchmarks.md"
BEGIN, END = "<!-- run.py table: begin -->", "<!-- run.py table: end -->"


def markdown(result: dict) -> str:
    """The docs' table of one ``--json`` result: machine, commit, every figure."""
    m = result["machine"]
    lines = [
        f"`benchmarks/run.py{' --quick' if result['quick'] else ''}`, {result['rounds']} rounds "
        f"(min / median / max), {result['date']}, commit `{result['commit']}`, "
        f"{m['cpus']} CPUs, {m['memory_gb']} GiB, Python {m['python']}, {_versions(m)}; "
        f"{result['minutes']} min in all.",
        "",
        "| benchmark | figure | goal | min | median | max | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for bench in result["benchmarks"]:
        for row in bench["figures"]:
            unit = row["unit"]
            lines.append(
                f"| {row['benchmark']}{'*' if 'measured' in bench else ''} | {row['label']} | {row['goal'].replace('<=', '≤').replace('>=', '≥')} "
                f"| {_fmt(row['min'], unit, row['goal'])} | {_fmt(row['median'], unit, row['goal'])} "
                f"| {_fmt(row['max'], unit, row['goal'])} "
                f"| {_verdict(row)} |"
            )
        failed = [r["error"] for r in bench["rounds"] if r["error"]]
        if failed:
            lines.append(f"| {bench['benchmark']} | failed: {failed[0][:150]} | | | | | |")
    lines += _later_runs(result)
    lines += ["", "Peers, as `benchmarks/peers.py` sets them:", ""]
    for bench in result["benchmarks"]:
        lines.append(f"- `{bench['benchmark']}`: {PEERS.get(bench['benchmark'], '')}")
    return "\n".join(lines)


README = HERE.parent / "README.md"
README_BEGIN, README_END = "<!-- run.py headline: begin -->", "<!-- run.py headline: end -->"


def _verdict(row: dict) -> str:
    """A row's verdict with its note (results written before notes have none)."""
    if not row.get("note"):
        return row["verdict"]
    return f"{row['verdict']} ({row['note']})" if row["verdict"] else f"({row['note']})"


def readme_markdown(result: dict) -> str:
    """The README's few lines of one ``--json`` result: each benchmark's first judged
    figure, then every other missed one (the docs have them all)."""
    rows = [row for bench in result["benchmarks"] for row in bench["figures"]]
    judged = [row for row in rows if row["verdict"] in ("MET", "MISSED", "FAILED")]
    unjudged = [row for row in rows if row["verdict"] == "UNJUDGED"]
    met = sum(row["verdict"] == "MET" for row in judged)
    lines = [
        f"`benchmarks/run.py{' --quick' if result['quick'] else ''}`, medians of "
        f"{result['rounds']} rounds, {result['date'][:10]}, commit `{result['commit']}`, "
        f"{result['machine']['cpus']} CPUs, {_versions(result['machine'])}: "
        f"{met} of {len(judged)} goals met, "
        + (
            f"{len(unjudged)} not judged (a peer that failed, or under "
            f"{MIN_JUDGED_ROUNDS} good rounds), "
            if unjudged
            else ""
        )
        + f"{result['minutes']} min in all.",
        "",
        "| figure | median | goal | |",
        "| --- | --- | --- | --- |",
    ]
    shown = []
    for bench in result["benchmarks"]:
        first = next((r for r in bench["figures"] if r["verdict"] != ""), None)
        shown += [first] if first else []
    shown += [r for r in judged + unjudged if r["verdict"] != "MET" and r not in shown]
    later = {r["benchmark"] for b in result["benchmarks"] if "measured" in b for r in b["figures"]}
    for row in shown:
        goal = row["goal"].replace("<=", "≤").replace(">=", "≥")
        star = "*" if row["benchmark"] in later else ""
        lines.append(
            f"| {row['label']}{star} | {_fmt(row['median'], row['unit'], row['goal'])} | {goal} "
            f"| {_verdict(row)} |"
        )
    return "\n".join(lines + _later_runs(result))


def _later_runs(result: dict) -> list[str]:
    """Where some benchmarks were measured by a later run merged in (``--merge``)."""
    stamps = {
        (b["measured"]["date"], b["measured"]["commit"], b["measured"]["rounds"]): b["benchmark"]
        for b in result["benchmarks"]
        if "measured" in b
    }
    if not stamps:
        return []
    lines = [""]
    for (date, commit, rounds), _ in sorted(stamps.items()):
        names = ", ".join(
            f"`{b['benchmark']}`"
            for b in result["benchmarks"]
            if b.get("measured", {}).get("commit") == commit and b["measured"]["date"] == date
        )
        lines.append(
            f"\\* {names}: measured in another run, {date}, commit `{commit}`, {rounds} rounds."
        )
    return lines


def _replace_between(path: Path, begin: str, end: str, body: str) -> None:
    text = path.read_text()
    head, found, rest = text.partition(begin)
    if not found:
        raise SystemExit(f"{path.name} has no {begin} marker")
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{begin}\n{body}\n{end}{tail}")


def write_docs(result: dict) -> None:
    """The docs' whole table and the README's headline, both from this result."""
    _replace_between(DOCS, BEGIN, END, markdown(result))
    _replace_between(README, README_BEGIN, README_END, readme_markdown(result))


def rejudged(result: dict) -> dict:
    """``result`` with every figure judged again from its recorded rounds by the
    current rules (goals, labels, peer failures, the least good rounds)."""
    known = {b.name: b for b in BENCHMARKS}
    for entry in result["benchmarks"]:
        bench = known.get(entry["benchmark"])
        if bench is None:
            continue
        rounds = [Round(**r) for r in entry["rounds"]]
        entry["figures"] = [asdict(r) for r in summarise(bench, rounds, result["quick"])]
    return result


def _merged(base: dict, run: dict) -> dict:
    """``base`` with ``run``'s benchmarks in place of its own (in run.py's order),
    each stamped with when and at which commit it was measured. A run of the same
    commit, sizes and rounds is the same run finished in parts: its benchmarks need
    no stamp, and its minutes count towards the whole run's."""
    same_run = all(base[key] == run[key] for key in ("commit", "quick", "rounds"))
    stamp = {"commit": run["commit"], "date": run["date"], "rounds": run["rounds"]}
    fresh = {b["benchmark"]: b if same_run else {**b, "measured": stamp} for b in run["benchmarks"]}
    if same_run:
        base["minutes"] = round(base["minutes"] + run["minutes"], 1)
    kept = {b["benchmark"]: b for b in base["benchmarks"] if b["benchmark"] not in fresh}
    every = {**kept, **fresh}
    base["benchmarks"] = [every[b.name] for b in BENCHMARKS if b.name in every]
    return base


def _result(
    args: argparse.Namespace, rounds: int, seconds: float, report: list[dict], base: str
) -> dict:
    """This run's record, merged into ``base`` (``--merge``'s file as it was when the
    run began: the run rewrites that file as it goes when it is also ``--json``)."""
    result = {
        "commit": _commit(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine(),
        "quick": args.quick,
        "rounds": rounds,
        "minutes": round(seconds / 60, 1),
        "benchmarks": report,
    }
    if base:
        result = _merged(json.loads(base), result)
    return result


def compile_rtnb() -> None:
    """rtnb's bytecode, as a wheel's install leaves it. Where PYTHONDONTWRITEBYTECODE
    is set (this VM, CI) no process keeps what it compiles, so each kernel, rank and
    Ray worker would compile rtnb's changed modules again (~0.2 s of CPU apiece),
    which no user's install does, and which the peers, compiled at their install,
    never pay."""
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-j", "0", "rtnb", "magics", "widgets"],
        cwd=HERE.parent,
        capture_output=True,
        check=False,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of smaller sizes")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when a goal is missed or unjudged"
    )
    parser.add_argument("--only", default="", help="comma-separated benchmark names")
    parser.add_argument("--json", default="", help="write the results here")
    parser.add_argument(
        "--merge",
        default="",
        metavar="FILE",
        help="put this run's benchmarks into an earlier --json FILE's result (marked as "
        "measured in another run) and write that with --json / --docs",
    )
    parser.add_argument("--rounds", type=int, default=0, help="override the round count")
    parser.add_argument(
        "--docs",
        action="store_true",
        help="write the table into docs/benchmarks.md and the headline into README.md",
    )
    parser.add_argument("--render", default="", help="print the docs' table of a --json FILE")
    parser.add_argument(
        "--docs-from",
        default="",
        metavar="FILE",
        help="write docs/benchmarks.md's table and README's headline from a --json FILE",
    )
    parser.add_argument(
        "--rejudge",
        default="",
        metavar="FILE",
        help="judge a --json FILE's rounds again by the current rules (and put them into "
        "--merge's); write with --json / --docs",
    )
    args = parser.parse_args()
    if args.rejudge:
        result = rejudged(json.loads(Path(args.rejudge).read_text()))
        if args.merge:
            result = _merged(json.loads(Path(args.merge).read_text()), result)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        if args.docs:
            write_docs(result)
        print(markdown(result))
        return 0
    if args.render:
        print(markdown(json.loads(Path(args.render).read_text())))
        return 0
    if args.docs_from:
        write_docs(json.loads(Path(args.docs_from).read_text()))
        return 0
    chosen = [b for b in BENCHMARKS if not args.only or b.name in args.only.split(",")]
    unknown = set(filter(None, args.only.split(","))) - {b.name for b in BENCHMARKS}
    if unknown:
        parser.error(f"no benchmark named {', '.join(sorted(unknown))}")
    rounds = args.rounds or (3 if args.quick else 5)
    base = Path(args.merge).read_text() if args.merge else ""
    compile_rtnb()
    began = time.perf_counter()
    rows: list[Row] = []
    report = []
    for bench in chosen:
        done: list[Round] = []
        bench_rounds = bench.rounds(rounds, args.quick)
        for k in range(bench_rounds):
            result = run_round(bench, args.quick, peer_first=bool(k % 2))
            done.append(result)
            what = result.error or ", ".join(
                f"{key} {'—' if v is None else f'{v:.4g}'}" for key, v in result.values.items()
            )
            print(
                f"[{time.perf_counter() - began:6.0f} s] {bench.name} round {k + 1}/{bench_rounds} "
                f"({'peer' if result.peer_first else 'rtnb'} first, {result.seconds:.0f} s): {what}",
                flush=True,
            )
            if result.error and k == 0:
                break  # a benchmark that cannot run here will not run in the next round
        bench_rows = summarise(bench, done, args.quick)
        rows.extend(bench_rows)
        report.append(
            {
                "benchmark": bench.name,
                "rounds": [asdict(r) for r in done],
                "figures": [asdict(r) for r in bench_rows],
            }
        )
        # A full run takes hours on 2 cores: what is measured is kept as it is
        # measured, so a run cut short can be finished with --only and --merge.
        if args.json:
            partial = _result(args, rounds, time.perf_counter() - began, report, base)
            Path(args.json).write_text(json.dumps(partial, indent=1))
    total = time.perf_counter() - began
    print()
    print_table(rows)
    missed = [r for r in rows if r.verdict in ("MISSED", "FAILED")]
    unjudged = [r for r in rows if r.verdict == "UNJUDGED"]
    print(
        f"\n{len(rows)} figures, {sum(r.verdict == 'MET' for r in rows)} goals met, "
        f"{len(missed)} missed or failed, {len(unjudged)} not judged; "
        f"{rounds} rounds{' (quick)' if args.quick else ''}, "
        f"{total / 60:.1f} min"
    )
    result = _result(args, rounds, total, report, base)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.docs:
        write_docs(result)
    return 1 if args.check and (missed or unjudged) else 0


if __name__ == "__main__":
    sys.exit(main())
