"""The ``rtnb`` command line.

rtnb demo                      run notebooks/quickstart.ipynb on an embedded local Ray
rtnb run NOTEBOOK.ipynb [-p NAME VALUE]... [-o OUT.ipynb] [--timeout S] [--kernel K]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rtnb.errors import RtnbError

__all__ = ["main"]

_REPO_NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rtnb", description="Interactive distributed PyTorch on Ray, from notebooks"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the quickstart notebook on an embedded local Ray")
    demo.add_argument(
        "-o",
        "--output",
        default=None,
        help="output notebook (default rtnb_runs/demo/quickstart.output.ipynb)",
    )

    run = sub.add_parser("run", help="execute a notebook with papermill")
    run.add_argument("notebook")
    run.add_argument(
        "-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE")
    )
    run.add_argument("-o", "--output", default=None)
    run.add_argument("--timeout", type=float, default=None, help="seconds per cell")
    run.add_argument(
        "--kernel", default=None, help="kernel name (default: the notebook's, in this Python)"
    )
    runs = sub.add_parser("runs", help="list the runs in a storage path")
    runs.add_argument("storage", nargs="?", default=None)

    ckpts = sub.add_parser("checkpoints", help="list a run's checkpoints")
    ckpts.add_argument("run")
    ckpts.add_argument("--storage", default=None)
    ckpts.add_argument("--all", action="store_true", help="also show incomplete ones")
    return parser


def _storage(value: str | None) -> str:
    from rtnb._config import SessionConfig

    return SessionConfig(storage=value).storage_path


def _print_checkpoints(run: str, storage: str, include_incomplete: bool) -> int:
    import time

    from rtnb._checkpoints import CheckpointStore
    from rtnb._rundir import RunDirectory
    from rtnb.errors import ConfigError

    run_dir = RunDirectory(storage, run)
    if not run_dir.exists("run.json"):
        raise ConfigError(f"no run {run!r} in {storage} (see `rtnb runs {storage}`)")
    rows = CheckpointStore(run_dir).list(include_incomplete)
    if not rows:
        print(f"run {run!r} has no checkpoints")
        return 0
    metrics = sorted({k for c in rows for k in c.metrics})
    table = [["id", "step", "time", *metrics, "MB", "ranks", "status"]]
    for c in rows:
        table.append(
            [
                c.id,
                str(c.step),
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.time)) if c.time else "-",
            ]
            + [
                f"{c.metrics[m]:.4g}" if isinstance(c.metrics.get(m), (int, float)) else ""
                for m in metrics
            ]
            + [f"{c.size / 1e6:.1f}", ",".join(map(str, c.ranks)), c.status]
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from rtnb._batch import parse_parameters, run_notebook

    try:
        if args.command == "runs":
            from rtnb._result import list_runs

            print(list_runs(_storage(args.storage)))
            return 0
        if args.command == "checkpoints":
            return _print_checkpoints(args.run, _storage(args.storage), args.all)
        if args.command == "demo":
            notebook = _REPO_NOTEBOOKS / "quickstart.ipynb"
            output = Path(
                args.output or Path("rtnb_runs") / "demo" / "quickstart.output.ipynb"
            ).resolve()
            result = run_notebook(notebook, output, cwd=output.parent)
        else:
            result = run_notebook(
                args.notebook,
                args.output,
                parameters=parse_parameters([tuple(p) for p in args.parameter]),
                timeout_s=args.timeout,
                kernel_name=args.kernel,
            )
    except RtnbError as exc:
        print(f"rtnb: {exc}", file=sys.stderr)
        return 2
    kept = "".join(f"\nrtnb: a copy is kept in the run directory: {k}" for k in result.kept_in)
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
