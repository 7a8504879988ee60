"""ipywidgets/plotly views of an rtnb session; they subscribe to engine callbacks and never call Ray."""

from __future__ import annotations

from rtnb.widgets._checkpoints import CheckpointBrowser
from rtnb.widgets._frontend import has_live_frontend
from rtnb.widgets._header import format_header
from rtnb.widgets._live import LiveMetrics, LiveOnFirstReport
from rtnb.widgets._logs import RankLog
from rtnb.widgets._output import NotebookOutput
from rtnb.widgets._plot import prepare_figures_in_background
from rtnb.widgets._profile import profile_figure
from rtnb.widgets._runs import RunsDashboard, runs_bundle
from rtnb.widgets._static import ProgressLines, show_static_figure, static_figure_bundle
from rtnb.widgets._sweep import SweepProgress, SweepView, sweep_bundle
from rtnb.widgets._theme import ask_page_theme, stop_asking

__all__ = [
    "CheckpointBrowser",
    "LiveMetrics",
    "LiveOnFirstReport",
    "NotebookOutput",
    "ProgressLines",
    "RankLog",
    "RunsDashboard",
    "SweepProgress",
    "SweepView",
    "ask_page_theme",
    "format_header",
    "has_live_frontend",
    "prepare_figures_in_background",
    "profile_figure",
    "runs_bundle",
    "show_static_figure",
    "static_figure_bundle",
    "stop_asking",
    "sweep_bundle",
]
