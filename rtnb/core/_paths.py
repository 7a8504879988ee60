"""Where rtnb keeps its per-user files on this machine (``RTNB_HOME``, by default
``~/.cache/rtnb``): the warm Ray's state, and the journal spool of runs whose
storage is not a local path."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["HOME_ENV", "rtnb_home"]

HOME_ENV = "RTNB_HOME"


def rtnb_home() -> Path:
    return Path(os.environ.get(HOME_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "rtnb"))
