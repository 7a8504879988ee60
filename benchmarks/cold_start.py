"""Cold start as a user meets it: a fresh kernel to the first result of a cell on
2 ranks, for rtnb and for its peers, measured side by side in one run.

rtnb: ``%load_ext rtnb``, ``%rtnb start`` (2 ranks, gloo), then ``%%rtrain``
``x = 1``; with the phases ``%rtnb start`` reports (Ray, placement, rank
processes, process group). Four ways: a kernel joining the per-user warm Ray
(the usual case: another kernel started it earlier), the kernel that starts the
warm Ray, a Ray embedded in the kernel (``RTNB_WARM_RAY=0``), and embedded with
``RTNB_EAGER_IMPORTS=1`` (Ray's processes build jsonschema's IRI grammar at
import, as they do without rtnb).

Peers (installed from PyPI into this environment by ``--install-peers``):
nbdistributed (``%dist_init -n 2`` + a ``%%distributed`` cell) and
jupyter-distributed (a Jupyter server extension: a kernel's process count set to 2
through its REST API, then a cell). See ``_peers.py`` for exactly what each does.

    .venv/bin/python benchmarks/cold_start.py [--install-peers] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _execute(client, code: str, timeout: float = 300.0) -> tuple[float, list[dict]]:
    """Seconds until ``code`` finished, and its iopub messages."""
    started = time.perf_counter()
    msg_id = client.execute(code)
    messages = []
    while True:
        left = timeout - (time.perf_counter() - started)
        if left <= 0:
            raise TimeoutError(f"no reply to {code!r} within {timeout} s")
        try:
            msg = client.get_iopub_msg(timeout=left)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        messages.append(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return time.perf_counter() - started, messages


def _texts(messages: list[dict]) -> str:
    out = []
    for msg in messages:
        content = msg["content"]
        if msg["msg_type"] == "stream":
            out.append(content["text"])
        elif msg["msg_type"] in ("execute_result", "display_data", "update_display_data"):
            out.append(content.get("data", {}).get("text/plain", ""))
        elif msg["msg_type"] == "error":
            out.append(f"{content['ename']}: {content['evalue']}")
    return "\n".join(out)


def cold_start_rtnb(mode: str, home: str | None = None) -> dict:
    """``mode``: "warm" (the kernel joins the per-user warm Ray, already running in
    ``home``), "warm_first" (no warm Ray yet: this kernel starts it), "embedded"
    (``RTNB_WARM_RAY=0``: a Ray inside the kernel) or "eager" (embedded, and Ray's
    processes build jsonschema's IRI grammar as they do without rtnb)."""
    from jupyter_client.manager import KernelManager

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RTNB_WARM_RAY"] = "1" if mode.startswith("warm") else "0"
    if home is not None:
        env.update(RTNB_HOME=home, RTNB_WARM_RAY_IDLE_S="120")
    if mode == "eager":
        env["RTNB_EAGER_IMPORTS"] = "1"
    workdir = tempfile.mkdtemp(prefix="rtnb-cold-")
    manager = KernelManager(kernel_name="python3")
    started = time.perf_counter()
    manager.start_kernel(cwd=workdir, env=env)
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=120)
        kernel_s = time.perf_counter() - started
        load_s, _ = _execute(client, "%load_ext rtnb")
        start_s, messages = _execute(client, "%rtnb start")
        phases = next((line for line in _texts(messages).splitlines() if "ready in" in line), "?")
        cell_s, messages = _execute(client, "%%rtrain\nx = 1\nx")
        assert "[rank 1] 1" in _texts(messages), _texts(messages)
        total_s = time.perf_counter() - started
        _execute(client, "%rtnb stop")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)
    return {
        "kernel_s": kernel_s,
        "load_s": load_s,
        "start_s": start_s,
        "cell_s": cell_s,
        "total_s": total_s,
        "phases": phases,
    }


def cold_start_warm_pair() -> tuple[dict, dict]:
    """The kernel that starts a warm Ray (in a fresh RTNB_HOME), then the next kernel,
    which joins it; the warm Ray is stopped afterwards."""
    home = tempfile.mkdtemp(prefix="rtnb-home-")
    try:
        first = cold_start_rtnb("warm_first", home)
        # A user opens the next notebook seconds later, not at once: the spare ranks
        # made after the first kernel's claim are ready by then.
        _wait_for_spares(home)
        return first, cold_start_rtnb("warm", home)
    finally:
        _stop_warm_ray(home)


async def _ws_run(url: str, token: str, codes: list[str | None], timeout: float) -> list[dict]:
    """Run ``codes`` one after another over one kernel websocket, as a notebook does:
    for each, when it was sent, when the kernel went idle, and its output texts.
    None asks for the kernel's info instead: answered once the kernel has booted."""
    import uuid

    from _peers import _ws_decode, _ws_request
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    session_id = uuid.uuid4().hex
    request = HTTPRequest(
        f"{url}?session_id={session_id}", headers={"Authorization": f"token {token}"}
    )
    connection = await asyncio.wait_for(websocket_connect(request), timeout)
    cells = []
    try:
        for code in codes:
            msg_id = uuid.uuid4().hex
            cell: dict = {"sent_at": time.perf_counter(), "messages": []}
            cells.append(cell)
            connection.write_message(_ws_request(code, session_id, msg_id))
            while "idle_at" not in cell:
                raw = await asyncio.wait_for(connection.read_message(), timeout)
                if raw is None:
                    raise RuntimeError(f"the kernel websocket closed during {code!r}")
                msg = _ws_decode(raw)
                if (msg.get("parent_header") or {}).get("msg_id") != msg_id:
                    continue
                msg.setdefault("msg_type", (msg.get("header") or {}).get("msg_type"))
                cell["messages"].append(msg)
                if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    cell["idle_at"] = time.perf_counter()
            cell["text"] = _texts(cell.pop("messages"))
    finally:
        connection.close()
    return cells


def _server_kernel(base: str, token: str) -> dict:
    """A python3 kernel started through the server's REST API, then ``%load_ext
    rtnb``, ``%rtnb start``, ``%%rtrain x = 1`` over its websocket: seconds from the
    start request to both ranks' results."""
    from _peers import _http

    started = time.perf_counter()
    status, model = _http("POST", f"{base}/api/kernels", token, {"name": "python3"}, timeout=120)
    if status not in (200, 201):
        raise RuntimeError(f"POST /api/kernels: {status} {model}")
    kernel_id = model["id"]
    url = base.replace("http://", "ws://") + f"/api/kernels/{kernel_id}/channels"
    # The server answers the POST once the kernel's process is launched, not booted:
    # the kernel's info is asked first, so its boot is the kernel's phase and not
    # `%load_ext`'s (a notebook's first cell waits for it all the same; the total
    # is the same either way).
    codes = [None, "%load_ext rtnb", "%rtnb start", "%%rtrain\nx = 1\nx"]
    try:
        booted, load, start, cell = asyncio.run(_ws_run(url, token, codes, 300))
        assert "[rank 1] 1" in cell["text"], cell["text"]
        asyncio.run(_ws_run(url, token, ["%rtnb stop"], 120))
    finally:
        _http("DELETE", f"{base}/api/kernels/{kernel_id}", token, timeout=60)
    phases = next((line for line in start["text"].splitlines() if "ready in" in line), "?")
    return {
        "kernel_s": booted["idle_at"] - started,
        "load_s": load["idle_at"] - load["sent_at"],
        "start_s": start["idle_at"] - start["sent_at"],
        "cell_s": cell["idle_at"] - cell["sent_at"],
        "total_s": cell["idle_at"] - started,
        "phases": phases,
        "started_warm_ray": "starting the warm Ray" in start["text"],
    }


def cold_start_rtnb_server(open_after_warm: bool) -> tuple[dict, dict]:
    """A fresh Jupyter server with rtnb's server extension (a fresh RTNB_HOME, so no
    warm Ray runs yet), then a notebook's kernel and, after it, a second one.

    ``open_after_warm``: the first kernel starts once the warm Ray that the server
    started is up (a user opening a notebook some seconds after the server); else
    the moment the server answers (a notebook opened with the server)."""
    from _common import free_port
    from _peers import _wait_server

    home = tempfile.mkdtemp(prefix="rtnb-home-")
    workdir = tempfile.mkdtemp(prefix="rtnb-server-")
    port, token = free_port(), secrets.token_hex(16)
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        RTNB_HOME=home,
        RTNB_WARM_RAY_IDLE_S="120",
        JUPYTER_RUNTIME_DIR=os.path.join(workdir, "runtime"),
    )
    log = open(os.path.join(workdir, "server.log"), "wb")
    launched = time.perf_counter()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter_server",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}",
            "--ServerApp.open_browser=False",
            "--ServerApp.allow_root=True",
            f"--ServerApp.root_dir={workdir}",
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=workdir,
        start_new_session=True,
    )
    try:
        _wait_server(base, token, server, 120)
        server_s = time.perf_counter() - launched
        warm_s = None
        if open_after_warm:
            while not list(Path(home, "warm-ray").glob("*.json")):
                if time.perf_counter() - launched > 120:
                    raise RuntimeError("the server started no warm Ray within 120 s")
                time.sleep(0.05)
            warm_s = time.perf_counter() - launched
        first = _server_kernel(base, token)
        # The next notebook a few seconds later, as in cold_start_warm_pair.
        _wait_for_spares(home)
        second = _server_kernel(base, token)
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
        _stop_warm_ray(home)
    first.update(server_start_s=server_s, warm_ray_up_s=warm_s)
    return first, second


def _wait_for_spares(home: str, count: int = 2, timeout_s: float = 120) -> None:
    """Until the warm Ray's pool holds ``count`` spare ranks again, done importing
    torch (it makes them seconds after a kernel claimed its ranks): what "warm" means
    for the next kernel. (Counting spares still importing charged the next kernel
    with their import: ~0.9 s of its 2.3 s.)"""
    import json

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for state in Path(home, "warm-ray").glob("*.json"):
            if json.loads(state.read_text()).get("spares_ready", 0) >= count:
                return
        time.sleep(0.1)
    raise RuntimeError(f"the warm Ray made no {count} spare ranks within {timeout_s:.0f} s")


def _stop_warm_ray(home: str) -> None:
    """SIGTERM the warm Ray's host (it shuts its Ray down) and wait until it is gone."""
    import json
    import signal

    for state in Path(home, "warm-ray").glob("*.json"):
        pid = json.loads(state.read_text())["pid"]
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)


PEERS_VENV = HERE / ".peers-venv"


def _install_peers() -> None:
    """The peers go into an environment of their own that sees this one's packages
    (a .pth file), so jupyter-distributed's server extension is not enabled in the
    servers rtnb is measured with, and nothing of theirs is on rtnb's path."""
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(PEERS_VENV)], check=True)
    peers_site = subprocess.run(
        [
            str(PEERS_VENV / "bin" / "python"),
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(peers_site, "rtnb-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            peers_site,
            "nbdistributed==0.1.0",
            "jupyter-distributed==0.1.1",
        ],
        check=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--install-peers",
        action="store_true",
        help="make the peers' environment (benchmarks/.peers-venv) from PyPI first",
    )
    parser.add_argument("--quick", action="store_true", help="only the rows compared with peers")
    args = parser.parse_args()
    if args.install_peers and not os.path.exists(PEERS_VENV / "bin" / "python"):
        _install_peers()
    peers_python = str(PEERS_VENV / "bin" / "python")
    if not os.path.exists(peers_python):
        sys.exit("no peers' environment: run with --install-peers once")
    import _peers
    from _common import emit, in_order

    print(f"cold_start: fresh kernel -> first result on 2 ranks; {args.rounds} rounds, median")
    modes = ("server_first_at_once", "server_next", "embedded")
    if not args.quick:
        modes += ("server_first", "warm", "warm_first", "eager")
    runs: dict[str, list[dict]] = {
        **{mode: [] for mode in modes},
        "nbdistributed": [],
        "jupyter_distributed": [],
    }

    def rtnb_side() -> None:
        first, second = cold_start_rtnb_server(open_after_warm=False)
        runs["server_first_at_once"].append(first)
        runs["server_next"].append(second)
        runs["embedded"].append(cold_start_rtnb("embedded"))
        if not args.quick:
            first, second = cold_start_rtnb_server(open_after_warm=True)
            runs["server_first"].append(first)
            runs["server_next"].append(second)
            first, warm = cold_start_warm_pair()
            runs["warm_first"].append(first)
            runs["warm"].append(warm)
            runs["eager"].append(cold_start_rtnb("eager"))

    def peer_side() -> None:
        workdir = tempfile.mkdtemp(prefix="peer-")
        runs["nbdistributed"].append(_peers.cold_start_nbdistributed(peers_python, workdir))
        runs["jupyter_distributed"].append(
            _peers.cold_start_jupyter_distributed(peers_python, workdir, process_group_cell=True)
        )

    for _ in range(args.rounds):
        for side in in_order("rtnb", "peers"):
            if side == "rtnb":
                rtnb_side()
            else:
                peer_side()

    def median(name: str, key: str) -> float | None:
        values = [r[key] for r in runs[name] if isinstance(r.get(key), (int, float))]
        return statistics.median(values) if values else None

    print()
    labels = {
        "server_first": "first kernel, server warmed Ray",
        "server_first_at_once": "first kernel, opened with server",
        "server_next": "next kernel, server",
        "warm": "next kernel (warm Ray)",
        "warm_first": "first kernel, no server ext",
        "embedded": "embedded Ray",
        "eager": "embedded, eager imports",
    }
    for name in modes:
        r = runs[name]
        print(
            f"rtnb {labels[name]:33s} total {median(name, 'total_s'):5.2f} s = kernel {median(name, 'kernel_s'):.1f}"
            f" + load_ext {median(name, 'load_s'):.2f} + start {median(name, 'start_s'):.1f}"
            f" + first cell {median(name, 'cell_s'):.2f}   [{r[-1]['phases']}]"
        )
    server = median("server_first_at_once", "server_start_s")
    print(f"rtnb's Jupyter server answered in {server:.2f} s")
    for r in runs["nbdistributed"]:
        first = (r.get("attempts") or [{}])[0]
        print(
            f"{'nbdistributed':22s} total {r.get('total_s') or float('nan'):5.1f} s = kernel "
            f"{r.get('kernel_ready_s') or 0:.1f} + load_ext {r.get('load_ext_s') or 0:.2f} + "
            f"%dist_init {r.get('dist_init_s') or 0:.1f} + cell(s); outcome {r.get('outcome')}"
            f" (first cell: {first.get('outcome')}, {str(first.get('detail', ''))[:70]!r})"
        )
    for r in runs["jupyter_distributed"]:
        pg = r.get("process_group_cell_s")
        group = f"{pg:.1f} s more" if pg is not None else "not measured"
        print(
            f"{'jupyter-distributed':22s} total {r.get('total_s') or float('nan'):5.1f} s = kernel "
            f"{r.get('kernel_post_s') or 0:.1f} + 2 processes {r.get('set_world_size_s') or 0:.1f}"
            f" + cell {r.get('cell_s') or 0:.2f} (server start {r.get('server_start_s') or 0:.1f} s"
            f" before; a gloo process group, which it does not make, "
            f"{group}); outcome {r.get('outcome')}"
            + (f": {r.get('error')}" if r.get("error") else "")
        )

    def ratio(ours: float | None, theirs: float | None) -> float | None:
        return None if ours is None or not theirs else ours / theirs

    # The same work on both sides: torch and a gloo group on 2 ranks. jupyter-
    # distributed makes no group, so its second cell makes one and is counted.
    jd_kernel = median("jupyter_distributed", "total_s")
    jd_group = median("jupyter_distributed", "process_group_cell_s")
    jd_server = median("jupyter_distributed", "server_start_s")
    jd_warm = None if jd_kernel is None or jd_group is None else jd_kernel + jd_group
    jd_cold = None if jd_warm is None or jd_server is None else jd_server + jd_warm
    rtnb_cold = server + median("server_first_at_once", "total_s")
    rtnb_warm = median("server_next", "total_s")
    embedded = median("embedded", "total_s")
    nbd = median("nbdistributed", "total_s")
    rows = (
        (
            "cold: a Jupyter server launched, then its first notebook (clock from the launch)",
            rtnb_cold,
            jd_cold,
            "jupyter-distributed + its gloo group",
        ),
        (
            "warm: a kernel on a running server (rtnb: its next kernel, spares ready)",
            rtnb_warm,
            jd_warm,
            "jupyter-distributed + its gloo group",
        ),
        ("cold: no server (rtnb: Ray embedded in the kernel)", embedded, nbd, "nbdistributed"),
    )
    for label, ours, theirs, peer in rows:
        shown = "failed" if theirs is None else f"{theirs:.2f} s"
        verdict = "" if theirs is None else f" = {ours / theirs:.2f}x"
        print(f"{label}: rtnb {ours:.2f} s vs {peer} {shown}{verdict}")
    # A peer that failed or needed a retry this round is a failed round of the peer,
    # not a slow one (its retries' time is in its total).
    peer_failed = {}
    nbd_failures = [r.get("outcome") for r in runs["nbdistributed"] if r.get("outcome") != "ok"]
    if nbd_failures:
        peer_failed["cold_no_server_ratio"] = f"nbdistributed: {', '.join(nbd_failures)}"
    jd_failures = [
        r.get("outcome") for r in runs["jupyter_distributed"] if r.get("outcome") != "ok"
    ]
    if jd_failures:
        why = f"jupyter-distributed: {', '.join(map(str, jd_failures))}"
        peer_failed.update(cold_server_ratio=why, warm_server_ratio=why)
    emit(
        peer_failed,
        cold_server_ratio=ratio(rtnb_cold, jd_cold),
        warm_server_ratio=ratio(rtnb_warm, jd_warm),
        cold_no_server_ratio=ratio(embedded, nbd),
        warm_server_s=rtnb_warm,
    )


if __name__ == "__main__":
    main()
