"""Joining a cluster from a machine that is not one of its nodes.

A Ray driver joined by ``HOST:PORT`` talks to a raylet on its own machine: Ray finds
one by looking for raylet processes there (``ps``) and asks the GCS which of them
belong to the cluster. On a machine with none (a laptop, a Slurm login node, a
KubeRay notebook pod) ``ray.init`` waits a minute and fails, and where a raylet of
another machine is visible (a shared PID namespace) it ends the whole process with
a C++ fatal: in a notebook, the kernel and the user's state.

So before ``ray.init`` rtnb looks at the cluster with one pure-Python gRPC call to
its GCS (it can fail, never abort the process): its alive nodes, against this
machine's own addresses and raylets. Where this machine holds none of them, it
joins as a node of its own that takes no work (0 CPUs, 0 GPUs), owned by this
process: ``ray start --block`` in a process group of its own, watched by a shell
that ends the group once this process is gone, so a kernel that dies leaves no
raylet behind. The driver then connects to that
raylet as on any node, and every call to the ranks goes straight to them, not
through a Ray Client proxy (measured: ``benchmarks/cluster.py``). Where that node
cannot start (another Ray version, ports the cluster cannot reach) the cluster's
Ray Client port is used when it answers, else one line says what to do.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rtnb.core._net import local_addresses
from rtnb.errors import ClusterError

__all__ = [
    "CLIENT_PORT",
    "ClusterView",
    "NodeSeen",
    "OwnNode",
    "look_at_cluster",
    "machine_name",
    "resolve",
    "start_own_node",
]

# How long a node of ours may take to register with the GCS (a busy 2-core machine
# started one in 5-12 s).
_NODE_START_S = 120.0
# The Ray Client port `ray start --head` opens by default: the join from outside the
# cluster's network.
CLIENT_PORT = 10001


@dataclass(frozen=True)
class NodeSeen:
    node_id: str
    address: str
    is_head: bool


@dataclass(frozen=True)
class ClusterView:
    """What the GCS said of its alive nodes, and what this machine is to them."""

    nodes: tuple[NodeSeen, ...]
    # This machine's address on the route to the GCS: the one its node registers.
    this_machine: str
    # Node ids of the raylets running on this machine, of any Ray.
    local_raylets: frozenset[str]
    # Raylets on this machine started for this GCS that it does not list yet (a
    # node still registering: `ray start` just returned).
    registering: frozenset[str] = frozenset()

    def node_here(self) -> NodeSeen | None:
        """The cluster's node on this machine, if any."""
        mine = set(local_addresses()) | {self.this_machine}
        for node in self.nodes:
            if node.node_id in self.local_raylets and (
                node.address in mine or node.address.startswith("127.")
            ):
                return node
        return None


def machine_name() -> str:
    return socket.gethostname()


def _address_toward(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((resolve(host), port))
            return sock.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def look_at_cluster(host: str, port: int, timeout_s: float = 10.0) -> ClusterView:
    """The GCS's alive nodes and this machine against them (pure Python gRPC, with
    the auth token Ray's loader holds now). A GCS that refuses the call for want of
    a token raises the one line naming the token's settings."""
    import grpc
    from ray.core.generated import gcs_pb2, gcs_service_pb2, gcs_service_pb2_grpc

    interceptors = []
    with contextlib.suppress(ImportError):  # a Ray before token auth: no interceptor
        from ray._private.authentication.grpc_authentication_client_interceptor import (
            SyncAuthenticationMetadataClientInterceptor,
        )

        interceptors.append(SyncAuthenticationMetadataClientInterceptor())
    target = f"{host}:{port}"
    try:
        # gRPC's own resolver may ask DNS alone and wait out the call on a name that
        # only /etc/hosts knows; the system's resolver knows what the user's tools do.
        address = f"{resolve(host)}:{port}"
        with grpc.insecure_channel(address) as channel:
            stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(
                grpc.intercept_channel(channel, *interceptors)
            )
            reply = stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=timeout_s)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            raise ClusterError(token_refused_line(target)) from None
        raise ClusterError(
            f"the Ray at {target} did not say which nodes it has ({exc.code().name}): "
            "is it a Ray GCS port (6379 by default)? For a Ray Client port use ray://"
        ) from None
    alive = gcs_pb2.GcsNodeInfo.GcsNodeState.ALIVE
    nodes = tuple(
        NodeSeen(
            node_id=info.node_id.hex(),
            address=info.node_manager_address,
            is_head=info.is_head_node,
        )
        for info in reply.node_info_list
        if info.state == alive
    )
    local = _local_raylets()
    listed = {node.node_id for node in nodes}
    return ClusterView(
        nodes=nodes,
        this_machine=_address_toward(host, port),
        local_raylets=frozenset(local),
        registering=frozenset(
            node for node, gcs in local.items() if gcs.endswith(f":{port}") and node not in listed
        ),
    )


def _local_raylets() -> dict[str, str]:
    """The raylets running on this machine, node id -> its GCS's address, read from
    their command lines as Ray's own tools read them (older Rays have no function
    for it)."""
    import psutil

    found: dict[str, str] = {}
    try:
        processes = list(psutil.process_iter(["cmdline"]))
    except Exception:  # noqa: BLE001 - no process table: no raylet seen here
        return found
    for process in processes:
        cmdline = process.info.get("cmdline") or []
        if not cmdline or "raylet" not in os.path.basename(cmdline[0]):
            continue
        args = dict(arg.partition("=")[::2] for arg in " ".join(cmdline).split(" "))
        if args.get("--node_id"):
            found[args["--node_id"]] = args.get("--gcs-address", "")
    return found


def resolve(host: str) -> str:
    """``host``'s address by the system's resolver (/etc/hosts, then DNS)."""
    if ":" in host:
        return host
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise ClusterError(
            f"cannot resolve {host!r} on this machine ({machine_name()}): {exc.strerror or exc}; "
            "give the head's address (an IP) or add its name to /etc/hosts"
        ) from None


def token_refused_line(target: str) -> str:
    return (
        f"the Ray at {target} uses token authentication and this machine "
        f"({machine_name()}) has no token it accepts: copy the cluster's token to "
        "~/.ray/auth_token here, or set RAY_AUTH_TOKEN (the token) or "
        "RAY_AUTH_TOKEN_PATH (its file), then `%rtnb start` again"
    )


class OwnNode:
    """A node of the cluster on this machine that takes no work, started by this
    process and ended with it."""

    def __init__(self, gcs: str, address: str, proc: subprocess.Popen, temp_dir: str) -> None:
        self.gcs, self.address, self.proc, self.temp_dir = gcs, address, proc, temp_dir

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """End the node and every process it started (they share its process group)."""
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait_s)
                break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


_OWN: dict[str, OwnNode] = {}
_OWN_LOCK = threading.Lock()


# The node's processes share the watcher's process group; the watcher ends that group
# once this process is gone, however it ended (a killed kernel too), or once the node
# ended by itself. (PR_SET_PDEATHSIG would fire when the starting *thread* ends.)
_WATCHER = """
"$@" &
node=$!
while kill -0 "$RTNB_OWNER_PID" 2>/dev/null && kill -0 "$node" 2>/dev/null; do sleep 1; done
trap '' TERM
kill -TERM 0 2>/dev/null
sleep 3
kill -KILL 0
"""


def start_own_node(
    host: str, port: int, view: ClusterView, env: dict[str, str] | None = None
) -> OwnNode:
    """Join this machine to the cluster at ``host:port`` as a node with no CPUs and
    no GPUs; return once the GCS lists it alive. One line on failure."""
    gcs = f"{host}:{port}"
    with _OWN_LOCK:
        node = _OWN.get(gcs)
        if node is not None and node.alive:
            return node
        temp_dir = tempfile.mkdtemp(prefix="rtnb-node-")
        log = Path(temp_dir) / "ray-start.log"
        ray_bin = Path(sys.executable).parent / "ray"
        argv = [
            str(ray_bin) if ray_bin.exists() else "ray",
            "start",
            f"--address={gcs}",
            f"--node-ip-address={view.this_machine}",
            "--num-cpus=0",
            "--num-gpus=0",
            "--block",
            "--disable-usage-stats",
            # Its own folder: `ray start` writes the cluster's address into its temp
            # folder, and a later plain ray.init() on this machine (an embedded Ray)
            # would take /tmp/ray's for a cluster to join.
            f"--temp-dir={temp_dir}",
            # No rank runs there, and rtnb gathers what the ranks print itself.
            "--include-log-monitor=False",
        ]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                ["sh", "-c", _WATCHER, "rtnb-node", *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {}), "RTNB_OWNER_PID": str(os.getpid())},
                start_new_session=True,
            )
        node = OwnNode(gcs, view.this_machine, proc, temp_dir)
        deadline = time.monotonic() + _NODE_START_S
        while True:
            if proc.poll() is not None:
                raise ClusterError(_start_failed_line(host, port, view, log))
            try:
                seen = look_at_cluster(host, port, timeout_s=5.0)
            except ClusterError:
                seen = None
            if seen is not None and seen.node_here() is not None:
                break
            if time.monotonic() > deadline:
                node.stop()
                raise ClusterError(
                    f"this machine ({machine_name()}, {view.this_machine}) joined the Ray "
                    f"at {gcs} as a node but the cluster did not list it within "
                    f"{_NODE_START_S:.0f} s: the cluster must reach this machine's ports "
                    "(see the remote page); from outside its network use "
                    f"--address ray://{host}:{CLIENT_PORT}"
                )
            time.sleep(0.3)
        _OWN[gcs] = node
        return node


def _start_failed_line(host: str, port: int, view: ClusterView, log: Path) -> str:
    from rtnb.driver.cluster._versions import ray_mismatch_line

    gcs = f"{host}:{port}"
    text = log.read_text(errors="replace") if log.exists() else ""
    mismatch = ray_mismatch_line(text)
    if mismatch is not None:
        return mismatch
    last = [line.strip() for line in text.splitlines() if line.strip()]
    said = last[-1][-300:] if last else "no output"
    return (
        f"this machine ({machine_name()}, {view.this_machine}) is not a node of the Ray at "
        f"{gcs} and could not join it as one ({said}; the log: {log}); from outside the "
        f"cluster's network use --address ray://{host}:{CLIENT_PORT}"
    )


def stop_own_nodes() -> None:
    with _OWN_LOCK:
        nodes = list(_OWN.values())
        _OWN.clear()
    for node in nodes:
        node.stop()


atexit.register(stop_own_nodes)
