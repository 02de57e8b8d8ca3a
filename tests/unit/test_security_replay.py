"""The replay window: each (sender, counter) is taken once; old ones are refused; memory
is bounded."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from ttpeer.net._seal import ReplayWindow


def test_in_order_duplicates_and_too_old() -> None:
    w = ReplayWindow(size=64)
    assert [w.accept("a", c) for c in (1, 2, 3)] == [True] * 3
    assert not w.accept("a", 2) and not w.accept("a", 3)
    assert w.accept("b", 2)  # senders are separate
    assert w.accept("a", 100) and w.accept("a", 37)  # inside the window, not seen yet
    assert not w.accept("a", 36)  # 64 below the top: too old, whether seen or not
    assert not w.accept("a", 37)


@given(st.lists(st.integers(0, 300), max_size=200), st.randoms())
def test_any_order_accepts_each_counter_at_most_once(counters: list[int], rnd: random.Random) -> None:
    w = ReplayWindow(size=128)
    taken: list[int] = []
    for c in counters + rnd.sample(counters, len(counters)):
        if w.accept("s", c):
            taken.append(c)
    assert len(taken) == len(set(taken))
    # Every counter not too old when it arrived first was taken.
    top = -1
    for c in counters:
        if c > top - 128 and c not in taken:
            raise AssertionError(f"{c} was refused though never seen and within the window")
        top = max(top, c)


def test_restored_marks_refuse_everything_up_to_them() -> None:
    w = ReplayWindow(size=64)
    w.floor("a", 1000)
    assert not w.accept("a", 1000) and not w.accept("a", 999) and not w.accept("a", 5)
    assert w.accept("a", 1001)


def test_memory_is_bounded_by_senders_and_window() -> None:
    w = ReplayWindow(size=64, max_senders=10)
    for i in range(1000):
        w.accept(f"s{i}", 2**40 + i)
    assert len(w.marks()) == 10
    assert all(seen < 2**64 for seen in w._seen.values())
