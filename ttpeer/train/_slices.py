"""Aggregation slices, the tensor part: reduce one slice of a round's mean from the
contributions' chunked bytes, send it re-quantized, and put the slices back together as
the mean the outer step takes.

A slice is a run of whole chunks of the ``TTD2`` format (``_compress``), so an
aggregator needs only its slice's bytes of each contribution (``ChunkIndex.span``). The
reduction is ``OuterSum``'s, position by position: ``((0 + d0*w0) + d1*w1) + ...`` in the
contributions' order with the same fp32 weights, so a slice of the mean is the same bits
as that slice of the mean of all deltas. The result is sent re-quantized with the delta's
block to the job's ``slice_bits``, 3 as ``ttpeer submit`` writes it (8 for a job that does
not say), without error feedback: ``scripts/bench/requantize`` measured 0.989x-0.994x test
loss at 3 bits, 0.996x-1.002x at 4 and 1.000x-1.003x at 8 (mnist1d at 8 peers, charlm at
16), feedback on the mean bought nothing, and 3 bits cost 0.31x the bytes of 8 (4: 0.45x;
2 bits, measured once outside the bench, lost 3-11%); chunks start on block
boundaries, so the slices' blocks are the blocks of the whole mean, and every peer that
reduces a slice gets the same bytes: a result is checked by recomputing it and comparing
hashes. ``mean_sum`` then holds the slices' mean as an ``OuterSum`` of one contribution of
weight one, whose ``step`` is the same arithmetic as the all-deltas outer step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor

from ._compress import ChunkIndex, decode_chunks, decode_delta, quantize
from ._errors import DeltaError
from ._outer import OuterSum, mean_weights
from ._state import OuterState


def reduce_slice(parts: Sequence[tuple[ChunkIndex, bytes | bytearray | memoryview]], samples: Sequence[int],
                 first: int, stop: int) -> Tensor:
    """The sample-weighted mean of chunks ``first .. stop-1`` over the contributions, in
    list order: ``parts`` are each contribution's checked index and the bytes at
    ``index.span(first, stop)``, ``samples`` their sample counts. Raises DeltaError if
    the contributions do not share one layout (values, chunk, block) or their bytes are
    malformed, ValueError for counts ``OuterSum`` refuses or a count that is not the
    parts'."""
    if len(parts) != len(samples) or not parts:
        raise ValueError(f"{len(parts)} contributions for {len(samples)} sample counts")
    if any(s < 0 for s in samples) or sum(samples) <= 0:
        raise ValueError(f"sample counts must be >= 0 with a positive total, got {list(samples)}")
    layout = {(i.numel, i.chunk, i.block) for i, _b in parts}
    if len(layout) != 1:
        raise DeltaError(f"the contributions are not cut alike (values, chunk, block): {sorted(layout)}")
    begin, end = parts[0][0].values(first, stop)
    total = torch.zeros(end - begin, dtype=torch.float32)
    for (index, data), weight in zip(parts, mean_weights(samples), strict=True):
        total.add_(decode_chunks(index, data, first, stop) * weight)
    return total


def encode_slice(mean: Tensor, *, bits: int = 8, block: int = 256) -> bytes:
    """A reduced slice as bytes: ``bits`` (the job's ``slice_bits``) with the
    contributions' block, no error feedback (deterministic: the same slice gives the same
    bytes everywhere). Raises ValueError for bits or a block ``quantize`` refuses."""
    return quantize(mean, bits=bits, block=block)


def decode_slice(data: bytes | bytearray | memoryview, count: int) -> Tensor:
    """A reduced slice of ``count`` values from its bytes. Raises DeltaError if they are
    malformed, hold another count, or decode to NaN or inf."""
    like = OuterState(params={"v": torch.empty(count, device="meta")}, momentum={})
    return decode_delta(data, like)["v"]


def iter_mean(slices: Iterable[Tensor], like: OuterState) -> Iterator[tuple[str, Tensor]]:
    """The round's mean tensor by tensor (sorted names, as ``iter_delta``), from its slices
    in order, each decoded only when reached. Raises DeltaError if the slices hold fewer
    or more values than the model."""
    pending = iter(slices)
    current, offset = torch.empty(0), 0
    for name in sorted(like.params):
        shape = like.params[name].shape
        need = like.params[name].numel()
        pieces = []
        while need:
            if offset == current.numel():
                following = next(pending, None)
                if following is None:
                    raise DeltaError("the slices hold fewer values than the model")
                current, offset = following, 0
                continue
            take = min(need, current.numel() - offset)
            pieces.append(current[offset:offset + take])
            offset, need = offset + take, need - take
        yield name, (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).reshape(shape)
    if offset != current.numel() or next(pending, None) is not None:
        raise DeltaError("the slices hold more values than the model")


def mean_sum(like: OuterState, slices: Iterable[Tensor]) -> OuterSum:
    """The slices' mean (in slice order) as a running sum of one contribution, ready for its
    outer ``step``. Raises ``DeltaError`` for slices that do not hold the model's values."""
    total = OuterSum(like, [1])
    total.add_parts(iter_mean(slices, like))
    return total
