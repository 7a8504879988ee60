"""The API a cell uses on each rank; names and behaviour follow ``ray.train``.

These functions only work inside a rank of a worker group (a ``%%rtrain`` cell or
``Session.run``); anywhere else they raise one clear error.
"""

from __future__ import annotations

import inspect
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from rtnb.core._context import CONFIG_NAME, notebook_checkpoints
from rtnb.core._messages import SAVE_TRIGGER, ValidationRequest
from rtnb.core._reports import portable_metric
from rtnb.errors import ConfigError, RtnbError, SessionError
from rtnb.worker import _reporting
from rtnb.worker._runtime import RankContext, RankRuntime, current_runtime
from rtnb.worker._uploads import CheckpointUploadMode, SaveOptions

__all__ = [
    "breakpoint",
    "control",
    "on_save",
    "on_trigger",
    "get_checkpoint",
    "get_config",
    "get_context",
    "get_dataset_shard",
    "get_device",
    "get_devices",
    "prepare_data_loader",
    "prepare_model",
    "report",
]


def _runtime(what: str) -> RankRuntime:
    runtime = current_runtime()
    if runtime is None:
        raise SessionError(
            f"rtnb.{what}() runs on the ranks of a worker group: call it inside a "
            "%%rtrain cell (or a function passed to Session.run), not in the notebook itself"
        )
    return runtime


def get_context() -> RankContext:
    """This rank's world_rank, world_size, local_rank, node_rank, device and run name."""
    return _runtime("get_context").context


def get_config() -> dict[str, Any]:
    """The config of this sweep trial (or of the function ``Session.run(fn,
    config=...)`` runs): Ray Train's ``train_loop_config``. Empty outside one.

    Example::

        In [5]: %%rtnb sweep space --metric loss
           ...: lr = rtnb.get_config()["lr"]
    """
    config = _runtime("get_config").namespace.get(CONFIG_NAME)
    return dict(config) if isinstance(config, Mapping) else {}


def control(name: str, default: Any = None) -> Any:
    """A value the notebook can change while the cell runs (``%rtnb set NAME=VALUE``,
    or the live view's inputs): read it every step. A change reaches every rank at
    the same step, is journaled (a recovery or replay applies it at that step
    again) and is marked on the live plot.

    Example::

        In [5]: %%rtrain --background
           ...: for step in range(1000):
           ...:     lr = rtnb.control("lr", 1e-3)
           ...:     for group in opt.param_groups:
           ...:         group["lr"] = lr
           ...:     ...
           ...:     rtnb.report({"loss": loss.item(), "lr": lr})

        In [6]: %rtnb set lr=3e-4
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a control's name is a Python identifier, got {name!r}")
    return _runtime("control").controls.value(name, default)


def on_trigger(name: str, fn: Callable[[], Any]) -> None:
    """Run ``fn()`` on this rank when the notebook fires trigger ``name``
    (``%rtnb trigger NAME``): every rank runs it in the report of the same step,
    before that report is recorded.

    Example::

        In [5]: %%rtrain --background
           ...: rtnb.on_trigger("eval", lambda: print("val loss", evaluate(model)))
           ...: for step in range(10_000):
           ...:     ...
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a trigger's name is a Python identifier, got {name!r}")
    _runtime("on_trigger").controls.on_trigger(name, fn)


def on_save(fn: Callable[[], Any]) -> None:
    """What ``%rtnb save-now`` saves: ``fn()`` returns this rank's state (saved with
    ``Checkpoint.from_state``) or a ``Checkpoint``; every rank saves in the report
    of the same step, which becomes that step's checkpoint.

    Example::

        In [5]: rtnb.on_save(lambda: {"model": model.state_dict(), "step": step})
    """
    _runtime("on_save").controls.on_trigger(SAVE_TRIGGER, fn)


def breakpoint(rank: int | None = None) -> None:  # noqa: A001 - the builtin it stands for
    """Stop here in pdb on ``rank`` (every rank when None), answered in the notebook:
    the prompt is the cell's input box, labelled with the rank; ``continue``
    goes on, an interrupt leaves the debugger and stops the cell. Plain
    ``breakpoint()`` does the same on every rank that reaches it.

    Example::

        In [5]: %%rtrain
           ...: loss = model(x).sum()
           ...: rtnb.breakpoint(rank=1)
    """
    runtime = _runtime("breakpoint")
    if rank is None or rank == runtime.context.world_rank:
        runtime.debugger.breakpoint_at(sys._getframe(1))


def get_device():
    """The ``torch.device`` this rank trains on (``cuda:0`` per GPU rank, else cpu)."""
    import torch

    return torch.device(_runtime("get_device").context.device)


def get_devices() -> list:
    return [get_device()]


def report(
    metrics: Mapping[str, Any],
    checkpoint: Any = None,
    checkpoint_dir_name: str | None = None,
    checkpoint_upload_mode: Any = None,
    delete_local_checkpoint_after_upload: bool | None = None,
    checkpoint_upload_fn: Callable | None = None,
    validation: Any = None,
    *,
    step: int | None = None,
) -> None:
    """Record ``metrics`` for this rank; cheap enough to call every step.

    Values are buffered on the rank and collected by the driver in batches, so a
    report never waits for the notebook. ``step`` counts reports per rank unless you
    pass one (or a ``"step"`` metric). An interrupted cell stops here, at the same
    step on every rank.

    ``checkpoint_upload_mode`` as Ray Train 2.60's: ``SYNC`` (the default for a
    folder of yours) copies it into the run before returning; ``ASYNC`` (the default
    for ``Checkpoint.from_state``) snapshots it and returns at once, the copy landing
    beside the loop, at most ``RTNB_UPLOADS_IN_FLIGHT`` (2) at a time before a
    report waits; the cell's end waits for what is in flight.
    ``delete_local_checkpoint_after_upload`` (default: with ``ASYNC``) removes your
    folder. ``NO_UPLOAD`` commits the folder where it is (it must be in the run's
    storage); ``checkpoint_upload_fn(checkpoint, destination) -> Checkpoint`` writes
    the files itself (``destination``: the checkpoint's folder in the run, as a URI
    that reopens it); rtnb hashes what it returns and commits it the same way.

    ``validation``: a function ``fn(checkpoint, **kwargs) -> dict`` (or Ray Train's
    ``ValidationConfig(fn, task_config, ray_remote_kwargs)``) run as its own Ray task
    on the checkpoint once it is committed, not on a rank; its metrics join the
    checkpoint's in the browser, the ``Result`` and
    :func:`get_all_reported_checkpoints`.

    In [1]: %%rtrain
       ...: rtnb.report({"loss": 0.1}, checkpoint=rtnb.Checkpoint.from_state(state),
       ...:             checkpoint_upload_mode="ASYNC")
    """
    options = None
    if (
        checkpoint_upload_mode is not None
        or checkpoint_upload_fn is not None
        or (validation is not None and validation is not False)
    ):
        options, delete_local_checkpoint_after_upload = _save_options(
            checkpoint_upload_mode,
            delete_local_checkpoint_after_upload,
            checkpoint_upload_fn,
            validation,
            checkpoint,
        )
    reports = _reporting.current_reports()
    if checkpoint is None and step is None and reports is not None:
        # Every step of a fast loop (where the C path below is not built): keep it short.
        if type(metrics) is dict and "step" not in metrics:
            reports.report_plain(metrics)
            return
    runtime = _runtime("report")
    if type(metrics) is not dict and not isinstance(metrics, Mapping):
        raise TypeError(f"rtnb.report() takes a dict of metrics, got {type(metrics).__name__}")
    if checkpoint is not None and not hasattr(checkpoint, "path"):
        raise TypeError(
            "rtnb.report(checkpoint=...) takes an rtnb.Checkpoint (or ray.train.Checkpoint), e.g. "
            "rtnb.Checkpoint.from_directory(d) or rtnb.Checkpoint.from_state({...})"
        )
    if step is None:
        given = metrics.get("step")
        if type(given) is int:
            step = given
    # A checkpoint's metrics go with its files, later: they must not change meanwhile,
    # and cross to the kernel as numbers (a CUDA tensor could not be read there).
    # Plain reports are read at once (ReportColumns.add), so they need no copy.
    if checkpoint is not None:
        metrics = {
            name: portable_metric(value) if hasattr(value, "item") else value
            for name, value in metrics.items()
        }
    runtime.reports.report(metrics, step, checkpoint, options)
    if delete_local_checkpoint_after_upload and checkpoint is not None:
        folder = getattr(checkpoint, "path", None)
        if folder and not getattr(checkpoint, "_temporary", False):
            shutil.rmtree(folder, ignore_errors=True)


def _save_options(
    mode: Any, delete: bool | None, upload_fn: Any, validation: Any, checkpoint: Any
) -> tuple[SaveOptions, bool]:
    """How report() saves ``checkpoint``, and whether it deletes the local folder
    after its upload; one line for what it cannot take."""
    try:
        chosen = CheckpointUploadMode.named(mode) if mode is not None else None
    except ValueError as exc:
        raise ConfigError(f"report({exc})") from None
    if upload_fn is not None and not callable(upload_fn):
        raise ConfigError(
            "report(checkpoint_upload_fn=...) takes a function "
            f"fn(checkpoint, destination) -> Checkpoint, got {type(upload_fn).__name__}"
        )
    request = None
    if validation is not None and validation is not False:
        request = _validation_request(validation, checkpoint)
    if delete is None:
        delete = chosen is not None and chosen.default_delete_local_checkpoint_after_upload()
    if chosen is CheckpointUploadMode.NO_UPLOAD and upload_fn is None:
        delete = False  # the folder is the checkpoint
    return SaveOptions(chosen, upload_fn, request, bool(delete)), bool(delete)


def _validation_request(validation: Any, checkpoint: Any) -> ValidationRequest:
    """``validation`` as report() takes it: a function, Ray Train's ValidationConfig
    (its ``fn``, ``task_config`` and ``ray_remote_kwargs``); one line otherwise."""
    if checkpoint is None:
        raise ConfigError(
            "report(validation=...) validates the checkpoint reported with it: pass checkpoint="
        )
    fn, kwargs, timeout_s, remote = validation, {}, None, {}
    if hasattr(validation, "fn") and not callable(validation):
        task = getattr(validation, "task_config", None)
        fn = validation.fn
        kwargs = dict(getattr(task, "fn_kwargs", None) or {})
        timeout_s = getattr(task, "timeout_s", None)
        remote = dict(getattr(validation, "ray_remote_kwargs", None) or {})
    if not callable(fn):
        raise ConfigError(
            f"report(validation=...) takes a function fn(checkpoint, **kwargs) -> dict or "
            f"ray.train.ValidationConfig(fn), got {type(validation).__name__}"
        )
    from ray import cloudpickle

    return ValidationRequest(cloudpickle.dumps(fn), kwargs, timeout_s, remote)


report_in_python = report

try:
    from rtnb.worker._fastreport import make_report
except ImportError:  # built without a C compiler: the Python path records the same
    pass
else:
    # Rebound through globals() so that static readers (the API reference, IDEs) see
    # the documented function above, while callers get the builtin with its docstring.
    globals()["report"] = make_report(
        report_in_python,
        vars(_reporting),
        "report(metrics, checkpoint=None, checkpoint_dir_name=None, checkpoint_upload_mode=None, "
        "delete_local_checkpoint_after_upload=None, checkpoint_upload_fn=None, validation=None, "
        "*, step=None)\n--\n\n" + inspect.cleandoc(report_in_python.__doc__ or ""),
    )


def get_dataset_shard(name: str):
    """This rank's shard of the Ray Dataset handed over as ``name`` (a
    ``DataIterator``: ``iter_torch_batches()``, ``iter_batches()``, once per epoch),
    as Ray Train's ``get_dataset_shard``. Datasets are handed over with
    ``%%rtrain --datasets name=ds``, ``%rtnb datasets name=ds`` or
    ``Session.run(..., datasets={...})``."""
    runtime = _runtime("get_dataset_shard")
    shard = runtime.datasets.get(name)
    if shard is None:
        passed = ", ".join(sorted(runtime.datasets)) or "none yet"
        raise SessionError(
            f"no dataset named {name!r} was handed to the ranks (handed: {passed}); "
            f"pass it with %rtnb datasets {name}=DATASET or %%rtrain --datasets {name}=DATASET"
        )
    return shard


def get_all_reported_checkpoints(
    consistency_mode: Any = "VALIDATED", timeout_s: float | None = None
) -> list:
    """Every committed checkpoint of the run so far, oldest first, each a
    ``ReportedCheckpoint(checkpoint, metrics, status)`` (as Ray Train's). In a cell
    it first waits until the last checkpoint this rank reported is ``COMMITTED``, or
    also ``VALIDATED`` (the default); in the notebook it waits for the validations
    still running. ``timeout_s``: give up with one line after that long.

    In [1]: %%rtrain
       ...: for reported in rtnb.get_all_reported_checkpoints():
       ...:     print(reported.checkpoint.id, reported.status, reported.metrics)
    """
    runtime = current_runtime()
    if runtime is None or not runtime.in_cell_thread():
        reader = notebook_checkpoints()
        if reader is None:
            raise SessionError(
                "get_all_reported_checkpoints() reads a run's checkpoints: start a session "
                "first (%rtnb start), or call it in a cell"
            )
        return reader(consistency_mode, timeout_s)
    return runtime.reports.reported_checkpoints(consistency_mode, timeout_s)


def get_checkpoint():
    """The checkpoint chosen for resume (``%rtnb resume``/Load), else the latest
    committed one of this run, else None (as Ray Train's ``get_checkpoint``)."""
    return _runtime("get_checkpoint").reports.hand_out_checkpoint()


def prepare_model(
    model,
    move_to_device: bool = True,
    parallel_strategy: str | None = "ddp",
    parallel_strategy_kwargs: dict | None = None,
):
    """Move ``model`` to this rank's device and, when there are peers, wrap it for
    data parallelism as Ray Train's ``prepare_model`` does: ``"ddp"``
    (``DistributedDataParallel``) or ``"fsdp"`` (FSDP2's ``fully_shard`` on the
    model: each rank holds its part of every parameter, as a DTensor; shard blocks
    first with ``fully_shard(block)`` for finer groups). ``parallel_strategy_kwargs``
    go to the wrapper; one rank (local mode) gets the model unwrapped."""
    import torch.distributed as dist

    if parallel_strategy not in (None, "ddp", "fsdp"):
        raise RtnbError(
            f"parallel_strategy {parallel_strategy!r} is not supported; use 'ddp', 'fsdp' or None"
        )
    device = get_device()
    if move_to_device:
        model = model.to(device)
    if parallel_strategy is None or not dist.is_initialized() or dist.get_world_size() < 2:
        return model
    kwargs = dict(parallel_strategy_kwargs or {})
    if parallel_strategy == "fsdp":
        return _fully_shard(model, kwargs)
    from torch.nn.parallel import DistributedDataParallel

    if device.type == "cuda":
        kwargs.setdefault("device_ids", [device.index or 0])
    return DistributedDataParallel(model, **kwargs)


def _fully_shard(model, kwargs: dict):
    """FSDP2 over the group's ranks: a device mesh of this rank's device type (a
    CPU mesh for gloo ranks, which FSDP2's default would not pick)."""
    import torch.distributed as dist

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch before FSDP2
        raise RtnbError(
            "parallel_strategy 'fsdp' needs torch.distributed.fsdp.fully_shard (torch 2.6 or later)"
        ) from None
    if "mesh" not in kwargs:
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["mesh"] = init_device_mesh(get_device().type, (dist.get_world_size(),))
    try:
        return fully_shard(model, **kwargs)
    except TypeError as exc:
        raise RtnbError(f"parallel_strategy_kwargs for 'fsdp': {exc}") from None


def prepare_data_loader(data_loader, add_dist_sampler: bool = True, move_to_device: bool = True):
    """Shard ``data_loader`` across ranks (DistributedSampler) and move batches to the device.

    The sampler's epoch advances on every pass, so shuffling differs per epoch as in
    Ray Train.
    """
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

    ctx = _runtime("prepare_data_loader").context
    world = dist.get_world_size() if dist.is_initialized() else 1
    loader = data_loader
    if (
        add_dist_sampler
        and world > 1
        and not isinstance(loader.dataset, IterableDataset)
        and not isinstance(loader.sampler, DistributedSampler)
    ):
        sampler = DistributedSampler(
            loader.dataset,
            num_replicas=world,
            rank=ctx.world_rank,
            shuffle=isinstance(loader.sampler, RandomSampler),
        )
        loader = DataLoader(
            loader.dataset,
            batch_size=loader.batch_size,
            sampler=sampler,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            drop_last=loader.drop_last,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            persistent_workers=loader.persistent_workers,
        )
    return _PreparedLoader(loader, get_device() if move_to_device else None)


class _PreparedLoader:
    """Iterates the wrapped loader, moving each batch to the device and bumping the
    sampler's epoch per pass; everything else is delegated."""

    def __init__(self, loader, device) -> None:
        self._loader = loader
        self._device = device
        self._epoch = 0

    def __iter__(self) -> Iterator:
        sampler = getattr(self._loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self._epoch)
        self._epoch += 1
        for batch in self._loader:
            yield _to_device(batch, self._device) if self._device is not None else batch

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


def _to_device(batch, device):
    import torch

    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return type(batch)({k: _to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        moved = [_to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch
