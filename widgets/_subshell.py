"""Widgets a user can click while the kernel runs a cell.

The kernel hears a widget's messages on its shell channel, which is busy for as long
as a foreground cell runs. ipykernel 7 can run *subshells* (threads with their own
event loops) and routes a comm's messages to the subshell its
``_reply_subshell_id`` names. :func:`answer_while_busy` makes one subshell for rtnb
(once per kernel) and points the given widgets' comms at it, so the live view's
Stacks button and control inputs act while a foreground ``%%rtrain`` cell runs.
Elsewhere (an older ipykernel, no kernel) it does nothing and the widgets answer
once the kernel is free, as any widget does.
"""

from __future__ import annotations

import threading

__all__ = ["answer_while_busy"]

_LOCK = threading.Lock()
_SUBSHELL: list[str] = []  # rtnb's subshell id, made once per kernel


def answer_while_busy(*widgets) -> bool:
    """Route ``widgets``' messages to rtnb's subshell; True when they are."""
    subshell = _subshell()
    if subshell is None:
        return False
    for widget in widgets:
        comm = getattr(widget, "comm", None)
        if comm is not None:
            comm._reply_subshell_id = subshell
    return True


def _subshell() -> str | None:
    with _LOCK:
        if _SUBSHELL:
            return _SUBSHELL[0]
        kernel = _kernel()
        channel = getattr(kernel, "shell_channel_thread", None)
        if channel is None or not getattr(kernel, "_supports_kernel_subshells", False):
            return None
        try:
            manager = channel.manager  # made in the kernel's main thread, where we are
        except Exception:  # noqa: BLE001 - not the main thread: leave the widgets as they are
            return None
        made: list[str] = []
        done = threading.Event()

        def create() -> None:
            try:
                made.append(manager._create_subshell())
            finally:
                done.set()

        channel.io_loop.add_callback(create)
        if not done.wait(5.0) or not made:
            return None
        _SUBSHELL.append(made[0])
        return made[0]


def _kernel():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return getattr(shell, "kernel", None)
