"""The one-line header over a cell's output: state, step, rate, ETA, resources,
stragglers. Shared by the live view and the static figure a saved notebook keeps."""

from __future__ import annotations

import html

__all__ = ["format_header"]


def _fmt_s(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
        if seconds >= 3600
        else f"{seconds // 60:02d}:{seconds % 60:02d}"
    )


def format_header(
    progress,
    state: str,
    cell_id: int | None = None,
    restarts: int = 0,
    restarted_from: str | None = None,
    *,
    label: str | None = None,
    running_ranks: set[int] | None = None,
    resumed_from: str | None = None,
    resources: dict | None = None,
    climbing: list[int] | None = None,
) -> str:
    """One line: the cell (``label``, e.g. Jupyter's ``[5]``, else rtnb's cell
    number), state, restarts, the last step reported (numbered as the loop numbers
    it), this cell's steps done of ``--steps``, ETA, steps/s, elapsed, stragglers
    among ``running_ranks``."""
    parts = [f"<b>{html.escape(state)}</b>"]
    if label is not None:
        parts.insert(0, html.escape(label))
    elif cell_id is not None:
        parts.insert(0, f"cell {cell_id}")
    if resumed_from and not restarts:
        parts.append(f"⤷ resumed from {html.escape(resumed_from)}")
    if restarts:
        origin = f" from {html.escape(restarted_from)}" if restarted_from else " from scratch"
        parts.append(f'<span style="font-weight:bold">↻ restarted {restarts}×, last{origin}</span>')
    # One convention: "step" is the step as the loop, the plot's x axis and the
    # checkpoint ids number it (the last one reported); "N/T done" counts this
    # cell's reports against --steps.
    if progress.steps:
        parts.append(f"step {getattr(progress, 'run_step', progress.step)}")
    if progress.total_steps:
        parts.append(f"{progress.step}/{progress.total_steps} done")
    if progress.eta_s is not None and state == "running":
        parts.append(f"ETA {_fmt_s(progress.eta_s)}")
    parts.append(f"{progress.rate:.1f} steps/s")
    parts.append(f"{_fmt_s(progress.elapsed_s)} elapsed")
    stragglers = [
        r
        for r in progress.stragglers
        if state == "running" and (running_ranks is None or r in running_ranks)
    ]
    if resources and state == "running":
        parts.append(_resources_text(resources))
    if climbing:
        parts.append(
            '<span style="color:var(--jp-error-color1, #d32f2f)">⚠ memory climbing: rank '
            + ", ".join(str(r) for r in climbing)
            + "</span>"
        )
    if stragglers:
        ranks = ", ".join(str(r) for r in stragglers)
        # The theme's own error colour: 5:1 on light and dark (a fixed #c0392b was
        # 3.5:1 on dark; the orange "restarted" was 4.2:1 on white, now bold text).
        parts.append(
            f'<span style="color:var(--jp-error-color1, #d32f2f)">⚠ straggler: rank {ranks}</span>'
        )
    return " · ".join(parts)


def _resources_text(resources: dict) -> str:
    """Each rank's CPU and memory (and GPU) for a few ranks; for many, the mean and
    the rank using the most."""
    samples = list(resources.values())
    gpu = [s for s in samples if s.gpu_util is not None]
    if len(resources) <= 4:
        cpu = "/".join(f"{s.cpu_percent:.0f}" for s in samples)
        rss = "/".join(f"{s.rss_bytes / 2**20:.0f}" for s in samples)
        text = f"CPU {cpu}% · RSS {rss} MB"
        if gpu:
            util = "/".join(f"{s.gpu_util:.0f}" for s in gpu)
            mem = "/".join(f"{(s.gpu_mem_bytes or 0) / 2**30:.1f}" for s in gpu)
            text += f" · GPU {util}% {mem} GB"
        return text
    top_cpu = max(resources, key=lambda r: resources[r].cpu_percent)
    top_rss = max(resources, key=lambda r: resources[r].rss_bytes)
    mean_cpu = sum(s.cpu_percent for s in samples) / len(samples)
    text = (
        f"CPU mean {mean_cpu:.0f}% (max {resources[top_cpu].cpu_percent:.0f}% rank {top_cpu})"
        f" · RSS max {resources[top_rss].rss_bytes / 2**20:.0f} MB (rank {top_rss})"
    )
    if gpu:
        text += f" · GPU mean {sum(s.gpu_util for s in gpu) / len(gpu):.0f}%"
    return text
