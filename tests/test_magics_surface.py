"""The magics' help, subcommands and handlers (magics/)."""

from __future__ import annotations


def test_rtnb_help_lists_every_subcommand_and_every_flag():
    from rtnb.magics._magics import SUBCOMMANDS, RtnbMagics, RtrainMagics

    text = RtnbMagics.rtnb.__doc__
    assert "In [1]: %load_ext rtnb" in text, "the example stays"
    for sub in SUBCOMMANDS:
        assert f"%rtnb {sub.name}" in text
        for flag in sub.flags():
            assert flag in text, (sub.name, flag)
    for flag in ("--max-failures", "--keep", "--score", "--mode", "--tensorboard", "--stop-grace"):
        assert flag in text
    for action in RtrainMagics.rtrain_cell.parser._actions:
        for option in action.option_strings:
            assert option in text or option in ("-h", "--help")
    assert "%rtnb scale WORKERS" in text and "%rtnb pull NAME" in text


def test_every_subcommand_has_one_registered_handler_and_every_handler_a_subcommand():
    """%rtnb finds a subcommand's handler in one registry; a row of the table without
    a handler (or a handler no row names) would print help for a command that fails."""
    from rtnb.magics._commands import COMMANDS
    from rtnb.magics._parsers import SUBCOMMAND_NAMES

    assert sorted(COMMANDS) == sorted(SUBCOMMAND_NAMES)
    assert COMMANDS["import"].__name__ == "import_script"
