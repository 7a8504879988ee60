"""Comparing runs: each run's curve of a metric (the mean over its ranks), its last
and best value, and the runs table the dashboard, ``%rtnb runs`` and ``rtnb runs``
show."""

from __future__ import annotations

import time

from rtnb.core._score import score_rule
from rtnb.core._text import align_rows, format_duration

__all__ = [
    "NUMERIC_RUN_COLUMNS",
    "format_rows",
    "run_cells",
    "run_columns",
    "run_curve",
    "runs_rows",
]


def run_curve(store, metric: str, x_axis: str = "step"):
    """(xs, mean, low, high) of ``metric`` in ``store``: the mean over the ranks at
    the steps every rank reported (the one rank's curve for a single rank); low and
    high are the min-max band (None for one rank)."""
    steps, times, values = store.mean_series(metric)
    low = high = None
    if steps:
        _s, _t, low, high = store.band_series(metric)
    else:
        ranks = [r for r in store.ranks() if store.series(metric, r)[0]]
        if not ranks:
            return [], [], None, None
        steps, times, values = store.series(metric, ranks[0])
    if x_axis == "step":
        xs = list(steps)
    else:
        origin = store.started_at or (times[0] if times else 0.0)
        xs = [t - origin for t in times]
    return xs, list(values), low, high


def _last_best(store, metric: str, mode: str | None) -> tuple[float | None, float | None]:
    """The metric's last value and its best (None without a ``mode``)."""
    _xs, values, _lo, _hi = run_curve(store, metric) if store is not None else ([], [], 0, 0)
    finite = [v for v in values if v == v and abs(v) != float("inf")]
    if not finite:
        return None, None
    best = None if mode is None else (min if mode == "min" else max)(finite)
    return finite[-1], best


def _config_text(config: dict) -> str:
    parts = [str(config.get("backend") or "")]
    if config.get("score"):
        parts.append(f"score={config['score']}({config.get('mode', 'min')})")
    if config.get("keep"):
        parts.append(f"keep={config['keep']}")
    return " ".join(p for p in parts if p)


def runs_rows(runs, stores: dict, metric: str | None) -> list[dict]:
    """One dict per run with everything the table shows (numbers unformatted)."""
    rows = []
    for run in runs:
        store = stores.get(run.name)
        # The run's --score decides its own metric; another metric has a best only
        # when its name says which way is better (the same rule as the browser's).
        rule = score_rule(
            run.config.get("score") if run.config.get("score") == metric else None,
            run.config.get("mode", "min"),
            [metric] if metric else [],
        )
        last, best = (
            _last_best(store, metric, rule.mode if rule else None) if metric else (None, None)
        )
        rows.append(
            {
                "run": run.name,
                "status": run.shown_state,
                "started": run.started,
                "updated": run.updated,
                "duration": run.duration_s,
                "steps": run.steps,
                "ranks": run.workers,
                "checkpoints": run.checkpoints,
                "last": last,
                "best": best,
                "config": _config_text(run.config),
                "mlflow": getattr(run, "mlflow_link", ""),
            }
        )
    return rows


def _fmt_number(value) -> str:
    return "" if value is None else f"{value:.4g}"


def _when(t: float) -> str:
    return time.strftime("%m-%d %H:%M", time.localtime(t)) if t else "-"


def run_cells(row: dict) -> dict[str, str]:
    """A row of :func:`runs_rows` as the text each column shows, by the row's keys."""
    return {
        "run": row["run"],
        "status": row["status"],
        "started": _when(row["started"]),
        "duration": format_duration(row["duration"]) if row["started"] else "-",
        "steps": str(row["steps"]),
        "ranks": str(row["ranks"]),
        "checkpoints": str(row["checkpoints"]),
        "last": _fmt_number(row["last"]),
        "best": _fmt_number(row["best"]),
        "config": row["config"],
        "mlflow": row.get("mlflow") or "-",
    }


# The runs table's numeric columns (right-aligned; in the dashboard, sorted largest
# first unless they are the metric's, which follow its direction).
NUMERIC_RUN_COLUMNS = frozenset({"duration", "steps", "ranks", "checkpoints", "last", "best"})


def run_columns(rows: list[dict], metric: str | None) -> list[tuple[str, str]]:
    """(key in :func:`run_cells`, label) of each column the runs table shows, in
    order: the metric's last and best with a metric, the MLflow link when a run has one."""
    columns = [
        ("run", "run"),
        ("status", "status"),
        ("started", "started"),
        ("duration", "duration"),
        ("steps", "steps"),
        ("ranks", "ranks"),
        ("checkpoints", "ckpts"),
    ]
    if metric:
        columns += [("last", f"last {metric}"), ("best", f"best {metric}")]
    columns.append(("config", "config"))
    if any(r.get("mlflow") for r in rows):
        columns.append(("mlflow", "mlflow run"))
    return columns


def format_rows(rows: list[dict], metric: str | None) -> tuple[str, list[str]]:
    """(header, one line per row): aligned columns, numbers right-aligned."""
    columns = run_columns(rows, metric)
    numeric = {label for key, label in columns if key in NUMERIC_RUN_COLUMNS}
    table = [[label for _key, label in columns]]
    table += [[run_cells(r)[key] for key, _label in columns] for r in rows]
    head, *lines = align_rows(table, right=numeric)
    return head, lines
