"""Connecting to Ray: an address, the embedded Ray, the per-user warm Ray (its host process, the kernel's side, its commands), the cluster's token, Ray's own output and versions, and what a start is doing."""

from typing import TYPE_CHECKING

from rtnb.core._faces import lazy_face

_FACE = {
    "active_warm_ray": "rtnb.driver.cluster._warm_client",
    "check_cluster_versions": "rtnb.driver.cluster._versions",
    "ClusterConnection": "rtnb.driver.cluster._connect",
    "connect": "rtnb.driver.cluster._connect",
    "DATA_CPUS": "rtnb.driver.cluster._embedded",
    "ensure_running": "rtnb.driver.cluster._warm_client",
    "join_running_warm_ray": "rtnb.driver.cluster._warm_client",
    "kernel_alive": "rtnb.driver.cluster._warm_host",
    "rank_bundle": "rtnb.driver.cluster._embedded",
    "rank_cpus": "rtnb.driver.cluster._embedded",
    "StartProgress": "rtnb.driver.cluster._start_progress",
    "StartReport": "rtnb.driver.cluster._start_progress",
    "stop_warm_ray": "rtnb.driver.cluster._warm_commands",
    "switched_off": "rtnb.driver.cluster._warm_client",
    "warm_lease_in_host": "rtnb.driver.cluster._warm_client",
    "warm_rank_env": "rtnb.driver.cluster._warm_client",
    "warm_ray_status": "rtnb.driver.cluster._warm_commands",
    "warm_ray_wanted": "rtnb.driver.cluster._warm_client",
    "WarmRayStatus": "rtnb.driver.cluster._warm_commands",
    "watch_ranks": "rtnb.driver.cluster._ray_output",
    "will_embed": "rtnb.driver.cluster._connect",
}
__all__ = [
    "active_warm_ray",
    "check_cluster_versions",
    "ClusterConnection",
    "connect",
    "DATA_CPUS",
    "ensure_running",
    "join_running_warm_ray",
    "kernel_alive",
    "rank_bundle",
    "rank_cpus",
    "StartProgress",
    "StartReport",
    "stop_warm_ray",
    "switched_off",
    "warm_lease_in_host",
    "warm_rank_env",
    "warm_ray_status",
    "warm_ray_wanted",
    "WarmRayStatus",
    "watch_ranks",
    "will_embed",
]
__getattr__ = lazy_face(globals(), _FACE)

if TYPE_CHECKING:  # what type checkers see
    from rtnb.driver.cluster._connect import ClusterConnection, connect, will_embed
    from rtnb.driver.cluster._embedded import DATA_CPUS, rank_bundle, rank_cpus
    from rtnb.driver.cluster._ray_output import watch_ranks
    from rtnb.driver.cluster._start_progress import StartProgress, StartReport
    from rtnb.driver.cluster._versions import check_cluster_versions
    from rtnb.driver.cluster._warm_client import (
        active_warm_ray,
        ensure_running,
        join_running_warm_ray,
        switched_off,
        warm_lease_in_host,
        warm_rank_env,
        warm_ray_wanted,
    )
    from rtnb.driver.cluster._warm_commands import WarmRayStatus, stop_warm_ray, warm_ray_status
    from rtnb.driver.cluster._warm_host import kernel_alive
