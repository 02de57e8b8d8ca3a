"""``ttpeer status`` lists who declined a job and why, from the signed records."""

from __future__ import annotations

from ttpeer.daemon._status import declines
from ttpeer.proto import RecordSet, sign

from .proto_helpers import Pool, contrib, job_body, key, state


def _decline(pool: Pool, author, job, reason: str, need: int = 0, have: int = 0):  # type: ignore[no-untyped-def]
    return sign("decline", pool.id, {"job": job.id, "reason": reason, "need": need, "have": have}, author)


def test_declines_of_members_are_listed_by_name_until_they_train_after_all():
    pool = Pool("declines")
    nodes = [key(f"d{i}") for i in range(3)]
    outsider = key("outsider")
    rs = RecordSet(pool.id)
    for rec in pool.admit(nodes):
        rs.add(rec)
    job = sign("job", pool.id, job_body(), nodes[0])
    other_job = sign("job", pool.id, job_body(seed=2), nodes[0])
    for rec in (job, other_job,
                _decline(pool, nodes[2], job, "too small", need=2**31, have=2**30),
                _decline(pool, outsider, job, "not a member"),
                _decline(pool, nodes[1], job, "restarted with more memory later"),
                contrib(pool.id, nodes[1], job, 0, state("init"), [0]),
                _decline(pool, nodes[0], other_job, "another job")):
        rs.add(rec)
    [shown] = declines(rs, job)
    assert shown == {"peer": nodes[2].public_key().public_bytes_raw().hex(), "name": "n2", "reason": "too small",
                     "need_bytes": 2**31, "have_bytes": 2**30, "code": None}
    assert [d["reason"] for d in declines(rs, other_job)] == ["another job"]


def test_a_peer_behind_the_pool_or_not_training_is_told_so():
    # held_round and rounds_trained from the records, then the lines `ttpeer status` prints.
    from ttpeer._behind import behind_lines
    from ttpeer.daemon._status import held_round, rounds_trained
    from ttpeer.proto import Chain

    from .proto_helpers import close

    pool = Pool("behind")
    fast, slow = key("fast"), key("slow")
    rs = RecordSet(pool.id)
    for rec in pool.admit([fast, slow]):
        rs.add(rec)
    job = sign("job", pool.id, job_body(shards=1), fast)
    rs.add(job)
    states, closes = [state("s0")], []
    for r in range(4):  # the fast peer trains every round; the slow one only round 0
        work = [contrib(pool.id, fast, job, r, states[r], [0])]
        if r == 0:
            work.append(contrib(pool.id, slow, job, r, states[r], [0]))
        for rec in work:
            rs.add(rec)
        closes.append(close(pool.id, fast, job, r, states[r], work, state(f"s{r + 1}")))
        states.append(state(f"s{r + 1}"))
    chain = Chain(tuple(states), tuple(closes))
    slow_id = slow.public_key().public_bytes_raw().hex()
    fast_id = fast.public_key().public_bytes_raw().hex()
    assert rounds_trained(rs, chain, fast_id) == 3 and rounds_trained(rs, chain, slow_id) == 0
    assert rounds_trained(rs, chain, slow_id, last=4) == 1
    assert held_round(chain, {states[1], "sha256:other"}) == 1 and held_round(chain, set()) is None

    job_row = {"mode": "fused", "state": "running", "declined": None, "round": 4, "training_shard": None,
               "held_round": 1, "rounds_trained": 0, "rounds_looked_at": 3}
    lines = behind_lines(job_row)
    assert lines[0].startswith("catching up: this peer holds round 1's model, the pool is at round 4")
    assert "trained none of the last 3 rounds" in lines[1] and "--inner-steps" in lines[1]
    assert behind_lines({**job_row, "held_round": 3, "rounds_trained": 3}) == []  # one round behind: every close
    assert behind_lines({**job_row, "mode": "ensemble"}) == [] and behind_lines({**job_row, "state": "done"}) == []
    assert len(behind_lines({**job_row, "rounds_looked_at": 2})) == 1  # too early to say it trains nothing
    slow = behind_lines({**job_row, "held_round": 3, "rounds_trained": 3,
                         "slow_link": {"round": 2, "rate": 500_000, "median_rate": 2_500_000}})
    assert slow == ["slow link: this peer's delta of round 2 went up at 4.0 Mbit/s against the pool's median "
                    "20.0 Mbit/s (encoding and sealing included), so the other peers reduce the rounds' slices; "
                    "a round still waits for this peer's own delta when it trains"]
