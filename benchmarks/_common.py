"""Shared set-up of the benchmarks: one embedded Ray sized for this 2-core machine."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
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


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (for a server to take)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def quiet(*_args) -> None:
    """An output sink that drops the ranks' prints (they would skew timings)."""


def phase_result(proc: subprocess.CompletedProcess, what: str) -> dict:
    """The JSON a phase printed on its last ``RESULT `` line; exits naming ``what``."""
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{what} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def run_phase(
    script: str, args: list[str], what: str, timeout: float, env_extra: dict | None = None
) -> dict:
    """Run ``script args`` in a fresh Python (its own embedded Ray, not RAY_ADDRESS's)."""
    env = {**os.environ, **(env_extra or {}), "RAY_DEDUP_LOGS": "0"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    return phase_result(proc, what)


def peer_first() -> bool:
    """Whether this round runs the peer's side first (``run.py`` alternates it)."""
    return os.environ.get("RTNB_BENCH_PEER_FIRST") == "1"


def in_order(rtnb_side: str, *peer_sides: str) -> list[str]:
    """The sides of one round in the order ``run.py`` asked for."""
    return [*peer_sides, rtnb_side] if peer_first() else [rtnb_side, *peer_sides]


def emit(peer_failed: dict[str, str] | None = None, **figures: float | None) -> None:
    """This round's figures, on the one line ``run.py`` reads. ``peer_failed`` names
    the figures whose peer failed this round (a timeout, an error, a retry), each with
    why: ``run.py`` counts those rounds as the peer's failures, never as its time."""
    line = {**figures, **({"peer_failed": peer_failed} if peer_failed else {})}
    print("FIGURES " + json.dumps(line), flush=True)
