"""rtnb: interactive distributed PyTorch training on Ray, from a Jupyter notebook.

In the notebook::

    In [1]: %load_ext rtnb
    In [2]: %rtnb start --workers 2
    In [3]: %%rtrain
       ...: import torch.distributed as dist
       ...: dist.get_rank(), dist.get_world_size()

Inside a cell, the ``ray.train``-style API: :func:`get_context`, :func:`report`,
:func:`prepare_model`, :func:`prepare_data_loader`, :func:`get_checkpoint`.
From Python, :class:`Session`.

This module is the one public face, and it loads lazily: a name is imported from
its subpackage on first use, so a rank process that only calls ``rtnb.report``
never imports the driver (docs/architecture.md). It never imports IPython display
code, ipywidgets or plotly; the magics and widgets live in ``rtnb.magics`` and
``rtnb.widgets``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rtnb.core._faces import lazy_face

__version__ = "0.1.0"


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    """Jupyter server: warm Ray at server start (rtnb.jupyter_extension)."""
    return [{"module": "rtnb.jupyter_extension"}]


# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # driver side (the notebook)
    "Session": "rtnb.driver.session._session",
    "Sweep": "rtnb.driver.tuning._sweep",
    "SweepTrial": "rtnb.driver.tuning._sweep",
    "TrialState": "rtnb.driver.tuning._sweep",
    "sweep": "rtnb.driver.tuning._runner",
    "CellHandle": "rtnb.driver.cells._handle",
    "Failure": "rtnb.driver.lifecycle._policies",
    "FailurePolicy": "rtnb.driver.lifecycle._policies",
    "Raise": "rtnb.driver.lifecycle._policies",
    "Retry": "rtnb.driver.lifecycle._policies",
    "Shrink": "rtnb.driver.lifecycle._policies",
    "GroupState": "rtnb.driver.lifecycle._states",
    "StateChange": "rtnb.driver.lifecycle._states",
    "GroupStatus": "rtnb.driver.session._status",
    "SessionConfig": "rtnb.core._config",
    "RunAccess": "rtnb.driver.session._run_access",
    "open_run": "rtnb.driver.session._run_access",
    "WarmRayStatus": "rtnb.driver.cluster._warm_commands",
    "stop_warm_ray": "rtnb.driver.cluster._warm_commands",
    "warm_ray_status": "rtnb.driver.cluster._warm_commands",
    "attach": "rtnb.driver.detached._client",
    "detached_groups": "rtnb.driver.detached._client",
    "stop_detached": "rtnb.driver.detached._client",
    "DetachedSession": "rtnb.driver.detached._client",
    "DetachedGroup": "rtnb.driver.detached._host",
    "PerRank": "rtnb.core._values",
    "MetricsStore": "rtnb.metrics._store",
    "Progress": "rtnb.metrics._store",
    "Report": "rtnb.metrics._store",
    "Result": "rtnb.storage._result",
    "list_runs": "rtnb.storage._result",
    "Checkpoint": "rtnb.storage._checkpoint",
    "CheckpointInfo": "rtnb.storage._checkpoints",
    "CheckpointUploadMode": "rtnb.worker._uploads",
    # rank side (inside a cell), named as in ray.train
    "CellStopped": "rtnb.worker._runtime",
    "RankContext": "rtnb.worker._runtime",
    "get_checkpoint": "rtnb.worker._api",
    "get_all_reported_checkpoints": "rtnb.worker._api",
    "CheckpointConsistencyMode": "rtnb.storage._checkpoints",
    "ReportedCheckpoint": "rtnb.storage._checkpoints",
    "get_config": "rtnb.worker._api",
    "control": "rtnb.worker._api",
    "breakpoint": "rtnb.worker._api",
    "on_trigger": "rtnb.worker._api",
    "on_save": "rtnb.worker._api",
    "get_context": "rtnb.worker._api",
    "get_dataset_shard": "rtnb.worker._api",
    "prepare_trainer": "rtnb.worker._hf",
    "RayTrainReportCallback": "rtnb.worker._hf",
    "get_device": "rtnb.worker._api",
    "get_devices": "rtnb.worker._api",
    "prepare_data_loader": "rtnb.worker._api",
    "prepare_model": "rtnb.worker._api",
    "report": "rtnb.worker._api",
    # errors
    "CellError": "rtnb.errors",
    "CellInterrupted": "rtnb.errors",
    "CheckpointError": "rtnb.errors",
    "ClusterError": "rtnb.errors",
    "ConfigError": "rtnb.errors",
    "RtnbError": "rtnb.errors",
    "SessionError": "rtnb.errors",
    "StorageError": "rtnb.errors",
    "WaitTimeout": "rtnb.errors",
    "WorkerGroupError": "rtnb.errors",
}

__all__ = [
    "CellError",
    "CellHandle",
    "CellInterrupted",
    "CellStopped",
    "Checkpoint",
    "CheckpointError",
    "CheckpointConsistencyMode",
    "CheckpointInfo",
    "CheckpointUploadMode",
    "ClusterError",
    "ConfigError",
    "DetachedGroup",
    "DetachedSession",
    "Failure",
    "FailurePolicy",
    "GroupState",
    "GroupStatus",
    "MetricsStore",
    "PerRank",
    "Progress",
    "Raise",
    "RankContext",
    "RayTrainReportCallback",
    "Report",
    "ReportedCheckpoint",
    "Result",
    "Retry",
    "RtnbError",
    "RunAccess",
    "Session",
    "SessionConfig",
    "SessionError",
    "Shrink",
    "StateChange",
    "StorageError",
    "Sweep",
    "SweepTrial",
    "TrialState",
    "WaitTimeout",
    "WarmRayStatus",
    "WorkerGroupError",
    "attach",
    "detached_groups",
    "get_all_reported_checkpoints",
    "get_checkpoint",
    "breakpoint",
    "control",
    "get_config",
    "get_context",
    "get_dataset_shard",
    "get_device",
    "get_devices",
    "list_runs",
    "load_ipython_extension",
    "on_save",
    "on_trigger",
    "open_run",
    "prepare_data_loader",
    "prepare_model",
    "prepare_trainer",
    "report",
    "stop_detached",
    "stop_warm_ray",
    "sweep",
    "unload_ipython_extension",
    "warm_ray_status",
]


__getattr__ = lazy_face(globals(), _EXPORTS)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def load_ipython_extension(ipython) -> None:
    """``%load_ext rtnb``: registers ``%rtnb``, ``%%rtrain`` and ``%rtrain``."""
    from rtnb.magics import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython) -> None:
    from rtnb.magics import unload_ipython_extension as unload

    unload(ipython)


if TYPE_CHECKING:  # what type checkers and IDEs see
    from rtnb.core._config import SessionConfig
    from rtnb.core._values import PerRank
    from rtnb.driver.cells._handle import CellHandle
    from rtnb.driver.cluster._warm_commands import WarmRayStatus, stop_warm_ray, warm_ray_status
    from rtnb.driver.detached._client import DetachedSession, attach, detached_groups, stop_detached
    from rtnb.driver.detached._host import DetachedGroup
    from rtnb.driver.lifecycle._policies import Failure, FailurePolicy, Raise, Retry, Shrink
    from rtnb.driver.lifecycle._states import GroupState, StateChange
    from rtnb.driver.session._run_access import RunAccess, open_run
    from rtnb.driver.session._session import Session
    from rtnb.driver.session._status import GroupStatus
    from rtnb.driver.tuning._runner import sweep
    from rtnb.driver.tuning._sweep import Sweep, SweepTrial, TrialState
    from rtnb.errors import (
        CellError,
        CellInterrupted,
        CheckpointError,
        ClusterError,
        ConfigError,
        RtnbError,
        SessionError,
        StorageError,
        WaitTimeout,
        WorkerGroupError,
    )
    from rtnb.metrics._store import MetricsStore, Progress, Report
    from rtnb.storage._checkpoint import Checkpoint
    from rtnb.storage._checkpoints import (
        CheckpointConsistencyMode,
        CheckpointInfo,
        ReportedCheckpoint,
    )
    from rtnb.storage._result import Result, list_runs
    from rtnb.worker._api import (
        breakpoint,
        control,
        get_all_reported_checkpoints,
        get_checkpoint,
        get_config,
        get_context,
        get_dataset_shard,
        get_device,
        get_devices,
        on_save,
        on_trigger,
        prepare_data_loader,
        prepare_model,
        report,
    )
    from rtnb.worker._hf import RayTrainReportCallback, prepare_trainer
    from rtnb.worker._runtime import RankContext
    from rtnb.worker._stopping import CellStopped
    from rtnb.worker._uploads import CheckpointUploadMode
