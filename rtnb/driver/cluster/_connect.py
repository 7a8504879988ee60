"""Connecting the driver to Ray: embedded local Ray, ``auto``, HOST:PORT or ray://.

Every failure here becomes one :class:`~rtnb.errors.ClusterError` line; an address
that does not answer is detected with a plain TCP probe first, because
``ray.init`` on a dead address can retry for minutes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rtnb.core._net import probe_tcp
from rtnb.core._redact import redact_uri
from rtnb.driver.cluster._auth import (
    as_the_environment_says,
    joining_with,
    set_environment,
    users_token,
)
from rtnb.driver.cluster._embedded import LOOPBACK, start_embedded_ray
from rtnb.driver.cluster._outside import (
    CLIENT_PORT,
    look_at_cluster,
    machine_name,
    resolve,
    start_own_node,
)
from rtnb.driver.cluster._ray_output import quiet_rank_machinery
from rtnb.driver.cluster._versions import ray_mismatch_line
from rtnb.errors import ClusterError, ConfigError, one_line

if TYPE_CHECKING:
    from rtnb.driver.cluster._warm_client import WarmRay

__all__ = ["ClusterConnection", "RayWatch", "connect", "will_embed"]

# Ray's driver ends its own process when its GCS has not answered for this many
# seconds (60 by default): in a notebook that is the kernel, with the user's state.
_RECONNECT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"
# A week: rtnb notices a lost Ray in about a second and lets go of the driver then
# (ray.shutdown), so this only has to outlast that. Ray keeps it in 32 bits of ms.
_RECONNECT_S = 7 * 24 * 3600
# Set (to anything): rtnb lifts the rule for its own driver even where the environment
# sets Ray's timeout, which then stands for Ray's default (the tests shorten Ray's rule
# so, and the lift shows in seconds instead of a minute).
_LIFT_OVER_ENV = "RTNB_LIFT_RAY_RULE_OVER_ENV"
# How often the watch knocks on the GCS's port, and for how long it must stay shut.
_WATCH_S = 0.5
# How long a join waits for a node of the cluster starting on this machine to
# register with its GCS before taking this machine for one outside it.
_REGISTERING_S = 30.0
_LOST_AFTER_S = 1.0

# A driver whose Ray died is shut down in the background (ray.shutdown takes ~5 s
# then); the next connect waits for it.
_letting_go: threading.Thread | None = None
_auto_connect_before: bool | None = None


class RayWatch:
    """Notices, within about 1.5 s, that the Ray this process drives is gone (its
    GCS no longer accepts connections), and says so once to each subscriber.

    A TCP knock, not a Ray call: every Ray call to a dead GCS waits on Ray's
    reconnect timeout."""

    def __init__(self, host: str, port: int, what: str) -> None:
        self.host, self.port, self.what = host, port, what
        self.lost: str | None = None
        self._subscribers: list[Callable[[str], None]] = []
        self._closed = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="rtnb-ray-watch", daemon=True).start()

    def subscribe(self, callback: Callable[[str], None]) -> None:
        with self._lock:
            if self.lost is None:
                self._subscribers.append(callback)
                return
        callback(self.lost)

    def unsubscribe(self, callback: Callable[[str], None]) -> None:
        with self._lock:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

    def answers(self, timeout_s: float = 1.0) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=timeout_s):
                return True
        except OSError:
            return False

    def check_now(self, settle_s: float = 0.0) -> str | None:
        """Before something that would wait on the GCS (a rebuild): is Ray gone?

        ``settle_s``: after a Ray call failed, also wait that long for a GCS that
        still answers to close (a Ray shutting down fails calls first)."""
        if self.lost is None and not self.answers() and not self.answers():
            self._declare_lost()
        deadline = time.monotonic() + settle_s
        shut_since: float | None = None
        while self.lost is None and time.monotonic() < deadline:
            if self.answers(timeout_s=0.2):
                shut_since = None
            else:
                shut_since = shut_since or time.monotonic()
                if time.monotonic() - shut_since >= _LOST_AFTER_S:
                    self._declare_lost()
            time.sleep(_WATCH_S / 5)
        return self.lost

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        shut_since: float | None = None
        while not self._closed.wait(_WATCH_S) and self.lost is None:
            if self.answers():
                shut_since = None
                continue
            now = time.monotonic()
            shut_since = shut_since or now
            if now - shut_since >= _LOST_AFTER_S:
                self._declare_lost()

    def _declare_lost(self) -> None:
        with self._lock:
            if self.lost is not None:
                return
            self.lost = f"{self.what} is gone (nothing answers at {self.host}:{self.port})"
            subscribers, self._subscribers = self._subscribers, []
        self._closed.set()
        _let_go_of_the_driver()
        for callback in subscribers:
            with contextlib.suppress(Exception):
                callback(self.lost)


def _let_go_of_the_driver() -> None:
    """Shut this process's Ray driver down in the background, so that a new
    ``%rtnb start`` can ``ray.init`` again; nothing else calls Ray meanwhile.

    Until that start, a Ray call in this process does not start a Ray of its own:
    Ray's API calls ``ray.init()`` when no driver is connected, so a cell loop's
    ``ray.wait`` landing just after the shutdown started a whole local Ray (tens
    of seconds on 2 cores) instead of failing."""
    global _letting_go
    from ray._private import auto_init_hook

    global _auto_connect_before
    if _auto_connect_before is None:
        _auto_connect_before = auto_init_hook.enable_auto_connect
    auto_init_hook.enable_auto_connect = False

    def let_go() -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.shutdown()
        as_the_environment_says()

    _letting_go = threading.Thread(target=let_go, name="rtnb-ray-let-go", daemon=True)
    _letting_go.start()


def _after_letting_go() -> None:
    """Before rtnb's own ``ray.init``: the lost driver is gone, and Ray's automatic
    ``ray.init`` is as it was."""
    global _auto_connect_before
    if _letting_go is not None:
        _letting_go.join(60)
    if _auto_connect_before is not None:
        from ray._private import auto_init_hook

        auto_init_hook.enable_auto_connect = _auto_connect_before
        _auto_connect_before = None


@contextlib.contextmanager
def _driver_outlives_its_ray() -> Iterator[None]:
    """Around ``ray.init`` in the kernel: its driver does not end the process when
    the GCS goes away; the Ray processes ``ray.init`` starts (an embedded Ray's GCS
    and raylet, and through them its workers) keep Ray's own timeout, so they
    still end when their GCS is gone."""
    if _users_own_rule():
        yield
        return
    rays_own = os.environ.get(_RECONNECT_ENV)
    from ray._private import services

    original = services.start_ray_process

    def start_ray_process(*args, **kwargs):
        set_environment({_RECONNECT_ENV: rays_own})
        try:
            return original(*args, **kwargs)
        finally:
            os.environ[_RECONNECT_ENV] = str(_RECONNECT_S)

    os.environ[_RECONNECT_ENV] = str(_RECONNECT_S)
    services.start_ray_process = start_ray_process
    try:
        yield
    finally:
        set_environment({_RECONNECT_ENV: rays_own})
        services.start_ray_process = original


def _users_own_rule() -> bool:
    """The environment sets Ray's timeout and rtnb is not told to lift it anyway."""
    return _RECONNECT_ENV in os.environ and _LIFT_OVER_ENV not in os.environ


@dataclass
class ClusterConnection:
    """The Ray connection a session uses; ``owned`` when this session started Ray."""

    address: str
    owned: bool
    client_mode: bool
    # Set when this is the per-user warm Ray (rtnb.driver.cluster._warm_client): stopping detaches.
    warm: WarmRay | None = None
    # False when the kernel's Ray driver came from the user's own ray.init() with
    # Ray's settings: the lost-Ray line says that connection closed too.
    driver_outlives_ray: bool = True
    watch: RayWatch | None = field(default=None, repr=False)
    # Counted in _JOINED.open while open: a Ray rtnb joined is left for another
    # address only when no connection to it is open.
    joined: bool = field(default=False, repr=False)
    # How a machine that is not one of the cluster's nodes joined it (the start line
    # says so); None: this machine is a node, or the Ray is local.
    joined_as: str | None = None

    @property
    def lost(self) -> str | None:
        """Why this Ray is gone, once it is (then no Ray call may be made)."""
        return self.watch.lost if self.watch is not None else None

    def check_lost(self, settle_s: float = 0.0) -> str | None:
        return self.watch.check_now(settle_s) if self.watch is not None else None

    def shutdown(self) -> None:
        import ray

        if self.joined:
            self.joined = False
            _JOINED.open -= 1
        if self.watch is not None:
            self.watch.close()
            if self.watch.lost is not None:
                if self.warm is not None:
                    self.warm.forget()
                return  # the driver is being let go of already
        if self.warm is not None:
            self.warm.detach()
        if self.owned and ray.is_initialized():
            ray.shutdown()
            as_the_environment_says()


@dataclass
class _JoinedRay:
    """The cluster address rtnb joined this process's Ray driver with (None: the
    driver is the user's own ``ray.init()``, or an embedded or warm Ray), and how many
    connections to it are open."""

    target: str | None = None
    gcs: str | None = None  # the GCS it reached: a later ray.init() elsewhere is not rtnb's
    open: int = 0
    joined_as: str | None = None  # ClusterConnection.joined_as of that join


_JOINED = _JoinedRay()


def _opened(connection: ClusterConnection) -> ClusterConnection:
    connection.joined = True
    _JOINED.open += 1
    return connection


def _same_cluster(target: str, gcs_address: str) -> bool:
    """Whether ``target`` (an --address) names the Ray this process is joined to."""
    if target == "auto" or target == _JOINED.target:
        return True
    if target.startswith("ray://"):
        return False  # a Ray Client address is never a GCS's: only the same text is
    try:
        host, port = _split_host_port(target.split("://", 1)[-1])
        gcs_host, gcs_port = _split_host_port(gcs_address)
        return port == gcs_port and socket.gethostbyname(host) == socket.gethostbyname(gcs_host)
    except (ValueError, OSError):
        return False


def _leave_for(ray, address: str) -> None:
    """``%rtnb start --address`` naming another cluster than the one this process is
    joined to: leave the old one when rtnb joined it and nothing uses it (a failed
    or stopped start's), else say why not in one line."""
    current = ray.get_runtime_context().gcs_address
    if _JOINED.gcs != current:
        _JOINED.target = None  # the user's own driver since rtnb's join
    if _JOINED.target is None or _JOINED.open > 0:
        whose = "ray.init()" if _JOINED.target is None else "a group of this kernel"
        raise ClusterError(
            f"this kernel is already connected to the Ray at {current} ({whose}); "
            f"--address {redact_uri(address)} names another: "
            + (
                "call ray.shutdown() first, or drop --address to use that Ray"
                if _JOINED.target is None
                else "`%rtnb stop` the group first, or drop --address"
            )
        )
    ray.shutdown()
    as_the_environment_says()
    _JOINED.target = None


def _watch(connection: ClusterConnection, what: str) -> ClusterConnection:
    """Start watching the Ray just joined (its GCS, or the client server)."""
    import ray

    try:
        if connection.client_mode:
            bare = connection.address.split("://", 1)[-1]
        else:
            bare = ray.get_runtime_context().gcs_address
        host, port = _split_host_port(bare)
    except Exception:  # noqa: BLE001 - not knowing where to knock: no watch
        return connection
    connection.watch = RayWatch(host, port, what)
    return connection


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
    outlive_kernel: bool = False,
) -> ClusterConnection:
    """Join (or start) the Ray cluster for ``address`` and return the connection.

    With ``address=None`` an already-initialised Ray in this process is reused; else
    ``RAY_ADDRESS`` is honoured as Ray does; else a local Ray is embedded, listening
    on ``listen`` (default 127.0.0.1: nothing it opens is reachable from the network),
    or, in a notebook kernel, the per-user warm Ray is joined (:mod:`rtnb.driver.cluster._warm_client`)
    when it has ``need_cpus`` free (a new one keeps ``ranks`` spare ranks);
    ``progress`` hears which of these happens. ``outlive_kernel`` (a detached
    group): the warm Ray wherever one would embed, scripts and ``rtnb run`` too.
    """
    target = address or os.environ.get("RAY_ADDRESS") or None
    _after_letting_go()
    import ray

    _quiet_ray_logging()
    quiet_rank_machinery()
    if ray.is_initialized() and address and not _in_client_mode():
        if not _same_cluster(address, ray.get_runtime_context().gcs_address):
            _leave_for(ray, address)
    if ray.is_initialized():
        return _watch(
            _opened(
                ClusterConnection(
                    address=address or "existing",
                    owned=False,
                    client_mode=_in_client_mode(),
                    driver_outlives_ray=_users_own_rule(),
                    joined_as=_JOINED.joined_as if _JOINED.target is not None else None,
                )
            ),
            "the Ray this process uses",
        )
    if target is None:
        with _driver_outlives_its_ray():
            connection = _embed(ray, num_cpus, listen, need_cpus, ranks, progress, outlive_kernel)
        what = "the warm Ray" if connection.warm is not None else "the embedded Ray"
        return _watch(connection, what)
    kwargs: dict = {"log_to_driver": False, "logging_level": logging.ERROR}
    if target != "auto":
        bare = target[len("ray://") :] if target.startswith("ray://") else target
        bare = bare.split("://", 1)[-1]
        host, port = _split_host_port(bare)
        probe_tcp(host, port, min(timeout_s, 5.0))
    gcs = None  # the GCS asked whether it wants a token (Ray Client's server is not one)
    joined_as = None
    if target and target.startswith("ray://"):
        kwargs.pop("log_to_driver")
    elif target != "auto":
        gcs = f"{host}:{port}"
        target, joined_as = _join_from_here(host, port, kwargs, progress)
        if target.startswith("ray://"):
            gcs = None
            kwargs.pop("log_to_driver", None)
    try:
        with _driver_outlives_its_ray(), joining_with(users_token(gcs)):
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
        mismatch = ray_mismatch_line(str(exc))
        if mismatch is not None:
            raise ClusterError(mismatch) from None
        raise ClusterError(f"could not join Ray ({target}): {one_line(exc)}") from None
    _quiet_ray_logging()
    client_mode = _in_client_mode()
    if client_mode:
        _mute_client_log_stream()
    _JOINED.target, _JOINED.joined_as = target, joined_as
    with contextlib.suppress(Exception):  # a Ray Client driver has no GCS address here
        _JOINED.gcs = ray.get_runtime_context().gcs_address
    return _watch(
        _opened(
            ClusterConnection(
                address=target, owned=False, client_mode=client_mode, joined_as=joined_as
            )
        ),
        f"the Ray at {redact_uri(target)}",
    )


def _join_from_here(
    host: str,
    port: int,
    kwargs: dict,
    progress: Callable[[str], None] | None,
) -> tuple[str, str | None]:
    """Before ``ray.init`` on a GCS address: where this machine is not one of the
    cluster's nodes, join it as a node that takes no work (``_outside``'s docstring
    says why), else its Ray Client port; the address to init with, and how this
    machine joined (None: it is a node already)."""
    host = resolve(host)  # Ray's gRPC, like look_at_cluster's, may not read /etc/hosts
    gcs = f"{host}:{port}"
    with joining_with(users_token(gcs)):
        view = look_at_cluster(host, port)
        # A node of this GCS starting on this machine (`ray start` just returned), or
        # a GCS with no node yet (its head's raylet still starting): this machine may
        # be one of its nodes once they register, not an outsider.
        deadline = time.monotonic() + _REGISTERING_S
        while (
            view.node_here() is None
            and (view.registering or not view.nodes)
            and time.monotonic() < deadline
        ):
            time.sleep(0.2)
            view = look_at_cluster(host, port)
    if view.node_here() is not None:
        return gcs, None
    here = f"{machine_name()} ({view.this_machine})"
    if progress is not None:
        progress(f"{here} is not a node of the Ray at {gcs}: joining it as a node with no CPUs")
    try:
        start_own_node(host, port, view, env=users_token(gcs))
    except ClusterError as refused:
        client = f"{host}:{CLIENT_PORT}"
        try:
            probe_tcp(host, CLIENT_PORT, 3.0)
        except ClusterError:
            raise refused from None
        if progress is not None:
            progress(f"joining as a node failed; using the cluster's Ray Client at {client}")
        return f"ray://{client}", f"from {here} through the Ray Client at {client}"
    kwargs["_node_ip_address"] = view.this_machine
    return gcs, f"from {here}, a node with no CPUs"


def _embed(
    ray,
    num_cpus: int | None,
    listen: str | None,
    need_cpus: float,
    ranks: int,
    progress: Callable[[str], None] | None,
    outlive_kernel: bool = False,
) -> ClusterConnection:
    """The kernel's warm Ray when it is wanted and has room (about a second), else a
    Ray embedded in this process."""
    from rtnb.driver.cluster import _warm_client as _warm

    if _warm.warm_ray_wanted(listen) or (
        outlive_kernel and listen in (None, LOOPBACK) and not _warm.switched_off()
    ):
        attached = _warm.attach(need_cpus, ranks, progress)
        if attached is not None:
            _quiet_ray_logging()
            return ClusterConnection(
                address=f"{attached.address} (the warm Ray)",
                owned=True,
                client_mode=False,
                warm=attached,
            )
    if outlive_kernel:
        # A Ray embedded here ends with this process: decided here, once, in one line.
        why = (
            "RTNB_WARM_RAY=0 switches the warm Ray off"
            if _warm.switched_off()
            else "the warm Ray takes no --listen address"
            if listen not in (None, LOOPBACK)
            else "the warm Ray has no room (another kernel holds its CPUs)"
        )
        raise ConfigError(
            f"--detached needs a Ray that outlives this kernel, and {why}: give a "
            "cluster's --address, or free the warm Ray"
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
    _after_letting_go()  # a driver whose Ray died is on its way out
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
