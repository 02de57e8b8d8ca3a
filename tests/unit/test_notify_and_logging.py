"""sd_notify over a real datagram socket, and log lines that never carry a secret."""

from __future__ import annotations

import json
import logging
import os
import socket
import uuid

import trio

from ttpeer import _logging
from ttpeer.daemon.service._systemd import Notifier


def _receiver(address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + address[1:] if address.startswith("@") else address)
    s.setblocking(False)
    return s


def _drain(s: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(s.recv(4096).decode())
        except BlockingIOError:
            return out


def test_notify_to_a_path_and_to_an_abstract_socket(tmp_path):
    for address in (str(tmp_path / "notify"), f"@ttpeer-test-{uuid.uuid4().hex}"):
        with _receiver(address) as rx:
            n = Notifier.from_environ({"NOTIFY_SOCKET": address})
            assert n.send(ready=1, status="line one\nline two")
            assert _drain(rx) == ["READY=1\nSTATUS=line one line two"]


def test_without_systemd_nothing_is_sent_and_a_dead_socket_is_not_fatal(tmp_path):
    assert not Notifier.from_environ({}).send(ready=1)
    assert not Notifier(str(tmp_path / "nobody-listens")).send(ready=1)


def test_the_watchdog_belongs_to_the_pid_systemd_named():
    env = {"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "4000000"}
    assert Notifier.from_environ(env).watchdog_interval == 2.0
    assert Notifier.from_environ({**env, "WATCHDOG_PID": str(os.getpid())}).watchdog_interval == 2.0
    assert Notifier.from_environ({**env, "WATCHDOG_PID": "1"}).watchdog_interval is None


async def test_watchdog_pings_while_the_loop_runs(tmp_path, autojump_clock):
    address = str(tmp_path / "notify")
    with _receiver(address) as rx:
        n = Notifier(address, watchdog_usec=1_000_000)
        states = iter(["round 1/4", "round 1/4", "round 2/4"])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(n.watchdog, lambda: next(states, "round 2/4"))
            await trio.sleep(1.6)  # pings at 0, 0.5, 1.0, 1.5
            nursery.cancel_scope.cancel()
        got = _drain(rx)
    assert len(got) == 4 and all(m.startswith("WATCHDOG=1") for m in got)
    assert [m for m in got if "STATUS=" in m] == ["WATCHDOG=1\nSTATUS=round 1/4", "WATCHDOG=1\nSTATUS=round 2/4"]


def test_tokens_and_keys_never_reach_a_log_line(capsys):
    key = bytes(range(32))
    _logging.add_secret(key)
    token = "ttp1.eyJhbGciOi-SECRET_PART.abc_DEF="
    for fmt in ("text", "json"):
        _logging.setup("debug", fmt)
        log = logging.getLogger("ttpeer.test")
        log.warning("joining with %s", token)
        log.warning("key %s and %r", key.hex(), key.hex().upper())
        try:
            raise ValueError(f"bad key {key.hex()}")
        except ValueError:
            log.exception("failed")
        err = capsys.readouterr().err
        assert "SECRET_PART" not in err and key.hex() not in err and key.hex().upper() not in err
        assert err.count("[redacted]") >= 4
        if fmt == "json":
            lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
            assert [x["level"] for x in lines] == ["warning", "warning", "error"]
            assert "Traceback" in lines[2]["exc"]
    _logging.setup("warning", "text")
