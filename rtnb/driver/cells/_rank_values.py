"""Values and datasets between the kernel and the ranks: ``pull``, ``push``, live
controls between cells, Ray Datasets handed over.

:class:`RankValues` is a part of the cell flow: it checks what the user hands over,
asks the flow to journal it (the flow writes every entry), and sends it to the ranks
as commands. A rank that dies under a running cell that recovery will rebuild is not
an error of these calls: they wait for the rebuilt group and ask it instead.
"""

from __future__ import annotations

import keyword
import pickle
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from rtnb.core._config import parse_ranks
from rtnb.core._values import from_portable
from rtnb.driver.ranks import (
    DatasetHandOver,
    DatasetRecord,
    RankGroup,
    RankLost,
    check_datasets,
    command_all,
    release_everywhere,
    split_failed,
)
from rtnb.errors import ConfigError, SessionError, WorkerGroupError, one_line
from rtnb.storage._journal import EntryKind
from rtnb.worker._commands import Pull, Push

if TYPE_CHECKING:
    from rtnb.driver.cells._handle import CellHandle

__all__ = ["RankValues", "rank_list", "serialize"]

# pull/push during a recovery wait this long for the rebuilt group before saying so.
WAIT_FOR_GROUP_S = 60.0


class Recoveries(Protocol):
    """What the values part needs of the group's owner: a recovery coming, and the
    group it builds."""

    def can_recover(self) -> bool: ...

    def replacement(
        self, lost: RankGroup, waiting: Callable[[], bool], wait_s: float
    ) -> RankGroup | None: ...


class RankValues:
    """Values in and out of the ranks; see the module docstring. ``require_group``
    waits up to its argument for a group; ``active`` is the running cell, if any;
    ``write`` journals an entry (the flow's)."""

    def __init__(
        self,
        require_group: Callable[[float], RankGroup],
        active: Callable[[], CellHandle | None],
        owner: Recoveries,
        write: Callable[..., Any],
    ) -> None:
        self._require_group = require_group
        self._active = active
        self._owner = owner
        self._write = write
        self.datasets = DatasetHandOver()

    def pull(self, name: str, ranks: Iterable[int] | str | None = None) -> list[Any]:
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"{name!r} is not a Python variable name")
        chosen = rank_list(ranks, self._require_group(WAIT_FOR_GROUP_S).world_size)
        answers = self.call_ranks(
            lambda group: command_all(group, chosen, Pull(name)),
            f"pulling {name!r}",
            timeout_s=120,
        )
        missing = [r for r, (found, *_rest) in zip(chosen, answers) if not found]
        if missing:
            raise SessionError(
                f"{name!r} is not defined on rank{'s' if len(missing) > 1 else ''} "
                f"{', '.join(map(str, missing))}: define it in a %%rtrain cell first"
            )
        return [from_portable((data, text)) for _found, data, text in answers]

    def push(self, values: dict[str, Any], ranks: Iterable[int] | str | None = None) -> None:
        for name in values:
            if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
                raise ConfigError(f"{name!r} is not a Python variable name")
        chosen = rank_list(ranks, self._require_group(WAIT_FOR_GROUP_S).world_size)
        data = serialize(dict(values))
        self._write(
            EntryKind.PUSH,
            values=data,
            names=sorted(values),
            ranks=None if ranks is None else chosen,
        )
        self.send_values(data, chosen)

    def send_values(self, data: bytes, ranks: list[int]) -> None:
        """Pickled values set on ``ranks`` (a push, a function cell's call, a replay)."""
        self.call_ranks(
            lambda group: command_all(group, ranks, Push(), group.share(data)),
            "sending values to the ranks",
            timeout_s=300,
        )

    def send_controls(self, values: dict[str, Any]) -> None:
        """``values`` in force on every rank from now on (between cells; a replay)."""
        self.call_ranks(
            lambda group: release_everywhere(group, values), "setting controls", timeout_s=30
        )

    # ---- datasets --------------------------------------------------------------------
    def set_datasets(self, datasets: dict[str, Any], data_config: Any = None) -> None:
        """Hand Ray Datasets to the ranks (added to those handed before), split for
        this group as Ray Train splits them; journaled, so every later group gets
        them again."""
        # A group first: datasets refused for want of one must not stay in the set
        # the next hand-over (or a replay) would give the ranks.
        group = self._require_group(WAIT_FOR_GROUP_S)
        # Before anything is kept: a pipeline that could never run is refused whole.
        group.check_data_room(check_datasets(datasets))
        record = self.datasets.record(datasets, data_config)
        self._write(EntryKind.DATASETS, values=pickle.dumps(record), names=record.names)
        self._hand(record, *self.datasets.resolve(record))

    def hand_datasets(self, data: bytes) -> list[str]:
        """Hand a journaled set of datasets to the current group (a replay); the
        names of those that cannot be rebuilt here."""
        record = pickle.loads(data)
        datasets, missing = self.datasets.resolve(record)
        self._hand(record, datasets, missing)
        return missing

    def _hand(self, record: DatasetRecord, datasets: dict[str, Any], missing: list[str]) -> None:
        if not datasets:
            return
        config = self.datasets.data_config(record, sorted(datasets))

        def calls(group: RankGroup) -> list:
            try:
                return group.hand_datasets(datasets, config)
            except Exception as exc:  # noqa: BLE001 - Ray Data's own error, in one line
                raise split_failed(exc) from None

        self.call_ranks(calls, "handing the datasets to the ranks", timeout_s=300)

    # ---- calling the ranks -------------------------------------------------------------
    def call_ranks(self, calls: Callable[[RankGroup], list], what: str, timeout_s: float):
        """The results of ``calls(group)``; each failure becomes one rtnb error line."""
        group = self._require_group(WAIT_FOR_GROUP_S)
        for attempt in range(2):
            try:
                return group.gather(calls(group), timeout_s)
            except TimeoutError:
                raise SessionError(
                    f"{what} took over {timeout_s:g} s (a rank busy in native code?); try again"
                ) from None
            except RankLost as exc:
                rebuilt = attempt == 0 and self._wait_for_recovery(group)
                if rebuilt is None:
                    raise WorkerGroupError(f"{what} failed: a rank died ({exc})") from None
                group = rebuilt
        raise AssertionError("unreachable")

    def _wait_for_recovery(self, lost: RankGroup) -> RankGroup | None:
        """The group that recovery builds to replace ``lost``; None when no
        recovery is coming (no running cell, or --max-failures spent)."""
        active = self._active()
        if active is None or active.done() or not (active.recovering or self._owner.can_recover()):
            return None
        return self._owner.replacement(
            lost, lambda: not active.done() or active.recovering, WAIT_FOR_GROUP_S
        )


def serialize(values: dict[str, Any]) -> bytes:
    from ray import cloudpickle

    try:
        return cloudpickle.dumps(values)
    except Exception as exc:  # noqa: BLE001 - anything unpicklable
        raise ConfigError(
            f"cannot send {', '.join(sorted(values))} to the ranks: not picklable "
            f"({one_line(exc)}); create it in a %%rtrain cell instead"
        ) from None


def rank_list(ranks: Iterable[int] | str | None, world_size: int) -> list[int]:
    """The ranks a call names (a list, or ``--ranks``' "1" or "0-2"; None: all)."""
    if ranks is None or isinstance(ranks, str):
        return parse_ranks(ranks, world_size)
    return parse_ranks(",".join(str(int(r)) for r in ranks), world_size)
