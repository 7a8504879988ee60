"""Which JupyterLab theme the notebook is shown in, so figure text reads well on it.

No single grey is readable as text (WCAG AA, 4.5:1) on both JupyterLab's white and
its dark ``#111`` page: the best one is 4.35:1 on each. Figures are see-through (a
white box in a dark notebook is worse), so their text takes the colour for the theme
the page is in. ``%rtnb start`` asks the page (:func:`ask_page_theme`: an invisible
widget whose frontend reports ``document.body.dataset.jpThemeLight``, then removes
itself); the kernel hears the answer once that cell ended (a running cell holds
the kernel's messages), so every figure of the next cells (a live view's own, its
lasting figure, the browser's timeline, the runs dashboard) uses that theme's
colour. Views also carry a probe, so a theme switched while they are open (and the
kernel is free) recolours their figures. Until a page answers (papermill, nbclient)
the light theme's is used; a saved notebook opened later in another theme keeps
the colours of the theme it was run in. Lasting figures drawn before the first
answer (Run All: the next cells queue ahead of it) are drawn again once it comes
(:func:`redraw_when_theme_known`), if the page is dark.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable

from rtnb.widgets._comms import close_tree

__all__ = [
    "ask_page_theme",
    "figure_text_color",
    "follow_theme",
    "redraw_when_theme_known",
    "stop_asking",
    "theme_probe",
]

TEXT_ON_LIGHT = "#5c5c5c"  # 6.7:1 on white
TEXT_ON_DARK = "#b0b0b0"  # 8.8:1 on #111111
_light = True
_answered = False  # a page has said its theme to this kernel
# Redraws of lasting figures drawn before that; the oldest are dropped past the cap
# (each holds its run's metrics).
_unthemed: list[Callable[[], None]] = []
_UNTHEMED_KEPT = 32
_unthemed_lock = threading.Lock()

_PROBE_ESM = """
export default {
  render({ model, el }) {
    el.style.display = "none";
    const report = () => {
      model.set("light", document.body.dataset.jpThemeLight !== "false");
      model.set("seen", true);
      model.save_changes();
    };
    report();
    const watch = new MutationObserver(report);
    watch.observe(document.body, { attributes: true, attributeFilter: ["data-jp-theme-light"] });
    return () => watch.disconnect();
  },
};
"""


def figure_text_color() -> str:
    """The text colour of figures for the theme the notebook was last seen in."""
    return TEXT_ON_LIGHT if _light else TEXT_ON_DARK


def theme_probe(on_change: Callable[[], None] | None = None):
    """An invisible widget that tells the kernel the page's theme (None where
    anywidget cannot be imported); ``on_change`` runs when the theme it reports
    differs from the one known."""
    probe_class = _probe_class()
    if probe_class is None:
        return None
    probe = probe_class(light=_light)

    def heard(_change) -> None:
        # Both traits arrive in one message and notify once both are set.
        global _light
        changed = probe.light != _light
        _light = probe.light
        _theme_heard()
        if changed and on_change is not None:
            on_change()

    probe.observe(heard, names=["light", "seen"])
    return probe


def redraw_when_theme_known(redraw: Callable[[], None]) -> None:
    """``redraw`` a lasting figure just drawn once the page says its theme, if no page
    has yet (its text took the light theme's colour, unreadable on a dark page)."""
    with _unthemed_lock:
        if _answered:
            return
        _unthemed.append(redraw)
        del _unthemed[:-_UNTHEMED_KEPT]


def _theme_heard() -> None:
    global _answered
    with _unthemed_lock:
        if _answered:
            return
        _answered = True
        pending = list(_unthemed)
        _unthemed.clear()
    if _light:
        return  # they were drawn for it
    for redraw in pending:
        with contextlib.suppress(Exception):  # one that fails keeps its first colours
            redraw()


@functools.cache
def _probe_class():
    """The probe's widget class, made once (anywidget is imported on first use)."""
    try:
        import anywidget
        import traitlets
    except ImportError:
        return None

    class ThemeProbe(anywidget.AnyWidget):
        _esm = _PROBE_ESM
        light = traitlets.Bool(True).tag(sync=True)
        seen = traitlets.Bool(False).tag(sync=True)  # the page answered

    return ThemeProbe


def follow_theme(box, figures: Callable[[], Iterable], lock=None) -> None:
    """Put a theme probe in ``box``; once the page reports a theme other than the one
    known, the text of ``figures()`` takes its colour (under ``lock``, where a redraw
    thread changes the figures too)."""

    def restyle() -> None:
        with lock if lock is not None else contextlib.nullcontext():
            for figure in figures():
                if figure is not None:
                    with contextlib.suppress(Exception):  # a figure closed meanwhile
                        figure.layout.font.color = figure_text_color()

    probe = theme_probe(restyle)
    if probe is not None:
        box.children = (*box.children, probe)


def ask_page_theme() -> None:
    """Ask the notebook's page for its theme, once: an invisible widget in this cell's
    output that removes itself when the page answered, and otherwise after a minute
    or at ``%rtnb stop`` (:func:`stop_asking`: a closed tab, a batch run forced
    live), so a saved notebook keeps no widget that would wait for a kernel."""
    global _question
    from IPython.display import display

    stop_asking()
    probe = theme_probe()
    if probe is None:
        return
    shown = display(probe, display_id=True)
    _question = (probe, shown)
    probe.observe(lambda _change: stop_asking(probe), names="seen")
    timer = threading.Timer(_ASK_S, stop_asking, args=(probe,))
    timer.daemon = True
    timer.start()


_question: tuple | None = None  # the probe ask_page_theme showed, and where
# A page that has not answered by then is not looking (the answer comes as soon as
# the kernel is free after the asking cell; a running cell holds it back).
_ASK_S = 60.0


def stop_asking(probe=None) -> None:
    """Take the theme question out of its cell's output, answered or not; with
    ``probe``, only if that is still the question (a later start asked anew)."""
    global _question
    question = _question
    if question is None or (probe is not None and question[0] is not probe):
        return
    _question = None
    probe, shown = question
    with contextlib.suppress(Exception):
        if shown is not None:
            shown.update({"text/plain": ""}, raw=True)
    close_tree(probe)
