"""Anti-entropy answers: a record a digest lacks goes back from its designated answerers at
once and from more holders the longer it stays missing, so a record in flight, or a late
joiner's history, does not come n - 1 times."""

from __future__ import annotations

import hashlib

import pytest
from ttpeer_wire import public_hex

from ttpeer.proto import sign
from ttpeer.proto._antientropy import ANSWERERS, FALLBACK_DIGESTS, LIVE_DIGESTS, AntiEntropy
from ttpeer.proto._gossip import WINDOW_SPAN, parse_payload

from .proto_helpers import Pool, hex64, key

INTERVAL = 5.0
KEYS = [key(f"ae{i}") for i in range(10)]
NAMES = [public_hex(k) for k in KEYS]
POOL = Pool("antientropy")


def _records(n: int) -> list:
    """``n`` records every holder has and the digest's sender lacks (claims of an open round)."""
    return [sign("claim", POOL.id, {"job": hex64("j"), "round": 0, "shard": i, "attempt": 0, "n": 0, "done": 0,
                                    "rate": 0.0, "backup": False}, KEYS[0]) for i in range(n)]


def _holders(recs: list, live: list[str], now: float) -> dict[str, AntiEntropy]:
    """One AntiEntropy per live peer but the sender (``NAMES[0]``), each holding ``recs`` and
    having heard from every live peer at ``now``."""
    out = {}
    for me in live[1:]:
        ae = AntiEntropy(INTERVAL, now, me)
        for r in recs:
            ae.admit(r)
        ae.heard.update({p: now for p in live if p != me})
        out[me] = ae
    return out


def _answered(ae: AntiEntropy, now: float, holds: frozenset[str] = frozenset()) -> set[str]:
    """The ids ``ae`` sends ``NAMES[0]`` at ``now`` for a digest of the id prefixes ``holds``
    (none of the records, unless given)."""
    ae.heard.update({p: now for p, t in ae.heard.items() if t >= 0})  # they go on being heard from
    sends = ae.answer(NAMES[0], (set(holds), 0, WINDOW_SPAN), {}, now)
    got = set()
    for s in sends:
        kind, raws = parse_payload(s.payload)
        assert kind == "records" and s.peer == NAMES[0]
        got |= {hashlib.sha256(raw).hexdigest() for raw in raws}
    return got


def test_each_missing_record_comes_from_two_designated_answerers_at_once_and_from_more_while_it_stays_missing():
    recs = _records(40)
    holders = _holders(recs, NAMES, 100.0)
    first = {me: _answered(ae, 100.0) for me, ae in holders.items()}
    for r in recs:  # each record goes back ANSWERERS times, not 9
        assert sum(r.id in got for got in first.values()) == ANSWERERS
    assert all(first.values()), "the work spreads over the holders"
    # Still missing a digest later: the same designated ones answer, nobody else yet.
    again = {me: _answered(ae, 100.0 + INTERVAL) for me, ae in holders.items()}
    assert again == first
    # Missing for FALLBACK_DIGESTS intervals, the answerers double (the designated ones were
    # dead, or their answers were lost); twice that, again; then every holder of the 9.
    for waited, count in ((1, 2 * ANSWERERS), (2, 4 * ANSWERERS), (3, 9)):
        now = 100.0 + waited * FALLBACK_DIGESTS * INTERVAL
        late = {me: _answered(ae, now) for me, ae in holders.items()}
        for r in recs:
            assert sum(r.id in got for got in late.values()) == count
        assert all(first[me] <= late[me] for me in holders)  # the first ones go on answering


def test_a_record_that_arrived_in_between_starts_its_wait_over():
    recs = _records(30)
    ae = next(iter(_holders(recs, NAMES, 0.0).values()))
    designated = _answered(ae, 0.0)
    assert 0 < len(designated) < len(recs)
    # The next digest holds them all (they came from others): nothing to answer, and the
    # missing-since times are dropped; lacking them again later starts the wait over, so
    # only the designated answer, where a wait from 0 s would have doubled the answerers.
    assert _answered(ae, INTERVAL, frozenset(r.id[:16] for r in recs)) == set()
    assert _answered(ae, FALLBACK_DIGESTS * INTERVAL) == designated
    assert _answered(ae, 2 * FALLBACK_DIGESTS * INTERVAL) > designated


@pytest.mark.parametrize("live", [2, 3])
def test_in_a_small_pool_every_holder_answers_at_once(live):
    recs = _records(10)
    for ae in _holders(recs, NAMES[:live], 0.0).values():
        assert _answered(ae, 0.0) == {r.id for r in recs}


def test_peers_not_heard_from_lately_are_not_in_the_ring():
    # Nine holders, but only two besides this one heard from lately: the ring is this one
    # and those two, and each record has two designated answerers among the three.
    recs = _records(60)
    holders = _holders(recs, NAMES, 0.0)
    me, ae = next(iter(holders.items()))
    stale = [p for p in NAMES[1:] if p != me][2:]
    for p in stale:
        ae.heard[p] = -100.0  # long silent
    assert len(_answered(ae, 0.0)) > len(recs) / 2  # about two in three, against two in nine


def test_its_own_digest_echoed_back_is_not_answered():
    ae = AntiEntropy(INTERVAL, 0.0, NAMES[0])
    for r in _records(5):
        ae.admit(r)
    assert ae.answer(NAMES[0], (set(), 0, WINDOW_SPAN), {}, 0.0) == []


# -- packed payloads: only to peers that showed they read them --------------------------


def test_answers_go_packed_only_to_a_peer_that_sent_a_packed_payload():
    from ttpeer.proto._gossip import PACKED

    recs = _records(5)
    ae = AntiEntropy(INTERVAL, 0.0, NAMES[1])
    for r in recs:
        ae.admit(r)
    ae.heard[NAMES[0]] = 0.0
    plain = ae.answer(NAMES[0], (set(), 0, WINDOW_SPAN), {}, 0.0)
    assert plain and not any(s.payload.startswith(PACKED) for s in plain)
    ae.packs.add(NAMES[0])
    packed = ae.answer(NAMES[0], (set(), 0, WINDOW_SPAN), {}, 0.0)
    assert packed and all(s.payload.startswith(PACKED) for s in packed)
    assert [parse_payload(s.payload) for s in packed] == [parse_payload(s.payload) for s in plain]


def test_broadcasts_go_packed_once_every_live_peer_reads_them_and_every_other_digest_probes():
    from ttpeer.proto._gossip import PACKED, PROBE_EVERY

    ae = AntiEntropy(INTERVAL, 0.0, NAMES[0])
    ae.heard.update({NAMES[1]: 0.0, NAMES[2]: 0.0})
    ae.packs.add(NAMES[1])  # NAMES[2] runs a version that does not read them
    digests = [ae.tick(i * INTERVAL, {})[0].payload for i in range(8)]
    for p in (NAMES[1], NAMES[2]):
        ae.heard[p] = 7 * INTERVAL
    assert [d.startswith(PACKED) for d in digests] == [i % PROBE_EVERY == 0 for i in range(8)]
    assert not ae.broadcast([b"x"], 7 * INTERVAL)[0].payload.startswith(PACKED)
    ae.packs.add(NAMES[2])
    assert ae.broadcast([b"x"], 7 * INTERVAL)[0].payload.startswith(PACKED)
    assert ae.tick(8 * INTERVAL, {})[0].payload.startswith(PACKED)
    # A peer that does not read them and stays silent long enough leaves the live set: it
    # holds nothing back (it gets what it lacks in answers, unpacked, when it is back).
    ae.packs.discard(NAMES[2])
    later = 7 * INTERVAL + (LIVE_DIGESTS + 1) * INTERVAL
    ae.heard[NAMES[1]] = later
    assert ae.broadcast([b"x"], later)[0].payload.startswith(PACKED)
    assert not ae.broadcast([b"x"], 7 * INTERVAL)[0].payload.startswith(PACKED)
