"""Aggregation slices, the pure part: whether a round is reduced in slices, which chunks
of the parameter vector each slice holds, who reduces a slice when, and which slices are
checked.

Theory of operation. A fused round's mean is cut into slices, runs of whole chunks of
the chunked delta format (``TTD2``), so an aggregator downloads only its slice's bytes
of every contribution. Nothing here is a claim record: everything is a function of the
cover (who contributed) and of how long this observer has seen the round covered, so
peers agree without a message, as the closer does. Slice ``s`` goes first to the
``s``-th author of the cover; a slice without a result a lease later passes to the next
author in an order drawn from the job, round and slice, so a peer that claims its slice
by being in the cover and then never publishes costs one lease. One slice in
``CHECK_ONE_IN`` a round is checked (``checked``): its result counts once a second peer
reproduced its hash (``_slicer``).

What it promises: the same inputs give every peer the same plan (I1 for the close);
slices cover every chunk exactly once; no author's turn comes twice before every author
has had one. What breaks it: callers passing authors in different orders (they are
sorted here) or a cover that is not the round's canonical one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from ttpeer_wire import Record

from ._jobspec import JobSpec

CHECK_ONE_IN = 4  # one slice in this many is spot-checked each round (``checked``)
SLICES_FROM = 3  # contributions: below this, every peer downloads every delta (fewer bytes)
SLOW_LINK = 3.0  # an author whose delta went up this many times slower than the median reduces last
SLOW_MIN_S = 2.0  # ... if that upload took this long: a short one says little, and costs the round little


def sliced(contribs: int, chunks: int) -> bool:
    """Whether a round with ``contribs`` contributions of ``chunks`` chunks each is
    reduced in slices. In units of one delta d per peer per round, with the reduced
    model r deltas on the wire, all deltas cost 1 + (N-1); slices cost
    (1 + r/N) + (N-1)(1 + r)/N. At N = 2 that is 2 against 1.5 + r (r = 1 at 8 bits,
    about 0.5 at 4, 0.3 at 3): no fewer bytes worth the reduction's extra upload and download on
    the round's path, so all deltas; from N = 3 slices (3 against 2.67 at 8 bits). A
    model of one chunk has nothing to cut."""
    return contribs >= SLICES_FROM and chunks >= 2


def worth_slicing(job: JobSpec, cover: Sequence[Record], slices: int) -> bool:
    """Whether a round covered by ``cover`` saves each peer the job's ``slice_min`` bytes or
    more when reduced in ``slices`` slices (always, for a job that names none; ``pays``).
    The delta's size is the cover's lower median (no single contribution moves it). A
    reduction adds round trips on the sync's path (a slice's fetches, its PUT and record,
    the reduced slices' fetches): for a small model they cost more than the bytes they save,
    so its rounds close from all deltas."""
    if job.slice_min is None:
        return True
    sizes = sorted(c["size"] for c in cover)
    delta = sizes[(len(sizes) - 1) // 2]
    authors = len({c.author for c in cover})
    return pays(authors, slices, delta, job.slice_bits, job.bits, job.slice_min)


def pays(peers: int, slices: int, delta: int, slice_bits: int, bits: int, least: int) -> bool:
    """Whether ``slices`` slices save each of ``peers`` peers ``least`` bytes or more of
    download a round: from all deltas a peer downloads the other ``peers - 1``, sliced its
    ``1/slices`` of them and the other ``slices - 1`` reduced slices (the checks' share, a
    chunk now and then, left out), so the saving is ``(peers - 1) d (1 - 1/slices) -
    (slices - 1) r / slices``. The reduced model ``r`` is estimated as ``min(slice_bits,
    bits) / bits`` of a delta of ``d`` = ``delta`` bytes (measured: 0.67x a 4-bit delta at 3
    bits; 1.3x-2x an 8-bit delta at 8, where the estimate makes slices look a little better
    than they are). Compared in whole numbers (both sides times ``slices x bits``), so every
    peer and every implementation draws the line alike (``worth_slicing``'s rule; ``ttpeer
    advise`` asks it of a job not yet run)."""
    if slices < 1 or bits < 1:
        raise ValueError(f"need at least one slice and one bit, got {slices} and {bits}")
    saved = (peers - 1) * delta * (slices - 1) * bits - (slices - 1) * delta * min(slice_bits, bits)
    return saved >= least * slices * bits


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


def aggregators(job: str, rnd: int, authors: Sequence[str], s: int,
                slow: frozenset[str] = frozenset()) -> list[str]:
    """Who reduces slice ``s`` of round ``rnd``, in turn: the ``s``-th of the cover's
    authors not on a ``slow`` link (``slow_authors``; sorted, each once; slices beyond
    the count wrap), then the other such authors in an order drawn from the job, round and
    slice, then the slow ones in such an order. Raises ValueError for no authors."""
    names = sorted(set(authors))
    if not names:
        raise ValueError("a slice needs at least one author to reduce it")
    fast = [a for a in names if a not in slow] or names
    first = fast[s % len(fast)]

    def drawn(group: Sequence[str]) -> list[str]:
        return sorted((a for a in group if a != first),
                      key=lambda a: hashlib.sha256(f"{job}:{rnd}:{s}:{a}".encode()).digest())

    return [first, *drawn(fast), *drawn([a for a in names if a not in fast])]


def slow_authors(cover: Sequence[Record]) -> frozenset[str]:
    """The cover's authors whose link is too slow to hold a slice first: those whose
    contribution went up (``up_s``, its encoding and upload, for ``size`` bytes) more than
    ``SLOW_LINK`` times slower than the (lower) median author's, and took ``SLOW_MIN_S`` or
    more. An author's figure is its fastest contribution's; an author without one is not
    slow.

    A reducer downloads its slice of every other delta and uploads the result on the
    round's critical path: a laptop on home Wi-Fi among wired machines would gate every
    round it holds a slice of. The floor keeps noise out: an upload of a fraction of a
    second (a small model, a fast link, a loaded machine's scheduling) says little of the
    link, and a reduction about as short gates nothing. At least half the authors with a
    figure are at or above the lower median, so three or more authors always leave two or
    more to reduce, and an author that claims an absurdly fast upload moves the median one
    place at most. The figures are in the signed records, so every peer finds the same set.
    Only a job that names ``slice_bits`` applies it (``slow_of``): a peer of a version
    before it drops such a job (the field is unknown to it), while an older job's rounds
    are cut as every version cuts them."""
    rates = upload_rates(cover)
    median = median_rate(rates)
    return frozenset(a for a, figure in rates.items() if median is not None and _slow(figure, median))


def _slow(figure: tuple[float, float], median: float) -> bool:
    rate, took = figure
    return rate * SLOW_LINK < median and took >= SLOW_MIN_S


def upload_rates(cover: Sequence[Record]) -> dict[str, tuple[float, float]]:
    """Each author's fastest contribution in ``cover`` by ``up_s``: (bytes a second, the
    seconds it took). Authors without the figure are left out."""
    out: dict[str, tuple[float, float]] = {}
    for c in cover:
        up = c["metrics"].get("up_s")
        if isinstance(up, (int, float)) and up > 0 and c["size"] / up > out.get(c.author, (0.0, 0.0))[0]:
            out[c.author] = (c["size"] / up, float(up))
    return out


def median_rate(rates: dict[str, tuple[float, float]]) -> float | None:
    """The lower median of ``upload_rates``' rates (no single fast claim moves it), or None
    below two figures."""
    if len(rates) < 2:
        return None
    return sorted(r for r, _took in rates.values())[(len(rates) - 1) // 2]


def turn(order: Sequence[str], covered_for: float, lease: float) -> int:
    """How many of ``order`` have had their turn at a slice once the round has been
    covered for ``covered_for`` seconds (on this observer's clock): one lease each; after
    the last, the turns start over (a result lost on the way is made again)."""
    if lease <= 0:
        raise ValueError(f"lease must be positive, got {lease}")
    return int(max(0.0, covered_for) // lease) % len(order)


def checked(job: str, rnd: int, s: int, one_in: int | None = None) -> bool:
    """Whether slice ``s`` of round ``rnd`` is spot-checked: its result counts only once a
    second peer has recomputed it to the same hash. One slice in ``one_in`` (default
    ``CHECK_ONE_IN``), drawn from the job, round and slice (so every peer draws the same);
    one in 1 checks them all."""
    one_in = CHECK_ONE_IN if one_in is None else one_in
    if one_in < 1:
        raise ValueError(f"one_in must be at least 1, got {one_in}")
    return int.from_bytes(hashlib.sha256(f"{job}:{rnd}:{s}:check".encode()).digest()[:8], "big") % one_in == 0


def counts(job: str, rnd: int, s: int, sha: str, makers: dict[str, set[str]]) -> bool:
    """Whether a result hashing ``sha`` counts for slice ``s``, given who signed each hash
    the slice has (``makers``: hash -> authors): when two or more authors signed it; or
    as the slice's only hash, when the slice is not checked this round (``checked``).
    The ledger (a close's validity) and the slicer (what a close names) share this rule."""
    authors = makers.get(sha, set())
    return len(authors) >= 2 or (len(makers) == 1 and bool(authors) and not checked(job, rnd, s))


def slice_bound(values: int, bits: int = 8) -> int:
    """The most bytes a reduced slice of ``values`` values in ``bits`` may take (the packed
    values (two to a byte below 8 bits), 4-byte block scales, zstd's worst case, the
    header): larger is refused unread."""
    return -(-values * (8 if bits == 8 else 4) // 8) + values // 32 + 4096


def plan(job: JobSpec, cover: Sequence[Record]) -> list[tuple[int, int]] | None:
    """The slices (runs of chunks ``[first, stop)``) of a round covered by ``cover``, or
    None when it is closed from all deltas: a job without ``chunk``, contributions that do
    not all name one chunk count, fewer than ``SLICES_FROM`` authors, one chunk, or slices
    that would save each peer less than the job's ``slice_min`` bytes (``worth_slicing``)."""
    if job.chunk is None or not job.mode.sliced or not cover:
        return None
    counts = {c.body.get("chunks") for c in cover}
    if len(counts) != 1:
        return None
    (chunks,) = counts
    authors = {c.author for c in cover}
    if not isinstance(chunks, int) or not sliced(len(authors), chunks):
        return None
    spans = slice_chunks(chunks, len(authors - slow_of(job, cover)))
    return spans if worth_slicing(job, cover, len(spans)) else None


def slow_link_of(job: JobSpec, cover: Sequence[Record], author: str) -> tuple[float, float] | None:
    """``author``'s upload rate and the cover's (lower) median rate, in bytes a second,
    when the job's rule (``slow_of``) found it slow in this cover; else None. What
    ``ttpeer status`` tells the peer that reduces no slices first."""
    if not job.slow_links:
        return None
    rates = upload_rates(cover)
    median, mine = median_rate(rates), rates.get(author)
    if median is None or mine is None or not _slow(mine, median):
        return None
    return mine[0], median


def slow_of(job: JobSpec, cover: Sequence[Record]) -> frozenset[str]:
    """``slow_authors`` for a job that applies the rule (``JobSpec.slow_links``), else none."""
    return slow_authors(cover) if job.slow_links else frozenset()


def fits(rec: Record, job: JobSpec, rnd: int, base: str, ids: list[str], s: int, span: tuple[int, int],
         of: int) -> bool:
    """Whether ``rec`` is a result of slice ``s`` (chunks ``span``, one of ``of``) of the
    round ``rnd`` on ``base`` closed from ``ids``, of a size a slice can have."""
    b = rec.body
    assert job.chunk is not None
    return (rec.kind == "slice" and b["job"] == job.id and b["round"] == rnd and b["base"] == base
            and b["contribs"] == ids and b["slice"] == s and b["of"] == of and (b["first"], b["stop"]) == span
            and b["size"] <= slice_bound((span[1] - span[0]) * job.chunk, job.slice_bits))
