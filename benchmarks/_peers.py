"""Cold start of rtnb's two PyPI peers, driven the way a notebook user meets them.

Each function starts everything it needs from nothing, returns timings (seconds) and
an ``outcome``, and stops every process it started, also when the peer fails: a peer
that fails or hangs is a result to report, not a crash of the benchmark.

nbdistributed 0.1.0 (IPython magics inside an ordinary kernel):
  ``%load_ext nbdistributed``; ``%dist_init -n 2`` (starts ``python .../worker.py``
  twice, ``python`` looked up on PATH; gloo without CUDA; then a fixed 2 s sleep; no
  wait for the workers to connect); ``%%distributed`` cells. A cell's per-rank
  results come back as the kernel's own stdout: a line ``🔹 Rank N:`` and under it
  that rank's output lines indented by two spaces (``  2``).

jupyter-distributed 0.1.1 (a Jupyter *server* extension):
  ``POST /jupyter-distributed/kernels/{kernel_id}`` with ``{"action": "set",
  "world_size": 2}`` restarts the kernel as a proxy that launches 2 ordinary
  ipykernels (env RANK, WORLD_SIZE, MASTER_ADDR/PORT; no process group is made) and
  answers once the proxy replied to kernel_info, which is what starts the ranks.
  Every cell then runs on all ranks; the proxy publishes ``display_data`` (live,
  first rank output) and ``update_display_data`` (final) whose data holds
  ``application/vnd.jupyter-distributed.rank+json`` = ``{"ranks": [{"rank": r,
  "status": "ok", "outputs": [{"rank": r, "type": "execute_result", "content":
  {...}}]}]}`` and a ``text/plain`` rendering ``[Rank r — ok]\\n2``.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import secrets
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from _common import free_port

STEP_TIMEOUT_S = 120.0

# ---------------------------------------------------------------------------- shared


def _probe(python: str, modules: list[str], dists: list[str]) -> dict[str, Any]:
    """Which modules ``python`` lacks and which peer versions it has (without
    importing them: torch would cost seconds), so a missing peer is one clear line."""
    script = (
        "import importlib.util as u, importlib.metadata as md, json, sys\n"
        "mods = [m for m in sys.argv[1].split(',') if m]\n"
        "missing = [m for m in mods if u.find_spec(m) is None]\n"
        "versions = {}\n"
        "for d in [d for d in sys.argv[2].split(',') if d]:\n"
        "    try:\n"
        "        versions[d] = md.version(d)\n"
        "    except md.PackageNotFoundError:\n"
        "        versions[d] = None\n"
        "print(json.dumps({'missing': missing, 'versions': versions}))\n"
    )
    try:
        done = subprocess.run(
            [python, "-c", script, ",".join(modules), ",".join(dists)],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError) as error:
        return {"missing": modules, "versions": {}, "error": f"{type(error).__name__}: {error}"}
    if done.returncode != 0:
        return {"missing": modules, "versions": {}, "error": done.stderr.strip()[-500:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _python_shim(python: str, directory: Path) -> Path:
    """A folder whose ``python`` runs the given interpreter. A script, not a symlink:
    a symlinked venv python outside its venv would lose the venv's packages."""
    directory.mkdir(parents=True, exist_ok=True)
    shim = directory / "python"
    shim.write_text(f'#!/bin/sh\nexec "{python}" "$@"\n')
    shim.chmod(0o755)
    return directory


def _env_with_path(prefix: Path) -> dict[str, str]:
    """This process's environment with ``prefix`` first on PATH."""
    env = dict(os.environ)
    env["PATH"] = f"{prefix}{os.pathsep}{env.get('PATH', '')}"
    return env


class _Descendants:
    """Every process seen below a root, remembered so that none outlives the run:
    kernels start their own sessions and get re-parented when a parent dies, so
    neither a process-group kill nor the parent's own shutdown reaches them all."""

    def __init__(self, root_pid: int | None) -> None:
        self.root_pid = root_pid
        self.seen: dict[int, Any] = {}

    def snapshot(self) -> None:
        if self.root_pid is None:
            return
        try:
            import psutil

            for child in psutil.Process(self.root_pid).children(recursive=True):
                self.seen.setdefault(child.pid, child)
        except Exception:  # the root is gone or psutil is missing: keep what we have
            pass

    def sweep(self, grace_s: float = 5.0) -> list[str]:
        """Terminate (then kill) the remembered processes still running; their names."""
        try:
            import psutil
        except ImportError:
            return []
        alive = []
        for process in self.seen.values():
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(process)
            except psutil.Error:
                pass
        names = []
        for process in alive:
            try:
                names.append(f"{process.pid}:{process.name()}")
            except psutil.Error:
                names.append(str(process.pid))
            try:
                process.terminate()
            except psutil.Error:
                pass
        _gone, still = psutil.wait_procs(alive, timeout=grace_s)
        for process in still:
            try:
                process.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(still, timeout=grace_s)
        return names


def _fail(result: dict[str, Any], outcome: str, error: str) -> dict[str, Any]:
    result["ok"] = False
    result["outcome"] = outcome
    result["error"] = error
    return result


def _why(run: _CellRun) -> str:
    """Why a cell never went idle, or "" when it did."""
    if run.died:
        return "the kernel process exited"
    if run.timed_out:
        return f"no idle within {time.perf_counter() - run.sent_at:.0f} s"
    return ""


def _tail(text: str, limit: int = 800) -> str:
    text = text.strip()
    return text if len(text) <= limit else "…" + text[-limit:]


# --------------------------------------------------------------------- nbdistributed


@dataclass
class _CellRun:
    """What one execute_request produced on iopub, with perf_counter stamps."""

    sent_at: float
    stdout: str = ""
    stderr: str = ""
    error: str | None = None
    done_at: float | None = None  # the watch() condition first held
    idle_at: float | None = None
    timed_out: bool = False
    died: bool = False  # the kernel process exited before the cell went idle

    @property
    def text(self) -> str:
        return self.stdout + self.stderr + (f"\n{self.error}" if self.error else "")


def _run_kernel_cell(
    client: Any,
    code: str,
    timeout: float,
    watch: Callable[[_CellRun], bool] | None = None,
    alive: Callable[[], bool] | None = None,
) -> _CellRun:
    """Execute ``code`` and collect its iopub output until idle or ``timeout``.

    Results are judged from iopub (not execute_reply) because nbdistributed's magics
    print their errors and still reply "ok"."""
    run = _CellRun(sent_at=time.perf_counter())
    msg_id = client.execute(code, stop_on_error=False)
    deadline = run.sent_at + timeout
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            run.timed_out = True
            return run
        try:
            msg = client.get_iopub_msg(timeout=min(left, 1.0))
        except queue.Empty:
            if alive is not None and not alive():
                run.died = True
                return run
            continue
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind, content = msg.get("msg_type"), msg.get("content", {})
        if kind == "stream":
            if content.get("name") == "stderr":
                run.stderr += content.get("text", "")
            else:
                run.stdout += content.get("text", "")
        elif kind == "error":
            run.error = f"{content.get('ename')}: {content.get('evalue')}"
        elif kind in ("execute_result", "display_data"):
            run.stdout += str(content.get("data", {}).get("text/plain", "")) + "\n"
        if run.done_at is None and watch is not None and watch(run):
            run.done_at = time.perf_counter()
        if kind == "status" and content.get("execution_state") == "idle":
            run.idle_at = time.perf_counter()
            return run


_NBD_HEADER = re.compile(r"Rank (\d+):\s*$")
_NBD_ERRORS = (
    "Error executing distributed code",
    "Error on Rank",
    "No distributed workers running",
)


def _nbd_rank_lines(stdout: str) -> dict[int, list[str]]:
    """nbdistributed's per-rank stdout sections: ``🔹 Rank N:`` then ``  line``s."""
    sections: dict[int, list[str]] = {}
    current: int | None = None
    for line in stdout.splitlines():
        header = _NBD_HEADER.search(line)
        if header and not line.startswith("  ") and "Error" not in line:
            current = int(header.group(1))
            sections.setdefault(current, [])
        elif current is not None and line.startswith("  "):
            sections[current].append(line.strip())
        elif line.strip():
            current = None
    return sections


def _nbd_has_results(stdout: str, expected: dict[int, str]) -> set[int]:
    sections = _nbd_rank_lines(stdout)
    return {rank for rank, want in expected.items() if want in sections.get(rank, [])}


def cold_start_nbdistributed(
    python: str,
    workdir: str,
    *,
    step_timeout: float = STEP_TIMEOUT_S,
    cell_attempts: int = 2,
) -> dict[str, Any]:
    """Fresh kernel -> ``%load_ext nbdistributed`` -> ``%dist_init -n 2`` -> a
    ``%%distributed`` ``1+1`` cell, until both ranks printed ``2``.

    ``total_s`` runs from the kernel start request to both ranks' results. A cell that
    fails is re-run up to ``cell_attempts`` times, as a user would (nbdistributed's
    first cell can be lost when the workers have not connected yet: a ZMQ ROUTER drops
    messages to peers it does not know, and the magic waits 30 s for replies); every
    attempt is listed in ``attempts`` and ``total_s`` includes the failed ones.
    """
    result: dict[str, Any] = {"peer": "nbdistributed", "ok": False, "outcome": "not_started"}
    try:
        from jupyter_client.kernelspec import KernelSpecManager
        from jupyter_client.manager import KernelManager
    except ImportError as error:
        return _fail(result, "missing_modules", f"the benchmark's python: {error}")
    os.makedirs(workdir, exist_ok=True)
    probe = _probe(python, ["nbdistributed", "ipykernel", "torch", "zmq"], ["nbdistributed"])
    result["versions"] = probe.get("versions", {})
    if probe.get("missing"):
        detail = probe.get("error") or f"not importable by {python}: {', '.join(probe['missing'])}"
        return _fail(result, "missing_modules", detail)

    run_dir = Path(tempfile.mkdtemp(prefix="nbdistributed-", dir=workdir))
    # A kernelspec of our own so the kernel runs exactly ``python`` (jupyter_client 8
    # has no kernel_cmd any more), and a shim so the workers' bare ``python`` does too.
    kernel_dir = run_dir / "kernels" / "peer-python"
    kernel_dir.mkdir(parents=True)
    argv = [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (kernel_dir / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "peer python", "language": "python"})
    )
    env = _env_with_path(_python_shim(python, run_dir / "bin"))
    env.pop("RAY_ADDRESS", None)

    manager = KernelManager(
        kernel_name="peer-python",
        kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(run_dir / "kernels")]),
    )
    client = None
    tracker = _Descendants(None)
    hung = False
    started = time.perf_counter()
    try:
        manager.start_kernel(cwd=workdir, env=env)
        tracker.root_pid = getattr(manager.provisioner, "pid", None)
        client = manager.client()
        client.start_channels()
        try:
            client.wait_for_ready(timeout=step_timeout)
        except RuntimeError as error:
            return _fail(result, "kernel_failed", str(error))
        result["kernel_ready_s"] = time.perf_counter() - started

        load = _run_kernel_cell(
            client, "%load_ext nbdistributed", step_timeout, alive=manager.is_alive
        )
        if load.timed_out or load.error:
            hung = load.timed_out
            return _fail(result, "load_ext_failed", load.error or _why(load))
        result["load_ext_s"] = load.idle_at - load.sent_at

        init = _run_kernel_cell(client, "%dist_init -n 2", step_timeout, alive=manager.is_alive)
        tracker.snapshot()
        result["dist_init_s"] = None if init.idle_at is None else init.idle_at - init.sent_at
        if init.idle_at is None or "Successfully started 2 workers" not in init.stdout:
            hung = init.timed_out
            return _fail(result, "dist_init_failed", _why(init) or _tail(init.text))

        expected = {0: "2", 1: "2"}
        attempts: list[dict[str, Any]] = []
        result["attempts"] = attempts
        for _ in range(max(1, cell_attempts)):
            cell = _run_kernel_cell(
                client,
                "%%distributed\n1+1",
                step_timeout,
                watch=lambda run: _nbd_has_results(run.stdout, expected) == set(expected),
                alive=manager.is_alive,
            )
            tracker.snapshot()
            attempt: dict[str, Any] = {
                "result_s": None if cell.done_at is None else cell.done_at - cell.sent_at,
                "idle_s": None if cell.idle_at is None else cell.idle_at - cell.sent_at,
                "ranks_with_result": sorted(_nbd_has_results(cell.stdout, expected)),
            }
            attempts.append(attempt)
            if cell.done_at is not None:
                attempt["outcome"] = "ok"
                result.pop("error", None)
                result.update(
                    ok=True,
                    outcome="ok" if len(attempts) == 1 else "ok_after_retry",
                    first_result_s=attempt["result_s"],
                    total_s=cell.done_at - started,
                )
                break
            if cell.idle_at is None:
                attempt["outcome"] = "timeout" if cell.timed_out else "kernel_died"
                hung = cell.timed_out
                _fail(result, f"cell_{attempt['outcome']}", _why(cell) + "; " + _tail(cell.text))
                break
            attempt["outcome"] = "error"
            attempt["detail"] = _tail(cell.text, 400)
            known = any(marker in cell.text for marker in _NBD_ERRORS)
            _fail(result, "cell_error", attempt["detail"] if known else _tail(cell.text))
        return result
    except Exception as error:
        return _fail(result, "exception", f"{type(error).__name__}: {error}")
    finally:
        cleanup_started = time.perf_counter()
        tracker.snapshot()
        if client is not None:
            try:
                client.stop_channels()
            except Exception:
                pass
        try:
            if manager.has_kernel:
                # A hung cell would only delay a polite shutdown request.
                manager.shutdown_kernel(now=hung)
        except Exception as error:
            result["cleanup_error"] = f"{type(error).__name__}: {error}"
            try:
                manager.shutdown_kernel(now=True)
            except Exception:
                pass
        result["leftover_processes"] = tracker.sweep()
        result["cleanup_s"] = time.perf_counter() - cleanup_started


# --------------------------------------------------------------- jupyter-distributed

_RANK_MIME = "application/vnd.jupyter-distributed.rank+json"
_PLAIN_RANK = re.compile(r"^\[Rank (\d+) \S+ (\w+)\]\n?(.*?)(?=\n\n\[Rank |\Z)", re.S | re.M)


class _PeerError(Exception):
    """A step of the peer failed; ``outcome`` names the step for the report."""

    def __init__(self, outcome: str, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http(
    method: str, url: str, token: str, body: Any = None, timeout: float = 30.0
) -> tuple[int, Any]:
    """One REST call to the local server (never through an http_proxy from the env)."""
    data = None
    if method in ("POST", "PUT", "PATCH"):
        data = json.dumps({} if body is None else body).encode()
    request = urllib.request.Request(
        url,
        data=data,
        method=method,
        headers={"Authorization": f"token {token}", "Content-Type": "application/json"},
    )
    try:
        with _NO_PROXY.open(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, raw = error.code, error.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


def _wait_server(base: str, token: str, server: subprocess.Popen, timeout: float) -> None:
    """Poll /api/status until the server answers; fail early if it exited."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if server.poll() is not None:
            raise _PeerError("server_failed", f"server exited with code {server.returncode}")
        try:
            status, _ = _http("GET", f"{base}/api/status", token, timeout=2.0)
            if status == 200:
                return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.05)
    raise _PeerError("server_failed", f"server did not answer within {timeout} s")


def _ws_decode(raw: str | bytes) -> dict[str, Any]:
    """A message of Jupyter's legacy websocket protocol: JSON text, or (when it has
    buffers) a binary frame whose first part is the JSON message."""
    if isinstance(raw, str):
        return json.loads(raw)
    count = int.from_bytes(raw[:4], "big")
    offsets = [int.from_bytes(raw[4 * (i + 1) : 4 * (i + 2)], "big") for i in range(count)]
    end = offsets[1] if count > 1 else len(raw)
    return json.loads(raw[offsets[0] : end].decode())


def _ws_request(code: str | None, session_id: str, msg_id: str) -> str:
    """An execute request of ``code``, or with None a kernel_info request (which a
    kernel answers once it has booted)."""
    header = {
        "msg_id": msg_id,
        "msg_type": "execute_request" if code is not None else "kernel_info_request",
        "username": "benchmark",
        "session": session_id,
        "date": datetime.now(timezone.utc).isoformat(),
        "version": "5.3",
    }
    content = (
        {
            "code": code,
            "silent": False,
            "store_history": True,
            "user_expressions": {},
            "allow_stdin": False,
            "stop_on_error": True,
        }
        if code is not None
        else {}
    )
    return json.dumps(
        {
            "header": header,
            "parent_header": {},
            "metadata": {},
            "content": content,
            "channel": "shell",
            "buffers": [],
        }
    )


def _jd_rank_results(content: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """rank -> {"status", "results" (execute_result texts), "errors"} from one of the
    proxy's display messages; the text/plain rendering is the fallback."""
    data = content.get("data") or {}
    payload = data.get(_RANK_MIME)
    ranks: dict[int, dict[str, Any]] = {}
    if isinstance(payload, dict):
        for entry in payload.get("ranks", []):
            results, errors = [], []
            for output in entry.get("outputs", []):
                body = output.get("content") or {}
                if output.get("type") == "execute_result":
                    results.append(str((body.get("data") or {}).get("text/plain", "")).strip())
                elif output.get("type") == "error":
                    errors.append(f"{body.get('ename')}: {body.get('evalue')}")
            ranks[int(entry.get("rank", -1))] = {
                "status": entry.get("status"),
                "results": results,
                "errors": errors,
            }
        return ranks
    plain = data.get("text/plain")
    if isinstance(plain, str):
        for match in _PLAIN_RANK.finditer(plain):
            lines = match.group(3).strip().splitlines()
            ranks[int(match.group(1))] = {
                "status": match.group(2),
                "results": [lines[-1].strip()] if lines else [],
                "errors": [],
            }
    return ranks


async def _ws_cells(
    url: str, token: str, session_id: str, cells: list[tuple[str, dict[int, str]]], timeout: float
) -> dict[str, Any]:
    """Run ``cells`` one after another over one kernel websocket, as a notebook does;
    perf_counter stamps of each cell's first rank result, all ranks' results, idle."""
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    record: dict[str, Any] = {"cells": []}
    opened = time.perf_counter()
    request = HTTPRequest(
        url,
        headers={"Authorization": f"token {token}"},
        connect_timeout=timeout,
        request_timeout=timeout,
    )
    connection = await asyncio.wait_for(websocket_connect(request), timeout)
    record["ws_connect_s"] = time.perf_counter() - opened
    try:
        for code, expected in cells:
            msg_id = uuid.uuid4().hex
            cell: dict[str, Any] = {"code": code, "sent_at": time.perf_counter()}
            record["cells"].append(cell)
            seen: dict[int, dict[str, Any]] = {}
            plain_results: list[str] = []
            connection.write_message(_ws_request(code, session_id, msg_id))
            deadline = cell["sent_at"] + timeout
            while "idle_at" not in cell or "reply" not in cell:
                left = deadline - time.perf_counter()
                if left <= 0:
                    cell["timed_out"] = True
                    break
                try:
                    raw = await asyncio.wait_for(connection.read_message(), left)
                except asyncio.TimeoutError:
                    cell["timed_out"] = True
                    break
                if raw is None:
                    cell["closed"] = True
                    break
                msg = _ws_decode(raw)
                if (msg.get("parent_header") or {}).get("msg_id") != msg_id:
                    continue
                now = time.perf_counter()
                kind = msg.get("msg_type") or (msg.get("header") or {}).get("msg_type")
                content = msg.get("content") or {}
                if kind in ("display_data", "update_display_data", "execute_result"):
                    ranks = _jd_rank_results(content)
                    if not ranks and kind == "execute_result":
                        plain_results.append(str((content.get("data") or {}).get("text/plain")))
                    seen.update(ranks)
                    done = {
                        rank
                        for rank, want in expected.items()
                        if want in seen.get(rank, {}).get("results", [])
                    }
                    if done and "first_rank_at" not in cell:
                        cell["first_rank_at"] = now
                    if done == set(expected) and "all_ranks_at" not in cell:
                        cell["all_ranks_at"] = now
                elif kind == "error":
                    cell["error"] = f"{content.get('ename')}: {content.get('evalue')}"
                elif kind == "execute_reply":
                    cell["reply"] = {key: content.get(key) for key in ("status", "ename", "evalue")}
                elif kind == "status" and content.get("execution_state") == "idle":
                    cell["idle_at"] = now
            cell["ranks"] = seen
            if plain_results:
                cell["undistributed_results"] = plain_results
            if cell.get("timed_out") or cell.get("closed"):
                break
    finally:
        connection.close()
    return record


def _describe_cell(cell: dict[str, Any], expected: dict[int, str]) -> tuple[str, str]:
    """The outcome of one websocket cell and a line explaining a failure."""
    if "all_ranks_at" in cell:
        return "ok", ""
    if cell.get("timed_out"):
        return "cell_timeout", f"ranks with a result: {sorted(cell.get('ranks', {}))}"
    if cell.get("closed"):
        return "cell_error", "the kernel websocket closed"
    if cell.get("undistributed_results"):
        return "not_distributed", f"plain result {cell['undistributed_results']} (no rank output)"
    reply = cell.get("reply") or {}
    ranks = {
        rank: (info.get("status"), info.get("results"), info.get("errors"))
        for rank, info in cell.get("ranks", {}).items()
    }
    return "cell_error", _tail(
        f"reply {reply.get('status')} {reply.get('ename')}: {reply.get('evalue')}; "
        f"ranks {ranks}; expected {expected}; {cell.get('error') or ''}"
    )


def cold_start_jupyter_distributed(
    python: str,
    workdir: str,
    *,
    step_timeout: float = STEP_TIMEOUT_S,
    process_group_cell: bool = False,
) -> dict[str, Any]:
    """Fresh Jupyter server -> a python3 kernel -> world size 2 through the
    extension's REST call -> a ``1+1`` cell over the kernel websocket, until both
    ranks' ``2`` arrived.

    ``server_start_s`` (launch to /api/status answering) is separate; ``total_s`` runs
    from the kernel start request (POST /api/kernels) to both ranks' results, and
    ``total_incl_server_s`` adds the server start. jupyter-distributed makes no torch
    process group; ``process_group_cell=True`` times one more cell that makes a gloo
    group on both ranks (``process_group_cell_s``, not part of ``total_s``), for a
    comparison with peers whose start includes one.
    """
    result: dict[str, Any] = {"peer": "jupyter-distributed", "ok": False, "outcome": "not_started"}
    os.makedirs(workdir, exist_ok=True)
    probe = _probe(
        python, ["jupyter_distributed", "jupyter_server", "ipykernel"], ["jupyter-distributed"]
    )
    result["versions"] = probe.get("versions", {})
    if probe.get("missing"):
        detail = probe.get("error") or f"not importable by {python}: {', '.join(probe['missing'])}"
        return _fail(result, "missing_modules", detail)

    run_dir = Path(tempfile.mkdtemp(prefix="jupyter-distributed-", dir=workdir))
    port, token = free_port(), secrets.token_hex(24)
    base = f"http://127.0.0.1:{port}"
    env = _env_with_path(_python_shim(python, run_dir / "bin"))
    env.pop("RAY_ADDRESS", None)
    # Connection files and the extension's orphan registry stay in this run's folder.
    env["JUPYTER_RUNTIME_DIR"] = str(run_dir / "runtime")
    command = [
        python,
        "-m",
        "jupyter_server",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        "--ServerApp.open_browser=False",
        # CI and this VM run as root; the server refuses that without the flag.
        "--ServerApp.allow_root=True",
        f"--ServerApp.root_dir={workdir}",
        # Enabled by the wheel's jupyter_server_config.d file too; said here in case
        # that file is not on this environment's config path.
        "--ServerApp.jpserver_extensions=jupyter_distributed=True",
    ]
    log_path = run_dir / "server.log"
    kernel_id: str | None = None
    with open(log_path, "wb") as log:
        started = time.perf_counter()
        try:
            server = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=workdir,
                start_new_session=True,  # our signals to it do not reach its kernels
            )
        except OSError as error:
            return _fail(result, "server_failed", f"{type(error).__name__}: {error}")
        tracker = _Descendants(server.pid)
        try:
            _wait_server(base, token, server, step_timeout)
            result["server_start_s"] = time.perf_counter() - started
            status, health = _http("GET", f"{base}/jupyter-distributed/health", token)
            if status != 200:
                raise _PeerError(
                    "extension_not_loaded", f"GET /jupyter-distributed/health: {status}"
                )
            result["extension_version"] = (health or {}).get("version")

            kernel_started = time.perf_counter()
            status, model = _http(
                "POST", f"{base}/api/kernels", token, {"name": "python3"}, timeout=step_timeout
            )
            if status not in (200, 201) or not isinstance(model, dict) or "id" not in model:
                raise _PeerError("kernel_failed", f"POST /api/kernels: {status} {model}")
            kernel_id = str(model["id"])
            result["kernel_post_s"] = time.perf_counter() - kernel_started
            tracker.snapshot()

            resize_started = time.perf_counter()
            try:
                status, described = _http(
                    "POST",
                    f"{base}/jupyter-distributed/kernels/{kernel_id}",
                    token,
                    {"action": "set", "world_size": 2},
                    timeout=step_timeout,
                )
            except OSError as error:  # our socket timed out: the restart hangs
                raise _PeerError(
                    "set_world_size_failed", f"{type(error).__name__}: {error}"
                ) from error
            result["set_world_size_s"] = time.perf_counter() - resize_started
            tracker.snapshot()
            if status != 200:
                raise _PeerError("set_world_size_failed", f"{status}: {_tail(str(described))}")
            result["world_size_model"] = described
            if not (isinstance(described, dict) and described.get("world_size") == 2):
                raise _PeerError("set_world_size_failed", f"unexpected model {described}")

            cells: list[tuple[str, dict[int, str]]] = [("1+1", {0: "2", 1: "2"})]
            if process_group_cell:
                cells.append(
                    (
                        "import torch.distributed as dist\n"
                        "if not dist.is_initialized():\n"
                        "    dist.init_process_group('gloo')\n"
                        "dist.get_rank()",
                        {0: "0", 1: "1"},
                    )
                )
            session_id = uuid.uuid4().hex
            ws_url = (
                f"ws://127.0.0.1:{port}/api/kernels/{kernel_id}/channels"
                f"?session_id={session_id}&token={token}"
            )
            try:
                record = asyncio.run(_ws_cells(ws_url, token, session_id, cells, step_timeout))
            except Exception as error:
                raise _PeerError("websocket_failed", f"{type(error).__name__}: {error}") from error
            tracker.snapshot()
            result["ws_connect_s"] = record.get("ws_connect_s")
            first = record["cells"][0]
            outcome, detail = _describe_cell(first, cells[0][1])
            if "first_rank_at" in first:
                result["first_rank_result_s"] = first["first_rank_at"] - first["sent_at"]
            if "idle_at" in first:
                result["cell_idle_s"] = first["idle_at"] - first["sent_at"]
            if outcome != "ok":
                raise _PeerError(outcome, detail)
            result["cell_s"] = first["all_ranks_at"] - first["sent_at"]
            result["total_s"] = first["all_ranks_at"] - kernel_started
            result["total_incl_server_s"] = result["total_s"] + result["server_start_s"]
            result.update(ok=True, outcome="ok")
            if process_group_cell:
                if len(record["cells"]) > 1:
                    pg = record["cells"][1]
                    pg_outcome, pg_detail = _describe_cell(pg, cells[1][1])
                    result["process_group_outcome"] = pg_outcome
                    if pg_outcome == "ok":
                        result["process_group_cell_s"] = pg["all_ranks_at"] - pg["sent_at"]
                    else:
                        result["process_group_error"] = pg_detail
                else:
                    result["process_group_outcome"] = "not_run"
        except _PeerError as error:
            _fail(result, error.outcome, str(error))
        except Exception as error:
            _fail(result, "exception", f"{type(error).__name__}: {error}")
        finally:
            cleanup_started = time.perf_counter()
            tracker.snapshot()
            # The server's own shutdown of the kernel first (the proxy stops its ranks),
            # then the server; what still runs after that is swept below.
            if server.poll() is None and kernel_id is not None:
                try:
                    _http("DELETE", f"{base}/api/kernels/{kernel_id}", token, timeout=60.0)
                except Exception as error:
                    result["cleanup_error"] = f"DELETE kernel: {type(error).__name__}: {error}"
            if server.poll() is None:
                try:
                    _http("POST", f"{base}/api/shutdown", token, timeout=15.0)
                except Exception:
                    pass  # it may drop the connection while stopping
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.terminate()
                try:
                    server.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait(timeout=10)
            result["leftover_processes"] = tracker.sweep()
            result["cleanup_s"] = time.perf_counter() - cleanup_started
    if not result["ok"]:
        result["server_log_tail"] = _tail(log_path.read_text(errors="replace")).replace(
            token, "<token>"
        )
    return result
