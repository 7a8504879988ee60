"""IPython magics for rtnb: ``%rtnb``, ``%%rtrain`` and ``%rtrain``."""

from __future__ import annotations

from rtnb.magics._magics import RtnbMagics

__all__ = ["RtnbMagics", "load_ipython_extension", "unload_ipython_extension"]


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(RtnbMagics)


def unload_ipython_extension(ipython) -> None:
    magics = ipython.magics_manager.registry.get("RtnbMagics")
    if magics is not None:
        magics.shutdown()
