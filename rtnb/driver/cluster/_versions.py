"""One line, before any rank starts, when the kernel and a cluster's nodes run different
software.

A rank runs rtnb's code and the user's torch on a node, and a cell's values, functions
and checkpoints cross between the kernel and the ranks pickled: a node whose Python,
Ray, torch or rtnb is not the kernel's fails later, in a rank's start or a cell, with
an error that names neither side. Ray itself refuses a different Ray or Python when
the kernel joins (:func:`ray_mismatch_line` turns its multi-line message into one);
the rest is asked of every node that can hold a rank by a task of no CPU
(:func:`check_cluster_versions`). A Ray rtnb started itself (embedded, warm) runs in
the kernel's own environment and is not asked, nor is the node this process's own
``ray.init()`` started (its workers run this very Python) unless the job installs
an environment of its own.
"""

from __future__ import annotations

import builtins
import contextlib
import re
import types
from typing import Any

from rtnb.core._installed import PACKAGES, versions_here
from rtnb.errors import ClusterError

__all__ = ["check_cluster_versions", "ray_mismatch_line"]

_PROBE_TIMEOUT_S = 10.0


def _said(versions: dict[str, str], names: list[str]) -> str:
    return ", ".join(f"{'Python' if n == 'python' else n} {versions.get(n, '?')}" for n in names)


def _advice(kernel: dict[str, str], names: list[str]) -> str:
    wanted = " ".join(f"{n}=={kernel[n]}" for n in names if n != "python")
    python = f"Python {kernel['python']} and " if "python" in names else ""
    return (
        f"install the same on both sides ({python}pip install {wanted} on the nodes, or "
        "the nodes' versions in the kernel's environment), or run the notebook in the "
        "cluster's image"
    )


def ray_mismatch_line(message: str) -> str | None:
    """Ray's "Version mismatch" error on joining, as one line naming both sides and
    what to do; None for any other error."""
    if "Version mismatch" not in message:
        return None
    rays = re.findall(r"Ray: (\S+)", message)
    pythons = re.findall(r"Python: (\S+)", message)
    if len(rays) < 2 or len(pythons) < 2:
        return None
    cluster = {"python": pythons[0], "ray": rays[0]}
    kernel = {"python": pythons[1], "ray": rays[1]}
    names = [n for n in ("python", "ray") if cluster[n] != kernel[n]] or ["python", "ray"]
    return (
        f"the cluster runs {_said(cluster, names)}; this kernel runs {_said(kernel, names)}: "
        + _advice(kernel, names)
    )


# The nodes this process found alike (their ids): each asked once.
_checked: set[str] = set()

# What a job's runtime env may hold and still run the kernel's packages.
_SAME_SOFTWARE_KEYS = frozenset({"env_vars", "config"})
_IMPORT_PATH_VARS = frozenset({"PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE"})


def _node_started_here() -> str | None:
    """The id of the node this process's ``ray.init()`` started, when its workers run
    the kernel's own Python and packages (asking it would cost a worker's start,
    ~0.3 s, to learn nothing); None otherwise."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    if node is None or not getattr(node, "head", False):
        return None  # joined a Ray started elsewhere
    try:
        runtime_env = dict(ray.get_runtime_context().runtime_env or {})
    except Exception:  # noqa: BLE001 - unknown: ask the node
        return None
    env_vars = runtime_env.get("env_vars") or {}
    if set(runtime_env) - _SAME_SOFTWARE_KEYS or _IMPORT_PATH_VARS & set(env_vars):
        return None
    return str(node.node_id)


def check_cluster_versions(timeout_s: float = _PROBE_TIMEOUT_S) -> None:
    """Ask every node that can hold a rank for its versions (each node once per
    process); one ClusterError line naming the first node that differs from this
    kernel (and how many more do)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # A copy of versions_here outside any module, which Ray then sends by value: a
    # node without rtnb answers too (with "not installed").
    probe = types.FunctionType(versions_here.__code__, {"__builtins__": builtins}, "versions")
    own = _node_started_here()
    if own is not None:
        _checked.add(own)
    nodes = [
        node
        for node in ray.nodes()
        if node.get("Alive")
        and node["NodeID"] not in _checked
        and (node["Resources"].get("CPU", 0) > 0 or node["Resources"].get("GPU", 0) > 0)
    ]
    if not nodes:
        return
    remote = ray.remote(num_cpus=0)(probe)
    calls = [
        remote.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        ).remote()
        for node in nodes
    ]
    # Best effort: a node that does not answer in time (one just lost, still listed
    # as alive; one whose Python cannot start) is asked again at the next start, and
    # the ranks' own placement says what is wrong with it. Only a known difference
    # stops the start.
    ready, pending = ray.wait(calls, num_returns=len(calls), timeout=timeout_s)
    for call in pending:
        with contextlib.suppress(Exception):
            ray.cancel(call)
    answered: list[tuple[dict[str, Any], dict[str, str]]] = []
    for node, call in zip(nodes, calls, strict=True):
        if call in ready:
            with contextlib.suppress(Exception):
                answered.append((node, ray.get(call, timeout=1.0)))
    kernel = versions_here()
    differing = [
        (node, answer, [n for n in ("python", *PACKAGES) if answer.get(n) != kernel[n]])
        for node, answer in answered
    ]
    _checked.update(node["NodeID"] for node, _, names in differing if not names)
    differing = [d for d in differing if d[2]]
    if not differing:
        return
    node, answer, names = differing[0]
    more = f" (and {len(differing) - 1} more node(s))" if len(differing) > 1 else ""
    raise ClusterError(
        f"the cluster's node {node.get('NodeManagerAddress', '?')}{more} runs "
        f"{_said(answer, names)}; this kernel runs {_said(kernel, names)}: "
        + _advice(kernel, names)
        + "; no rank was started"
    )
