"""``ttpeer status`` lists who declined a job and why, from the signed records."""

from __future__ import annotations

from ttpeer.daemon.node._status import declines
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
    from ttpeer.daemon.node._status import held_round, rounds_trained
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

    job_row = {"mode": "fused", "state": "running", "declined": None, "round": 4, "rounds": 10, "training_shard": None,
               "held_round": 1, "rounds_trained": 0, "rounds_looked_at": 3}
    lines = behind_lines(job_row)
    assert lines[0].startswith("catching up: this peer holds round 1's model, the pool is at round 5")
    assert "trained none of the last 3 rounds" in lines[1] and "--inner-steps" in lines[1]
    assert behind_lines({**job_row, "held_round": 3, "rounds_trained": 3}) == []  # one round behind: every close
    assert behind_lines({**job_row, "mode": "ensemble"}) == [] and behind_lines({**job_row, "state": "done"}) == []
    assert len(behind_lines({**job_row, "rounds_looked_at": 2})) == 1  # too early to say it trains nothing
    slow = behind_lines({**job_row, "held_round": 3, "rounds_trained": 3,
                         "slow_link": {"round": 2, "rate": 500_000, "median_rate": 2_500_000}})
    assert slow == ["slow link: this peer's delta of round 3 went up at 4.0 Mbit/s against the pool's median "
                    "20.0 Mbit/s (encoding and sealing included), so the other peers reduce the rounds' slices; "
                    "a round still waits for this peer's own delta when it trains"]


def test_status_says_how_a_fused_jobs_rounds_move():
    # From the job record and the newest close, then the line `ttpeer status` prints.
    from ttpeer._status_cmds import exchange_line
    from ttpeer.daemon.node._status import exchange
    from ttpeer.proto import Chain

    from .proto_helpers import close, hex64

    pool, k = Pool("exchange"), key("exchange")
    sliced = sign("job", pool.id, job_body(chunk=65536, slice_bits=3), k)
    work = [contrib(pool.id, k, sliced, 0, state("s0"), [0])]
    plain = close(pool.id, k, sliced, 0, state("s0"), work, state("s1"))
    named = sign("close", pool.id, {**plain.body, "slices": [hex64(f"slice{i}") for i in range(4)]}, k)

    assert exchange(sliced, Chain((state("s0"),), ())) == {
        "bits": 8, "chunk": 65536, "slice_bits": 3, "slice_min": None, "slices_from": 3, "last_slices": None,
        "outer": None}
    ex = exchange(sliced, Chain((state("s0"), state("s1")), (named,)))
    assert ex["last_slices"] == 4
    assert exchange_line(ex) == ("exchange: 8-bit deltas; rounds of 3 or more authors close from reduced slices "
                                 "(chunks of 65,536 values, the mean at 3 bits); the last round from 4 slices; "
                                 "outer step lr 0.7, momentum 0.9 (the job's own, fixed at submit)")
    # A job whose closes pick their outer step says which they picked, and for how many.
    auto = sign("job", pool.id, job_body(outer_auto=1), k)
    picked = close(pool.id, k, auto, 0, state("s0"), [contrib(pool.id, k, auto, 0, state("s0"), [0])], state("s1"))
    picked = sign("close", pool.id, {**picked.body, "outer_lr": 0.7, "outer_momentum": 0.3}, k)
    assert exchange_line(exchange(auto, Chain((state("s0"), state("s1")), (picked,)))).endswith(
        "(--no-slices); outer step lr 0.7, momentum 0.3 (picked for 1 contribution)")
    two = exchange(sliced, Chain((state("s0"), state("s1")), (plain,)))  # two authors: all deltas
    assert "the mean at 3 bits); the last round closed from all deltas; outer step" in exchange_line(two)
    # What submit sends by default: slices only where they save each peer 1 MiB a round.
    least = exchange(sign("job", pool.id, job_body(chunk=65536, slice_bits=3, slice_min=1 << 20), k),
                     Chain((state("s0"), state("s1")), (plain,)))
    assert exchange_line(least).startswith(
        "exchange: 8-bit deltas; rounds of 3 or more authors close from reduced slices (chunks of 65,536 values, "
        "the mean at 3 bits) where that saves each peer 1.0 MiB a round, else from all deltas; the last round "
        "closed from all deltas")
    older = sign("job", pool.id, job_body(chunk=65536), k)  # a job from before slice_bits: 8
    assert exchange(older, Chain((state("s0"),), ()))["slice_bits"] == 8
    off = exchange(sign("job", pool.id, job_body(bits=4), k), Chain((state("s0"),), ()))
    assert off["chunk"] is None and off["slice_bits"] is None
    assert exchange_line(off) == "exchange: 4-bit deltas; every round closes from all deltas (--no-slices)"


def test_status_says_what_its_spot_checks_found():
    from ttpeer._status_cmds import spot_check_line

    assert spot_check_line(None) is None and spot_check_line({"reproduced": 0, "missed": 0}) is None
    assert spot_check_line({"reproduced": 5, "missed": 0}) == (
        "spot checks: 5 of the others' reduced slices reproduced here on one chunk")
    assert "; 1 did not (this peer reduced each whole" in spot_check_line({"reproduced": 5, "missed": 1})
