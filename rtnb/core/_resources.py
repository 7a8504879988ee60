"""What a rank's process uses: CPU, memory, and its GPU (NVML), sampled on the rank.

A rank samples at most once a second (:class:`ResourceSampler`, called from its
long-poll, so only while a cell runs and at no cost to ``report()``); the samples
travel with the next poll's reports (``RankUpdate.resources``). The driver keeps
them out of the training metrics (no subplot, no step count) and writes them to
the run's system record (``metrics/system/``) and to TensorBoard/MLflow as
``sys/cpu``, ``sys/rss_mb``, ``sys/gpu_util``, ``sys/gpu_mem_mb``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ResourceSample", "ResourceSampler", "memory_climbing"]

SAMPLE_EVERY_S = 1.0
_MB = 1024 * 1024


@dataclass(frozen=True)
class ResourceSample:
    time: float
    step: int
    cpu_percent: float  # of one core (200 = two cores busy)
    rss_bytes: int
    gpu_util: float | None = None  # percent, the rank's GPU
    gpu_mem_bytes: int | None = None

    def metrics(self) -> dict[str, float]:
        out = {"sys/cpu": self.cpu_percent, "sys/rss_mb": self.rss_bytes / _MB}
        if self.gpu_util is not None:
            out["sys/gpu_util"] = self.gpu_util
        if self.gpu_mem_bytes is not None:
            out["sys/gpu_mem_mb"] = self.gpu_mem_bytes / _MB
        return out


class ResourceSampler:
    """Samples this process (psutil) and its GPU (nvidia-ml-py, when installed and
    a GPU is visible) no more often than ``every_s``."""

    def __init__(self, every_s: float = SAMPLE_EVERY_S, gpu_index: int | None = None) -> None:
        self.every_s = every_s
        self._last = 0.0
        self._process: Any = None
        self._gpu: Any = None
        self._nvml: Any = None
        try:
            import psutil

            self._process = psutil.Process(os.getpid())
            self._process.cpu_percent(None)  # the first call only starts the clock
        except Exception:  # noqa: BLE001 - no psutil: no samples, never an error
            self._process = None
        if gpu_index is not None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
                self._gpu = pynvml.nvmlDeviceGetHandleByIndex(gpu_index)
            except Exception:  # noqa: BLE001 - no NVML: CPU and memory only
                self._gpu = None

    def due(self, now: float | None = None) -> bool:
        return self._process is not None and (now or time.monotonic()) - self._last >= self.every_s

    def sample(self, step: int) -> ResourceSample | None:
        if self._process is None:
            return None
        self._last = time.monotonic()
        try:
            cpu = self._process.cpu_percent(None)
            rss = self._process.memory_info().rss
        except Exception:  # noqa: BLE001
            return None
        util = mem = None
        if self._gpu is not None:
            try:
                util = float(self._nvml.nvmlDeviceGetUtilizationRates(self._gpu).gpu)
                mem = int(self._nvml.nvmlDeviceGetMemoryInfo(self._gpu).used)
            except Exception:  # noqa: BLE001
                util = mem = None
        return ResourceSample(time.time(), step, cpu, rss, util, mem)


def memory_climbing(samples: Sequence[ResourceSample], window: int = 20) -> bool:
    """A rank whose memory climbs steadily: over the last ``window`` samples its RSS
    rose in at least 80% of the intervals, by 10% and 50 MB at least (a leak: a list
    of tensors kept by mistake, a growing cache), where a healthy loop's RSS rises
    then stays flat."""
    recent = [s.rss_bytes for s in samples[-window:]]
    if len(recent) < window:
        return False
    rises = sum(1 for a, b in zip(recent, recent[1:]) if b > a)
    grown = recent[-1] - recent[0]
    return rises >= 0.8 * (len(recent) - 1) and grown >= 0.1 * recent[0] and grown >= 50 * _MB
