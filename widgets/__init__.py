"""ipywidgets views of an rtnb session; they subscribe to engine callbacks and never call Ray."""

from __future__ import annotations

from rtnb.widgets._logs import RankLog

__all__ = ["RankLog"]
