"""PeerMachine on ensemble jobs: a shard is a member, and every unit is published as
its own contribution (the member's checkpoint), so whoever trains the member next
starts from it. Fused jobs keep one contribution per peer and round."""

from __future__ import annotations

import pytest

from ttpeer.proto import member_variants

from .test_proto_peer import Cluster, check_finished


def _contribs(c: Cluster, job):  # type: ignore[no-untyped-def]
    return [r for r in c.machine(0).records.of_job(job.id, "contrib")]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_member_unit_is_its_own_contribution(n: int) -> None:
    c = Cluster(n)
    job = c.submit_job(0, mode="ensemble", shards=4, rounds=3, lease=30,
                       members=member_variants(1, 4, 0.001, 0.01))
    c.run(until=10_000)
    check_finished(c, job)
    contribs = _contribs(c, job)
    assert sorted((p["round"], p["shards"][0]) for p in contribs) == [(r, s) for r in range(3) for s in range(4)]
    assert all(len(p["shards"]) == 1 for p in contribs)
    assert all(t.fresh for _, t in c.trains)  # each unit starts from the round's state, never a local model
    if n > 1:  # peers share the members of every round
        for rnd in range(3):
            assert len({p.author for p in contribs if p["round"] == rnd}) > 1


def test_a_fused_peer_still_publishes_once_per_round() -> None:
    c = Cluster(1)
    job = c.submit_job(0, shards=4, rounds=2, lease=30)
    c.run(until=10_000)
    check_finished(c, job)
    assert sorted(p["shards"] for p in _contribs(c, job)) == [[0, 1, 2, 3]] * 2


def test_a_dead_peers_member_is_trained_by_another_from_the_rounds_state() -> None:
    c = Cluster(2, train_time=5.0)
    job = c.submit_job(0, mode="ensemble", shards=2, rounds=2, lease=10,
                       members=member_variants(3, 2, 0.001, 0.01))
    victim = c.order[1]
    c.run(until=10_000, stop=lambda: any(me == victim and t.round == 1 for me, t in c.trains))
    died_on = next(t for me, t in c.trains if me == victim and t.round == 1)
    c.dead.add(victim)
    c.run(until=10_000, stop=lambda: c.order[0] in c.done)
    retrained = [t for me, t in c.trains if me == c.order[0] and (t.round, t.shard) == (1, died_on.shard)]
    assert len(retrained) == 1 and retrained[0].base == died_on.base and retrained[0].attempt > died_on.attempt
    assert c.machine(0).chain(job).round == 2
