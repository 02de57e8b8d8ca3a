"""Fetching a round's whole deltas ahead of its close, pure: which peer is told to fetch
what, and only once per cover (``Closer.fetch_ahead``, ``FetchDeltas``)."""

from __future__ import annotations

import dataclasses

from ttpeer_wire import public_hex

from ttpeer.proto import FetchDeltas, JobSpec, sign
from ttpeer.proto._closer import Closer
from ttpeer.proto._jobspec import ENSEMBLE

from .proto_helpers import Pool, hex64, job_body, key

P = Pool("ahead")
KEYS = [key(f"a{i}") for i in range(3)]
NAMES = [public_hex(k) for k in KEYS]
JOB = sign("job", P.id, job_body(shards=3), KEYS[0])
SPEC = JobSpec.of(JOB)


def _cover(rnd: int = 0) -> list:
    return [sign("contrib", P.id, {"job": JOB.id, "round": rnd, "base": JOB["init"], "shards": [i], "samples": 8,
                                   "blob": hex64(("d", rnd, i)), "size": 100, "metrics": {}}, k)
            for i, k in enumerate(KEYS)]


def test_every_peer_fetches_the_others_deltas_once_per_cover():
    cover = _cover()
    for i, me in enumerate(NAMES):
        closer = Closer(me, digest_interval=5.0)
        assert closer.fetch_ahead(SPEC, 0, cover) == [FetchDeltas(SPEC, 0, tuple(c for c in cover if c.author != me))]
        assert closer.fetch_ahead(SPEC, 0, list(reversed(cover))) == [], "the same cover is fetched once"
        # A cover of other contributions (shard 2 trained again, by the first peer) fetches again.
        again = sign("contrib", P.id, {**cover[2].body, "blob": hex64(("again", 2))}, KEYS[0])
        assert closer.fetch_ahead(SPEC, 0, [*cover[:2], again]) == [
            FetchDeltas(SPEC, 0, tuple(c for c in (*cover[:2], again) if c.author != me))]
        later = _cover(1)
        assert [len(e.contribs) for e in closer.fetch_ahead(SPEC, 1, later)] == [2], i


def test_a_cover_of_only_this_peers_own_deltas_and_an_ensemble_fetch_nothing():
    cover = _cover()
    assert Closer(NAMES[0], 5.0).fetch_ahead(SPEC, 0, cover[:1]) == []
    assert Closer(NAMES[1], 5.0).fetch_ahead(dataclasses.replace(SPEC, mode=ENSEMBLE), 0, cover) == []


def test_forgetting_the_rounds_before_a_round_lets_a_new_cover_of_it_be_fetched():
    closer = Closer(NAMES[0], 5.0)
    cover = _cover()
    assert closer.fetch_ahead(SPEC, 0, cover)
    closer.forget_before(JOB.id, 1)
    assert closer.fetch_ahead(SPEC, 0, cover), "forgotten: asked again, it fetches again"
    assert closer.fetch_ahead(SPEC, 0, cover) == []
