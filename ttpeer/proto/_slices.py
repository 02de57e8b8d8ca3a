"""Aggregation slices, the pure part: whether a round is reduced in slices, which chunks
of the parameter vector each slice holds, who reduces a slice when, and which slice a
peer checks.

Theory of operation. A fused round's mean is cut into slices, runs of whole chunks of
the chunked delta format (``TTD2``), so an aggregator downloads only its slice's bytes
of every contribution. Nothing here is a claim record: everything is a function of the
cover (who contributed) and of how long this observer has seen the round covered, so
peers agree without a message, as the closer does. Slice ``s`` goes first to the
``s``-th author of the cover; a slice without a result a lease later passes to the next
author in an order drawn from the job, round and slice, so a peer that claims its slice
by being in the cover and then never publishes costs one lease. Every peer recomputes
one slice a round (``spot_check``), drawn so that over the peers every slice is checked.

What it promises: the same inputs give every peer the same plan (I1 for the close);
slices cover every chunk exactly once; no author's turn comes twice before every author
has had one. What breaks it: callers passing authors in different orders (they are
sorted here) or a cover that is not the round's canonical one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

SLICES_FROM = 3  # contributions: below this, every peer downloads every delta (fewer bytes)


def sliced(contribs: int, chunks: int) -> bool:
    """Whether a round with ``contribs`` contributions of ``chunks`` chunks each is
    reduced in slices. In units of one delta d per peer per round, all deltas cost
    1 + (N-1); slices sent re-quantized cost (1 + 1/N) + 2(N-1)/N: all deltas are
    cheaper at N = 2 (2 against 2.5), slices from N = 3 (2.67 against 3). A model of one
    chunk has nothing to cut."""
    return contribs >= SLICES_FROM and chunks >= 2


def slice_chunks(chunks: int, slices: int) -> list[tuple[int, int]]:
    """``chunks`` cut into ``min(slices, chunks)`` runs ``[first, stop)``, in order,
    sizes differing by at most one (the larger first). Raises ValueError for a count
    below 1."""
    if chunks < 1 or slices < 1:
        raise ValueError(f"need at least one chunk and one slice, got {chunks} and {slices}")
    n = min(slices, chunks)
    size, extra = divmod(chunks, n)
    out, first = [], 0
    for s in range(n):
        stop = first + size + (1 if s < extra else 0)
        out.append((first, stop))
        first = stop
    return out


def aggregators(job: str, rnd: int, authors: Sequence[str], s: int) -> list[str]:
    """Who reduces slice ``s`` of round ``rnd``, in turn: the ``s``-th of the cover's
    authors (sorted, each once; slices beyond the count wrap), then the others in an
    order drawn from the job, round and slice. Raises ValueError for no authors."""
    names = sorted(set(authors))
    if not names:
        raise ValueError("a slice needs at least one author to reduce it")
    first = names[s % len(names)]
    rest = sorted((a for a in names if a != first),
                  key=lambda a: hashlib.sha256(f"{job}:{rnd}:{s}:{a}".encode()).digest())
    return [first, *rest]


def turn(order: Sequence[str], covered_for: float, lease: float) -> int:
    """How many of ``order`` have had their turn at a slice once the round has been
    covered for ``covered_for`` seconds (on this observer's clock): one lease each; after
    the last, the turns start over (a result lost on the way is made again)."""
    if lease <= 0:
        raise ValueError(f"lease must be positive, got {lease}")
    return int(max(0.0, covered_for) // lease) % len(order)


def reducer(job: str, rnd: int, authors: Sequence[str], s: int, covered_for: float, lease: float) -> str:
    """The author whose turn it is to reduce slice ``s`` now (``aggregators`` and ``turn``)."""
    order = aggregators(job, rnd, authors, s)
    return order[turn(order, covered_for, lease)]


def spot_check(job: str, rnd: int, me: str, authors: Sequence[str], slices: int) -> int:
    """The slice ``me`` recomputes in round ``rnd`` to check another's result: an
    author of the cover checks the slice after its own (so the slices are all checked
    when there are at least as many authors as slices), any other peer one drawn from
    the job, round and its name."""
    if slices < 1:
        raise ValueError(f"need at least one slice, got {slices}")
    names = sorted(set(authors))
    if me in names:
        return (names.index(me) + 1) % slices
    return int.from_bytes(hashlib.sha256(f"{job}:{rnd}:{me}".encode()).digest()[:8], "big") % slices
