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

from ttpeer.errors import UsageError

DEFAULT_CHUNK = 1 << 16  # --slices: values per chunk of a chunked delta
DEFAULT_BITS = 4  # --bits: a delta's bits, with error feedback (scripts/bench/convergence: the steps of 8 bits)
DEFAULT_SLICE_BITS = 3  # --slice-bits: a reduced slice's bits (scripts/bench/requantize: no loss at 3)
# Slices by default only where they save each peer this many bytes a round: below it, a
# reduction's extra round trips cost more than the bytes (scripts/bench/speedup, a 40 KB delta).
DEFAULT_SLICE_MIN = 1 << 20
DEFAULT_H_MIN, DEFAULT_H_MAX = 5, 1000  # --inner-steps auto: the bounds of a round's size unless given


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



def chunk_values(text: str) -> int:
    """``--slices VALUES`` (submit's and advise's): a power of two from 4096 to 2^21."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1 or value & (value - 1) or not 4096 <= value <= 1 << 21:
        raise argparse.ArgumentTypeError(f"a chunk is a power of two from 4096 to 2097152 values, got {value}")
    return value


def chunk_of(slices: int | None, no_slices: bool) -> int | None:
    """A fused job's chunk from ``--slices [VALUES]`` and ``--no-slices`` (submit's and
    advise's): the default chunk, the one given, or None. Raises UsageError for both."""
    if slices is not None and no_slices:
        raise UsageError("--slices and --no-slices: pick one")
    return None if no_slices else slices or DEFAULT_CHUNK


def slice_min_of(slices: int | None, chunk: int | None) -> int | None:
    """A fused job's ``slice_min`` once ``chunk_of`` gave its chunk: ``DEFAULT_SLICE_MIN``
    by default, None (slices from 3 peers whatever they save) for an explicit ``--slices``
    or without slices."""
    return DEFAULT_SLICE_MIN if chunk is not None and slices is None else None


def slice_bits_of(chunk: int | None, slice_bits: int | None) -> int | None:
    """A fused job's ``--slice-bits`` (submit's and advise's) once ``chunk_of`` gave its
    chunk: the bits given or ``DEFAULT_SLICE_BITS``, None without slices. Raises UsageError
    for bits given with ``--no-slices``."""
    if chunk is None:
        if slice_bits is not None:
            raise UsageError("--slice-bits goes with slices: leave out --no-slices, or --slice-bits")
        return None
    return slice_bits or DEFAULT_SLICE_BITS


def duration(text: str) -> float:
    """``90s``, ``30m``, ``24h``, ``7d`` or plain seconds, as seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 90s, 30m, 24h, 7d)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
