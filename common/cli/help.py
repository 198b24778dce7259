"""One ``--help`` style for every dflash console script: each option's default shown the same way.

Why a formatter rather than hand-written "(default ...)" in each help string: a default changed in code
can never disagree with the help text. Unlike argparse's ``ArgumentDefaultsHelpFormatter`` it skips the
noise defaults (None, False, suppressed): a flag's help says what it does, and an option whose default is
None says in its own words what happens without it ("default: the drafter's"). Standard library only:
every CLI imports this before parsing, so ``--help`` must stay fast.
"""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless X is None/False, the option is a switch (a
    ``--flag`` / ``--no-flag`` that takes no value: it is off unless given, whatever the field it sets
    defaults to) or the help names a default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        default = action.default
        if (
            default is None
            or default is False
            or default is argparse.SUPPRESS
            or isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction)
            or "default" in help_text
            or not (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE))
        ):
            return help_text
        return f"{help_text} (default: %(default)s)"


def plain_text(doc: str | None) -> str:
    """First line of a docstring as plain text for a ``description=``: reST ``literal`` markup removed."""
    first = (doc or "").strip().split("\n")[0]
    return first.replace("``", "").replace("`", "")
