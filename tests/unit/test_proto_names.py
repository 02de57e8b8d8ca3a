"""Names are unique in a pool, as a pure function of the records (joins race with no
admin online, so two machines may choose one name at once), and ``standing`` tells a
node where it stands: member, revoked, lost its token's race, or not known yet."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ttpeer.proto import admitted, members, public_hex, sign, standing

from .proto_helpers import Pool, key

P = Pool("names")
IK_ADMIN, IK = key("names-ik-admin"), key("names-ik")
INV_ADMIN = P.invite(IK_ADMIN, uses=1, role="admin")
INV = P.invite(IK, uses=10)
ADMIN, SAM, TOM, ANN = (key(f"names:{n}") for n in ("admin", "sam", "tom", "ann"))
J_ADMIN = P.join(INV_ADMIN, ADMIN, signer=IK_ADMIN, name="alice", at=100)
J_SAM = P.join(INV, SAM, signer=IK, name="alice", at=90)  # before the admin by its clock: still renamed
J_TOM = P.join(INV, TOM, signer=IK, name="alice", at=120)
J_ANN = P.join(INV, ANN, signer=IK, name="ann", at=130)
ALL = [INV_ADMIN, INV, J_ADMIN, J_SAM, J_TOM, J_ANN]


def _names(records) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {m.node: m.name for m in members(P.id, records).values()}


def test_the_admin_keeps_a_taken_name_and_the_others_get_a_suffix_of_their_id() -> None:
    got = _names(ALL)
    sam, tom = public_hex(SAM), public_hex(TOM)
    assert got[public_hex(ADMIN)] == "alice" and got[public_hex(ANN)] == "ann"
    assert got[sam] == f"alice-{sam[:6]}" and got[tom] == f"alice-{tom[:6]}"
    assert len(set(got.values())) == len(got) == 4


def test_without_the_admin_the_earliest_join_keeps_the_name() -> None:
    got = _names([INV, J_SAM, J_TOM])
    assert got[public_hex(SAM)] == "alice" and got[public_hex(TOM)] == f"alice-{public_hex(TOM)[:6]}"


def test_a_suffixed_name_that_is_taken_already_gets_a_longer_suffix() -> None:
    tom = public_hex(TOM)
    squatter = P.join(INV, key("names:squat"), signer=IK, name=f"alice-{tom[:6]}", at=50)
    got = _names([*ALL, squatter])
    assert got[tom] == f"alice-{tom[:8]}" and len(set(got.values())) == len(got)


@settings(max_examples=60, deadline=None)
@given(st.permutations(ALL), st.lists(st.sampled_from(ALL), max_size=6))
def test_names_do_not_depend_on_order_or_duplicates(perm, dups) -> None:  # type: ignore[no-untyped-def]
    assert _names([*perm, *dups]) == _names(ALL)


def test_a_revoked_node_keeps_its_name_so_that_no_one_else_takes_it() -> None:
    revoke = sign("revoke", P.id, {"node": public_hex(ADMIN), "keep": [], "at": 200}, P.root)
    got = admitted(P.id, [*ALL, revoke])
    assert got[public_hex(ADMIN)].name == "alice"  # revoked, still named
    assert public_hex(ADMIN) not in members(P.id, [*ALL, revoke])
    assert "alice" not in _names([*ALL, revoke]).values()


def test_standing_member_revoked_lost_unknown() -> None:
    single = P.invite(key("names-single"), uses=1)
    x, y = (P.join(single, key(f"names:race{i}"), signer=key("names-single"), name="x") for i in range(2))
    winner, loser = sorted([x, y], key=lambda r: r.id)
    revoke = sign("revoke", P.id, {"node": public_hex(ANN), "keep": [], "at": 200}, P.root)
    records = [*ALL, single, x, y, revoke]
    assert standing(P.id, records, winner["node"]) == "member"
    assert standing(P.id, records, loser["node"]) == "waiting"  # the admin has not settled it yet
    body = {"invite": single.id, "join": winner.id, "node": winner["node"], "name": "x", "at": winner["at"]}
    records.append(sign("admit", P.id, body, P.root))
    assert standing(P.id, records, loser["node"]) == "lost"  # every use acknowledged: final
    assert standing(P.id, records, public_hex(ANN)) == "revoked"
    assert standing(P.id, [single, loser], loser["node"]) == "member"  # the winner not heard of yet
    assert standing(P.id, [loser], loser["node"]) == "unknown"  # its invite not held
