"""A snapshot of the session for ``%rtnb status`` (text and HTML, no display code)."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rtnb.core._text import format_table

if TYPE_CHECKING:
    from rtnb.core._config import SessionConfig
    from rtnb.driver.cells import CellHandle
    from rtnb.driver.control import Controller
    from rtnb.metrics._store import MetricsStore

__all__ = ["GroupStatus", "RankStatus", "group_status"]


def group_status(
    run_name: str,
    config: SessionConfig,
    controller: Controller,
    active: CellHandle | None,
    metrics: MetricsStore,
    state_text: str,
    mlflow_run: str = "",
) -> GroupStatus:
    """The snapshot: each rank's place, pid, device, step and state, the cell."""
    group = controller.group
    ranks = []
    for info in group.ranks if group is not None else []:
        last = metrics.last.get(info.rank)
        state, step = "idle", last.step if last is not None else 0
        if active is not None and info.rank in active.ranks:
            state = active.attempt.states.get(info.rank, "running")
            # the rank's own step once it answered (after a resume it is below the
            # last report of the earlier line)
            if info.rank in active.attempt.lines:
                step = max(active.steps.get(info.rank, -1), 0)
        where = f"{info.hostname} ({info.node_ip})"
        ranks.append(
            RankStatus(
                info.rank, where, info.pid, info.device, step, state, group.calls_path(info.rank)
            )
        )
    cell = controller.ray_lost or ""
    if not cell and active is not None:
        background = " (background)" if active.background else ""
        cell = f"{active.name}{background} running for {active.elapsed_s:.1f} s"
    return GroupStatus(
        state=state_text,
        run_name=run_name,
        address=controller.connection.address if controller.connection else "-",
        local=config.local,
        backend=config.backend or "",
        world_size=controller.world_size,
        size_reason=controller.size_reason or "",
        ranks=ranks,
        cell=cell,
        mlflow_run=mlflow_run,
    )


@dataclass
class RankStatus:
    rank: int
    node: str
    pid: int
    device: str
    step: int = 0
    state: str = "idle"
    calls: str = ""  # how cells reach it: "channel" (open), "Ray" (actor calls), "in process"


@dataclass
class GroupStatus:
    state: str
    run_name: str
    address: str
    backend: str
    world_size: int
    ranks: list[RankStatus] = field(default_factory=list)
    cell: str = ""  # what runs now: "cell 3 (background), 12.5 s"
    mlflow_run: str = ""  # the MLflow run it is mirrored into (--mlflow)
    local: bool = False  # local mode: rank 0 runs in the kernel's own process
    size_reason: str = ""  # an elastic group: its size and why ("elastic 2-4: 3 ranks ...")

    def _rows(self) -> list[list[str]]:
        return [
            [
                str(r.rank),
                r.node,
                str(r.pid),
                r.device,
                self.backend,
                r.calls,
                r.state,
                str(r.step),
            ]
            for r in self.ranks
        ]

    _HEAD = ["rank", "node", "pid", "device", "backend", "calls", "state", "step"]

    def __str__(self) -> str:
        lines = [
            f"rtnb run {self.run_name!r}: {self.state}, {self.world_size} ranks"
            + (f" ({self.size_reason})" if self.size_reason else "")
            + ", "
            f"{self.backend}, "
            + ("local mode (rank 0 in this kernel)" if self.local else f"Ray {self.address}")
            + (f"; {self.cell}" if self.cell else "")
            + (f"; MLflow run {self.mlflow_run}" if self.mlflow_run else "")
        ]
        lines.append(format_table([self._HEAD, *self._rows()]))
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in self._HEAD)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
            for row in self._rows()
        )
        title = html.escape(str(self).splitlines()[0])
        return (
            f'<div class="rtnb-status"><b>{title}</b>'
            f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
        )
