"""How a magic's result is shown: live widgets or output that lasts, decided once."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from rtnb.widgets._frontend import has_live_frontend
from rtnb.widgets._plot import prepare_figures_in_background
from rtnb.widgets._theme import ask_page_theme

__all__ = ["NotebookOutput"]

Shown = TypeVar("Shown")


class NotebookOutput:
    """The one place that tells live widgets from lasting output. Live: a frontend
    renders widgets and its clicks reach the kernel (JupyterLab, Notebook 7, VS
    Code). Lasting: papermill, nbclient, nbconvert, a notebook reopened later, which
    keep text and static figures. A magic hands over both of its renderings and
    never looks at the frontend itself (``RTNB_LIVE=0/1`` overrides the detection).

    Example::

        In [1]: output = NotebookOutput()
        In [2]: output.show(live=lambda: "widget", lasting=lambda: "text")
        Out[2]: 'widget'
    """

    @property
    def live(self) -> bool:
        return has_live_frontend()

    def show(self, live: Callable[[], Shown], lasting: Callable[[], Shown]) -> Shown:
        return live() if self.live else lasting()

    def prepare(self) -> None:
        """Once a group started, while the user writes the next cell: the first live
        plot then draws at once, its text in the page theme's colours."""
        if self.live:
            prepare_figures_in_background()
            ask_page_theme()
