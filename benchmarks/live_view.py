"""What the live view costs the kernel, and how far its plot is behind the reports.

For 2, 8, 32 and 128 ranks (``--sizes``; simulated: the reports are fed into the kernel's store
here, not sent by rank processes, so 128 ranks fit on this machine), each reporting
100 times a second for ``--seconds`` (fed into the
kernel's metrics store in 50 ms batches per rank, as the long-polls deliver them):

- rtnb: ``LiveMetrics`` on the store, redrawing on its own thread;
- peer: the plot a careful user writes themselves, a ``FigureWidget`` with one trace
  per rank, redrawn at most 10 times a second (rtnb's ceiling) when points arrived,
  each trace thinned to 1,000 points (see ``_PeerView``).

Printed per side: the kernel CPU share of the drawing thread (its whole CPU time,
the first figure's making included on both sides, over the feed's wall time), the mean cost of one redraw, redraws per second, and the plot's lag:
sampled every 100 ms, how many steps each rank's last drawn point (its own line's, or
at 9 ranks and more, where a rank with no line of its own is drawn inside the band,
the band's) is behind its last report, as a median and 95th percentile (and in seconds at 100 steps/s). No frontend
is attached: this is the kernel's side of the view (the browser's side is measured
by tests/test_browser.py against the header's step).

    .venv/bin/python benchmarks/live_view.py [--seconds 10] [--sizes 2,8,32,128]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

RATE_HZ = 100
BATCH_S = 0.05


def _feed(store, ranks: int, seconds: float, stop: threading.Event, last: dict) -> None:
    """Every rank reports RATE_HZ times a second, delivered in BATCH_S batches."""
    per_batch = int(RATE_HZ * BATCH_S)
    step = 0
    started = time.monotonic()
    while not stop.is_set() and time.monotonic() - started < seconds:
        now = time.time()
        for rank in range(ranks):
            store.add(
                rank,
                [
                    (
                        step + i,
                        now,
                        {"loss": 2.0 * 0.999 ** (step + i) + 0.01 * rank, "acc": 0.5 + rank * 0.01},
                    )
                    for i in range(per_batch)
                ],
            )
            last[rank] = step + per_batch - 1
        step += per_batch
        time.sleep(BATCH_S)


def _drawn_last(figure, ranks: int) -> dict[int, int]:
    """Each rank's last drawn step on the first subplot: its own trace's, or, for a
    rank a many-rank view draws only inside the min–max band, the band's (which
    holds every rank's value at the steps all reported)."""
    out: dict[int, int] = {}
    if figure is None:
        return out
    band = -1
    for trace in figure.data:
        name = trace.name or ""
        if trace.yaxis not in (None, "y") or trace.x is None or not len(trace.x):
            continue
        if name.startswith("rank "):
            out[int(name[5:])] = int(trace.x[-1])
        elif name.startswith("min–max"):
            band = max(band, int(trace.x[-1]))
    if band >= 0:
        for rank in range(ranks):
            out.setdefault(rank, band)
    return out


class _PeerView:
    """The live plot a careful user writes: one FigureWidget, a subplot per metric and
    a trace per rank (rtnb's figure also has each metric's mean), redrawn at most 10
    times a second and only when points arrived, each trace thinned to at most
    MAX_POINTS (every k-th point and the last), all traces in one batch_update."""

    METRICS = ("loss", "acc")
    MAX_POINTS = 1000

    def __init__(self, store, ranks: int) -> None:
        self.store = store
        self.ranks = ranks
        self.figure = None
        self.redraws = 0
        self.spent = 0.0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _build(self) -> None:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        base = make_subplots(rows=len(self.METRICS), cols=1, shared_xaxes=True)
        for row, _metric in enumerate(self.METRICS, start=1):
            for r in range(self.ranks):
                base.add_trace(
                    go.Scatter(x=[], y=[], mode="lines", name=f"rank {r}"), row=row, col=1
                )
        self.figure = go.FigureWidget(base)

    def _loop(self) -> None:
        # The figure is made in the drawing thread, as rtnb's view makes its own, so
        # its cost is counted on both sides alike.
        self._build()
        drawn = -1
        while not self._stop.wait(0.1):
            started = time.thread_time()
            arrived = self.store.count()
            if arrived == drawn:
                continue
            drawn = arrived
            with self.figure.batch_update():
                for index, trace in enumerate(self.figure.data):
                    metric, rank = self.METRICS[index // self.ranks], index % self.ranks
                    steps, _times, values = self.store.series(metric, rank)
                    trace.x, trace.y = self._thin(list(steps)), self._thin(list(values))
            self.spent += time.thread_time() - started
            self.redraws += 1

    @classmethod
    def _thin(cls, points: list) -> list:
        stride = -(-len(points) // cls.MAX_POINTS)
        if stride <= 1:
            return points
        kept = points[::stride]
        return kept if (len(points) - 1) % stride == 0 else [*kept, points[-1]]

    def close(self) -> None:
        self._stop.set()
        self.thread.join()


def _measure(kind: str, ranks: int, seconds: float) -> dict:
    from rtnb.widgets import LiveMetrics

    from rtnb.metrics._store import MetricsStore

    store = MetricsStore()
    store.begin(list(range(ranks)))
    last: dict[int, int] = {}
    stop = threading.Event()
    feeder = threading.Thread(target=_feed, args=(store, ranks, seconds, stop, last), daemon=True)
    if kind == "rtnb":
        view = LiveMetrics(store)
        drawing = view._thread
    else:
        view = _PeerView(store, ranks)
        drawing = view.thread
    # Each view's thread is its own from its start: all of its CPU is the view's,
    # the first figure's making included (on both sides).
    started = time.monotonic()
    feeder.start()
    behind: list[int] = []
    while feeder.is_alive():
        time.sleep(0.1)
        drawn = _drawn_last(view.figure, ranks)
        for rank, reported in list(last.items()):
            if time.monotonic() - started > 1.0:  # past the first draw
                behind.append(reported - drawn.get(rank, -1))
    wall = time.monotonic() - started
    cpu = _thread_cpu(drawing)
    redraws = view.redraws
    view.close()
    behind.sort()
    return {
        "cpu_share": cpu / wall,
        "redraw_ms": 1000 * cpu / max(1, redraws),
        "redraws_per_s": redraws / wall,
        "lag_median": statistics.median(behind) if behind else float("nan"),
        "lag_p95": behind[int(0.95 * (len(behind) - 1))] if behind else float("nan"),
    }


def _thread_cpu(thread: threading.Thread) -> float:
    """CPU seconds of ``thread`` so far (Linux: its /proc task stat)."""
    import os

    with open(f"/proc/self/task/{thread.native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--sizes", default="2,8,32,128")
    args = parser.parse_args()
    tempfile.tempdir = tempfile.mkdtemp(prefix="rtnb-live-bench-")
    # As in a kernel after `%rtnb start`: plotly's widget machinery imported already.
    from _common import emit, in_order
    from plotly.graph_objects import FigureWidget  # noqa: F401

    print(f"live_view: {RATE_HZ} reports/s per rank for {args.seconds:g} s, no frontend attached")
    # What only a process's first figure pays (plotly's templates and validators
    # loaded): paid here, untimed, by both views, so neither side's figure is charged
    # for the other's (the side drawn first in a round used to pay it alone).
    for kind in ("rtnb", "peer"):
        _measure(kind, 2, 1.5)
    figures = {}
    for ranks in (int(n) for n in args.sizes.split(",")):
        measured = {kind: _measure(kind, ranks, args.seconds) for kind in in_order("rtnb", "peer")}
        results = {kind: measured[kind] for kind in ("rtnb", "peer")}
        for kind, r in results.items():
            print(
                f"  {ranks} ranks, {kind:4}: drawing CPU {100 * r['cpu_share']:5.1f}% of a core | "
                f"{r['redraw_ms']:6.1f} ms per redraw | {r['redraws_per_s']:4.1f} redraws/s | "
                f"plot behind the reports: median {r['lag_median']:.0f} steps "
                f"({r['lag_median'] / RATE_HZ:.2f} s), p95 {r['lag_p95']:.0f} steps "
                f"({r['lag_p95'] / RATE_HZ:.2f} s)"
            )
        ours, peer = results["rtnb"], results["peer"]
        print(
            f"  {ranks} ranks, rtnb vs peer: drawing CPU {ours['cpu_share'] / peer['cpu_share']:.2f}x, "
            f"lag p95 {ours['lag_p95'] / max(1, peer['lag_p95']):.2f}x "
            f"(goal: p95 lag <= 1 s = {RATE_HZ} steps)"
        )
        figures.update(
            {
                f"cpu_ratio_{ranks}": ours["cpu_share"] / peer["cpu_share"],
                f"p95_lag_steps_{ranks}": ours["lag_p95"],
                f"cpu_share_{ranks}": 100 * ours["cpu_share"],
            }
        )
    emit(**figures)


if __name__ == "__main__":
    main()
