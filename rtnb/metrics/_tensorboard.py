"""Mirrors every report into TensorBoard event files, one writer per rank."""

from __future__ import annotations

import os

from rtnb.core._text import to_number
from rtnb.errors import ConfigError

__all__ = ["TensorBoardExporter"]


class TensorBoardExporter:
    """Writes ``{run}/tensorboard/rank_N/`` so ``tensorboard --logdir {run}/tensorboard``
    shows one run per rank."""

    def __init__(self, local_dir: str) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ConfigError(
                "--tensorboard needs the tensorboardX package: pip install tensorboardX"
            ) from None
        self._writer_cls = SummaryWriter
        self.dir = local_dir
        self._writers: dict[int, object] = {}

    def add(self, rank: int, records: list[tuple[int, float, dict]]) -> None:
        writer = self._writers.get(rank)
        if writer is None:
            writer = self._writers[rank] = self._writer_cls(os.path.join(self.dir, f"rank_{rank}"))
        for step, timestamp, metrics in records:
            for name, raw in metrics.items():
                value = to_number(raw)
                if value is not None and name != "step":
                    writer.add_scalar(name, value, global_step=step, walltime=timestamp)

    def flush(self) -> None:
        for writer in self._writers.values():
            writer.flush()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
