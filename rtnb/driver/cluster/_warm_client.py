"""The kernel's side of the per-user warm Ray (see :mod:`rtnb.driver.cluster._warm_host`).

A notebook kernel that would embed a Ray joins the user's warm Ray instead: a
loopback Ray started by the first kernel that wanted one, with spare rank
processes that have imported torch. Joining and claiming ranks takes about a
second where an embedded start takes eight on a 2-core machine.

When it is used: in a Jupyter kernel with no ``--address``/``RAY_ADDRESS``, on
loopback, without ``--gpu``, not under ``rtnb run``; ``RTNB_WARM_RAY=1`` forces
it on (scripts), ``0`` off. When it ends: ``RTNB_WARM_RAY_IDLE_S`` seconds
(default 600) after the last kernel using it stopped its session or died.
A warm Ray whose CPUs are taken by another kernel is left alone: this kernel
embeds its own Ray, as without the warm Ray.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtnb.core._net import probe_tcp
from rtnb.core._paths import rtnb_home
from rtnb.driver.cluster._auth import (
    TOKEN_MODE_ENV,
    TOKEN_PATH_ENV,
    as_the_environment_says,
    joining_with,
)
from rtnb.driver.cluster._embedded import LOOPBACK, joining_private_ray, node_ip_as_given, rank_cpus
from rtnb.errors import ClusterError, one_line
from rtnb.storage._rundir import BATCH_RUNS_ENV
from rtnb.worker._actor import RAY_OWNED_ENV

__all__ = [
    "WarmRay",
    "active_warm_ray",
    "attach",
    "ensure_running",
    "join_running_warm_ray",
    "warm_lease_in_host",
    "live_state",
    "state_dir",
    "switched_off",
    "warm_ray_wanted",
]

SWITCH_ENV = "RTNB_WARM_RAY"
IDLE_ENV = "RTNB_WARM_RAY_IDLE_S"
DEFAULT_IDLE_S = 600.0
_LAUNCH_TIMEOUT_S = 120.0

_active: WarmRay | None = None


def warm_ray_wanted(listen: str | None) -> bool:
    """Whether an embedded start in this process should join the warm Ray."""
    if listen not in (None, LOOPBACK):
        return False
    if os.environ.get(SWITCH_ENV, "").strip():
        return not switched_off()
    return "ipykernel" in sys.modules and not os.environ.get(BATCH_RUNS_ENV)


def idle_seconds() -> float:
    try:
        return float(os.environ.get(IDLE_ENV, DEFAULT_IDLE_S))
    except ValueError:
        return DEFAULT_IDLE_S


def state_dir() -> Path:
    return rtnb_home() / "warm-ray"


def _fingerprint() -> str:
    """One warm Ray per Python environment, Ray and rtnb code: ranks of another
    version would run other code than the kernel's. Read without importing Ray, so
    a Jupyter server can warm it (rtnb.jupyter_extension); a kernel started by that
    server has the server's ``sys.prefix``."""
    from importlib.metadata import version

    package = Path(__file__).resolve().parents[2]  # rtnb/: the ranks' code is all of it
    newest = max(
        (entry.stat().st_mtime_ns for entry in package.rglob("*.py")),
        default=0,
    )
    text = (
        f"{sys.prefix}|{sys.version_info[:2]}|{version('ray')}|{os.getuid()}|{package}|"
        f"{newest}|{os.cpu_count()}"
    )
    return hashlib.sha1(text.encode()).hexdigest()[:12]


@dataclass
class WarmRay:
    """This kernel's attachment to the warm Ray."""

    address: str
    launcher_pid: int
    pool: Any
    launched: bool

    def claim(self, count: int) -> list[Any]:
        import ray

        return ray.get(self.pool.claim.remote(os.getpid(), count), timeout=120)

    def forget(self) -> None:
        """This warm Ray is gone: the next start launches a new one."""
        global _active
        if _active is self:
            _active = None

    def detach(self) -> None:
        global _active
        import ray

        with contextlib.suppress(Exception):
            ray.get(self.pool.detach.remote(os.getpid()), timeout=5)
        if _active is self:
            _active = None


def warm_lease_in_host(pid: int, run: str) -> WarmRay | None:
    """In a detached group's host (a process of this Ray): when this Ray is the warm
    Ray, lease it for ``pid`` (the warm Ray does not end while the host lives, and a
    kernel's death takes none of the host's ranks) and claim its spare ranks for the
    host's session as a kernel would. None on any other Ray."""
    global _active
    import ray

    from rtnb.driver.cluster._warm_host import POOL_NAME, POOL_NAMESPACE

    try:
        pool = ray.get_actor(POOL_NAME, namespace=POOL_NAMESPACE)
        ray.get(pool.attach.remote(pid, run), timeout=30)
    except Exception:  # noqa: BLE001 - no warm pool in this Ray
        return None
    _active = WarmRay(ray.get_runtime_context().gcs_address, 0, pool, launched=False)
    return _active


def active_warm_ray() -> WarmRay | None:
    """The warm Ray this process is attached to, if any."""
    return _active


def warm_rank_env(extra: dict[str, str]) -> dict[str, str]:
    """What an adopted rank sets in its environment: the kernel's (as a rank of an
    embedded Ray inherits it) and the session's ``env``."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(RAY_OWNED_ENV)}
    return {**inherited, **extra}


def _token_file(directory: Path) -> Path:
    """The warm Ray's own auth token (0600), made on first use.

    Not ``~/.ray/auth_token``: a Ray started by ``ray.init`` writes that file when
    it is missing, and once it exists the user's own ``ray start --head`` turns
    token auth on, after which their ``ray status`` fails with InvalidAuthToken.
    The warm Ray keeps token auth (it runs code as this user) with a token of its
    own, which only its host, its processes and the kernels joining it read."""
    path = directory / "auth_token"
    if not path.exists():
        fd = os.open(path.with_suffix(f".{os.getpid()}.tmp"), os.O_WRONLY | os.O_CREAT, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32))
        os.replace(path.with_suffix(f".{os.getpid()}.tmp"), path)
    return path


def _private_token_env(token_file: Path) -> dict[str, str]:
    return {TOKEN_MODE_ENV: "token", TOKEN_PATH_ENV: str(token_file)}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def live_state(state_file: Path) -> dict[str, Any] | None:
    try:
        state = json.loads(state_file.read_text())
        os.kill(int(state["pid"]), 0)
        host, _, port = str(state["address"]).rpartition(":")
        probe_tcp(host, int(port), 1.0)
        return state
    except (OSError, ValueError, KeyError, ClusterError):
        return None


def _launch(state_file: Path, key: str, spares: int, first_kernel: int | None) -> dict[str, Any]:
    log_path = state_file.with_suffix(".log")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env.update(_private_token_env(_token_file(state_file.parent)))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rtnb.driver.cluster._warm_host",
                "--state",
                str(state_file),
                "--key",
                key,
                "--spares",
                str(spares),
                "--idle-s",
                str(idle_seconds()),
                *(["--first-kernel", str(first_kernel)] if first_kernel is not None else []),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=state_file.parent,
            env=env,
        )
    deadline = time.monotonic() + _LAUNCH_TIMEOUT_S
    while time.monotonic() < deadline:
        state = live_state(state_file)
        if state is not None and state.get("pid") == proc.pid:
            return state
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise ClusterError(f"the warm Ray did not start: {tail[0][:300]} (log: {log_path})")
        time.sleep(0.05)
    proc.kill()
    raise ClusterError(
        f"the warm Ray did not start within {_LAUNCH_TIMEOUT_S:.0f} s (log: {log_path})"
    )


def switched_off() -> bool:
    """``RTNB_WARM_RAY=0`` (or false/no/off): no kernel joins a warm Ray and no
    Jupyter server starts one."""
    return os.environ.get(SWITCH_ENV, "").strip().lower() in ("0", "false", "no", "off")


def ensure_running(
    spares: int = 2,
    progress: Callable[[str], None] | None = None,
    first_kernel: int | None = None,
) -> tuple[dict[str, Any], bool]:
    """The live warm Ray's state (address, pid, temp dir), started if none runs, and
    whether this call started it. Imports no Ray: the warm Ray is a process of its
    own. A second caller waits for the first's start (a file lock) and joins it.
    ``first_kernel``: the kernel that will join what this call starts (it holds the
    Ray until it attaches); none for a Jupyter server warming it for kernels to come."""
    say = progress or (lambda text: None)
    directory = state_dir()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = _fingerprint()
    state_file = directory / f"{key}.json"
    with _locked(directory / f"{key}.lock"):
        state = live_state(state_file)
        if state is not None:
            return state, False
        idle = idle_seconds()
        after = f"{idle / 60:.0f} min" if idle >= 120 else f"{idle:.0f} s"
        say(
            "starting the warm Ray (later kernels join it in about a second; it ends "
            f"{after} after the last kernel leaves)"
        )
        return _launch(state_file, key, spares, first_kernel), True


def _join(state: dict[str, Any]) -> None:
    import ray

    with (
        joining_with(_private_token_env(_token_file(state_dir()))),
        node_ip_as_given(True),
        joining_private_ray(),
    ):
        ray.init(
            address=state["address"],
            _node_ip_address=LOOPBACK,
            _temp_dir=state.get("temp_dir"),
            log_to_driver=False,
            logging_level=logging.ERROR,
        )


def join_running_warm_ray() -> str | None:
    """Join this environment's warm Ray if one runs (starting none): its address, or
    None. For looking at detached groups from a terminal or another kernel."""
    state = live_state(state_dir() / f"{_fingerprint()}.json")
    if state is None:
        return None
    try:
        _join(state)
    except Exception as exc:  # noqa: BLE001 - Ray raises many types here
        raise ClusterError(f"could not join the warm Ray: {one_line(exc)}") from None
    return str(state["address"])


def _import_ray_beside() -> threading.Thread | None:
    """``import ray`` (~0.5 s of CPU) in a thread while this kernel finds or launches
    the warm Ray, which is mostly waiting on another process: on a machine of two
    cores the two overlap. Join the thread before using Ray (a failed import
    shows again, as ever, at the ``import ray`` that follows)."""
    if "ray" in sys.modules:
        return None

    def load() -> None:
        with contextlib.suppress(BaseException):
            import ray  # noqa: F401

    thread = threading.Thread(target=load, name="rtnb-import-ray", daemon=True)
    thread.start()
    return thread


def attach(
    need_cpus: float, spares: int, progress: Callable[[str], None] | None = None
) -> WarmRay | None:
    """Join (starting it if needed) the warm Ray; None when it has fewer than
    ``need_cpus`` CPUs free, so the caller embeds a Ray of its own."""
    global _active
    say = progress or (lambda text: None)
    importing = _import_ray_beside()
    state, launched = ensure_running(spares, say, first_kernel=os.getpid())
    say(f"joining the warm Ray at {state['address']}")
    if importing is not None:
        importing.join()
    import ray

    try:
        _join(state)
        from rtnb.driver.cluster._warm_host import POOL_NAME, POOL_NAMESPACE

        pool = ray.get_actor(POOL_NAME, namespace=POOL_NAMESPACE)
        free = rank_cpus(ray.available_resources(), ray.cluster_resources())
        if free + 1e-9 < need_cpus:
            # Not this kernel's Ray after all: a lease it held from the launch goes.
            with contextlib.suppress(Exception):
                ray.get(pool.detach.remote(os.getpid()), timeout=5)
            ray.shutdown()
            as_the_environment_says()
            say(
                f"the warm Ray has {free:g} of {need_cpus:g} CPUs free (another kernel "
                "holds them): starting an embedded Ray for this kernel"
            )
            return None
        ray.get(pool.attach.remote(os.getpid()), timeout=30)
    except Exception as exc:  # noqa: BLE001 - a broken warm Ray must not block the start
        with contextlib.suppress(Exception):
            ray.shutdown()
        as_the_environment_says()
        say(f"the warm Ray did not answer ({one_line(exc)}): starting an embedded Ray")
        return None
    _active = WarmRay(state["address"], int(state["pid"]), pool, launched)
    return _active
