"""Running a notebook unattended with papermill (``rtnb run`` / ``rtnb demo``).

Stopping is graceful in every case: a cell past ``--timeout``, and the first SIGTERM
or Ctrl-C, interrupt the kernel, which stops the ranks at a common step as a
notebook interrupt does (committed checkpoints stay; nothing half-written is
listed); papermill then saves the output notebook and shuts the kernel down, whose
exit stops the worker group. A second signal stops without waiting.
"""

from __future__ import annotations

import ast
import contextlib
import json
import keyword
import os
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from rtnb.core._changes import CHANGES_ENV, CHANGES_MIME, CellChanges
from rtnb.core._redact import is_secret_name, redact_uri
from rtnb.errors import CellError, ConfigError, one_line
from rtnb.storage._layout import notebook
from rtnb.storage._rundir import BATCH_RUNS_ENV, RunDirectory

__all__ = [
    "BatchResult",
    "KernelChoice",
    "check_timeout",
    "collect_parameters",
    "parse_parameters",
    "run_notebook",
]


@dataclass
class BatchResult:
    input_path: Path
    output_path: Path
    ok: bool
    message: str = ""
    exit_code: int = 0
    kept_in: list[str] = field(default_factory=list)  # copies under the run directories
    # Runs whose group the notebook started --detached: left running on purpose.
    detached: list[str] = field(default_factory=list)


_INTERRUPTED = ("CellInterrupted", "KeyboardInterrupt", "CellStopped")


class _Terminator:
    """First SIGTERM/SIGINT: interrupt the kernel (a graceful stop of the cell and its
    ranks); a second one, or ``grace_s`` without the run ending (a kernel that ignores
    interrupts, or a signal that fell between two cells): stop waiting
    (KeyboardInterrupt here; papermill then shuts the kernel down)."""

    def __init__(self, grace_s: float = 60.0) -> None:
        self.grace_s = grace_s
        self.signal: int | None = None
        self._finished = threading.Event()
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _Terminator:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        self._finished.set()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, _frame) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signum
        name = signal.Signals(signum).name
        print(
            f"rtnb: {name}: stopping the running cell and its worker group "
            "(committed checkpoints are kept; send it again to stop at once)",
            file=sys.stderr,
            flush=True,
        )
        for pid in _kernel_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)
        threading.Thread(target=self._give_up_later, daemon=True).start()

    def _give_up_later(self) -> None:
        import _thread

        if not self._finished.wait(self.grace_s):
            _thread.interrupt_main()

    @property
    def exit_code(self) -> int:
        return 128 + self.signal if self.signal else 1


def _kernel_pids() -> list[int]:
    """The Jupyter kernels this process started (jupyter_client puts them in their
    own session, so a terminal's signals never reach them by themselves)."""
    import psutil

    pids = []
    for child in psutil.Process().children(recursive=False):
        with contextlib.suppress(psutil.Error):
            if any("kernel" in part for part in child.cmdline()):
                pids.append(child.pid)
    return pids


def _keep_in_run_dirs(output: Path, runs_file: str) -> tuple[list[str], list[str]]:
    """Copy the output notebook into every run directory the notebook started; the
    copies, and the runs whose groups were started detached."""
    kept: list[str] = []
    try:
        lines = Path(runs_file).read_text().splitlines()
    except OSError:
        return kept, []
    finally:
        with contextlib.suppress(OSError):
            os.remove(runs_file)
    detached = []
    for line in lines:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            record = json.loads(line)
            if record.get("detached") and record["run"] not in detached:
                detached.append(record["run"])
    if not output.exists():
        return kept, detached
    data = output.read_bytes()
    # Sessions announce their storage masked; the real one is the runner's own.
    ours = os.environ.get("RTNB_STORAGE", "")
    for line in dict.fromkeys(lines):  # each run once, in order
        with contextlib.suppress(ValueError, KeyError, OSError, ConfigError):
            where = json.loads(line)
            storage = ours if ours and redact_uri(ours) == where["storage"] else where["storage"]
            run_dir = RunDirectory(storage, where["run"])
            if run_dir.shown(notebook(output.name)) not in kept:
                kept.append(run_dir.write_bytes(notebook(output.name), data))
    return kept, detached


def _check_parameter_name(name: str) -> None:
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ConfigError(
            f"parameter name {name!r} is not a Python identifier (letters, digits, _; "
            "not starting with a digit): papermill inserts names into code as they are"
        )
    if is_secret_name(name):
        # papermill writes parameters into the output notebook as code.
        raise ConfigError(
            f"parameter {name!r} looks like a secret, and parameters are written into "
            "the output notebook: pass it as an environment variable instead and read "
            "it with os.environ in the notebook"
        )


def parse_parameters(pairs: list[tuple[str, str]]) -> dict:
    """``-p NAME VALUE`` pairs to a dict; values are Python literals when they parse.

    Names must be identifiers because papermill writes them into code verbatim.
    """
    params = {}
    for name, raw in pairs:
        _check_parameter_name(name)
        try:
            params[name] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            params[name] = raw
    return params


def collect_parameters(
    files: list[str] = (), yamls: list[str] = (), pairs: list[tuple[str, str]] = ()
) -> dict:
    """``-f FILE.yaml``, ``-y YAML`` and ``-p NAME VALUE`` merged in that order (a later
    one wins, as papermill merges them), each name checked as ``-p``'s are."""
    import yaml

    merged: dict = {}
    for where, text in [(f"parameters file {f!r}", _read_parameters_file(f)) for f in files] + [
        (f"-y {y!r}", y) for y in yamls
    ]:
        try:
            values = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" (line {mark.line + 1})" if mark is not None else ""
            raise ConfigError(f"{_masked(where)} is not valid YAML{at}") from None
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(
                f"{_masked(where)} must be a mapping of names to values (name: value per line)"
            )
        for name in values:
            _check_parameter_name(str(name))
        merged.update({str(k): v for k, v in values.items()})
    merged.update(parse_parameters(pairs))
    return merged


def _read_parameters_file(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"parameters file {path!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"parameters file {path!r} cannot be read: {one_line(exc)}") from None


def _masked(where: str) -> str:
    # -y text may hold a value that must not be echoed: name only the option.
    return "-y" if where.startswith("-y") else where


def check_timeout(timeout_s: float | None) -> None:
    if timeout_s is not None and timeout_s <= 0:
        raise ConfigError(f"--timeout must be a positive number of seconds, not {timeout_s:g}")


# The kernel of the Python running rtnb: jupyter_client's native kernel spec
# (ipykernel in this environment), needing no registration.
NATIVE_KERNEL = "python3"


@contextlib.contextmanager
def example_notebook(name: str):
    """A path to one of the example notebooks shipped inside the package."""
    from importlib import resources

    with resources.as_file(resources.files("rtnb.notebooks") / name) as path:
        yield path


def copy_examples(target: Path) -> list[Path]:
    """The example notebooks shipped inside the package, copied into ``target`` to
    open in JupyterLab (a pip install has no clone to find them in). A file already
    there is kept, and the copy refused in one line naming it."""
    from importlib import resources

    shipped = sorted(
        (f for f in resources.files("rtnb.notebooks").iterdir() if f.name.endswith(".ipynb")),
        key=lambda f: f.name,
    )
    there = [target / f.name for f in shipped if (target / f.name).exists()]
    if there:
        raise ConfigError(
            f"{there[0]} already exists: rtnb demo --copy writes its notebooks into a "
            "folder without them (give another folder, or move those away)"
        )
    try:
        target.mkdir(parents=True, exist_ok=True)
        copied = []
        for f in shipped:
            (target / f.name).write_bytes(f.read_bytes())
            copied.append(target / f.name)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the example notebooks into {target}: {exc.strerror}"
        ) from None
    return copied


def saved_changes(notebook: dict) -> list[CellChanges]:
    """The live-change records in a notebook's outputs, in cell order."""
    found = []
    for cell in notebook.get("cells", []):
        for output in cell.get("outputs", []) or []:
            record = (output.get("data") or {}).get(CHANGES_MIME)
            if isinstance(record, dict):
                with contextlib.suppress(ValueError, TypeError):
                    found.append(CellChanges.from_json(record))
    return found


def _write_saved_changes(notebook: dict) -> str | None:
    found = saved_changes(notebook)
    if not found:
        return None
    fd, path = tempfile.mkstemp(prefix="rtnb-changes-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as dst:
        json.dump([c.to_json() for c in found], dst)
    return path


def read_notebook(path: Path) -> dict:
    """The notebook's JSON, or one ConfigError line saying what is wrong with it."""
    try:
        notebook = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{str(path)!r} is not a notebook: it is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{str(path)!r} is not a notebook: not valid JSON (line {exc.lineno}: {exc.msg})"
        ) from None
    if not isinstance(notebook, dict) or not isinstance(notebook.get("cells"), list):
        raise ConfigError(f"{str(path)!r} is not a notebook: it has no list of cells")
    return notebook


def check_parameters_cell(path: Path, parameters: dict | None) -> None:
    """``-p`` goes into the cell tagged ``parameters``; without one, refuse (papermill
    would silently put the values before the first cell)."""
    if not parameters:
        return
    cells = read_notebook(path)["cells"]
    if not any("parameters" in (c.get("metadata", {}).get("tags") or []) for c in cells):
        raise ConfigError(
            f"{path.name} has no cell tagged 'parameters' for -p "
            f"{', '.join(parameters)}: tag the cell that sets their defaults "
            "(JupyterLab: property inspector → Cell Tags → parameters)"
        )


@dataclass(frozen=True)
class KernelChoice:
    name: str
    # papermill needs it to write parameters; a notebook written by nbformat,
    # jupytext or VS Code may name none.
    language: str


def choose_kernel(path: Path, requested: str | None) -> KernelChoice:
    """``--kernel``, else the notebook's kernelspec, else this Python's kernel; a
    kernel that does not exist gets one line listing those that do. The language is
    the notebook's, else the kernel's (Python for this Python's kernel)."""
    metadata = read_notebook(path).get("metadata") or {}
    kernelspec = metadata.get("kernelspec") or {}
    said = kernelspec.get("language") or (metadata.get("language_info") or {}).get("name")
    name = requested or kernelspec.get("name")
    if not name:
        # Written by nbformat, jupytext, VS Code, ...: no kernelspec.
        return KernelChoice(NATIVE_KERNEL, said or "python")
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    manager = KernelSpecManager()
    try:
        spec = manager.get_kernel_spec(name)
    except NoSuchKernel:
        known = manager.find_kernel_specs()
        raise ConfigError(
            f"the notebook asks for kernel {name!r}, which is not installed here; "
            f"installed: {', '.join(sorted(known)) or 'none'}. Pass --kernel NAME"
        ) from None
    return KernelChoice(name, (spec.language if requested else said) or spec.language or "python")


def _local_kernel_manager() -> type:
    """The kernel manager for the kernels rtnb starts itself: they talk over Unix
    sockets in Jupyter's runtime folder, which only this user can open, rather than
    unencrypted TCP on loopback (ipykernel warns of it on every start)."""
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    class LocalKernelManager(AsyncKernelManager):
        @default("transport")
        def _transport_default(self) -> str:
            return "ipc"

    return LocalKernelManager


def run_notebook(
    notebook: str | Path,
    output: str | Path | None = None,
    parameters: dict | None = None,
    timeout_s: float | None = None,
    kernel_name: str | None = None,
    cwd: str | Path | None = None,
) -> BatchResult:
    """Execute ``notebook`` with papermill; never raises for what happens in it."""
    import papermill
    from papermill.exceptions import PapermillExecutionError

    src = Path(notebook)
    if not src.is_file():
        raise ConfigError(f"notebook {str(src)!r} does not exist")
    if src.suffix != ".ipynb":
        raise ConfigError(f"{str(src)!r} is not a .ipynb notebook")
    check_timeout(timeout_s)
    kernel = choose_kernel(src, kernel_name)
    check_parameters_cell(src, parameters)
    dst = Path(output) if output else src.with_name(src.stem + ".output.ipynb")
    dst.parent.mkdir(parents=True, exist_ok=True)
    # The kernel runs in the notebook's folder (relative paths in it keep working),
    # but its runs land under the caller's ./rtnb_runs unless told otherwise.
    os.environ.setdefault("RTNB_STORAGE", str(Path("rtnb_runs").resolve()))
    fd, runs_file = tempfile.mkstemp(prefix="rtnb-batch-runs-")
    os.close(fd)
    os.environ[BATCH_RUNS_ENV] = runs_file
    # The notebook a session's --mlflow logs at its stop (papermill writes the output
    # notebook as the cells run; it is whole only once they are done).
    os.environ["RTNB_NOTEBOOK"] = str(src.resolve())
    # Live changes the saved notebook's cells received: made again at their steps.
    changes_file = _write_saved_changes(read_notebook(src))
    if changes_file is not None:
        os.environ[CHANGES_ENV] = changes_file
    ok, message, code = True, "", 0
    with _Terminator() as terminator:
        try:
            papermill.execute_notebook(
                str(src),
                str(dst),
                parameters=parameters or {},
                kernel_name=kernel.name,
                kernel_manager_class=_local_kernel_manager(),
                language=kernel.language,
                execution_timeout=timeout_s,
                # past the timeout, interrupt (the ranks stop cleanly), then fail
                interrupt_on_timeout=True,
                log_output=True,
                progress_bar=False,
                stdout_file=sys.stdout,
                stderr_file=sys.stderr,
                cwd=str(cwd) if cwd else str(src.parent),
            )
        except PapermillExecutionError as exc:
            ok, code = False, 1
            message = f"cell [{exc.exec_count}] failed: {exc.ename}: {exc.evalue}"
            if terminator.signal is None and timeout_s and exc.ename in _INTERRUPTED:
                message = (
                    f"cell [{exc.exec_count}] ran past --timeout {timeout_s:g} s and was stopped"
                )
        except CellError as exc:
            ok, code, message = False, 1, str(exc)
        except KeyboardInterrupt:
            ok, message = False, "stopped without waiting for the cell (second signal)"
        except Exception as exc:  # noqa: BLE001 - dead kernels and the like: report, keep output
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            ok, code, message = False, 1, f"{type(exc).__name__}: {first}"
        finally:
            os.environ.pop(BATCH_RUNS_ENV, None)
            os.environ.pop("RTNB_NOTEBOOK", None)
            if changes_file is not None:
                os.environ.pop(CHANGES_ENV, None)
                with contextlib.suppress(OSError):
                    os.unlink(changes_file)
    if terminator.signal is not None:
        ok, code = False, terminator.exit_code
        name = signal.Signals(terminator.signal).name
        message = f"stopped by {name}" + (f" ({message})" if message else "")
    kept, detached = _keep_in_run_dirs(dst, runs_file)
    return BatchResult(src, dst, ok, message, code, kept, detached)
