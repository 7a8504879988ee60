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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from rtnb._batch import parse_parameters, run_notebook

    try:
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
    if result.ok:
        print(
            f"rtnb: {result.input_path.name} ran to completion; output notebook: {result.output_path}"
        )
        return 0
    print(f"rtnb: {result.input_path.name} failed: {result.message}", file=sys.stderr)
    print(f"rtnb: output notebook (kept): {result.output_path}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
