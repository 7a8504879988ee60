"""Safe by default: an embedded session listens on loopback only.

This starts the one embedded Ray of the suite (what `%rtnb start` does on a
laptop), in a subprocess with its own temp dir, and stops it before returning.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow]

PROBE = r"""
import ipaddress, json, os, psutil, rtnb
session = rtnb.Session(workers=2, cpus_per_worker=0.5, storage=os.environ["STORAGE"])
session.start()
assert session.run("import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()") == {0: 2.0, 1: 2.0}
rank_pids = sorted(session.run("import os\nos.getpid()").values())
me = psutil.Process()
found = []
for proc in [me, *me.children(recursive=True)]:
    try:
        # The process name, not the command line: on a deep checkout path the
        # command line's first 80 characters are all directories.
        name = proc.name()
        for conn in proc.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                found.append([conn.laddr.ip, conn.laddr.port, name, proc.pid])
    except psutil.Error:
        pass
session.stop()
print("LISTEN " + json.dumps(found))
print("RANKS " + json.dumps(rank_pids))
"""


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def test_an_embedded_session_opens_no_socket_outside_loopback(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["STORAGE"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("LISTEN "))
    listening = json.loads(line[len("LISTEN ") :])
    exposed = [x for x in listening if not _is_loopback(x[0])]
    assert listening, "the probe saw no listening socket at all"
    assert not exposed, f"listening beyond loopback: {exposed}"
    # gcs_server, raylet and both ranks (Ray's worker server, gloo's store) were
    # among what was checked: a probe that missed the ranks would prove nothing.
    names = " ".join(x[2] for x in listening)
    assert "gcs_server" in names and "raylet" in names, names
    ranks = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RANKS "))[6:])
    assert len(ranks) == 2
    assert {x[3] for x in listening} >= set(ranks), (ranks, listening)
