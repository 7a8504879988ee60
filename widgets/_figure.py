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

A figure opens with its data and layout in its opening state (plotly sends them just
after), so one that anywidget gave up on still shows what it was made with. Such a
figure cannot hear the kernel again, but it can still speak: each view of a figure,
once drawn (also after a tab's reload), asks the kernel through the holder to
answer it; a figure that heard no answer says so, and its ``missed`` flag is set,
so the view that owns it draws a new figure (see ``figure_widget``).
"""

from __future__ import annotations

import functools
import threading
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path

from rtnb.widgets._subshell import answer_while_busy

__all__ = ["figure_widget", "missed_updates", "send_plotly_code"]

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

# How long a drawn figure waits for the kernel's answer before it says it missed it:
# the kernel answers in its subshell, milliseconds on a free machine.
_MISSED_AFTER_MS = 5000
# Misses heard per kernel, at most: a page so slow that every new figure misses would
# otherwise have its views make figures for as long as it stays so.
_MAX_MISSES = 50

# The holder only carries the code. The first figure that needs it has the page
# evaluate it: one long task of the page's main thread (~1.3 s here, more on a busy
# machine). Started by anything else, a figure model made just before it, whose own
# small module came in behind it, could miss anywidget's 2 s.
_HOLDER_ESM = "export default {};"

_FIGURE_ESM = (
    _LOAD
    + f"const MISSED_AFTER_MS = {_MISSED_AFTER_MS};\n"
    + r"""
async function sayIfMissed(model) {
  // A model anywidget gave up on hears nothing more from the kernel, but it can
  // still send: so the figure asks the kernel (through the holder, which the kernel
  // hears even while a cell runs) to answer it, and says it missed if no answer came.
  const key = model.get("_figure_key");
  const holder = await model.widget_manager.get_model(model.get("_plotly_code"));
  let answered;
  const heard = await new Promise((resolve) => {
    const timer = setTimeout(() => resolve(false), MISSED_AFTER_MS);
    answered = (message) => {
      if (message && message.hello === key) {
        clearTimeout(timer);
        resolve(true);
      }
    };
    model.on("msg:custom", answered);
    holder.send({ hello: key });
  });
  model.off("msg:custom", answered);
  if (!heard) holder.send({ missed: key });
}

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
    async render({ model, el }) {
      let cleanup;
      try {
        cleanup = await (await plotlyWidget).render({ el });
      } catch (error) {
        el.textContent = `plotly's page code did not load: ${error}`;
        return;
      }
      sayIfMissed(model); // not awaited: the view is drawn meanwhile
      return cleanup;
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
    something closed it, as ``Widget.close_all()`` does). Figures that missed their
    updates say so through it, heard while a cell keeps the kernel busy where the
    kernel has rtnb's subshell."""
    global _holder
    with _lock:
        if _holder is None or _holder.comm is None:
            _holder = _holder_class()(code=_bundle_path().read_text(encoding="utf-8"))
            _holder.on_msg(_on_holder_message)
        holder = _holder
    answer_while_busy(holder)
    return holder


# Figures by key, for the holder's "missed" messages; a closed figure drops out.
_figures: weakref.WeakValueDictionary[str, object] = weakref.WeakValueDictionary()
_misses = 0


def _on_holder_message(_holder, content, _buffers) -> None:
    global _misses
    if not isinstance(content, dict):
        return
    hello = content.get("hello")
    if isinstance(hello, str):
        figure = _figures.get(hello)
        if figure is not None:
            figure.send({"hello": hello})
        return
    key = content.get("missed")
    figure = _figures.pop(key, None) if isinstance(key, str) else None  # heard once
    if figure is None:
        return
    with _lock:
        if _misses >= _MAX_MISSES:
            return
        _misses += 1
    figure.missed = True
    if figure.on_missed is not None:
        figure.on_missed()


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
        _figure_key = traitlets.Unicode().tag(sync=True)
        # Declared here: plotly's figures refuse attributes they do not know.
        missed = False
        on_missed: Callable[[], None] | None = None

        def __init__(self, *args, **kwargs) -> None:
            # In the opening state: the holder's id and this figure's key, and (the
            # opening waits for plotly's own __init__) its data and layout.
            self._plotly_code = _plotly_code().model_id
            self._figure_key = uuid.uuid4().hex
            self._opening_later = True
            try:
                super().__init__(*args, **kwargs)
            finally:
                self._opening_later = False
            self.open()
            _figures[self._figure_key] = self

        def open(self) -> None:
            if not getattr(self, "_opening_later", False):
                super().open()

    return Figure


def figure_widget(*args, on_missed: Callable[[], None] | None = None, **kwargs):
    """A ``go.FigureWidget(*args, **kwargs)`` whose page code comes once per kernel.

    Its ``missed`` is True once the page said the figure cannot hear the kernel (see
    the module's docstring): its owner should draw a new one rather than update it;
    ``on_missed`` is then called (in the thread that heard it)."""
    figure = _figure_class()(*args, **kwargs)
    if _shares_plotly_code():  # plotly 5's own widget hears every update
        figure.on_missed = on_missed
    return figure


def missed_updates(figure) -> bool:
    """Whether the page said ``figure`` cannot hear the kernel: its owner should
    draw a new figure instead of updating it."""
    return bool(getattr(figure, "missed", False))
