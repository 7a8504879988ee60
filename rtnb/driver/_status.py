"""A snapshot of the session for ``%rtnb status`` (text and HTML, no display code)."""

from __future__ import annotations

import html
from dataclasses import dataclass, field

from rtnb.core._text import format_table

__all__ = ["GroupStatus", "RankStatus"]


@dataclass
class RankStatus:
    rank: int
    node: str
    pid: int
    device: str
    step: int = 0
    state: str = "idle"


@dataclass
class GroupStatus:
    state: str
    run_name: str
    address: str
    backend: str
    world_size: int
    ranks: list[RankStatus] = field(default_factory=list)
    cell: str = ""  # what runs now: "cell 3 (background), 12.5 s"

    def _rows(self) -> list[list[str]]:
        return [
            [str(r.rank), r.node, str(r.pid), r.device, self.backend, r.state, str(r.step)]
            for r in self.ranks
        ]

    _HEAD = ["rank", "node", "pid", "device", "backend", "state", "step"]

    def __str__(self) -> str:
        lines = [
            f"rtnb run {self.run_name!r}: {self.state}, {self.world_size} ranks, "
            f"{self.backend}, Ray {self.address}" + (f"; {self.cell}" if self.cell else "")
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
