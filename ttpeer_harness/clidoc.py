"""docs/reference/cli.md, generated from ``ttpeer``'s own parser: every command's ``--help``.

    python -m ttpeer_harness.clidoc            # rewrite docs/reference/cli.md
    python -m ttpeer_harness.clidoc --check    # exit 1 if it is stale (tests/unit/test_cli_reference.py)

The help is rendered at a fixed width (100 columns), so the file does not depend on the
terminal that made it; argparse's layout differs between Python versions, so the file is
made (and checked) with the version ``PYTHON`` names.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path

PATH = Path(__file__).resolve().parents[1] / "docs" / "reference" / "cli.md"
WIDTH = "100"
PYTHON = (3, 11)
HEAD = """# Command reference

Every `ttpeer` command's `--help`, generated from the parser
(`python -m ttpeer_harness.clidoc`; a test fails when this file is stale). The guide
(docs/guide/) says when to use which; `ttpeer COMMAND --help` prints the same text.
"""


def _subcommands(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, f"{path} {name}")


def render() -> str:
    from ttpeer.cli import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        parts = [HEAD]
        for path, parser in _subcommands(build_parser(), "ttpeer"):
            parser.prog = path
            parts.append(f"\n## `{path}`\n\n```\n{parser.format_help().rstrip()}\n```\n")
        return "".join(parts)
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(prog="python -m ttpeer_harness.clidoc", description=__doc__.split("\n\n")[0])
    args.add_argument("--check", action="store_true", help="exit 1 if docs/reference/cli.md is stale")
    check = args.parse_args(argv).check
    text = render()
    if check:
        stale = not PATH.exists() or PATH.read_text() != text
        if stale:
            print(f"{PATH} is stale: run python -m ttpeer_harness.clidoc", file=sys.stderr)
        return 1 if stale else 0
    PATH.parent.mkdir(parents=True, exist_ok=True)
    PATH.write_text(text)
    print(f"wrote {PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
