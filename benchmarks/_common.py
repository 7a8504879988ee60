"""Shared set-up of the benchmarks: one embedded Ray sized for this 2-core machine."""

from __future__ import annotations

import time


def embedded_ray() -> float:
    """Start a local Ray with 2 CPUs and a capped object store; seconds it took."""
    import ray

    started = time.perf_counter()
    ray.init(
        num_cpus=2,
        object_store_memory=300_000_000,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
    )
    return time.perf_counter() - started


def quiet(*_args) -> None:
    """An output sink that drops the ranks' prints (they would skew timings)."""
