"""The control socket's client (what `ttpeer status`, `wait`, ... use) when the daemon is
there but does not answer, or goes away mid-request: one clear error, never a traceback."""

from __future__ import annotations

import socket
import threading

import pytest

from ttpeer.daemon import call
from ttpeer.errors import DaemonNotRunning, TtpeerError


def _server(path, behaviour: str) -> socket.socket:  # type: ignore[no-untyped-def]
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        conn.recv(65536)
        if behaviour == "close":
            conn.close()  # a daemon dying, or stopping, mid-request
        else:
            threading.Event().wait(5)  # a stopped daemon: connected, never answers
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv


def test_a_daemon_that_does_not_answer_is_one_clear_error(tmp_path):
    srv = _server(tmp_path / "control.sock", "silent")
    try:
        with pytest.raises(TtpeerError) as err:
            call(tmp_path / "control.sock", {"op": "status"}, timeout=0.3)
        assert str(err.value).startswith(f"the ttpeer daemon on {tmp_path} did not answer within 0.3 s: it may be "
                                         "stopped")
    finally:
        srv.close()


def test_a_daemon_that_goes_away_mid_request_is_said_not_to_run(tmp_path):
    srv = _server(tmp_path / "control.sock", "close")
    try:
        with pytest.raises(DaemonNotRunning) as err:
            call(tmp_path / "control.sock", {"op": "status"}, timeout=5)
        assert "closed the connection without answering" in str(err.value)
    finally:
        srv.close()
