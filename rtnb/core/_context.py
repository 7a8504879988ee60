"""Which rank this process is, for code that runs on both sides (checkpoints).

The worker sets it when its runtime starts; in the driver it stays unset, so
``current_rank()`` is 0 there, as for a single-process program.
"""

from __future__ import annotations

__all__ = ["CONFIG_NAME", "current_rank", "set_current_rank"]

_RANK: int | None = None


def set_current_rank(rank: int | None) -> None:
    global _RANK
    _RANK = rank


def current_rank() -> int:
    return _RANK if _RANK is not None else 0


# The rank variable holding a function's or a sweep trial's config (Ray Train's
# train_loop_config): ``rtnb.get_config()`` reads it, the driver pushes it.
CONFIG_NAME = "__rtnb_config__"
