"""A want of dataset pieces is a message kind of its own (``W``), sealed under its own
purpose: the receiver routes by kind, never by sniffing the payload, and a want cannot
be replayed as gossip or gossip as a want."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ttpeer.daemon import Home
from ttpeer.daemon.sealed._keys import SEALED, PoolKeys
from ttpeer.net._seal import SealError


@pytest.fixture
def keys(tmp_path: Path) -> PoolKeys:
    home = Home(tmp_path / "alice")
    home.create_pool("https://127.0.0.1:1", "sha256:" + "0" * 64, "alice", time.time())
    keys = PoolKeys(home)
    assert keys.newest is not None
    return keys


def test_a_want_and_gossip_are_sealed_apart(keys: PoolKeys) -> None:
    me = "ab" * 32
    payload = b'{"want":{"damaged":[],"id":"x","pieces":[1]}}'
    want = keys.seal_gossip(me, 7, payload, b"W")
    gossip = keys.seal_gossip(me, 8, payload)
    assert want[:1] == b"W" and gossip[:1] == b"P" and set(SEALED) == {b"P", b"W"}
    assert keys.open_gossip(me, want[1:], b"W") == (7, payload)
    assert keys.open_gossip(me, gossip[1:]) == (8, payload)
    with pytest.raises(SealError):
        keys.open_gossip(me, want[1:])  # a want relabelled as gossip
    with pytest.raises(SealError):
        keys.open_gossip(me, gossip[1:], b"W")  # gossip relabelled as a want
    with pytest.raises(SealError):
        keys.open_gossip("cd" * 32, want[1:], b"W")  # re-attributed to another peer
