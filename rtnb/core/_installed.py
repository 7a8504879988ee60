"""What this process runs: its Python and the packages that must match between a
kernel and a cluster's nodes, read from their metadata (nothing is imported)."""

from __future__ import annotations

__all__ = ["PACKAGES", "versions_here"]

# What must be the same on both sides, as pip names them.
PACKAGES = ("ray", "torch", "rtnb")


def versions_here() -> dict[str, str]:
    """This process's Python and :data:`PACKAGES`, from their metadata. Self-contained
    (no module-level name): a node runs a copy of it, sent by value
    (``rtnb.driver.cluster._versions.check_cluster_versions``)."""
    import platform
    from importlib import metadata

    found = {"python": platform.python_version()}
    for name in ("ray", "torch", "rtnb"):  # PACKAGES
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found
