"""Closing widgets without noise in JupyterLab's log console.

A frontend can still send a message to a widget the kernel has just closed: plotly's
view of a ``FigureWidget`` answers its own close with the values plotly.js computed.
The kernel's comm manager no longer knows that comm and logs ``No such comm: <id>``
to the cell-less stderr that JupyterLab's log console shows, in red, once for every
figure a live view, the dashboard or the checkpoint browser replaces or ends.

So a widget rtnb closes leaves a silent stand-in under its comm id for a while: it
takes those late messages and sends nothing (the frontend's side is gone already).
The newest few hundred are kept; a frontend that sends ``comm_close`` for one removes
it itself.
"""

from __future__ import annotations

from collections import deque

import ipywidgets as w

__all__ = ["close_tree", "close_view"]

# Ids of the stand-ins still registered, oldest first. Late answers come within a
# second of the close; a long session closes a figure every few seconds at most.
_STAND_INS: deque[str] = deque()
_KEEP = 256


def close_tree(widget) -> None:
    """Close ``widget`` and every widget under it (children first), each leaving a
    silent stand-in for late messages from the frontend."""
    for child in getattr(widget, "children", ()) or ():
        close_tree(child)
    comm = getattr(widget, "comm", None)
    comm_id = getattr(comm, "comm_id", None)
    w.Widget.close(widget)
    if comm_id is not None:
        _stand_in(comm_id)


def close_view(widget) -> None:
    """Close a view that may have its own ``close`` (a live view stops its redraw
    thread and unsubscribes first, then closes its tree); any other widget's tree."""
    if type(widget).close is not w.Widget.close:
        widget.close()
    else:
        close_tree(widget)


def _stand_in(comm_id: str) -> None:
    try:
        from comm import create_comm, get_comm_manager

        manager = get_comm_manager()
    except Exception:  # noqa: BLE001 - no kernel (a test, a script): nothing to quiet
        return
    if manager is None or comm_id in manager.comms:
        return
    stand_in = create_comm(comm_id=comm_id, primary=False, target_name="rtnb-closed")
    # It must never send: a close (or its garbage collection) would tell the frontend
    # about a comm it already dropped.
    stand_in._closed = True
    manager.register_comm(stand_in)
    _STAND_INS.append(comm_id)
    while len(_STAND_INS) > _KEEP:
        manager.comms.pop(_STAND_INS.popleft(), None)
