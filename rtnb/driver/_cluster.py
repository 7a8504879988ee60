"""Connecting the driver to Ray: embedded local Ray, ``auto``, HOST:PORT or ray://.

Every failure here becomes one :class:`~rtnb.errors.ClusterError` line; an address
that does not answer is detected with a plain TCP probe first, because
``ray.init`` on a dead address can retry for minutes.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rtnb.core._net import probe_tcp, use_auth_token_if_present
from rtnb.driver._embedded import start_embedded_ray
from rtnb.errors import ClusterError, one_line

if TYPE_CHECKING:
    from rtnb.driver._warm import WarmRay

__all__ = ["ClusterConnection", "connect", "will_embed"]


@dataclass
class ClusterConnection:
    """The Ray connection a session uses; ``owned`` when this session started Ray."""

    address: str
    owned: bool
    client_mode: bool
    # Set when this is the per-user warm Ray (rtnb.driver._warm): stopping detaches.
    warm: WarmRay | None = None

    def shutdown(self) -> None:
        import ray

        if self.warm is not None:
            self.warm.detach()
        if self.owned and ray.is_initialized():
            ray.shutdown()


def _quiet_ray_logging() -> None:
    # Ray logs several INFO lines and auth-token warnings on every connect; in a
    # notebook those land in the user's cell output.
    for name in ("ray", "ray._private.worker", "ray.util.client", "ray._private.auth"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"ray(\..*)?")


def _split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def connect(
    address: str | None,
    timeout_s: float = 15.0,
    num_cpus: int | None = None,
    listen: str | None = None,
    need_cpus: float = 0.0,
    ranks: int = 2,
    progress: Callable[[str], None] | None = None,
) -> ClusterConnection:
    """Join (or start) the Ray cluster for ``address`` and return the connection.

    With ``address=None`` an already-initialised Ray in this process is reused; else
    ``RAY_ADDRESS`` is honoured as Ray does; else a local Ray is embedded, listening
    on ``listen`` (default 127.0.0.1: nothing it opens is reachable from the network),
    or, in a notebook kernel, the per-user warm Ray is joined (:mod:`rtnb.driver._warm`)
    when it has ``need_cpus`` free (a new one keeps ``ranks`` spare ranks);
    ``progress`` hears which of these happens.
    """
    target = address or os.environ.get("RAY_ADDRESS") or None
    if target is not None:
        # Before `import ray`: Ray reads RAY_AUTH_MODE when it is first imported.
        use_auth_token_if_present()
    import ray

    _quiet_ray_logging()
    if ray.is_initialized():
        return ClusterConnection(
            address=address or "existing", owned=False, client_mode=_in_client_mode()
        )
    if target is None:
        return _embed(ray, num_cpus, listen, need_cpus, ranks, progress)
    kwargs: dict = {"log_to_driver": False, "logging_level": logging.ERROR}
    if target != "auto":
        bare = target[len("ray://") :] if target.startswith("ray://") else target
        bare = bare.split("://", 1)[-1]
        host, port = _split_host_port(bare)
        probe_tcp(host, port, min(timeout_s, 5.0))
    if target and target.startswith("ray://"):
        kwargs.pop("log_to_driver")
    try:
        _init_with_retry(ray, target, kwargs, timeout_s)
    except ConnectionError as exc:
        raise ClusterError(
            f"could not connect to Ray at {target!r}: {one_line(exc)}. "
            + (
                "No local cluster was found: start one with `ray start --head` or omit --address."
                if target == "auto"
                else "Is `ray start --head` running there?"
            )
        ) from None
    except Exception as exc:  # noqa: BLE001 - Ray raises many types here
        raise ClusterError(f"could not join Ray ({target}): {one_line(exc)}") from None
    _quiet_ray_logging()
    client_mode = _in_client_mode()
    if client_mode:
        _mute_client_log_stream()
    return ClusterConnection(address=target, owned=False, client_mode=client_mode)


def _embed(
    ray,
    num_cpus: int | None,
    listen: str | None,
    need_cpus: float,
    ranks: int,
    progress: Callable[[str], None] | None,
) -> ClusterConnection:
    """The kernel's warm Ray when it is wanted and has room (about a second), else a
    Ray embedded in this process."""
    from rtnb.driver import _warm

    if _warm.wanted(listen):
        attached = _warm.attach(need_cpus, ranks, progress)
        if attached is not None:
            _quiet_ray_logging()
            return ClusterConnection(
                address=f"{attached.address} (the warm Ray)", owned=True, client_mode=False, warm=attached
            )
    try:
        start_embedded_ray(ray, num_cpus=num_cpus, listen=listen)
    except Exception as exc:  # noqa: BLE001 - Ray raises many types here
        raise ClusterError(f"could not start an embedded Ray: {one_line(exc)}") from None
    _quiet_ray_logging()
    return ClusterConnection(address="embedded", owned=True, client_mode=False)


def will_embed(address: str | None) -> bool:
    """Whether connecting to ``address`` starts an embedded Ray in this process."""
    if address is not None or os.environ.get("RAY_ADDRESS"):
        return False
    ray = sys.modules.get("ray")
    return not (ray is not None and ray.is_initialized())


def _mute_client_log_stream() -> None:
    # Ray Client streams every worker's and raylet's stdout to the driver (there is
    # no log_to_driver switch in client mode); rtnb collects the ranks' output
    # itself, so the stream is only noise in the cell (e.g. disk-space warnings).
    try:
        from ray.util.client import ray as client_ray

        client_ray.worker.log_client.stdstream = lambda level, msg: None
    except Exception:  # noqa: BLE001 - private API; worst case the chatter stays
        pass


def _init_with_retry(ray, target: str | None, kwargs: dict, timeout_s: float) -> None:
    # A Ray Client server spawns one "specific server" per connection, and on a
    # head that has run for a while that spawn can die at birth ("Initialization
    # failure from server"; ray-project/ray#63202, a fork race in Ray's proxy) and
    # succeed on the next try. Ray's proxy only reports the death after its 30 s
    # channel timeout plus ~10 s of log-stream retries, so allow three tries.
    deadline = time.monotonic() + max(timeout_s, 130.0)
    while True:
        try:
            ray.init(address=target, **kwargs)
            return
        except ConnectionError as exc:
            transient = "Initialization failure" in str(exc)
            if not (target or "").startswith("ray://") or not transient:
                raise
            if time.monotonic() > deadline:
                raise ConnectionError(
                    "Ray's client server could not start a session for this kernel "
                    "(ray-project/ray#63202); connect with HOST:PORT (the GCS address) "
                    "instead of ray://, or restart the head's client server"
                ) from None
            try:
                ray.shutdown()
            except Exception:  # noqa: BLE001
                pass
            time.sleep(1.0)


def _in_client_mode() -> bool:
    try:
        from ray.util.client import ray as client_ray

        return client_ray.is_connected()
    except Exception:  # noqa: BLE001
        return False
