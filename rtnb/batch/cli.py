"""The ``rtnb`` command line.

rtnb demo                      run notebooks/quickstart.ipynb on an embedded local Ray
rtnb demo --copy [DIR]         copy the example notebooks into DIR to open in JupyterLab
rtnb run NOTEBOOK.ipynb [-p NAME VALUE]... [-o OUT.ipynb] [--timeout S] [--kernel K]
rtnb submit NOTEBOOK.ipynb --address http://HEAD:8265 [-p NAME VALUE]... [--wait]
rtnb jobs [--address URL] | rtnb logs JOB [--address URL] [--follow]
rtnb runs [STORAGE] | rtnb checkpoints RUN [--storage S]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rtnb.core._redact import redact_uri
from rtnb.core._startup import defer_unused_imports
from rtnb.core._text import format_table
from rtnb.errors import ConfigError, RtnbError

__all__ = ["main"]


def _notebook_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """What `rtnb run` and `rtnb submit` share: the notebook, its parameters, the timeout."""
    parser.add_argument("notebook")
    parser.add_argument(
        "-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE")
    )
    parser.add_argument(
        "-f",
        "--parameters-file",
        action="append",
        default=[],
        metavar="FILE.yaml",
        help="parameters from a YAML file (as papermill's -f)",
    )
    parser.add_argument(
        "-y",
        "--parameters-yaml",
        action="append",
        default=[],
        metavar="YAML",
        help="parameters as YAML text; merged: files, then -y, then -p",
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds per cell")
    return parser


def _address_option(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from rtnb.batch._jobs import default_job_address

    parser.add_argument(
        "--address",
        default=default_job_address(),
        help="the head's dashboard URL (default $RAY_API_SERVER_ADDRESS or %(default)s)",
    )
    return parser


class _Parser(argparse.ArgumentParser):
    """argparse, but a mistake is one line (not usage text plus the error)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def _versions() -> str:
    """rtnb's version, and those of what it runs on (what a bug report needs), from
    the installed packages' metadata: nothing is imported."""
    from rtnb import __version__
    from rtnb.core._installed import versions_here

    found = versions_here()
    return (
        f"rtnb {__version__} (Python {found['python']}, Ray {found['ray']}, torch {found['torch']})"
    )


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="rtnb", description="Interactive distributed PyTorch on Ray, from notebooks"
    )
    parser.add_argument("--version", action="version", version=_versions())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = sub.add_parser("demo", help="run the quickstart notebook on an embedded local Ray")
    demo.add_argument(
        "-o",
        "--output",
        default=None,
        help="output notebook (default rtnb_runs/demo/quickstart.output.ipynb)",
    )
    demo.add_argument(
        "--copy",
        nargs="?",
        const="rtnb-examples",
        default=None,
        metavar="DIR",
        help="copy the example notebooks (quickstart, resume, sweep, ...) into DIR "
        "(default rtnb-examples) instead of running one",
    )

    run = _notebook_options(sub.add_parser("run", help="execute a notebook with papermill"))
    run.add_argument("-o", "--output", default=None)
    run.add_argument(
        "--storage-file",
        default=None,
        help="read the storage path/URI (default $RTNB_STORAGE) from this file: keeps a URI "
        "with credentials out of process listings (rtnb submit uses it)",
    )
    run.add_argument(
        "--kernel", default=None, help="kernel name (default: the notebook's, in this Python)"
    )
    submit = _address_option(
        _notebook_options(
            sub.add_parser("submit", help="run a notebook on a Ray cluster as a Ray Job")
        )
    )
    submit.add_argument(
        "--storage",
        default=os.environ.get("RTNB_STORAGE"),
        help="where the job's runs go (default $RTNB_STORAGE); use storage the cluster "
        "shares, e.g. s3://bucket/runs",
    )
    submit.add_argument(
        "--working-dir", default=None, help="upload this folder (holding the notebook) too"
    )
    submit.add_argument(
        "--wait", action="store_true", help="follow the logs; exit 0 only if the job succeeds"
    )
    jobs = _address_option(
        sub.add_parser("jobs", help="list notebook jobs submitted with rtnb submit")
    )
    jobs.add_argument("--all", action="store_true", help="every Ray job, not only rtnb's")
    logs = sub.add_parser("logs", help="print (or --follow) a submitted job's logs")
    logs.add_argument("job")
    _address_option(logs)
    logs.add_argument("-f", "--follow", action="store_true", help="until the job ends")

    runs = sub.add_parser("runs", help="list the runs in a storage path")
    runs.add_argument("storage", nargs="?", default=None)
    runs.add_argument(
        "--metric", default=None, help="add each run's last and best value of this metric"
    )

    ckpts = sub.add_parser("checkpoints", help="list a run's checkpoints")
    ckpts.add_argument("run")
    ckpts.add_argument("--storage", default=None)
    ckpts.add_argument("--all", action="store_true", help="also show incomplete ones")

    warm = sub.add_parser(
        "warm", help="the warm Ray notebooks share: status (default), or stop to end it now"
    )
    warm.add_argument("action", nargs="?", default="status", choices=("status", "stop"))
    for name, text in (
        ("ps", "the detached groups (run, ranks, state, step, since, resources held)"),
        ("attach", "follow a detached group's running cell in text (Ctrl-C leaves it running)"),
        ("stop", "free a detached group: its cell, its ranks, its CPUs/GPUs"),
    ):
        detached = sub.add_parser(name, help=text)
        if name != "ps":
            detached.add_argument("run")
        detached.add_argument(
            "--address", default=None, help="the cluster (default: this machine's warm Ray)"
        )
    warm.add_argument(
        "--force",
        action="store_true",
        help="stop it even while kernels use it (their sessions end)",
    )
    return parser


def _warm_command(action: str, force: bool) -> int:
    # The public face, as a notebook would: batch code never reaches into the driver.
    from rtnb import stop_warm_ray, warm_ray_status

    if action == "stop":
        stopped = stop_warm_ray(force=force)
        for status in stopped:
            print(f"rtnb: stopped the warm Ray at {status.address} (pid {status.pid})")
        if not stopped:
            print("rtnb: no warm Ray is running")
        return 0
    running = warm_ray_status()
    for status in running:
        print(status.summary())
    if not running:
        print("rtnb: no warm Ray is running (the next notebook's `%rtnb start` starts one)")
    return 0


def _storage(value: str | None) -> str:
    from rtnb.core._config import SessionConfig

    return SessionConfig(storage=value).storage_path


def _print_runs(storage: str, metric: str | None) -> int:
    from rtnb.storage._result import list_runs, read_run_metrics

    table = list_runs(storage)
    if metric is None or not table.runs:
        print(table)
        return 0
    from rtnb.metrics._compare import format_rows, runs_rows
    from rtnb.metrics._store import MetricsStore

    stores = {r.name: MetricsStore.from_rows(read_run_metrics(storage, r.name)) for r in table.runs}
    if not any(metric in s.metric_names() for s in stores.values()):
        raise ConfigError(f"no run in {redact_uri(storage)} reported {metric!r}")
    head, lines = format_rows(runs_rows(table.runs, stores, metric), metric)
    print("\n".join([head, *lines]))
    return 0


def _print_checkpoints(run: str, storage: str, include_incomplete: bool) -> int:
    from rtnb.core._config import check_name
    from rtnb.errors import ConfigError
    from rtnb.storage._checkpoints import CheckpointInfo, CheckpointStore
    from rtnb.storage._layout import RUN_RECORD
    from rtnb.storage._rundir import RunDirectory

    check_name(run, "RUN")

    run_dir = RunDirectory(storage, run)
    if not run_dir.exists(RUN_RECORD):
        shown = redact_uri(storage)
        raise ConfigError(f"no run {run!r} in {shown} (see `rtnb runs {shown}`)")
    rows = CheckpointStore(run_dir).list(include_incomplete)
    if not rows:
        print(f"run {run!r} has no checkpoints")
        return 0
    print(CheckpointInfo.table(rows))
    return 0


def _print_jobs(rows) -> None:
    import time

    if not rows:
        print("no notebook jobs on this cluster (rtnb submit NOTEBOOK --address ...)")
        return
    table = [["job", "status", "notebook", "started", "ended", "message"]]

    def when(t):
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"

    for r in rows:
        table.append(
            [r.submission_id, r.status, r.notebook, when(r.start_time), when(r.end_time), r.message]
        )
    print(format_table(table))


def _jobs_command(args) -> int:
    from rtnb.batch import _jobs

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    if args.command == "jobs":
        _print_jobs(_jobs.list_jobs(args.address, include_all=args.all))
        return 0
    if args.command == "logs":
        status = _jobs.job_logs(args.address, args.job, args.follow, write)
        print(f"rtnb: job {args.job} is {status}", file=sys.stderr)
        return 0
    job = _jobs.submit_notebook(
        args.notebook,
        args.address,
        _parameters(args),
        storage=args.storage,
        timeout_s=args.timeout,
        working_dir=args.working_dir,
    )
    print(f"rtnb: submitted {job}")
    if not args.storage:
        print(
            "rtnb: no --storage (nor $RTNB_STORAGE): the job's run directory stays on the "
            "head node, in the job's working directory",
            file=sys.stderr,
        )
    if not args.wait:
        print(f"rtnb: follow it with `rtnb logs {job} --follow --address {args.address}`")
        return 0
    status = _jobs.job_logs(args.address, job, True, write)
    print(f"rtnb: job {job} {status}", file=sys.stderr if status != "SUCCEEDED" else sys.stdout)
    return 0 if status == "SUCCEEDED" else 1


def _parameters(args: argparse.Namespace) -> dict:
    from rtnb.batch._runner import collect_parameters

    return collect_parameters(
        args.parameters_file, args.parameters_yaml, [tuple(p) for p in args.parameter]
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # papermill imports nbformat, and with it jsonschema's unused IRI grammar: ~2.5 s
    # before `rtnb run` could even say that a notebook does not exist.
    defer_unused_imports()
    from rtnb.batch._runner import example_notebook, run_notebook

    try:
        if args.command in ("submit", "jobs", "logs"):
            return _jobs_command(args)
        if args.command == "warm":
            return _warm_command(args.action, args.force)
        if args.command in ("ps", "attach", "stop"):
            from rtnb.batch._detached_cli import detached_command

            return detached_command(args.command, getattr(args, "run", None), args.address)
        if args.command == "runs":
            return _print_runs(_storage(args.storage), args.metric)
        if args.command == "checkpoints":
            return _print_checkpoints(args.run, _storage(args.storage), args.all)
        if args.command == "demo" and args.copy is not None:
            from rtnb.batch._runner import copy_examples

            copied = copy_examples(Path(args.copy))
            for path in copied:
                print(f"rtnb: {path}")
            print(f"rtnb: open {copied[0].parent / 'quickstart.ipynb'} in JupyterLab to begin")
            return 0
        if args.command == "demo":
            output = Path(
                args.output or Path("rtnb_runs") / "demo" / "quickstart.output.ipynb"
            ).resolve()
            with example_notebook("quickstart.ipynb") as notebook:
                result = run_notebook(notebook, output, cwd=output.parent)
        else:
            if args.storage_file:
                try:
                    os.environ["RTNB_STORAGE"] = Path(args.storage_file).read_text().strip()
                except OSError as exc:
                    raise ConfigError(
                        f"--storage-file {args.storage_file!r} cannot be read ({exc.strerror})"
                    ) from None
            result = run_notebook(
                args.notebook,
                args.output,
                parameters=_parameters(args),
                timeout_s=args.timeout,
                kernel_name=args.kernel,
            )
    except RtnbError as exc:
        print(f"rtnb: {exc}", file=sys.stderr)
        return 2
    shown = result.kept_in[:2]
    kept = "".join(f"\nrtnb: a copy is kept in the run directory: {k}" for k in shown)
    if len(result.kept_in) > len(shown):
        # A sweep's trials are runs too: each keeps the notebook that made it.
        kept += f"\nrtnb: ... and in {len(result.kept_in) - len(shown)} more run directories"
    for run in result.detached:
        print(
            f"rtnb: run {run!r} was started --detached and is left running on purpose: "
            f"`rtnb attach {run}` follows it, `rtnb stop {run}` frees it"
        )
    if result.ok:
        print(
            f"rtnb: {result.input_path.name} ran to completion; output notebook: "
            f"{result.output_path}{kept}"
        )
        return 0
    print(f"rtnb: {result.input_path.name} failed: {result.message}", file=sys.stderr)
    print(f"rtnb: output notebook (kept): {result.output_path}{kept}", file=sys.stderr)
    return result.exit_code or 1


if __name__ == "__main__":
    sys.exit(main())
