"""Makes a torchrun script run unchanged in a cell on the persistent group.

A script written for ``torchrun`` sets up its own process group
(``init_process_group(backend=...)``, its rank and world from the environment) and
ends by destroying it. On a rank, the session's group is that group already, and it
outlives the cell (the next cell, the cell relay and a recovery stand on it). So,
once the session's group is up:

- ``init_process_group`` with a backend, world size and rank that agree with the
  session's is the session's group: nothing is made (one note, once a session); one
  that does not agree raises one line naming both.
- ``destroy_process_group()`` of the default group keeps it (one note, once): the
  group is there for the next cell at once, as when the script runs again under
  torchrun. A subgroup is destroyed as torch would.
- :func:`torchrun_environment` is every variable torchrun gives its workers.
"""

from __future__ import annotations

import sys
from typing import Any

from rtnb.errors import ConfigError

__all__ = ["install_torchrun_compat", "remove_torchrun_compat", "torchrun_environment"]

_ORIGINALS: dict[str, Any] = {}
_NOTED: set[str] = set()


def torchrun_environment(
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    node_rank: int,
    nodes: int,
    run_id: str,
) -> dict[str, str]:
    """The variables ``torchrun`` sets for a worker (its docs' list), for this rank."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "NODE_RANK": str(node_rank),
        "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(nodes),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id or "none",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "PYTHON_EXEC": sys.executable,
    }


def _note(key: str, text: str) -> None:
    """One line, once a session, from rank 0 (every rank would say the same)."""
    import torch.distributed as dist

    if key in _NOTED:
        return
    _NOTED.add(key)
    if dist.get_rank() == 0:
        print(f"[rtnb] {text}", file=sys.stderr, flush=True)


def _backends(backend: Any) -> set[str]:
    """``"gloo"``, ``"cpu:gloo,cuda:nccl"``, a ``Backend``: the backend names it asks for."""
    text = str(backend).lower()
    return {part.rpartition(":")[2].strip() for part in text.split(",") if part.strip()}


def _init_process_group(
    backend: Any = None,
    init_method: Any = None,
    timeout: Any = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    *args: Any,
    **kwargs: Any,
) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        return _ORIGINALS["init_process_group"](
            backend, init_method, timeout, world_size, rank, store, *args, **kwargs
        )
    ours, size, me = str(dist.get_backend()), dist.get_world_size(), dist.get_rank()
    session = f"this session's process group is {ours} over {size} ranks"
    asked = backend if backend is not None else ours
    if backend is not None and ours not in _backends(backend):
        fix = (
            "--gpu"
            if "nccl" in _backends(backend)
            else f"--backend {sorted(_backends(backend))[0]}"
        )
        raise ConfigError(
            f"init_process_group(backend={str(backend)!r}): {session}; start the session "
            f"with `%rtnb start {fix}` to train on {backend}"
        )
    if world_size not in (-1, None) and int(world_size) != size:
        raise ConfigError(
            f"init_process_group(world_size={world_size}): {session}; start it with "
            f"`%rtnb start --workers {world_size}` or let the world size come from WORLD_SIZE"
        )
    if rank not in (-1, None) and int(rank) != me:
        raise ConfigError(
            f"init_process_group(rank={rank}) on rank {me}: {session}, where this rank is "
            f"{me}; take the rank from RANK (or dist.get_rank())"
        )
    _note(
        "init",
        f"init_process_group(backend={str(asked)!r}): the session's process group "
        f"({ours}, {size} ranks) is already up, and is the one this code uses",
    )
    return None


def _destroy_process_group(group: Any = None) -> None:
    import torch.distributed as dist

    if group is not None and group is not dist.group.WORLD:
        return _ORIGINALS["destroy_process_group"](group)
    _note(
        "destroy",
        "destroy_process_group(): the session's process group stays up for the next "
        "cell (`%rtnb stop` ends it)",
    )
    return None


def install_torchrun_compat() -> None:
    """Point ``torch.distributed``'s init/destroy at the versions above (once the
    session's group is up)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if _ORIGINALS:
        return
    _ORIGINALS["init_process_group"] = c10d.init_process_group
    _ORIGINALS["destroy_process_group"] = c10d.destroy_process_group
    for module in (dist, c10d):
        module.init_process_group = _init_process_group
        module.destroy_process_group = _destroy_process_group


def remove_torchrun_compat() -> None:
    """torch's own init/destroy again (the session's group is going away)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if not _ORIGINALS:
        return
    for module in (dist, c10d):
        module.init_process_group = _ORIGINALS["init_process_group"]
        module.destroy_process_group = _ORIGINALS["destroy_process_group"]
    _ORIGINALS.clear()
    _NOTED.clear()
