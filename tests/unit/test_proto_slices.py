"""Aggregation slices, the pure part: when a round is sliced, the runs of chunks, who
reduces a slice when, and which slice each peer checks."""

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
    with pytest.raises(ValueError, match="at least one slice"):
        sl.spot_check("j", 0, "a", ["a"], 0)


@given(names, st.integers(0, 40), st.integers(0, 100), st.randoms(use_true_random=False))
def test_every_author_has_a_turn_the_sth_first_and_the_order_is_the_same_for_every_peer(authors, s, rnd, rng):
    order = sl.aggregators("job", rnd, authors, s)
    assert sorted(order) == sorted(authors)  # each author once
    assert order[0] == sorted(authors)[s % len(authors)]
    shuffled = list(authors)
    rng.shuffle(shuffled)
    assert sl.aggregators("job", rnd, shuffled + shuffled[:1], s) == order  # order and repeats do not matter


def test_the_turn_passes_after_each_lease_and_starts_over_after_the_last():
    order = sl.aggregators("job", 3, ["p1", "p2", "p3"], 1)
    assert order[0] == "p2"
    seen = [sl.reducer("job", 3, ["p3", "p1", "p2"], 1, t, 5.0) for t in (-1.0, 0.0, 4.99, 5.0, 10.0, 15.0)]
    assert seen == [order[0], order[0], order[0], order[1], order[2], order[0]]


def test_the_order_after_the_first_depends_on_the_round():
    authors = [f"p{i:02d}" for i in range(12)]
    orders = {tuple(sl.aggregators("job", rnd, authors, 0)) for rnd in range(10)}
    assert len(orders) > 1 and all(o[0] == "p00" for o in orders)


@given(names, st.integers(1, 30))
def test_with_as_many_authors_as_slices_every_slice_is_checked_and_not_by_its_reducer(authors, slices):
    checks = {a: sl.spot_check("job", 4, a, authors, slices) for a in authors}
    assert all(0 <= c < slices for c in checks.values())
    ranked = sorted(authors)
    if len(authors) >= slices:
        assert set(checks.values()) == set(range(slices))
    if slices > 1:
        assert all(checks[a] != ranked.index(a) % slices for a in authors)


def test_a_peer_outside_the_cover_checks_a_slice_drawn_from_the_round():
    drawn = {sl.spot_check("job", rnd, "outsider", ["a", "b"], 7) for rnd in range(40)}
    assert len(drawn) > 3 and drawn <= set(range(7))
