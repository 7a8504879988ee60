"""Values that come back from the ranks: one per rank, shown per rank."""

from __future__ import annotations

import pickle
from typing import Any

__all__ = ["PerRank", "RemoteRepr", "from_portable", "to_portable"]


class RemoteRepr:
    """Stands in for a rank's value that could not be sent back (unpicklable)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


# A value's repr beyond this many characters is cut: it is shown, not stored.
_MAX_REPR_CHARS = 10_000
# A cell's value is sent back through the object store; past this it stays on
# the rank and only its (cut) repr comes back.
_MAX_VALUE_BYTES = 64 * 1024 * 1024


def to_portable(value: Any) -> tuple[bytes | None, str]:
    """A value as (pickled bytes or None, repr), so the other side can show it
    either way: a value only the ranks can unpickle still prints."""
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001
        text = f"<unrepresentable {type(value).__name__}: {exc}>"
    if len(text) > _MAX_REPR_CHARS:
        text = text[:_MAX_REPR_CHARS] + " …"
    try:
        from ray import cloudpickle as dumper
    except ImportError:  # outside Ray (unit tests): plain pickle is enough
        dumper = pickle
    try:
        data = dumper.dumps(value)
    except Exception:  # noqa: BLE001 - unpicklable values come back as their repr
        data = None
    if data is not None and len(data) > _MAX_VALUE_BYTES:
        size = len(data) / 1e6
        data = None
        text = (
            f"{text[:200]}{' …' if len(text) > 200 else ''} [{size:.0f} MB: too large to send "
            "back; keep it on the ranks (assign it) or save it to storage]"
        )
    return data, text


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
