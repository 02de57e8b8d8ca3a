"""The job ledger (I1): the canonical chain is a pure function of the set of records."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ttpeer.proto import Chain, Record, RecordSet, canonical_chain, checkpoints, contributions, select_cover, sign

from .proto_helpers import Pool, contrib, hex64, job_body, key, state

P = Pool("ledger")
M0, M1, M2 = key("ledger-m0"), key("ledger-m1"), key("ledger-m2")
OUTSIDER = key("ledger-outsider")
MEMBERSHIP = P.admit([M0, M1, M2])

JOB = sign("job", P.id, job_body(rounds=3, shards=4), M0)
OTHER_JOB = sign("job", P.id, job_body(rounds=3, shards=4, seed=99), M1)
INIT = JOB["init"]
S1, S2, S3 = state("s1"), state("s2"), state("s3")


def close(author, rnd: int, base: str, parts: list[Record], new_state: str, job: Record = JOB) -> Record:  # noqa: ANN001
    return sign("close", P.id, {
        "job": job.id, "round": rnd, "base": base, "contribs": sorted(p.id for p in parts),
        "state": new_state, "metrics": {},
    }, author)


C0A = contrib(P.id, M0, JOB, 0, INIT, [0, 1])
C0B = contrib(P.id, M1, JOB, 0, INIT, [2, 3])
CLOSE0 = close(M0, 0, INIT, [C0A, C0B], S1)
C1A = contrib(P.id, M1, JOB, 1, S1, [0, 1, 2, 3])
CLOSE1 = close(M1, 1, S1, [C1A], S2)
C2A = contrib(P.id, M2, JOB, 2, S2, [0, 1])
C2B = contrib(P.id, M0, JOB, 2, S2, [1, 2, 3])
CLOSE2 = close(M2, 2, S2, [C2A, C2B], S3)
GENUINE = [*MEMBERSHIP, JOB, C0A, C0B, CLOSE0, C1A, CLOSE1, C2A, C2B, CLOSE2]
GENUINE_CHAIN = ((INIT, S1, S2, S3), (CLOSE0.id, CLOSE1.id, CLOSE2.id))

# Closes that must never be followed. Each would extend the chain if it were
# (wrongly) accepted: ``round`` is the round it claims to close.
C0_OUT = contrib(P.id, OUTSIDER, JOB, 0, INIT, [2, 3])
C0_RANGE = contrib(P.id, M1, JOB, 0, INIT, [2, 4])
C0_WRONG_BASE = contrib(P.id, M1, JOB, 0, state("elsewhere"), [2, 3])
C0_OTHER_JOB = contrib(P.id, M1, OTHER_JOB, 0, INIT, [2, 3])
C1_BOGUS = contrib(P.id, M1, JOB, 1, state("bogus"), [0, 1, 2, 3])
C0_PART = contrib(P.id, M1, JOB, 0, INIT, [2])
C3 = contrib(P.id, M0, JOB, 3, S3, [0, 1, 2, 3])
CLAIM = sign("claim", P.id, {"job": JOB.id, "round": 0, "shard": 2, "attempt": 0, "n": 0, "done": 0, "rate": 0.0,
                             "backup": False}, M1)
BAD: dict[str, tuple[int, list[Record]]] = {
    "does not cover shard 3": (0, [C0_PART, close(M0, 0, INIT, [C0A, C0_PART], state("b1"))]),
    "only one of two contributions": (0, [close(M0, 0, INIT, [C0A], state("b2"))]),
    "names an unknown contribution": (0, [sign("close", P.id, {
        "job": JOB.id, "round": 0, "base": INIT, "contribs": sorted([C0A.id, C0B.id, hex64("ghost")]),
        "state": state("b3"), "metrics": {}}, M0)]),
    "contribution by a non-member": (0, [C0_OUT, close(M0, 0, INIT, [C0A, C0_OUT], state("b4"))]),
    "close by a non-member": (0, [close(OUTSIDER, 0, INIT, [C0A, C0B], state("b5"))]),
    "contribution out of shard range": (0, [C0_RANGE, close(M0, 0, INIT, [C0A, C0_RANGE], state("b6"))]),
    "contribution on another base": (0, [C0_WRONG_BASE, close(M0, 0, INIT, [C0A, C0_WRONG_BASE], state("b7"))]),
    "contribution of another job": (0, [OTHER_JOB, C0_OTHER_JOB, close(M0, 0, INIT, [C0A, C0_OTHER_JOB], state("b8"))]),
    "contribution of another round": (1, [close(M1, 1, S1, [C0A, C0B], state("b9"))]),
    "close on a base not on the chain": (1, [C1_BOGUS, close(M1, 1, state("bogus"), [C1_BOGUS], state("b10"))]),
    "close for round 0 claiming round 1": (0, [close(M1, 1, INIT, [C1A], state("b11"))]),
    "close beyond the last round": (3, [C3, close(M0, 3, S3, [C3], state("b12"))]),
    "contribution that is a claim": (0, [CLAIM, sign("close", P.id, {
        "job": JOB.id, "round": 0, "base": INIT, "contribs": sorted([C0A.id, CLAIM.id]),
        "state": state("b13"), "metrics": {}}, M0)]),
}
# Genuine records up to the base each bad close sits on.
PREFIX = {0: [*MEMBERSHIP, JOB, C0A, C0B], 1: [*MEMBERSHIP, JOB, C0A, C0B, CLOSE0, C1A], 3: GENUINE}
ALL_BAD = [r for _, recs in BAD.values() for r in recs]


def record_set(records: list[Record]) -> RecordSet:
    rs = RecordSet(P.id)
    for rec in records:
        rs.add(rec)
    return rs


def summary(chain: Chain) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return chain.states, tuple(c.id for c in chain.closes)


def test_genuine_chain() -> None:
    chain = canonical_chain(record_set(GENUINE), JOB)
    assert summary(chain) == GENUINE_CHAIN
    assert chain.round == 3 and chain.head == S3


def test_chain_grows_one_round_at_a_time() -> None:
    assert summary(canonical_chain(record_set([*MEMBERSHIP, JOB]), JOB)) == ((INIT,), ())
    assert canonical_chain(record_set([*MEMBERSHIP, JOB, C0A, C0B, CLOSE0]), JOB).round == 1
    # A close is followed only once every contribution it names is known.
    assert canonical_chain(record_set([*MEMBERSHIP, JOB, C0A, CLOSE0]), JOB).round == 0


def test_nothing_counts_without_membership() -> None:
    assert canonical_chain(record_set(GENUINE[len(MEMBERSHIP):]), JOB).round == 0
    assert record_set(GENUINE[len(MEMBERSHIP):]).jobs() == []


@pytest.mark.parametrize("case", sorted(BAD))
def test_invalid_close_is_not_followed(case: str) -> None:
    rnd, recs = BAD[case]
    bad_close = recs[-1]
    chain = canonical_chain(record_set(PREFIX[rnd] + recs), JOB)
    assert chain.round == rnd
    assert bad_close.id not in {c.id for c in chain.closes}
    assert bad_close["state"] not in chain.states


@settings(max_examples=60, deadline=None)
@given(
    st.permutations(GENUINE + ALL_BAD),
    st.lists(st.integers(0, len(GENUINE + ALL_BAD) - 1), max_size=15),
    st.integers(0, len(GENUINE + ALL_BAD)),
)
def test_chain_ignores_insertion_order_and_duplication(order: list[Record], dups: list[int], peek: int) -> None:
    everything = GENUINE + ALL_BAD
    rs = RecordSet(P.id)
    for i, rec in enumerate(order + [everything[d] for d in dups]):
        if i == peek:  # a view computed mid-way must not go stale (cached members)
            canonical_chain(rs, JOB)
        assert rs.add(rec) == (rec.id not in {r.id for r in (order + [everything[d] for d in dups])[:i]})
    assert len(rs) == len(everything)
    assert summary(canonical_chain(rs, JOB)) == GENUINE_CHAIN


def test_record_set_refuses_duplicates_and_other_pools() -> None:
    rs = RecordSet(P.id)
    assert rs.add(JOB) and not rs.add(JOB)
    assert not rs.add(sign("job", Pool("x").id, job_body(), M0))
    assert len(rs) == 1 and JOB.id in rs


# -- conflicting closes ---------------------------------------------------------------------


def branch(base_close_state: str, start: int, length: int, label: str, author=M1) -> list[Record]:  # noqa: ANN001
    """Rounds ``start``.. ``start+length-1`` on top of ``base_close_state``."""
    out: list[Record] = []
    base = base_close_state
    for rnd in range(start, start + length):
        c = contrib(P.id, author, JOB, rnd, base, [0, 1, 2, 3])
        nxt = state(f"{label}:{rnd}")
        out += [c, close(author, rnd, base, [c], nxt)]
        base = nxt
    return out


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.text("abc", min_size=1, max_size=3), st.data())
def test_fork_longest_branch_wins_then_smallest_state(la: int, lb: int, tag: str, data: st.DataObject) -> None:
    a = branch(INIT, 0, la, f"A{tag}", M1)
    b = branch(INIT, 0, lb, f"B{tag}", M2)
    records = data.draw(st.permutations([*MEMBERSHIP, JOB, *a, *b]))
    chain = canonical_chain(record_set(records), JOB)
    a_first, b_first = a[1]["state"], b[1]["state"]
    if la != lb:
        winner = a if la > lb else b
    else:
        winner = a if a_first < b_first else b
    assert chain.closes == tuple(winner[1::2])
    assert chain.round == max(la, lb)


def test_conflicting_closes_of_equal_length_pick_smaller_state() -> None:
    lo, hi = sorted([state("x1"), state("x2")])
    c_lo, c_hi = close(M0, 0, INIT, [C0A, C0B], lo), close(M1, 0, INIT, [C0A, C0B], hi)
    for order in ([c_lo, c_hi], [c_hi, c_lo]):
        chain = canonical_chain(record_set([*MEMBERSHIP, JOB, C0A, C0B, *order]), JOB)
        assert chain.states == (INIT, lo) and chain.closes == (c_lo,)
    # ... unless the larger one has a child: the longer branch wins.
    child = branch(hi, 1, 1, "child")
    chain = canonical_chain(record_set([*MEMBERSHIP, JOB, C0A, C0B, c_lo, c_hi, *child]), JOB)
    assert chain.states[:2] == (INIT, hi) and chain.round == 2


def test_same_edge_signed_twice_follows_the_lower_close_id() -> None:
    twins = [close(M0, 0, INIT, [C0A, C0B], S1), close(M2, 0, INIT, [C0A, C0B], S1),
             close(M1, 0, INIT, [C0A, C0B, C1A], S1)]
    for order in (twins, twins[::-1]):
        chain = canonical_chain(record_set([*MEMBERSHIP, JOB, C0A, C0B, C1A, *order]), JOB)
        assert chain.states == (INIT, S1)
        assert chain.closes[0].id == min(t.id for t in twins[:2])  # the third names a round-1 contribution


# -- contributions, select_cover, checkpoints ---------------------------------------------


def test_contributions_filter_round_base_membership_and_range() -> None:
    rs = record_set(GENUINE + ALL_BAD)
    got = contributions(rs, JOB, 0, INIT)
    ids = {c.id for c in got}
    assert ids == {C0A.id, C0B.id, C0_PART.id}
    assert not ids & {C0_OUT.id, C0_RANGE.id, C0_WRONG_BASE.id, C0_OTHER_JOB.id, C1A.id}
    assert [c.id for c in got] == sorted(ids)


def _contribs(shard_sets: list[list[int]]) -> list[Record]:
    return sorted(
        (contrib(P.id, M0, JOB, 0, INIT, sorted(set(s)), samples=1 + i) for i, s in enumerate(shard_sets)),
        key=lambda c: c.id,
    )


shard_sets = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True), max_size=6)


@settings(max_examples=60, deadline=None)
@given(shard_sets)
def test_select_cover_is_deterministic_and_covers_all_or_none(sets: list[list[int]]) -> None:
    contribs = _contribs(sets)
    cover = select_cover(JOB, contribs)
    assert cover == select_cover(JOB, list(contribs))
    union = {s for c in contribs for s in c["shards"]}
    if union != set(range(4)):
        assert cover is None
        return
    assert cover is not None
    assert {s for c in cover for s in c["shards"]} == set(range(4))
    assert [c for c in contribs if c in cover] == cover  # a sub-sequence, in id order
    seen: set[int] = set()
    for c in cover:  # every chosen contribution adds a shard
        assert not set(c["shards"]) <= seen
        seen |= set(c["shards"])


def test_select_cover_does_not_depend_on_input_order() -> None:
    contribs = _contribs([[0], [0, 1, 2, 3], [1, 2]])
    covers = {tuple(c.id for c in select_cover(JOB, order) or ()) for order in (contribs, contribs[::-1],
                                                                                  contribs[1:] + contribs[:1])}
    assert len(covers) == 1


def test_select_cover_never_returns_a_cover_with_a_missing_shard() -> None:
    cover = select_cover(JOB, _contribs([[0, 1], [2, 4]]))  # shard 3 missing; 4 is out of range
    assert cover is None


def test_checkpoints_pick_the_lowest_id_per_state() -> None:
    cks = [sign("ckpt", P.id, {"job": JOB.id, "round": 1, "state": S1, "blob": hex64(i), "size": 10}, m)
           for i, m in enumerate([M0, M1, M2])]
    outsider = sign("ckpt", P.id, {"job": JOB.id, "round": 2, "state": S2, "blob": hex64(9), "size": 10}, OUTSIDER)
    for order in (cks, cks[::-1]):
        got = checkpoints(record_set([*MEMBERSHIP, JOB, *order, outsider]), JOB)
        assert set(got) == {S1}
        assert got[S1].id == min(c.id for c in cks)
