"""``ttpeer join`` checks the relay's certificate through the configured proxy: on a
machine whose only way out is an HTTP CONNECT proxy, a direct check could never work.
(The whole path through a real tinyproxy is in tests/netns.)"""

from __future__ import annotations

import socket
import time

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ttpeer.cli import main
from ttpeer.daemon import new_invite
from ttpeer.proto import make_token, pool_id_of, public_hex


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _token(relay: str) -> str:
    root = Ed25519PrivateKey.generate()
    invite, key = new_invite(root, pool_id_of(public_hex(root)), ttl=600, uses=1, role="member", now=time.time())
    return make_token([relay], "sha256:" + "ab" * 32, invite, key.private_bytes_raw())


def test_join_checks_the_relay_through_https_proxy(tmp_path, monkeypatch, capsys):
    proxy_port = _closed_port()
    monkeypatch.setenv("TTPEER_CONFIG", str(tmp_path / "none.toml"))
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{proxy_port}")
    code = main(["join", _token(f"https://127.0.0.1:{_closed_port()}"), "--home", str(tmp_path / "home")])
    err = capsys.readouterr().err
    assert code != 0
    assert "via proxy 127.0.0.1" in err, err  # it went to the proxy, not straight to the relay
    assert not (tmp_path / "home" / "pool.json").exists()  # nothing enrolled
