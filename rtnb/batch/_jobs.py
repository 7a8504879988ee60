"""Notebooks as Ray Jobs: ``rtnb submit`` / ``rtnb jobs`` / ``rtnb logs``.

A submitted job's entrypoint is ``rtnb run`` of the notebook on the cluster (its
head runs the kernel; ``%rtnb start`` in it joins the cluster through the
``RAY_ADDRESS`` that Ray sets for jobs), so a job behaves exactly like a local
batch run: same parameters, exit status, timeout, output notebook kept in the run
directory. The notebook travels as the job's ``working_dir``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from rtnb.batch._runner import check_parameters_cell, check_timeout
from rtnb.core._net import probe_tcp, use_auth_token_if_present
from rtnb.errors import ClusterError, ConfigError, one_line

__all__ = ["JobRow", "default_job_address", "job_logs", "list_jobs", "submit_notebook"]

# Inside a submitted job's working dir: the --storage URI (kept out of its metadata).
STORAGE_FILE = ".rtnb-storage"
# Ray's own `ray job` CLI reads the same variable.
_ADDRESS_ENV = "RAY_API_SERVER_ADDRESS"
_FINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def default_job_address() -> str:
    return os.environ.get(_ADDRESS_ENV) or "http://127.0.0.1:8265"


@dataclass
class JobRow:
    submission_id: str
    status: str
    notebook: str
    start_time: float | None
    end_time: float | None
    message: str


def _client(address: str):
    parsed = urlparse(address if "://" in address else f"http://{address}")
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(f"--address {address!r} is not a Ray dashboard URL; use http://HEAD:8265")
    port = parsed.port or (443 if parsed.scheme == "https" else 8265)
    try:
        probe_tcp(parsed.hostname, port, timeout=5.0)
    except ClusterError:
        raise ClusterError(
            f"no Ray dashboard answers at {address} (the job server runs in the head's "
            "dashboard: start the head with ray[default] installed and check "
            "--dashboard-host/--dashboard-port)"
        ) from None
    use_auth_token_if_present()  # before Ray is imported: it reads the auth mode once
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(f"{parsed.scheme}://{parsed.hostname}:{port}")
    except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError/RuntimeError/...
        raise ClusterError(f"cannot use the Ray job server at {address}: {one_line(exc)}") from None


def _status_name(status) -> str:
    """Ray's JobStatus enum (or its string) as its name: SUCCEEDED, FAILED, ..."""
    return str(getattr(status, "value", status))


def submit_notebook(
    notebook: str | Path,
    address: str,
    parameters: dict | None = None,
    storage: str | None = None,
    timeout_s: float | None = None,
    working_dir: str | Path | None = None,
) -> str:
    """Submit ``rtnb run NOTEBOOK`` as a Ray Job; returns the submission id.

    Everything a user can get wrong (notebook path, parameter names, address) is
    checked here, before the cluster is asked to do anything.
    """
    src = Path(notebook).resolve()
    if not src.is_file() or src.suffix != ".ipynb":
        raise ConfigError(f"notebook {str(notebook)!r} does not exist or is not a .ipynb file")
    # What the job would refuse, refused here, before the cluster is asked anything.
    parameters = dict(parameters or {})
    check_parameters_cell(src, parameters)
    check_timeout(timeout_s)
    relative = src.name
    if working_dir is not None:
        folder = Path(working_dir).resolve()
        try:
            relative = str(src.relative_to(folder))
        except ValueError:
            raise ConfigError(
                f"the notebook {str(src)!r} is not inside --working-dir {str(folder)!r}"
            ) from None
    client = _client(address)
    staged = tempfile.mkdtemp(prefix="rtnb-job-")
    if working_dir is None:
        # Only the notebook travels, not whatever else sits in its folder.
        shutil.copy2(src, staged)
    else:
        shutil.copytree(folder, staged, dirs_exist_ok=True)
    command = ["rtnb", "run", relative]
    if storage:
        # The storage URI may hold credentials: it travels inside the uploaded
        # working dir, never in the job's entrypoint, env or metadata (which the
        # dashboard and `ray job list` show).
        Path(staged, STORAGE_FILE).write_text(storage)
        command += ["--storage-file", STORAGE_FILE]
    for name, value in parameters.items():
        # The job's `rtnb run` reads each value back as a Python literal.
        command += ["-p", name, repr(value)]
    if timeout_s is not None:
        command += ["--timeout", f"{timeout_s:g}"]
    runtime_env: dict = {"working_dir": staged}
    stem = re.sub(r"[^A-Za-z0-9_-]+", "-", src.stem)[:40] or "notebook"
    submission_id = f"rtnb-{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    try:
        return client.submit_job(
            entrypoint=shlex.join(command),
            runtime_env=runtime_env,
            submission_id=submission_id,
            metadata={"rtnb": "notebook", "notebook": src.name},
        )
    except Exception as exc:  # noqa: BLE001 - Ray's HTTP errors
        raise ClusterError(f"the job server refused the job: {one_line(exc)}") from None
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def list_jobs(address: str, include_all: bool = False) -> list[JobRow]:
    """The notebook jobs rtnb submitted (every job with ``include_all``), oldest first."""
    client = _client(address)
    try:
        jobs = client.list_jobs()
    except Exception as exc:  # noqa: BLE001
        raise ClusterError(f"cannot list jobs at {address}: {one_line(exc)}") from None
    rows = []
    for job in jobs:
        metadata = job.metadata or {}
        if not include_all and metadata.get("rtnb") != "notebook":
            continue
        rows.append(
            JobRow(
                submission_id=job.submission_id or job.job_id or "?",
                status=_status_name(job.status),
                notebook=metadata.get("notebook", job.entrypoint or ""),
                start_time=job.start_time / 1000 if job.start_time else None,
                end_time=job.end_time / 1000 if job.end_time else None,
                message=(job.message or "").strip().splitlines()[0] if job.message else "",
            )
        )
    return sorted(rows, key=lambda r: r.start_time or 0)


def job_logs(address: str, submission_id: str, follow: bool, write) -> str:
    """Write the job's logs with ``write`` (following them until the job ends when
    ``follow``); returns its final (or current) status."""
    client = _client(address)
    try:
        status = client.get_job_status(submission_id)
    except Exception as exc:  # noqa: BLE001 - unknown ids come back as HTTP errors
        raise ConfigError(
            f"no job {submission_id!r} at {address} ({one_line(exc)}); see `rtnb jobs`"
        ) from None
    if not follow:
        write(client.get_job_logs(submission_id))
        return _status_name(status)

    import asyncio

    async def tail() -> None:
        async for chunk in client.tail_job_logs(submission_id):
            write(chunk)

    asyncio.run(tail())
    # The log stream ends when the job does; its status lands a moment later.
    deadline = time.monotonic() + 30
    while True:
        status = _status_name(client.get_job_status(submission_id))
        if status in _FINAL or time.monotonic() > deadline:
            return status
        time.sleep(0.5)
