"""Whether a frontend that renders live widgets is attached to this kernel."""

from __future__ import annotations

import os

__all__ = ["has_live_frontend"]


def has_live_frontend() -> bool:
    """True in JupyterLab/Notebook; False under papermill, nbclient or plain Python.

    ``RTNB_LIVE=1`` or ``0`` overrides. Otherwise: a widget manager has opened
    ipywidgets' control comm, or the running cell's execute request carries the
    metadata JupyterLab and Notebook 7 add (``recordTiming``/``deletedCells``);
    batch executors send neither.
    """
    forced = os.environ.get("RTNB_LIVE", "").strip().lower()
    if forced in ("0", "1", "false", "true", "no", "yes"):
        return forced in ("1", "true", "yes")
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    kernel = getattr(shell, "kernel", None)
    if kernel is None:
        return False
    try:
        import ipywidgets

        if ipywidgets.Widget._control_comm is not None:
            return True
    except ImportError:
        return False
    try:
        metadata = kernel.get_parent("shell").get("metadata", {})
    except Exception:  # noqa: BLE001 - older ipykernel
        metadata = getattr(kernel, "_parent_header", {}).get("metadata", {})
    return "recordTiming" in metadata or "deletedCells" in metadata
