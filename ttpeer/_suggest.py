"""Every command ttpeer suggests runs as printed: the options that chose where a command
acted (``--home``, ``--config``) are carried into each quoted ``'ttpeer ...'`` it prints.

ttpeer's messages suggest the next command in quotes, as ``'ttpeer up'`` or
```ttpeer data add PATH```; they are written in many places, some in the daemon. Rather
than thread the options through each, ``carrying`` rewrites what the command prints, on
its way out: a user who ran ``ttpeer pool create --home ./lab`` reads ``start it with
'ttpeer up --home ./lab'``. A suggested command that takes no such option, or already
gives it, is left as it is; so is ``ttpeer relay`` serving, which has no home, and ``ttpeer
invite``, which ttpeer suggests to a joiner for the pool admin to run on its own machine.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shlex
import sys
from collections.abc import Callable, Iterator
from typing import Any

CARRIED = ("--home", "--config")
# Serving a relay (no home; its subcommands have one); an invite (the admin's, elsewhere).
_ELSEWHERE = {("relay",), ("invite",)}

# A quoted suggestion: 'ttpeer ...' or `ttpeer ...`, optionally after sudo, on one line.
_QUOTED = re.compile(r"(['`])((?:sudo )?ttpeer [^'`\n]*)\1")
_SEGMENT = re.compile(r"(?:\s*(?:&&|\|\|?|;)\s*)")  # shell joins between commands


def options_given(args: argparse.Namespace) -> list[str]:
    """The carried options the user gave, as arguments (``["--home", "./lab"]``)."""
    out: list[str] = []
    for flag in CARRIED:
        value = getattr(args, flag[2:], None)  # absent unless given: the parser's default is SUPPRESS
        if value is not None:
            out += [flag, str(value)]
    return out


def takers(parser: argparse.ArgumentParser) -> set[tuple[str, ...]]:
    """The command paths (``("data", "add")``) whose parser takes every carried option."""
    found: set[tuple[str, ...]] = set()

    def walk(p: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        if path and all(flag in p._option_string_actions for flag in CARRIED):
            found.add(path)
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*path, name))

    walk(parser, ())
    return found


def carry(text: str, given: list[str], commands: set[tuple[str, ...]]) -> str:
    """``text`` with ``given`` added to each quoted ttpeer command in it that takes them."""
    if not given or "ttpeer " not in text:
        return text
    extra = " ".join(_quote(a) for a in given)

    def one(command: str) -> str:
        words = command.split()
        start = 2 if words[0] == "sudo" else 1
        path = tuple(w for w in words[start:start + 2] if not w.startswith("-"))
        takes = path[:2] in commands - _ELSEWHERE or path[:1] in commands - _ELSEWHERE
        if not takes or any(w in CARRIED for w in words):
            return command
        return f"{command} {extra}"

    def quoted(m: re.Match[str]) -> str:
        parts = _SEGMENT.split(m.group(2))
        joins = _SEGMENT.findall(m.group(2))
        out = one(parts[0]) if parts[0].lstrip().startswith(("ttpeer ", "sudo ttpeer ")) else parts[0]
        for join, part in zip(joins, parts[1:], strict=True):
            out += join + (one(part) if part.startswith(("ttpeer ", "sudo ttpeer ")) else part)
        return m.group(1) + out + m.group(1)

    return _QUOTED.sub(quoted, text)


def _quote(arg: str) -> str:
    """``arg`` for a shell, in double quotes when it needs quoting (the suggestion itself
    sits in single quotes)."""
    if shlex.quote(arg) == arg:
        return arg
    return '"' + re.sub(r'(["\\$`])', r"\\\1", arg) + '"'


class _Carrying:
    """A text stream that writes through ``fix`` to ``inner`` (and is ``inner`` otherwise)."""

    def __init__(self, inner: Any, fix: Callable[[str], str]) -> None:
        self._inner, self._fix = inner, fix

    def write(self, text: str) -> int:
        self._inner.write(self._fix(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def carrying(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Iterator[None]:
    """While the command runs, what it prints to stdout and stderr carries the options
    the user gave (``carry``)."""
    given = options_given(args)
    if not given:
        yield
        return
    commands = takers(parser)
    out, err = sys.stdout, sys.stderr
    sys.stdout = _Carrying(out, lambda t: carry(t, given, commands))  # type: ignore[assignment]
    sys.stderr = _Carrying(err, lambda t: carry(t, given, commands))  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err
