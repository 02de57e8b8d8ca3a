"""Membership (I1): ``members`` is a pure function of the record set; forgeries admit nobody."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ttpeer.proto import (
    Member,
    ProofError,
    Record,
    lost_joins,
    members,
    provisional,
    public_hex,
    sign,
    standing,
    used_by,
    verify_proof,
)

from .proto_helpers import Pool, hex64, key

P = Pool("membership")
Q = Pool("another")

IK = key("ik-main")  # invite with room for everyone genuine
IK_TWO = key("ik-two")  # uses=2, three joins race
IK_SHORT = key("ik-short")  # expires early
IK_ADMIN = key("ik-admin")
MALLORY = key("mallory")

INV = P.invite(IK, uses=5)
INV_TWO = P.invite(IK_TWO, uses=2)
INV_SHORT = P.invite(IK_SHORT, uses=5, expires=50)
INV_ADMIN = P.invite(IK_ADMIN, uses=1, role="admin")
INV_FORGED = P.invite(MALLORY, uses=5, signer=MALLORY)  # pool P, but not signed by P's root

NODES = {name: key(f"node:{name}") for name in "ABCDEFGHIJKLM"}
NID = {name: public_hex(k) for name, k in NODES.items()}

J_A = P.join(INV, NODES["A"], signer=IK, name="a")
J_B = P.join(INV, NODES["B"], signer=IK, name="b")
J_ADMIN = P.join(INV_ADMIN, NODES["C"], signer=IK_ADMIN, name="c")
J_SHORT_OK = P.join(INV_SHORT, NODES["D"], signer=IK_SHORT, at=50)  # exactly at expiry: still valid
RACE = [P.join(INV_TWO, NODES[n], signer=IK_TWO, name=n.lower()) for n in "EFG"]
RACE_WINNERS = sorted(RACE, key=lambda r: r.id)[:2]

FORGED = {
    "invite signed by non-root": INV_FORGED,
    "join through non-root invite": P.join(INV_FORGED, NODES["H"], signer=MALLORY),
    "join signed by the node, not the invite key": P.join(INV, NODES["I"], signer=NODES["I"]),
    "join signed by the root, not the invite key": P.join(INV, NODES["I"], signer=P.root),
    "join to an unknown invite": P.join(INV, NODES["J"], signer=IK, invite_id=hex64("nowhere")),
    "join after the invite expired": P.join(INV_SHORT, NODES["K"], signer=IK_SHORT, at=51),
    "join naming another invite's id": P.join(INV, NODES["L"], signer=IK, invite_id=INV_TWO.id),
}

# A whole second pool, and pool-Q records that point at pool P's invites.
Q_IK = key("q-ik")
Q_INV = Q.invite(Q_IK, uses=5)
FOREIGN = [
    Q_INV,
    Q.join(Q_INV, NODES["M"], signer=Q_IK),
    Q.join(INV, NODES["M"], signer=IK),  # pool Q, names pool P's invite
    Q.invite(IK, uses=5, signer=P.root),  # P's root signing for pool Q
]

GENUINE = [INV, INV_TWO, INV_SHORT, INV_ADMIN, J_A, J_B, J_ADMIN, J_SHORT_OK, *RACE]
EVERYTHING = GENUINE + list(FORGED.values()) + FOREIGN


def expected() -> dict[str, Member]:
    out = {}
    for join, invite in [(J_A, INV), (J_B, INV), (J_ADMIN, INV_ADMIN), (J_SHORT_OK, INV_SHORT)] + [
        (j, INV_TWO) for j in RACE_WINNERS
    ]:
        out[join["node"]] = Member(join["node"], join["seal"], join["name"], invite["role"], join.id, invite.id)
    return out


def test_members_of_the_reference_set() -> None:
    got = members(P.id, EVERYTHING)
    assert got == expected()
    assert got[NID["C"]].role == "admin" and got[NID["A"]].role == "member"
    assert len(got) == 6


@settings(max_examples=150, deadline=None)
@given(st.permutations(EVERYTHING), st.lists(st.sampled_from(EVERYTHING), max_size=12), st.data())
def test_members_ignore_order_and_duplication(perm: list[Record], dups: list[Record], data: st.DataObject) -> None:
    records = list(perm)
    for rec in dups:
        records.insert(data.draw(st.integers(0, len(records))), rec)
    assert members(P.id, records) == expected()


@settings(max_examples=100, deadline=None)
@given(st.sets(st.sampled_from(sorted(FORGED))), st.permutations(GENUINE))
def test_forged_pieces_never_make_members(which: set[str], genuine: list[Record]) -> None:
    with_forged = genuine + [FORGED[w] for w in sorted(which)] + FOREIGN
    assert members(P.id, with_forged) == members(P.id, GENUINE) == expected()
    forged_nodes = {NID[n] for n in "HIJKLM"}
    assert not forged_nodes & set(members(P.id, with_forged))


def test_forged_pieces_alone_make_no_members() -> None:
    assert members(P.id, list(FORGED.values()) + FOREIGN) == {}


def test_joins_without_their_invite_make_no_members() -> None:
    assert members(P.id, [J_A, J_B, *RACE]) == {}


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 10**6))
def test_single_use_invite_admits_exactly_the_lower_join_id(a: int, b: int) -> None:
    ik = key(f"race-ik:{a}:{b}")
    inv = P.invite(ik, uses=1)
    x = P.join(inv, key(f"race-x:{a}"), signer=ik)
    y = P.join(inv, key(f"race-y:{b}"), signer=ik)
    for order in ([inv, x, y], [y, x, inv], [x, inv, y, x]):
        got = members(P.id, order)
        winner = min(x, y, key=lambda r: r.id)
        assert list(got) == [winner["node"]]
        assert got[winner["node"]].join == winner.id


def test_a_node_that_joined_twice_counts_once_and_spends_one_use() -> None:
    ik = key("twice-ik")
    inv = P.invite(ik, uses=2)
    first = P.join(inv, NODES["A"], signer=ik, name="first")
    again = P.join(inv, NODES["A"], signer=ik, name="again", at=101)
    other = P.join(inv, NODES["B"], signer=ik)
    got = members(P.id, [inv, first, again, other])
    assert set(got) == {NID["A"], NID["B"]}
    assert got[NID["A"]].join == min(first.id, again.id)


def test_members_of_the_other_pool_are_its_own() -> None:
    got = members(Q.id, EVERYTHING)
    assert set(got) == {NID["M"]}
    assert got[NID["M"]].invite == Q_INV.id


def test_expiry_boundary() -> None:
    ik = key("boundary-ik")
    inv = P.invite(ik, expires=1000)
    on_time = P.join(inv, NODES["A"], signer=ik, at=1000)
    late = P.join(inv, NODES["B"], signer=ik, at=1001)
    assert set(members(P.id, [inv, on_time, late])) == {NID["A"]}


# -- verify_proof ------------------------------------------------------------------------


@pytest.mark.parametrize(("invite", "join"), [(INV, J_A), (INV_ADMIN, J_ADMIN), (INV_SHORT, J_SHORT_OK)])
def test_verify_proof_accepts_a_genuine_chain(invite: Record, join: Record) -> None:
    member = verify_proof(P.id, join["node"], [invite.raw, join.raw])
    assert member == members(P.id, [invite, join])[join["node"]]
    assert member.role == invite["role"]


PROOF_FORGERIES = {
    "invite signed by non-root": (P.id, NID["H"], [INV_FORGED.raw, FORGED["join through non-root invite"].raw]),
    "join signed by the node": (P.id, NID["I"], [INV.raw, FORGED["join signed by the node, not the invite key"].raw]),
    "join signed by the root": (P.id, NID["I"], [INV.raw, FORGED["join signed by the root, not the invite key"].raw]),
    "join to another invite": (P.id, NID["J"], [INV.raw, FORGED["join to an unknown invite"].raw]),
    "join to another invite 2": (P.id, NID["L"], [INV.raw, FORGED["join naming another invite's id"].raw]),
    "join after expiry": (P.id, NID["K"], [INV_SHORT.raw, FORGED["join after the invite expired"].raw]),
    "proof for another node": (P.id, NID["B"], [INV.raw, J_A.raw]),
    "proof for another pool": (P.id, NID["M"], [Q_INV.raw, FOREIGN[1].raw]),
    "our proof checked against another pool": (Q.id, NID["A"], [INV.raw, J_A.raw]),
    "join of pool Q to pool P invite": (P.id, NID["M"], [INV.raw, FOREIGN[2].raw]),
    "swapped order": (P.id, NID["A"], [J_A.raw, INV.raw]),
    "two invites": (P.id, NID["A"], [INV.raw, INV.raw]),
    "empty": (P.id, NID["A"], []),
    "one record": (P.id, NID["A"], [J_A.raw]),
    "three records": (P.id, NID["A"], [INV.raw, J_A.raw, J_A.raw]),
    "tampered invite": (P.id, NID["A"], [INV.raw.replace(b'"uses":5', b'"uses":6'), J_A.raw]),
    "tampered join": (P.id, NID["A"], [INV.raw, J_A.raw.replace(b'"name":"a"', b'"name":"z"')]),
    "garbage": (P.id, NID["A"], [b"\x00garbage", J_A.raw]),
}


@pytest.mark.parametrize("case", sorted(PROOF_FORGERIES))
def test_verify_proof_rejects_forgeries_with_proof_error(case: str) -> None:
    pool, peer, proof = PROOF_FORGERIES[case]
    with pytest.raises(ProofError):
        verify_proof(pool, peer, proof)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 1), st.data())
def test_verify_proof_rejects_any_mutated_byte(which: int, data: st.DataObject) -> None:
    proof = [bytearray(INV.raw), bytearray(J_A.raw)]
    pos = data.draw(st.integers(0, len(proof[which]) - 1))
    proof[which][pos] = data.draw(st.integers(0, 255).filter(lambda b: b != proof[which][pos]))
    with pytest.raises(ProofError):
        verify_proof(P.id, NID["A"], [bytes(p) for p in proof])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=3))
def test_fuzz_verify_proof_raises_only_proof_error(proof: list[bytes]) -> None:
    with pytest.raises(ProofError):
        verify_proof(P.id, NID["A"], proof)


# -- the machine that joined first keeps its place ---------------------------------------

def _admit(join: Record, pool: Pool = P) -> Record:
    body = {"invite": join["invite"], "join": join.id, "node": join["node"], "name": join["name"], "at": join["at"]}
    return sign("admit", pool.id, body, pool.root)


IK_ONE = key("ik-one")
INV_ONE = P.invite(IK_ONE, uses=1)
ONE = sorted((P.join(INV_ONE, key(f"one:{i}"), signer=IK_ONE, name=f"one{i}") for i in range(3)),
             key=lambda r: r.id)
FIRST = ONE[-1]  # the highest id: the lowest-id rule alone would evict it
SEEN_FIRST = _admit(FIRST)


def test_an_acknowledged_join_keeps_the_seat_against_any_lower_id():
    for later in (ONE[:1], ONE[:2]):
        got = members(P.id, [INV_ONE, FIRST, SEEN_FIRST, *later])
        assert list(got) == [FIRST["node"]]
        for loser in later:
            assert standing(P.id, [INV_ONE, FIRST, SEEN_FIRST, *later], loser["node"]) == "lost"
            assert used_by(P.id, [INV_ONE, FIRST, SEEN_FIRST, *later], loser["node"]) == SEEN_FIRST
        assert provisional(P.id, [INV_ONE, FIRST, SEEN_FIRST, *later]) == set()


def test_before_the_admin_acknowledges_the_lowest_id_is_a_provisional_member_and_the_other_waits():
    rs = [INV_ONE, FIRST, ONE[0]]
    assert list(members(P.id, rs)) == [ONE[0]["node"]]
    assert provisional(P.id, rs) == {ONE[0]["node"]}
    assert standing(P.id, rs, FIRST["node"]) == "waiting"  # not final: the admin decides
    assert lost_joins(P.id, rs) == set()


def test_an_acknowledgement_whose_join_has_not_arrived_still_holds_its_use():
    # The admit came before the join it names: the invite admits nobody else meanwhile.
    rs = [INV_ONE, SEEN_FIRST, ONE[0]]
    assert members(P.id, rs) == {}
    assert standing(P.id, rs, ONE[0]["node"]) == "lost"


def test_a_forged_acknowledgement_counts_for_nothing():
    body = {**SEEN_FIRST.body}
    forged = sign("admit", P.id, body, MALLORY)  # not the pool's root
    assert list(members(P.id, [INV_ONE, FIRST, ONE[0], forged])) == [ONE[0]["node"]]
    other_pool = sign("admit", Q.id, {**body}, Q.root)
    assert list(members(P.id, [INV_ONE, FIRST, ONE[0], other_pool])) == [ONE[0]["node"]]


def test_two_uses_acknowledged_for_the_first_two_leave_the_rest_lost():
    ik = key("ik-two-acks")
    inv = P.invite(ik, uses=2)
    joins = sorted((P.join(inv, key(f"two-acks:{i}"), signer=ik, name=f"t{i}") for i in range(4)), key=lambda r: r.id)
    seen = joins[2:]  # the admin saw the two highest ids first
    rs = [inv, *joins, *map(_admit, seen)]
    assert set(members(P.id, rs)) == {j["node"] for j in seen}
    assert lost_joins(P.id, rs) == {j["node"] for j in joins[:2]}
    one_acked = [inv, *joins, _admit(joins[3])]  # one use acknowledged, one left to the lowest id
    assert set(members(P.id, one_acked)) == {joins[3]["node"], joins[0]["node"]}
    assert provisional(P.id, one_acked) == {joins[0]["node"]}
    assert standing(P.id, one_acked, joins[1]["node"]) == "waiting"


ACK_WORLD = [INV_ONE, *ONE, SEEN_FIRST, *GENUINE, *map(_admit, RACE_WINNERS[1:])]


@settings(max_examples=150, deadline=None)
@given(st.permutations(ACK_WORLD), st.lists(st.sampled_from(ACK_WORLD), max_size=12), st.data())
def test_acknowledged_membership_ignores_order_and_duplication(perm: list[Record], dups: list[Record],
                                                               data: st.DataObject) -> None:
    """I1 with acknowledgements: any order, any duplication, the same members and standings."""
    records = list(perm)
    for rec in dups:
        records.insert(data.draw(st.integers(0, len(records))), rec)
    assert members(P.id, records) == members(P.id, ACK_WORLD)
    assert lost_joins(P.id, records) == lost_joins(P.id, ACK_WORLD) == {j["node"] for j in ONE[:2]}
    assert FIRST["node"] in members(P.id, records)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.booleans(), min_size=3, max_size=3), st.permutations(range(3)))
def test_an_acknowledged_member_is_never_evicted_by_any_record_that_can_follow(acked: list[bool],
                                                                              order: list[int]) -> None:
    """Whatever the admin acknowledged (at most the invite's one use) and in whatever order the
    joins arrive after it, a join once acknowledged stays a member."""
    chosen = [j for j, a in zip(ONE, acked, strict=True) if a][:1]
    rs = [INV_ONE, *map(_admit, chosen)]
    for i in order:
        rs.append(ONE[i])
        if chosen and chosen[0] in rs:
            assert chosen[0]["node"] in members(P.id, rs)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**34))
def test_the_time_a_token_was_used_is_the_calendars(seconds: int) -> None:
    import time

    from ttpeer_wire._proofs import utc_text  # by arithmetic: the wire reads no clock

    assert utc_text(seconds) == time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(seconds))


def test_a_record_sets_provisional_members_follow_the_records_it_is_given():
    from ttpeer.proto import RecordSet

    rs = RecordSet(P.id)
    for rec in (INV_ONE, ONE[0]):
        rs.add(rec)
    assert rs.provisional == {ONE[0]["node"]}  # held until the membership changes...
    rs.add(_admit(ONE[0]))
    assert rs.provisional == frozenset()  # ...which an acknowledgement does
    rs.add(FIRST)
    assert rs.provisional == frozenset() and set(rs.members) == {ONE[0]["node"]}
