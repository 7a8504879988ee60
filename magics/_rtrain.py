"""%%rtrain and %rtrain: a cell on the ranks, and the runner that shows it (the live
view, the progress lines, the static figure, the notebook's hints)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import magic_arguments, parse_argstring
from IPython.display import display
from rtnb.magics._parsers import LEADING_OPTIONS, cell_options, split_names
from rtnb.magics._slot import NotebookSlot
from rtnb.widgets import (
    LiveMetrics,
    LiveOnFirstReport,
    ProgressLines,
    RankLog,
    profile_figure,
    static_figure_bundle,
)

from rtnb.core._output import print_sink
from rtnb.errors import CellError, ConfigError

__all__ = ["CellRunner", "RtrainMagics", "show_profile", "shown"]


def shown(value):
    """The Out[] value of a cell: nothing when no rank returned anything."""
    if value is None or all(v is None for v in value.values()):
        return None
    return value


def show_profile(report) -> None:
    """A finished profile: its summary, its table, its figure."""
    print(report.summary())
    print(report.table())
    display(profile_figure(report))


class CellRunner:
    """Runs a cell on the kernel's session and shows it: %%rtrain, and the cells
    %rtnb resume and %rtnb import run."""

    def __init__(self, slot: NotebookSlot, shell) -> None:
        self.slot, self.shell = slot, shell

    def run(self, code: str, args, live_view: bool = True):
        session = self.slot.require()
        live = live_view and not args.no_live and self.slot.output.live
        label = self._cell_label()
        datasets = self.datasets_from([args.datasets]) if args.datasets else None
        split = split_names(args)
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
                        self.slot.last_view = LiveMetrics(
                            session.metrics,
                            handle,
                            stacks=session.stacks,
                            set_controls=session.set_controls,
                        ).show()
                    else:
                        self.slot.last_view = RankLog(handle)
                        display(self.slot.last_view)
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
            with self.names_of_the_notebook_hinted():
                return shown(handle.run_here())
        finally:
            if late is not None:
                late.close()
                self.slot.last_view = late.view or self.slot.last_view
            if session.last_profile is not profile_before and session.last_profile is not None:
                show_profile(session.last_profile)
            if progress is not None:
                progress.close()
                if session.metrics.count() > reports_before:
                    bundle = static_figure_bundle(session.metrics, title=f"run {session.run_name}")
                    if bundle is not None:
                        display(bundle, raw=True)

    @contextlib.contextmanager
    def names_of_the_notebook_hinted(self) -> Iterator[None]:
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

    def name_of_the_ranks_hinted(self, shell, etype, value, tb, tb_offset=None) -> None:
        """The notebook's NameError as IPython shows it, with a note when the ranks
        have the name (a newcomer reads a cell's variable in a plain cell)."""
        name = getattr(value, "name", None)
        session = self.slot.session
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

    def datasets_from(self, pairs: list[str]) -> dict:
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


@magics_class
class RtrainMagics(Magics):
    """%%rtrain and %rtrain: parse the line, run the cell through the runner."""

    def __init__(self, shell, runner: CellRunner) -> None:
        super().__init__(shell=shell)
        self.runner = runner

    @magic_arguments()
    @cell_options
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
        # `%%rtrain` is the cell's line 1 in the notebook's editor: the code starts on
        # line 2, so a traceback's and the hang doctor's line numbers are the editor's.
        return self.runner.run("\n" + cell, args)

    @magic_arguments()
    @cell_options
    @line_magic
    def rtrain_line(self, line: str):
        """Run one statement on every rank: ``%rtrain x = 1``.

        Example::

            In [4]: %rtrain model.weight.sum().item()
        """
        # Options only at the start; everything after them is the statement, verbatim.
        match = LEADING_OPTIONS.match(line)
        options, statement = match.group(0), line[match.end() :].strip()
        args = parse_argstring(self.rtrain_line, options)
        if not statement:
            raise UsageError("%rtrain needs a statement, e.g. `%rtrain x = 1`")
        # A one-liner prints plainly: no live view re-plotting the whole run for it.
        return self.runner.run(statement, args, live_view=False)


# IPython names magics after the methods; %rtrain and %%rtrain share one name.
RtrainMagics.magics["cell"]["rtrain"] = RtrainMagics.magics["cell"].pop("rtrain_cell")
RtrainMagics.magics["line"]["rtrain"] = RtrainMagics.magics["line"].pop("rtrain_line")
