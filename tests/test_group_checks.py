"""What a worker group checks before it starts (driver/ranks/_group)."""

from __future__ import annotations

import pytest

from rtnb.errors import ConfigError


def test_node_local_storage_is_refused_for_ranks_on_several_nodes():
    from rtnb.driver.ranks._group import check_storage_locality

    check_storage_locality(1, "/data/runs", allowed=False)
    check_storage_locality(3, "s3://bucket/runs", allowed=False)
    check_storage_locality(3, "/shared/nfs/runs", allowed=True)
    with pytest.raises(ConfigError, match="2 nodes.*--allow-local-storage"):
        check_storage_locality(2, "/data/runs", allowed=False)
