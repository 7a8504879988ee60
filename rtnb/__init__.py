"""rtnb: interactive distributed PyTorch training on Ray, from a Jupyter notebook.

In the notebook::

    In [1]: %load_ext rtnb
    In [2]: %rtnb start --workers 2
    In [3]: %%rtrain
       ...: import torch.distributed as dist
       ...: dist.get_rank(), dist.get_world_size()

Inside a cell, the ``ray.train``-style API: :func:`get_context`, :func:`report`,
:func:`prepare_model`, :func:`prepare_data_loader`, :func:`get_checkpoint`.
From Python, :class:`Session`. This module never imports IPython display code,
ipywidgets or plotly; the magics and widgets live in ``rtnb.magics`` and
``rtnb.widgets``.
"""

from __future__ import annotations

from rtnb._cell import CellHandle
from rtnb._checkpoint import Checkpoint
from rtnb._checkpoints import CheckpointInfo
from rtnb._config import SessionConfig
from rtnb._metrics import MetricsStore, Progress, Report
from rtnb._rank import CellStopped, RankContext
from rtnb._result import Result, list_runs
from rtnb._session import Session
from rtnb._state import GroupState, StateChange
from rtnb._status import GroupStatus
from rtnb._train import (
    get_checkpoint,
    get_context,
    get_device,
    get_devices,
    prepare_data_loader,
    prepare_model,
    report,
)
from rtnb._values import PerRank
from rtnb.errors import (
    CellError,
    CellInterrupted,
    CheckpointError,
    ClusterError,
    ConfigError,
    RtnbError,
    SessionError,
    WorkerGroupError,
)

__version__ = "0.1.0"

__all__ = [
    "CellError",
    "CellHandle",
    "CellInterrupted",
    "CellStopped",
    "Checkpoint",
    "CheckpointInfo",
    "CheckpointError",
    "ClusterError",
    "ConfigError",
    "GroupState",
    "GroupStatus",
    "MetricsStore",
    "PerRank",
    "Progress",
    "RankContext",
    "Report",
    "Result",
    "RtnbError",
    "Session",
    "SessionConfig",
    "SessionError",
    "StateChange",
    "WorkerGroupError",
    "get_checkpoint",
    "get_context",
    "get_device",
    "get_devices",
    "list_runs",
    "load_ipython_extension",
    "prepare_data_loader",
    "prepare_model",
    "report",
    "unload_ipython_extension",
]


def load_ipython_extension(ipython) -> None:
    """``%load_ext rtnb``: registers ``%rtnb``, ``%%rtrain`` and ``%rtrain``."""
    from rtnb.magics import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython) -> None:
    from rtnb.magics import unload_ipython_extension as unload

    unload(ipython)
