"""The warm Ray's folder and fingerprint (driver/cluster)."""

from __future__ import annotations

import pathlib
import tempfile
import time


def test_the_warm_rays_folder_leaves_a_tmpdir_too_long_for_rays_sockets(tmp_path, monkeypatch):
    """Ray's sockets go ~64 bytes under the warm Ray's folder and a socket path holds
    107: a TMPDIR that fits keeps the folder; a longer one (a job's scratch folder)
    gives way to /tmp instead of a warm Ray that cannot start."""
    import shutil

    from rtnb.driver.cluster._warm_host import private_ray_dir

    short = pathlib.Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))
    long_ = tmp_path / ("scratch-of-a-batch-job-" * 2)
    long_.mkdir()
    try:
        for tmpdir, kept in ((short, True), (long_, False)):
            monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
            made = private_ray_dir()
            shutil.rmtree(made)
            assert (made.parent == tmpdir) is kept, (tmpdir, made)
            socket = made / "session_2026-11-29_14-10-45_051662_4194304/sockets/plasma_store"
            assert len(str(socket)) <= 107, socket
    finally:
        shutil.rmtree(short)


def test_the_warm_rays_fingerprint_changes_with_the_ranks_code():
    """A kernel joins a warm Ray only if its spare ranks run the same rtnb: an edit to
    the rank runtime (not only the driver's code) makes a new one."""
    import os

    from rtnb.driver.cluster._warm_client import _fingerprint
    from rtnb.worker import _runtime

    before = _fingerprint()
    source = pathlib.Path(_runtime.__file__)
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, time.time_ns() + 10**9 * 3600))  # now newest
    try:
        assert _fingerprint() != before
    finally:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert _fingerprint() == before
