"""The home directory and the record log: secrets 0600, clear errors, torn tails cut."""

from __future__ import annotations

import stat
import time

import pytest

from ttpeer.daemon import Home, new_invite
from ttpeer.daemon.node._recordlog import RecordLog
from ttpeer.errors import HomeError
from ttpeer.proto import Token, parse, sign

RELAY, FP = "https://127.0.0.1:1", "sha256:" + "ab" * 32


def test_create_pool_writes_secrets_owner_only(tmp_path):
    home = Home(tmp_path / "h")
    cfg = home.create_pool(RELAY, FP, "alice", time.time())
    assert stat.S_IMODE((tmp_path / "h").stat().st_mode) == 0o700
    for name in ("node.key", "seal.key", "pool.key", "root.key", "pool.json"):
        assert stat.S_IMODE((tmp_path / "h" / name).stat().st_mode) == 0o600, name
    assert home.config() == cfg
    assert parse(cfg.proof[1])["node"] == home.node_key().public_key().public_bytes_raw().hex()


def test_enroll_with_a_token_and_refuse_a_second_enrolment(tmp_path):
    admin = Home(tmp_path / "a")
    cfg = admin.create_pool(RELAY, FP, "alice", time.time())
    invite, key = new_invite(admin.root_key(), cfg.pool, ttl=60, uses=1, role="member", now=time.time())
    token = Token((RELAY,), FP, cfg.pool, invite, key.private_bytes_raw())
    home = Home(tmp_path / "b")
    joined = home.enroll(token, "bob", time.time())
    assert joined.pool == cfg.pool and home.pool_key() is None  # the key comes from a member later
    with pytest.raises(HomeError, match="already enrolled"):
        home.enroll(token, "bob", time.time())


def test_missing_home_and_non_admin_say_what_to_do(tmp_path):
    with pytest.raises(HomeError, match="ttpeer pool create"):
        Home(tmp_path / "nothing").config()
    admin = Home(tmp_path / "a")
    cfg = admin.create_pool(RELAY, FP, "alice", time.time())
    invite, key = new_invite(admin.root_key(), cfg.pool, ttl=60, uses=1, role="member", now=time.time())
    member = Home(tmp_path / "b")
    member.enroll(Token((RELAY,), FP, cfg.pool, invite, key.private_bytes_raw()), "bob", time.time())
    with pytest.raises(HomeError, match="only the pool admin"):
        member.root_key()


def test_one_daemon_per_home(tmp_path):
    home = Home(tmp_path / "h")
    home.create_pool(RELAY, FP, "alice", time.time())
    home.lock()
    try:
        with pytest.raises(HomeError, match="already running"):
            Home(tmp_path / "h").lock()
    finally:
        home.unlock()


def _records(n):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    return [sign("claim", "ab" * 16, {"job": "cd" * 32, "round": i, "shard": 0, "attempt": 0, "n": 0,
                                         "done": 0, "rate": 0.0, "backup": False}, key)
            for i in range(n)]


def _write_log(path, recs) -> bytes:  # type: ignore[no-untyped-def]
    log = RecordLog(path)
    for r in recs:
        log.append(r.raw)
    log.close()
    return path.read_bytes()


def test_record_log_survives_a_torn_tail_at_every_cut(tmp_path):
    recs = _records(4)
    data = _write_log(tmp_path / "whole.log", recs)
    for cut in range(len(data) + 1):  # a crash can stop a write at any byte
        path = tmp_path / f"cut{cut}.log"
        path.write_bytes(data[:cut])
        got = RecordLog(path).load()
        assert got == [r.raw for r in recs][: len(got)]  # a prefix, never garbage
        assert path.stat().st_size == sum(8 + len(r) for r in got)  # the torn tail was cut off
        again = RecordLog(path)
        again.append(recs[0].raw)  # appends continue from a clean end
        again.close()
        assert RecordLog(path).load()[-1] == recs[0].raw


def test_record_log_stops_at_a_corrupt_frame(tmp_path):
    recs = _records(3)
    path = tmp_path / "r.log"
    data = bytearray(_write_log(path, recs))
    data[8 + len(recs[0].raw) + 8 + 5] ^= 0xFF  # flip a byte inside the second record
    path.write_bytes(bytes(data))
    assert RecordLog(path).load() == [recs[0].raw]


def test_the_pools_relays_are_kept_in_pool_json_and_an_older_file_still_loads(tmp_path):
    import json

    home = Home(tmp_path / "h")
    home.create_pool(RELAY, FP, "alice", time.time())
    raw = json.loads((tmp_path / "h" / "pool.json").read_text())
    raw.pop("fingerprints")  # a pool.json written before a pool could have several relays
    (tmp_path / "h" / "pool.json").write_text(json.dumps(raw))
    assert home.config().relay_pairs() == [(RELAY, FP)]
    other = ("https://relay2.example", "sha256:" + "cd" * 32)
    home.save_relays([(RELAY, FP), other])
    assert home.config().relay_pairs() == [(RELAY, FP), other]
    home.save_relays([other])  # the first relay removed: the first pin follows
    cfg = home.config()
    assert (cfg.relays, cfg.fingerprint, cfg.relay_pairs()) == ([other[0]], other[1], [other])
    assert stat.S_IMODE((tmp_path / "h" / "pool.json").stat().st_mode) == 0o600
