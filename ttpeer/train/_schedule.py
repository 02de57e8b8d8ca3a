"""The shared data schedule: which samples each shard of each round trains on.

Every peer computes the same schedule from ``(n_train, seed)`` alone, with no
messages. The training set is read as an endless stream of epochs; epoch ``e``
is a permutation of ``range(n_train)``. Global shard ``g = round *
shards_per_round + shard`` takes stream positions ``[g*B*H, (g+1)*B*H)`` (B =
batch size, H = batches per shard), so shards of one epoch never overlap and
every sample is seen once per epoch.

Permutations must not depend on the torch or numpy version (their shuffles
have changed between releases), so they are defined here: sample ``i`` of
epoch ``e`` gets the key ``splitmix64(s + (i + 1) * GAMMA)`` with ``s = (seed *
1_000_003 + e) mod 2**64``, i.e. the ``i``-th output of a SplitMix64 stream
seeded with ``s``; the epoch's order is the samples sorted by key, ties by index.
Only exact 64-bit integer arithmetic is involved.

A dataset read by pieces (``dataset_samples``) has its own order, ``piece_shard_indices``,
so that a shard reads few pieces: epoch ``e`` lays the pieces out in a permutation of the
pieces (the same rule over the piece count, in a stream of its own), each piece's samples
in their order, and a shard takes its positions of that stream as above, then shuffles
them (a permutation keyed by the shard's first position). A shard of ``S`` samples then
reads about ``S / samples per piece + 1`` pieces, and every sample is still seen once per
epoch; batches mix samples of the pieces a shard covers, not of the whole dataset.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

_MASK = (1 << 64) - 1
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


def shard_indices(n_train: int, seed: int, round: int, shard: int, shards_per_round: int,
                  batches_per_shard: int, batch_size: int, *, first_step: int | None = None) -> list[list[int]]:
    """Return the batches (lists of sample indices) of ``shard`` in ``round``.

    Pure and deterministic: the same arguments give the same batches on every
    machine. A shard larger than an epoch simply runs into the next epoch.
    Raises ValueError for sizes < 1, negative seed/round, or a shard number
    outside ``[0, shards_per_round)``.
    """
    _check(n_train, seed, round, shard, shards_per_round, batches_per_shard, batch_size)

    per_shard = batch_size * batches_per_shard
    # Rounds before this one drew ``first_step`` batches for each of the shards (an
    # auto-cadence job's rounds differ in size; by default every round has this one's).
    first = round * batches_per_shard if first_step is None else first_step
    start = (first * shards_per_round + shard * batches_per_shard) * batch_size
    stop = start + per_shard
    picked: list[int] = []
    position = start
    while position < stop:
        epoch, offset = divmod(position, n_train)
        take = min(n_train - offset, stop - position)
        picked.extend(_epoch_order(n_train, seed, epoch)[offset:offset + take].tolist())
        position += take
    return [picked[b * batch_size:(b + 1) * batch_size] for b in range(batches_per_shard)]


_PIECE_STREAM = 0x7069656365  # "piece": the piece order's stream, apart from any sample order


def piece_shard_indices(counts: list[int], seed: int, round: int, shard: int, shards_per_round: int,
                        batches_per_shard: int, batch_size: int, *, first_step: int | None = None) -> list[list[int]]:
    """The batches of ``shard`` in ``round`` over samples laid out in pieces: ``counts[k]``
    samples in piece ``k``, numbered in piece order. Pure, like ``shard_indices``."""
    n = sum(counts)
    _check(n, seed, round, shard, shards_per_round, batches_per_shard, batch_size)
    first = round * batches_per_shard if first_step is None else first_step
    start = (first * shards_per_round + shard * batches_per_shard) * batch_size
    stop = start + batch_size * batches_per_shard
    parts: list[np.ndarray] = []
    position = start
    while position < stop:
        epoch, offset = divmod(position, n)
        take = min(n - offset, stop - position)
        parts.append(_piece_epoch_slice(counts, seed, epoch, offset, offset + take))
        position += take
    picked = np.concatenate(parts)
    mix = _epoch_order(len(picked), seed ^ _PIECE_STREAM, start)
    picked = picked[mix].tolist()
    return [picked[b * batch_size:(b + 1) * batch_size] for b in range(batches_per_shard)]


def _piece_epoch_slice(counts: list[int], seed: int, epoch: int, lo: int, hi: int) -> np.ndarray:
    """Positions ``[lo, hi)`` of epoch ``epoch``: the pieces in their permuted order, each
    piece's samples in order. Only the pieces the span touches are laid out."""
    order = _epoch_order(len(counts), (seed + _PIECE_STREAM) & _MASK, epoch)
    sizes = np.asarray(counts, dtype=np.int64)
    firsts = np.concatenate([[0], np.cumsum(sizes)])  # each piece's first sample
    ends = np.cumsum(sizes[order])  # where each slot of the epoch ends
    out: list[np.ndarray] = []
    slot = int(np.searchsorted(ends, lo, side="right"))
    while lo < hi:
        piece = int(order[slot])
        begin = int(ends[slot]) - counts[piece]  # the epoch position where this piece starts
        a, b = lo - begin, min(hi, int(ends[slot])) - begin
        out.append(np.arange(firsts[piece] + a, firsts[piece] + b, dtype=np.int64))
        lo, slot = begin + b, slot + 1
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def _check(n_train: int, seed: int, round: int, shard: int, shards_per_round: int, batches_per_shard: int,
           batch_size: int) -> None:
    for name, value in (("n_train (samples)", n_train), ("shards_per_round", shards_per_round),
                        ("batches_per_shard", batches_per_shard), ("batch_size", batch_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if seed < 0 or round < 0:
        raise ValueError(f"seed and round must be >= 0, got seed={seed}, round={round}")
    if not 0 <= shard < shards_per_round:
        raise ValueError(f"shard must be in [0, {shards_per_round}), got {shard}")


@lru_cache(maxsize=4)
def _epoch_order(n_train: int, seed: int, epoch: int) -> np.ndarray:
    # Cached because consecutive shards of a run fall in the same epoch.
    stream_seed = np.uint64((seed * 1_000_003 + epoch) & _MASK)
    counters = np.arange(1, n_train + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):  # wrap-around is the intended arithmetic
        keys = _splitmix_mix(stream_seed + counters * _GAMMA)
    order = np.argsort(keys, kind="stable")
    order.setflags(write=False)
    return order


def _splitmix_mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _MUL1
    z = (z ^ (z >> np.uint64(27))) * _MUL2
    return z ^ (z >> np.uint64(31))
