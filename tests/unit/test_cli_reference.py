"""docs/reference/cli.md is every command's --help as the parser prints it now."""

from __future__ import annotations

import sys

import pytest

from ttpeer_harness import clidoc


@pytest.mark.skipif(sys.version_info[:2] != clidoc.PYTHON, reason="argparse lays help out differently here")
def test_the_cli_reference_is_what_the_parser_prints():
    assert clidoc.PATH.read_text() == clidoc.render(), "stale: run python -m ttpeer_harness.clidoc"


def test_the_reference_has_every_command_and_subcommand():
    text = clidoc.render()
    for command in ("ttpeer submit", "ttpeer join", "ttpeer relay add", "ttpeer data add", "ttpeer service install",
                    "ttpeer wait", "ttpeer advise"):
        assert f"\n## `{command}`\n" in text, command
    assert "--inner-steps" in text and "--token-file" in text
