"""The pool's relays record (issue 15 point 3): only the root's counts, the highest ``n``
wins in any order (I1), and a malformed list is refused by ``parse``."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ttpeer.proto import RecordError, parse, pool_relays, relay_pairs, sign

from .proto_helpers import Pool, key

P = Pool("relays")
FP = "sha256:" + "ab" * 32
A, B = ["https://a.example:8443", FP], ["https://b.example", "sha256:" + "cd" * 32]


def relays(n: int, lst: list[list[str]], signer=None):  # type: ignore[no-untyped-def]
    return sign("relays", P.id, {"relays": lst, "n": n, "at": 1}, signer or P.root)


V1, V2, V3 = relays(1, [A]), relays(2, [A, B]), relays(3, [B])
FORGED = relays(9, [["https://evil.example", FP]], key("a member"))


@given(st.permutations([V1, V2, V3, FORGED]))
def test_the_roots_highest_n_counts_in_any_order(order) -> None:  # type: ignore[no-untyped-def]
    best = pool_relays(P.id, order)
    assert best == V3 and relay_pairs(best) == [tuple(B)]


def test_no_root_record_means_none_and_another_pools_is_ignored() -> None:
    assert pool_relays(P.id, [FORGED]) is None
    other = Pool("relays-other")
    assert pool_relays(P.id, [sign("relays", other.id, {"relays": [A], "n": 5, "at": 1}, other.root)]) is None


@pytest.mark.parametrize("bad", [
    [], [["http://plain.example", FP]], [["https://a.example", "sha256:xyz"]], [A, A],
    [A[:1]], [A] * 9, [["https://" + "x" * 300, FP]],
])
def test_a_malformed_list_is_refused(bad) -> None:  # type: ignore[no-untyped-def]
    # The schema is one for signing and parsing (ttpeer_wire): what cannot be signed cannot arrive.
    with pytest.raises(RecordError, match="invalid 'relays'"):
        relays(1, bad)
    assert parse(relays(1, [A, B]).raw).body["relays"] == [A, B]
