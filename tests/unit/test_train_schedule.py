"""The shared data schedule is pure, deterministic and covers each epoch once."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ttpeer.train import shard_indices


def test_same_arguments_same_batches():
    first = shard_indices(1000, 7, 3, 1, 4, 5, 8)
    assert first == shard_indices(1000, 7, 3, 1, 4, 5, 8)
    assert len(first) == 5 and all(len(batch) == 8 for batch in first)
    assert first != shard_indices(1000, 8, 3, 1, 4, 5, 8)


def _reference_epoch(n, seed, epoch):
    # The documented scheme in plain Python integers: SplitMix64 keys, sorted.
    mask = (1 << 64) - 1
    state = (seed * 1_000_003 + epoch) & mask

    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    keys = [mix((state + (i + 1) * 0x9E3779B97F4A7C15) & mask) for i in range(n)]
    return sorted(range(n), key=lambda i: (keys[i], i))


@pytest.mark.parametrize("n,seed", [(10, 0), (37, 12345), (500, 2**63 + 5)])
def test_matches_the_documented_scheme(n, seed):
    # Peers on other numpy/torch versions must draw the same schedule.
    stream = _reference_epoch(n, seed, 0) + _reference_epoch(n, seed, 1)
    got = [i for b in shard_indices(n, seed, 0, 0, 1, 2, n) for i in b]
    assert got == stream


def test_pinned_values_do_not_drift():
    assert shard_indices(10, 0, 0, 0, 1, 1, 10) == [[2, 4, 6, 8, 5, 1, 7, 0, 9, 3]]


def test_one_epoch_is_a_disjoint_cover():
    n, shards, batches, size = 960, 3, 4, 20  # 80 samples a shard, 12 shards an epoch
    seen = []
    for rnd in range(4):
        for shard in range(shards):
            for batch in shard_indices(n, 5, rnd, shard, shards, batches, size):
                seen.extend(batch)
    assert sorted(seen) == list(range(n))


def test_epochs_are_different_permutations():
    first = [i for b in shard_indices(100, 1, 0, 0, 1, 10, 10) for i in b]
    second = [i for b in shard_indices(100, 1, 1, 0, 1, 10, 10) for i in b]
    assert sorted(first) == sorted(second) == list(range(100))
    assert first != second


@given(n=st.integers(1, 50), seed=st.integers(0, 2**70), rnd=st.integers(0, 100),
       size=st.integers(1, 40), batches=st.integers(1, 4))
def test_shards_longer_than_an_epoch_wrap(n, seed, rnd, size, batches):
    result = shard_indices(n, seed, rnd, 0, 1, batches, size)
    flat = [i for batch in result for i in batch]
    assert len(flat) == size * batches
    assert all(0 <= i < n for i in flat)


@pytest.mark.parametrize("args", [
    (0, 0, 0, 0, 1, 1, 1), (10, -1, 0, 0, 1, 1, 1), (10, 0, -1, 0, 1, 1, 1),
    (10, 0, 0, 2, 2, 1, 1), (10, 0, 0, 0, 1, 0, 1), (10, 0, 0, 0, 1, 1, 0),
])
def test_bad_arguments_raise_value_error(args):
    with pytest.raises(ValueError):
        shard_indices(*args)
