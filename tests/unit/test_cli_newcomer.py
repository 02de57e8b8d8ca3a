"""The command line as a newcomer meets it: no torch for client commands, one-line
errors (never a traceback) for every mistake, "did you mean", no abbreviations, and
join tokens that stay out of argv."""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ttpeer._join import read_token, up_argv
from ttpeer.cli import build_parser, main
from ttpeer.daemon import Home
from ttpeer.errors import UsageError

FIXTURES = Path(__file__).parent / "fixtures"

# Runs in a fresh interpreter: a fake daemon (canned replies from a real status) on the
# home's control socket, then each client command, then which torch modules came in.
_NO_TORCH = r"""
import json, socket, sys, threading
from pathlib import Path
from ttpeer.cli import main
home, status = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(str(home / "control.sock"))
server.listen(8)
def serve():
    while True:
        conn, _ = server.accept()
        with conn:
            request = b""
            while chunk := conn.recv(65536):
                request += chunk
            op = json.loads(request)["op"]
            reply = {"status": {"ok": True, "status": status},
                     "submit": {"ok": True, "job": "ab" * 32, "shards": 4, "lease": 30.0}}.get(
                         op, {"ok": False, "error": "only the pool admin can revoke"})
            conn.sendall(json.dumps(reply).encode())
threading.Thread(target=serve, daemon=True).start()
seen = {}
for argv in json.loads(sys.argv[3]):
    try:
        main(argv + ["--home", str(home)])
    except SystemExit:
        pass
    seen[" ".join(argv)] = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(json.dumps(seen), file=sys.stderr)
"""

CLIENT_COMMANDS = [
    ["status"], ["status", "--json"], ["wait", "abab", "--timeout", "1"], ["invite"], ["revoke", "bob"],
    ["config", "show"], ["report", "abab", "r.html"], ["export", "deadbeef", "x"], ["--help"], ["status", "--help"],
    ["submit", "--task", "mnist1d", "--rounds", "2"], ["data", "ls"], ["data", "rm", "corpus"],
]


def _enrolled(path: Path) -> Path:
    Home(path).create_pool("https://127.0.0.1:1", "sha256:" + "0" * 64, "alice", time.time())
    return path


@pytest.mark.slow
def test_client_commands_do_not_import_torch(tmp_path):
    home = _enrolled(tmp_path / "h")
    out = subprocess.run([sys.executable, "-c", _NO_TORCH, str(home), str(FIXTURES / "status.json"),
                          json.dumps(CLIENT_COMMANDS)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert "Traceback" not in out.stderr, out.stderr
    seen = json.loads(out.stderr.strip().splitlines()[-1])
    assert len(seen) == len(CLIENT_COMMANDS)
    assert {cmd: mods for cmd, mods in seen.items() if mods} == {}, "these commands imported torch"
    assert "node alice" in out.stdout and "ttpeer" in out.stdout  # they did run: status, --help


def _one_line_error(capsys, argv: list[str], says: str = "") -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and err[0].startswith("error: "), (argv, err)
    assert says in err[0], (argv, err[0])
    return err[0]


COMMANDS = [["status"], ["wait", "abc"], ["invite"], ["revoke", "bob"], ["report", "abc", "OUT/r.html"],
            ["export", "abc", "OUT/m"], ["submit", "--task", "mnist1d"], ["status", "--watch", "--frames", "1"],
            ["data", "ls"], ["data", "add", "OUT"]]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: a[0])
def test_every_command_on_a_home_that_does_not_exist(tmp_path, capsys, argv):
    argv = [a.replace("OUT", str(tmp_path)) for a in argv]
    if "--watch" in argv:  # the watch redraws its error and keeps going: no traceback, exit 0
        assert main([*argv, "--home", str(tmp_path / "nowhere")]) == 0
        assert "does not exist" in " ".join(capsys.readouterr().out.split())
        return
    _one_line_error(capsys, [*argv, "--home", str(tmp_path / "nowhere")], "does not exist")


@pytest.mark.parametrize("argv", [c for c in COMMANDS if "--watch" not in c], ids=lambda a: a[0])
def test_every_command_on_a_home_that_is_not_enrolled(tmp_path, capsys, argv):
    argv = [a.replace("OUT", str(tmp_path)) for a in argv]
    _one_line_error(capsys, [*argv, "--home", str(tmp_path)], "not enrolled")


@pytest.mark.parametrize("argv", [["status"], ["invite"], ["up"], ["report", "abc", "r.html"]], ids=lambda a: a[0])
def test_every_command_on_a_home_that_cannot_be_read(tmp_path, capsys, argv):
    (tmp_path / "pool.json").mkdir()  # reading it fails as an unreadable file does (tests run as root)
    _one_line_error(capsys, [*argv, "--home", str(tmp_path)])


def test_up_on_a_folder_that_does_not_exist_says_so(tmp_path, capsys):
    said = _one_line_error(capsys, ["--home", str(tmp_path / "nowhere"), "up"], "does not exist")
    assert "daemon.lock" not in said


@pytest.mark.parametrize(("argv", "says"), [
    (["wait", "deadbeef"], "ttpeer up"), (["export", "deadbeef", "OUT/x"], "no job 'deadbeef'"),
    (["report", "deadbeef", "OUT/r.html"], "no job 'deadbeef'"),
    (["export", "deadbeef", "OUT/no/such/dir/x"], "no job 'deadbeef'"),
    (["report", "deadbeef", "OUT/no/such/dir/r.html"], "does not exist"),
    (["submit", "--task", "OUT/missing.py"], "cannot read task file"),
    (["predict", "OUT/missing.safetensors", "OUT/rows.csv"], "does not exist"),
    (["join", "--token-file", "OUT/missing"], "does not exist"),
    (["join"], "--token-file"),
    (["status"], "ttpeer up"),
], ids=lambda v: v[0] if isinstance(v, list) else "")
def test_unknown_jobs_and_missing_files(tmp_path, capsys, argv, says):
    home = _enrolled(tmp_path / "h")
    argv = [a.replace("OUT", str(tmp_path)) for a in argv]
    _one_line_error(capsys, [*argv, "--home", str(home)], says)


@pytest.mark.slow
def test_a_closed_pipe_ends_quietly(tmp_path):
    """'ttpeer status | head -1' with the reader gone before the writer is done: unbuffered,
    so that the first line already meets the closed pipe."""
    home = _enrolled(tmp_path / "h")
    proc = subprocess.run(["bash", "-c", f"{sys.executable} -m ttpeer config show --home {home} | true; "
                           "echo ${PIPESTATUS[0]}"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.stdout.split() == ["141"]  # SIGPIPE's status, as a Unix tool's


@pytest.mark.parametrize(("argv", "says"), [
    (["submit", "--task", "mnist1d", "--rouns", "2"], "unknown option --rouns; did you mean --rounds?"),
    (["submit", "--task", "mnist1d", "--round", "2"], "unknown option --round; did you mean --rounds?"),
    (["submit", "--task", "mnist1d", "--inner-step", "2"], "did you mean --inner-steps?"),
    (["submit", "--tsk", "mnist1d"], "did you mean --task?"),
    (["stauts"], "unknown command 'stauts'; did you mean status?"),
    (["pool", "creat"], "unknown action 'creat'; did you mean create?"),
    (["pool", "create", "--relay", "https://x", "--fingerprnt", "y"], "did you mean --fingerprint?"),
    (["status", "extra"], "unexpected argument 'extra'"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_mistyped_flags_and_commands(capsys, argv, says):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and says in err[0], err


def test_no_option_is_abbreviated_anywhere():
    parser = build_parser()
    stack, seen = [parser], 0
    while stack:
        p = stack.pop()
        assert p.allow_abbrev is False, p.prog
        seen += 1
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
    assert seen > 15


def _join_args(*argv: str) -> argparse.Namespace:
    args = build_parser().parse_args(["join", *argv])
    return args


def test_the_token_comes_from_stdin_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("ttp1.from-stdin\n"))
    assert read_token(_join_args("-"), {}) == "ttp1.from-stdin"
    (tmp_path / "t").write_text("ttp1.from-file\n")
    assert read_token(_join_args("--token-file", str(tmp_path / "t")), {}) == "ttp1.from-file"
    assert read_token(_join_args(), {"TTPEER_TOKEN": "ttp1.from-env"}) == "ttp1.from-env"
    assert read_token(_join_args("ttp1.argv"), {"TTPEER_TOKEN": "ttp1.env"}) == "ttp1.argv"
    with pytest.raises(UsageError, match="not both"):
        read_token(_join_args("ttp1.x", "--token-file", str(tmp_path / "t")), {})
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n"))
    with pytest.raises(UsageError, match="empty"):
        read_token(_join_args("-"), {})


def test_the_daemon_a_join_becomes_has_the_flags_and_not_the_token(tmp_path):
    args = _join_args("ttp1.SECRET", "--device", "cpu", "--metrics", "127.0.0.1:9", "--slowdown", "2",
                      "--step-s", "0.5", "-vv", "--log-format", "json", "--config", str(tmp_path / "c.toml"))
    argv = up_argv(args, tmp_path)
    assert "ttp1.SECRET" not in " ".join(argv)
    assert argv[1:] == ["-P", "-m", "ttpeer", "up", "--home", str(tmp_path), "--config", str(tmp_path / "c.toml"),
                        "-vv", "--log-format", "json", "--device", "cpu", "--metrics", "127.0.0.1:9",
                        "--slowdown", "2.0", "--step-s", "0.5"]
    build_parser().parse_args(argv[4:])  # and 'up' takes them all


def test_a_relay_that_is_down_reads_as_one(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the test asks
    said = _one_line_error(capsys, ["pool", "create", "--relay", f"https://127.0.0.1:{port}", "--fingerprint",
                                    "sha256:" + "0" * 64, "--home", str(tmp_path / "h")])
    assert said == (f"error: cannot reach the relay at https://127.0.0.1:{port}: connection refused "
                    "(is it running, and on that port?); start that relay first, or check the URL; nothing was created")
    assert not (tmp_path / "h").exists()
