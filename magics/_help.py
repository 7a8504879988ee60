"""Help and tab completion for ``%rtnb`` and ``%%rtrain``.

Each subcommand has one line of purpose and one example; its flags come from its
``magic_arguments`` parser, so ``%rtnb SUB --help``, ``%rtnb?`` and completion can
never disagree with what the parser accepts.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "Subcommand",
    "complete",
    "full_help",
    "parser_flags",
    "reference_markdown",
    "subcommand_help",
]


@dataclass(frozen=True)
class Subcommand:
    name: str
    purpose: str
    example: str
    parser_of: Callable | None = None  # the magic_arguments-decorated function

    @property
    def parser(self):
        return getattr(self.parser_of, "parser", None)

    def positionals(self) -> list[str]:
        parser = self.parser
        if parser is None:
            return []
        return [
            (action.metavar or action.dest).upper()
            for action in parser._actions
            if not action.option_strings
        ]

    def flags(self) -> list[str]:
        return parser_flags(self.parser) if self.parser is not None else []


def parser_flags(parser) -> list[str]:
    """A magic_arguments parser's long flags, sorted, without --help."""
    return sorted(
        option
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    )


def subcommand_help(prefix: str, sub: Subcommand) -> str:
    """``%rtnb SUB --help``: usage and flags from the parser, then one example."""
    parser = sub.parser
    if parser is None:
        lines = [f"usage: {prefix} {sub.name}", "", f"{sub.purpose} (no options)"]
    else:
        # "usage: <the parser's own name> [-h] ...": keep what follows the name
        parts = parser.format_usage().split(None, 2)
        lines = [f"usage: {prefix} {sub.name} {parts[2] if len(parts) > 2 else ''}".rstrip()]
        lines += ["", sub.purpose]
        options = _options_block(parser)
        if options:
            lines += ["", options]
    return "\n".join(lines) + f"\n\nExample:\n    {sub.example}"


def _options_block(parser) -> str:
    help_text = parser.format_help()
    for marker in ("options:", "optional arguments:", "positional arguments:"):
        at = help_text.find(marker)
        if at >= 0:
            return help_text[at:].rstrip()
    return ""


def full_help(intro: str, subcommands: list[Subcommand], cell_parser) -> str:
    """``%rtnb?``: every subcommand with its flags, and every ``%%rtrain`` flag."""
    lines = [intro.rstrip(), "", "Subcommands::", ""]
    for sub in subcommands:
        words = [*sub.positionals(), *(f"[{f}]" for f in sub.flags())]
        lines.append(f"    %rtnb {sub.name} {' '.join(words)}".rstrip())
        lines.append(f"        {sub.purpose}; e.g. {sub.example}")
    lines += ["", "%%rtrain / %rtrain flags::", ""]
    for action in cell_parser._actions:
        if action.option_strings and "--help" not in action.option_strings:
            lines.append(f"    {', '.join(action.option_strings):16s} {action.help or ''}")
    lines += ["", "`%rtnb SUBCOMMAND --help` shows one subcommand's flags with an example."]
    return "\n".join(lines) + "\n"


def complete(
    line: str,
    subcommands: list[Subcommand],
    cell_flags: list[str],
    run_names: Callable[[], list[str]],
    checkpoint_ids: Callable[[], list[str]],
) -> list[str]:
    """Candidates for the word being typed at the end of ``line`` (a ``%rtnb`` or
    ``%rtrain``/``%%rtrain`` line); IPython filters them by that word's prefix."""
    try:
        words = shlex.split(line)
    except ValueError:  # an unclosed quote: complete as if it were closed
        words = line.split()
    if line.endswith((" ", "\t")):
        words.append("")
    if not words:
        return []
    command, typed = words[0], words[-1]
    if command.lstrip("%") == "rtrain":
        return [f for f in cell_flags if f.startswith(typed)]
    if len(words) == 2:
        return [s.name for s in subcommands if s.name.startswith(typed)]
    by_name = {s.name: s for s in subcommands}
    sub = by_name.get(words[1])
    if sub is None:
        return []
    previous = words[-2]
    if previous in ("--name", "--run") or (sub.name in ("checkpoints", "plot") and len(words) == 3):
        if not typed.startswith("-"):
            return [r for r in _safe(run_names) if r.startswith(typed)]
    if sub.name in ("resume", "load") and not typed.startswith("-") and previous != "--run":
        return [c for c in ["latest", *_safe(checkpoint_ids)] if c.startswith(typed)]
    return [f for f in [*sub.flags(), "--help"] if f.startswith(typed)]


def _safe(source: Callable[[], list[str]]) -> list[str]:
    # Completion must never raise into the editor (no session yet, storage offline).
    try:
        return list(source())
    except Exception:  # noqa: BLE001
        return []


def reference_markdown(subcommands: list[Subcommand], cell_parser, intro: str) -> str:
    """The manual's magics reference: ``%rtnb SUB --help`` for every subcommand and the
    ``%%rtrain`` flags, as the parsers print them (the docs build calls this, so a
    renamed flag changes the page in the same build)."""
    lines = [intro.strip(), "", "| subcommand | what it does |", "| --- | --- |"]
    for sub in subcommands:
        purpose = sub.purpose.replace("|", "\\|")
        lines.append(f"| [`%rtnb {sub.name}`](#rtnb-{sub.name}) | {purpose} |")
    lines.append("| [`%%rtrain`, `%rtrain`](#rtrain) | run a cell / one line on every rank |")
    for sub in subcommands:
        sentence = sub.purpose[:1].upper() + sub.purpose[1:] + "."
        lines += ["", f"## `%rtnb {sub.name}` {{#rtnb-{sub.name}}}", "", sentence, ""]
        lines += ["```text", subcommand_help("%rtnb", sub), "```"]
    usage = cell_parser.format_help().replace(cell_parser.prog, "%%rtrain", 1)
    lines += ["", "## `%%rtrain`, `%rtrain` {#rtrain}", ""]
    lines += [
        "`%%rtrain` runs its cell on every rank (or `--ranks`), `%rtrain` one line; "
        "both take these flags.",
        "",
        "```text",
        usage.rstrip(),
        "```",
    ]
    return "\n".join(lines) + "\n"
