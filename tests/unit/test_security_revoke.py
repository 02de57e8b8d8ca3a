"""Revocation in the pure protocol: which of a revoked node's records count is a
function of the record set alone (I1), so every peer gives the same answer in any
order; forged revocations change nothing; the relay's check agrees."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ttpeer.proto import (
    ProofError,
    RecordSet,
    canonical_chain,
    public_hex,
    revocation_keep,
    sign,
    verify_revocation,
)

from .proto_helpers import Pool, close, contrib, job_body, key, state

P = Pool("revoke")
A, B, C = key("rv-a"), key("rv-b"), key("rv-c")
AID, BID, CID = (public_hex(k) for k in (A, B, C))
ADMIT = P.admit([A, B, C])
JOB = sign("job", P.id, job_body(shards=2, rounds=3), B)  # B submitted the job

# Round 0: A and B each trained a shard; B closed it.
R0 = [contrib(P.id, A, JOB, 0, JOB["init"], [0]), contrib(P.id, B, JOB, 0, JOB["init"], [1])]
CLOSE0 = close(P.id, B, JOB, 0, JOB["init"], R0, state("s1"))
BEFORE = [*ADMIT, JOB, *R0, CLOSE0]


def _set(records) -> RecordSet:
    rs = RecordSet(P.id)
    for r in records:
        rs.add(r)
    return rs


KEEP = revocation_keep(_set(BEFORE), BID)
REVOKE = sign("revoke", P.id, {"node": BID, "keep": KEEP, "at": 5}, P.root)

# After the revocation B signs a whole round 1 on its own, and a claim: none of it counts.
B_LATE = contrib(P.id, B, JOB, 1, state("s1"), [0, 1])
B_LATE_CLOSE = close(P.id, B, JOB, 1, state("s1"), [B_LATE], state("evil"))
B_CLAIM = sign("claim", P.id, {"job": JOB.id, "round": 1, "shard": 0, "attempt": 0, "n": 0, "done": 0,
                               "rate": 1.0, "backup": False}, B)
# A and C carry on with round 1.
R1 = [contrib(P.id, A, JOB, 1, state("s1"), [0]), contrib(P.id, C, JOB, 1, state("s1"), [1])]
CLOSE1 = close(P.id, A, JOB, 1, state("s1"), R1, state("s2"))
EVERYTHING = [*BEFORE, REVOKE, B_LATE, B_LATE_CLOSE, B_CLAIM, *R1, CLOSE1]


def test_keep_names_exactly_the_chain_records_of_the_node() -> None:
    assert KEEP == sorted([JOB.id, R0[1].id, CLOSE0.id])


def test_revoked_node_is_no_member_and_its_late_records_do_not_count() -> None:
    rs = _set(EVERYTHING)
    assert set(rs.members) == {AID, CID}
    assert BID not in rs.members
    # The job B submitted, its round-0 contribution and close still hold the chain up ...
    chain = canonical_chain(rs, JOB)
    assert chain.states == (JOB["init"], state("s1"), state("s2"))
    assert [c.id for c in chain.closes] == [CLOSE0.id, CLOSE1.id]
    # ... but what it signed after (or anything not kept) is ignored by every view.
    assert not rs.counts(B_LATE) and not rs.counts(B_LATE_CLOSE) and not rs.counts(B_CLAIM)
    assert B_LATE not in rs.in_round(JOB.id, "contrib", 1)
    assert rs.jobs() == [JOB]


def test_without_the_revocation_the_late_records_would_count() -> None:
    # The control: the same records minus REVOKE let B's own round-1 close win a tie.
    rs = _set([r for r in EVERYTHING if r is not REVOKE])
    assert BID in rs.members and rs.counts(B_LATE_CLOSE)


@settings(max_examples=60, deadline=None)
@given(st.permutations(EVERYTHING), st.lists(st.sampled_from(EVERYTHING), max_size=10))
def test_the_outcome_does_not_depend_on_order_or_duplicates(order, dups) -> None:
    rs = _set(order + dups)
    assert set(rs.members) == {AID, CID}
    assert canonical_chain(rs, JOB).states == (JOB["init"], state("s1"), state("s2"))
    work = ("job", "contrib", "close", "claim")  # what members sign (invites, joins: root and invite keys)
    assert {r.id for r in rs if r.kind in work and rs.counts(r)} == {
        r.id for r in EVERYTHING if r.kind in work and r not in (B_LATE, B_LATE_CLOSE, B_CLAIM)}


@pytest.mark.parametrize("signer", ["member", "revoked-node", "other-root"])
def test_a_revocation_not_signed_by_the_root_changes_nothing(signer: str) -> None:
    other = Pool("elsewhere")
    k = {"member": A, "revoked-node": B, "other-root": other.root}[signer]
    forged = sign("revoke", P.id, {"node": CID, "keep": [], "at": 5}, k)
    rs = _set([*BEFORE, forged])
    assert CID in rs.members
    with pytest.raises(ProofError):
        verify_revocation(P.id, forged.raw)


def test_relay_check_accepts_the_root_revocation_for_its_pool_only() -> None:
    assert verify_revocation(P.id, REVOKE.raw) == BID
    with pytest.raises(ProofError, match="revocation"):
        verify_revocation(Pool("other").id, REVOKE.raw)
    with pytest.raises(ProofError):
        verify_revocation(P.id, CLOSE0.raw)  # a genuine record, but not a revocation
    with pytest.raises(ProofError):
        verify_revocation(P.id, REVOKE.raw[:-3] + b"00}")


def test_a_revoked_node_cannot_rejoin_with_a_new_join() -> None:
    ik = key("rv-second-invite")
    invite = P.invite(ik, uses=3)
    rejoin = P.join(invite, B, signer=ik, name="again")
    rs = _set([*EVERYTHING, invite, rejoin])
    assert BID not in rs.members


def test_a_close_naming_an_unkept_contribution_does_not_stall_the_round() -> None:
    # A signed round 1 naming B's late contribution before it heard of the revocation: that
    # close can never become valid, so nobody may wait for it ("catching up") forever.
    stale = close(P.id, A, JOB, 1, state("s1"), [B_LATE], state("stale"))
    rs = _set([*BEFORE, REVOKE, B_LATE, stale])
    assert canonical_chain(rs, JOB).round == 1
    assert rs.highest_closed_round(JOB.id) == 0
    for r in [*R1, CLOSE1]:
        rs.add(r)
    assert rs.highest_closed_round(JOB.id) == 1 and canonical_chain(rs, JOB).round == 2
