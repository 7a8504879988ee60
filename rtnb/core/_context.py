"""Which rank this process is, for code that runs on both sides (checkpoints).

The worker sets it when its runtime starts; in the driver it stays unset, so
``current_rank()`` is 0 there, as for a single-process program.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "CONFIG_NAME",
    "current_rank",
    "notebook_checkpoints",
    "set_current_rank",
    "set_notebook_checkpoints",
]

_RANK: int | None = None
# What rtnb.get_all_reported_checkpoints() answers in the notebook (outside a cell):
# the session started last registers its own. A slot here, so that the rank-side API
# never imports the driver.
_NOTEBOOK_CHECKPOINTS: Callable[..., Any] | None = None


def set_notebook_checkpoints(reader: Callable[..., Any] | None) -> None:
    global _NOTEBOOK_CHECKPOINTS
    _NOTEBOOK_CHECKPOINTS = reader


def notebook_checkpoints() -> Callable[..., Any] | None:
    return _NOTEBOOK_CHECKPOINTS


def set_current_rank(rank: int | None) -> None:
    global _RANK
    _RANK = rank


def current_rank() -> int:
    return _RANK if _RANK is not None else 0


# The rank variable holding a function's or a sweep trial's config (Ray Train's
# train_loop_config): ``rtnb.get_config()`` reads it, the driver pushes it.
CONFIG_NAME = "__rtnb_config__"
