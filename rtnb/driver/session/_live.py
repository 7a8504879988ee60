"""The session's API into its ranks: values in and out, datasets, and into a
running cell — live controls, triggers, the debugger, the profiler and the stacks (a
part of :class:`~rtnb.driver.session._session.Session`, which is made of it; the cell flow
does the work)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from rtnb.core._messages import SAVE_TRIGGER
from rtnb.core._names import names_bound
from rtnb.core._profile import ProfileReport
from rtnb.core._stacks import GroupStacks
from rtnb.storage._journal import EntryKind

if TYPE_CHECKING:
    from rtnb.driver.cells import CellFlow
    from rtnb.storage._journal import Journal

__all__ = ["LiveAPI"]


class LiveAPI:
    """Values to and from the ranks; changes to the running cell, on every rank at
    one step; looks into it."""

    _cells: CellFlow
    journal: Journal

    def set_datasets(
        self, datasets: Mapping[str, Any] | None = None, dataset_config: Any = None, **named: Any
    ) -> None:
        """Hand Ray Datasets to the ranks, as ``TorchTrainer(datasets=...,
        dataset_config=...)`` does: in a cell, ``rtnb.get_dataset_shard(name)`` (or
        ``ray.train.get_dataset_shard``) is the rank's streaming shard. Each is split
        across the ranks (``streaming_split(world_size, equal=True)``) unless a
        ``ray.train.DataConfig(datasets_to_split=[...])`` (or just the list of names to
        split: ``dataset_config=["train"]``, the magics' ``--split train``) leaves it
        whole. They stay for later cells and are handed again to every new group
        (recovery, scale, ``--replay``). The Datasets' preprocessing runs on the
        cluster.

        Example::

            In [2]: session.set_datasets(train=ray.data.range(1000).map(double))
        """
        self._cells.values.set_datasets({**(datasets or {}), **named}, dataset_config)

    @property
    def dataset_names(self) -> list[str]:
        """The names of the datasets handed to the ranks."""
        return self._cells.values.datasets.names

    def pull(self, name: str, ranks: Iterable[int] | str | None = None) -> list[Any]:
        """The value of ``name`` on each rank, in rank order (``%rtnb pull``)."""
        return self._cells.values.pull(name, ranks)

    def names_on_ranks(self) -> set[str]:
        """The names this run's cells and pushes bound in the ranks' namespaces since
        the group last started fresh, as the journal records them (what a replay
        rebuilds, and ``--once`` cells): what the notebook can ``%rtnb pull``. A name
        bound inside a function of a cell is not one.

        Example::

            In [5]: "model" in session.names_on_ranks()
            Out[5]: True
        """
        names: set[str] = set()
        for step in self.journal.replay_plan():
            entry = step.entry
            if step.skipped and not entry.once:
                continue  # a cell that failed or never ended: what it bound is unknown
            if entry.kind is EntryKind.PUSH:
                names.update(entry.names)
            elif entry.kind is EntryKind.CELL and entry.code:
                names |= names_bound(entry.code)
        return names

    def push(self, values: dict[str, Any], ranks: Iterable[int] | str | None = None) -> None:
        """Set each ``name: value`` in the namespace of every rank (``%rtnb push``).

        The values are serialized once: the same bytes go to the ranks and, beside
        the journal entry, to storage, so a replay pushes them again."""
        self._cells.values.push(values, ranks)

    # ---- checkpoints and results -------------------------------------------------------
    def set_controls(self, values: dict[str, Any] | None = None, **named: Any) -> int | None:
        """Change values the ranks read with ``rtnb.control(name, default)``
        (``%rtnb set lr=3e-4``). While a cell runs, every rank takes the change at
        the same step, which is returned (the driver picks one no rank has begun);
        else it holds from the next cell on (None). Journaled: a recovery or a
        replay applies it at the same step again.

        In [1]: session.set_controls(lr=3e-4)
        Out[1]: 52
        """
        return self._cells.steering.set_controls({**(values or {}), **named})

    def trigger(self, name: str) -> int:
        """Run every rank's ``rtnb.on_trigger(name, fn)`` handler at one step of the
        running cell (``%rtnb trigger eval``): that step. Journaled like a control.

        In [1]: session.trigger("eval")
        Out[1]: 310
        """
        return self._cells.steering.fire(name)

    def save_now(self) -> int:
        """Checkpoint at the next common step of the running cell on every rank,
        through ``rtnb.on_save(fn)`` (``%rtnb save-now``): fn returns the state (or a
        Checkpoint) and it is committed as that step's checkpoint. The step.

        In [1]: session.save_now()
        Out[1]: 311
        """
        return self._cells.steering.fire(SAVE_TRIGGER)

    def debug(
        self,
        rank: int | None = None,
        ask: Callable[[str], str] | None = None,
        show: Callable[[str], None] | None = None,
    ) -> None:
        """A pdb prompt on a rank (``%rtnb debug [RANK]``): a rank the running
        background cell left at a breakpoint, else a post-mortem of the last failed
        cell on that rank (the first rank it failed on), with its frames and locals.
        ``ask`` reads a line (the notebook's input box), ``show`` prints pdb's output.

        In [1]: %rtnb debug 1
        [rtnb] post-mortem of rank 1 at cell [5] line 7
        (Pdb rank 1) p x
        """
        self._cells.steering.debug(
            rank,
            ask or input,
            show or (lambda text: print(text, end="", flush=True)),
        )

    def profile(self, steps: int = 20) -> int | None:
        """Profile ``steps`` steps on every rank with torch.profiler (``%rtnb profile
        --steps N``): of the running cell from a common step (the first profiled
        step is returned), else of the next cell. When every rank is done,
        ``last_profile`` has the merged Chrome/Perfetto trace (one row per rank,
        in the run directory's ``profiles/``) and each rank's time in compute,
        communication, data, rtnb and idle, with the straggler named.

        In [1]: session.profile(steps=20)
        Out[1]: 121
        """
        return self._cells.steering.profile(steps)

    @property
    def last_profile(self) -> ProfileReport | None:
        return self._cells.steering.last_profile

    def stacks(self, ranks: Iterable[int] | str | None = None) -> GroupStacks:
        """Where each rank's cell is right now, identical stacks folded and the odd
        ranks first (``%rtnb stacks``); works while a cell runs, in the background
        or from another thread. A rank whose Python does not answer within a second
        (native code holding the GIL) is read with ``py-spy dump``.

        In [1]: session.stacks()
        rank 1: in all_reduce (torch/distributed/distributed_c10d.py:2950) at cell [5] line 12
        """
        return self._cells.stacks(ranks)
