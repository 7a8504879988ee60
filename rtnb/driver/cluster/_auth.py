"""Which auth token this process's ``ray.init`` sends, for that one join.

Ray reads its auth mode and token once per process (its config and token loader
keep them for the life of the driver, from the first ``import ray``), so setting
``RAY_AUTH_MODE`` after a notebook imported Ray changes nothing: a join to a
token-auth cluster then retries for ever logging ``InvalidAuthToken``. Here the
environment is set around the join and Ray's cached copies are read again; the
environment is put back afterwards, so a ``!ray status`` from the notebook, or
the user's own Ray later, sees what it would without rtnb.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

__all__ = [
    "TOKEN_MODE_ENV",
    "TOKEN_PATH_ENV",
    "as_the_environment_says",
    "gcs_wants_token",
    "joining_with",
    "set_environment",
    "users_token",
]

TOKEN_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"


def users_token(gcs_address: str | None = None) -> dict[str, str]:
    """The environment that sends the user's own token (Ray 2.5x+ clusters turn
    token auth on and write ~/.ray/auth_token, but a driver only sends it with
    RAY_AUTH_MODE=token; without it the join retries for ever). Not for a cluster
    that runs without auth (``gcs_address`` asked first, when given): a driver in
    token mode there has every actor it creates refused ("The actor died
    unexpectedly"), since the cluster calls it back without a token. A mode the user
    set is theirs."""
    if os.environ.get(TOKEN_MODE_ENV):
        return {}
    token_file = os.environ.get(TOKEN_PATH_ENV) or os.path.expanduser("~/.ray/auth_token")
    if not (os.environ.get("RAY_AUTH_TOKEN") or os.path.exists(token_file)):
        return {}
    if gcs_address is not None and gcs_wants_token(gcs_address) is False:
        return {}
    return {TOKEN_MODE_ENV: "token"}


def gcs_wants_token(gcs_address: str, timeout_s: float = 5.0) -> bool | None:
    """Whether the GCS at ``gcs_address`` (HOST:PORT) refuses a call without a token:
    one unauthenticated call; None when that cannot be told (an older Ray, no answer)."""
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:
        return None
    try:
        with grpc.insecure_channel(gcs_address) as channel:
            stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
        return False
    except grpc.RpcError as exc:
        return True if exc.code() == grpc.StatusCode.UNAUTHENTICATED else None
    except Exception:  # noqa: BLE001 - a Ray without that call: as before
        return None


@contextlib.contextmanager
def joining_with(env: dict[str, str]) -> Iterator[None]:
    """Around one ``ray.init``: Ray's auth settings as ``env`` says (they stay
    so for this driver; :func:`as_the_environment_says` once it is shut down)."""
    if not env:
        yield
        return
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    _reload()
    try:
        yield
    except BaseException:
        set_environment(saved)
        _reload()
        raise
    set_environment(saved)


def as_the_environment_says() -> None:
    """After rtnb shut its driver down: Ray's auth settings read again from the
    environment. Otherwise the next Ray this process starts or joins (an embedded
    one, or the user's own ``ray.init``) would send the last join's token, and a
    Ray it starts would not accept its own driver ("Failed to start GCS")."""
    if "ray" in sys.modules:
        with contextlib.suppress(Exception):  # a Ray without these hooks
            _reload()


def _reload() -> None:
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:  # a Ray before token auth (2.4x): nothing is cached to read again
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def set_environment(values: dict[str, str | None]) -> None:
    """Each name set to its value in this process's environment; None: removed."""
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
