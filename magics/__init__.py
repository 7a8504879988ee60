"""IPython magics for rtnb: ``%rtnb``, ``%%rtrain`` and ``%rtrain``."""

from __future__ import annotations

from rtnb.magics._magics import RtnbMagics, RtrainMagics, completer
from rtnb.widgets._late import follow_cells, stop_following_cells

__all__ = ["RtnbMagics", "RtrainMagics", "load_ipython_extension", "unload_ipython_extension"]


def load_ipython_extension(ipython) -> None:
    magics = RtnbMagics(shell=ipython)
    ipython.register_magics(magics)
    ipython.register_magics(RtrainMagics(ipython, magics.runner))
    hook = completer(magics)
    for command in ("%rtnb", "%%rtnb", "%rtrain", "%%rtrain"):
        ipython.set_hook("complete_command", hook, str_key=command)
    # A view that ends between two cells is drawn again as the next starts.
    follow_cells(ipython)


def unload_ipython_extension(ipython) -> None:
    magics = ipython.magics_manager.registry.get("RtnbMagics")
    if magics is not None:
        magics.shutdown()
    stop_following_cells(ipython)
