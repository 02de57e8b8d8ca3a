"""Every `ttpeer` command the README and the guide show is one the parser accepts as
written (placeholders such as JOB and sha256:5f1c... filled in): a renamed flag or
command fails here before a newcomer copies it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from ttpeer.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
FILL = [(r"sha256:[0-9a-f]*\.\.\.", "sha256:" + "5f" * 32), (r"ttp1\.eyJ\.\.\.", "ttp1.eyJ")]


def commands(path: Path) -> list[tuple[int, str]]:
    """(line, command) for every line of a ```sh block that runs ttpeer."""
    found, inside, held = [], False, ""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            inside = line.strip() in ("```sh", "```bash")
            continue
        text = held + line.split("#", 1)[0].strip()
        if inside and text.endswith("\\"):  # continued on the next line
            held = text[:-1] + " "
            continue
        held = ""
        for part in re.split(r"\s*(?:&&|;)\s*", text) if inside else ():
            part = re.sub(r"^(sudo |TTPEER_TOKEN=\S+ )", "", part)
            if part.startswith("ttpeer "):
                for pattern, value in FILL:
                    part = re.sub(pattern, value, part)
                found.append((number, part.split(" <")[0].split(" |")[0]))
    return found


ALL = [(p.relative_to(ROOT).as_posix(), n, c) for p in DOCS for n, c in commands(p)]


def test_the_readme_shows_the_quick_start():
    shown = [c for f, _, c in ALL if f == "README.md"]
    for start in ("ttpeer relay --listen", "ttpeer pool create", "ttpeer join -", "ttpeer submit", "ttpeer export"):
        assert any(c.startswith(start) for c in shown), start


@pytest.mark.parametrize(("doc", "line", "command"), ALL, ids=[f"{f}:{n}" for f, n, _ in ALL])
def test_a_documented_command_parses_as_written(doc, line, command, capsys):
    try:
        build_parser().parse_args(shlex.split(command)[1:])
    except SystemExit as exc:
        if exc.code != 0:  # --help exits 0
            pytest.fail(f"{doc}:{line}: {command!r} does not parse: {capsys.readouterr().err.strip()}")
