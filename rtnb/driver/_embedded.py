"""Starting a Ray inside this process: on loopback, lean, with a capped object store.

Used by an embedded session and by the warm Ray's host process; joining such a
Ray on loopback needs :func:`node_ip_as_given` too.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from rtnb.core._startup import lazy_imports_for_children

__all__ = ["LOOPBACK", "node_ip_as_given", "start_embedded_ray"]

LOOPBACK = "127.0.0.1"
# An embedded Ray takes 30% of RAM for its object store by default; a notebook
# sharing the machine with the user's other work should not.
_EMBEDDED_OBJECT_STORE_BYTES = 2 * 1024**3


def start_embedded_ray(
    ray, num_cpus: int | None, listen: str | None = None, namespace: str | None = None
) -> None:
    """``ray.init`` of a Ray in this process: loopback unless ``listen`` says
    otherwise, a capped object store, no dashboard, only the processes it uses."""
    kwargs: dict = {
        "log_to_driver": False,
        "logging_level": logging.ERROR,
        "include_dashboard": False,
        "object_store_memory": _EMBEDDED_OBJECT_STORE_BYTES,
        "num_cpus": num_cpus,
        "namespace": namespace,
    }
    if (listen or LOOPBACK) not in ("0.0.0.0", "::"):
        # 0.0.0.0: Ray's own default (the node's address, every interface).
        kwargs["_node_ip_address"] = listen or LOOPBACK
    with (
        node_ip_as_given((listen or LOOPBACK) == LOOPBACK),
        lazy_imports_for_children(),
        _lean_embedded_ray(),
    ):
        ray.init(**kwargs)


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
def node_ip_as_given(loopback: bool) -> Iterator[None]:
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
