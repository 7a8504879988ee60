"""Running a notebook unattended with papermill (``rtnb run`` / ``rtnb demo``)."""

from __future__ import annotations

import ast
import keyword
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from rtnb.errors import CellError, ConfigError

__all__ = ["BatchResult", "parse_parameters", "run_notebook"]


@dataclass
class BatchResult:
    input_path: Path
    output_path: Path
    ok: bool
    message: str = ""


def parse_parameters(pairs: list[tuple[str, str]]) -> dict:
    """``-p NAME VALUE`` pairs to a dict; values are Python literals when they parse.

    Names must be identifiers because papermill writes them into code verbatim.
    """
    params = {}
    for name, raw in pairs:
        if not name.isidentifier() or keyword.iskeyword(name):
            raise ConfigError(
                f"parameter name {name!r} is not a Python identifier (letters, digits, _; "
                "not starting with a digit): papermill inserts names into code as they are"
            )
        try:
            params[name] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            params[name] = raw
    return params


def run_notebook(
    notebook: str | Path,
    output: str | Path | None = None,
    parameters: dict | None = None,
    timeout_s: float | None = None,
    kernel_name: str | None = None,
    cwd: str | Path | None = None,
) -> BatchResult:
    import papermill
    from papermill.exceptions import PapermillExecutionError

    src = Path(notebook)
    if not src.is_file():
        raise ConfigError(f"notebook {str(src)!r} does not exist")
    if src.suffix != ".ipynb":
        raise ConfigError(f"{str(src)!r} is not a .ipynb notebook")
    dst = Path(output) if output else src.with_name(src.stem + ".output.ipynb")
    dst.parent.mkdir(parents=True, exist_ok=True)
    # The kernel runs in the notebook's folder (relative paths in it keep working),
    # but its runs land under the caller's ./rtnb_runs unless told otherwise.
    os.environ.setdefault("RTNB_STORAGE", str(Path("rtnb_runs").resolve()))
    try:
        papermill.execute_notebook(
            str(src),
            str(dst),
            parameters=parameters or {},
            kernel_name=kernel_name,
            execution_timeout=timeout_s,
            log_output=True,
            progress_bar=False,
            stdout_file=sys.stdout,
            stderr_file=sys.stderr,
            cwd=str(cwd) if cwd else str(src.parent),
        )
    except PapermillExecutionError as exc:
        return BatchResult(
            src, dst, False, f"cell {exc.exec_count} failed: {exc.ename}: {exc.evalue}"
        )
    except CellError as exc:
        return BatchResult(src, dst, False, str(exc))
    except Exception as exc:  # noqa: BLE001 - timeouts, dead kernels: report, keep output
        return BatchResult(
            src,
            dst,
            False,
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
        )
    return BatchResult(src, dst, True)
