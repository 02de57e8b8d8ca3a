"""The key ring (``proto.KeyRing``): who is handed the pool key, who is told why it is no
member, when the admin rotates, and what ends our own membership. Pure: records built
here, time passed in."""

from __future__ import annotations

import pytest

from ttpeer.proto import (
    EXPIRY_GRACE,
    AcceptKeys,
    EndMembership,
    HandKeys,
    KeyRing,
    Member,
    Record,
    RecordSet,
    Refuse,
    RejectKeys,
    Renamed,
    Rotate,
    TellEnded,
    public_hex,
    sign,
    verify_proof,
)
from ttpeer.proto._keyring import ENDED_EVERY, REHELLO_EVERY

from .proto_helpers import EXPIRES, Pool, key

P = Pool("keyring")
A, B, C = key("kr-a"), key("kr-b"), key("kr-c")
AID, BID, CID = (public_hex(k) for k in (A, B, C))
IK = key("kr-ik")
INV = P.invite(IK, uses=10)
J = {k: P.join(INV, k, signer=IK, name=n) for k, n in ((A, "a"), (B, "b"), (C, "c"))}
BASE = [INV, *J.values()]

# A single-use invite that two machines raced for, and a two-use one that three raced for.
IK_ONE, IK_TWO = key("kr-ik-one"), key("kr-ik-two")
INV_ONE, INV_TWO = P.invite(IK_ONE, uses=1), P.invite(IK_TWO, uses=2)
RACE_ONE = sorted((P.join(INV_ONE, key(f"kr-one-{i}"), signer=IK_ONE, name=f"one{i}") for i in range(2)),
                  key=lambda r: r.id)  # the lowest id wins the use
RACE_TWO = sorted((P.join(INV_TWO, key(f"kr-two-{i}"), signer=IK_TWO, name=f"two{i}") for i in range(3)),
                  key=lambda r: r.id)


def admit(join: Record) -> Record:
    """The admin's acknowledgement of ``join``."""
    body = {"invite": join["invite"], "join": join.id, "node": join["node"], "name": join["name"], "at": join["at"]}
    return sign("admit", P.id, body, P.root)


# The admin saw the winners first: every use of both invites is acknowledged.
ACK_ONE, ACK_TWO = [admit(j) for j in RACE_ONE[:1]], [admit(j) for j in RACE_TWO[:2]]


def revoke(node: str, at: int = 5) -> Record:
    return sign("revoke", P.id, {"node": node, "keep": [], "at": at}, P.root)


def records(*recs: Record) -> RecordSet:
    rs = RecordSet(P.id)
    for r in recs:
        rs.add(r)
    return rs


def proof(invite: Record, join: Record) -> Member:
    """The member a hello of ``join`` presents (verified from the proof alone)."""
    return verify_proof(P.id, join["node"], [invite.raw, join.raw])


def ring(me: str = AID, name: str = "a", *, admin: bool = False) -> KeyRing:
    return KeyRing(P.id, me, name, admin=admin)


def hello(r: KeyRing, m: Member, rs: RecordSet, *, now: float = 100.0, wall: float = EXPIRES - 10.0,
          has_key: bool = True) -> object:
    return r.hello(m, EXPIRES, rs, has_key=has_key, now=now, wall=wall)


# -- hello -------------------------------------------------------------------------------

def test_a_member_is_handed_the_keys_sealed_to_its_own_seal_key():
    b = proof(INV, J[B])
    assert hello(ring(), b, records(*BASE)) == HandKeys(BID, b.seal)


def test_a_node_that_holds_no_key_answers_nothing():
    assert hello(ring(), proof(INV, J[B]), records(*BASE), has_key=False) is None
    assert hello(ring(), proof(INV, J[B]), records(*BASE, revoke(BID)), has_key=False) is None


def test_a_revoked_node_is_shown_exactly_its_own_revocations():
    mine, again, other = revoke(BID, at=5), revoke(BID, at=6), revoke(CID)
    b = proof(INV, J[B])
    told = hello(ring(), b, records(*BASE, mine, other, again))
    assert isinstance(told, TellEnded) and (told.node, told.seal, told.where) == (BID, b.seal, "revoked")
    assert sorted(r.id for r in told.records) == sorted([mine.id, again.id])


@pytest.mark.parametrize(("invite", "race", "uses"), [(INV_ONE, RACE_ONE, 1), (INV_TWO, RACE_TWO, 2)])
def test_a_race_loser_is_shown_its_invite_and_the_joins_that_took_its_uses(invite, race, uses):
    loser = proof(invite, race[-1])
    rs = records(*BASE, INV_ONE, INV_TWO, *RACE_ONE, *RACE_TWO)
    assert hello(ring(), loser, rs) is None  # nothing acknowledged yet: the admin decides, not us
    acks = ACK_ONE if uses == 1 else ACK_TWO
    for rec in ACK_ONE + ACK_TWO:
        rs.add(rec)
    told = hello(ring(), loser, rs)
    assert isinstance(told, TellEnded) and (told.node, told.seal, told.where) == (race[-1]["node"], loser.seal, "lost")
    assert told.records[: uses + 1] == (invite, *race[:uses])
    assert sorted(r.id for r in told.records[uses + 1:]) == sorted(r.id for r in acks)  # so it can judge too


def test_a_node_whose_standing_is_not_known_yet_is_told_nothing():
    # Its join is not held (the hello's proof is added before the ring is asked; here it is not).
    assert hello(ring(), proof(INV, J[B]), records(INV, J[A])) is None


def test_ended_answers_are_limited_per_node_by_now():
    r, rs = ring(), records(*BASE, revoke(BID), revoke(CID))
    b, c = proof(INV, J[B]), proof(INV, J[C])
    assert isinstance(hello(r, b, rs, now=100.0), TellEnded)
    assert hello(r, b, rs, now=100.0 + ENDED_EVERY - 0.1) is None
    assert isinstance(hello(r, c, rs, now=100.1), TellEnded)  # another node: its own limit
    assert isinstance(hello(r, b, rs, now=100.0 + ENDED_EVERY), TellEnded)
    assert hello(r, b, rs, now=100.0 + ENDED_EVERY + 1) is None


def test_a_first_ended_answer_goes_out_at_time_zero():
    assert isinstance(hello(ring(), proof(INV, J[B]), records(*BASE, revoke(BID)), now=0.0), TellEnded)


def test_a_late_joiner_is_refused_past_expiry_and_grace():
    b = proof(INV, J[B])
    assert hello(ring(), b, records(*BASE), wall=EXPIRES + EXPIRY_GRACE) == HandKeys(BID, b.seal)
    late = EXPIRY_GRACE + 60
    assert hello(ring(), b, records(*BASE), wall=EXPIRES + late) == Refuse(BID, "invite expired", late)


def test_a_late_hello_of_a_member_that_took_part_gets_the_keys():
    b = proof(INV, J[B])
    body = {"job": "ab" * 32, "reason": "busy", "need": 0, "have": 0}
    by_a = sign("decline", P.id, body, A)
    assert isinstance(hello(ring(), b, records(*BASE, by_a), wall=EXPIRES + 86_400), Refuse)  # others' part
    by_b = sign("decline", P.id, body, B)
    assert hello(ring(), b, records(*BASE, by_b), wall=EXPIRES + 86_400) == HandKeys(BID, b.seal)


# -- key handover ---------------------------------------------------------------------

K0, K1, K2, KX = (bytes([i]) * 32 for i in range(4))


def test_keys_are_taken_from_anyone_while_we_hold_none():
    assert ring().offer_keys([], [K0, K1], CID, records(INV, J[A])) == AcceptKeys(CID, 1)


def test_a_newer_epoch_is_taken_only_extending_ours_from_a_current_member():
    rs = records(*BASE)
    assert ring().offer_keys([K0], [K0, K1, K2], BID, rs) == AcceptKeys(BID, 2)
    assert ring().offer_keys([K0, K1], [K0, K1], BID, rs) == RejectKeys(BID, "stale")
    assert ring().offer_keys([K0, K1], [K0], BID, rs) == RejectKeys(BID, "stale")
    assert ring().offer_keys([K0, K1], [K0, KX, K2], BID, rs) == RejectKeys(BID, "forked")
    assert ring().offer_keys([K0], [K0, K1], BID, records(*BASE, revoke(BID))) == RejectKeys(BID, "not a member")
    assert ring().offer_keys([K0], [K0, K1], BID, records(INV, J[A])) == RejectKeys(BID, "not a member")


def test_after_a_rotation_every_current_member_but_us_is_handed_the_keys():
    rs = records(*BASE, revoke(CID))
    assert ring().hand_all(rs) == [HandKeys(BID, rs.members[BID].seal)]
    assert [h.node for h in ring(me=CID).hand_all(records(*BASE))] == sorted([AID, BID])


# -- lost races (admin) ---------------------------------------------------------------

def test_the_admin_rotates_once_per_new_race_loser():
    r = ring(admin=True)
    rs = records(*BASE)
    assert r.loaded(rs) is None
    assert r.check_lost_races(rs) is None
    for rec in (INV_ONE, *RACE_ONE):
        rs.add(rec)
    assert r.check_lost_races(rs) is None  # not lost for good until the winner is acknowledged
    rs.add(ACK_ONE[0])
    assert r.check_lost_races(rs) == Rotate(1)
    assert r.check_lost_races(rs) is None  # the same records: checked already
    rs.add(P.join(INV, key("kr-d"), signer=IK, name="d"))  # a membership change, no new loser
    assert r.check_lost_races(rs) is None
    for rec in (INV_TWO, *RACE_TWO, *ACK_TWO):
        rs.add(rec)
    assert r.check_lost_races(rs) == Rotate(1)


def test_only_the_admin_rotates_for_a_lost_race():
    rs = records(*BASE, INV_ONE, *RACE_ONE, *ACK_ONE)
    assert ring(admin=False).check_lost_races(rs) is None
    assert ring(admin=True).check_lost_races(rs) == Rotate(1)


def test_a_revocation_is_no_lost_race():
    r = ring(admin=True)
    rs = records(*BASE)
    r.loaded(rs)
    rs.add(revoke(BID))  # revoking rotated the key already
    assert r.check_lost_races(rs) is None


def test_races_lost_before_a_restart_were_answered_then():
    r = ring(admin=True)
    rs = records(*BASE, INV_ONE, *RACE_ONE, *ACK_ONE)
    assert r.loaded(rs) is None
    rs.add(revoke(CID))
    assert r.check_lost_races(rs) is None


# -- our own standing -------------------------------------------------------------------

def test_a_revoked_or_lost_node_ends_its_membership():
    assert ring(me=BID, name="b").check_standing(records(*BASE)) is None
    assert ring(me=BID, name="b").check_standing(records(*BASE, revoke(BID))) == EndMembership("revoked")
    loser = RACE_ONE[-1]
    rs = records(*BASE, INV_ONE, *RACE_ONE)
    assert ring(me=loser["node"], name=loser["name"]).check_standing(rs) is None  # waiting: the admin decides
    rs.add(ACK_ONE[0])
    assert ring(me=loser["node"], name=loser["name"]).check_standing(rs) == EndMembership("lost", ACK_ONE[0])
    assert ring(me=BID, name="b").loaded(records(*BASE, revoke(BID))) == EndMembership("revoked")
    assert ring(me=loser["node"], name=loser["name"]).loaded(rs) == EndMembership("lost", ACK_ONE[0])


def test_standing_is_checked_once_per_membership_change():
    r, rs = ring(me=BID, name="b"), records(*BASE, revoke(BID))
    assert r.check_standing(rs) == EndMembership("revoked")
    assert r.check_standing(rs) is None
    rs.add(revoke(BID, at=9))
    assert r.check_standing(rs) == EndMembership("revoked")


def test_a_taken_name_is_said_once():
    first, second = key("kr-twin-1"), key("kr-twin-2")
    rs = records(*BASE, P.join(INV, first, signer=IK, name="twin", at=100))
    late = ring(me=public_hex(second), name="twin")
    assert ring(me=public_hex(first), name="twin").check_standing(rs) is None
    rs.add(P.join(INV, second, signer=IK, name="twin", at=200))
    shown = rs.members[public_hex(second)].name
    assert shown != "twin"
    assert late.check_standing(rs) == Renamed("twin", shown)
    rs.add(P.join(INV, key("kr-e"), signer=IK, name="e"))
    assert late.check_standing(rs) is None


# -- hello again ------------------------------------------------------------------------

def test_a_hello_again_at_most_once_per_interval():
    r = ring()
    assert [r.rehello_due(t) for t in (0.0, 10.0, REHELLO_EVERY - 0.1, REHELLO_EVERY, REHELLO_EVERY + 1)] == [
        True, False, False, True, False]


# -- acknowledging joins ----------------------------------------------------------------

def test_the_admin_acknowledges_each_unacknowledged_member_once():
    r = ring(admin=True)
    rs = records(*BASE, INV_ONE, RACE_ONE[-1])
    first = r.check_admits(rs)
    assert sorted(a.member.node for a in first) == sorted([AID, BID, CID, RACE_ONE[-1]["node"]])
    assert all(a.at == rs.by_id[a.member.join]["at"] for a in first)
    assert r.check_admits(rs) == []  # the same records: checked already
    for a in first:  # the daemon signs them and adds them to the records
        rs.add(admit(rs.by_id[a.member.join]))
    rs.add(RACE_ONE[0])  # a later, lower-id join of the used invite: nobody new to acknowledge
    assert r.check_admits(rs) == []
    assert RACE_ONE[-1]["node"] in rs.members and RACE_ONE[0]["node"] not in rs.members
    assert r.check_lost_races(rs) == Rotate(1)  # it may have been handed the key: rotate


def test_only_the_admin_acknowledges():
    assert ring(admin=False).check_admits(records(*BASE)) == []
