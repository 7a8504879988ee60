"""PyTorch Lightning in a cell, as Ray Train runs it.

``ray.train.lightning``'s ``RayDDPStrategy``, ``RayFSDPStrategy``,
``RayLightningEnvironment`` and ``prepare_trainer`` run as Ray ships them: they
ask ``ray.train.get_context()`` and ``ray.train.torch.get_device()``, which are
rtnb's on a rank, and the process group is already up. Only the callback is
rtnb's: :class:`RayTrainReportCallback` is Ray's (its checkpoint folder and
``checkpoint.ckpt`` inside it, reported at each epoch's end), and it also sends
what ``self.log`` logged at every training step to the live plot, so a curve
grows step by step rather than once an epoch. Each step is reported once: the
epoch's last step goes out with its checkpoint.

Importing this module imports Lightning: rtnb only does so when a cell imports
``ray.train.lightning``.
"""

from __future__ import annotations

from typing import Any

from ray.train.lightning._lightning_utils import (
    RayTrainReportCallback as _RayTrainReportCallback,
)

from rtnb.worker import _api

__all__ = ["RayTrainReportCallback"]


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for name, value in metrics.items():
        if hasattr(value, "numel") and value.numel() != 1:
            continue
        try:
            out[name] = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError):
            continue
    return out


class RayTrainReportCallback(_RayTrainReportCallback):
    """Ray Train's Lightning callback, with every training step's logged values
    reported too (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: tuple[int, dict[str, float]] | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = _numbers(dict(trainer.logged_metrics))
        step = trainer.global_step
        if not metrics:
            return
        if self._pending is not None and self._pending[0] != step:
            self._flush()
        self._pending = (step, metrics)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        # The epoch's report (with its checkpoint) is this step's: a step reported
        # twice would start a new line on the plot.
        if self._pending is not None and self._pending[0] == trainer.global_step:
            self._pending = None
        self._flush()
        super().on_train_epoch_end(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._flush()

    def _flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            step, metrics = pending
            _api.report({**metrics, "step": step})
