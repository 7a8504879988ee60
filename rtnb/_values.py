"""Values that come back from the ranks: one per rank, shown per rank."""

from __future__ import annotations

import pickle
from typing import Any

__all__ = ["PerRank", "RemoteRepr", "from_portable"]


class RemoteRepr:
    """Stands in for a rank's value that could not be sent back (unpicklable)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def from_portable(portable: tuple[bytes | None, str] | None) -> Any:
    if portable is None:
        return None
    data, text = portable
    if data is not None:
        try:
            return pickle.loads(data)
        except Exception:  # noqa: BLE001 - e.g. a class only the ranks can import
            pass
    return RemoteRepr(text)


class PerRank(dict):
    """``{rank: value}`` for the ranks a cell ran on, printed one rank per line."""

    def values_list(self) -> list[Any]:
        return [self[r] for r in sorted(self)]

    def __repr__(self) -> str:
        return "\n".join(f"[rank {r}] {self[r]!r}" for r in sorted(self))

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(repr(self))
