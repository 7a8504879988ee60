"""Connecting the driver to Ray: embedded local Ray, ``auto``, HOST:PORT or ray://.

Every failure here becomes one :class:`~rtnb.errors.ClusterError` line; an address
that does not answer is detected with a plain TCP probe first, because
``ray.init`` on a dead address can retry for minutes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

from rtnb.core._net import probe_tcp, use_auth_token_if_present
from rtnb.core._startup import lazy_imports_for_children
from rtnb.errors import ClusterError, one_line

__all__ = ["ClusterConnection", "connect"]

# An embedded Ray takes 30% of RAM for its object store by default; a notebook
# sharing the machine with the user's other work should not.
_EMBEDDED_OBJECT_STORE_BYTES = 2 * 1024**3


@dataclass
class ClusterConnection:
    """The Ray connection a session uses; ``owned`` when this session started Ray."""

    address: str
    owned: bool
    client_mode: bool

    def shutdown(self) -> None:
        import ray

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
) -> ClusterConnection:
    """Join (or start) the Ray cluster for ``address`` and return the connection.

    With ``address=None`` an already-initialised Ray in this process is reused; else
    ``RAY_ADDRESS`` is honoured as Ray does; else a local Ray is embedded, listening
    on ``listen`` (default 127.0.0.1: nothing it opens is reachable from the network).
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
    kwargs: dict = {"log_to_driver": False, "logging_level": logging.ERROR}
    owned = target is None
    if target is None:
        kwargs.update(
            include_dashboard=False,
            object_store_memory=_EMBEDDED_OBJECT_STORE_BYTES,
            num_cpus=num_cpus,
        )
        if (listen or LOOPBACK) not in ("0.0.0.0", "::"):
            # 0.0.0.0: Ray's own default (the node's address, every interface).
            kwargs["_node_ip_address"] = listen or LOOPBACK
    if target is not None and target != "auto":
        bare = target[len("ray://") :] if target.startswith("ray://") else target
        bare = bare.split("://", 1)[-1]
        host, port = _split_host_port(bare)
        probe_tcp(host, port, min(timeout_s, 5.0))
    if target and target.startswith("ray://"):
        kwargs.pop("log_to_driver")
    try:
        with (
            _node_ip_as_given(target is None and (listen or LOOPBACK) == LOOPBACK),
            lazy_imports_for_children() if target is None else contextlib.nullcontext(),
            _lean_embedded_ray() if target is None else contextlib.nullcontext(),
        ):
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
        raise ClusterError(
            f"could not start or join Ray ({target or 'embedded'}): {one_line(exc)}"
        ) from None
    _quiet_ray_logging()
    client_mode = _in_client_mode()
    if client_mode:
        _mute_client_log_stream()
    return ClusterConnection(address=target or "embedded", owned=owned, client_mode=client_mode)


LOOPBACK = "127.0.0.1"


@contextlib.contextmanager
def _lean_embedded_ray() -> Iterator[None]:
    """Start only the Ray processes an embedded, one-kernel Ray uses.

    ``ray.init`` also starts, and waits ~2 s for, a dashboard process that only
    reports usage statistics when the dashboard is off; an autoscaler monitor (no
    nodes to add to a laptop); and a log monitor, which streams worker logs to the
    driver (rtnb starts Ray with ``log_to_driver=False`` and collects the ranks'
    output itself). Skipping them took ``ray.init`` from 6.9 s to 3.7 s here and
    leaves one process fewer listening. ``RTNB_FULL_EMBEDDED_RAY=1`` keeps them.
    Private Ray functions: each is only replaced if it exists, around this call.
    """
    if os.environ.get("RTNB_FULL_EMBEDDED_RAY", "") not in ("", "0"):
        yield
        return
    from ray._private import node, services

    replaced = []
    for owner, name, stand_in in (
        (services, "start_api_server", lambda *args, **kwargs: (None, None)),
        (node.Node, "start_monitor", lambda self: None),
        (node.Node, "start_log_monitor", lambda self: None),
    ):
        if callable(getattr(owner, name, None)):
            replaced.append((owner, name, getattr(owner, name)))
            setattr(owner, name, stand_in)
    try:
        yield
    finally:
        for owner, name, original in replaced:
            setattr(owner, name, original)


@contextlib.contextmanager
def _node_ip_as_given(loopback: bool) -> Iterator[None]:
    """Let an embedded Ray keep 127.0.0.1 as its node address.

    Ray 2.60 has no bind-address option: every component (GCS, raylet, object
    manager, agents, each worker's gRPC server) listens on loopback only when the
    node address is loopback, else on every interface. On Linux it replaces a
    loopback ``_node_ip_address`` with the default route's address unless its
    ``ENABLE_RAY_CLUSTER`` constant is off (as on macOS and Windows), which is read
    at call time; it is switched off only around this ``ray.init``.
    """
    if not loopback:
        yield
        return
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


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
