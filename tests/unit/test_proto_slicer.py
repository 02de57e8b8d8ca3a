"""The slicer and the ledger on sliced closes, pure: which results a close may name, who
reduces or checks a slice when, and when a close naming slices is valid."""

from __future__ import annotations

import dataclasses

import pytest
from ttpeer_wire import public_hex

from ttpeer.proto import FetchSlices, JobSpec, RecordSet, ReduceSlice, canonical_chain, sign
from ttpeer.proto import _slices as sl
from ttpeer.proto._ledger import _slices_fit
from ttpeer.proto._reports import RETRY_AFTER
from ttpeer.proto._slicer import Slicer

from .proto_helpers import Pool, hex64, job_body, key, state

P = Pool("slicer")
KEYS = [key(f"s{i}") for i in range(4)]
NAMES = [public_hex(k) for k in KEYS]
JOB = sign("job", P.id, job_body(shards=4, chunk=4096), KEYS[0])
SPEC = JobSpec.of(JOB)
# A job as this version's submit writes it: it names slice_bits, so slow authors reduce last.
JOB4 = sign("job", P.id, job_body(shards=4, chunk=4096, slice_bits=4), KEYS[0])
BASE = JOB["init"]


def _contribs(chunks: int = 8, up: list[float] | None = None, job=JOB) -> list:
    """One contribution per key; ``up``: each one's ``up_s`` (its 100 bytes' upload)."""
    return [sign("contrib", P.id, {"job": job.id, "round": 0, "base": BASE, "shards": [i], "samples": 8,
                                   "blob": hex64(("d", i)), "size": 100, "chunks": chunks,
                                   "metrics": {} if up is None else {"up_s": up[i]}}, k)
            for i, k in enumerate(KEYS)]


def _records(*recs, job=JOB) -> RecordSet:
    rs = RecordSet(P.id)
    for r in [*P.admit(KEYS), job, *recs]:
        rs.add(r)
    return rs


def _slice(author, cover, s: int, sha: str = "good", *, size: int = 1000, blob: str | None = None, job=JOB):
    spans = sl.plan(JobSpec.of(job), cover)
    assert spans is not None
    first, stop = spans[s]
    return sign("slice", P.id, {"job": job.id, "round": 0, "base": BASE, "contribs": sorted(c.id for c in cover),
                                "slice": s, "of": len(spans), "first": first, "stop": stop,
                                "blob": blob or hex64(("b", sha, s)), "sha256": hex64((sha, s)), "size": size},
                author)


def test_the_plan_slices_rounds_of_three_or_more_authors_that_agree_on_the_chunks():
    cover = _contribs()
    assert sl.plan(SPEC, cover) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert sl.plan(SPEC, cover[:2]) is None  # two authors: all deltas
    assert sl.plan(SPEC, [*cover[:3], _contribs(chunks=9)[3]]) is None  # the contributions disagree
    assert sl.plan(JobSpec.of(sign("job", P.id, job_body(shards=4), KEYS[0])), cover) is None  # not a sliced job


def test_a_job_with_slice_min_slices_only_rounds_that_save_each_peer_that_much():
    # 4 deltas of 100 bytes at 8 bits, 4 slices of a reduced model as large as a delta: each
    # peer downloads 3 x 100 bytes, or sliced 3 x 25 + 3 x 25 = 150; slices save 150 bytes.
    cover = _contribs()
    for least, sliced in [(150, True), (151, False), (0, True)]:
        job = sign("job", P.id, job_body(shards=4, chunk=4096, slice_bits=8, slice_min=least), KEYS[0])
        assert (sl.plan(JobSpec.of(job), cover) is not None) == sliced, least
    # At 3-bit slices of 8-bit deltas the reduced model is taken as 3/8 of a delta: 3 x 25 +
    # 3 x 9.375 = 103.125 bytes, a saving of 196.875.
    job = sign("job", P.id, job_body(shards=4, chunk=4096, slice_bits=3, slice_min=196), KEYS[0])
    assert sl.plan(JobSpec.of(job), cover) is not None
    assert sl.pays(4, 4, 100, 3, 8, 196) and not sl.pays(4, 4, 100, 3, 8, 197)
    # In whole numbers: right at the line it still pays (3 x 25 + 3 x 25 = 150 saved of 300).
    assert sl.pays(4, 4, 100, 8, 8, 150) and not sl.pays(4, 4, 100, 8, 8, 151)
    with pytest.raises(ValueError, match="at least one slice"):
        sl.pays(4, 0, 100, 8, 8, 1)
    # One large contribution does not decide: the size is the cover's lower median.
    big = [*cover[:3], sign("contrib", P.id, {**cover[3].body, "size": 10**9}, KEYS[3])]
    assert sl.plan(JobSpec.of(sign("job", P.id, job_body(shards=4, chunk=4096, slice_bits=8, slice_min=151),
                                   KEYS[0])), big) is None
    assert SPEC.slice_min is None and sl.plan(SPEC, cover) is not None  # a job without it: as before


def test_the_ledger_takes_a_sliced_close_only_where_slice_min_says_the_round_slices(monkeypatch):
    monkeypatch.setattr(sl, "CHECK_ONE_IN", 10**9)  # no slice checked: one result counts
    cover = _contribs()
    results = [_slice(KEYS[s], cover, s) for s in range(4)]
    rs = _records(*cover, *results)
    ids = sorted(c.id for c in cover)
    assert _slices_fit(JOB, 0, BASE, ids, cover, results, rs) is True
    too_much = sign("job", P.id, job_body(shards=4, chunk=4096, slice_bits=8, slice_min=151), KEYS[0])
    assert _slices_fit(too_much, 0, BASE, ids, cover, results, rs) is False  # this round closes from all deltas


def test_an_author_on_a_slow_link_reduces_no_slice_first_and_the_ledger_agrees(monkeypatch):
    monkeypatch.setattr(sl, "CHECK_ONE_IN", 10**9)  # no slice checked
    spec = JobSpec.of(JOB4)
    # KEYS[3]'s delta went up 5x slower than the median (up_s 2.5 against 0.5): a laptop on
    # home Wi-Fi among wired machines. Within SLOW_LINK (3x) of the median is not slow.
    cover = _contribs(up=[0.4, 0.5, 0.6, 2.5], job=JOB4)
    slow = NAMES[3]
    assert sl.slow_authors(cover) == {slow}
    assert sl.slow_authors(_contribs(up=[0.4, 0.5, 0.6, 1.4])) == frozenset()
    # 5x slower but a fraction of a second (loopback, a small model): noise, not a link.
    assert sl.slow_authors(_contribs(up=[0.04, 0.05, 0.06, 0.25])) == frozenset()
    assert sl.slow_authors(_contribs()) == frozenset()  # no figures: nobody is slow
    # An author that claims an absurdly fast upload moves the (lower) median one place at
    # most: honest uploads of 10, 100 and 100 s (the mean of the middle two would put two
    # honest authors out) leave nobody slow.
    assert sl.slow_authors(_contribs(up=[5e-324, 10.0, 100.0, 100.0])) == frozenset()
    spans = sl.plan(spec, cover)
    assert spans == [(0, 3), (3, 6), (6, 8)]  # three slices, for the three others
    # A job without slice_bits (an older version's submit) is cut as every version cuts it.
    assert sl.plan(SPEC, _contribs(up=[0.4, 0.5, 0.6, 2.5])) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    firsts = set()
    for name in NAMES:
        work, _results = Slicer(name).step(spec, 0, cover, spans, 0.0, 0.0, _records(*cover, job=JOB4))
        firsts |= {(name, w.slice) for w in work if isinstance(w, ReduceSlice)}
    assert {n for n, _s in firsts} == set(NAMES) - {slow} and len(firsts) == 3
    # A lease later each slice passes on, to the slow author only after every other.
    for s in range(3):
        assert sl.aggregators(JOB4.id, 0, [c.author for c in cover], s, frozenset({slow}))[-1] == slow
    # The ledger takes a close of three slices from these contributions, not of four.
    results = [_slice(KEYS[0], cover, s, job=JOB4) for s in range(3)]
    body = {"job": JOB4.id, "round": 0, "base": BASE, "contribs": sorted(c.id for c in cover),
            "state": state("s3"), "metrics": {}, "slices": [r.id for r in results]}
    close = sign("close", P.id, body, KEYS[0])
    assert canonical_chain(_records(*cover, *results, close, job=JOB4), JOB4).closes == (close,)


def test_each_slice_goes_to_its_author_first_then_passes_after_a_lease(monkeypatch):
    monkeypatch.setattr(sl, "CHECK_ONE_IN", 10**9)  # no slice checked (below: checked slices)
    cover = _contribs()
    spans = sl.plan(SPEC, cover)
    rs = _records(*cover)
    mine = {}
    for name in NAMES:
        work, results = Slicer(name).step(SPEC, 0, cover, spans, 0.0, 0.0, rs)
        assert results is None
        mine[name] = [w.slice for w in work]
    assert sorted(s for v in mine.values() for s in v) == [0, 1, 2, 3]  # each slice once, by one author
    silent = sorted(NAMES)[1]  # its turn is slice 1, and it never publishes
    order = sl.aggregators(JOB.id, 0, NAMES, 1)
    assert order[0] == silent
    nxt = Slicer(order[1])
    assert 1 not in [w.slice for w in nxt.step(SPEC, 0, cover, spans, 0.0, SPEC.lease - 0.1, rs)[0]]
    assert 1 in [w.slice for w in nxt.step(SPEC, 0, cover, spans, 0.0, SPEC.lease, rs)[0]]


def test_a_slice_in_flight_is_not_asked_again_and_a_failed_one_waits_its_retry_time(monkeypatch):
    """While this peer's reduction of a slice runs, later steps (every tick, every record
    heard) must not ask for it again: a second ``ReduceSlice`` of the same slice would
    download and reduce it twice. When the reduction failed (``failed``), the slice is
    asked again only from its retry time (``RETRY_AFTER`` on), not at once: a reduction
    that cannot run now (its downloads failed) would otherwise be retried in a busy loop."""
    monkeypatch.setattr(sl, "CHECK_ONE_IN", 10**9)  # no slice checked
    cover = _contribs()
    spans = sl.plan(SPEC, cover)
    rs = _records(*cover)
    for name in NAMES:  # an author whose turn it is at some slice from the cover on
        me = Slicer(name)
        work = [w for w in me.step(SPEC, 0, cover, spans, 0.0, 0.0, rs)[0] if isinstance(w, ReduceSlice)]
        if work:
            break
    mine = work[0]
    assert work == [mine]

    def asked(now: float) -> list[int]:
        return [w.slice for w in me.step(SPEC, 0, cover, spans, 0.0, now, rs)[0] if isinstance(w, ReduceSlice)]

    assert asked(1.0) == [], "a slice in flight was asked again"
    me.failed(mine, 1.0)
    assert 1.0 + RETRY_AFTER in me.deadlines()  # the machine wakes for the retry
    assert asked(1.0 + RETRY_AFTER - 0.1) == [], "a failed slice was retried before its retry time"
    assert asked(1.0 + RETRY_AFTER) == [mine.slice]  # still its turn (a lease is 30 s): made again
    assert asked(1.0 + RETRY_AFTER + 0.1) == []  # and in flight again


def test_forgetting_the_rounds_before_a_round_keeps_that_rounds_slicing(monkeypatch):
    """``forget_before(job, r)`` is called with the chain's round r when this peer starts
    work on a round (with overlap: round r+1, while round r is still being reduced). Round
    r's state must survive it: a failed reduction keeps its retry time (not retried at once),
    the results already fetched ahead are not fetched again, and ``ready_at`` still says
    when every slice had a result. Rounds before r go."""
    monkeypatch.setattr(sl, "CHECK_ONE_IN", 10**9)  # no slice checked
    cover = _contribs()
    spans = sl.plan(SPEC, cover)
    rs = _records(*cover)
    for name in NAMES:
        me = Slicer(name)
        work = [w for w in me.step(SPEC, 0, cover, spans, 0.0, 0.0, rs)[0] if isinstance(w, ReduceSlice)]
        if work:
            break
    me.failed(work[0], 1.0)
    me.forget_before(JOB.id, 0)
    assert not [w for w in me.step(SPEC, 0, cover, spans, 0.0, 1.5, rs)[0] if isinstance(w, ReduceSlice)], \
        "the retry time of the round being reduced was forgotten"
    results = [_slice(KEYS[s], cover, s) for s in range(4)]
    rs = _records(*cover, *results)
    work, chosen = me.step(SPEC, 0, cover, spans, 0.0, 4.0, rs)
    assert chosen == tuple(results) and FetchSlices(SPEC, 0, tuple(results)) in work
    me.forget_before(JOB.id, 0)
    assert me.ready_at(JOB.id, 0, BASE, cover) == 4.0
    work, chosen = me.step(SPEC, 0, cover, spans, 0.0, 5.0, rs)
    assert chosen == tuple(results) and not [w for w in work if isinstance(w, FetchSlices)], \
        "results fetched ahead were fetched again"
    me.forget_before(JOB.id, 1)
    assert me.ready_at(JOB.id, 0, BASE, cover) is None


def test_a_close_naming_any_refused_result_is_refuted():
    """A close whose slices include one result this peer refused (its blob did not hash as
    its record says) cannot be applied from here, however many of its other results are
    good: ``refutes`` says so for one refused result among several, not only for all."""
    cover = _contribs()
    results = [_slice(KEYS[s], cover, s) for s in range(4)]
    body = {"job": JOB.id, "round": 0, "base": BASE, "contribs": sorted(c.id for c in cover),
            "state": state("r"), "metrics": {}, "slices": [r.id for r in results]}
    close = sign("close", P.id, body, KEYS[0])
    me = Slicer(NAMES[1])
    assert not me.refutes(close)
    me.refused(results[2].id)
    assert me.refutes(close), "a close naming one refused result among good ones was taken"


def test_a_checked_slice_is_reduced_once_then_checked_on_a_chunk_by_the_next_in_its_order(monkeypatch):
    # The check waits for the result (it samples one chunk of it): one reduction's
    # downloads, not two, and the second in the order checks as soon as it sees the result.
    monkeypatch.setattr(sl, "CHECK_ONE_IN", 1)
    cover = _contribs()
    spans = sl.plan(SPEC, cover)
    rs = _records(*cover)
    makers: dict[int, set[str]] = {}
    for name in NAMES:
        work, _results = Slicer(name).step(SPEC, 0, cover, spans, 0.0, 0.0, rs)
        for w in work:
            assert w.against is None and not w.sample
            makers.setdefault(w.slice, set()).add(name)
    assert makers == {s: {sl.aggregators(JOB.id, 0, NAMES, s)[0]} for s in range(4)}
    order = sl.aggregators(JOB.id, 0, NAMES, 2)
    first = _slice(KEYS[NAMES.index(order[0])], cover, 2)
    rs = _records(*cover, first)
    for name in NAMES:
        checks = [w for w in Slicer(name).step(SPEC, 0, cover, spans, 0.0, 5.0, rs)[0] if w.slice == 2]
        assert checks == ([ReduceSlice(SPEC, 0, BASE, tuple(cover), 2, 4, *spans[2], first, True)]
                          if name == order[1] else [])
    # Hashes that disagree are settled by a third author reducing the whole slice.
    other = _slice(KEYS[NAMES.index(order[1])], cover, 2, sha="other")
    work, _results = Slicer(order[2]).step(SPEC, 0, cover, spans, 0.0, 5.0, _records(*cover, first, other))
    assert [(w.slice, w.sample) for w in work if w.against is not None] == [(2, False)]
    # A result this peer refused is no result to sample: the slice is made again whole.
    me = Slicer(order[1])
    me.refused(first.id)
    assert [(w.slice, w.against, w.sample) for w in me.step(SPEC, 0, cover, spans, 0.0, 5.0, rs)[0]
            if w.slice == 2] == [(2, None, False)]


def test_a_checked_slice_of_one_chunk_is_reduced_by_the_first_two_in_its_order_at_once(monkeypatch):
    # Its check is a whole reduction either way: beside the first, not after its result.
    monkeypatch.setattr(sl, "CHECK_ONE_IN", 1)
    cover = _contribs(chunks=4)
    spans = sl.plan(SPEC, cover)
    assert spans == [(0, 1), (1, 2), (2, 3), (3, 4)]
    rs = _records(*cover)
    makers: dict[int, set[str]] = {}
    for name in NAMES:
        for w in Slicer(name).step(SPEC, 0, cover, spans, 0.0, 0.0, rs)[0]:
            assert w.against is None and not w.sample
            makers.setdefault(w.slice, set()).add(name)
    assert makers == {s: set(sl.aggregators(JOB.id, 0, NAMES, s)[:2]) for s in range(4)}
    # With no result, the turns go on as for any slice: the third's two leases from the cover.
    third = sl.aggregators(JOB.id, 0, NAMES, 2)[2]
    assert 2 not in [w.slice for w in Slicer(third).step(SPEC, 0, cover, spans, 0.0, 2 * SPEC.lease - 0.1, rs)[0]]
    assert 2 in [w.slice for w in Slicer(third).step(SPEC, 0, cover, spans, 0.0, 2 * SPEC.lease, rs)[0]]


def test_a_checked_slice_counts_once_a_second_author_signs_its_hash(monkeypatch):
    monkeypatch.setattr(sl, "CHECK_ONE_IN", 1)
    cover = _contribs()
    spans = sl.plan(SPEC, cover)
    results = [_slice(KEYS[s], cover, s) for s in range(4)]
    rs = _records(*cover, *results)
    me = Slicer(NAMES[0])
    work, chosen = me.step(SPEC, 0, cover, spans, 0.0, 100.0, rs)
    assert chosen is None
    checks = [w for w in work if w.against is not None]
    assert checks and all(isinstance(w, ReduceSlice) and w.against.author != NAMES[0] for w in checks)
    confirmations = [_slice(KEYS[(s + 1) % 4], cover, s) for s in range(4)]
    rs = _records(*cover, *results, *confirmations)
    _work, chosen = Slicer(NAMES[0]).step(SPEC, 0, cover, spans, 0.0, 100.0, rs)
    assert chosen is not None and [r["slice"] for r in chosen] == [0, 1, 2, 3]


def test_each_result_is_fetched_ahead_once_as_soon_as_it_counts(monkeypatch):
    monkeypatch.setattr(sl, "CHECK_ONE_IN", 10**9)
    cover = _contribs()
    spans = sl.plan(SPEC, cover)
    results = [_slice(KEYS[s], cover, s) for s in range(4)]
    for name in NAMES:  # the closer too: its aggregate reads them
        me = Slicer(name)
        work, chosen = me.step(SPEC, 0, cover, spans, 0.0, 1.0, _records(*cover, *results[:3]))
        assert chosen is None and [w for w in work if isinstance(w, FetchSlices)] == [
            FetchSlices(SPEC, 0, tuple(results[:3]))]
        rs = _records(*cover, *results)
        work, chosen = me.step(SPEC, 0, cover, spans, 0.0, 2.0, rs)
        assert chosen == tuple(results)
        assert [w for w in work if isinstance(w, FetchSlices)] == [FetchSlices(SPEC, 0, (results[3],))]
        assert not [w for w in me.step(SPEC, 0, cover, spans, 0.0, 3.0, rs)[0] if isinstance(w, FetchSlices)]


def test_a_forged_hash_never_counts_and_the_ledger_refuses_a_close_naming_it(monkeypatch):
    monkeypatch.setattr(sl, "CHECK_ONE_IN", 1)
    cover = _contribs()
    honest = [_slice(KEYS[s], cover, s) for s in range(4)] + [_slice(KEYS[(s + 1) % 4], cover, s) for s in range(4)]
    forged = _slice(KEYS[3], cover, 0, sha="forged")
    body = {"job": JOB.id, "round": 0, "base": BASE, "contribs": sorted(c.id for c in cover), "state": state("f"),
            "metrics": {}, "slices": [forged.id, *(r.id for r in honest[1:4])]}
    bad_close = sign("close", P.id, body, KEYS[3])
    rs = _records(*cover, *honest, forged, bad_close)
    assert canonical_chain(rs, JOB).round == 0  # one author of the forged hash: it does not count
    good_close = sign("close", P.id, {**body, "state": state("g"), "slices": [r.id for r in honest[:4]]}, KEYS[0])
    rs.add(good_close)
    assert canonical_chain(rs, JOB).closes == (good_close,)
    # A second forger makes the forged hash count twice: what the checks cannot catch.
    assert sl.counts(JOB.id, 0, 0, hex64(("forged", 0)), {hex64(("forged", 0)): {"a", "b"}})


def test_an_oversized_slice_is_no_result_and_a_refused_one_is_made_again_at_once():
    cover = _contribs()
    spans = sl.plan(SPEC, cover)
    huge = _slice(KEYS[0], cover, 0, size=sl.slice_bound(2 * 4096) + 1)
    assert not sl.fits(huge, SPEC, 0, BASE, sorted(c.id for c in cover), 0, spans[0], 4)
    # A job of 4-bit slices bounds them at half the values' bytes: an int8-sized one is refused.
    spec4 = dataclasses.replace(SPEC, slice_bits=4)  # the same job id, so only the bits differ
    int8_sized = _slice(KEYS[0], cover, 0, size=sl.slice_bound(2 * 4096, 4) + 1)
    assert sl.fits(int8_sized, SPEC, 0, BASE, sorted(c.id for c in cover), 0, spans[0], 4)
    assert not sl.fits(int8_sized, spec4, 0, BASE, sorted(c.id for c in cover), 0, spans[0], 4)
    ok = _slice(KEYS[0], cover, 0)
    other = sorted(NAMES)[2]
    me = Slicer(other)
    rs = _records(*cover, ok)
    assert 0 not in [w.slice for w in me.step(SPEC, 0, cover, spans, 0.0, 1.0, rs)[0] if isinstance(w, ReduceSlice)]
    me.refused(ok.id)  # its blob did not hash as it says
    assert 0 in [w.slice for w in me.step(SPEC, 0, cover, spans, 0.0, 1.0, rs)[0] if isinstance(w, ReduceSlice)]
    assert me.refutes(sign("close", P.id, {"job": JOB.id, "round": 0, "base": BASE, "contribs": [ok["contribs"][0]],
                                          "state": state("x"), "metrics": {}, "slices": [ok.id]}, KEYS[0]))


@pytest.mark.parametrize("one_in", [0, -1])
def test_a_check_rate_below_one_is_refused(one_in):
    with pytest.raises(ValueError):
        sl.checked(JOB.id, 0, 0, one_in)


def test_a_silent_first_aggregator_of_a_checked_slice_checks_it_last_not_first_again():
    """A checked slice whose first aggregator A never publishes: B makes it a lease later,
    and the checkers take turns from B on (C, D, ..., then A), so C checks it as soon as
    B's result is seen. A had its turn already: first again among the checkers, its
    silence would cost the round a second lease. Real ``checked`` and ``aggregators``."""
    cover = _contribs()
    spans = sl.plan(SPEC, cover)
    s = next(s for s, (first, stop) in enumerate(spans) if stop - first > 1 and sl.checked(JOB.id, 0, s))
    order = sl.aggregators(JOB.id, 0, NAMES, s)
    assert len(order) == 4
    silent, maker, *checkers = order
    lease = SPEC.lease
    seen = lease + 1.0  # B made it on its turn (A's lease passed without a result)
    result = _slice(KEYS[NAMES.index(maker)], cover, s)
    before, after = _records(*cover), _records(*cover, result)

    def asked(me: Slicer, now: float, rs: RecordSet) -> list[ReduceSlice]:
        return [w for w in me.step(SPEC, 0, cover, spans, 0.0, now, rs)[0]
                if isinstance(w, ReduceSlice) and w.slice == s]

    peers = {name: Slicer(name) for name in NAMES}
    (made,) = asked(peers[silent], 0.0, before)  # A's turn first ...
    peers[silent].reduced(made)  # ... and its result never arrives
    for name in (maker, *checkers):
        assert not asked(peers[name], 0.0, before)
    # The check of B's result is C's at once, on one chunk: not A's again, not a lease later.
    at_once = {name: asked(me, seen, after) for name, me in peers.items()}
    assert sorted(order.index(n) for n, work in at_once.items() if work) == [2], \
        "the check of B's result (order[1]) went at once to order[i] for the i listed, not to order[2] alone"
    assert at_once[checkers[0]] == [ReduceSlice(SPEC, 0, BASE, tuple(cover), s, len(spans), *spans[s], result, True)]
    # Then one lease each: D, and A only after every other checker had its turn.
    for i, name in enumerate([*checkers[1:], silent], start=1):
        me = peers[name]
        assert not asked(me, seen + i * lease - 0.1, after), f"{order.index(name)}-th in the order checked early"
        assert [w.against for w in asked(me, seen + i * lease, after)] == [result]
