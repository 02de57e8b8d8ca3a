"""Aggregation slices, the pure part: when a round is sliced, the runs of chunks, who
reduces a slice when, and which slices are checked."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ttpeer.proto import _slices as sl

names = st.lists(st.text("abcdef", min_size=1, max_size=4), min_size=1, max_size=20, unique=True)


def test_small_rounds_and_one_chunk_models_send_all_deltas():
    assert not sl.sliced(2, 60) and sl.sliced(3, 60) and sl.sliced(16, 2)
    assert not sl.sliced(16, 1)  # nothing to cut


@given(st.integers(1, 500), st.integers(1, 64))
def test_slices_cover_every_chunk_once_in_order_and_balanced(chunks, slices):
    runs = sl.slice_chunks(chunks, slices)
    assert len(runs) == min(chunks, slices)
    assert runs[0][0] == 0 and runs[-1][1] == chunks
    assert all(a[1] == b[0] for a, b in zip(runs, runs[1:], strict=False))
    sizes = [stop - first for first, stop in runs]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_counts_below_one_are_refused():
    for chunks, slices in [(0, 3), (3, 0)]:
        with pytest.raises(ValueError, match="at least one"):
            sl.slice_chunks(chunks, slices)
    with pytest.raises(ValueError, match="at least one author"):
        sl.aggregators("j", 0, [], 0)
    with pytest.raises(ValueError, match="lease must be positive"):
        sl.turn(["a"], 1.0, 0.0)
    with pytest.raises(ValueError, match="at least 1"):
        sl.checked("j", 0, 0, 0)


@given(names, st.integers(0, 40), st.integers(0, 100), st.randoms(use_true_random=False))
def test_every_author_has_a_turn_the_sth_first_and_the_order_is_the_same_for_every_peer(authors, s, rnd, rng):
    order = sl.aggregators("job", rnd, authors, s)
    assert sorted(order) == sorted(authors)  # each author once
    assert order[0] == sorted(authors)[s % len(authors)]
    shuffled = list(authors)
    rng.shuffle(shuffled)
    assert sl.aggregators("job", rnd, shuffled + shuffled[:1], s) == order  # order and repeats do not matter


@given(names, st.data(), st.integers(0, 40))
def test_slow_authors_come_after_every_other_author_in_each_slices_order(authors, data, s):
    slow = frozenset(data.draw(st.lists(st.sampled_from(authors), max_size=len(authors) - 1)))
    order = sl.aggregators("job", 0, authors, s, slow)
    fast = sorted(set(authors) - slow)
    assert sorted(order) == sorted(authors)
    assert order[0] == fast[s % len(fast)] and set(order[:len(fast)]) == set(fast)
    assert sl.aggregators("job", 0, authors, s, frozenset(authors)) == sl.aggregators("job", 0, authors, s)


def test_the_turn_passes_after_each_lease_and_starts_over_after_the_last():
    order = sl.aggregators("job", 3, ["p1", "p2", "p3"], 1)
    assert order[0] == "p2"
    again = sl.aggregators("job", 3, ["p3", "p1", "p2"], 1)
    seen = [again[sl.turn(again, t, 5.0)] for t in (-1.0, 0.0, 4.99, 5.0, 10.0, 15.0)]
    assert seen == [order[0], order[0], order[0], order[1], order[2], order[0]]


def test_the_order_after_the_first_depends_on_the_round():
    authors = [f"p{i:02d}" for i in range(12)]
    orders = {tuple(sl.aggregators("job", rnd, authors, 0)) for rnd in range(10)}
    assert len(orders) > 1 and all(o[0] == "p00" for o in orders)


def test_one_slice_in_one_in_is_checked_drawn_the_same_for_every_peer():
    draws = [sl.checked("job", rnd, s, 4) for rnd in range(50) for s in range(8)]
    assert 0.15 < sum(draws) / len(draws) < 0.35  # about one in four
    assert draws == [sl.checked("job", rnd, s, 4) for rnd in range(50) for s in range(8)]
    assert all(sl.checked("job", rnd, s, 1) for rnd in range(5) for s in range(5))  # one in one: all


def test_a_slice_may_be_as_large_as_its_values_compress_at_worst_and_no_larger():
    assert sl.slice_bound(2**20) >= 2**20 + 4 * 2**20 // 256  # int8 values and their block scales
    assert sl.slice_bound(2**20) < 1.05 * 2**20 + 8192
    assert sl.slice_bound(2**20, 4) >= 2**19 + 4 * 2**20 // 256  # two 4-bit values a byte
    assert sl.slice_bound(2**20, 4) < 1.05 * 2**19 + 2**20 // 32 + 8192
    assert sl.slice_bound(2**20, 3) == sl.slice_bound(2**20, 4)  # 3-bit values go as nibbles too
