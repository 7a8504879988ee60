"""``figure_widget``: plotly's ``FigureWidget`` with plotly's page code sent once.

plotly's ``FigureWidget`` is an anywidget whose module is plotly.js and its widget
code, ~5 MB carried in every figure's opening state and evaluated by the page once
per figure: every redraw that makes a new figure (a new metric, a new trial) paid it.
Worse, anywidget gives a model 2 s to load its module; past that the model drops
every message the kernel sends it, and the figure stays as it opened. plotly fills a
figure's data just after the opening, so such a figure stays empty for good: a live
sweep view that never drew a point, seen beside CI's suite on a busy day.

The figures here open with a small module instead. plotly's code travels once per
kernel in one hidden widget (``_PlotlyCode``); the page evaluates it once and draws
every figure's views with plotly's own widget code. A figure waits at most 1 s for
that code before it answers anywidget; a first figure that comes up slower is drawn
when the code is there, from its latest synced data (the live views send their
traces whole on each redraw).
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

__all__ = ["figure_widget", "send_plotly_code"]

# One evaluation of plotly's code per page and plotly version (two kernels of one
# page may run different plotly versions). A load that failed is forgotten: the next
# figure tries again.
_LOAD = r"""
const PAGE_CACHE = "__rtnb_plotly_widget_code";

function plotlyWidgetCode(version, readCode) {
  const cache = (globalThis[PAGE_CACHE] ??= new Map());
  if (!cache.has(version)) {
    const loading = (async () => {
      const blob = new Blob([await readCode()], { type: "text/javascript" });
      const url = URL.createObjectURL(blob);
      try {
        return await import(url);
      } finally {
        URL.revokeObjectURL(url);
      }
    })();
    loading.catch(() => cache.delete(version));
    cache.set(version, loading);
  }
  return cache.get(version);
}
"""

# The holder only carries the code. The first figure that needs it has the page
# evaluate it: one long task of the page's main thread (~1.3 s here, more on a busy
# machine). Started by anything else, a figure model made just before it, whose own
# small module came in behind it, could miss anywidget's 2 s.
_HOLDER_ESM = "export default {};"

_FIGURE_ESM = (
    _LOAD
    + r"""
export default () => {
  let plotlyWidget = null;
  return {
    async initialize({ model }) {
      const readCode = async () => {
        const holder = await model.widget_manager.get_model(model.get("_plotly_code"));
        return holder.get("code");
      };
      plotlyWidget = plotlyWidgetCode(model.get("_plotly_version"), readCode).then((code) => {
        const widget = code.default();
        widget.initialize({ model });
        return widget;
      });
      // Quick (the code already in the page): plotly's listeners are on before any
      // message reaches the model. Never near anywidget's 2 s.
      const aSecond = new Promise((resolve) => setTimeout(resolve, 1000));
      await Promise.race([plotlyWidget, aSecond]).catch(() => {});
    },
    async render({ el }) {
      try {
        return (await plotlyWidget).render({ el });
      } catch (error) {
        el.textContent = `plotly's page code did not load: ${error}`;
      }
    },
  };
};
"""
)

_lock = threading.Lock()
_holder = None


def send_plotly_code() -> None:
    """Send plotly's page code to the page now (5 MB), so that the first figure does
    not wait for it."""
    if _shares_plotly_code():
        _plotly_code()


def _plotly_code():
    """The kernel's one hidden widget holding plotly's page code (made again if
    something closed it, as ``Widget.close_all()`` does)."""
    global _holder
    with _lock:
        if _holder is None or _holder.comm is None:
            _holder = _holder_class()(code=_bundle_path().read_text(encoding="utf-8"))
        return _holder


def _bundle_path() -> Path:
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "widgetbundle.js"


@functools.cache
def _holder_class():
    import anywidget
    import traitlets

    class _PlotlyCode(anywidget.AnyWidget):
        _esm = _HOLDER_ESM
        code = traitlets.Unicode().tag(sync=True)

    return _PlotlyCode


@functools.cache
def _shares_plotly_code() -> bool:
    """Whether plotly's FigureWidget is an anywidget with its page code in one file
    (plotly 6 on); plotly 5's is a classic widget whose code a JupyterLab extension
    brings once, which needs none of this."""
    import anywidget
    import plotly.graph_objects as go

    return issubclass(go.FigureWidget, anywidget.AnyWidget) and _bundle_path().is_file()


@functools.cache
def _figure_class():
    import plotly
    import plotly.graph_objects as go
    import traitlets

    if not _shares_plotly_code():
        return go.FigureWidget

    class Figure(go.FigureWidget):
        _esm = _FIGURE_ESM
        _plotly_code = traitlets.Unicode().tag(sync=True)
        _plotly_version = traitlets.Unicode(plotly.__version__).tag(sync=True)

        def __init__(self, *args, **kwargs) -> None:
            # Before plotly opens the widget: the id is in its opening state.
            self._plotly_code = _plotly_code().model_id
            super().__init__(*args, **kwargs)

    return Figure


def figure_widget(*args, **kwargs):
    """A ``go.FigureWidget(*args, **kwargs)`` whose page code comes once per kernel."""
    return _figure_class()(*args, **kwargs)
