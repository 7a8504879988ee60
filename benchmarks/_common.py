"""Shared set-up of the benchmarks: one embedded Ray sized for this 2-core machine."""

from __future__ import annotations

import time


def embedded_ray() -> float:
    """Start a local Ray with 2 CPUs and a capped object store; seconds it took.

    Its processes get rtnb's lazy stand-in for jsonschema's IRI grammar, as an
    embedded ``%rtnb start`` does, so a peer sharing this Ray (TorchTrainer, plain
    actors) starts its workers as fast as rtnb's."""
    from rtnb.core._startup import defer_unused_imports, lazy_imports_for_children

    defer_unused_imports()
    import ray

    started = time.perf_counter()
    with lazy_imports_for_children():
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
