"""A live view of one cell's per-rank output, for cells that run in the background."""

from __future__ import annotations

import html
import threading

import ipywidgets as w

__all__ = ["RankLog"]

_MAX_SHOWN = 200_000


class RankLog(w.VBox):
    """Header (state, elapsed, steps) plus the ranks' output, updated as it arrives.

    ``handle`` is any object with ``cell_id``, ``ranks``, ``steps``, ``elapsed_s``,
    ``add_sink(fn)`` and ``add_done_callback(fn)`` (an :class:`rtnb.CellHandle`).
    """

    def __init__(self, handle, **kwargs) -> None:
        self._handle = handle
        self._header = w.HTML()
        self._out = w.Output(layout=w.Layout(max_height="320px", overflow="auto"))
        self._lock = threading.Lock()
        self._shown = 0
        self._state = "running"
        super().__init__([self._header, self._out], **kwargs)
        self._render_header()
        handle.add_sink(self._on_output)
        handle.add_done_callback(self._on_done)

    def _on_output(self, rank: int, stream: str, text: str) -> None:
        tag = f"[rank {rank}] " if rank >= 0 else ""
        tagged = "".join(f"{tag}{line}" for line in text.splitlines(keepends=True))
        with self._lock:
            # The output area is saved into the notebook: it shows the first
            # _MAX_SHOWN characters; the whole output is in {run}/logs/.
            if self._shown >= _MAX_SHOWN:
                return
            self._shown += len(tagged)
            if self._shown >= _MAX_SHOWN:
                tagged += (
                    f"\n[rtnb: more output than {_MAX_SHOWN // 1000} kB; every rank's full "
                    "output is in the run directory's logs/rank-N.log]\n"
                )
            if stream == "stderr":
                self._out.append_stderr(tagged)
            else:
                self._out.append_stdout(tagged)
        self._render_header()

    def _on_done(self, handle) -> None:
        error = handle.error
        self._state = "done" if error is None else f"{type(error).__name__}: {error}"
        self._render_header()

    def _render_header(self) -> None:
        h = self._handle
        steps = ", ".join(f"{r}: {h.steps.get(r, 0)}" for r in h.ranks)
        self._header.value = (
            f"<b>rtnb {html.escape(h.name)}</b> (background) — {html.escape(self._state)}, "
            f"{h.elapsed_s:.1f} s; steps per rank {{{html.escape(steps)}}}"
        )
