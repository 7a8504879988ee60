"""A Hugging Face ``transformers.Trainer`` in a cell, as Ray Train runs one.

``prepare_trainer(trainer)`` makes a Trainer built in a ``%%rtrain`` cell train on
the group: its ``TrainingArguments`` already see the group (rtnb sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and ``MASTER_ADDR`` on every rank and has
``torch.distributed`` up, which accelerate takes as it is), Ray Data iterables
(``get_dataset_shard(...).iter_torch_batches()``) feed its dataloaders batch by
batch, and :class:`RayTrainReportCallback` is added. The callback sends the
Trainer's logs to the live plot at each logging step and each checkpoint the
Trainer saves through rtnb's checkpoint store (``checkpoint/`` inside it, as Ray
Train lays it out), so ``trainer.train(resume_from_checkpoint=...)`` takes it back.

Importing this module imports transformers: rtnb only does so when a cell asks.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import transformers.trainer
from torch.utils.data import DataLoader, IterableDataset
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from rtnb.errors import ConfigError
from rtnb.worker import _api
from rtnb.worker import _runtime as _rank

__all__ = ["CHECKPOINT_NAME", "RayTrainReportCallback", "prepare_trainer"]

# The folder inside an rtnb checkpoint that holds the Trainer's own checkpoint.
CHECKPOINT_NAME = "checkpoint"


class RayTrainReportCallback(TrainerCallback):
    """Reports the Trainer's logs at each logging step, and its checkpoints.

    A log waits for the step's other events (the Trainer logs, then saves, at the
    same step): a save then goes out with the metrics in one report, and no step is
    reported twice (a step reported again would start a new line in the plot)."""

    CHECKPOINT_NAME = CHECKPOINT_NAME

    def __init__(self) -> None:
        super().__init__()
        self._pending: tuple[int, dict[str, float]] | None = None
        self._last_step = -1
        self._offset = 0

    def on_train_begin(self, args, state, control, **kwargs):
        # The run's steps go on: a Trainer that starts at step 0 in a run that has
        # trained before reports after the run's last step (its checkpoint ids too);
        # one resumed from an rtnb checkpoint starts where that checkpoint's step
        # count left the rank (get_checkpoint() set it), so its steps match.
        runtime = _rank.current_runtime()
        last = runtime.step if runtime is not None else -1
        self._offset = max(0, last - state.global_step)
        self._last_step = state.global_step + self._offset
        self._pending = None

    def _reports_for(self, state) -> bool:
        """One callback reports per training run, however many were added (the
        user's RayTrainReportCallback and the one prepare_trainer adds)."""
        owner = getattr(state, "_rtnb_reporter", None)
        if owner is None:
            state._rtnb_reporter = owner = self
        return owner is self

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self._reports_for(state):
            return
        numbers = {
            key: float(value)
            for key, value in (logs or {}).items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        step = state.global_step + self._offset
        if not numbers or step <= self._last_step:
            return
        if self._pending is not None and self._pending[0] == step:
            self._pending[1].update(numbers)
        else:
            self._flush()
            self._pending = (step, numbers)

    def on_save(self, args, state, control, **kwargs):
        if not self._reports_for(state):
            return
        step = state.global_step + self._offset
        metrics = {}
        for log in state.log_history:
            metrics.update(
                {k: v for k, v in log.items() if isinstance(v, (int, float)) and k != "step"}
            )
        if self._pending is not None and self._pending[0] == step:
            metrics.update(self._pending[1])
            self._pending = None
        self._flush()
        if step <= self._last_step:
            return
        # The folder this save wrote (not the highest-numbered one in output_dir: a
        # folder left there by an earlier run can have a higher number).
        source = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if not state.is_world_process_zero or not os.path.isdir(source):
            _api.report(metrics, step=step)
            self._last_step = step
            return
        with tempfile.TemporaryDirectory(prefix="rtnb-hf-") as folder:
            shutil.copytree(source, os.path.join(folder, CHECKPOINT_NAME))
            _api.report(metrics, checkpoint=_checkpoint_from(folder), step=step)
        self._last_step = step

    def on_step_begin(self, args, state, control, **kwargs):
        self._flush()

    def on_train_end(self, args, state, control, **kwargs):
        self._flush()

    def _flush(self) -> None:
        if self._pending is None:
            return
        step, metrics = self._pending
        self._pending = None
        if step > self._last_step:
            _api.report(metrics, step=step)
            self._last_step = step


def _checkpoint_from(folder: str):
    from rtnb.storage._checkpoint import Checkpoint

    return Checkpoint.from_directory(folder)


class _BatchesAsDataset(IterableDataset):
    """A Ray Data iterable of ready batches, as a torch dataset a DataLoader passes on."""

    def __init__(self, batches: Any) -> None:
        super().__init__()
        self.batches = batches

    def __iter__(self) -> Iterator:
        return iter(self.batches)


def _loader(batches: Any) -> DataLoader:
    # Ray Data made the batches: the loader hands each one on as it is.
    return DataLoader(_BatchesAsDataset(batches), batch_size=None)


def _is_ray_batches(value: Any) -> bool:
    from ray.data.iterator import _IterableFromIterator

    return isinstance(value, _IterableFromIterator)


def prepare_trainer(trainer: Any) -> Any:
    """Make a ``transformers.Trainer`` built in the cell train on the group (see the
    module docstring); returns it, as Ray Train's ``prepare_trainer`` does.

    Example::

        In [5]: %%rtrain
           ...: trainer = Trainer(model, TrainingArguments("out", max_steps=50), train_dataset=ds)
           ...: trainer = rtnb.prepare_trainer(trainer)
           ...: trainer.train()
    """
    context = _api.get_context()
    if not isinstance(trainer, transformers.trainer.Trainer):
        raise ConfigError(
            f"prepare_trainer() takes a transformers.Trainer, got {type(trainer).__name__}"
        )
    if getattr(trainer, "_rtnb_prepared", False):
        raise ConfigError(
            "prepare_trainer() was already called on this Trainer: call it once, "
            "after building the Trainer and before trainer.train()"
        )
    if trainer.args.world_size != context.world_size:
        raise ConfigError(
            f"the Trainer's TrainingArguments see {trainer.args.world_size} process(es), "
            f"the group has {context.world_size}: build TrainingArguments inside the "
            "%%rtrain cell (on the ranks), not in the notebook"
        )
    base = type(trainer)

    class RtnbTrainer(base):  # type: ignore[valid-type, misc]
        def get_train_dataloader(self):
            if _is_ray_batches(self.train_dataset):
                return _loader(self.train_dataset)
            return super().get_train_dataloader()

        def get_eval_dataloader(self, eval_dataset=None):
            chosen = self.eval_dataset if eval_dataset is None else eval_dataset
            if isinstance(chosen, str) and isinstance(self.eval_dataset, dict):
                chosen = self.eval_dataset[chosen]
            if _is_ray_batches(chosen):
                return _loader(chosen)
            return super().get_eval_dataloader(eval_dataset)

    RtnbTrainer.__name__ = RtnbTrainer.__qualname__ = base.__name__
    trainer.__class__ = RtnbTrainer
    trainer._rtnb_prepared = True
    if not any(isinstance(cb, RayTrainReportCallback) for cb in trainer.callback_handler.callbacks):
        trainer.add_callback(RayTrainReportCallback())
    return trainer
