"""The client commands answer at once: they import the parser, the errors and the control
client, never the protocol, torch, trio, httpx or x509 (docs/ARCHITECTURE.md, "Imports").

Each command runs in a fresh interpreter against a real enrolled home whose daemon is not
running, so it goes as far as a user's would: the home is read, the socket is tried.
How long they take is a benchmark (scripts/bench/client), not a test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.client import PROBE
from ttpeer.daemon import Home

pytestmark = pytest.mark.slow  # a fresh interpreter per command: what is imported is per process


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("client") / "alice"
    Home(path).create_pool("https://127.0.0.1:1", "sha256:" + "0" * 64, "alice", time.time())
    return path


def _run(args: list[str], tmp: Path) -> tuple[str, list[str]]:
    env = {**os.environ, "TTPEER_CONFIG": str(tmp / "none.toml")}
    env.pop("TTPEER_HOME", None)
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, timeout=60)
    heavy = [line.split()[1:] for line in done.stderr.splitlines() if line.startswith("HEAVY")]
    assert heavy, done.stderr[-2000:]
    return done.stdout + done.stderr, heavy[0]


@pytest.mark.parametrize(("args", "said"), [
    (["--help"], "ttpeer submit"),
    (["status"], "no ttpeer daemon is running"),
    (["wait", "job1"], "no ttpeer daemon is running"),
    (["invite"], "ttp1."),
    (["config", "show"], "config file:"),
])
def test_a_client_command_imports_no_protocol_torch_or_network(args: list[str], said: str, home: Path,
                                                                tmp_path: Path) -> None:
    at = [] if args == ["--help"] else ["--home", str(home)]
    out, heavy = _run(args + at, tmp_path)
    assert said in out  # it went as far as a user's command goes
    assert heavy == []


def test_the_probe_sees_a_heavy_import(home: Path, tmp_path: Path) -> None:
    """The check above can fail: a command that does read the protocol is seen doing it."""
    out, heavy = _run(["export", "job1", str(tmp_path / "out"), "--home", str(home)], tmp_path)
    assert "no job 'job1'" in out
    assert "ttpeer.proto" in heavy
