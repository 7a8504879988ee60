"""Reaching a Ray cluster from any process: a TCP probe, the auth-token opt-in, and
this machine's own addresses.

Used by the driver's connection, by ``rtnb submit``/``jobs``/``logs``, and by the
ranks (the interface their collectives bind).
"""

from __future__ import annotations

import os
import socket

from rtnb.errors import ClusterError

__all__ = ["local_addresses", "probe_tcp", "use_auth_token_if_present"]


def probe_tcp(host: str, port: int, timeout: float) -> None:
    """Raise one ClusterError line unless ``host:port`` accepts a TCP connection:
    ``ray.init`` on a dead address can retry for minutes."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        raise ClusterError(
            f"cannot reach a Ray cluster at {host}:{port} ({exc.strerror or exc}). "
            "Check the address, that `ray start --head` is running there, and the port "
            "(6379 for HOST:PORT, 10001 for ray://)"
        ) from None


def use_auth_token_if_present() -> None:
    # Ray 2.5x+ clusters enable token auth by default and write the token to
    # ~/.ray/auth_token, but a client only sends it when RAY_AUTH_MODE=token; without
    # it ray.init retries forever logging "InvalidAuthToken". For the HTTP calls of
    # this process (Ray Jobs) a token sent to a dashboard without auth is ignored, so
    # opt in whenever a token is available. (Not for a driver joining a GCS: there a
    # cluster without auth refuses the actors of a driver in token mode; rtnb asks the
    # GCS first, rtnb.driver.cluster._auth.users_token.)
    if os.environ.get("RAY_AUTH_MODE"):
        return
    token_file = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.exists(token_file):
        os.environ["RAY_AUTH_MODE"] = "token"


def local_addresses() -> dict[str, str]:
    """This machine's IPv4 and IPv6 addresses, each with the interface holding it
    (empty without psutil, which Ray installs)."""
    try:
        import psutil

        return {
            a.address.split("%", 1)[0]: name
            for name, found in psutil.net_if_addrs().items()
            for a in found
            if a.family in (socket.AF_INET, socket.AF_INET6)
        }
    except Exception:  # noqa: BLE001 - no psutil: no addresses known
        return {}
