"""The auto cadence (proto/_cadence.py): the rule that sizes rounds from measured figures,
the plan every peer reads from the chain, and the records that carry both."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ttpeer.proto import Plan, Record, RecordError, RecordSet, canonical_chain, sign
from ttpeer.proto._cadence import MAX_CHANGE, next_inner_steps, steps_for

from .proto_helpers import Pool, hex64, job_body, key, state

P = Pool("cadence")
M0, M1 = key("cadence-m0"), key("cadence-m1")
MEMBERSHIP = P.admit([M0, M1])
# Budget 3 x 20 = 60 inner steps per shard, rounds of 5-80.
AUTO = sign("job", P.id, job_body(rounds=3, batches=20, shards=2, h_min=5, h_max=80), M0)
FIXED = sign("job", P.id, job_body(rounds=3, batches=20, shards=2), M0)


def figures(work: float, sync: float | None, shards: int = 1) -> tuple[dict[str, float], int]:
    m = {"work_s": work} if sync is None else {"work_s": work, "sync_s": sync}
    return m, shards


# -- the rule ----------------------------------------------------------------------------

def test_steps_for_hides_the_sync_with_a_margin_or_a_utilization():
    assert steps_for(0.1, 2.0, overlap=True, lo=1, hi=1000) == 60  # 3 x 2 s of 0.1 s steps
    assert steps_for(0.1, 2.0, overlap=False, lo=1, hi=1000) == 180  # 9 x: 90% of the time in steps
    assert steps_for(0.1, 0.0, overlap=True, lo=5, hi=1000) == 5
    assert steps_for(0.1, 500.0, overlap=True, lo=5, hi=1000) == 1000
    assert steps_for(0.0, 1.0, overlap=True, lo=5, hi=700) == 700  # no step time measured: the longest


def test_next_inner_steps_scales_the_round_to_the_sync_within_a_factor_and_bounds():
    # 1 s of compute per peer, 0.3 s of sync: 3 x 0.3 = 0.9 s of compute needed, 18 of 20 steps.
    assert next_inner_steps(20, [figures(1.0, 0.3), figures(1.0, 0.3)], shards=2, peers=2, overlap=True,
                        lo=1, hi=1000) == 18
    # Far too slow a link: at most MAX_CHANGE x a round, then the bound.
    assert next_inner_steps(20, [figures(1.0, 100.0)] * 2, shards=2, peers=2, overlap=True, lo=1,
                        hi=1000) == 20 * MAX_CHANGE
    assert next_inner_steps(20, [figures(1.0, 100.0)] * 2, shards=2, peers=2, overlap=True, lo=1, hi=30) == 30
    # A near-free sync: halved, not more, and never under the bound.
    assert next_inner_steps(20, [figures(1.0, 0.0)] * 2, shards=2, peers=2, overlap=True, lo=1, hi=1000) == 10
    assert next_inner_steps(8, [figures(1.0, 0.0)] * 2, shards=2, peers=2, overlap=True, lo=6, hi=1000) == 6
    # Nobody has synced yet: the size stays.
    assert next_inner_steps(20, [figures(1.0, None)] * 2, shards=2, peers=2, overlap=True, lo=1, hi=1000) == 20
    assert next_inner_steps(90, [], shards=2, peers=2, overlap=True, lo=1, hi=50) == 50


def test_next_inner_steps_uses_medians_and_each_peers_share_of_the_shards():
    # One straggler's long sync and one fast copy do not move the medians.
    many = [figures(1.0, 0.3), figures(1.0, 0.3), figures(9.0, 50.0), figures(0.1, 0.3)]
    assert next_inner_steps(20, many, shards=4, peers=4, overlap=True, lo=1, hi=1000) == 18
    # One peer trained all 4 shards alone (4 s) while 3 others fetched its base: a pool of 4
    # peers has 1 s of compute each a round, so 0.5 s of sync needs 1.5 s: 30 steps, not 8.
    assert next_inner_steps(20, [figures(4.0, 0.5, shards=4)], shards=4, peers=4, overlap=True, lo=1,
                        hi=1000) == 30
    # Without overlap the sync is waited for: 9 x it (capped at 2x a round here).
    assert next_inner_steps(20, [figures(1.0, 0.5)] * 2, shards=2, peers=2, overlap=False, lo=1, hi=1000) == 40


# -- the plan ----------------------------------------------------------------------------

def close(rnd: int, base: str, new: str, nxt: int | None, job: Record = AUTO) -> Record:
    body = {"job": job.id, "round": rnd, "base": base, "contribs": [contrib(rnd, base, job).id], "state": new,
            "metrics": {}}
    if nxt is not None:
        body["next"] = nxt
    return sign("close", P.id, body, M0)


def contrib(rnd: int, base: str, job: Record = AUTO) -> Record:
    return sign("contrib", P.id, {"job": job.id, "round": rnd, "base": base, "shards": [0, 1], "samples": 64,
                                  "blob": hex64(("blob", rnd, base)), "size": 100,
                                  "metrics": {"work_s": 1.0, "sync_s": 0.1}}, M1)


def chain_records(nexts: list[int | None], job: Record = AUTO) -> list[Record]:
    out, base = [], job["init"]
    for r, nxt in enumerate(nexts):
        new = state(("s", job.id, r))
        out += [contrib(r, base, job), close(r, base, new, nxt, job)]
        base = new
    return out


def test_a_fixed_job_plans_what_it_always_did():
    plan = Plan.of(FIXED, ())
    assert [plan.inner_steps(r) for r in range(3)] == [20, 20, 20]
    assert [plan.first_step(r) for r in range(4)] == [0, 20, 40, 60]
    assert plan.has_round(2) and not plan.has_round(3)
    assert plan.expected_rounds() == 3 and not plan.auto


def test_an_auto_job_runs_its_budget_in_the_sizes_its_closes_picked():
    recs = chain_records([5, 10, 30, 80, 80])
    closes = [r for r in recs if r.kind == "close"]
    plan = Plan.of(AUTO, closes[:2])
    # Rounds 0 and 1: the first size; round 2: what close 0 picked; round 3: close 1's.
    assert plan.sizes == (20, 20, 5, 10)
    assert [plan.first_step(r) for r in range(4)] == [0, 20, 40, 45]
    assert plan.has_round(3) and plan.expected_rounds() == 5  # 55 of 60 steps fixed; 5 left at 10
    # The last round takes what is left of the budget, and the job ends there.
    full = Plan.of(AUTO, closes)
    assert full.sizes == (20, 20, 5, 10, 5) and full.finished(5) and not full.finished(4)


def test_a_close_without_next_keeps_the_size_before():
    closes = [r for r in chain_records([7, None, None]) if r.kind == "close"]
    assert Plan.of(AUTO, closes).sizes == (20, 20, 7, 7, 6)  # the last: what the 60-step budget leaves


def test_the_chain_of_an_auto_job_ends_where_its_budget_does():
    recs = chain_records([5, 10, 30, 80, 80, 80])  # a sixth close, past the budget, is no round
    rs = RecordSet(P.id)
    for rec in [*MEMBERSHIP, AUTO, *recs]:
        rs.add(rec)
    chain = canonical_chain(rs, AUTO)
    assert chain.round == 5
    assert Plan.of(AUTO, chain.closes).finished(chain.round)


def test_a_round_takes_the_rest_rather_than_leave_less_than_half_a_round():
    def sizes(nexts: list[int | None], job: Record = AUTO) -> tuple[int, ...]:
        return Plan.of(job, [r for r in chain_records(nexts, job) if r.kind == "close"]).sizes

    assert sizes([15, 80, 80]) == (20, 20, 20)  # 15 would leave a last round of 5
    assert sizes([12, 80, 80]) == (20, 20, 12, 8)  # 8 is more than half of 12: its own round
    # Within h_max only: a 26-step rest does not become one round where rounds end at 18.
    capped = sign("job", P.id, job_body(rounds=4, batches=13, shards=2, h_min=5, h_max=18), M0)
    assert sizes([18, 18, 18], capped) == (13, 13, 18, 8)
    # The chain ends where the plan does.
    rs = RecordSet(P.id)
    for rec in [*MEMBERSHIP, AUTO, *chain_records([15, 80, 80, 80])]:
        rs.add(rec)
    chain = canonical_chain(rs, AUTO)
    assert chain.round == 3 and Plan.of(AUTO, chain.closes).finished(3)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([5, 6, 10, 33, 80]), min_size=1, max_size=8), st.randoms(use_true_random=False))
def test_every_peer_reads_the_same_sizes_from_the_same_records_in_any_order(nexts, rng):
    recs = [*MEMBERSHIP, AUTO, *chain_records(nexts)]
    sizes = set()
    for _ in range(3):
        order = recs[:]
        rng.shuffle(order)
        rs = RecordSet(P.id)
        for rec in order:
            rs.add(rec)
        chain = canonical_chain(rs, AUTO)
        plan = Plan.of(AUTO, chain.closes)
        sizes.add(tuple(plan.inner_steps(r) for r in range(chain.round)))
    assert len(sizes) == 1
    (got,) = sizes
    assert sum(got) <= 60 and all(5 <= s <= 80 for s in got[:-1])


# -- the records -------------------------------------------------------------------------

@pytest.mark.parametrize(("over", "words"), [
    ({"h_min": 5}, "both h_min and h_max"),
    ({"h_min": 30, "h_max": 80}, "must lie within"),
    ({"h_min": 5, "h_max": 10}, "must lie within"),
    ({"h_min": 5, "h_max": 80, "outer_lr_schedule": "cosine"}, "fixed inner steps"),
])
def test_a_job_record_with_inconsistent_cadence_fields_is_refused(over, words):
    with pytest.raises(RecordError, match=words):
        sign("job", P.id, job_body(rounds=3, batches=20, **over), M0)

