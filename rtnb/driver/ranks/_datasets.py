"""Ray Data datasets handed from the notebook to the ranks, as Ray Train hands them.

The one owner of a session's datasets: it checks what the user passes, records it
in the run journal (the names, and each dataset's lineage where Ray can serialize
it), and splits the datasets for a group with Ray Train's own ``DataConfig`` (by
default every dataset is split with ``streaming_split(world_size, equal=True)``;
those left out of ``datasets_to_split`` go whole to every rank). A rank reads its
shard with ``rtnb.get_dataset_shard(name)`` or ``ray.train.get_dataset_shard``.

Every new group gets the datasets again, split for its size: a recovery, a
``scale`` and a ``--replay`` reach the journal's DATASETS entry in order and hand
them over before the cells after it run. In the kernel that passed them, the live
Dataset objects are used; a new kernel rebuilds them from their lineage, and says
which it cannot (a dataset made from the notebook's memory, such as
``ray.data.from_numpy``: its blocks went with the kernel that made them).

A pipeline whose tasks can never be scheduled would leave the ranks waiting in
their first ``next()`` for ever, silently. Before handing datasets over, the
group waits up to :data:`DATA_ROOM_WAIT_S` for the CPUs the pipeline's tasks need
(:func:`pipeline_cpus`), then says in one line what holds the cluster's CPUs and
what to change (:func:`wait_for_data_room`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rtnb.errors import ClusterError, ConfigError, one_line

__all__ = [
    "DATA_ROOM_WAIT_S",
    "DataProgress",
    "DataWatch",
    "DatasetHandOver",
    "DatasetRecord",
    "check_datasets",
    "pipeline_cpus",
    "wait_for_data_room",
]

# How long a hand-over waits for CPUs its pipelines' tasks need before saying so.
DATA_ROOM_WAIT_S = 15.0


@dataclass
class DatasetRecord:
    """What the journal keeps of one hand-over (pickled as the entry's values)."""

    names: list[str]
    # Each dataset's serialized lineage; None where Ray could not serialize it.
    lineage: dict[str, bytes | None] = field(default_factory=dict)
    datasets_to_split: list[str] | str = "all"


def check_datasets(datasets: Mapping[str, Any]) -> dict[str, Any]:
    """``datasets`` as a dict of Ray Datasets; one ConfigError line for anything else."""
    if not isinstance(datasets, Mapping) or not datasets:
        raise ConfigError(
            "datasets are given as name=dataset pairs, e.g. --datasets train=train_ds "
            "or Session.run(..., datasets={'train': train_ds})"
        )
    from ray.data import Dataset

    checked: dict[str, Any] = {}
    for name, dataset in datasets.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"dataset name {name!r} is not a name: use letters, digits and _")
        if not isinstance(dataset, Dataset):
            raise ConfigError(
                f"dataset {name!r} is a {type(dataset).__name__}, not a Ray Dataset: make one "
                "with ray.data (e.g. ray.data.from_items(rows), ray.data.read_parquet(path))"
            )
        checked[name] = dataset
    return checked


def _split_names(data_config: Any, names: list[str]) -> list[str] | str:
    chosen = getattr(data_config, "_datasets_to_split", "all") if data_config else "all"
    if chosen != "all":
        unknown = sorted(set(chosen) - set(names))
        if unknown:
            raise ConfigError(
                f"DataConfig(datasets_to_split=...) names {', '.join(map(repr, unknown))}, "
                f"which was not passed; passed: {', '.join(names)}"
            )
    return chosen


def _as_data_config(data_config: Any) -> Any:
    """A ``ray.train.DataConfig``, or the names of the datasets to split (the others
    go whole to every rank): ``--split train`` is ``DataConfig(datasets_to_split=
    ["train"])``."""
    if data_config is None or hasattr(data_config, "configure"):
        return data_config
    names = [data_config] if isinstance(data_config, str) else data_config
    if isinstance(names, (list, tuple)) and all(
        isinstance(n, str) and n.isidentifier() for n in names
    ):
        from ray.train import DataConfig

        return DataConfig(datasets_to_split=list(names))
    raise ConfigError(
        f"dataset_config is a {type(data_config).__name__}: pass a ray.train.DataConfig "
        "(e.g. DataConfig(datasets_to_split=['train'])) or the names to split (['train'])"
    )


def _named(name: str, dataset: Any) -> Any:
    """``dataset`` named as handed, as Ray Train 2.60's DataConfig names it: Ray Data's
    stats then tag its executions ``NAME_...``, which the cell's data watch reads (Ray
    2.40's DataConfig leaves the name unset, and its setter private)."""
    setter = getattr(dataset, "set_name", None) or getattr(dataset, "_set_name", None)
    if setter is not None:
        setter(name)
    return dataset


def _lineage(dataset: Any) -> bytes | None:
    try:
        return dataset.serialize_lineage()
    except Exception:  # noqa: BLE001 - made from in-memory data: not serializable
        return None


class DatasetHandOver:
    """The datasets of one session: checked, journaled, and split for each group."""

    def __init__(self) -> None:
        self._live: dict[str, Any] = {}
        self._data_config: Any = None

    @property
    def names(self) -> list[str]:
        return sorted(self._live)

    @property
    def split_names(self) -> list[str]:
        """The datasets split across the ranks (the others go whole to each)."""
        chosen = _split_names(self._data_config, self.names)
        return self.names if chosen == "all" else [n for n in self.names if n in chosen]

    def record(self, datasets: Mapping[str, Any], data_config: Any = None) -> DatasetRecord:
        """Take ``datasets`` (added to those passed before, a name passed again is
        replaced) and the record the journal keeps of the whole set."""
        checked = check_datasets(datasets)
        data_config = _as_data_config(data_config)
        merged = {**self._live, **checked}
        config = data_config if data_config is not None else self._data_config
        split = _split_names(config, sorted(merged))
        self._live, self._data_config = merged, config
        return DatasetRecord(
            names=sorted(merged),
            lineage={name: _lineage(ds) for name, ds in merged.items()},
            datasets_to_split=split,
        )

    def resolve(self, record: DatasetRecord) -> tuple[dict[str, Any], list[str]]:
        """The datasets ``record`` names, and those that cannot be rebuilt: the live
        objects in this kernel, else rebuilt from their lineage."""
        from ray.data import Dataset

        datasets: dict[str, Any] = {}
        missing: list[str] = []
        for name in record.names:
            if name in self._live:
                datasets[name] = _named(name, self._live[name])
                continue
            lineage = record.lineage.get(name)
            try:
                datasets[name] = Dataset.deserialize_lineage(lineage) if lineage else None
            except Exception:  # noqa: BLE001 - a lineage this Ray cannot read
                datasets[name] = None
            if datasets[name] is None:
                del datasets[name]
                missing.append(name)
            else:
                self._live[name] = _named(name, datasets[name])
        return datasets, missing

    def data_config(self, record: DatasetRecord, available: list[str]) -> Any:
        """Ray Train's DataConfig for handing ``available`` of ``record``'s datasets
        (the user's own, when this kernel has it)."""
        if self._data_config is not None:
            return self._data_config
        from ray.train import DataConfig

        split = record.datasets_to_split
        return DataConfig(
            datasets_to_split=split if split == "all" else [n for n in split if n in available]
        )


def split_wait_line(
    name: str, waiting: Mapping[int, float], idle: list[int], split: list[str]
) -> str:
    """The line for ranks stuck in split dataset ``name`` that other ranks do not read."""
    rest = [n for n in split if n != name]
    whole = f"--split {','.join(rest)}" if rest else "--split '' (none split)"
    waiters = (
        f"ranks {', '.join(map(str, sorted(waiting)))} have waited"
        if len(waiting) > 1
        else f"rank {next(iter(waiting))} has waited"
    )
    readers = f"ranks {', '.join(map(str, idle))} do" if len(idle) > 1 else f"rank {idle[0]} does"
    mine = "their" if len(waiting) > 1 else "its"
    return (
        f"[rtnb] Ray Data {name!r} is split across the ranks, and {waiters} "
        f"{max(waiting.values()):.0f} s for {mine} shard while {readers} not read it: a split "
        f"dataset streams only while every rank reads its part. Read {name!r} on every "
        f"rank, or hand it whole to every rank with {whole}\n"
    )


def split_failed(exc: BaseException) -> ConfigError:
    return ConfigError(f"the datasets could not be split for the ranks: {one_line(exc)}")


def pipeline_cpus(dataset: Any) -> float:
    """The CPUs a pipeline's task asks Ray for: none for data already in the object
    store (``from_items``, ``from_numpy``, ``materialize()``: a MaterializedDataset),
    else one, Ray Data's default for a read or map task. (A stage made with
    ``num_cpus=0.5`` may start with less free; Ray Data keeps its stages private.)"""
    from ray.data.dataset import MaterializedDataset

    return 0.0 if isinstance(dataset, MaterializedDataset) else 1.0


def wait_for_data_room(
    datasets: Mapping[str, Any],
    ranks_hold: float,
    resources: Callable[[], tuple[dict[str, float], dict[str, float]]],
    timeout_s: float = DATA_ROOM_WAIT_S,
) -> None:
    """Return once the cluster has the CPUs ``datasets``' pipelines need free (at
    once, in the usual case); after ``timeout_s`` without them, one ClusterError
    line: what the ranks (``ranks_hold`` CPUs) and others hold, what to change.
    ``resources()`` gives the cluster's (total, free) resources."""
    needs = {name: pipeline_cpus(ds) for name, ds in datasets.items()}
    name, need = max(needs.items(), key=lambda item: item[1])
    if need <= 0:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        total, free = resources()
        if free.get("CPU", 0.0) + 1e-9 >= need:
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    cpus = total.get("CPU", 0.0)
    others = max(0.0, cpus - free.get("CPU", 0.0) - ranks_hold)
    held = f"the ranks hold {ranks_hold:g} of the cluster's {cpus:g} CPUs" + (
        f", other work holds {others:g}," if others > 1e-9 else ""
    )
    raise ClusterError(
        f"the Ray Data pipeline of {name!r} needs {need:g} free CPU for its tasks, but {held} "
        f"and none came free within {timeout_s:g} s: start the group with "
        "--cpus-per-worker 0.5 or fewer --workers, free the CPUs, or add a node with free CPUs"
    )


@dataclass
class DataProgress:
    """One execution of a handed dataset's pipeline (an epoch of its shards), as
    Ray Data's stats actor keeps it."""

    name: str
    state: str  # PENDING, RUNNING, FINISHED, FAILED
    stage: str  # the first stage still running, else the last one
    blocks_done: int
    blocks_total: int
    rows_total: int | None
    started: float
    ended: float | None

    @classmethod
    def parse(cls, name: str, record: Mapping[str, Any]) -> DataProgress:
        stages = [
            op for op in (record.get("operators") or {}).values() if op.get("name") != "Input"
        ]
        running = next((op for op in stages if op.get("state") != "FINISHED"), None)
        stage = running or (stages[-1] if stages else {})
        return cls(
            name=name,
            state=str(record.get("state", "UNKNOWN")),
            stage=str(stage.get("name", "")),
            blocks_done=int(stage.get("progress") or 0),
            blocks_total=int(stage.get("total") or 0),
            rows_total=record.get("total_rows"),
            started=float(record.get("start_time") or 0.0),
            ended=record.get("end_time"),
        )

    def text(self) -> str:
        rows = f"{self.rows_total} rows" if self.rows_total else "rows"
        if self.state == "FINISHED":
            # Ray Data's record can pair a new execution's start with the last one's
            # end (a dataset read again): no duration then, rather than a negative one.
            took = (
                f" in {self.ended - self.started:.1f} s"
                if self.ended and self.ended >= self.started
                else ""
            )
            return f"Ray Data {self.name!r}: {rows} read{took}"
        if self.state == "FAILED":
            return f"Ray Data {self.name!r}: its pipeline failed (the ranks' error says why)"
        done = f"{self.blocks_done}/{self.blocks_total} blocks" if self.blocks_total else "starting"
        approx = (
            f" (≈{self.rows_total * self.blocks_done // self.blocks_total}/{self.rows_total} rows)"
            if self.rows_total and self.blocks_total
            else ""
        )
        return f"Ray Data {self.name!r}: {self.stage} {done}{approx}"


# A pipeline that made no progress this long while its tasks lack CPUs is said to wait.
_WAIT_NOTE_S = 3.0
# A rank waiting this long in a split dataset's shard while another rank does not read
# it is told why (it would wait for ever: the split streams only while all read).
SPLIT_WAIT_NOTE_S = 20.0
# Running pipelines are shown again at most this often (a line each, not a bar).
_PROGRESS_NOTE_S = 10.0


class DataWatch:
    """A cell's view of the pipelines feeding it: a few lines in the cell — when
    one starts, every ``_PROGRESS_NOTE_S`` while it runs, why it waits (its tasks
    find no free CPU), when it ends — instead of Ray Data's progress bars, which a
    notebook shows as a wall of text (and rtnb's ranks keep out of it)."""

    def __init__(
        self,
        names: list[str],
        fetch: Callable[[], tuple[list[dict], dict[str, float]]],
        note: Callable[[str], None],
        poll_s: float = 1.0,
        since: float | None = None,
        split: list[str] | None = None,
        rank_waits: Callable[[], Mapping[int, Mapping[str, float]]] | None = None,
    ) -> None:
        self._names = names
        self._fetch = fetch
        self._note = note
        # The split datasets, and each rank's waits in them (RankUpdate.data_waits).
        self._split = list(names) if split is None else list(split)
        self._rank_waits = rank_waits
        self._split_noted: set[str] = set()
        self._poll_s = poll_s
        self._ended = threading.Event()
        self._lock = threading.Lock()
        # Executions that started before (the cell's start) are earlier cells' epochs.
        self._since = time.time() if since is None else since
        self._shown: dict[str, float] = {}  # each execution, when it was last shown
        self._stuck_noted: set[str] = set()
        self._finished: set[str] = set()

    @classmethod
    def for_cell(
        cls,
        handover: DatasetHandOver,
        fetch: Callable[[], tuple[list[dict], dict[str, float]]],
        cell: Any,
    ) -> DataWatch:
        """The watch of a cell (a ``CellHandle``: its ``note``, ``ranks`` and each
        running rank's ``data_waits``) reading ``handover``'s datasets."""
        return cls(
            handover.names,
            fetch,
            cell.note,
            split=handover.split_names,
            rank_waits=lambda: {r: dict(cell.attempt.data_waits.get(r, {})) for r in cell.ranks},
        )

    def start(self) -> None:
        threading.Thread(target=self._run, name="rtnb-data-watch", daemon=True).start()

    def _run(self) -> None:
        while not self._ended.wait(self._poll_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a view must never end the cell
                return

    def end(self, settle_s: float = 2.0) -> None:
        """The cell ends: say how each pipeline it read ended. Ray Data records an
        execution's end a moment after its last rows are read, so a pipeline seen
        running is waited for up to ``settle_s``."""
        self._ended.set()
        deadline = time.monotonic() + settle_s
        while True:
            running = self.check()
            if not running or time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    def check(self) -> int:
        """Note what changed; how many executions seen are still running."""
        with self._lock:
            return self._check()

    def _check(self) -> int:
        self._check_split_waits()
        running = 0
        records, free = self._fetch()
        now = time.time()
        for record in records:
            tag = str(record.get("_tag", ""))
            name = next((n for n in self._names if tag.startswith(f"{n}_")), None)
            if name is None or tag in self._finished:
                continue
            progress = DataProgress.parse(name, record)
            if progress.started < self._since - 1.0:
                continue  # an epoch of an earlier cell
            if progress.state in ("FINISHED", "FAILED"):
                self._finished.add(tag)
                self._note(f"[rtnb] {progress.text()}\n")
                continue
            running += 1
            last = self._shown.get(tag)
            if last is None or now - last >= _PROGRESS_NOTE_S:
                self._shown[tag] = now
                self._note(f"[rtnb] {progress.text()}\n")
            if (
                tag not in self._stuck_noted
                and progress.blocks_done == 0
                and now - progress.started >= _WAIT_NOTE_S
                and free.get("CPU", 0.0) < 1e-9
            ):
                self._stuck_noted.add(tag)
                self._note(
                    f"[rtnb] Ray Data {name!r} waits: its tasks find no free CPU "
                    f"({progress.stage}; the cluster has {free.get('CPU', 0.0):g} free)\n"
                )
        return running

    def _check_split_waits(self) -> None:
        """One line per split dataset some ranks wait in while others do not read it."""
        if self._rank_waits is None:
            return
        waits = self._rank_waits()
        for name in self._split:
            if name in self._split_noted:
                continue
            waiting = {r: w[name] for r, w in waits.items() if name in w}
            idle = sorted(r for r in waits if r not in waiting)
            if waiting and idle and max(waiting.values()) >= SPLIT_WAIT_NOTE_S:
                self._split_noted.add(name)
                self._note(split_wait_line(name, waiting, idle, self._split))
