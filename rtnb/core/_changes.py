"""Live changes a cell received, kept in the saved notebook so a batch re-run
(``rtnb run``) makes them again at the same steps.

A cell that got live-control changes or triggers while it ran (``%rtnb set``,
``%rtnb trigger``, ``%rtnb save-now``, the live view's inputs) leaves a
:class:`CellChanges` record in its lasting output under :data:`CHANGES_MIME`.
``rtnb run`` collects those records from the notebook it runs and hands them to the
kernel (:data:`CHANGES_ENV`, a JSON file); the session gives each to the first cell
of the re-run with the same code (:class:`SavedChanges`), whose ranks then apply
them at their recorded steps. The ``%rtnb set`` cells of the notebook, run again,
find their change already scheduled and do not apply it a second time.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from rtnb.core._messages import SAVE_TRIGGER
from rtnb.core._profile import PROFILE_START

__all__ = [
    "CHANGES_ENV",
    "CHANGES_MIME",
    "CellChanges",
    "SavedChanges",
    "change_text",
    "control_value",
    "trigger_text",
]

CHANGES_MIME = "application/vnd.rtnb.changes+json"
CHANGES_ENV = "RTNB_CHANGES"


def trigger_text(name: str) -> str:
    """How messages and the plot's markers name a trigger."""
    if name.startswith(PROFILE_START):
        return f"profile {name[len(PROFILE_START) :]} steps"
    return "save-now" if name == SAVE_TRIGGER else f"trigger {name}"


def change_text(values: dict[str, Any], triggers) -> str:
    """``lr = 0.5, trigger eval``: one change, as the live plot's marker says it."""
    return ", ".join(
        [f"{n} = {v!r}" for n, v in values.items()] + [trigger_text(t) for t in triggers]
    )


def control_value(text: str) -> Any:
    """A control's value as typed (``%rtnb set lr=3e-4``, the live view's input): a
    Python literal, else the text itself (a bare word is a string)."""
    import ast

    text = text.strip()
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


@dataclass
class CellChanges:
    code: str
    controls: list[tuple[str, Any, int]] = field(default_factory=list)  # name, value, step
    triggers: list[tuple[int, str]] = field(default_factory=list)  # step, name

    def to_json(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "controls": [list(c) for c in self.controls],
            "triggers": [list(t) for t in self.triggers],
        }

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> CellChanges:
        return cls(
            str(record.get("code", "")),
            [(str(n), v, int(s)) for n, v, s in record.get("controls", [])],
            [(int(s), str(n)) for s, n in record.get("triggers", [])],
        )

    def by_step(self) -> list[tuple[int, dict[str, Any], list[str]]]:
        """The changes as one (step, values, triggers) per step, in step order."""
        steps: dict[int, tuple[dict[str, Any], list[str]]] = {}
        for name, value, step in self.controls:
            steps.setdefault(step, ({}, []))[0][name] = value
        for step, name in self.triggers:
            steps.setdefault(step, ({}, []))[1].append(name)
        return [(step, values, fired) for step, (values, fired) in sorted(steps.items())]

    def describe(self) -> str:
        parts = [f"{n} = {v!r} at step {s}" for n, v, s in self.controls]
        parts += [f"{trigger_text(n)} at step {s}" for s, n in self.triggers]
        return "; ".join(parts)


class SavedChanges:
    """A saved notebook's records, each given once, in order, to a cell with its code."""

    def __init__(self, items: list[CellChanges]) -> None:
        self._items = list(items)

    @classmethod
    def from_env(cls) -> SavedChanges | None:
        path = os.environ.get(CHANGES_ENV)
        if not path:
            return None
        try:
            with open(path, encoding="utf-8") as src:
                return cls([CellChanges.from_json(r) for r in json.load(src)])
        except (OSError, ValueError, TypeError):
            return None  # a record rtnb cannot read: the re-run makes no changes

    def take(self, code: str) -> CellChanges | None:
        for i, item in enumerate(self._items):
            if item.code == code:
                return self._items.pop(i)
        return None
