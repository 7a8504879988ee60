"""The %rtnb magic: parse the subcommand, call its handler, display the result.

The magics hold no logic of their own beyond that, so everything they do is also
available from Python through ``rtnb.Session``. The parts: the parsers and the
subcommand table (``_parsers``), the handlers (``_commands``), %%rtrain and its
runner (``_rtrain``), the kernel's one session (``_slot``)."""

from __future__ import annotations

import difflib
import shlex

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from rtnb.magics._commands import COMMANDS, Commands
from rtnb.magics._help import complete, full_help, parser_flags, reference_markdown, subcommand_help
from rtnb.magics._parsers import BY_NAME, SUBCOMMAND_NAMES, SUBCOMMANDS
from rtnb.magics._rtrain import CellRunner, RtrainMagics
from rtnb.magics._slot import NotebookSlot

from rtnb.driver import Session, Sweep
from rtnb.errors import ConfigError
from rtnb.storage import list_runs

__all__ = ["SUBCOMMANDS", "RtnbMagics", "RtrainMagics", "completer", "reference"]


@magics_class
class RtnbMagics(Magics):
    """%rtnb, over the kernel's one :class:`NotebookSlot` (which %%rtrain shares)."""

    def __init__(self, shell=None, slot: NotebookSlot | None = None, **kwargs) -> None:
        super().__init__(shell=shell, **kwargs)
        self.slot = slot or NotebookSlot()
        self.runner = CellRunner(self.slot, shell)
        self.commands = Commands(self.slot, shell, self.runner)
        self._unwatch_sweeps = Sweep.on_start(self.commands.show_sweep)
        # A plain cell reading a name only the ranks have gets a note saying how to
        # bring it over; another extension's NameError handler is left in place.
        self._hints_names = shell is not None and not shell.custom_exceptions
        if self._hints_names:
            shell.set_custom_exc((NameError,), self.runner.name_of_the_ranks_hinted)

    @property
    def session(self) -> Session | None:
        return self.slot.session

    @property
    def last_view(self):
        return self.slot.last_view

    @property
    def last_sweep(self) -> Sweep | None:
        return self.slot.last_sweep

    def shutdown(self) -> None:
        if self._hints_names:
            self.shell.set_custom_exc((), None)
        self._unwatch_sweeps()
        session, self.slot.session = self.slot.session, None
        if session is not None:
            # A detached group outlives this kernel on purpose: let go, leave it running.
            if session.detached:
                session.release()
            else:
                session.stop()

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
                "%rtnb needs a subcommand: " + ", ".join(SUBCOMMAND_NAMES) + " (see %rtnb?)"
            )
        sub, rest = words[0], line.strip()[len(words[0]) :].strip()
        if sub in BY_NAME and ("--help" in words[1:] or "-h" in words[1:]):
            print(subcommand_help("%rtnb", BY_NAME[sub]))
            return None
        handler = COMMANDS.get(sub)
        if handler is None:
            close = difflib.get_close_matches(sub, SUBCOMMAND_NAMES, n=1)
            hint = f"did you mean `%rtnb {close[0]}`? " if close else ""
            raise UsageError(
                f"%rtnb has no subcommand {sub!r}; {hint}use one of: " + ", ".join(SUBCOMMAND_NAMES)
            )
        if (sub == "sweep") != (cell is not None):
            raise UsageError(
                "%%rtnb sweep takes the trial's training code as its cell: "
                "`%%rtnb sweep space --metric loss --mode min`"
                if sub == "sweep"
                else f"only `%%rtnb sweep` takes a cell; `%rtnb {sub}` is a line magic"
            )
        try:
            commands = self.commands
            return handler(commands, rest) if cell is None else handler(commands, rest, cell)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None


# `%rtnb?` prints the magic's docstring: make it list every subcommand with its flags
# and every %%rtrain flag, from the parsers themselves.
_intro, _, _rest = RtnbMagics.rtnb.__doc__.partition("Subcommands::")
RtnbMagics.rtnb.__doc__ = full_help(
    _intro + "Example::" + _rest.partition("Example::")[2],
    SUBCOMMANDS,
    RtrainMagics.rtrain_cell.parser,
)


def reference() -> str:
    """The manual's magics reference (docs/reference/magics.md), from the parsers."""
    return reference_markdown(SUBCOMMANDS, RtrainMagics.rtrain_cell.parser, _intro)


def completer(magics: RtnbMagics):
    """IPython custom completer for %rtnb, %rtrain and %%rtrain lines."""
    cell_flags = parser_flags(RtrainMagics.rtrain_cell.parser)

    def run_names() -> list[str]:
        session = magics.slot.session
        storage = session.config.storage_path if session is not None else None
        return [run.name for run in list_runs(storage).runs]

    def checkpoint_ids() -> list[str]:
        session = magics.slot.session
        return [] if session is None else [c.id for c in session.list_checkpoints()]

    def hook(_shell, event) -> list[str]:
        # IPython's set_hook binds a hook to the shell, so it gets the shell first.
        return complete(event.line, SUBCOMMANDS, cell_flags, run_names, checkpoint_ids)

    return hook
