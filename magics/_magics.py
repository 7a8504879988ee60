"""The magics: parse arguments, call :class:`rtnb.Session`, display the result.

They hold no logic of their own beyond that, so everything they do is also
available from Python through ``rtnb.Session``.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import re
import shlex
from collections.abc import Iterator
from types import SimpleNamespace

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display
from rtnb.magics._help import (
    Subcommand,
    complete,
    full_help,
    parser_flags,
    reference_markdown,
    subcommand_help,
)
from rtnb.widgets import (
    CheckpointBrowser,
    LiveMetrics,
    LiveOnFirstReport,
    NotebookOutput,
    ProgressLines,
    RankLog,
    RunsDashboard,
    SweepProgress,
    SweepView,
    profile_figure,
    runs_bundle,
    show_static_figure,
    static_figure_bundle,
    stop_asking,
)

from rtnb.core._changes import control_value
from rtnb.core._config import (
    BACKENDS,
    FILE_MODES,
    STRATEGIES,
    SessionConfig,
    declared_defaults,
    parse_workers,
)
from rtnb.core._output import print_sink
from rtnb.core._redact import redact_uri
from rtnb.driver import (
    RunAccess,
    Session,
    Sweep,
    attach,
    open_run,
    stop_warm_ray,
    sweep,
    warm_ray_status,
)
from rtnb.errors import CellError, ConfigError, SessionError
from rtnb.metrics._store import MetricsStore
from rtnb.storage import CheckpointInfo, list_runs

__all__ = ["SUBCOMMANDS", "RtnbMagics", "completer", "reference"]


def _ranks_option(func):
    return argument(
        "--ranks",
        default=None,
        help="ranks to use, e.g. 0,1 or 0-3 (default: all)",
    )(func)


def _split_option(func):
    return argument(
        "--split",
        default=None,
        metavar="NAME,...",
        help=(
            "split only these datasets across the ranks; the others go whole to every "
            "rank (Ray Train's DataConfig(datasets_to_split=...))"
        ),
    )(func)


def _split_names(args) -> list[str] | None:
    """``--split a,b`` as ["a", "b"]; given without datasets to split, a UsageError."""
    if args.split is None:
        return None
    if not getattr(args, "datasets", None) and not getattr(args, "pairs", None):
        raise UsageError("--split goes with datasets: --datasets train=A,val=B --split train")
    return [n.strip() for n in args.split.split(",") if n.strip()]  # '': none split


def _cell_options(func):
    """Options shared by %%rtrain and %rtrain."""
    for decorator in reversed(
        [
            argument("--background", action="store_true", help="return at once; see `%%rtnb wait`"),
            argument("--timeout", type=float, default=None, help="stop the cell after S seconds"),
            argument("--quiet", action="store_true", help="do not show the ranks' output"),
            argument("--no-live", action="store_true", help="no live widget (plain output)"),
            argument("--steps", type=int, default=None, help="total steps, for progress and ETA"),
            argument(
                "--once",
                action="store_true",
                help="never replay this cell (after a failure, a scale, --replay)",
            ),
            argument(
                "--datasets",
                default=None,
                metavar="NAME=VAR,...",
                help="Ray Datasets for rtnb.get_dataset_shard(NAME), e.g. train=train_ds",
            ),
            _split_option,
            _ranks_option,
        ]
    ):
        func = decorator(func)
    return func


_DEFAULTS = SessionConfig()  # the one place start's defaults come from
# What start's parser offers: the declared defaults (the backend stays undecided until
# the options are validated: nccl with --gpu, else gloo).
_DECLARED = SimpleNamespace(**declared_defaults())


def _workers(text: str) -> int | tuple[int, int]:
    """``--workers`` and ``%rtnb scale``'s size: N, MIN-MAX (elastic) or 0 (local)."""
    try:
        return parse_workers(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@magic_arguments()
@argument(
    "--workers",
    type=_workers,
    default=_DECLARED.workers,
    help=(
        f"number of ranks (default {_DEFAULTS.workers}); MIN-MAX: elastic, as many as the "
        "cluster places up to MAX; 0: local mode, one rank in this kernel, where "
        "breakpoint() and %%debug reach the training code"
    ),
)
@argument("--gpu", action="store_true", help="one GPU per rank; nccl backend")
@argument(
    "--cpus-per-worker",
    type=float,
    default=_DECLARED.cpus_per_worker,
    help=f"CPUs reserved per rank (default {_DEFAULTS.cpus_per_worker:g})",
)
@argument("--strategy", default=_DECLARED.strategy, help="placement: " + "|".join(STRATEGIES))
@argument(
    "--address",
    default=_DECLARED.address,
    help="auto, HOST:PORT or ray://HOST:PORT (default: embedded local Ray)",
)
@argument(
    "--storage", default=_DECLARED.storage, help="where run directories go (default ./rtnb_runs)"
)
@argument("--name", default=_DECLARED.name, help="run name (default run-DATE-TIME)")
@argument(
    "--backend",
    default=_DECLARED.backend,
    help="|".join(BACKENDS) + " (default gloo, nccl with --gpu)",
)
@argument(
    "--max-failures",
    type=int,
    default=_DECLARED.max_failures,
    help="group restarts allowed after a rank dies",
)
@argument("--keep", type=int, default=_DECLARED.keep, help="checkpoints to keep")
@argument("--score", default=_DECLARED.score, help="metric that ranks checkpoints")
@argument("--mode", default=_DECLARED.mode, help="min|max for --score")
@argument("--tensorboard", action="store_true", help="also write TensorBoard event files")
@argument(
    "--mlflow",
    nargs="?",
    const="",
    default=_DECLARED.mlflow,
    metavar="URI",
    help="log to MLflow (default store: mlflow.db in the run directory)",
)
@argument(
    "--allow-local-storage",
    action="store_true",
    help="a local --storage path is shared by all nodes",
)
@argument(
    "--stop-grace",
    dest="stop_grace_s",
    type=float,
    default=_DECLARED.stop_grace_s,
    help="seconds an interrupted cell gets per stop phase",
)
@argument(
    "--hang-after",
    dest="hang_after_s",
    type=float,
    default=_DECLARED.hang_after_s,
    metavar="S",
    help="show every rank's stack when a cell reports and prints nothing for S s (0: off)",
)
@argument(
    "--replay",
    action="store_true",
    help="rebuild the ranks' state from the journal of run --name (a new kernel)",
)
@argument(
    "--listen",
    default=_DECLARED.listen,
    help="address an embedded Ray listens on (default 127.0.0.1, loopback only)",
)
@argument(
    "--files",
    default=_DECLARED.files,
    choices=FILE_MODES,
    help=(
        "the notebook's folder on ranks whose node cannot see it: auto (copy it there, "
        "kept in step before each cell), ship (copy to every rank), off"
    ),
)
@argument(
    "--excludes",
    default=_DECLARED.excludes,
    metavar="PATTERN,...",
    help="leave these out of the copied folder (as in .gitignore), e.g. data/,*.ckpt",
)
@argument(
    "--includes",
    default=_DECLARED.includes,
    metavar="PATTERN,...",
    help="ship these though they may hold secrets (.env, keys) or are over 10 MiB",
)
@argument(
    "--detached",
    action="store_true",
    help="the group and its running cell outlive this kernel (%%rtnb attach RUN picks it up)",
)
@argument(
    "--idle-timeout",
    dest="idle_timeout_s",
    type=float,
    default=None,
    metavar="S",
    help="a detached group with no cell and no kernel for S s is freed (default 1800)",
)
def _start_args(line):
    """%rtnb start options."""


@magic_arguments()
@_ranks_option
def _stacks_args(line):
    """Every rank's stack right now, identical ones folded, the odd ranks first."""


@magic_arguments()
@argument("rank", nargs="?", type=int, default=None, help="the rank (default: the first one)")
def _debug_args(line):
    """pdb on a rank: a breakpoint a background cell stopped at, or the last failure."""


@magic_arguments()
@argument("--steps", type=int, default=20, help="steps to profile (default 20)")
@argument("--show", action="store_true", help="show the last profile taken")
def _profile_args(line):
    """torch.profiler on every rank for N steps: merged trace and per-rank breakdown."""


@magic_arguments()
@argument("assignments", nargs="+", metavar="NAME=VALUE", help="e.g. lr=3e-4 (a Python literal)")
def _set_args(line):
    """Change live controls (rtnb.control) at one step on every rank."""


@magic_arguments()
@argument("name", help="the trigger's name, as the cell's rtnb.on_trigger(NAME, fn) gave it")
def _trigger_args(line):
    """Run every rank's handler of a trigger at one step of the running cell."""


@magic_arguments()
@_ranks_option
@argument("name", help="variable to read on every rank")
def _pull_args(line):
    """%rtnb pull options."""


@magic_arguments()
@argument("names", nargs="+", help="notebook variables to send to every rank")
@_ranks_option
def _push_args(line):
    """%rtnb push options."""


@magic_arguments()
@argument("pairs", nargs="*", help="NAME=VAR: the notebook's Ray Dataset VAR as NAME on the ranks")
@_split_option
def _datasets_args(line):
    """%rtnb datasets options."""


@magic_arguments()
@argument("--replay", action="store_true", help="keep the ranks' state (replay the journal)")
def _restart_args(line):
    """%rtnb restart options."""


@magic_arguments()
@argument(
    "workers",
    type=_workers,
    nargs="?",
    default=None,
    help=(
        "new number of ranks, MIN-MAX for an elastic group, 0 for local mode; none: an "
        "elastic group grows now to what the cluster has room for"
    ),
)
def _scale_args(line):
    """%rtnb scale options."""


@magic_arguments()
@argument("--timeout", type=float, default=None, help="give up waiting after S seconds")
def _wait_args(line):
    """%rtnb wait options."""


@magic_arguments()
@argument(
    "run", nargs="?", default=None, help="another run in the same storage (default: this one)"
)
@argument(
    "--list", action="store_true", help="return the committed checkpoints instead of the browser"
)
def _checkpoints_args(line):
    """%rtnb checkpoints options."""


@magic_arguments()
@argument("checkpoint", nargs="?", default="latest", help="latest or a checkpoint id")
@argument("--run", default=None, help="take it from another run in the same storage")
def _resume_args(line):
    """%rtnb resume/load options."""


@magic_arguments()
@argument(
    "storage",
    nargs="?",
    default=None,
    help="storage path or URI (default: the session's, else ./rtnb_runs)",
)
@argument("--metric", default=None, help="the metric to compare (default: the first reported)")
def _runs_args(line):
    """%rtnb runs options."""


@magic_arguments()
@argument("run", nargs="?", default=None, help="a run name (default: this session's run)")
@argument(
    "--metric",
    action="append",
    default=None,
    help="only this metric (repeat for more; default: every metric)",
)
@argument(
    "--storage",
    default=None,
    help="storage path or URI of the run (default: the session's, else ./rtnb_runs)",
)
def _plot_args(line):
    """%rtnb plot options."""


@magic_arguments()
@argument("file", help="the script to write, FILE.py")
@argument("--run", default=None, help="the run to export (default: this session's run)")
@argument(
    "--storage",
    default=None,
    help="storage path or URI of the run (default: the session's, else ./rtnb_runs)",
)
@argument("--force", action="store_true", help="replace FILE.py even if it is not an rtnb export")
def _export_args(line):
    """%rtnb export options."""


@magic_arguments()
@argument("file", help="a Ray Train script (TorchTrainer(train_loop_per_worker, ...))")
def _import_args(line):
    """%rtnb import options."""


@magic_arguments()
@argument("space", help="the notebook variable holding the search space, e.g. space")
@argument("--metric", default=None, help="the reported metric to optimise, e.g. loss")
@argument("--mode", default=None, choices=("min", "max"), help="min or max")
@argument("--num-samples", type=int, default=1, help="trials (times over a grid)")
@argument(
    "--max-concurrent-trials",
    type=int,
    default=None,
    help="trials at once (default: as many as the free CPUs hold)",
)
@argument(
    "--scheduler",
    default=None,
    help="asha, median, fifo, or a notebook variable holding a Tune scheduler",
)
@argument(
    "--search-alg",
    default=None,
    help="optuna, or a notebook variable holding a Tune Searcher",
)
@argument("--workers", type=int, default=2, help="ranks per trial")
@argument("--cpus-per-worker", type=float, default=None, help="CPUs per rank (e.g. 0.5)")
@argument("--gpu", action="store_true", help="one GPU per rank")
@argument("--max-failures", type=int, default=0, help="retries of a failed trial")
@argument("--name", default=None, help="the sweep's name; trials are runs NAME-tNNN")
@argument("--storage", default=None, help="where the trials' runs go (default: the session's)")
@argument("--background", action="store_true", help="return at once; the view keeps updating")
def _sweep_args(line):
    """%%rtnb sweep options (the cell is the trial's training code)."""


_LEADING_OPTIONS = re.compile(
    r"\s*(?:(?:--(?:background|quiet|no-live|once)|--(?:ranks|timeout|steps)[ =]\S+)\s*)*"
)


@magic_arguments()
@argument(
    "action",
    nargs="?",
    default="status",
    choices=("status", "stop"),
    help="status (default) or stop",
)
@argument("--force", action="store_true", help="stop it even while kernels use it")
def _warm_args(line):
    """the warm Ray: who uses it, its spare ranks, when it ends; stop to end it now"""


@magic_arguments()
@argument("run", help="the run whose detached group this kernel takes")
@argument("--take", action="store_true", help="even when another kernel holds it")
@argument(
    "--address", default=None, help="the cluster it runs on (default: this machine's warm Ray)"
)
def _attach_args(line):
    """this kernel takes a detached group: its running cell, its history, new cells"""


SUBCOMMANDS = [
    Subcommand(
        "start",
        "start the worker group (embedded Ray unless --address)",
        "%rtnb start --workers 4 --name mnist --max-failures 2",
        _start_args,
    ),
    Subcommand("status", "ranks, nodes, pids, devices, state and the running cell", "%rtnb status"),
    Subcommand("stop", "free every actor and the placement group", "%rtnb stop"),
    Subcommand(
        "restart",
        "a fresh group (--replay keeps the ranks' state)",
        "%rtnb restart --replay",
        _restart_args,
    ),
    Subcommand(
        "scale",
        "a group of N ranks holding the same state (journal replay)",
        "%rtnb scale 4",
        _scale_args,
    ),
    Subcommand(
        "wait", "the value of the last --background cell", "%rtnb wait --timeout 60", _wait_args
    ),
    Subcommand(
        "stacks",
        "where every rank's cell is now: stacks folded, the odd ranks first (hang doctor)",
        "%rtnb stacks",
        _stacks_args,
    ),
    Subcommand(
        "debug",
        "pdb on a rank: a background cell's breakpoint, else post-mortem of the failed cell",
        "%rtnb debug 1",
        _debug_args,
    ),
    Subcommand(
        "profile",
        "torch.profiler on every rank for N steps: one trace, time per part, the straggler",
        "%rtnb profile --steps 20",
        _profile_args,
    ),
    Subcommand(
        "set",
        "change live controls (rtnb.control) at one step on every rank, journaled",
        "%rtnb set lr=3e-4",
        _set_args,
    ),
    Subcommand(
        "trigger",
        "run rtnb.on_trigger(NAME, fn) on every rank at one step of the running cell",
        "%rtnb trigger eval",
        _trigger_args,
    ),
    Subcommand(
        "save-now",
        "checkpoint every rank at the next common step (rtnb.on_save(fn))",
        "%rtnb save-now",
    ),
    Subcommand(
        "pull", "a rank variable -> a list in the notebook", "%rtnb pull loss --ranks 0", _pull_args
    ),
    Subcommand("push", "notebook variables -> every rank", "%rtnb push lr batch_size", _push_args),
    Subcommand(
        "datasets",
        "Ray Datasets -> a streaming shard per rank (rtnb.get_dataset_shard)",
        "%rtnb datasets train=train_ds val=val_ds",
        _datasets_args,
    ),
    Subcommand(
        "runs",
        "compare the runs in a storage path or URI: table, overlaid curves, checkpoints",
        "%rtnb runs s3://bucket/runs --metric loss",
        _runs_args,
    ),
    Subcommand(
        "plot",
        "a static figure of any run's metrics (live or finished, local or S3)",
        "%rtnb plot mnist --metric loss",
        _plot_args,
    ),
    Subcommand(
        "result", "the run so far as an rtnb.Result (metrics, dataframe)", "result = %rtnb result"
    ),
    Subcommand(
        "import",
        "run a Ray Train script's train_loop_per_worker as a cell (its size and config)",
        "%rtnb import train.py",
        _import_args,
    ),
    Subcommand(
        "export",
        "the run's training as a Ray Train TorchTrainer script (also runs under torchrun)",
        "%rtnb export train.py",
        _export_args,
    ),
    Subcommand(
        "checkpoints",
        "the checkpoint browser (Resume / Load / Delete)",
        "%rtnb checkpoints",
        _checkpoints_args,
    ),
    Subcommand(
        "resume",
        "run the last training cell again from a checkpoint",
        "%rtnb resume step-20",
        _resume_args,
    ),
    Subcommand(
        "load",
        "rtnb.get_checkpoint() returns this checkpoint on every rank",
        "%rtnb load latest --run other-run",
        _resume_args,
    ),
    Subcommand(
        "sweep",
        "a Tune search, each trial on a reused group of ranks (the cell is its code)",
        "%%rtnb sweep space --metric loss --mode min --num-samples 8 --scheduler asha",
        _sweep_args,
    ),
    Subcommand(
        "warm",
        "the warm Ray: attached kernels, spare ranks, idle timeout (stop: end it now)",
        "%rtnb warm stop",
        _warm_args,
    ),
    Subcommand(
        "attach",
        "take a detached group (%rtnb start --detached) into this kernel",
        "%rtnb attach mnist",
        _attach_args,
    ),
]


def _shown_storage(storage: str) -> str:
    """A storage path as a title shows it: under the working directory, relative to
    it (``./rtnb_runs``, not the machine's whole path); a URI without its secrets."""
    if "://" in storage:
        return redact_uri(storage)
    relative = os.path.relpath(storage, os.getcwd())
    return storage if relative.startswith("..") else f"./{relative}"


_SUBCOMMANDS = tuple(sub.name for sub in SUBCOMMANDS)
_BY_NAME = {s.name: s for s in SUBCOMMANDS}


@magics_class
class RtnbMagics(Magics):
    """Holds the notebook's one :class:`rtnb.Session`."""

    def __init__(self, shell=None, **kwargs) -> None:
        super().__init__(shell=shell, **kwargs)
        self.session: Session | None = None
        self.output = NotebookOutput()  # live widgets or lasting output: it decides
        self.last_view = None  # the widget of the latest cell, for inspection
        self.last_sweep: Sweep | None = None
        self._unwatch_sweeps = Sweep.on_start(self._show_sweep)
        # A plain cell reading a name only the ranks have gets a note saying how to
        # bring it over; another extension's NameError handler is left in place.
        self._hints_names = shell is not None and not shell.custom_exceptions
        if self._hints_names:
            shell.set_custom_exc((NameError,), self._name_of_the_ranks_hinted)

    def shutdown(self) -> None:
        if self._hints_names:
            self.shell.set_custom_exc((), None)
        self._unwatch_sweeps()
        if self.session is not None:
            # A detached group outlives this kernel on purpose: let go, leave it running.
            if self.session.detached:
                self.session.release()
            else:
                self.session.stop()
            self.session = None

    # ---- %rtnb -------------------------------------------------------------------------
    @line_cell_magic
    def rtnb(self, line: str = "", cell: str | None = None):
        """Start, inspect and stop the worker group that %%rtrain cells run on.

        Subcommands::

            (every subcommand with its flags: written in from the parsers at import)

        Example::

            In [1]: %load_ext rtnb
            In [2]: %rtnb start --workers 2
            In [3]: %%rtrain
               ...: import torch.distributed as dist
               ...: x = dist.get_rank()
            In [4]: %rtnb pull x
            Out[4]: [0, 1]
        """
        words = shlex.split(line)
        if not words:
            raise UsageError(
                "%rtnb needs a subcommand: " + ", ".join(_SUBCOMMANDS) + " (see %rtnb?)"
            )
        sub, rest = words[0], line.strip()[len(words[0]) :].strip()
        if sub in _BY_NAME and ("--help" in words[1:] or "-h" in words[1:]):
            print(subcommand_help("%rtnb", _BY_NAME[sub]))
            return None
        handler = (
            getattr(self, f"_rtnb_{sub.replace('-', '_')}", None) if sub in _SUBCOMMANDS else None
        )
        if handler is None:
            close = difflib.get_close_matches(sub, _SUBCOMMANDS, n=1)
            hint = f"did you mean `%rtnb {close[0]}`? " if close else ""
            raise UsageError(
                f"%rtnb has no subcommand {sub!r}; {hint}use one of: " + ", ".join(_SUBCOMMANDS)
            )
        if (sub == "sweep") != (cell is not None):
            raise UsageError(
                "%%rtnb sweep takes the trial's training code as its cell: "
                "`%%rtnb sweep space --metric loss --mode min`"
                if sub == "sweep"
                else f"only `%%rtnb sweep` takes a cell; `%rtnb {sub}` is a line magic"
            )
        try:
            return handler(rest) if cell is None else handler(rest, cell)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None

    def _require(self) -> Session:
        if self.session is None:
            raise UsageError("no worker group yet: run `%rtnb start` first")
        return self.session

    def _rtnb_start(self, rest: str):
        args = parse_argstring(_start_args, rest)
        self._let_go_of_a_lost_detached()
        if self.session is not None and self.session.started:
            raise UsageError(
                f"a worker group is already running (run {self.session.run_name!r}); "
                "use `%rtnb restart` for a fresh one, or `%rtnb stop` first"
            )
        options = vars(args)  # every option but these is a SessionConfig field
        replay, detached = options.pop("replay"), options.pop("detached")
        idle_timeout_s = options.pop("idle_timeout_s")
        if idle_timeout_s is not None and not detached:
            raise UsageError("--idle-timeout is a detached group's: add --detached")
        if detached:
            options["idle_timeout_s"] = idle_timeout_s
        session = Session(replay=replay, detached=detached, **options)
        shown = display({"text/plain": "rtnb: starting…"}, raw=True, display_id=True)

        def progress(line: str) -> None:
            if shown is not None:
                shown.update({"text/plain": line}, raw=True)

        try:
            session = session.start(progress=progress)
        except BaseException:
            progress("rtnb: the start failed (the reason follows)")
            raise
        progress(f"rtnb: run {session.run_name!r} {session.last_start}")
        # (a detached group's start is told as one line by its host: no notes)
        for note in getattr(session.last_start, "notes", ()):
            print(f"rtnb: {note}")
        if session.detached:
            print(
                f"rtnb: run {session.run_name!r} is detached: it goes on if this kernel "
                f"dies; `%rtnb attach {session.run_name}` from any kernel, "
                "`%rtnb stop` frees it"
            )
        if session.last_replay is not None:
            print(f"rtnb: run {session.run_name!r} rebuilt from its journal: {session.last_replay}")
        self.session = session
        display(session.status())
        self.output.prepare()

    def _let_go_of_a_lost_detached(self) -> None:
        """A detached group taken over by another kernel (or freed) leaves this
        kernel's slot free for a start or an attach."""
        session = self.session
        if session is not None and session.detached and not session.started:
            session.release()
            self.session = None

    def _rtnb_attach(self, rest: str):
        args = parse_argstring(_attach_args, rest)
        self._let_go_of_a_lost_detached()
        if self.session is not None and self.session.started:
            raise UsageError(
                f"this kernel already has run {self.session.run_name!r}: `%rtnb stop` it "
                "(or restart the kernel) before attaching another"
            )
        try:
            session = attach(args.run, take=args.take, address=args.address)
        except (ConfigError, SessionError) as exc:
            raise UsageError(str(exc)) from None
        self.session = session
        self.output.prepare()
        print(f"rtnb: run {session.run_name!r} attached to this kernel")
        display(session.status())
        cell = session.active_cell
        if cell is not None:
            self.last_view = LiveMetrics(
                session.metrics, cell, stacks=session.stacks, set_controls=session.set_controls
            ).show()
            return None
        ended = session.cells[-1] if session.cells else None
        if ended is not None:
            print(f"rtnb: {ended.name} ended while detached")
            return _shown(ended.wait(0))
        return None

    def _rtnb_status(self, rest: str):
        self._no_args("status", rest)
        display(self._require().status())

    def _rtnb_stop(self, rest: str):
        self._no_args("stop", rest)
        stop_asking()  # the theme question, if the page never answered it
        session = self._require()
        if session.detached and not session.started:
            # Taken over by another kernel, or already freed: only this kernel lets go.
            session.release()
            self.session = None
            print(f"rtnb: this kernel let go of run {session.run_name!r}; it is not held here")
            return
        session.stop()
        self.session = None
        print(f"rtnb: worker group of run {session.run_name!r} stopped; its CPUs/GPUs are free")

    def _rtnb_restart(self, rest: str):
        args = parse_argstring(_restart_args, rest)
        session = self._require().restart(replay=args.replay)
        if args.replay and session.last_replay is not None:
            print(f"rtnb: state kept: {session.last_replay}")
        display(session.status())

    def _rtnb_scale(self, rest: str):
        args = parse_argstring(_scale_args, rest)
        session = self._require()
        try:
            session.scale(args.workers)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        if args.workers is None:
            print(session.last_growth or "rtnb: the elastic group stays: no room for more ranks")
        elif session.last_replay is not None:
            ranks = f"{session.world_size} rank{'s' if session.world_size != 1 else ''}"
            print(f"rtnb: now {ranks}, state kept: {session.last_replay}")
        display(session.status())

    def _rtnb_wait(self, rest: str):
        args = parse_argstring(_wait_args, rest)
        with self._names_of_the_notebook_hinted():
            return _shown(self._require().wait(args.timeout))

    def _rtnb_stacks(self, rest: str):
        args = parse_argstring(_stacks_args, rest)
        return self._require().stacks(ranks=args.ranks)

    def _rtnb_debug(self, rest: str):
        args = parse_argstring(_debug_args, rest)
        try:
            self._require().debug(args.rank)
        except (ConfigError, SessionError) as exc:
            raise UsageError(str(exc)) from None

    def _rtnb_profile(self, rest: str):
        args = parse_argstring(_profile_args, rest)
        session = self._require()
        if args.show:
            if session.last_profile is None:
                raise UsageError("no profile yet: `%rtnb profile --steps 20` arms one")
            self._show_profile(session.last_profile)
            return
        try:
            first = session.profile(args.steps)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        if first is None:
            print(f"rtnb: the next cell's first {args.steps} steps are profiled on every rank")
        else:
            print(
                f"rtnb: steps {first}-{first + args.steps - 1} are profiled on every rank; "
                "`%rtnb profile --show` once they ran"
            )

    @staticmethod
    def _show_profile(report) -> None:
        print(report.summary())
        print(report.table())
        display(profile_figure(report))

    def _rtnb_set(self, rest: str):
        args = parse_argstring(_set_args, rest)
        values = {}
        for assignment in args.assignments:
            name, eq, text = assignment.partition("=")
            if not eq or not name.strip():
                raise UsageError(
                    f"%rtnb set takes NAME=VALUE pairs (e.g. lr=3e-4), got {assignment!r}"
                )
            values[name.strip()] = control_value(text)
        try:
            step = self._require().set_controls(values)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        shown = ", ".join(f"{n} = {v!r}" for n, v in values.items())
        where = f"from step {step} on every rank" if step is not None else "from the next cell on"
        print(f"rtnb: {shown} {where}")

    def _rtnb_trigger(self, rest: str):
        args = parse_argstring(_trigger_args, rest)
        step = self._fire(lambda session: session.trigger(args.name))
        print(f"rtnb: trigger {args.name!r} fired at step {step} on every rank")

    def _rtnb_save_now(self, rest: str):
        self._no_args("save-now", rest)
        step = self._fire(lambda session: session.save_now())
        print(f"rtnb: every rank saves at step {step} (committed once all have written it)")

    def _fire(self, fire):
        try:
            return fire(self._require())
        except (ConfigError, SessionError) as exc:
            raise UsageError(str(exc)) from None

    def _rtnb_pull(self, rest: str):
        args = parse_argstring(_pull_args, rest)
        return self._require().pull(args.name, ranks=args.ranks)

    def _rtnb_push(self, rest: str):
        args = parse_argstring(_push_args, rest)
        namespace = self.shell.user_ns
        missing = [n for n in args.names if n not in namespace]
        if missing:
            raise UsageError(f"{missing[0]!r} is not defined in the notebook")
        self._require().push({n: namespace[n] for n in args.names}, ranks=args.ranks)

    def _rtnb_datasets(self, rest: str):
        args = parse_argstring(_datasets_args, rest)
        session = self._require()
        if not args.pairs:
            names = session.dataset_names
            print(
                f"rtnb: datasets on the ranks: {', '.join(names)}"
                if names
                else "rtnb: no datasets handed to the ranks yet (%rtnb datasets train=train_ds)"
            )
            return None
        session.set_datasets(self._datasets_from(args.pairs), _split_names(args))
        return None

    def _datasets_from(self, pairs: list[str]) -> dict:
        """``NAME=VAR`` pairs (space or comma separated) as {NAME: the notebook's VAR}."""
        namespace, datasets = self.shell.user_ns, {}
        for pair in (p for chunk in pairs for p in chunk.split(",") if p):
            name, eq, var = pair.partition("=")
            name, var = name.strip(), (var.strip() or name.strip())
            if not name.isidentifier() or (eq and not var.isidentifier()):
                raise UsageError(
                    f"--datasets takes NAME=VAR pairs, e.g. train=train_ds; got {pair!r}"
                )
            if var not in namespace:
                raise UsageError(f"{var!r} is not defined in the notebook (for dataset {name!r})")
            datasets[name] = namespace[var]
        return datasets

    def _rtnb_checkpoints(self, rest: str):
        args = parse_argstring(_checkpoints_args, rest)
        session = self._require()
        if args.list:
            return session.list_checkpoints(run=args.run)

        def lasting() -> None:  # nothing can click it: the table, as text
            rows = session.list_checkpoints(include_incomplete=True, run=args.run)
            print(CheckpointInfo.table(rows) if rows else "rtnb: no checkpoints yet")

        def live() -> None:
            self.last_view = self._browser_for(
                session, session.config.storage_path, args.run or session.run_name
            )
            display(self.last_view)

        self.output.show(live, lasting)

    def _rtnb_resume(self, rest: str):
        args = parse_argstring(_resume_args, rest)
        plan = self._require().prepare_resume(args.checkpoint, run=args.run)
        if plan.code is None:
            print(
                f"rtnb: loaded {plan.checkpoint.id}; the next training cell starts from it "
                "(rtnb.get_checkpoint())"
            )
            return None
        print(f"rtnb: resuming the last training cell from {plan.checkpoint.id}")
        return self._run(plan.code, parse_argstring(self.rtrain_cell, ""))

    def _rtnb_load(self, rest: str):
        args = parse_argstring(_resume_args, rest)
        checkpoint = self._require().load(args.checkpoint, run=args.run)
        print(f"rtnb: rtnb.get_checkpoint() now returns {checkpoint.id} on every rank")

    def _rtnb_warm(self, rest: str):
        args = parse_argstring(_warm_args, rest)
        if args.action == "stop":
            stopped = stop_warm_ray(force=args.force)
            if not stopped:
                print("rtnb: no warm Ray is running")
            for status in stopped:
                print(f"rtnb: stopped the warm Ray at {status.address} (pid {status.pid})")
            return None
        running = warm_ray_status()
        if not running:
            print(
                "rtnb: no warm Ray is running (the next `%rtnb start` in a notebook "
                "starts one; RTNB_WARM_RAY=0 keeps kernels off it)"
            )
        for status in running:
            print(status.summary(this_pid=os.getpid()))
        return None

    def _rtnb_sweep(self, rest: str, cell: str):
        args = parse_argstring(_sweep_args, rest)
        namespace = self.shell.user_ns
        if args.space not in namespace:
            raise UsageError(
                f"{args.space!r} is not defined in the notebook: make the search space first, "
                "e.g. space = {'lr': tune.loguniform(1e-4, 1e-1)}"
            )
        session = self.session
        storage = args.storage or (session.config.storage_path if session is not None else None)
        self.last_sweep = sweep(
            cell,
            namespace[args.space],
            metric=args.metric,
            mode=args.mode,
            num_samples=args.num_samples,
            max_concurrent_trials=args.max_concurrent_trials,
            scheduler=self._tune_object(args.scheduler, "scheduler"),
            search_alg=self._tune_object(args.search_alg, "search-alg"),
            workers=args.workers,
            cpus_per_worker=args.cpus_per_worker,
            gpu=args.gpu,
            max_failures=args.max_failures,
            name=args.name,
            storage=storage,
            background=True,
        )
        # Kept before waiting: an interrupted or failed sweep's trials stay at hand.
        return self.last_sweep if args.background else self.last_sweep.wait()

    def _tune_object(self, text: str | None, flag: str):
        """--scheduler/--search-alg: a short name (the engine knows them), or a
        notebook variable."""
        names = ("asha", "median", "fifo") if flag == "scheduler" else ("optuna",)
        if text is None or text in names:
            return text
        if text not in self.shell.user_ns:
            raise UsageError(
                f"--{flag} {text!r}: neither {', '.join(names)} nor a variable of the notebook"
            )
        return self.shell.user_ns[text]

    def _show_sweep(self, started: Sweep) -> None:
        """Every sweep of this kernel (``%%rtnb sweep`` or ``rtnb.sweep``) gets its view."""

        def live() -> None:
            self.last_view = SweepView(
                started, resume=lambda index: _resume_trial_in_view(self, started, index)
            ).show()

        self.output.show(live, lambda: SweepProgress(started))

    def _rtnb_result(self, rest: str):
        self._no_args("result", rest)
        return self._require().result()

    def _rtnb_runs(self, rest: str):
        args = parse_argstring(_runs_args, rest)
        session = self.session
        storage = self._storage_of(args.storage)
        try:
            table = list_runs(storage)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None

        def load(name: str) -> MetricsStore:
            return self._metrics_of(name, args.storage)

        title = f"runs in {_shown_storage(storage)}"
        if not table.runs:
            print(f"rtnb: no rtnb runs in {redact_uri(storage)}")
            return None
        if not self.output.live:
            # A saved notebook and papermill keep the table as text and a figure.
            stores = {run.name: load(run.name) for run in table.runs}
            metric = args.metric or next(
                (m for s in stores.values() for m in s.metric_names()), None
            )
            display(runs_bundle(table.runs, stores, metric, title=title), raw=True)
            return None
        self.last_view = RunsDashboard(
            lambda: list_runs(storage),
            load,
            open_checkpoints=lambda name: self._browser_for(session, storage, name),
            title=title,
        )
        if args.metric:
            if args.metric not in self.last_view.metric.options:
                raise UsageError(
                    f"no run in {redact_uri(storage)} reported {args.metric!r}; reported: "
                    f"{', '.join(self.last_view.metric.options) or 'nothing yet'}"
                )
            self.last_view.metric.value = args.metric
        display(self.last_view)
        return None

    @staticmethod
    def _browser_for(session, storage: str, name: str) -> CheckpointBrowser:
        """The checkpoint browser of run ``name``; Resume/Load act through this
        kernel's session when it uses the same storage."""
        run = open_run(storage, name, session)
        store = run.checkpoints()
        return CheckpointBrowser(
            lambda: store.list(include_incomplete=True),
            resume=(lambda cid: _resume_in_view(session, run, cid)) if run.can_act else None,
            load=(
                (lambda cid: f"rtnb.get_checkpoint() now returns {run.load(cid).id} on every rank")
                if run.can_act
                else None
            ),
            delete=store.delete,
            subscribe=store.subscribe,
            latest=run.latest_checkpoint_id if run.own else None,
            score=store.score,
            mode=store.mode,
            title=f"checkpoints of run {name!r}",
        )

    def _rtnb_plot(self, rest: str):
        args = parse_argstring(_plot_args, rest)
        run = args.run or (self.session.run_name if self.session else None)
        if run is None:
            raise UsageError(
                "%rtnb plot needs a run name (`%rtnb runs` lists them), e.g. %rtnb plot mnist"
            )
        try:
            store = self._metrics_of(run, args.storage)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        missing = [m for m in args.metric or () if m not in store.metric_names()]
        if missing:
            raise UsageError(
                f"run {run!r} has no metric {missing[0]!r}; it reported: "
                f"{', '.join(store.metric_names()) or 'nothing yet'}"
            )
        if not show_static_figure(store, title=f"run {run}", metrics=args.metric):
            print(f"rtnb: run {run!r} has reported no metrics yet")
        return None

    def _rtnb_import(self, rest: str):
        args = parse_argstring(_import_args, rest)
        try:
            script = self._require().prepare_import(args.file)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        for note in script.notes:
            print(f"rtnb: {note}")
        print(f"rtnb: running {script.loop}() of {script.path} on the ranks")
        return self._run(script.code, parse_argstring(self.rtrain_cell, ""))

    def _rtnb_export(self, rest: str):
        args = parse_argstring(_export_args, rest)
        run = args.run or (self.session.run_name if self.session else None)
        if run is None:
            raise UsageError(
                "%rtnb export needs a run: start a session and run cells, or name one "
                "with --run (`%rtnb runs` lists them)"
            )
        try:
            exported = open_run(self._storage_of(args.storage), run, self.session).export(
                args.file, force=args.force
            )
        except (ConfigError, SessionError) as exc:
            raise UsageError(str(exc)) from None
        print(exported)

    def _storage_of(self, storage: str | None) -> str:
        """``--storage``, else this session's, else the default."""
        if storage is not None:
            return storage
        return (self.session.config if self.session else _DEFAULTS).storage_path

    def _metrics_of(self, run: str, storage: str | None) -> MetricsStore:
        """A run's metrics: this session's own from the kernel (the newest), any
        other's from its record."""
        return open_run(self._storage_of(storage), run, self.session).metrics()

    @staticmethod
    def _no_args(sub: str, rest: str) -> None:
        if rest:
            raise UsageError(f"%rtnb {sub} takes no arguments, got {rest!r}")

    # ---- %%rtrain / %rtrain -------------------------------------------------------------
    @magic_arguments()
    @_cell_options
    @cell_magic
    def rtrain_cell(self, line: str, cell: str):
        """Run this cell on every rank of the worker group, in its persistent namespace.

        torch.distributed is initialised on the ranks; each rank's prints stream in
        tagged ``[rank N]``; the last expression's value comes back per rank.

        Example::

            In [3]: %%rtrain --ranks 0,1
               ...: import torch, torch.distributed as dist
               ...: t = torch.ones(1) * dist.get_rank()
               ...: dist.all_reduce(t)
               ...: t.item()
            Out[3]:
            [rank 0] 1.0
            [rank 1] 1.0
        """
        args = parse_argstring(self.rtrain_cell, line)
        return self._run(cell, args)

    @magic_arguments()
    @_cell_options
    @line_magic
    def rtrain_line(self, line: str):
        """Run one statement on every rank: ``%rtrain x = 1``.

        Example::

            In [4]: %rtrain model.weight.sum().item()
        """
        # Options only at the start; everything after them is the statement, verbatim.
        match = _LEADING_OPTIONS.match(line)
        options, statement = match.group(0), line[match.end() :].strip()
        args = parse_argstring(self.rtrain_line, options)
        if not statement:
            raise UsageError("%rtrain needs a statement, e.g. `%rtrain x = 1`")
        # A one-liner prints plainly: no live view re-plotting the whole run for it.
        return self._run(statement, args, live_view=False)

    def _run(self, code: str, args, live_view: bool = True):
        session = self._require()
        live = live_view and not args.no_live and self.output.live
        label = self._cell_label()
        datasets = self._datasets_from([args.datasets]) if args.datasets else None
        split = _split_names(args)
        if split is not None:  # handed now with their split, as the cell would hand them
            session.set_datasets(datasets, split)
            datasets = None
        try:
            if args.background:
                handle = session.run_background(
                    code,
                    datasets=datasets,
                    ranks=args.ranks,
                    timeout=args.timeout,
                    total_steps=args.steps,
                    once=args.once,
                    label=label,
                )
                if not args.quiet:
                    if live:
                        self.last_view = LiveMetrics(
                            session.metrics,
                            handle,
                            stacks=session.stacks,
                            set_controls=session.set_controls,
                        ).show()
                    else:
                        self.last_view = RankLog(handle)
                        display(self.last_view)
                return None
            late = None
            if args.quiet:
                sink = lambda rank, stream, text: None  # noqa: E731
            elif live:
                late = LiveOnFirstReport(
                    session.metrics,
                    print_sink(),
                    stacks=session.stacks,
                    set_controls=session.set_controls,
                )
                sink = late
            else:
                sink = None
            handle = session.begin_cell(
                code,
                datasets=datasets,
                ranks=args.ranks,
                timeout=args.timeout,
                total_steps=args.steps,
                output=sink,
                once=args.once,
                label=label,
            )
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        reports_before = session.metrics.count()
        profile_before = session.last_profile
        progress = None
        if late is not None:
            late.attach(handle)
        elif not args.quiet:
            progress = ProgressLines(session.metrics, handle)
        try:
            with self._names_of_the_notebook_hinted():
                return _shown(handle.run_here())
        finally:
            if late is not None:
                late.close()
                self.last_view = late.view or self.last_view
            if session.last_profile is not profile_before and session.last_profile is not None:
                self._show_profile(session.last_profile)
            if progress is not None:
                progress.close()
                if session.metrics.count() > reports_before:
                    bundle = static_figure_bundle(session.metrics, title=f"run {session.run_name}")
                    if bundle is not None:
                        display(bundle, raw=True)

    @contextlib.contextmanager
    def _names_of_the_notebook_hinted(self) -> Iterator[None]:
        """A cell that failed on a name the ranks lack but the notebook has (a
        papermill parameter, a variable of an earlier plain cell) says how to send it:
        the first thing a newcomer meets."""
        try:
            yield
        except CellError as exc:
            name = exc.missing_name
            if name and not exc.hint and not name.startswith("_") and name in self.shell.user_ns:
                exc.hint = (
                    f"`{name}` is a variable of this notebook, not of the ranks: send it with "
                    f"`%rtnb push {name}` before this cell (a papermill parameter is the "
                    f"notebook's too; in a magic's line, `${name}` reads the notebook's value)"
                )
            raise

    def _name_of_the_ranks_hinted(self, shell, etype, value, tb, tb_offset=None) -> None:
        """The notebook's NameError as IPython shows it, with a note when the ranks
        have the name (a newcomer reads a cell's variable in a plain cell)."""
        name = getattr(value, "name", None)
        session = self.session
        try:
            on_ranks = bool(name) and session is not None and name in session.names_on_ranks()
        except Exception:  # noqa: BLE001 - a hint never stands in the way of the error
            on_ranks = False
        if on_ranks and not any(name in note for note in getattr(value, "__notes__", ())):
            value.add_note(
                f"`{name}` is a variable of the ranks, not of this notebook: `{name} = "
                f"%rtnb pull {name}` brings each rank's value (a list in rank order)"
            )
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)

    def _cell_label(self) -> str | None:
        """The running cell's In [N] as the notebook shows it. IPython 9 counts the
        next cell up before this one runs (shell.execution_count is N + 1 here, and
        N under IPython 8); the display hook's result of the running cell is N in
        both."""
        running = getattr(getattr(self.shell, "displayhook", None), "exec_result", None)
        count = getattr(running, "execution_count", None)
        return f"[{count}]" if isinstance(count, int) else None


# `%rtnb?` prints the magic's docstring: make it list every subcommand with its flags
# and every %%rtrain flag, from the parsers themselves.
_intro, _, _rest = RtnbMagics.rtnb.__doc__.partition("Subcommands::")
RtnbMagics.rtnb.__doc__ = full_help(
    _intro + "Example::" + _rest.partition("Example::")[2],
    SUBCOMMANDS,
    RtnbMagics.rtrain_cell.parser,
)


def reference() -> str:
    """The manual's magics reference (docs/reference/magics.md), from the parsers."""
    return reference_markdown(SUBCOMMANDS, RtnbMagics.rtrain_cell.parser, _intro)


def completer(magics: RtnbMagics):
    """IPython custom completer for %rtnb, %rtrain and %%rtrain lines."""
    cell_flags = parser_flags(RtnbMagics.rtrain_cell.parser)

    def run_names() -> list[str]:
        session = magics.session
        storage = session.config.storage_path if session is not None else None
        return [run.name for run in list_runs(storage).runs]

    def checkpoint_ids() -> list[str]:
        session = magics.session
        return [] if session is None else [c.id for c in session.list_checkpoints()]

    def hook(_shell, event) -> list[str]:
        # IPython's set_hook binds a hook to the shell, so it gets the shell first.
        return complete(event.line, SUBCOMMANDS, cell_flags, run_names, checkpoint_ids)

    return hook


# IPython names magics after the methods; %rtrain and %%rtrain share one name.
RtnbMagics.magics["cell"]["rtrain"] = RtnbMagics.magics["cell"].pop("rtrain_cell")
RtnbMagics.magics["line"]["rtrain"] = RtnbMagics.magics["line"].pop("rtrain_line")


def _resume_in_view(session: Session, run: RunAccess, checkpoint_id: str):
    """The browser's Resume: the last training cell runs again in the background, its
    live view shown under the browser (the kernel stays free meanwhile)."""
    handle = run.resume(checkpoint_id)
    if handle is None:
        return "loaded; the next training cell starts from it"
    # A button click reaches the kernel only through a live widget frontend.
    view = LiveMetrics(session.metrics, handle)
    return (
        f"{handle.name} is running in the background from it (`%rtnb wait` for its value)",
        view,
    )


def _resume_trial_in_view(magics: RtnbMagics, started: Sweep, index: int | None):
    """The sweep view's Resume: the trial's config and checkpoint go to the notebook's
    group, and the sweep's code runs on from there in the background."""
    session = magics.session
    if session is None or not session.started:
        return (
            f"start the notebook's group first (`%rtnb start --storage {redact_uri(started.storage)}`), "
            "then Resume"
        )
    handle = started.resume_trial(session, index, background=True)
    trial = started.best_trial() if index is None else started.trials[index]
    view = LiveMetrics(session.metrics, handle)
    return (
        f"trial {trial.index} ({trial.config}) carries on in the notebook's group, in the "
        "background (`%rtnb wait` for its value)",
        view,
    )


def _shown(value):
    """The Out[] value of a cell: nothing when no rank returned anything."""
    if value is None or all(v is None for v in value.values()):
        return None
    return value
