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
import os
import queue
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
        time.sleep(8)
        return first, cold_start_rtnb("warm", home)
    finally:
        _stop_warm_ray(home)


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--install-peers", action="store_true")
    args = parser.parse_args()
    if args.install_peers:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "nbdistributed==0.1.0",
                "jupyter-distributed==0.1.1",
            ],
            check=True,
        )
    import _peers

    print(f"cold_start: fresh kernel -> first result on 2 ranks; {args.rounds} rounds, median")
    modes = ("warm", "warm_first", "embedded", "eager")
    runs: dict[str, list[dict]] = {
        **{mode: [] for mode in modes},
        "nbdistributed": [],
        "jupyter_distributed": [],
    }
    for _ in range(args.rounds):
        first, warm = cold_start_warm_pair()
        runs["warm_first"].append(first)
        runs["warm"].append(warm)
        runs["embedded"].append(cold_start_rtnb("embedded"))
        runs["eager"].append(cold_start_rtnb("eager"))
        workdir = tempfile.mkdtemp(prefix="peer-")
        runs["nbdistributed"].append(_peers.cold_start_nbdistributed(sys.executable, workdir))
        runs["jupyter_distributed"].append(
            _peers.cold_start_jupyter_distributed(sys.executable, workdir, process_group_cell=True)
        )

    def median(name: str, key: str) -> float | None:
        values = [r[key] for r in runs[name] if isinstance(r.get(key), (int, float))]
        return statistics.median(values) if values else None

    print()
    labels = {
        "warm": "rtnb (warm Ray)",
        "warm_first": "rtnb (first kernel)",
        "embedded": "rtnb (embedded Ray)",
        "eager": "rtnb (embedded, eager)",
    }
    for name in modes:
        r = runs[name]
        label = labels[name]
        print(
            f"{label:22s} total {median(name, 'total_s'):5.1f} s = kernel {median(name, 'kernel_s'):.1f}"
            f" + load_ext {median(name, 'load_s'):.2f} + start {median(name, 'start_s'):.1f}"
            f" + first cell {median(name, 'cell_s'):.2f}   [{r[-1]['phases']}]"
        )
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
    rtnb_total = median("warm", "total_s")
    for name in ("nbdistributed", "jupyter_distributed"):
        peer = median(name, "total_s")
        if peer is not None:
            print(f"rtnb vs {name}: {rtnb_total:.1f} s vs {peer:.1f} s = {rtnb_total / peer:.2f}x")
    pg = median("jupyter_distributed", "process_group_cell_s")
    peer = median("jupyter_distributed", "total_s")
    if pg is not None and peer is not None:
        print(
            f"rtnb vs jupyter-distributed with a gloo group made in a second cell: "
            f"{rtnb_total:.1f} s vs {peer + pg:.1f} s = {rtnb_total / (peer + pg):.2f}x"
        )
    print(
        f"goal: rtnb total <= 4.0 s -> {rtnb_total:.1f} s with the warm Ray; "
        f"{median('warm_first', 'total_s'):.1f} s for the kernel that starts it; "
        f"{median('embedded', 'total_s'):.1f} s embedded"
    )


if __name__ == "__main__":
    main()
