"""Starting a Ray inside this process: on loopback, lean, with a capped object store.

Used by an embedded session and by the warm Ray's host process; joining such a
Ray on loopback needs :func:`node_ip_as_given` too.

Either kind leaves the fixed ports of a Ray the user starts (``ray start --head``:
6379, 8265, 10001, the dashboard agent's 52365) to that Ray. The warm Ray is also
kept out of every way Ray finds "the local cluster" (:func:`start_embedded_ray`'s
``private_dir``), because it outlives the kernel and is not the user's.

A Ray started here keeps one CPU for Ray Data beside the ranks (:data:`DATA_CPUS`).
It declares the machine's CPUs plus that one, and a resource of its own,
:data:`RANK_CPU`, as large as the machine's CPUs; the ranks' bundles ask for both
(:func:`rank_bundle`), so groups never take Data's CPU while a pipeline's read and
map tasks (one CPU each by default) always find it. Without it, two ranks on a
2-core laptop hold every CPU Ray counts and a Data pipeline handed to them waits
for ever (Ray Train's ``TorchTrainer(datasets=...)`` waits the same way there).
The cores are shared either way: a rank's loop and Data's tasks take turns on
them; only Ray's accounting kept the tasks out.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path

from rtnb.core._startup import lazy_imports_for_children

__all__ = [
    "DATA_CPUS",
    "HIDDEN_RAYLET_NAME",
    "RANK_CPU",
    "rank_bundle",
    "rank_cpus",
    "LOOPBACK",
    "joining_private_ray",
    "node_ip_as_given",
    "start_embedded_ray",
]

LOOPBACK = "127.0.0.1"
# What a private Ray's raylet is started as: Ray finds local clusters by looking for
# processes whose executable's name contains "raylet" (services._is_raylet_process).
HIDDEN_RAYLET_NAME = "rtnb-warm-node"
# An embedded Ray takes 30% of RAM for its object store by default; a notebook
# sharing the machine with the user's other work should not.
_EMBEDDED_OBJECT_STORE_BYTES = 2 * 1024**3
# Logical CPUs a Ray started here declares beyond the machine's, for Ray Data.
DATA_CPUS = 1
# The resource that only ranks ask for: as many as the machine's CPUs.
RANK_CPU = "rtnb_rank_cpu"


def rank_cpus(resources: Mapping[str, float], total: Mapping[str, float] | None = None) -> float:
    """The CPUs of ``resources`` (a cluster's ``total`` or its free ones) that ranks
    may take: on a Ray rtnb started, all but Ray Data's; elsewhere every CPU. For free
    resources pass ``total`` too: Ray leaves a resource with none free out."""
    cpus = resources.get("CPU", 0.0)
    marked = RANK_CPU in (resources if total is None else total)
    return min(cpus, resources.get(RANK_CPU, 0.0)) if marked else cpus


_LEAST_CPU = 0.0001


def rank_bundle(cpus: float, gpus: float, cluster: Mapping[str, float]) -> dict[str, float]:
    """What one rank's placement-group bundle asks for on ``cluster``."""
    bundle = {"CPU": cpus, "GPU": gpus}
    if RANK_CPU in cluster:
        bundle[RANK_CPU] = cpus
    # Ray never places an empty bundle: a rank that asks for nothing
    # (--cpus-per-worker 0) holds Ray's smallest share of a CPU.
    return {k: v for k, v in bundle.items() if v} or {"CPU": _LEAST_CPU}


def start_embedded_ray(
    ray,
    num_cpus: int | None,
    listen: str | None = None,
    namespace: str | None = None,
    private_dir: Path | None = None,
) -> None:
    """``ray.init`` of a Ray in this process: loopback unless ``listen`` says
    otherwise, a capped object store, no dashboard, only the processes it uses.

    With ``private_dir`` the Ray is invisible to the user's own Ray tools: its
    session files live there instead of Ray's shared temp dir (``/tmp/ray``, whose
    ``session_latest`` the CLI reads), and its raylet runs under another name, so
    ``ray status``, ``ray.init(address="auto")`` and Ray Train's own look-ups of
    "the local cluster" never find it (they scan for raylet processes and read
    their ``--gcs-address``).

    ``num_cpus`` (default: this machine's) is what ranks may take; Ray Data gets
    :data:`DATA_CPUS` more."""
    machine = num_cpus if num_cpus is not None else (os.cpu_count() or 1)
    kwargs: dict = {
        "log_to_driver": False,
        "logging_level": logging.ERROR,
        "include_dashboard": False,
        "object_store_memory": _EMBEDDED_OBJECT_STORE_BYTES,
        "num_cpus": machine + DATA_CPUS,
        "resources": {RANK_CPU: machine},
        "namespace": namespace,
    }
    if (listen or LOOPBACK) not in ("0.0.0.0", "::"):
        # 0.0.0.0: Ray's own default (the node's address, every interface).
        kwargs["_node_ip_address"] = listen or LOOPBACK
    if private_dir is not None:
        kwargs["_temp_dir"] = str(private_dir)
    with (
        node_ip_as_given((listen or LOOPBACK) == LOOPBACK),
        lazy_imports_for_children(),
        _lean_embedded_ray(),
        _agent_ports_chosen(listen or LOOPBACK),
        _raylet_named_apart(private_dir),
        _ranks_not_niced(),
    ):
        ray.init(**kwargs)


@contextlib.contextmanager
def _ranks_not_niced() -> Iterator[None]:
    """Start the raylet so that its workers (the ranks) run at the kernel's
    priority, as torchrun's processes do.

    Ray renices every worker to 15 so that its own processes stay responsive under
    load; on a machine whose cores the ranks fill, each tick of the raylet, the GCS
    or the kernel then preempts a rank in the middle of a step, and its peers wait
    for it in the next collective: an FSDP2 loop on 2 cores ran at 0.92x torchrun
    niced, 0.98x not. A ``RAY_worker_niceness`` the user set is kept (the raylet
    reads it from its environment)."""
    if _NICENESS in os.environ:
        yield
        return
    os.environ[_NICENESS] = "0"
    try:
        yield
    finally:
        os.environ.pop(_NICENESS, None)


_NICENESS = "RAY_worker_niceness"


@contextlib.contextmanager
def _agent_ports_chosen(listen: str) -> Iterator[None]:
    """Give the node's agents ports chosen here instead of Ray's fixed ones, and
    tell the raylet them before it starts.

    ``ray.init`` has no option for the agents' ports; on Ray's fixed dashboard
    agent port (52365), a ``ray start --head`` the user runs beside this Ray has
    no dashboard agent, so their ``ray job submit`` fails. Left to pick their own
    ports, the agents write them to port files once up, and the raylet waits for
    those files before it registers its node: ~0.7 s here of the dashboard agent
    importing its modules, on the path of every start (nothing in a session
    waits for the agents otherwise). With the ports chosen first and their
    files written before the raylet starts, it registers at once and the agents
    bind the same ports when they are up. A Ray without port files (older) gets
    only the free listen port, as before."""
    from ray._private import node, parameter

    try:
        from ray._raylet import (
            DASHBOARD_AGENT_LISTEN_PORT_NAME,
            METRICS_AGENT_PORT_NAME,
            METRICS_EXPORT_PORT_NAME,
            RUNTIME_ENV_AGENT_PORT_NAME,
            persist_port,
        )

        port_files = {
            "metrics_agent_port": METRICS_AGENT_PORT_NAME,
            "metrics_export_port": METRICS_EXPORT_PORT_NAME,
            "dashboard_agent_listen_port": DASHBOARD_AGENT_LISTEN_PORT_NAME,
            "runtime_env_agent_port": RUNTIME_ENV_AGENT_PORT_NAME,
        }
    except ImportError:
        port_files = {}
    if not callable(getattr(node.Node, "start_raylet", None)) or _full_ray_wanted():
        port_files = {}

    original_params = parameter.RayParams.__init__
    original_start_raylet = getattr(node.Node, "start_raylet", None)

    def params(self, *args, **kwargs) -> None:
        if port_files:
            for name in port_files:
                if not kwargs.get(name):
                    kwargs[name] = _free_port(listen)
        else:
            kwargs.setdefault("dashboard_agent_listen_port", 0)  # 0: any free port
        original_params(self, *args, **kwargs)

    def start_raylet(self, *args, **kwargs):
        for name, file_name in port_files.items():
            persist_port(
                self._session_dir, self._node_id, file_name, getattr(self._ray_params, name)
            )
        return original_start_raylet(self, *args, **kwargs)

    parameter.RayParams.__init__ = params
    if port_files:
        node.Node.start_raylet = start_raylet
    try:
        yield
    finally:
        parameter.RayParams.__init__ = original_params
        if port_files:
            node.Node.start_raylet = original_start_raylet


def _free_port(listen: str) -> int:
    """A TCP port free on ``listen`` now (the agent binds it a moment later)."""
    every_interface = listen in ("0.0.0.0", "::")
    family = socket.AF_INET6 if ":" in listen and not every_interface else socket.AF_INET
    with socket.socket(family) as probe:
        probe.bind(("" if every_interface else listen, 0))
        return int(probe.getsockname()[1])


def _full_ray_wanted() -> bool:
    return os.environ.get("RTNB_FULL_EMBEDDED_RAY", "") not in ("", "0")


@contextlib.contextmanager
def _raylet_named_apart(private_dir: Path | None) -> Iterator[None]:
    """Start the raylet through a link named :data:`HIDDEN_RAYLET_NAME`."""
    if private_dir is None:
        yield
        return
    from ray._private import services

    link = private_dir / HIDDEN_RAYLET_NAME
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    link.symlink_to(services.RAYLET_EXECUTABLE)
    original = services.RAYLET_EXECUTABLE
    services.RAYLET_EXECUTABLE = str(link)
    try:
        yield
    finally:
        services.RAYLET_EXECUTABLE = original


@contextlib.contextmanager
def joining_private_ray() -> Iterator[None]:
    """Around a driver's ``ray.init(address=...)`` of a Ray started with
    ``private_dir``: a driver finds its node's raylet by the same scan that the
    user's tools use (``services.find_node_ids``), so it is shown the renamed
    raylet too, for this call only."""
    from ray._private import services

    original = getattr(services, "_is_raylet_process", None)
    if original is None:  # a Ray before 2.5x: its driver asks the GCS for its node
        yield
        return

    def is_raylet(cmdline) -> bool:
        named = bool(cmdline) and os.path.basename(cmdline[0]) == HIDDEN_RAYLET_NAME
        return named or original(cmdline)

    services._is_raylet_process = is_raylet
    try:
        yield
    finally:
        services._is_raylet_process = original


@contextlib.contextmanager
def _lean_embedded_ray() -> Iterator[None]:
    """Start only the Ray processes an embedded, one-kernel Ray uses.

    ``ray.init`` also starts, and waits ~2 s for, a dashboard process that only
    reports usage statistics when the dashboard is off; an autoscaler monitor (no
    nodes to add to a laptop); and a log monitor, which streams worker logs to the
    driver (rtnb starts Ray with ``log_to_driver=False`` and collects the ranks'
    output itself). Skipping them took ``ray.init`` from 6.9 s to 3.7 s here and
    leaves one process fewer listening. ``RTNB_FULL_EMBEDDED_RAY=1`` keeps them.

    And the head's wait for its own raylet is cut to when it registers: Ray asks
    the GCS for the node once a second (its C++ ``GetNode`` polls so), and the
    raylet registers ~1.2 s after it starts here, so the wait was 2 s where 1.2
    would do (see :func:`_get_node_when_registered`).

    Private Ray functions: each is only replaced if it exists, around this call.
    """
    if _full_ray_wanted():
        yield
        return
    from ray._private import node, services

    replaced = []
    python_command = "_build_python_executable_command_memory_profileable"
    for owner, name, stand_in in (
        (services, "start_api_server", lambda *args, **kwargs: (None, None)),
        (services, python_command, _agents_niced(getattr(services, python_command, None))),
        (node.Node, "start_monitor", lambda self: None),
        (node.Node, "start_log_monitor", lambda self: None),
        (services, "get_node", _get_node_when_registered(getattr(services, "get_node", None))),
    ):
        if callable(getattr(owner, name, None)):
            replaced.append((owner, name, getattr(owner, name)))
            setattr(owner, name, stand_in)
    try:
        yield
    finally:
        for owner, name, original in replaced:
            setattr(owner, name, original)


def _agents_niced(build_command):
    """Ray's Python command builder, starting the node's two agents at a lower CPU
    priority: their start is ~1.2 s of imports that nothing in a session waits
    for, which on two cores would take it from the ranks' start."""
    import shutil

    nice = shutil.which("nice")
    if build_command is None or nice is None:
        return build_command
    from ray._private import ray_constants

    agents = {
        getattr(ray_constants, "PROCESS_TYPE_DASHBOARD_AGENT", None),
        getattr(ray_constants, "PROCESS_TYPE_RUNTIME_ENV_AGENT", None),
    } - {None}

    def build(component, *args, **kwargs):
        command = build_command(component, *args, **kwargs)
        return [nice, "-n", "10", *command] if component in agents else command

    return build


def _get_node_when_registered(get_node):
    """``services.get_node`` that first waits, asking every 20 ms, for the node to be
    in the GCS's node table, then asks Ray's own way (which answers at once then).
    Ray's own wait asks once a second from its first try."""
    if get_node is None:
        return None

    def wait_then_get(gcs_address, node_id, *args, **kwargs):
        import time

        from ray._raylet import GcsClient

        # Past this, Ray's own wait goes on (up to its 30 s): a slow machine loses
        # nothing, and a Ray whose client differs is never waited on for long.
        deadline = time.monotonic() + 10.0
        try:
            client = GcsClient(address=gcs_address)
            while time.monotonic() < deadline:
                nodes = client.get_all_node_info(timeout=5)
                if any(found.hex() == node_id for found in nodes):
                    break
                time.sleep(0.02)
        except Exception:  # noqa: BLE001 - a Ray whose internals differ: its own wait
            pass
        return get_node(gcs_address, node_id, *args, **kwargs)

    return wait_then_get


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
