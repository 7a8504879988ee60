"""The magics' parsers: the option stacks %%rtrain and %rtnb share, each subcommand's
flags, and the table of subcommands (name, purpose, example, parser) that help,
completion and the manual's reference are made from."""

from __future__ import annotations

import argparse
import re
from types import SimpleNamespace

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments
from rtnb.magics._help import (
    Subcommand,
)

from rtnb.core._config import (
    BACKENDS,
    FILE_MODES,
    STRATEGIES,
    SessionConfig,
    declared_defaults,
    parse_workers,
)
from rtnb.errors import ConfigError


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


def split_names(args) -> list[str] | None:
    """``--split a,b`` as ["a", "b"]; given without datasets to split, a UsageError."""
    if args.split is None:
        return None
    if not getattr(args, "datasets", None) and not getattr(args, "pairs", None):
        raise UsageError("--split goes with datasets: --datasets train=A,val=B --split train")
    return [n.strip() for n in args.split.split(",") if n.strip()]  # '': none split


def cell_options(func):
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


DEFAULTS = SessionConfig()  # the one place start's defaults come from
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
        f"number of ranks (default {DEFAULTS.workers}); MIN-MAX: elastic, as many as the "
        "cluster places up to MAX; 0: local mode, one rank in this kernel, where "
        "breakpoint() and %%debug reach the training code"
    ),
)
@argument("--gpu", action="store_true", help="one GPU per rank; nccl backend")
@argument(
    "--cpus-per-worker",
    type=float,
    default=_DECLARED.cpus_per_worker,
    help=f"CPUs reserved per rank (default {DEFAULTS.cpus_per_worker:g})",
)
@argument("--strategy", default=_DECLARED.strategy, help="placement: " + "|".join(STRATEGIES))
@argument(
    "--address",
    default=_DECLARED.address,
    help="auto, HOST:PORT or ray://HOST:PORT (default: RAY_ADDRESS if set, else this machine's warm Ray, else a Ray embedded in the kernel)",
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
def start_args(line):
    """%rtnb start options."""


@magic_arguments()
@_ranks_option
def stacks_args(line):
    """Every rank's stack right now, identical ones folded, the odd ranks first."""


@magic_arguments()
@argument("rank", nargs="?", type=int, default=None, help="the rank (default: the first one)")
def debug_args(line):
    """pdb on a rank: a breakpoint a background cell stopped at, or the last failure."""


@magic_arguments()
@argument("--steps", type=int, default=20, help="steps to profile (default 20)")
@argument("--show", action="store_true", help="show the last profile taken")
def profile_args(line):
    """torch.profiler on every rank for N steps: merged trace and per-rank breakdown."""


@magic_arguments()
@argument("assignments", nargs="+", metavar="NAME=VALUE", help="e.g. lr=3e-4 (a Python literal)")
def set_args(line):
    """Change live controls (rtnb.control) at one step on every rank."""


@magic_arguments()
@argument("name", help="the trigger's name, as the cell's rtnb.on_trigger(NAME, fn) gave it")
def trigger_args(line):
    """Run every rank's handler of a trigger at one step of the running cell."""


@magic_arguments()
@_ranks_option
@argument("name", help="variable to read on every rank")
def pull_args(line):
    """%rtnb pull options."""


@magic_arguments()
@argument("names", nargs="+", help="notebook variables to send to every rank")
@_ranks_option
def push_args(line):
    """%rtnb push options."""


@magic_arguments()
@argument("pairs", nargs="*", help="NAME=VAR: the notebook's Ray Dataset VAR as NAME on the ranks")
@_split_option
def datasets_args(line):
    """%rtnb datasets options."""


@magic_arguments()
@argument("--replay", action="store_true", help="keep the ranks' state (replay the journal)")
def restart_args(line):
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
def scale_args(line):
    """%rtnb scale options."""


@magic_arguments()
@argument("--timeout", type=float, default=None, help="give up waiting after S seconds")
def wait_args(line):
    """%rtnb wait options."""


@magic_arguments()
@argument(
    "run", nargs="?", default=None, help="another run in the same storage (default: this one)"
)
@argument(
    "--list", action="store_true", help="return the committed checkpoints instead of the browser"
)
def checkpoints_args(line):
    """%rtnb checkpoints options."""


@magic_arguments()
@argument("checkpoint", nargs="?", default="latest", help="latest or a checkpoint id")
@argument("--run", default=None, help="take it from another run in the same storage")
def resume_args(line):
    """%rtnb resume/load options."""


@magic_arguments()
@argument(
    "storage",
    nargs="?",
    default=None,
    help="storage path or URI (default: the session's, else ./rtnb_runs)",
)
@argument("--metric", default=None, help="the metric to compare (default: the first reported)")
def runs_args(line):
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
def plot_args(line):
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
def export_args(line):
    """%rtnb export options."""


@magic_arguments()
@argument(
    "file",
    help="a Ray Train script (TorchTrainer(train_loop_per_worker, ...)) or a torchrun script",
)
@argument(
    "args",
    nargs=argparse.REMAINDER,
    help="a torchrun script's command-line arguments (its sys.argv[1:])",
)
def import_args(line):
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
def sweep_args(line):
    """%%rtnb sweep options (the cell is the trial's training code)."""


LEADING_OPTIONS = re.compile(
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
def warm_args(line):
    """the warm Ray: who uses it, its spare ranks, when it ends; stop to end it now"""


@magic_arguments()
@argument("run", help="the run whose detached group this kernel takes")
@argument("--take", action="store_true", help="even when another kernel holds it")
@argument(
    "--address", default=None, help="the cluster it runs on (default: this machine's warm Ray)"
)
def attach_args(line):
    """this kernel takes a detached group: its running cell, its history, new cells"""


SUBCOMMANDS = [
    Subcommand(
        "start",
        "start the worker group (on the warm Ray unless --address or RAY_ADDRESS)",
        "%rtnb start --workers 4 --name mnist --max-failures 2",
        start_args,
    ),
    Subcommand("status", "ranks, nodes, pids, devices, state and the running cell", "%rtnb status"),
    Subcommand("stop", "free every actor and the placement group", "%rtnb stop"),
    Subcommand(
        "restart",
        "a fresh group (--replay keeps the ranks' state)",
        "%rtnb restart --replay",
        restart_args,
    ),
    Subcommand(
        "scale",
        "a group of N ranks holding the same state (journal replay)",
        "%rtnb scale 4",
        scale_args,
    ),
    Subcommand(
        "wait", "the value of the last --background cell", "%rtnb wait --timeout 60", wait_args
    ),
    Subcommand(
        "stacks",
        "where every rank's cell is now: stacks folded, the odd ranks first (hang doctor)",
        "%rtnb stacks",
        stacks_args,
    ),
    Subcommand(
        "debug",
        "pdb on a rank: a background cell's breakpoint, else post-mortem of the failed cell",
        "%rtnb debug 1",
        debug_args,
    ),
    Subcommand(
        "profile",
        "torch.profiler on every rank for N steps: one trace, time per part, the straggler",
        "%rtnb profile --steps 20",
        profile_args,
    ),
    Subcommand(
        "set",
        "change live controls (rtnb.control) at one step on every rank, journaled",
        "%rtnb set lr=3e-4",
        set_args,
    ),
    Subcommand(
        "trigger",
        "run rtnb.on_trigger(NAME, fn) on every rank at one step of the running cell",
        "%rtnb trigger eval",
        trigger_args,
    ),
    Subcommand(
        "save-now",
        "checkpoint every rank at the next common step (rtnb.on_save(fn))",
        "%rtnb save-now",
    ),
    Subcommand(
        "pull", "a rank variable -> a list in the notebook", "%rtnb pull loss --ranks 0", pull_args
    ),
    Subcommand("push", "notebook variables -> every rank", "%rtnb push lr batch_size", push_args),
    Subcommand(
        "datasets",
        "Ray Datasets -> a streaming shard per rank (rtnb.get_dataset_shard)",
        "%rtnb datasets train=train_ds val=val_ds",
        datasets_args,
    ),
    Subcommand(
        "runs",
        "compare the runs in a storage path or URI: table, overlaid curves, checkpoints",
        "%rtnb runs s3://bucket/runs --metric loss",
        runs_args,
    ),
    Subcommand(
        "plot",
        "a static figure of any run's metrics (live or finished, local or S3)",
        "%rtnb plot mnist --metric loss",
        plot_args,
    ),
    Subcommand(
        "result", "the run so far as an rtnb.Result (metrics, dataframe)", "result = %rtnb result"
    ),
    Subcommand(
        "import",
        "run a Ray Train script's training loop, or a torchrun script, as a cell",
        "%rtnb import train.py [ARGS...]",
        import_args,
    ),
    Subcommand(
        "export",
        "the run's training as a Ray Train TorchTrainer script (also runs under torchrun)",
        "%rtnb export train.py",
        export_args,
    ),
    Subcommand(
        "checkpoints",
        "the checkpoint browser (Resume / Load / Delete)",
        "%rtnb checkpoints",
        checkpoints_args,
    ),
    Subcommand(
        "resume",
        "run the last training cell again from a checkpoint",
        "%rtnb resume step-20",
        resume_args,
    ),
    Subcommand(
        "load",
        "rtnb.get_checkpoint() returns this checkpoint on every rank",
        "%rtnb load latest --run other-run",
        resume_args,
    ),
    Subcommand(
        "sweep",
        "a Tune search, each trial on a reused group of ranks (the cell is its code)",
        "%%rtnb sweep space --metric loss --mode min --num-samples 8 --scheduler asha",
        sweep_args,
    ),
    Subcommand(
        "warm",
        "the warm Ray: attached kernels, spare ranks, idle timeout (stop: end it now)",
        "%rtnb warm stop",
        warm_args,
    ),
    Subcommand(
        "attach",
        "take a detached group (%rtnb start --detached) into this kernel",
        "%rtnb attach mnist",
        attach_args,
    ),
]


SUBCOMMAND_NAMES = tuple(sub.name for sub in SUBCOMMANDS)
BY_NAME = {s.name: s for s in SUBCOMMANDS}


@magic_arguments()
@cell_options
def rtrain_args(line):
    """%%rtrain's options: the parser the magics use for a cell they run themselves
    (%rtnb resume, %rtnb import) and the manual's reference"""
