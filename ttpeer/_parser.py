"""The argument parser behind ``ttpeer``: no silent abbreviations, one-line errors,
and a "did you mean" for a mistyped flag or command.

argparse's defaults suit a newcomer badly: ``--round 2`` is quietly taken for
``--rounds`` (and breaks the day a ``--round-...`` flag is added), an unknown flag
of a subcommand is reported with the top-level usage, and nothing suggests the
flag that was meant. ``Parser`` fixes the three for every subcommand: argparse
builds subparsers with the class of their parent.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn


class Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False  # '--round' is a mistake, not '--rounds'
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        """One line on stderr, exit status 2 (argparse's), the way to more help."""
        unknown = self._unknown_flags()
        if message.startswith("the following arguments are required") and unknown:
            self.unrecognized(unknown)  # '--fingerprnt X' is why --fingerprint is missing
        choice = re.search(r"argument ([^:]+): invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if choice:
            arg, value = choice.group(1), choice.group(2)
            offered = re.findall(r"'([^']*)'", choice.group(3))
            if arg.startswith("-"):  # a flag's value: say which flag, and what it takes
                message = (f"argument {arg}: invalid choice: {value!r} (choose from {', '.join(offered)})"
                           f"{_suggest(value, offered)}")
            else:  # a command or action
                message = f"unknown {_what(self)} {value!r}{_suggest(value, offered)}"
        self.exit(2, f"error: {message} (see '{self.prog} --help')\n")

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            # argparse would report a subcommand's unknown flag with the top-level usage.
            _innermost(self, parsed).unrecognized(extras)
        return parsed

    def _known(self) -> list[str]:
        return [s for action in self._actions for s in action.option_strings if action.help is not argparse.SUPPRESS]

    def _unknown_flags(self) -> list[str]:
        every = {s for action in self._actions for s in action.option_strings}
        return [a for a in getattr(self, "_given", []) if a.startswith("--") and a.split("=", 1)[0] not in every]

    def unrecognized(self, extras: list[str]) -> NoReturn:
        flags = [e for e in extras if e.startswith("-") and e != "-"]
        if not flags:
            self.error(f"unexpected argument {extras[0]!r}")
        flag = flags[0].split("=", 1)[0]
        self.exit(2, f"error: unknown option {flag}{_suggest(flag, self._known())} (see '{self.prog} --help')\n")


def _suggest(word: str, offered: list[str]) -> str:
    close = difflib.get_close_matches(word, offered, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _what(parser: argparse.ArgumentParser) -> str:
    return "command" if parser.prog.count(" ") == 0 else "action"


def _innermost(parser: Parser, parsed: argparse.Namespace) -> Parser:
    """The subcommand's parser that took the arguments (e.g. ``ttpeer pool create``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(parsed, action.dest, None)
            sub = action.choices.get(chosen) if chosen is not None else None  # type: ignore[union-attr]
            if isinstance(sub, Parser):
                return _innermost(sub, parsed)
    return parser

