"""Shard count and lease defaults from published speeds (issue 3, mixed speeds)."""

from __future__ import annotations

from ttpeer.proto import default_sizing


def test_a_three_times_slower_peer_gets_work_and_a_fitting_lease() -> None:
    shards, lease = default_sizing([30.0, 30.0, 10.0], peers=3, inner_steps=100)
    assert shards == 14  # 2 x (30 + 30 + 10) / 10
    # Each fast peer can take ~6 shards while the slow one takes 2: nobody idles, nobody stalls.
    assert lease == 20.0  # twice the slow peer's shard time (10 s)


def test_unknown_speeds_fall_back_and_bounds_hold() -> None:
    assert default_sizing([], peers=5, inner_steps=100) == (10, 30.0)
    shards, lease = default_sizing([1000.0], peers=1, inner_steps=10)
    assert shards == 2 and lease == 15.0  # lease never below 15 s
    shards, lease = default_sizing([0.01, 100.0], peers=2, inner_steps=1000)
    assert lease == 300.0 and shards == 4096  # capped


def test_peers_without_a_measurement_count_as_typical() -> None:
    with_unknown, _ = default_sizing([20.0, 10.0], peers=4, inner_steps=50)
    all_known, _ = default_sizing([20.0, 10.0, 20.0, 20.0], peers=4, inner_steps=50)
    assert with_unknown == all_known
