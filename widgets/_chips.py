"""``RankChips``: the ranks of a live view as chips in their traces' colours, a
legend to click: a filled chip is drawn, an outlined one is off the plot (with many
ranks, where a band stands for them, a filled chip is a rank added to the band)."""

from __future__ import annotations

import anywidget
import traitlets

__all__ = ["RankChips"]

_ESM = """
function render({ model, el }) {
  const root = document.createElement("div");
  root.className = "rtnb-chips";
  el.appendChild(root);
  const draw = () => {
    const picked = new Set(model.get("value"));
    const colors = model.get("colors");
    const label = document.createElement("span");
    label.className = "rtnb-chips-label";
    label.textContent = "ranks";
    const chips = model.get("options").map((rank, i) => {
      const chip = document.createElement("button");
      chip.className = "rtnb-chip" + (picked.has(rank) ? " rtnb-on" : "");
      chip.style.setProperty("--rtnb-chip", colors[i] || "#888");
      chip.textContent = String(rank);
      chip.title = (picked.has(rank) ? "hide" : "show") + " rank " + rank;
      chip.setAttribute("aria-pressed", picked.has(rank) ? "true" : "false");
      chip.addEventListener("click", () => {
        const now = model.get("value");
        model.set("value", now.includes(rank) ? now.filter((r) => r !== rank) : [...now, rank].sort((a, b) => a - b));
        model.save_changes();
      });
      return chip;
    });
    root.replaceChildren(label, ...chips);
  };
  for (const name of ["options", "value", "colors"]) model.on("change:" + name, draw);
  draw();
  return () => { for (const name of ["options", "value", "colors"]) model.off("change:" + name, draw); };
}
export default { render };
"""

_CSS = """
.rtnb-chips { display: flex; flex-wrap: wrap; align-items: center; gap: 4px;
  font-family: var(--jp-ui-font-family, system-ui, sans-serif);
  font-size: var(--jp-ui-font-size1, 13px); max-width: 420px; }
.rtnb-chips-label { color: var(--jp-ui-font-color1, #212121); margin-right: 4px; }
.rtnb-chip { min-width: 26px; height: 22px; padding: 0 7px; border-radius: 11px;
  cursor: pointer; font: inherit; font-size: var(--jp-ui-font-size0, 11px); font-weight: 600;
  border: 2px solid var(--rtnb-chip); background: transparent;
  color: var(--jp-ui-font-color1, #212121); }
.rtnb-chip.rtnb-on { background: var(--rtnb-chip); color: #fff; }
.rtnb-chip:focus-visible { outline: 2px solid var(--jp-brand-color1, #1976d2); outline-offset: 1px; }
"""


class RankChips(anywidget.AnyWidget):
    """``options``: the ranks; ``value``: those filled (drawn, or added to the band);
    ``colors``: each option's trace colour."""

    _esm = _ESM
    _css = _CSS
    options = traitlets.List(traitlets.Int()).tag(sync=True)
    value = traitlets.List(traitlets.Int()).tag(sync=True)
    colors = traitlets.List(traitlets.Unicode()).tag(sync=True)
