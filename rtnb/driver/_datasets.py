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

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rtnb.errors import ClusterError, ConfigError, one_line

__all__ = [
    "DATA_ROOM_WAIT_S",
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

    def record(self, datasets: Mapping[str, Any], data_config: Any = None) -> DatasetRecord:
        """Take ``datasets`` (added to those passed before, a name passed again is
        replaced) and the record the journal keeps of the whole set."""
        checked = check_datasets(datasets)
        if data_config is not None and not hasattr(data_config, "configure"):
            raise ConfigError(
                f"data_config is a {type(data_config).__name__}: pass a "
                "ray.train.DataConfig (e.g. DataConfig(datasets_to_split=['train']))"
            )
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
                datasets[name] = self._live[name]
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
                self._live[name] = datasets[name]
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


def split_failed(exc: BaseException) -> ConfigError:
    return ConfigError(f"the datasets could not be split for the ranks: {one_line(exc)}")


def pipeline_cpus(dataset: Any) -> float:
    """The CPUs one task of ``dataset``'s hungriest stage asks Ray for: 0 for data
    already in the object store (``from_items``, ``materialize()``), else the
    stage's ``num_cpus`` (Ray Data's tasks take 1 unless told otherwise)."""
    need = 0.0
    pending = [dataset._logical_plan.dag]
    while pending:
        op = pending.pop()
        pending.extend(op.input_dependencies)
        remote_args = getattr(op, "ray_remote_args", None)
        if remote_args is not None:  # a stage that runs tasks (read, map, ...)
            need = max(need, float(remote_args.get("num_cpus", 1)))
    return need


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
        f" and other work {others:g}" if others > 1e-9 else ""
    )
    raise ClusterError(
        f"the Ray Data pipeline of {name!r} needs {need:g} free CPU for its tasks, but {held} "
        f"and none came free within {timeout_s:g} s: start the group with "
        "--cpus-per-worker 0.5 or fewer --workers, free the CPUs, or add a node with free CPUs"
    )
