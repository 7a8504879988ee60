"""``DataTable``: the rows a view lists (checkpoints, runs, trials) as an HTML table
drawn by the page, in JupyterLab's own fonts and colours, light or dark.

A header click sorts by that column (again: the other way), at once in the page and
in the kernel's :meth:`DataTable.ordered` alike, so a sort needs no free kernel. A
row click selects it (one row, or toggles it where ``multiple``); arrow keys move a
single selection. Rows carry badges (``best``, ``latest``, a state), drawn as
coloured pills beside the row's name; the best row is also tinted and edged, so it
stands out before a word of it is read. Rows of a ``group`` (a checkpoint's line of
training) stay together, in the order the groups first appear, under a heading when
there is more than one group.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from typing import Literal

import anywidget
import traitlets

__all__ = ["Column", "DataTable", "Row", "Tone", "order_rows"]

# What a badge means, which decides its colour (the same in every view).
Tone = Literal["best", "latest", "good", "bad", "busy", "muted"]


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    numeric: bool = False
    # The way a first click on the header sorts: the newest or the most first for a
    # step or a time, the lowest first for a metric unless it is better high.
    descending_first: bool = False
    # The column the row's badges are drawn in (its name column).
    badges: bool = False


@dataclass(frozen=True)
class Row:
    id: str
    cells: dict[str, str]
    # What the row sorts by in each column (a number or text; None sorts last).
    keys: dict[str, float | str | None] = field(default_factory=dict)
    badges: tuple[tuple[str, Tone], ...] = ()
    selectable: bool = True
    group: str = ""
    tooltip: str = ""


def order_rows(rows: list[Row], sort_by: str, descending: bool) -> list[Row]:
    """The rows in the order the page shows them: groups in the order they first
    appear; inside one, by ``sort_by`` (missing values last, ties as given)."""
    groups = {row.group: i for i, row in reversed(list(enumerate(rows)))}

    def compare(i: int, j: int) -> int:
        a, b = rows[i], rows[j]
        if groups[a.group] != groups[b.group]:
            return groups[a.group] - groups[b.group]
        va, vb = a.keys.get(sort_by), b.keys.get(sort_by)
        if va is None or vb is None:
            return (va is None) - (vb is None) or i - j
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)):
            c = (va > vb) - (va < vb)
        else:
            c = (str(va) > str(vb)) - (str(va) < str(vb))
        return (-c if descending else c) or i - j

    return [rows[i] for i in sorted(range(len(rows)), key=functools.cmp_to_key(compare))]


_ESM = """
const TONES = ["best", "latest", "good", "bad", "busy", "muted"];
function render({ model, el }) {
  const root = document.createElement("div");
  root.className = "rtnb-table";
  root.tabIndex = 0;
  el.appendChild(root);
  const compare = (sortBy, desc, groups) => (a, b) => {
    const g = groups.get(a.group) - groups.get(b.group);
    if (g !== 0) return g;
    const va = a.keys[sortBy], vb = b.keys[sortBy];
    const ma = va === null || va === undefined, mb = vb === null || vb === undefined;
    if (ma || mb) return ma === mb ? a.order - b.order : (ma ? 1 : -1);
    let c;
    if (typeof va === "number" && typeof vb === "number") c = Math.sign(va - vb);
    else c = String(va) > String(vb) ? 1 : String(va) < String(vb) ? -1 : 0;
    return (desc ? -c : c) || a.order - b.order;
  };
  const ordered = () => {
    const rows = model.get("rows").map((r, i) => ({ ...r, order: i }));
    const groups = new Map();
    rows.forEach((r) => { if (!groups.has(r.group)) groups.set(r.group, groups.size); });
    return [rows.sort(compare(model.get("sort_by"), model.get("descending"), groups)), groups];
  };
  const choose = (row) => {
    if (!row.selectable) return;
    const selected = model.get("selected");
    let next;
    if (model.get("multiple")) {
      next = selected.includes(row.id)
        ? selected.filter((id) => id !== row.id) : [...selected, row.id];
    } else {
      next = [row.id];
    }
    model.set("selected", next);
    model.save_changes();
  };
  const sortOn = (column) => {
    if (model.get("sort_by") === column.key) {
      model.set("descending", !model.get("descending"));
    } else {
      model.set("sort_by", column.key);
      model.set("descending", !!column.descending_first);
    }
    model.save_changes();
  };
  const draw = () => {
    const columns = model.get("columns");
    const [rows, groups] = ordered();
    const selected = new Set(model.get("selected"));
    const multiple = model.get("multiple");
    const sortBy = model.get("sort_by");
    const table = document.createElement("table");
    const head = table.createTHead().insertRow();
    if (multiple) head.appendChild(document.createElement("th")).className = "rtnb-pick";
    for (const column of columns) {
      const th = document.createElement("th");
      th.textContent = column.label;
      th.dataset.key = column.key;
      if (column.numeric) th.classList.add("rtnb-num");
      if (column.key === sortBy) {
        th.classList.add(model.get("descending") ? "rtnb-desc" : "rtnb-asc");
        th.setAttribute("aria-sort", model.get("descending") ? "descending" : "ascending");
      }
      th.title = "sort by " + column.label;
      th.addEventListener("click", () => sortOn(column));
      head.appendChild(th);
    }
    const body = table.createTBody();
    let group = null;
    for (const row of rows) {
      if (groups.size > 1 && row.group !== group) {
        group = row.group;
        const cell = body.insertRow().insertCell();
        cell.colSpan = columns.length + (multiple ? 1 : 0);
        cell.className = "rtnb-group";
        cell.textContent = row.group;
      }
      const tr = body.insertRow();
      tr.dataset.id = row.id;
      if (row.tooltip) tr.title = row.tooltip;
      const tones = row.badges.map(([, tone]) => tone);
      if (tones.includes("best")) tr.classList.add("rtnb-best");
      if (selected.has(row.id)) {
        tr.classList.add("rtnb-selected");
        tr.setAttribute("aria-selected", "true");
      }
      if (!row.selectable) tr.classList.add("rtnb-inert");
      if (multiple) {
        const pick = tr.insertCell();
        pick.className = "rtnb-pick";
        const box = document.createElement("input");
        box.type = "checkbox";
        box.checked = selected.has(row.id);
        box.disabled = !row.selectable;
        box.tabIndex = -1;
        pick.appendChild(box);
      }
      for (const column of columns) {
        const td = tr.insertCell();
        const text = document.createElement("span");
        text.textContent = row.cells[column.key] ?? "";
        td.appendChild(text);
        if (column.numeric) td.classList.add("rtnb-num");
        if (column.badges) {
          for (const [label, tone] of row.badges) {
            const pill = document.createElement("span");
            pill.className = "rtnb-badge rtnb-" + (TONES.includes(tone) ? tone : "muted");
            pill.textContent = label;
            td.appendChild(pill);
          }
        }
      }
      // On the press, not the click: the table is drawn anew each second while a
      // run or sweep goes on, and a click whose press and release fall on two
      // drawings of the row never fires.
      tr.addEventListener("pointerdown", (event) => {
        if (event.button !== 0) return;
        choose(row);
        root.focus();
      });
    }
    root.replaceChildren(table);
    const chosen = root.querySelector("tr.rtnb-selected");
    if (chosen && !multiple) chosen.scrollIntoView({ block: "nearest" });
  };
  root.addEventListener("keydown", (event) => {
    if (model.get("multiple") || !["ArrowDown", "ArrowUp"].includes(event.key)) return;
    const [rows] = ordered();
    const open = rows.filter((r) => r.selectable);
    if (!open.length) return;
    const at = open.findIndex((r) => r.id === model.get("selected")[0]);
    const step = event.key === "ArrowDown" ? 1 : -1;
    const next = at < 0 ? 0 : Math.min(open.length - 1, Math.max(0, at + step));
    event.preventDefault();
    choose(open[next]);
  });
  const names = ["rows", "columns", "sort_by", "descending", "selected", "multiple"];
  for (const name of names) model.on("change:" + name, draw);
  draw();
  return () => { for (const name of names) model.off("change:" + name, draw); };
}
export default { render };
"""

_CSS = """
.rtnb-table { max-height: 340px; overflow: auto; outline: none;
  border: 1px solid var(--jp-border-color2, #e0e0e0); border-radius: 4px;
  font-family: var(--jp-ui-font-family, system-ui, sans-serif);
  font-size: var(--jp-ui-font-size1, 13px); color: var(--jp-ui-font-color1, #212121); }
.rtnb-table:focus-visible { border-color: var(--jp-brand-color1, #1976d2); }
.rtnb-table table { border-collapse: collapse; width: 100%; }
.rtnb-table th { position: sticky; top: 0; z-index: 1; text-align: left; cursor: pointer;
  padding: 6px 10px; font-weight: 600; font-size: var(--jp-ui-font-size0, 11px);
  letter-spacing: .02em; color: var(--jp-ui-font-color1, #212121); white-space: nowrap;
  user-select: none; background: var(--jp-layout-color2, #eee);
  border-bottom: 1px solid var(--jp-border-color1, #bdbdbd); }
.rtnb-table th:hover { color: var(--jp-brand-color1, #1976d2); }
.rtnb-table th.rtnb-asc::after { content: " \\25B2"; font-size: 9px; }
.rtnb-table th.rtnb-desc::after { content: " \\25BC"; font-size: 9px; }
.rtnb-table td { padding: 5px 10px; white-space: nowrap; cursor: pointer;
  border-bottom: 1px solid var(--jp-border-color3, #eee); }
.rtnb-table .rtnb-num { text-align: right; font-variant-numeric: tabular-nums; }
.rtnb-table tbody tr { box-shadow: inset 3px 0 0 transparent; }
.rtnb-table tbody tr:hover { background: var(--jp-layout-color2, #f5f5f5); }
.rtnb-table tr.rtnb-best { background: rgba(212, 160, 23, .10);
  box-shadow: inset 3px 0 0 #d4a017; }
.rtnb-table tr.rtnb-selected, .rtnb-table tr.rtnb-selected:hover {
  background: rgba(33, 150, 243, .20); box-shadow: inset 3px 0 0 var(--jp-brand-color1, #1976d2); }
.rtnb-table tr.rtnb-inert td { cursor: default; color: var(--jp-ui-font-color2, #616161);
  font-style: italic; }
.rtnb-table td.rtnb-group { cursor: default; padding: 8px 10px 3px; font-weight: 600;
  font-size: var(--jp-ui-font-size0, 11px); color: var(--jp-ui-font-color1, #212121);
  background: transparent; border-bottom: 1px solid var(--jp-border-color2, #e0e0e0); }
.rtnb-table .rtnb-pick { width: 18px; padding-right: 0; }
.rtnb-table .rtnb-pick input { margin: 0; pointer-events: none; }
.rtnb-badge { display: inline-block; margin-left: 6px; padding: 0 7px; border-radius: 9px;
  font-size: var(--jp-ui-font-size0, 11px); font-weight: 600; font-style: normal;
  line-height: 17px; vertical-align: 1px; }
.rtnb-badge.rtnb-best { background: rgba(212, 160, 23, .22); color: #6b4a00; }
.rtnb-badge.rtnb-latest { background: rgba(46, 160, 67, .18); color: #145a23; }
.rtnb-badge.rtnb-good { background: rgba(46, 160, 67, .18); color: #145a23; }
.rtnb-badge.rtnb-bad { background: rgba(211, 47, 47, .16); color: #9a1414; }
.rtnb-badge.rtnb-busy { background: rgba(33, 150, 243, .18); color: #0b4a8a; }
.rtnb-badge.rtnb-muted { background: rgba(128, 128, 128, .18);
  color: var(--jp-ui-font-color1, #212121); }
body[data-jp-theme-light="false"] .rtnb-badge.rtnb-best { color: #f2c744; }
body[data-jp-theme-light="false"] .rtnb-badge.rtnb-latest,
body[data-jp-theme-light="false"] .rtnb-badge.rtnb-good { color: #6fd88a; }
body[data-jp-theme-light="false"] .rtnb-badge.rtnb-bad { color: #ff8a80; }
body[data-jp-theme-light="false"] .rtnb-badge.rtnb-busy { color: #82c4ff; }
"""


class DataTable(anywidget.AnyWidget):
    """A table widget (see the module's docstring): :meth:`show` gives it columns and
    rows; ``selected`` holds the ids picked (observe it); :meth:`ordered` is the order
    the page shows."""

    _esm = _ESM
    _css = _CSS
    columns = traitlets.List().tag(sync=True)
    rows = traitlets.List().tag(sync=True)
    sort_by = traitlets.Unicode("").tag(sync=True)
    descending = traitlets.Bool(False).tag(sync=True)
    selected = traitlets.List(traitlets.Unicode()).tag(sync=True)
    multiple = traitlets.Bool(False).tag(sync=True)

    def show(self, columns: list[Column], rows: list[Row]) -> None:
        """Show these columns and rows; the selection keeps the ids still listed and
        selectable. The sort may be by a key no column shows (a run's last write)."""
        open_ids = {row.id for row in rows if row.selectable}
        kept = [i for i in self.selected if i in open_ids]
        with self.hold_sync():
            self.columns = [asdict(column) for column in columns]
            self.rows = [{**asdict(row), "badges": [list(b) for b in row.badges]} for row in rows]
            if kept != list(self.selected):
                self.selected = kept

    def ordered(self, rows: list[Row]) -> list[Row]:
        """``rows`` in the order the page shows them now."""
        return order_rows(rows, self.sort_by, self.descending)
